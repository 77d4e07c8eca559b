"""A local read-through cache of chunk blobs fetched from remote stores.

Chunks are immutable and named by their content, so a blob fetched once can be served
from local disk ever after: the second fine-tune of a family pulled on one machine
fetches only its own chunks, and the bases of delta chains are fetched once per machine.

Layout: ``<root>/<store dir>/<id[:2]>/<id>``, one file per chunk blob (a delta blob is only
meaningful in the store that holds its base, hence one directory per store), followed by
the 32-byte BLAKE3 of the blob. The store dir is the store's id (32 hex digits, as every
store ckpt creates has) or a hash of it: a remote store's config is outside data, never a path.
The cache deletes, counts and clears only files of that layout (entries and its own
temporaries): a cache directory that also holds other files (``CKPT_CACHE_DIR=~/.cache``,
say) keeps them. The blob is any valid blob of the chunk: the one stored, or
(the caller's choice, see ckpt/transfer/fetch.py) the chunk decoded, as a raw blob. This
module knows only bytes. :meth:`ChunkBlobCache.get` checks an entry against its trailer
(BLAKE3 runs at ~4-6 GB/s per core here); a damaged or truncated entry is deleted and
reported as a miss, never served. :meth:`ChunkBlobCache.read_split` leaves the check to a
caller that verifies the chunk's id after decoding anyway, and drops what fails. Entries are
written to a temporary name and renamed, so a crash leaves at most a temporary file, swept
once an hour old by the next count of the cache (below) or eviction.

The cache holds at most ``max_bytes``: past that, the least recently used entries (by modification
time, refreshed on every hit) are deleted until it is under 90% of it; a larger blob is not cached.
Other processes put entries too: every put and deletion goes into a tally the processes share
(``storage/cache_tally.py``: a file and a lock, ~4 us), so a put knows the cache's size without
walking it, and a put past the limit evicts (one process at a time). A walk (a process's first put,
each eviction, a quarter of the limit put) sets the tally to what it found plus what was put
meanwhile, which corrects what it missed (a writer killed between its entry and the tally). Walking
instead, near the limit, took as long as the pull (0.3-0.4 s at 50,000 entries, every hundredth of
the limit). Where the tally cannot be used, each process counts the cache again once it has put a
tenth of the room free at its last count (at least a hundredth of the limit): N processes that
counted it at C bytes put at most ``N * max((max_bytes - C) / 10, max_bytes / 100)`` (and a blob
each) before they count again, near the limit about N hundredths of it over.
A disk (or quota) that fills before the limit is a lower limit: a put that fails with ENOSPC evicts
(least recently used first, below 90% of what the cache holds, less the entry; threads that find it
full meanwhile get their rooms, no more) and writes again, once; only a disk that the cache's own
entries do not fill leaves the chunk uncached, with a warning once.
Which files the layout names, and clearing them: ``storage/cache_files.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import blake3

from ckpt_store.storage.backends.base import TEMPORARY
from ckpt_store.storage.cache_files import CacheUsage, clear, default_cache_dir, entries_sweeping, remove, store_dir_name, usage
from ckpt_store.storage.cache_tally import CacheTally

log = logging.getLogger(__name__)

TRAILER = 32  # bytes of BLAKE3 after each blob
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class ChunkBlobCache:
    """Chunk blobs of one store (``store_id``) below ``root``, at most ``max_bytes`` in all of ``root``.

    >>> import tempfile
    >>> c = ChunkBlobCache(tempfile.mkdtemp(), "s1", 1 << 20)
    >>> c.put("ab" * 32, (b"head", b"body"))
    >>> bytes(c.get("ab" * 32))
    b'headbody'
    >>> c.get("cd" * 32) is None
    True
    """

    def __init__(self, root: str, store_id: str, max_bytes: int, max_entry: int = 1 << 40) -> None:
        self.root = root
        self.dir = os.path.join(root, store_dir_name(store_id))
        self.max_bytes = max_bytes
        self.max_entry = max_entry  # bytes of the largest blob an entry may hold: a larger one is damaged
        self.hits = 0
        self.misses = 0
        self.dropped = 0  # damaged entries deleted
        self._size: int | None = None  # bytes in the whole cache root, counted on first put
        self._uncounted = 0  # bytes put since the cache root was last counted (other processes put too)
        self._step = 0  # bytes put after which the cache root is counted again (set by each count)
        self._counting = False  # one thread counts at a time; the others' puts go on top of its count
        self._added = 0  # bytes put since the running eviction's walk began
        self._evicting = False  # one thread evicts at a time; others ask it to look again
        self._again = False
        self._room = 0  # bytes that a put found no room for on a full disk: the next eviction frees them too
        self._put_failed = False  # a put failed: later failures are logged at debug level only
        self._tally = CacheTally(root)  # the cache's bytes, as every process that puts into it counts them
        self._lock = threading.Lock()
        self._evicted = threading.Condition(self._lock)  # the running eviction is done (a full disk's put waits for it)

    def _path(self, oid: str) -> str:
        return os.path.join(self.dir, oid[:2], oid)

    def has(self, oid: str) -> bool:
        """Whether an entry for ``oid`` is there (not whether it is sound: reading says that)."""
        return os.path.isfile(self._path(oid))

    def _open(self, path: str) -> tuple[Any, int]:
        """The entry at ``path`` open for reading, and its size. Raises OSError unless it is a
        regular file (not a link, a FIFO that would block, a device) of at most ``max_entry``
        bytes past its trailer: anything else is not an entry this cache wrote."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        f = os.fdopen(fd, "rb", buffering=0)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not TRAILER <= st.st_size <= self.max_entry + TRAILER:
                raise OSError(f"{path}: not a cache entry")
        except BaseException:
            f.close()
            raise
        return f, st.st_size

    def get(self, oid: str) -> bytes | None:
        """The blob of chunk ``oid``, checked against its trailer, or None (absent, or damaged:
        then it is deleted). (:meth:`read_split` reads without the check.)"""
        path = self._path(oid)
        try:
            f, size = self._open(path)
            with f:
                # Read straight into the blob's own bytes, neither zeroed first (bytearray(n)
                # does that holding the GIL) nor copied afterwards.
                blob = f.read(size - TRAILER)
                trailer = f.read(TRAILER)
        except OSError as e:
            return self._unreadable(path, oid, e)
        if len(blob) != size - TRAILER or len(trailer) != TRAILER or blake3.blake3(blob).digest() != trailer:
            return self._damaged(path, oid)
        self._hit(path)
        return blob

    def _hit(self, path: str) -> None:
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        with self._lock:
            self.hits += 1

    def _unreadable(self, path: str, oid: str, e: OSError) -> None:
        """An entry that could not be read: a miss; deleted if something is there (not an entry
        this cache wrote, or one cut short). One that was not there is only a miss: what is there
        by now was put meanwhile (by another process, after a ``ckpt cache clear``), and is sound."""
        if not isinstance(e, FileNotFoundError) and os.path.lexists(path) and not os.path.isdir(path):
            return self._damaged(path, oid)
        with self._lock:
            self.misses += 1
        return None

    def _damaged(self, path: str, oid: str, *, miss: bool = True) -> None:
        """Delete a damaged entry (counted as dropped, and as a miss unless it was read as a hit)."""
        try:
            size = os.lstat(path).st_size
        except OSError:
            size = 0
        log.warning("cached chunk %s is damaged: dropped, fetching it again", oid)
        self._drop(path, size)
        with self._lock:
            self.dropped += 1
            self.misses += miss

    def read_split(self, oid: str, first: int, place: Callable[[bytes, int], memoryview]) -> bytes | None:
        """The blob of chunk ``oid`` read as :meth:`Backend.read_split` reads an object: its first
        ``first`` bytes, then the rest into ``place(those bytes, blob size)``'s buffer (a chunk kept
        decoded goes straight into its destination). Returns the first bytes, or None when absent
        or shorter than its trailer says. The trailer is not checked: the caller verifies the
        decoded chunk against its id and :meth:`drop` s the entry if it is wrong."""
        path = self._path(oid)
        try:
            f, size = self._open(path)
            with f:
                size -= TRAILER
                head = f.read(min(first, size))
                buf = place(head, size)
                if len(head) != min(first, size) or len(buf) != size - len(head) or f.readinto(buf) != len(buf):
                    raise OSError("short read")
        except OSError as e:
            return self._unreadable(path, oid, e)
        self._hit(path)
        return head

    def drop(self, oid: str) -> None:
        """Delete the entry of ``oid`` (a caller found it wrong after decoding)."""
        path = self._path(oid)
        if os.path.lexists(path):
            self._damaged(path, oid, miss=False)

    def _in_own_dirs(self, path: str) -> bool:
        """Whether the store dir and fan-out dir holding ``path`` are directories, not links: through
        a link (a hostile or mistaken cache folder) the cache would delete and write another's files."""
        for d in (self.dir, os.path.dirname(path)):
            try:
                if not stat.S_ISDIR(os.lstat(d).st_mode):
                    return False
            except OSError:
                return False
        return True

    def _drop(self, path: str, n: int) -> None:
        if not self._in_own_dirs(path):
            return
        try:
            os.unlink(path)
        except OSError:
            return
        shared = self._tally.add(-n)
        with self._lock:
            if self._size is not None:
                self._size = shared if shared is not None else self._size - n

    def _write(self, path: str, parts: tuple[bytes | bytearray | memoryview, ...]) -> int:
        """The entry at ``path``: written to a temporary in its folder, then renamed into place; returns
        the bytes of the entry it replaced (0: none, another process's eviction took it meanwhile, say)."""
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        if not self._in_own_dirs(path):
            if not os.path.isdir(folder):
                raise FileNotFoundError(errno.ENOENT, "removed while the entry was written", folder)
            raise OSError(f"{folder} is reached through a link, not a folder of this cache")
        tmp = os.path.join(folder, f"{TEMPORARY}{uuid.uuid4().hex}")
        h = blake3.blake3()
        try:
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
                    h.update(p)
                f.write(h.digest())
            try:
                st = os.lstat(path)
                replaced = st.st_size if stat.S_ISREG(st.st_mode) else 0
            except OSError:
                replaced = 0
            os.replace(tmp, path)
        except BaseException:
            remove(tmp)
            raise
        return replaced

    def _write_retrying(self, path: str, parts: tuple[bytes | bytearray | memoryview, ...]) -> int:
        for _ in range(2):
            try:
                return self._write(path, parts)
            except (FileNotFoundError, FileExistsError):
                # Its folder went while it was made or written to (`ckpt cache clear` in another
                # process removes the folders it empties; makedirs then finds it neither there
                # nor absent): again.
                pass
        return self._write(path, parts)

    def put(self, oid: str, parts: Iterable[bytes | bytearray | memoryview], *, replace: bool = False) -> None:
        """Keep the blob ``b"".join(parts)`` of chunk ``oid`` (a failure to write is only logged);
        an entry already there stays unless ``replace`` (another blob of the same chunk: the
        chunk decoded, say)."""
        path = self._path(oid)
        try:
            st: os.stat_result | None = os.lstat(path)
        except OSError:
            st = None
        old = st.st_size if st is not None and stat.S_ISREG(st.st_mode) else -1  # (a link is no entry: replaced)
        if old >= 0 and not replace:
            return
        if st is not None and stat.S_ISDIR(st.st_mode) and self._in_own_dirs(path):
            # (through a linked store or fan-out dir the folder is another's: the write below says so)
            try:
                os.rmdir(path)  # a folder in the entry's place kept the chunk out of the cache for good
            except OSError:
                log.debug("chunk %s not cached: %s is a folder that holds files", oid, path)
                return  # (not ours to delete)
        parts = tuple(parts)
        n = TRAILER + sum(len(p) for p in parts)
        if n > self.max_bytes * 0.9:
            # Eviction would delete it at once, and every other entry with it (it frees down to 90%).
            log.debug("chunk %s is larger than the cache's limit: not cached", oid)
            return
        try:
            try:
                replaced = self._write_retrying(path, parts)
            except OSError as e:
                if e.errno not in _DISK_FULL:
                    raise
                # The disk (or the user's quota) is full before the limit is: room is made as at the
                # limit, least recently used entries first, and the entry written again, once.
                self.evict(room=n)
                replaced = self._write_retrying(path, parts)
        except OSError as e:
            # Once per cache: a cache folder that cannot take entries (read-only, full) fails every put,
            # and a load puts every chunk it fetches.
            with self._lock:
                first, self._put_failed = not self._put_failed, True
            log.log(logging.WARNING if first else logging.DEBUG, "cannot cache chunk %s in %s: %s%s", oid, self.root, e,
                    " (further chunks that cannot be cached are not reported)" if first else "")
            return
        # (what the write replaced, not what was there before it: another process may have evicted it, or put it, meanwhile)
        shared = self._tally.add(n - replaced)  # (other processes' entries in it too)
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

    def _count(self) -> None:
        """Count the cache root (a walk, not holding the lock; it sweeps what killed writers left, as
        eviction does). One thread counts at a time: bytes put meanwhile go on top of its count (a
        few twice: an early eviction, never an overfull cache), as in :meth:`_evict_once`."""
        try:
            before = self._tally.before_walk()
            size = sum(b for _, b, _ in self._entries())
            shared = self._tally.walked(size, before) if before is not None else None
        except BaseException:
            with self._lock:
                self._counting = False
            raise
        with self._lock:
            self._counting = False
            self._size = shared if shared is not None else size + self._uncounted
            self._step = self._step_from(size, shared is not None)

    def _step_from(self, size: int, tallied: bool) -> int:
        """Bytes to put before counting a cache found holding ``size`` bytes again: a tenth of its room
        (a quarter of the limit where the shared tally counts every process's puts)."""
        if tallied:
            return self.max_bytes // 4
        return max((self.max_bytes - size) // 10, self.max_bytes // 100)

    def evict(self, room: int = 0) -> int:
        """Delete least recently used entries (and stale temporaries) until the cache is
        under 90% of its limit; returns the bytes freed. ``room``: bytes that a put found no room
        for on a full disk: the cache is then taken below 90% of what it holds, less ``room``
        (a full disk sets a lower limit than ``max_bytes``). An entry deleted while another process
        reads it is read whole (an open file keeps its bytes); one deleted before it opens it is a
        miss there, fetched again.

        One thread of one process evicts at a time (another process's eviction meanwhile: this one
        returns 0, or waits for it where ``room`` is asked). Entries put while it walks the cache are
        counted on top of what its walk found (a few twice: an early eviction, never an overfull
        cache), and it walks again while another thread asked it to (it put an entry past the limit
        meanwhile, or found the disk full: that thread waits for the room, then writes again; such a
        round frees only the rooms asked, less what earlier rounds freed past theirs), or while the
        cache is over its limit and the last walk freed something."""
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
            with self._tally.evicting(wait=room > 0) as mine:
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
                self._evicted.notify_all()
        return freed

    def _entries(self) -> list[tuple[float, int, str]]:
        return entries_sweeping(self.root)

    def _evict_once(self, spare: int | None) -> tuple[int, int]:
        """One walk of eviction: (bytes freed, room asked). ``spare``: None in the first round, else the
        bytes freed past the room asked so far; a further round frees only the room asked meanwhile
        beyond those (each round taking a tenth off what the cache holds, 16 threads that found a
        4 MiB disk full at once evicted 6 times their room)."""
        with self._lock:
            self._added = 0
            room, self._room = self._room, 0
        before = self._tally.before_walk()
        files = self._entries()
        total = sum(b for _, b, _ in files)
        files.sort()
        freed = 0
        target = int(self.max_bytes * 0.9)
        if room:
            target = min(target, int(total * 0.9) - room if spare is None else total - max(room - spare, 0))
        for _, size, p in files:
            if total - freed <= target:
                break
            if remove(p):
                freed += size
        shared = self._tally.walked(total - freed, before) if before is not None else None
        with self._lock:
            self._size = shared if shared is not None else total - freed + self._added
            self._uncounted = self._added
            self._step = self._step_from(total - freed, shared is not None)
        return freed, room


__all__ = ["CacheUsage", "ChunkBlobCache", "clear", "default_cache_dir", "store_dir_name", "usage"]
