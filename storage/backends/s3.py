"""The S3 backend: ``s3://bucket/prefix`` through s3fs, with the guarantees the store needs.

* **Atomic visibility.** An object is one PUT (or one completed multipart upload for
  objects of ``MULTIPART_THRESHOLD`` bytes and more): S3 shows it whole or not at all.
* **Exclusive create** (ref entries, the store config) is a PUT with ``If-None-Match: *``.
  A 412 means the name exists -- but possibly because *our own* earlier attempt landed
  and only its response was lost (the client then retried). So on a 412 the object is
  read back: if it holds exactly our bytes (every ref entry carries a unique writer
  token), the create succeeded. Servers without conditional writes: see
  ``conditional_writes`` and docs/format.md.
* **One retry layer.** botocore's and s3fs's own retry loops are switched off; every
  operation is retried here (``storage/retry.py``) on throttling, 5xx, timeouts and
  dropped connections, with exponential backoff, and fails with a retryable
  :class:`StorageIOError` that says so when the attempts run out.
* **Credentials never leak.** Error messages are built here, from the server's error
  code and the object path, and every configured secret is masked in any text taken
  from an exception. Credentials come from the standard places (AWS environment
  variables, ``~/.aws`` config and credentials files, instance roles) or from
  ``storage_options`` (``key``, ``secret``, ``token``, ``endpoint_url``, ``profile``...).
"""

from __future__ import annotations

import errno
import logging
import math
import posixpath
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ckpt_store.storage.backends.base import Data, Entry, joined
from ckpt_store.storage.backends.fsspec_backend import FsspecBackend
from ckpt_store.storage.backends.s3_errors import (
    ACCESS,
    chain,
    client_error,
    is_precondition_failed,
    secrets_in,
    secrets_in_env,
    transient,
)
from ckpt_store.storage.errors import StorageIOError
from ckpt_store.storage.retry import RetryPolicy, call_with_retries

log = logging.getLogger(__name__)
T = TypeVar("T")

# Objects this large go up as a multipart upload with parts of half this size,
# several parts in flight at once (s3fs does the upload). Chunks (4 MiB by default)
# and manifests stay single PUTs.
MULTIPART_THRESHOLD = 16 * 1024 * 1024
# A LIST page holds at most this many keys (S3's limit).
LIST_PAGE = 1000
# What one LIST request costs in HEADs: AWS prices a LIST 12.5x a HEAD, and a full page
# (~250 KB) takes longer to send. A listing is used only where it is cheaper by this measure.
LIST_COST = 10

class S3Backend(FsspecBackend):
    """A store below ``s3://bucket/prefix``. See the module docstring for what it guarantees.

    ``concurrency`` bounds the requests in flight (connection pool, parallel existence
    checks, parts of one upload); ``retry`` says how often and how patiently to repeat a
    failed request; ``conditional_writes=False`` is the fallback for servers that ignore
    or reject ``If-None-Match`` (docs/format.md says what it does and does not guarantee).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, concurrency: int = 16,
                 retry: RetryPolicy | None = None, conditional_writes: bool = True) -> None:
        try:
            import s3fs
        except ImportError:
            raise StorageIOError(f"{url} needs s3fs", hint="install it: pip install 'ckpt-store[s3]'") from None
        opts = dict(storage_options or {})
        self._secrets = secrets_in(opts)
        self.url = url
        self.concurrency = max(1, concurrency)
        self.retry = retry or RetryPolicy()
        self.conditional_writes = conditional_writes
        # Listings are never cached: another process may have added a ref entry since.
        opts.setdefault("skip_instance_cache", True)
        opts.setdefault("use_listings_cache", False)
        if "session" not in opts:
            opts["session"] = _new_session(opts.pop("profile", None))
        cfg = dict(opts.pop("config_kwargs", None) or {})
        cfg.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # one attempt: we retry (storage/retry.py)
        cfg.setdefault("max_pool_connections", max(10, self.concurrency))
        opts["config_kwargs"] = cfg
        opts.setdefault("max_concurrency", max(1, min(8, self.concurrency)))  # parts of one upload
        try:
            self.fs = s3fs.S3FileSystem(**opts)
        except (TypeError, ValueError, KeyError) as e:
            raise StorageIOError(f"bad storage options for {url}: {self._redact(str(e))}") from None
        self.fs.retries = 1  # s3fs's own loop: off (one attempt)
        root = self.fs._strip_protocol(url).rstrip("/")
        self.root = root
        self.bucket, _, self.prefix = root.partition("/")
        if not self.bucket:
            raise StorageIOError(f"{url} names no bucket", hint="use s3://BUCKET/PREFIX")

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None, fsync: bool,
                 remote: dict[str, Any] | None) -> S3Backend:
        return cls(url, storage_options, **(remote or {}))

    # -- plumbing --------------------------------------------------------------
    def _redact(self, text: str) -> str:
        for s in self._secrets | secrets_in_env():
            text = text.replace(s, "***")
        return text

    def _key(self, path: str) -> str:
        return posixpath.join(self.prefix, path) if self.prefix else path

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()`` with retries; any failure left is mapped to a clear error (absent stays FileNotFoundError)."""
        try:
            return call_with_retries(fn, what=f"{op} {self.url}/{path}", policy=self.retry, transient=self._transient)
        except StorageIOError as e:
            e.message = self._redact(e.message)
            raise
        except FileNotFoundError as e:
            if op in ("write", "create") or (client_error(e) or ("",))[0] == "NoSuchBucket" and op != "read":
                raise self._error(op, path, e) from None
            raise FileNotFoundError(errno.ENOENT, "no such object", path) from None
        except Exception as e:  # noqa: BLE001 - every client error becomes a StorageIOError
            raise self._error(op, path, e) from None

    def _transient(self, e: BaseException) -> str | None:
        reason = transient(e)
        return self._redact(reason) if reason is not None else None

    def _error(self, op: str, path: str, e: BaseException) -> Exception:
        where = f"{self.url}/{path}" if path else self.url
        ce = client_error(e)
        code = ce[0] if ce else ""
        if type(e).__name__ == "NoCredentialsError" or any(type(x).__name__ == "NoCredentialsError" for x in chain(e)):
            return StorageIOError(f"cannot {op} {where}: no S3 credentials found",
                                  hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
                                       "or pass --storage-option anon=true for a public bucket")
        if code == "NoSuchBucket":
            return StorageIOError(f"cannot {op} {where}: bucket {self.bucket} does not exist",
                                  hint="create the bucket first (for example `aws s3 mb s3://BUCKET`)")
        if code in ACCESS or isinstance(e, PermissionError) or (ce and ce[1] == 403):
            return StorageIOError(f"cannot {op} {where}: access denied ({code or 'HTTP 403'})",
                                  hint="check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE) "
                                       "and the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url=...)")
        detail = self._redact(str(e).strip() or type(e).__name__)
        return StorageIOError(f"cannot {op} {where}: {detail}")

    def _head(self, path: str) -> dict[str, Any] | None:
        def head() -> dict[str, Any] | None:
            try:
                return self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._key(path))  # type: ignore[no-any-return]
            except FileNotFoundError:
                return None

        return self._call("check", path, head)

    # -- primitives ------------------------------------------------------------
    def root_exists(self) -> bool:
        return bool(next(iter(self._list_keys(""), None)))

    def read(self, path: str) -> bytes:
        return self._call("read", path, lambda: bytes(self.fs.cat_file(self._p(path))))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return self._call("read", path, lambda: bytes(self.fs.cat_file(self._p(path), start=start, end=start + length)))

    def write(self, path: str, data: Data) -> None:
        blob = joined(data)
        self._call("write", path, lambda: self._put(path, blob))

    def _put(self, path: str, blob: bytes, **kw: Any) -> None:
        self.fs.pipe_file(self._p(path), blob, chunksize=MULTIPART_THRESHOLD // 2, **kw)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` only if absent (``If-None-Match: *``); True if this call created it.

        A 412 is read back: the object may be ours, from an attempt whose success
        response was lost before the retry that got the 412. ``data`` must be unique to
        this call for that to tell the two apart (ref entries carry a writer token).
        """
        if not self.conditional_writes:
            return self._create_unconditional(path, data)

        def attempt() -> bool:
            try:
                self._put(path, data, mode="create")
                return True
            except Exception as e:
                if is_precondition_failed(e):
                    return False
                ce = client_error(e)
                if ce is not None and (ce[0] == "NotImplemented" or ce[1] == 501):
                    raise StorageIOError(
                        f"{self.url} does not support conditional writes (If-None-Match)",
                        hint="set CKPT_CONDITIONAL_WRITES=0 to fall back to check-then-write, "
                             "safe only with one writer per ref (docs/format.md)") from None
                raise

        if self._call("create", path, attempt):
            return True
        try:
            return self.read(path) == data
        except FileNotFoundError:
            return False

    def _create_unconditional(self, path: str, data: bytes) -> bool:
        """Fallback without conditional writes: check, write, then read back after a pause.

        Narrows the race to a short window but cannot close it: two writers that both
        pass the check within the window can both believe they won (docs/format.md).
        """
        if self._head(path) is not None:
            return False
        self.write(path, data)
        time.sleep(0.05)
        try:
            return self.read(path) == data
        except FileNotFoundError:
            return False

    def exists(self, path: str) -> bool:
        return self._head(path) is not None

    def size(self, path: str) -> int:
        h = self._head(path)
        if h is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return int(h["ContentLength"])

    def mtime(self, path: str) -> float:
        h = self._head(path)
        if h is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return float(h["LastModified"].timestamp())

    def _list_page(self, prefix: str, token: str | None, delimiter: str) -> dict[str, Any]:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        if delimiter:
            kw["Delimiter"] = delimiter
        return self._call("list", prefix, lambda: self.fs.call_s3("list_objects_v2", **kw))  # type: ignore[no-any-return]

    def _list_keys(self, prefix: str, delimiter: str = "") -> Iterator[Entry]:
        """Objects whose path starts with directory ``prefix`` (one LIST request per 1000)."""
        key_prefix = self._key(prefix).rstrip("/") + "/" if (prefix or self.prefix) else ""
        token: str | None = None
        while True:
            page = self._list_page(key_prefix, token, delimiter)
            for o in page.get("Contents", []):
                rel = o["Key"][len(self.prefix) + 1 :] if self.prefix else o["Key"]
                if rel and not rel.endswith("/"):
                    yield Entry(rel, int(o.get("Size", 0)), float(o["LastModified"].timestamp()))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def list(self, prefix: str) -> Iterator[Entry]:
        yield from self._list_keys(prefix)

    def delete(self, path: str) -> None:
        self._call("delete", path, lambda: self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self._key(path)))

    def touch(self, path: str) -> bool:
        # S3 cannot refresh an object's time in place; gc relies on its grace period
        # there (docs/format.md). Presence is still reported (one HEAD): hot paths check
        # ``touches`` and ask presence in batches instead.
        return self.exists(path)

    def list_all(self, prefix: str, lookups: int) -> set[str] | None:
        """Every path below ``prefix``, if listing them costs less than ``lookups`` HEADs
        (at most ``lookups // LIST_COST`` pages of 1000); None as soon as it would cost more."""
        max_pages = lookups // LIST_COST
        if max_pages < 1:
            return None
        key_prefix = self._key(prefix).rstrip("/") + "/" if (prefix or self.prefix) else ""
        found: set[str] = set()
        token: str | None = None
        for _ in range(max_pages):
            page = self._list_page(key_prefix, token, "")
            for o in page.get("Contents", []):
                found.add(o["Key"][len(self.prefix) + 1 :] if self.prefix else o["Key"])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found
        return None

    def exists_many(self, paths: Iterable[str]) -> set[str]:
        """The subset of ``paths`` that exists, asking S3 as little as possible.

        If the directory holding all of them lists in fewer requests than one HEAD per
        path (priced by ``LIST_COST``), that listing answers. Otherwise paths are grouped
        by directory: listing a directory costs one request per 1000 keys in it, checking
        a path one HEAD; a directory is listed where that is cheaper, priced from the size
        of the most asked directory (listed first). Requests run ``concurrency`` at a time.
        """
        asked = list(dict.fromkeys(paths))
        if not asked:
            return set()
        listed = self.list_all(posixpath.commonpath([posixpath.dirname(p) for p in asked]), len(asked))
        if listed is not None:
            return listed & set(asked)
        by_dir: dict[str, list[str]] = defaultdict(list)
        for p in asked:
            by_dir[posixpath.dirname(p)].append(p)
        found: set[str] = set()
        ordered = sorted(by_dir, key=lambda d: -len(by_dir[d]))
        pages = 1
        first = ordered[0]
        if len(by_dir[first]) >= LIST_COST:
            names = {e.path for e in self._list_keys(first, delimiter="/")}
            found |= names & set(by_dir[first])
            pages = max(1, math.ceil(len(names) / LIST_PAGE))
            ordered = ordered[1:]
        to_list = [d for d in ordered if len(by_dir[d]) >= pages * LIST_COST]
        to_head = [p for d in ordered if len(by_dir[d]) < pages * LIST_COST for p in by_dir[d]]

        def list_dir(d: str) -> set[str]:
            return {e.path for e in self._list_keys(d, delimiter="/")} & set(by_dir[d])

        def head(p: str) -> set[str]:
            return {p} if self.exists(p) else set()

        jobs: list[Callable[[], set[str]]] = [lambda d=d: list_dir(d) for d in to_list]
        jobs += [lambda p=p: head(p) for p in to_head]
        if len(jobs) == 1:
            (only,) = jobs
            return found | only()
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(jobs) or 1), thread_name_prefix="ckpt-s3") as pool:
            for part in pool.map(lambda job: job(), jobs):
                found |= part
        return found


_loader_lock = threading.Lock()
_loader: Any = None


def _new_session(profile: str | None) -> Any:
    """A fresh aiobotocore session (credentials resolved anew) sharing one model loader:
    loading botocore's service models is most of the cost of opening a store (0.6 s)."""
    global _loader
    from aiobotocore.session import AioSession

    session = AioSession(profile=profile) if profile else AioSession()
    with _loader_lock:
        if _loader is None:
            _loader = session.get_component("data_loader")
    session.register_component("data_loader", _loader)
    return session


__all__ = ["MULTIPART_THRESHOLD", "S3Backend", "is_precondition_failed"]
