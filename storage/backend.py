"""Backends: the few byte-level primitives the store needs, over a local directory or fsspec.

A backend knows paths relative to the store root and bytes; nothing else. Every
write is atomic: a reader never sees a half-written object under its final name.

* :class:`LocalBackend` uses the OS directly (temp file + fsync + rename; exclusive
  create through ``link``), which is both faster and stricter than going
  through fsspec's local filesystem.
* :class:`FsspecBackend` serves any other fsspec URL (``memory://``, ``gs://`` ...).
* ``s3://`` goes to :class:`storage.s3.S3Backend` (conditional writes, retries,
  batched existence checks), loaded only when an S3 store is opened.
"""

from __future__ import annotations

import errno
import os
import posixpath
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Union

from ckpt_store.storage.errors import StorageIOError, StoreLocationError

# What write() takes: bytes, or a tuple of buffers whose concatenation is the file.
Data = Union[bytes, bytearray, memoryview, tuple[Any, ...]]


def joined(data: Data) -> bytes:
    """``data`` as one bytes object (for backends that send a single body)."""
    return b"".join(data) if isinstance(data, tuple) else bytes(data)

# Prefix of an object gc is deleting (LocalBackend.delete_if_stale); it is a temporary.
CONDEMNED = ".tmp-gc-"


@dataclass(frozen=True)
class Entry:
    """One file found by :meth:`Backend.list`: its path relative to the root, size and mtime."""

    path: str
    size: int
    mtime: float


class Backend(ABC):
    """Byte-level access below a store root. Paths are ``/``-separated and relative."""

    url: str
    # Requests worth having in flight at once. 1 for local stores, where the caller's
    # own worker counts apply; remote stores (latency-bound) say how many they allow.
    concurrency: int = 1
    # True where touch() refreshes an object's modification time (and reports presence
    # in the same call); object stores cannot, and callers there ask presence in batches.
    touches: bool = False

    @abstractmethod
    def read(self, path: str) -> bytes:
        """Whole file. Raises ``FileNotFoundError`` when absent."""

    @abstractmethod
    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer at end of file)."""

    # True where read_into() reads straight into the buffer (no intermediate copy) and
    # a small read before it is cheap: callers then read a header first, then the body.
    reads_into: bool = False

    def read_into(self, path: str, start: int, buf: memoryview) -> int:
        """Fill ``buf`` with the file's bytes from ``start`` (as many as there are); return the file's size.

        Local stores read straight into ``buf`` (a tensor's memory, say) with no
        intermediate copy; others read the file and copy.
        """
        data = self.read(path)
        part = memoryview(data)[start : start + len(buf)]
        buf[: len(part)] = part
        return len(data)

    @abstractmethod
    def write(self, path: str, data: Data) -> None:
        """Atomically create or replace ``path`` with ``data`` (durable on return).

        ``data`` may be a tuple of buffers: the file is their concatenation (a chunk's
        header and payload are written without joining them first)."""

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Atomically create ``path`` only if absent. Returns False if it existed."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    def exists_many(self, paths: Iterable[str]) -> set[str]:
        """The subset of ``paths`` that exists. Remote backends batch this (one listing
        of a directory instead of a request per path, where that is cheaper)."""
        return {p for p in paths if self.exists(p)}

    def list_all(self, prefix: str, lookups: int) -> set[str] | None:
        """Every path below ``prefix`` when one listing is cheaper than ``lookups`` single
        existence checks, else None. Only remote stores say yes (a local check is cheap)."""
        return None

    @abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes. Raises ``FileNotFoundError`` when absent."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[Entry]:
        """Every file below directory ``prefix`` (recursively); nothing if it does not exist."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove ``path``; absent is not an error."""

    @abstractmethod
    def touch(self, path: str) -> bool:
        """Mark ``path`` as recently used (protects it from a concurrent ``gc``).

        Returns False when ``path`` does not exist (a caller that meant to reuse it must
        write it again).
        """

    def recover_condemned(self, prefix: str) -> int:
        """Undo what a killed :meth:`delete_if_stale` left half done (nothing by default)."""
        return 0

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
        """Modification time (seconds since the epoch); 0.0 when the backend cannot tell."""
        return 0.0

    def flush(self) -> None:
        """Make the names of everything written so far durable (a no-op where writes already are)."""
        return None

    def root_exists(self) -> bool:
        return True

    def local_path(self, path: str) -> str | None:
        """The OS path of ``path`` when the store is a local directory, else None."""
        return None

    # Whether prefetch() makes later reads cheaper: then a reader reads in its own
    # thread, having hinted what comes next, instead of handing reads to a pool.
    prefetches: bool = False

    def prefetch(self, path: str) -> None:
        """Hint that ``path`` will be read soon (no-op by default; never raises)."""
        return None


class LocalBackend(Backend):
    """A store in a local directory. ``fsync`` makes every write durable before it is visible."""

    touches = True
    prefetches = hasattr(os, "posix_fadvise")

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        self.fsync = fsync
        self._made_dirs: set[str] = set()
        self._dirty_dirs: set[str] = set()  # directories with renames not yet fsynced
        self._lock = threading.Lock()

    def _p(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    def local_path(self, path: str) -> str | None:
        return self._p(path)

    def root_exists(self) -> bool:
        return os.path.isdir(self.root)

    def _ensure_dir(self, d: str) -> None:
        if d in self._made_dirs:
            return
        os.makedirs(d, exist_ok=True)
        with self._lock:
            self._made_dirs.add(d)

    def _write_temp(self, final: str, data: Data) -> str:
        d = os.path.dirname(final)
        self._ensure_dir(d)
        tmp = os.path.join(d, f".tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in data if isinstance(data, tuple) else (data,):
                view = memoryview(part).cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)
        return tmp

    def read(self, path: str) -> bytes:
        try:
            with open(self._p(path), "rb") as f:
                return f.read()
        except OSError as e:
            raise _read_error(path, e) from e

    def _open_read(self, path: str) -> int:
        try:
            return os.open(self._p(path), os.O_RDONLY)
        except OSError as e:
            raise _read_error(path, e) from e

    def read_range(self, path: str, start: int, length: int) -> bytes:
        fd = self._open_read(path)
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)

    reads_into = True

    def prefetch(self, path: str) -> None:
        # The kernel starts reading the file into the page cache and returns at once, so
        # one thread can keep many reads in flight (a queue deep enough for an SSD or a
        # network disk) without a thread per read.
        try:
            fd = os.open(self._p(path), os.O_RDONLY)
        except OSError:
            return  # a missing chunk is reported by the read itself
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def read_into(self, path: str, start: int, buf: memoryview) -> int:
        fd = self._open_read(path)
        try:
            size = os.fstat(fd).st_size
            pos, end = 0, min(len(buf), max(0, size - start))
            while pos < end:
                n = os.preadv(fd, [buf[pos:end]], start + pos)
                if n == 0:  # the file shrank under us: the caller's length check sees it
                    break
                pos += n
            return size
        except OSError as e:
            raise _read_error(path, e) from e
        finally:
            os.close(fd)

    def write(self, path: str, data: Data) -> None:
        final = self._p(path)
        try:
            tmp = self._write_temp(final, data)
            os.replace(tmp, final)
        except OSError as e:
            raise _io_error("write", path, e) from e
        self._renamed(final)

    def _renamed(self, final: str) -> None:
        if self.fsync:
            with self._lock:
                self._dirty_dirs.add(os.path.dirname(final))

    def flush(self) -> None:
        """fsync every directory that gained a name since the last flush.

        A file's data is fsynced before its rename; the rename itself is durable only
        once its directory is. Batching this per commit costs one fsync per directory
        touched instead of one per object.
        """
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        for d in sorted(dirs):
            try:
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        final = self._p(path)
        try:
            tmp = self._write_temp(final, data)
        except OSError as e:
            raise _io_error("write", path, e) from e
        try:
            os.link(tmp, final)  # atomic, fails if the name exists, never half-written
            self._renamed(final)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            raise _io_error("write", path, e) from e
        finally:
            _unlink_quiet(tmp)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._p(path))

    def size(self, path: str) -> int:
        return os.stat(self._p(path)).st_size

    def mtime(self, path: str) -> float:
        return os.stat(self._p(path)).st_mtime

    def list(self, prefix: str) -> Iterator[Entry]:
        base = self._p(prefix) if prefix else self.root
        stack = [base]
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(d)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted while we listed
                    rel = os.path.relpath(e.path, self.root).replace(os.sep, "/")
                    yield Entry(rel, st.st_size, st.st_mtime)

    def delete(self, path: str) -> None:
        _unlink_quiet(self._p(path))

    def touch(self, path: str) -> bool:
        p = self._p(path)
        try:
            os.utime(p)
            # utime resolves the name before it updates the inode: a gc may condemn and
            # unlink the object in between, and utime still succeeds on the unlinked
            # inode. Looking the name up again afterwards closes that window.
            os.stat(p)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise _io_error("touch", path, e) from e

    def delete_if_stale(self, path: str, cutoff: float) -> bool:
        """Condemn, re-check, then delete or restore: a concurrent touch is never lost.

        The object is first renamed to a ``.tmp-gc-`` name in its directory. A writer
        that touches it after that finds it missing and writes it again; a touch that
        landed before the rename shows in the mtime read *after* it, and the object is
        linked back under its name (if a writer has not already put an identical copy
        there). The window in which the name is absent is a few system calls long;
        commit retries its presence check across it (storage/commit.py).
        """
        final = self._p(path)
        try:
            if os.stat(final).st_mtime >= cutoff:
                return False  # touched since the plan: the cheap check first
        except FileNotFoundError:
            return False
        # The name keeps the object's name, so a gc killed mid-way can put it back
        # (recover_condemned) instead of losing an object a writer had just touched.
        condemned = os.path.join(os.path.dirname(final), f"{CONDEMNED}{uuid.uuid4().hex}-{os.path.basename(final)}")
        try:
            os.rename(final, condemned)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _io_error("delete", path, e) from e
        try:
            if os.stat(condemned).st_mtime >= cutoff:
                try:
                    os.link(condemned, final)
                except FileExistsError:
                    pass  # a writer put it back already: same name, same bytes
                return False
            return True
        finally:
            _unlink_quiet(condemned)

    def recover_condemned(self, prefix: str) -> int:
        """Put back objects a killed gc left condemned below ``prefix``. Returns how many."""
        n = 0
        for e in list(self.list(prefix)):
            head, _, name = e.path.rpartition("/")
            if not name.startswith(CONDEMNED):
                continue
            original = name[len(CONDEMNED) :].partition("-")[2]
            if original:
                src = self._p(e.path)
                try:
                    os.link(src, self._p(f"{head}/{original}" if head else original))
                    n += 1
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    continue
                _unlink_quiet(src)
        return n


class FsspecBackend(Backend):
    """A store on any fsspec filesystem (``memory://``, ``gs://``, ...).

    ``create_exclusive`` is check-then-write here, which is exact on filesystems
    with one writing process (``memory://``); S3 has its own backend with
    conditional writes (``storage/s3.py``).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def _p(self, path: str) -> str:
        return posixpath.join(self.root, path) if path else self.root

    def root_exists(self) -> bool:
        return bool(self.fs.exists(self.root))

    def read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(self._p(path)))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return bytes(self.fs.cat_file(self._p(path), start=start, end=start + length))

    def write(self, path: str, data: Data) -> None:
        try:
            self.fs.pipe_file(self._p(path), joined(data))
        except OSError as e:
            raise _io_error("write", path, e) from e

    # Check-then-write is exact only with one writing process (``memory://``); the
    # lock makes it exact across that process's threads.
    _create_lock = threading.Lock()

    def create_exclusive(self, path: str, data: bytes) -> bool:
        p = self._p(path)
        with self._create_lock:
            if self.fs.exists(p):
                return False
            self.fs.pipe_file(p, data)
        return True

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._p(path)))

    def size(self, path: str) -> int:
        return int(self.fs.size(self._p(path)))

    def mtime(self, path: str) -> float:
        try:
            m = self.fs.modified(self._p(path))
            return float(m.timestamp())
        except (NotImplementedError, AttributeError, OSError):
            return 0.0

    def list(self, prefix: str) -> Iterator[Entry]:
        base = self._p(prefix)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return
        for full, info in sorted(found.items()):
            if info.get("type") == "directory":
                continue
            rel = _relative(full, self.root)
            mt = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
            if hasattr(mt, "timestamp"):
                mt = mt.timestamp()
            yield Entry(rel, int(info.get("size") or 0), float(mt))

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(self._p(path))
        except FileNotFoundError:
            pass

    def touch(self, path: str) -> bool:
        # Object stores cannot update an object's time in place; gc relies on the
        # grace period there (docs/format.md). Presence is still reported.
        return self.exists(path)


def _relative(full: str, root: str) -> str:
    full_n = full.lstrip("/")
    root_n = root.lstrip("/")
    if root_n and full_n.startswith(root_n + "/"):
        return full_n[len(root_n) + 1 :]
    return full_n


def _read_error(path: str, e: OSError) -> Exception:
    """Absent (also when a parent is not a directory) stays FileNotFoundError; the rest is a StorageIOError."""
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        return FileNotFoundError(errno.ENOENT, "no such object", path)
    if isinstance(e, IsADirectoryError):
        return e
    return _io_error("read", path, e)


def _unlink_quiet(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def _io_error(op: str, path: str, e: OSError) -> StorageIOError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageIOError(f"cannot {op} {path}: the store's disk is full", hint="free space and retry")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageIOError(f"cannot {op} {path}: permission denied ({e.strerror})")
    return StorageIOError(f"cannot {op} {path}: {e.strerror or e}", retryable=True)


def open_backend(url: str, *, storage_options: dict[str, Any] | None = None, fsync: bool = True,
                 remote: dict[str, Any] | None = None) -> Backend:
    """The backend for ``url``: a plain path or ``file://`` is local, ``s3://`` is
    :class:`storage.s3.S3Backend` (``remote`` holds its ``concurrency``, ``retry`` and
    ``conditional_writes``), anything else goes to fsspec."""
    if not url.strip() or url.strip() == "file://":
        # An empty --store would otherwise mean the current directory, silently.
        raise StoreLocationError("empty store URL", hint="give a path or URL, e.g. --store ./ckpt-store")
    if "://" not in url:
        return LocalBackend(url, fsync=fsync)
    if url.startswith("file://"):
        return LocalBackend(url[len("file://") :], fsync=fsync)
    if url.startswith(("s3://", "s3a://")):
        from ckpt_store.storage.s3 import S3Backend

        return S3Backend(url, storage_options, **(remote or {}))
    return FsspecBackend(url, storage_options)


__all__ = ["Backend", "Entry", "FsspecBackend", "LocalBackend", "open_backend"]
