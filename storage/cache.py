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
once an hour old by the next count of the cache or eviction (storage/cache_evict.py).

The cache holds at most ``max_bytes`` (its size counted, a full disk met, and its least recently
used entries deleted: ``storage/cache_evict.py``); a larger blob is not cached. A put that fails with
ENOSPC evicts and writes again (while eviction frees room: other puts may take the room made); only a disk that the cache's own entries do not fill leaves
the chunk uncached, with a warning once.
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
from ckpt_store.storage.cache_evict import CacheEviction
from ckpt_store.storage.cache_files import CacheUsage, clear, default_cache_dir, in_own_folders, remove, store_dir_name, usage

log = logging.getLogger(__name__)

TRAILER = 32  # bytes of BLAKE3 after each blob
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Writes of one entry a put tries at most on a full disk, each after an eviction that freed room but the first.
_DISK_FULL_TRIES = 32


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
        self._put_failed = False  # a put failed: later failures are logged at debug level only
        self._eviction = CacheEviction(root, max_bytes)  # the whole cache root's bytes, kept within max_bytes
        self._lock = threading.Lock()

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
        """Whether the store dir and fan-out dir holding ``path`` are directories, not links."""
        return in_own_folders(path)

    def _drop(self, path: str, n: int) -> None:
        if not self._in_own_dirs(path):
            return
        try:
            os.unlink(path)
        except OSError:
            return
        self._eviction.removed(n)

    def _write(self, path: str, parts: tuple[bytes | bytearray | memoryview, ...], replace: bool) -> int | None:
        """The entry at ``path``: written to a temporary in its folder, then renamed into place; returns
        the bytes of the entry it replaced where ``replace`` (0: none, another process's eviction took it
        meanwhile, say; else 0 unlooked: see :meth:`put`), or None where a folder holding files is in its
        place (not the cache's to delete)."""
        folder = os.path.dirname(path)
        self._make_folders(folder)
        if not self._in_own_dirs(path):
            if not os.path.isdir(folder):
                raise FileNotFoundError(errno.ENOENT, "removed while the entry was written", folder)
            raise OSError(f"{folder} is reached through a link, not a folder of this cache")
        tmp = os.path.join(folder, f"{TEMPORARY}{uuid.uuid4().hex}")
        h = blake3.blake3()
        replaced = 0
        try:
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
                    h.update(p)
                f.write(h.digest())
            if replace:
                try:
                    st = os.lstat(path)
                    replaced = st.st_size if stat.S_ISREG(st.st_mode) else 0  # (a link is no entry)
                except OSError:
                    pass
            try:
                os.replace(tmp, path)
            except IsADirectoryError:
                # A folder in the entry's place kept the chunk out of the cache for good: removed if
                # empty (its store and fan-out dirs are the cache's own, checked above).
                try:
                    os.rmdir(path)
                except OSError:
                    remove(tmp)
                    return None
                os.replace(tmp, path)
        except BaseException:
            remove(tmp)
            raise
        return replaced

    def _make_folders(self, folder: str) -> None:
        """Make the fan-out dir ``folder`` of an entry, and its store dir where that is missing, never
        through a link: a store dir that is a link (to a folder elsewhere) is not followed to make the
        fan-out dir there (``os.makedirs`` did). A folder removed meanwhile (``ckpt cache clear``) raises
        FileNotFoundError: :meth:`_write_retrying` tries again."""
        if os.path.islink(self.dir):
            raise OSError(f"{self.dir} is a link, not a folder of this cache")
        try:
            os.mkdir(folder)
            return
        except FileExistsError:
            return  # (a link in its place: the caller's check)
        except FileNotFoundError:
            pass  # no store dir (yet, or cleared meanwhile)
        os.makedirs(self.root, exist_ok=True)
        for d in (self.dir, folder):
            try:
                os.mkdir(d)
            except FileExistsError:
                if os.path.islink(d):
                    raise OSError(f"{d} is a link, not a folder of this cache") from None

    def _write_retrying(self, path: str, parts: tuple[bytes | bytearray | memoryview, ...], replace: bool) -> int | None:
        for _ in range(2):
            try:
                return self._write(path, parts, replace)
            except (FileNotFoundError, FileExistsError):
                # Its folder went while it was made or written to (`ckpt cache clear` in another
                # process removes the folders it empties; makedirs then finds it neither there
                # nor absent): again.
                pass
        return self._write(path, parts, replace)

    def put(self, oid: str, parts: Iterable[bytes | bytearray | memoryview], *, replace: bool = False) -> None:
        """Keep the blob ``b"".join(parts)`` of chunk ``oid`` (a failure to write is only logged);
        an entry already there stays unless ``replace`` (another blob of the same chunk: the
        chunk decoded, say)."""
        path = self._path(oid)
        if not replace:
            # The one look at the entry a put takes: a replacing put looks just before its rename (what it
            # replaces: its tally), one that keeps an entry there only here. What another process puts
            # meanwhile is then replaced and counted twice, a tally too high until the next walk
            # (never too low: an overfull cache).
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    return  # (a link or a folder is no entry: replaced, see _write)
            except OSError:
                pass
        parts = tuple(parts)
        n = TRAILER + sum(len(p) for p in parts)
        if n > self.max_bytes * 0.9:
            # Eviction would delete it at once, and every other entry with it (it frees down to 90%).
            log.debug("chunk %s is larger than the cache's limit: not cached", oid)
            return
        try:
            tries = 0
            while True:
                try:
                    replaced = self._write_retrying(path, parts, replace)
                    break
                except OSError as e:
                    tries += 1
                    if e.errno not in _DISK_FULL or tries == _DISK_FULL_TRIES:
                        raise
                    # The disk (or the user's quota) is full before the limit is: room is made as at the
                    # limit, least recently used entries first, and the entry written again. Again while
                    # eviction frees room: other threads' and processes' puts may take the room made before
                    # this one writes (16 threads on a full disk, under load, each lost it up to 4 times).
                    # A round that frees nothing ends it: the disk is full of what the cache cannot delete.
                    freed = self._eviction.freed_ever
                    self.evict(room=n)
                    if self._eviction.freed_ever == freed:
                        raise
        except OSError as e:
            # Once per cache: a cache folder that cannot take entries (read-only, full) fails every put,
            # and a load puts every chunk it fetches.
            with self._lock:
                first, self._put_failed = not self._put_failed, True
            log.log(logging.WARNING if first else logging.DEBUG, "cannot cache chunk %s in %s: %s%s", oid, self.root, e,
                    " (further chunks that cannot be cached are not reported)" if first else "")
            return
        if replaced is None:
            log.debug("chunk %s not cached: %s is a folder that holds files", oid, path)
            return  # (not ours to delete)
        # (what the write replaced, not what was there before it: another process may have evicted it meanwhile)
        self._eviction.added(n, replaced)

    def evict(self, room: int = 0) -> int:
        """Delete least recently used entries of the whole cache until it is within its limit (see
        :meth:`CacheEviction.evict`; ``room``: bytes a put found no room for on a full disk); returns the
        bytes freed."""
        return self._eviction.evict(room)


__all__ = ["CacheUsage", "ChunkBlobCache", "clear", "default_cache_dir", "store_dir_name", "usage"]
