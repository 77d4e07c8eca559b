"""Keeping the chunk cache (storage/cache.py) within its limit: what it holds, and deleting its least
recently used entries.

The cache holds at most ``max_bytes``: past that, the least recently used entries (by modification
time, refreshed on every hit) are deleted until it is under 90% of it; a larger blob is not cached.
Other processes put entries too: every put and deletion goes into a tally the processes share
(``storage/cache_tally.py``: a file and a lock, ~4 us), so a put knows the cache's size without
walking it, and a put past the limit evicts (one process at a time). A walk (a process's first put,
a quarter of the limit put, an eviction that the last walk's oldest entries cannot serve) sets the
tally to what it found plus what was put meanwhile, which corrects what it missed (a writer killed
between its entry and the tally). Walking instead, near the limit, took as long as the pull (0.3-0.4 s
at 50,000 entries, every hundredth of the limit). A walk keeps the oldest entries it leaves, up to a
quarter of the limit, and evictions take those first (a walk each, 70-80% of the time of a pull's puts
into a cache of 50,000 entries on a tmpfs): each is looked at again just before it is deleted and
kept if it was used (a hit touches it) or replaced since; the entries it does not list are younger
than any it lists, so the least recently used still go first. Where the tally cannot be used, each process counts the cache again once it has put a
tenth of the room free at its last count (at least a hundredth of the limit): N processes that
counted it at C bytes put at most ``N * max((max_bytes - C) / 10, max_bytes / 100)`` (and a blob
each) before they count again, near the limit about N hundredths of it over.
A disk (or quota) that fills before the limit is a lower limit: a put that fails with ENOSPC evicts
(least recently used first, its entry's room and a hundredth of what the cache holds; threads that
find it full meanwhile get their rooms, no more) and writes again, while evictions free room.

>>> import os, tempfile
>>> root = tempfile.mkdtemp()
>>> os.makedirs(os.path.join(root, "5" * 32, "ab"))
>>> open(os.path.join(root, "5" * 32, "ab", "ab" * 32), "wb").write(bytes(1000))  # an entry a put wrote
1000
>>> e = CacheEviction(root, 1 << 20)
>>> e.added(1000, 0)  # (its first put counts the cache)
>>> e.size, e.evict()  # within the limit: nothing to free
(1000, 0)
"""

from __future__ import annotations

import os
import stat
import threading

from ckpt_store.storage.cache_files import Entry, entries_sweeping, in_own_folders, remove
from ckpt_store.storage.cache_tally import CacheTally

KEPT = 4  # a walk keeps its oldest entries, up to 1/KEPT of the limit, for the next evictions


class CacheEviction:
    """The bytes of the chunk cache at ``root`` (every store's entries), kept at most ``max_bytes``."""

    def __init__(self, root: str, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.tally = CacheTally(root)  # the cache's bytes, as every process that puts into it counts them
        self._size: int | None = None  # bytes in the whole cache root, counted on first put
        self._uncounted = 0  # bytes put since the cache root was last counted (other processes put too)
        self._step = 0  # bytes put after which the cache root is counted again (set by each count)
        self._counting = False  # one thread counts at a time; the others' puts go on top of its count
        self._added = 0  # bytes put since the running eviction's walk began
        self._evicting = False  # one thread evicts at a time; others ask it to look again
        self._again = False
        self._room = 0  # bytes that a put found no room for on a full disk: the next eviction frees them too
        self._oldest: list[Entry] = []  # the oldest entries the last tallied walk left, newest first
        self._lock = threading.Lock()
        self._evicted = threading.Condition(self._lock)  # the running eviction is done (a full disk's put waits for it)
        self._freed_ever = 0  # bytes this process's evictions freed: whether a full disk's put may write again

    @property
    def freed_ever(self) -> int:
        """Bytes every eviction of this object freed so far (a put that found the disk full writes again
        only after some were)."""
        with self._lock:
            return self._freed_ever

    @property
    def size(self) -> int | None:
        """The cache's bytes as this process knows them (None until its first put)."""
        with self._lock:
            return self._size

    def added(self, n: int, replaced: int) -> None:
        """A put wrote an entry of ``n`` bytes in place of one of ``replaced`` bytes (0: none): counted,
        the cache counted again where due, and evicted where it is past its limit."""
        shared = self.tally.add(n - replaced)  # (other processes' entries in it too)
        with self._lock:
            self._uncounted += n
            self._added += n
            if self._size is not None:
                self._size = shared if shared is not None else self._size + n - replaced
            # Counted again after a tenth of the room free at the last count is put (without a tally:
            # other processes' entries count too; two pulls, each under the limit on its own count, filled
            # 150% of it), or a quarter of the limit (with one: what it missed, a killed writer's entry, say).
            recount = not self._counting and (self._size is None or self._uncounted > self._step)
            if recount:
                self._counting, self._uncounted = True, 0
        if recount:
            self._count()
        with self._lock:
            over = self._size is not None and self._size > self.max_bytes
        if over:
            self.evict()

    def removed(self, n: int) -> None:
        """An entry of ``n`` bytes was deleted (found damaged)."""
        shared = self.tally.add(-n)
        with self._lock:
            if self._size is not None:
                self._size = shared if shared is not None else self._size - n

    def _count(self) -> None:
        """Count the cache root (a walk, not holding the lock; it sweeps what killed writers left, as
        eviction does). One thread counts at a time: bytes put meanwhile go on top of its count (a
        few twice: an early eviction, never an overfull cache), as in :meth:`_evict_once`."""
        try:
            before = self.tally.before_walk()
            files = self._entries()
            size = sum(e.size for e in files)
            shared = self.tally.walked(size, before) if before is not None else None
            # (kept where an eviction may come before the next count: sorting 50,000 entries takes 50-80 ms)
            near = shared is not None and size >= self.max_bytes - self._step_from(size, True)
            oldest = self._oldest_of(sorted(files)) if near else []
        except BaseException:
            with self._lock:
                self._counting = False
            raise
        with self._lock:
            self._counting = False
            self._size = shared if shared is not None else size + self._uncounted
            self._step = self._step_from(size, shared is not None)
            self._oldest = oldest

    def _step_from(self, size: int, tallied: bool) -> int:
        """Bytes to put before counting a cache found holding ``size`` bytes again: a tenth of its room
        (a quarter of the limit where the shared tally counts every process's puts)."""
        if tallied:
            return self.max_bytes // 4
        return max((self.max_bytes - size) // 10, self.max_bytes // 100)

    def evict(self, room: int = 0) -> int:
        """Delete least recently used entries (and stale temporaries) until the cache is
        under 90% of its limit; returns the bytes freed. ``room``: bytes that a put found no room
        for on a full disk: the cache then frees ``room`` and a margin (:meth:`_disk_need`; a full
        disk sets a lower limit than ``max_bytes``). An entry deleted while another process
        reads it is read whole (an open file keeps its bytes); one deleted before it opens it is a
        miss there, fetched again.

        One thread of one process evicts at a time (another process's eviction meanwhile: this one
        returns 0, or waits for it where ``room`` is asked). Entries put while it walks the cache are
        counted on top of what its walk found (a few twice: an early eviction, never an overfull
        cache), and it evicts again while another thread asked it to (it put an entry past the limit
        meanwhile, or found the disk full: that thread waits for the room, then writes again; such a
        round frees only the rooms asked, less what earlier rounds freed past theirs), or while the
        cache is over its limit and the last round freed something."""
        with self._evicted:
            self._room += room  # (threads that found the disk full at once each need their entry's room)
            if self._evicting:
                self._again = True
                if room:
                    self._evicted.wait_for(lambda: not self._evicting, timeout=60)
                return 0
            self._evicting = True
        freed, spare = 0, None
        try:
            # One process at a time: processes that read one tally past the limit all evicted a tenth of
            # the cache at once. The others skip (their next put reads the tally the eviction set), or,
            # on a full disk, wait for the room it made.
            with self.tally.evicting(wait=room > 0) as mine:
                while mine:
                    now, asked = self._evict_once(spare)
                    freed += now
                    spare = max(0, (spare or 0) + now - asked)  # freed past the room asked: the next asks take it
                    with self._lock:
                        again, self._again = self._again, False
                        over = (self._size or 0) > self.max_bytes
                    # Done unless entries came meanwhile, or it is still over and freeing works.
                    if not again and (not over or not now):
                        break
        finally:
            with self._lock:
                self._evicting = False
                self._freed_ever += freed
                self._evicted.notify_all()
        return freed

    def _entries(self) -> list[Entry]:
        return entries_sweeping(self.root)

    def _oldest_of(self, files: list[Entry]) -> list[Entry]:
        """The first of ``files`` (oldest first) up to a :data:`KEPT` th of the limit, newest first."""
        kept, n = [], 0
        for e in files:
            if n >= self.max_bytes // KEPT:
                break
            kept.append(e)
            n += e.size
        return kept[::-1]

    @staticmethod
    def _disk_need(held: int, room: int, spare: int | None) -> int:
        """Bytes a full disk needs freed in a cache holding ``held``, ``room`` asked: in a first round the
        room and a margin, a hundredth of what it holds (at least the room again), so that the puts that
        follow do not each find the disk full; in a further round the room less what earlier rounds
        freed past theirs (``spare``). (A first round took a tenth of what the cache held: 2.2 times
        the rooms of 16 threads that found a 4 MiB disk full at once, 5 times a 64 KB put's.)"""
        if not room:
            return 0
        return room + max(held // 100, room) if spare is None else max(room - spare, 0)

    def _evict_once(self, spare: int | None) -> tuple[int, int]:
        """One round of eviction: (bytes freed, room asked). ``spare``: None in the first round, else the
        bytes freed past the room asked so far; a further round frees only the room asked meanwhile
        beyond those (each round taking a tenth off what the cache holds, 16 threads that found a
        4 MiB disk full at once evicted 6 times their room; see :meth:`_disk_need`). The oldest entries
        the last walk left go first; a walk where they are too few (or the tally unusable)."""
        with self._lock:
            self._added = 0
            room, self._room = self._room, 0
            oldest, self._oldest = self._oldest, []
        listed = 0
        size = self.tally.add(0) if oldest else None
        if size is not None:
            need = max(size - int(self.max_bytes * 0.9), self._disk_need(size, room, spare))
            if need <= sum(e.size for e in oldest):
                listed = self._free_listed(oldest, need)
                shared = self.tally.add(-listed)
                if listed >= need and shared is not None:
                    with self._lock:
                        self._size = shared
                        self._oldest = oldest
                    return listed, room
        before = self.tally.before_walk()
        files = self._entries()
        total = sum(e.size for e in files)
        files.sort()
        need = max(total - int(self.max_bytes * 0.9), self._disk_need(total + listed, room, spare) - listed)
        freed = gone = 0
        for e in files:
            if freed >= need:
                break
            gone += 1
            if remove(e.path):
                freed += e.size
        shared = self.tally.walked(total - freed, before) if before is not None else None
        with self._lock:
            self._size = shared if shared is not None else total - freed + self._added
            self._uncounted = self._added
            self._step = self._step_from(total - freed, shared is not None)
            self._oldest = self._oldest_of(files[gone:]) if shared is not None else []
        return listed + freed, room

    @staticmethod
    def _free_listed(oldest: list[Entry], need: int) -> int:
        """Delete entries of ``oldest`` (newest first), the oldest first, until ``need`` bytes are freed;
        returns the bytes freed, and leaves the rest in ``oldest``. Each is looked at again first: one
        gone (another process's eviction, a clear) is passed over, one used since the walk (a hit
        refreshed its time) or replaced is younger now, and kept."""
        freed = 0
        own: dict[str, bool] = {}  # fan-out dir -> whether it and its store dir are the cache's own (not links)
        while oldest and freed < need:
            e = oldest.pop()
            try:
                st = os.lstat(e.path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or (st.st_mtime_ns, st.st_size, st.st_ino) != (e.mtime_ns, e.size, e.ino):
                continue
            folder = os.path.dirname(e.path)
            if folder not in own:
                own[folder] = in_own_folders(e.path)
            if own[folder] and remove(e.path):
                freed += e.size
        return freed


__all__ = ["CacheEviction"]
