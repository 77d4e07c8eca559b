"""The running total of the chunk cache's bytes (storage/cache.py), shared by every process that puts
into one cache root: a file ``<root>/tally`` holding one little-endian 64-bit count, changed under an
exclusive ``flock`` by each put and each eviction. A put then knows the cache's size, other processes'
entries included, without walking the cache (a walk stats every entry: 0.3-0.4 s at 50,000 entries
here, and near the limit it walked every hundredth of it put, as long as the pull took to put it).

The tally is an estimate that walks correct: a process killed between writing an entry and adding it,
a ``ckpt cache clear``, a file deleted by hand leave it off, and the next walk (a process's first put,
an eviction) sets it to what the walk found plus what was put meanwhile. Where the file cannot be
opened or locked (a read-only folder, a filesystem without ``flock``), :meth:`CacheTally.add` returns
None and the cache walks as it did before.

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
import struct
import threading
from collections.abc import Callable

TALLY = "tally"  # (not a name of the cache's layout: usage and clear neither count nor delete it)
_FIELDS = struct.Struct("<qq")  # bytes in the cache; bytes ever added (what a walk adds to what it found)


class CacheTally:
    """The shared byte count of the cache at ``root`` (see the module's docstring)."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, TALLY)
        self._fd: int | None = None
        self._broken = False  # the file could not be used: the cache walks instead
        self._lock = threading.Lock()  # (a flock is one per open file: it does not keep this process's threads apart)

    def _change(self, change: Callable[[int, int], tuple[int, int]]) -> tuple[int, int] | None:
        """(total, walks) after ``change`` (of the two read) was written, under the lock; None where the
        file cannot be used (from then on)."""
        with self._lock:
            if self._broken:
                return None
            try:
                if self._fd is None:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    raw = os.pread(self._fd, _FIELDS.size, 0)
                    old = _FIELDS.unpack(raw) if len(raw) == _FIELDS.size else (0, 0)
                    new = change(*old)
                    new = (max(0, new[0]), new[1])
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
        return self._change(lambda total, added: (total, added))

    def walked(self, found: int, before: tuple[int, int]) -> int | None:
        """A walk that began at ``before`` found ``found`` bytes (less what its process deleted after
        it): the tally becomes that plus what was put meanwhile; returns it. What other processes
        deleted meanwhile is not taken away: the walk may have missed it or counted it, and a tally
        too high costs an early eviction, one too low an overfull cache. (Taking it away too, two
        processes evicting at once took each other's deletions off twice: 4 processes filling a
        1 MB cache at once sometimes ended over its limit.)"""
        got = self._change(lambda total, added: (found + added - before[1], added))
        return None if got is None else got[0]

    def __del__(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


__all__ = ["TALLY", "CacheTally"]
