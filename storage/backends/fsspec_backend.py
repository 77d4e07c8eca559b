"""A store on any other fsspec filesystem (``memory://``, ``gs://``, ...)."""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from ckpt_store.storage.backends.base import (
    Backend,
    Data,
    Entry,
    io_error,
    joined,
    read_error,
    relative,
    too_large,
)
from ckpt_store.storage.errors import MissingDependencyError, StorageIOError, StoreLocationError

_MEMORY_LOCK = threading.Lock()  # (see FsspecBackend._changing)


@contextmanager
def _failing(op: str, path: str) -> Iterator[None]:
    """Around one call of the filesystem: an error of a type its library defines (gcsfs's HttpError, adlfs's Azure
    errors, a user's filesystem's own), the medium failing, is raised as a :class:`StorageIOError`, the type the
    layers above (and the tiers that catch a medium's failures, ``ckpt.snapshot.tiers.caught``) know, as fsspec's
    own filesystems fail with OSError. OSError is left to the method (mapped where it maps it); a builtin type
    (TypeError, KeyError...) is a bug, ours (a wrong argument) or the filesystem's, and is left as it is."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        if type(e).__module__ == "builtins":
            raise
        said = str(e).strip().splitlines()
        # retryable, as an OSError of no known kind is (``io_error``): a server's passing 503 is not damage (a ref
        # entry that cannot be read for good is reported as the store's damage, with advice to move it out)
        raise StorageIOError(f"cannot {op} {path}: {type(e).__name__}{': ' + said[0][:200] if said else ''}",
                             retryable=True) from e


class FsspecBackend(Backend):
    """A store on any fsspec filesystem (``memory://``, ``gs://``, ...).

    ``create_exclusive`` is check-then-write here, which is exact on filesystems
    with one writing process (``memory://``); S3 has its own backend with
    conditional writes (``storage/backends/s3.py``).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        scheme = url.split("://", 1)[0]
        try:
            try:
                fsspec.get_filesystem_class(scheme)
            except ValueError:
                raise StoreLocationError(f"{url}: no backend knows {scheme}:// URLs",
                                         hint="give a local path, s3://BUCKET/PREFIX or another fsspec URL (memory://, gs://...)") from None
            with _failing("open", url):
                fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as e:  # fsspec's own words name the package: "Please install gcsfs to access Google Storage"
            raise MissingDependencyError(f"{scheme}:// stores need a package that is not installed ({e})",
                                         hint="pip install the package it names") from None
        except (TypeError, ValueError) as e:  # options the filesystem does not take, or lacks
            raise StorageIOError(f"bad storage options for {url}: {e}") from None
        except OSError as e:  # filesystems that connect when made (ftp://, sftp://)
            raise io_error("open", url, e) from e
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        # Check-then-write under a lock is exact only with one writing process: memory://.
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.exact_creates = "memory" in protocols
        # memory:// keeps every file of the process in one dict, which its find() copies: a garbage collection
        # during the copy can hand the GIL to a thread writing, and the copy raised "dictionary changed size
        # during iteration" (a push listing its locks while a gc deleted). Its writes, deletes and listings take
        # one lock of the process; other filesystems need none.
        self._changing: AbstractContextManager[Any] = _MEMORY_LOCK if self.exact_creates else nullcontext()

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None, fsync: bool,
                 remote: dict[str, Any] | None) -> FsspecBackend:
        return cls(url, storage_options)

    def _p(self, path: str) -> str:
        return posixpath.join(self.root, path) if path else self.root

    def root_exists(self) -> bool:
        with _failing("read", self.url):
            return bool(self.fs.exists(self.root))

    def read(self, path: str, limit: int | None = None) -> bytes:
        try:
            with _failing("read", path):
                data = bytes(self.fs.cat_file(self._p(path)))
        except OSError as e:  # an unreachable server (http://) fails here first
            raise read_error(path, e) from e
        if limit is not None and len(data) > limit:
            raise too_large(path, len(data), limit)
        return data

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with _failing("read", path):
            return bytes(self.fs.cat_file(self._p(path), start=start, end=start + length))

    def write(self, path: str, data: Data) -> None:
        try:
            with self._changing, _failing("write", path):
                self.fs.pipe_file(self._p(path), joined(data))
        except OSError as e:
            raise io_error("write", path, e) from e

    # Check-then-write is exact only with one writing process (``memory://``); the
    # lock makes it exact across that process's threads.
    _create_lock = threading.Lock()

    def create_exclusive(self, path: str, data: Data) -> bool:
        data = joined(data)
        p = self._p(path)
        with self._create_lock, _failing("write", path):
            if self.fs.exists(p):
                return False
            with self._changing:
                self.fs.pipe_file(p, data)
        return True

    def exists(self, path: str) -> bool:
        with _failing("read", path):
            return bool(self.fs.isfile(self._p(path)))  # a folder there is not an object

    def size(self, path: str) -> int:
        with _failing("read", path):
            return int(self.fs.size(self._p(path)))

    def mtime(self, path: str) -> float:
        try:
            with _failing("read", path):  # (raised, not read as 0.0 below: that is "old", which gc may delete)
                m = self.fs.modified(self._p(path))
            return float(m.timestamp())
        except FileNotFoundError:
            raise  # absent is not "old": gc would delete nothing and report it deleted
        except (NotImplementedError, AttributeError, OSError):
            return 0.0

    def list(self, prefix: str) -> Iterator[Entry]:
        base = self._p(prefix)
        try:
            with self._changing, _failing("list", prefix or self.url):
                found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return
        for full, info in sorted(found.items()):
            if info.get("type") == "directory":
                continue
            rel = relative(full, self.root)
            mt = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
            if hasattr(mt, "timestamp"):
                mt = mt.timestamp()
            yield Entry(rel, int(info.get("size") or 0), float(mt))

    def delete(self, path: str) -> None:
        try:
            with self._changing, _failing("delete", path):
                self.fs.rm_file(self._p(path))
        except FileNotFoundError:
            pass

    def touch(self, path: str) -> bool:
        # Object stores cannot update an object's time in place; writers and gc keep
        # off each other with leases there (storage/leases.py). Presence is still reported.
        return self.exists(path)
