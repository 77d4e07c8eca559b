"""Reading a local store's files (:class:`LocalReads`, a part of
:class:`~ckpt_store.storage.backends.local.LocalBackend`): regular files only (a FIFO or a device in
an object's place is refused, never waited on or read forever), read straight into the caller's
buffer with its pages faulted in first (:func:`populate`), and prefetched into the page cache."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import stat
import sys
from collections.abc import Callable

from ckpt_store.storage.backends.base import read_error, too_large
from ckpt_store.storage.errors import StorageIOError

# madvise(2) advice (Linux 5.14): fault a range's pages in, writable, in one call
MADV_POPULATE_WRITE = 23
POPULATE_MIN = 64 << 10  # smaller reads: a few faults cost less than the call
_PAGE = mmap.PAGESIZE


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library on Linux (None elsewhere: other systems number their advice apart)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@functools.cache
def _libc_function(name: str, *argtypes: type) -> Callable[..., int] | None:
    """libc's ``name`` on Linux, taking ``argtypes`` and returning an int (None elsewhere)."""
    f = getattr(_libc(), name, None)
    if f is None:
        return None
    f.argtypes = argtypes
    f.restype = ctypes.c_int
    return f  # type: ignore[no-any-return]


def _madvise() -> Callable[[int, int, int], int] | None:
    return _libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _mincore() -> Callable[[int, int, object], int] | None:
    return _libc_function("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _all_resident(lo: int, n: int) -> bool:
    """Whether every page of the ``n`` bytes at page-aligned ``lo`` is in memory (mincore(2): a walk of
    the page table that faults nothing, one byte per page; False where it cannot tell)."""
    f = _mincore()
    if f is None:
        return False
    vec = ctypes.create_string_buffer(n // _PAGE)
    if f(lo, n, vec) != 0:
        return False
    return b"\0" not in vec.raw  # (a page out of memory has its low bit clear: 0 here, as Linux sets no other bit)


def populate(buf: memoryview) -> None:
    """Fault the pages of ``buf`` in, before a read writes them, in one call.

    A read into memory never touched (a restore's fresh optimizer moments) otherwise takes
    one page fault per 4 KiB page in the middle of the kernel's copy, each an exception and
    a return: the fault work done here in one pass costs less (a 1.2 GB GPT + AdamW restored
    from a local tier in /dev/shm: 0.98 -> 0.89 CPU-s). Memory already in place (a model's
    parameters, a buffer reused read after read) is left alone: the advice would take each of
    its pages through the kernel's page lookup again (measured: ~4 ms per 32 MiB, 0.3 s of a
    1.2 GB peer transfer's reads into its two reused send buffers), where a residency check
    (mincore) costs a tenth of that. Best effort: where the advice is unknown (kernels before
    5.14, other systems) or refused (a mapping it does not apply to), the read faults the pages itself."""
    f = _madvise()
    if f is None or buf.nbytes < POPULATE_MIN or buf.readonly:
        return
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):  # not a buffer ctypes can address
        return
    lo, hi = -(-start // _PAGE) * _PAGE, (start + buf.nbytes) // _PAGE * _PAGE  # whole pages only
    if hi > lo and not _all_resident(lo, hi - lo):
        f(lo, hi - lo, MADV_POPULATE_WRITE)


# read_into's reads for a caller that takes each part (hashes it): a block stays in the core's
# L2 cache between the copy that writes it and the hash that reads it (a 1.2 GB GPT + AdamW
# restored from a local tier in /dev/shm, 4 MiB chunks: 0.79 -> 0.73 CPU-s at 256 KiB)
READ_BLOCK = 256 << 10


class LocalReads:
    """The reads of :class:`~ckpt_store.storage.backends.local.LocalBackend`, which it is mixed into
    (through its paths, ``_p``)."""

    reads_into = True
    prefetches = hasattr(os, "posix_fadvise")

    def read(self, path: str, limit: int | None = None) -> bytes:
        fd = self._open_read(path)
        try:
            with open(fd, "rb") as f:
                if limit is not None and (size := os.fstat(fd).st_size) > limit:
                    raise too_large(path, size, limit)
                return f.read()
        except OSError as e:
            raise read_error(path, e) from e

    def _open_read(self, path: str) -> int:
        """A descriptor of the regular file at ``path``. Anything else a store folder may hold there
        (a FIFO, or a symlink to a device such as /dev/zero) is refused: opening a FIFO waits for
        a writer forever, and reading a device never ends."""
        try:
            fd = os.open(self._p(path), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once: fstat tells
        except OSError as e:
            raise read_error(path, e) from e
        try:
            mode = os.fstat(fd).st_mode
        except OSError as e:
            os.close(fd)
            raise read_error(path, e) from e
        if not stat.S_ISREG(mode):
            os.close(fd)
            # A folder where an object should be (a damaged or crafted store folder) is refused like a
            # FIFO: an IsADirectoryError escaped every command that read it as a traceback.
            what = "a folder" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
            raise StorageIOError(f"cannot read {path}: not a regular file ({what} in the store folder)",
                                 hint="remove it from the store folder")
        return fd

    def read_range(self, path: str, start: int, length: int) -> bytes:
        fd = self._open_read(path)
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)


    def prefetch(self, path: str) -> None:
        # The kernel starts reading the file into the page cache and returns at once, so
        # one thread can keep many reads in flight (a queue deep enough for an SSD or a
        # network disk) without a thread per read.
        try:
            fd = self._open_read(path)
        except (OSError, StorageIOError):
            return  # a missing or unreadable chunk is reported by the read itself
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def read_into(self, path: str, start: int, buf: memoryview, each: Callable[[memoryview], object] | None = None) -> int:
        fd = self._open_read(path)
        try:
            size = os.fstat(fd).st_size
            pos, end = 0, min(len(buf), max(0, size - start))
            populate(buf[:end])
            block = end if each is None else READ_BLOCK
            while pos < end:
                n = os.preadv(fd, [buf[pos : min(end, pos + block)]], start + pos)
                if n == 0:  # the file shrank under us: the caller's length check sees it
                    break
                if each is not None:
                    each(buf[pos : pos + n])
                pos += n
            return size
        except OSError as e:
            raise read_error(path, e) from e
        finally:
            os.close(fd)
