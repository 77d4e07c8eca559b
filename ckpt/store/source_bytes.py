"""Where push reads a tensor's bytes from (:class:`ByteSource`): a regular file read with ``pread``
and checked unchanged at the end, under a read lease where it is memory-mapped (:class:`FileBytes`),
or memory already there (:class:`MemBytes`). :mod:`ckpt.store.sources` builds sources on them."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
from collections.abc import Callable
from typing import Protocol

from ckpt.errors import InvalidSourceError
from ckpt.store.source_files import open_regular


class ByteSource(Protocol):
    def read(self, offset: int, length: int) -> bytes | memoryview: ...


class FileBytes:
    """A regular file read with ``pread`` from any number of threads at once.

    ``fd``: an already opened descriptor (see :func:`open_regular`, :func:`open_under`)."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        self.path = path
        self.fd = open_regular(path) if fd is None else fd
        self._stamp = _stamp(os.fstat(self.fd))
        self._leased = False

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise InvalidSourceError(self.path, "file shrank while it was being pushed")
        return data

    def check_unchanged(self) -> None:
        """Raise :class:`InvalidSourceError` if the file was written since it was opened: bytes read
        before and after a write in place (same size, as a writer rewriting it does) would make a
        checkpoint of a file that never existed."""
        self.check_lease()
        if _stamp(os.fstat(self.fd)) != self._stamp:
            raise InvalidSourceError(self.path, "file changed while it was being pushed",
                                     hint="push it again once whatever writes it is done")

    def lease(self) -> bool:
        """Take a read lease on the file (Linux), for reading it through a memory mapping: a
        mapped file that another process truncates kills the reader with SIGBUS. While the
        lease is held, a process that opens the file for writing (``torch.save`` over it, say)
        waits, and :meth:`check_lease` says so at once; the push stops, lets go, and the writer
        goes on. Unanswered, the kernel lets the writer go after ``/proc/sys/fs/lease-break-time``
        (45 s by default); :meth:`check_lease` then still refuses before another byte is read.

        False where the file cannot be leased (another user's file, a filesystem without
        leases, not Linux). Raises :class:`InvalidSourceError` where a process has it open
        for writing now."""
        if not hasattr(fcntl, "F_SETLEASE") or not hasattr(signal, "SIGURG"):
            return False
        try:
            # The break is signalled to this process: SIGIO by default, whose default action kills
            # it. SIGURG's is to ignore it; check_lease asks the kernel instead.
            fcntl.fcntl(self.fd, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as e:
            if e.errno == errno.EAGAIN:
                raise InvalidSourceError(self.path, "is open for writing by another process",
                                         hint="push it once it is written (a training job saving it?)") from None
            return False
        self._leased = True
        return True

    def check_lease(self) -> None:
        """Raise :class:`InvalidSourceError` once a writer has asked for the leased file."""
        if self._leased and fcntl.fcntl(self.fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK:
            raise InvalidSourceError(self.path, "another process opened it for writing while it was being pushed",
                                     hint="push it again once whatever writes it is done")

    @property
    def leased(self) -> bool:
        """Whether this file is read under a lease (:meth:`lease`): a writer waits while it is open."""
        return self._leased

    def close(self) -> None:
        if self.fd >= 0:  # closing twice would close whatever reused the number
            os.close(self.fd)
            self.fd = -1


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


class MemBytes:
    def __init__(self, view: memoryview, keepalive: object = None) -> None:
        self.view = view
        self._keepalive = keepalive
        # For memory that maps a file: raises once the file may change under the mapping.
        self.guard: Callable[[], None] | None = None

    def read(self, offset: int, length: int) -> memoryview:
        if self.guard is not None:
            self.guard()
        return self.view[offset : offset + length]


