"""What every backend provides: a few byte-level primitives below a store root.

A backend knows paths relative to the store root and bytes; nothing else. Every
write is atomic: a reader never sees a half-written object under its final name.
Backends are chosen by URL scheme (:mod:`ckpt_store.storage.backends`).
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Union

from ckpt_store.storage.errors import DISK_FULL, StorageIOError, StoreFormatError

# What write() takes: bytes, or a tuple of buffers whose concatenation is the file.
Data = Union[bytes, bytearray, memoryview, tuple[Any, ...]]


def joined(data: Data) -> bytes:
    """``data`` as one bytes object (for backends that send a single body)."""
    return b"".join(data) if isinstance(data, tuple) else bytes(data)


def data_size(data: Data) -> int:
    """Bytes in ``data`` (what :func:`joined` would return, without joining)."""
    parts = data if isinstance(data, tuple) else (data,)
    return sum(memoryview(p).nbytes for p in parts)

# Prefix of every file written but not yet renamed into place (what gc removes once stale).
TEMPORARY = ".tmp-"
# Prefix of an object gc is deleting (LocalBackend.delete_if_stale); it is a temporary.
CONDEMNED = TEMPORARY + "gc-"


def condemned_original(name: str) -> str | None:
    """The name of the object a gc condemned as ``name`` (``.tmp-gc-<hex>-<its name>``), which
    :meth:`Backend.recover_condemned` puts back; None for any other name."""
    if not name.startswith(CONDEMNED):
        return None
    return name[len(CONDEMNED):].partition("-")[2] or None


@dataclass(frozen=True)
class Entry:
    """One file found by :meth:`Backend.list`: its path relative to the root, size and mtime."""

    path: str
    size: int
    mtime: float


@dataclass(frozen=True)
class Upload:
    """An upload begun and never completed (:meth:`Backend.incomplete_uploads`)."""

    path: str  # the object it was writing, below the store's root
    upload_id: str
    begun: float  # seconds since the epoch, by the store's clock
    size: int  # bytes of the parts stored so far


class Backend(ABC):
    """Byte-level access below a store root. Paths are ``/``-separated and relative."""

    url: str
    # Requests worth having in flight at once. 1 for local stores, where the caller's
    # own worker counts apply; remote stores (latency-bound) say how many they allow.
    concurrency: int = 1
    # True where touch() refreshes an object's modification time (and reports presence
    # in the same call); object stores cannot, and callers there ask presence in batches.
    touches: bool = False
    # True where create_exclusive() can have only one winner among all writers (the
    # metadata index relies on it: storage/index.py).
    exact_creates: bool = False
    # True where list() names only objects read() can read (an object store's keys), so that a
    # listing answers what exists() would; a folder's listing also shows FIFOs and links.
    lists_only_objects: bool = False
    # True where children() lists from a name in one read: an object store's StartAfter (a request per page
    # from there on: for a ref's newest entry, about what two lookups cost), a local folder's one directory
    # read, which is linear in the whole folder, not in what follows the name (0.98 ms at 1,000 names,
    # 5.2 ms at 10,000, against 7.6 us for two lookups).
    # A ref's newest entry is then listed, not guessed (storage/refs.py: a guess fills a gap it cannot see).
    lists_from_a_name: bool = False

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None, fsync: bool,
                 remote: dict[str, Any] | None) -> Backend:
        """The backend for ``url`` (how :func:`open_backend` makes one): ``fsync`` is for
        local stores, ``remote`` (concurrency, retry, conditional_writes) for remote ones."""
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URL")

    @abstractmethod
    def read(self, path: str, limit: int | None = None) -> bytes:
        """Whole file. Raises ``FileNotFoundError`` when absent. ``limit``: a file larger than that
        is refused (:func:`too_large`) before its bytes are read where the backend can tell (a
        file in a store folder from elsewhere may be of any size, a sparse one of terabytes)."""

    @abstractmethod
    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer at end of file)."""

    # True where read_into() reads straight into the buffer (no intermediate copy) and
    # a small read before it is cheap: callers then read a header first, then the body.
    reads_into: bool = False

    def read_into(self, path: str, start: int, buf: memoryview, each: Callable[[memoryview], object] | None = None) -> int:
        """Fill ``buf`` with the file's bytes from ``start`` (as many as there are); return the file's size.

        Local stores read straight into ``buf`` (a tensor's memory, say) with no
        intermediate copy; others read the file and copy. ``each`` is called with the parts
        of ``buf`` filled, in order, each as soon as it is (a local store: block by block,
        while the block is in the CPU's caches), so that a caller hashing them reads no
        byte back from memory.
        """
        data = self.read(path)
        part = memoryview(data)[start : start + len(buf)]
        buf[: len(part)] = part
        if each is not None and len(part):
            each(buf[: len(part)])
        return len(data)

    # True where read_split() reads one request's body straight into place (remote stores).
    streams: bool = False
    # True where a local copy of what is read pays (a remote store): chunk blobs are then
    # kept in the local read-through cache (storage/cache.py).
    caches: bool = False

    def read_split(self, path: str, first: int, place: Callable[[bytes, int], memoryview]) -> bytes:
        """Read ``path`` in one request: its first ``first`` bytes (fewer if it is shorter),
        then the rest into ``place(those bytes, object size)``, which returns a buffer for
        exactly the remaining bytes. Returns the first bytes. ``place`` may be called again
        if the read is retried. Raises ``FileNotFoundError`` when absent."""
        data = self.read(path)
        head = data[:first]
        buf = place(head, len(data))
        buf[:] = memoryview(data)[len(head):]
        return head

    @abstractmethod
    def write(self, path: str, data: Data) -> None:
        """Atomically create or replace ``path`` with ``data`` (durable on return).

        ``data`` may be a tuple of buffers: the file is their concatenation (a chunk's
        header and payload are written without joining them first)."""

    def stage(self, path: str, data: Data) -> Callable[[bool], None]:
        """Prepare to :meth:`write` ``data`` at ``path`` without naming it yet; the function
        returned puts it in place (``True``) or drops it (``False``), once. Until then ``path``
        is untouched, so a batch can be named only once all of it has arrived.

        This default keeps a copy of ``data`` in memory until then; a local backend writes it
        now, under a temporary name beside ``path`` (a stale one is what gc removes)."""
        held = joined(data)

        def done(keep: bool) -> None:
            if keep:
                self.write(path, held)

        return done

    @abstractmethod
    def create_exclusive(self, path: str, data: Data) -> bool:
        """Atomically create ``path`` only if absent. Returns False if it existed."""

    def create_exclusive_cache(self, path: str, data: bytes) -> bool:
        """:meth:`create_exclusive` for a record that is a cache (its reader detects damage
        and falls back): it need not be durable on return (locally: no fsync)."""
        return self.create_exclusive(path, data)

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether an object (a file :meth:`read` can read) is at ``path``: a folder, a FIFO or a
        device there is not one."""

    def exists_many(self, paths: Iterable[str]) -> set[str]:
        """The subset of ``paths`` that exists. Remote backends batch this (one listing
        of a directory instead of a request per path, where that is cheaper)."""
        return {p for p in paths if self.exists(p)}

    def list_all(self, prefix: str, lookups: int) -> set[str] | None:
        """Every path below ``prefix`` when one listing is cheaper than ``lookups`` single
        existence checks, else None. Only remote stores say yes (a local check is cheap)."""
        return None

    def written(self, path: str) -> float | None:
        """When the object at ``path`` was written, as :meth:`mtime` says (0.0 when the backend cannot
        tell); None when absent. One existence check (S3: one HEAD)."""
        if not self.exists(path):
            return None
        try:
            return self.mtime(path)
        except FileNotFoundError:
            return None

    def list_times(self, prefix: str, lookups: int) -> dict[str, float] | None:
        """:meth:`list_all` with each path's :meth:`mtime`; None where :meth:`list_all` says None."""
        return None

    @abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes. Raises ``FileNotFoundError`` when absent."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[Entry]:
        """Every file below directory ``prefix`` (recursively); nothing if it does not exist."""

    def folders(self, prefix: str) -> Iterator[str]:
        """Every folder below directory ``prefix`` (recursively), empty ones included, which
        :meth:`list` does not show. Nothing by default: an object store has no folders (a
        prefix holding objects shows in :meth:`list`)."""
        return iter(())

    def tree(self, prefix: str) -> tuple[list[Entry], list[str]]:
        """:meth:`list` and :meth:`folders` of ``prefix`` at once (a local backend reads each folder
        once for both: a store's ``refs/`` holds a folder per ref)."""
        return list(self.list(prefix)), list(self.folders(prefix))

    def children(self, prefix: str, after: str = "") -> Iterator[tuple[list[tuple[str, bool]], bool]]:
        """The names directly below directory ``prefix`` that sort after ``after``, in order, page by
        page: each page's (name, whether a file is there: False for a folder, or an object store's
        prefix holding objects) pairs, and whether more pages follow (the next is asked for only when
        the caller goes on). A ref's newest entry is found from the pages at and past a hint, not from
        a listing of its whole history (storage/refs.py). This default derives them from :meth:`list`
        and :meth:`folders`, in one page."""
        cut = len(prefix.rstrip("/")) + 1
        found: dict[str, bool] = {}
        for e in self.list(prefix):
            name, _, below = e.path[cut:].partition("/")
            found[name] = found.get(name, True) and not below  # (an object store's key and prefix alike: a prefix)
        for path in self.folders(prefix):
            found[path[cut:].partition("/")[0]] = False
        yield sorted((n, f) for n, f in found.items() if n > after), False

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove ``path``; absent is not an error."""

    @abstractmethod
    def touch(self, path: str) -> bool:
        """Mark ``path`` as recently used (protects it from a concurrent ``gc``).

        Returns False when ``path`` does not exist (a caller that meant to reuse it must
        write it again).
        """

    # True where recover_condemned() puts objects back (a gc's dry run, which writes nothing,
    # plans for them as the real run will find them: ObjectStore.inventory).
    recovers_condemned: bool = False

    def recover_condemned(self, prefix: str) -> int:
        """Undo what a killed :meth:`delete_if_stale` left half done (nothing by default)."""
        return 0

    def incomplete_uploads(self, before: float) -> tuple[list[Upload], int]:
        """Uploads begun in this store before ``before`` (by the store's clock) and never completed nor
        aborted, and how many younger ones there are: an S3 multipart upload of a writer killed in the
        middle of an object is in no listing, yet its parts are stored (and billed) until it is aborted.
        None where the backend has no such thing (the default)."""
        return [], 0

    def abort_upload(self, upload: Upload) -> bool:
        """End ``upload`` and free its parts: True if this call did (False: it was gone already)."""
        return False

    def delete_if_stale(self, path: str, cutoff: float) -> bool:
        """Delete ``path`` unless it was modified (or touched) at or after ``cutoff``.

        Returns True when deleted. This default checks, then deletes: a touch landing
        between the two is lost. Backends that can rename override it with a protocol
        that cannot lose one (:meth:`LocalBackend.delete_if_stale`).
        """
        try:
            if self.mtime(path) >= cutoff:
                return False
        except FileNotFoundError:
            return False
        self.delete(path)
        return True

    def mtime(self, path: str) -> float:
        """Modification time (seconds since the epoch); 0.0 when the backend cannot tell.
        Raises ``FileNotFoundError`` when absent (where the backend can tell)."""
        return 0.0

    def clock(self, path: str) -> float:
        """Now by the clock that stamps this store's objects, read without writing anything, from
        the answer to a request about ``path`` (one that should be there; absent is no error): what
        a ``gc --dry-run`` judges ages by (storage/gc.py ``store_now``). 0.0 where the backend cannot
        tell that way. A local folder cannot: it is this machine's clock, unless the folder is on
        NFS, whose server stamps files but answers no read with its time."""
        return 0.0

    def flush(self) -> None:
        """Make the names of everything written so far durable (a no-op where writes already are)."""
        return None

    def root_exists(self) -> bool:
        return True

    def local_path(self, path: str) -> str | None:
        """The OS path of ``path`` when the store is a local directory, else None."""
        return None

    def root_is_object(self) -> bool:
        """Whether the root itself names an object (a file), which holds no store (False where
        the backend cannot tell; local directories are checked by path: storage/config.py)."""
        return False

    def outer_store(self, config: str) -> str | None:
        """The URL of the nearest place above this root that holds ``config``: a store this one
        would sit inside. None if there is none, or the backend cannot look above its root
        (local directories are checked by path: storage/config.py)."""
        return None

    # Whether prefetch() makes later reads cheaper: then a reader reads in its own
    # thread, having hinted what comes next, instead of handing reads to a pool.
    prefetches: bool = False

    def prefetch(self, path: str) -> None:
        """Hint that ``path`` will be read soon (no-op by default; never raises)."""
        return None


def relative(full: str, root: str) -> str:
    full_n = full.lstrip("/")
    root_n = root.lstrip("/")
    if root_n and full_n.startswith(root_n + "/"):
        return full_n[len(root_n) + 1 :]
    return full_n




def too_large(path: str, size: int, limit: int) -> StoreFormatError:
    """The error of a :meth:`Backend.read` refused by its ``limit``."""
    return StoreFormatError(f"{path} is {size} bytes, more than any valid object there ({limit})")


def read_error(path: str, e: OSError) -> Exception:
    """Absent (also when a parent is not a directory) stays FileNotFoundError; the rest is a StorageIOError."""
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        return FileNotFoundError(errno.ENOENT, "no such object", path)
    if isinstance(e, IsADirectoryError):
        return e
    return io_error("read", path, e)




def io_error(op: str, path: str, e: OSError) -> StorageIOError:
    if e.errno in DISK_FULL:
        return StorageIOError(f"cannot {op} {path}: the store's disk is full", hint="free space and retry", errno=e.errno)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageIOError(f"cannot {op} {path}: permission denied ({e.strerror})", errno=e.errno)
    return StorageIOError(f"cannot {op} {path}: {e.strerror or e}", retryable=True, errno=e.errno)


def creates_are_exclusive(backend: Backend) -> bool:
    """True where an exclusive create can have only one winner (the metadata index
    relies on it; new chunks are created so where it is true)."""
    cw = getattr(backend, "conditional_writes", None)
    if cw is not None:
        return bool(cw)
    return bool(getattr(backend, "exact_creates", False))
