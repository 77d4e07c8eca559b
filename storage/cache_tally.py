"""The running total of the chunk cache's bytes (storage/cache.py), shared by every process that puts
into one cache root: a file ``<root>/.ckpt-cache-tally`` holding two little-endian signed 64-bit fields
(the bytes in the cache; the bytes ever added, which a walk needs), changed under an exclusive ``flock``
by each put and each eviction. Only a regular file of 0 or 16 bytes by that name is used (never
followed through a link), and only while its values are in range: the cache root may hold other
programs' files (``CKPT_CACHE_DIR=~/.cache``), and none of them is ever written. A put then knows the cache's size, other processes'
entries included, without walking the cache (a walk stats every entry: 0.3-0.4 s at 50,000 entries
here, and near the limit it walked every hundredth of it put, as long as the pull took to put it).

The tally is an estimate that walks correct: a process killed between writing an entry and adding it,
a ``ckpt cache clear``, a file deleted by hand leave it off, and the next walk (a process's first put,
an eviction) sets it to what the walk found plus what was put meanwhile. Where the file cannot be
opened or locked (a read-only folder, a filesystem without ``flock``, a file of that name that is not
the tally), :meth:`CacheTally.add` returns None and the cache walks as it did before; each walk tries
the file again.

One process evicts at a time (:meth:`CacheTally.evicting`, a ``flock`` on ``<root>/.ckpt-cache-evicting``):
processes that all read one tally past the limit each evicted a tenth of the cache at once.

>>> import tempfile
>>> t = CacheTally(tempfile.mkdtemp())
>>> t.add(100), t.add(-30)
(100, 70)
>>> before = t.before_walk()
>>> t.add(5), t.walked(60, before)  # the walk found 60 bytes; 5 were put meanwhile
(75, 65)
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# (Names outside the cache's layout, storage/cache_files.py: usage and clear neither count nor delete them.)
TALLY = ".ckpt-cache-tally"
EVICTING = ".ckpt-cache-evicting"
FILES = (TALLY, EVICTING)
EVICT_WAIT_S = 60.0  # how long a put that found the disk full waits for another process's eviction
_FIELDS = struct.Struct("<qq")  # bytes in the cache; bytes ever added (what a walk adds to what it found)
_MAX = 1 << 62  # past this a field is not a count of bytes (and near 2**63 sums would not fit its 64 bits)


def _open_own(path: str) -> int:
    """A descriptor of the regular file at ``path`` (made if absent) of 0 or ``_FIELDS.size`` bytes;
    OSError for anything else there (a link, a folder, a FIFO, another program's file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size not in (0, _FIELDS.size):
            raise OSError(f"{path} is not a file of this cache: not used")
    except BaseException:
        os.close(fd)
        raise
    return fd


class CacheTally:
    """The shared byte count of the cache at ``root`` (see the module's docstring)."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, TALLY)
        self._fd: int | None = None
        self._evict_fd: int | None = None
        self._broken = False  # the file could not be used: the cache walks instead
        self._lock = threading.Lock()  # (a flock is one per open file: it does not keep this process's threads apart)

    def _change(self, change: Callable[[int, int], tuple[int, int]], retry: bool = False) -> tuple[int, int] | None:
        """(total, walks) after ``change`` (of the two read) was written, under the lock; None where the
        file cannot be used (until the next walk, ``retry``)."""
        with self._lock:
            if self._broken and not retry:
                return None
            self._broken = False
            try:
                if self._fd is None:
                    self._fd = _open_own(self.path)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    raw = os.pread(self._fd, _FIELDS.size, 0)
                    old = _FIELDS.unpack(raw) if len(raw) == _FIELDS.size else (0, 0)
                    new = change(*old)
                    new = (max(0, new[0]), new[1])
                    if not all(0 <= v <= _MAX for v in old + new):
                        raise OSError(f"{self.path} holds no byte counts ({old}): not used")
                    if new != old:
                        os.pwrite(self._fd, _FIELDS.pack(*new), 0)
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                return new
            except OSError:
                self._broken = True
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                return None

    def add(self, n: int) -> int | None:
        """Add ``n`` bytes (negative: taken away); the new total (never below 0), or None where the
        tally cannot be used."""
        got = self._change(lambda total, added: (total + n, added + max(n, 0)))
        return None if got is None else got[0]

    def before_walk(self) -> tuple[int, int] | None:
        """What to hand :meth:`walked` after a walk of the cache: the tally as the walk begins."""
        return self._change(lambda total, added: (total, added), retry=True)

    def walked(self, found: int, before: tuple[int, int]) -> int | None:
        """A walk that began at ``before`` found ``found`` bytes (less what its process deleted after
        it): the tally becomes that plus what was put meanwhile; returns it. What other processes
        deleted meanwhile is not taken away: the walk may have missed it or counted it, and a tally
        too high costs an early eviction, one too low an overfull cache. (Taking it away too, two
        processes evicting at once took each other's deletions off twice: 4 processes filling a
        1 MB cache at once sometimes ended over its limit.)"""
        got = self._change(lambda total, added: (found + added - before[1], added))
        return None if got is None else got[0]

    @contextmanager
    def evicting(self, wait: bool) -> Iterator[bool]:
        """Whether this process may evict now: False while another process evicts (``wait``: wait for
        it instead, up to :data:`EVICT_WAIT_S`: a stopped process holding the lock must not hang every
        pull on the machine; then it evicts beside it). True where the lock cannot be used (every
        process evicts, as before it)."""
        deadline = time.monotonic() + EVICT_WAIT_S
        held = None  # True: locked here; False: another process evicts; None: no lock (unusable, or waited out)
        try:
            if self._evict_fd is None:
                self._evict_fd = _open_own(os.path.join(os.path.dirname(self.path), EVICTING))
            while held is None:
                try:
                    fcntl.flock(self._evict_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                except BlockingIOError:
                    if not wait:
                        held = False
                    elif time.monotonic() > deadline:
                        break
                    else:
                        time.sleep(0.02)
        except OSError:
            held = None
        if not held:
            yield held is None
            return
        try:
            yield True
        finally:
            fcntl.flock(self._evict_fd, fcntl.LOCK_UN)

    def __del__(self) -> None:
        for fd in (self._fd, self._evict_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._evict_fd = None


__all__ = ["EVICTING", "FILES", "TALLY", "CacheTally"]
