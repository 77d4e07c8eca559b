"""The S3 backend: ``s3://bucket/prefix`` through botocore's threaded client, with the guarantees the store needs.

* **Transport.** botocore's synchronous client on threads, its connection pool as large
  as the requests the store keeps in flight (``concurrency``; botocore's default pool is
  10). Measured on SeaweedFS on loopback (benchmarks/results/s3.md): 22 GETs of 4 MiB,
  16 at a time, ran at 365 MB/s this way against 123 MB/s through s3fs, whose requests
  all run on one asyncio event-loop thread. A body is read straight into the caller's
  buffer (:meth:`S3Backend.read_into`, :meth:`S3Backend.open_read`), no ``bytes`` built on the way.
* **Atomic visibility.** An object is one PUT (or one completed multipart upload for
  objects of ``MULTIPART_THRESHOLD`` bytes and more): S3 shows it whole or not at all.
* **Exclusive create** (ref entries, the store config) is a PUT with ``If-None-Match: *``.
  A 412 means the name exists -- but possibly because *our own* earlier attempt landed
  and only its response was lost (the client then retried). So on a 412 the object is
  read back: if it holds exactly our bytes (every ref entry carries a unique writer
  token), the create succeeded. Servers without conditional writes: see
  ``conditional_writes`` and docs/format.md.
* **One retry layer.** botocore's own retry loop is switched off; every operation is
  retried here (``storage/retry.py``) on throttling, 5xx, timeouts and dropped
  connections, with exponential backoff, and fails with a retryable
  :class:`StorageIOError` that says so when the attempts run out.
* **Credentials never leak.** Error messages are built here, from the server's error
  code and the object path, and every configured secret is masked in any text taken
  from an exception. Credentials come from the standard places (AWS environment
  variables, ``~/.aws`` config and credentials files, instance roles) or from
  ``storage_options`` (``key``, ``secret``, ``token``, ``endpoint_url``, ``profile``,
  ``anon``, ``client_kwargs``, ``config_kwargs``: the names s3fs uses).

:class:`S3Backend` is opened here, where its requests are retried and their errors mapped;
its reads are in s3_reads.py, its writes in s3_writes.py and its listings in s3_listing.py.
"""

from __future__ import annotations

import copy
import errno
import logging
import posixpath
import re
import threading
from collections.abc import Callable
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

from ckpt_store.storage.backends.base import Backend
from ckpt_store.storage.backends.s3_direct import HEAD, ClientOnly, DirectRequests
from ckpt_store.storage.backends.s3_errors import (
    ACCESS,
    chain,
    client_error,
    is_precondition_failed,
    secrets_in,
    secrets_in_env,
    timed_out,
    transient,
)
from ckpt_store.storage.backends.s3_listing import S3Listing
from ckpt_store.storage.backends.s3_reads import ObjectReader, S3Reads
from ckpt_store.storage.backends.s3_writes import MULTIPART_THRESHOLD, S3Writes
from ckpt_store.storage.errors import StorageIOError, StoreLocationError
from ckpt_store.storage.retry import RetryPolicy, call_with_retries, progressed

log = logging.getLogger(__name__)
T = TypeVar("T")

# s3fs options that mean nothing here (listings are never cached anyway): accepted, ignored.
_IGNORED_OPTIONS = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_concurrency",
                    "default_block_size", "default_fill_cache", "version_aware", "cache_regions"}
_MISSING = {"NoSuchKey", "404", "NotFound"}
# What botocore accepts as a bucket name (AWS itself is stricter: it answers for those).
_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")
# Operations whose 404 is no missing object: a listing, a write (S3 answers neither with 404).
_NOT_OF_ONE_OBJECT = ("write", "create", "list")


def _direct_requests(client: Any, on: bool) -> DirectRequests | ClientOnly:
    """Direct GETs, HEADs, PUTs and LISTs for ``client`` (s3_direct.py), unless switched off or
    this botocore lacks what they use."""
    if not on:
        return ClientOnly()
    try:
        return DirectRequests(client)
    except (AttributeError, ImportError) as e:
        log.debug("direct S3 requests unavailable: %s", e)
        return ClientOnly()


class S3Backend(S3Reads, S3Writes, S3Listing, Backend):
    """A store below ``s3://bucket/prefix``. See the module docstring for what it guarantees.

    ``concurrency`` bounds the requests in flight (connection pool, parallel existence
    checks, parts of one upload); ``retry`` says how often and how patiently to repeat a
    failed request; ``conditional_writes=False`` is the fallback for servers that ignore
    or reject ``If-None-Match`` (docs/format.md says what it does and does not guarantee);
    ``direct=False`` sends every request through botocore (see s3_direct.py).
    """

    streams = True
    caches = True
    lists_only_objects = True
    lists_from_a_name = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, concurrency: int = 16,
                 retry: RetryPolicy | None = None, conditional_writes: bool = True, direct: bool = True) -> None:
        try:
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError
        except ImportError:
            raise StorageIOError(f"{url} needs botocore", hint="install it: pip install 'ckpt-store[s3]'") from None
        opts = dict(storage_options or {})
        self._secrets = secrets_in(opts)
        self.url = url
        self.concurrency = max(1, concurrency)
        self.retry = retry or RetryPolicy()
        self.conditional_writes = conditional_writes
        root = url.split("://", 1)[1] if "://" in url else url
        self.root = root.strip("/")
        self.bucket, _, self.prefix = self.root.partition("/")
        self.prefix = self.prefix.strip("/")
        if not self.bucket:
            raise StorageIOError(f"{url} names no bucket", hint="use s3://BUCKET/PREFIX")
        if "@" in self.bucket:  # s3://KEY:SECRET@bucket: never shown, not even in botocore's "Invalid bucket name"
            raise StorageIOError(f"s3://...@{self.bucket.rsplit('@', 1)[1]}: a store URL carries no credentials "
                                 "(what came before '@' is not shown)",
                                 hint="give them in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                                      "or --storage-option key=... --storage-option secret=...")
        if not _BUCKET.fullmatch(self.bucket):
            raise StorageIOError(f"{url}: {self.bucket!r} is not a bucket name",
                                 hint="a bucket name has letters, digits, '.', '-' and '_' only: s3://BUCKET/PREFIX")
        parts = self.prefix.split("/") if self.prefix else []
        if any(p in ("", ".", "..") for p in parts) or any(ord(c) < 32 or c == "\x7f" for c in self.prefix):
            # S3 keys are not paths: SeaweedFS folds a//b into a/b and refuses . and .., AWS keeps them as
            # they are; a store written under one reading and listed under the other loses its objects.
            plain = "/".join(q for q in ("".join(c for c in p if c.isprintable()) for p in parts) if q not in ("", ".", ".."))
            raise StoreLocationError(f"{url!r}: the prefix has an empty, '.' or '..' segment or a control character, "
                                     "which S3 servers read differently", hint=f"write it plainly: s3://{self.bucket}/{plain}")
        # The store's own name, one for each spelling of it (s3://b/st/, s3://b//st): what tells two stores apart.
        scheme = url.split("://", 1)[0].lower() if "://" in url else "s3"
        self.url = f"{scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        for k in ("key", "secret", "token", "endpoint_url", "region_name", "profile"):
            if opts.get(k) is not None and not isinstance(opts[k], str):  # (its value unshown: it may be a credential)
                raise StorageIOError(f"bad storage options for {url}: {k} must be text, not a {type(opts[k]).__name__}",
                                     hint=f"--storage-option takes a value that reads as JSON (a number, say) as "
                                          f"JSON: quote it, --storage-option '{k}=\"...\"'")
        if not isinstance(opts.get("anon", False), bool):  # "maybe" or "false" is no reason to drop the credentials
            raise StorageIOError(f"bad storage options for {url}: anon must be true or false, not {opts['anon']!r}")
        try:
            session = _new_session(opts.pop("profile", None))
            client_kw = dict(opts.pop("client_kwargs", None) or {})
            cfg = dict(opts.pop("config_kwargs", None) or {})
            for ours, theirs in (("key", "aws_access_key_id"), ("secret", "aws_secret_access_key"),
                                 ("token", "aws_session_token"), ("endpoint_url", "endpoint_url"),
                                 ("region_name", "region_name")):
                if opts.get(ours) is not None:
                    client_kw[theirs] = opts.pop(ours)
                opts.pop(ours, None)
            if opts.pop("anon", False):
                from botocore import UNSIGNED

                cfg["signature_version"] = UNSIGNED
            for k in _IGNORED_OPTIONS:
                opts.pop(k, None)
            if opts:
                raise TypeError(f"unknown option(s) {', '.join(sorted(opts))}")
            cfg.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # one attempt: we retry (storage/retry.py)
            cfg.setdefault("max_pool_connections", max(10, self.concurrency))
            if self.retry.deadline is not None:  # one wait never outlasts the request's deadline (botocore: 60 s)
                cfg.setdefault("connect_timeout", min(60.0, self.retry.deadline))
                cfg.setdefault("read_timeout", min(60.0, self.retry.deadline))
            # Every chunk is verified by its BLAKE3 id on read; a CRC32 per request on top buys nothing.
            cfg.setdefault("request_checksum_calculation", "when_required")
            cfg.setdefault("response_checksum_validation", "when_required")
            client_kw.setdefault("region_name", session.get_config_variable("region") or "us-east-1")
            self.client = session.create_client("s3", config=Config(**cfg), **client_kw)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise StorageIOError(f"bad storage options for {url}: {self._redact(str(e))}") from None
        except BotoCoreError as e:  # a profile not found, a config file that does not parse, a key without its secret
            raise StorageIOError(f"cannot open {url}: {self._redact(str(e))}",
                                 hint="check the AWS configuration: AWS_PROFILE, AWS_CONFIG_FILE, "
                                      "AWS_SHARED_CREDENTIALS_FILE, and the key, secret and profile given "
                                      "with --storage-option") from None
        self._direct = _direct_requests(self.client, direct)
        self._parts = None  # thread pool for the parts of multipart uploads, made on first use
        self._parts_lock = threading.Lock()

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
            if op in _NOT_OF_ONE_OBJECT:
                raise self._error(op, path, e) from None
            raise FileNotFoundError(errno.ENOENT, "no such object", path) from None
        except Exception as e:  # noqa: BLE001 - every client error becomes a StorageIOError
            code, status = client_error(e) or ("", 0)
            if code in _MISSING or (not code and status == 404) or (code == "NoSuchBucket" and op == "read"):
                if op not in _NOT_OF_ONE_OBJECT:
                    raise FileNotFoundError(errno.ENOENT, "no such object", path) from None
            raise self._error(op, path, e) from None

    def _transient(self, e: BaseException) -> str | None:
        reason = transient(e)
        if reason is not None and not timed_out(e):
            progressed()  # the server answered (5xx, throttling) or the connection broke: not silence
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
        if code in _MISSING or (ce and ce[1] == 404):
            # S3 answers a listing of a bucket that exists, or a write into one, never with 404 (and a
            # missing bucket with NoSuchBucket): this endpoint is no S3 server, or not the one meant.
            endpoint = self._redact(str(self.client.meta.endpoint_url))
            return StorageIOError(f"cannot {op} {where}: {endpoint} answered 404 Not Found (error code "
                                  f"{code or 'none'}), which no S3 server answers to a {op}",
                                  hint=f"check that {endpoint} is the S3 endpoint (AWS_ENDPOINT_URL or --storage-option "
                                       f"endpoint_url=...) and that bucket {self.bucket} exists there")
        detail = self._redact(str(e).strip() or type(e).__name__)
        return StorageIOError(f"cannot {op} {where}: {detail}")

    def _head(self, path: str) -> dict[str, Any] | None:
        key = self._key(path)

        def client() -> dict[str, Any] | None:
            try:
                return self.client.head_object(Bucket=self.bucket, Key=key)  # type: ignore[no-any-return]
            except Exception as e:
                if (client_error(e) or ("",))[0] in _MISSING:
                    return None
                raise

        def head() -> dict[str, Any] | None:
            direct = self._direct
            r, answer = direct.call(HEAD, key, lambda: direct.head(key), (200, 404), client)
            if r is None:
                return answer
            if r.status_code == 404:
                direct.finish(r)
                return None
            return direct.headers(r)

        return self._call("check", path, head)

    # -- primitives ------------------------------------------------------------
    def root_exists(self) -> bool:
        return bool(next(iter(self._list_keys(""), None)))

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

    def written(self, path: str) -> float | None:
        h = self._head(path)
        return None if h is None else float(h["LastModified"].timestamp())

    def clock(self, path: str) -> float:
        """The server's time, from the ``Date`` header of its answer to a HEAD of ``path`` (a 404
        has one too), through the client or sent directly; 0.0 if the answer has none that parses.
        Whole seconds, rounded down, as ``LastModified`` is."""
        key = self._key(path)

        def client() -> Any:
            try:
                answer = self.client.head_object(Bucket=self.bucket, Key=key)
            except Exception as e:
                if (client_error(e) or ("",))[0] not in _MISSING:
                    raise
                answer = next((x.response for x in chain(e) if isinstance(getattr(x, "response", None), dict)), {})
            return (answer.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date")

        def head() -> Any:
            direct = self._direct
            r, answer = direct.call(HEAD, key, lambda: direct.head(key), (200, 404), client)
            if r is None:
                return answer
            direct.finish(r)
            return r.headers.get("date")

        date = self._call("check", path, head)
        try:
            when = parsedate_to_datetime(date)
            return when.replace(tzinfo=when.tzinfo or timezone.utc).timestamp()  # (HTTP dates are GMT)
        except (TypeError, ValueError, OverflowError):
            return 0.0

    def delete(self, path: str) -> None:
        self._call("delete", path, lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(path)))

    def _at(self, prefix: str) -> S3Backend:
        """This backend at another prefix of its bucket (the same client)."""
        other = copy.copy(self)
        other.prefix = prefix
        other.url = f"{self.url.split('://', 1)[0]}://{self.bucket}/{prefix}".rstrip("/")
        return other

    def root_is_object(self) -> bool:
        """Whether the prefix itself is an object's key (s3://b/models/w.safetensors); one HEAD."""
        if not self.prefix:
            return False
        parent, _, name = self.prefix.rpartition("/")
        try:
            return self._at(parent).exists(name)
        except StorageIOError as e:  # a user allowed only below the prefix may not look at it
            log.debug("cannot look for an object at %s: %s", self.url, e)
            return False

    def outer_store(self, config: str) -> str | None:
        """The nearest prefix above this one (up to the bucket's root) that holds ``config``; one HEAD each."""
        parts = self.prefix.split("/") if self.prefix else []
        for n in range(len(parts) - 1, -1, -1):
            above = self._at("/".join(parts[:n]))
            try:
                if above.exists(config):
                    return above.url
            except StorageIOError as e:  # a user allowed only below some prefix may not look above it
                log.debug("cannot look for a store at %s: %s", above.url, e)
        return None

    def touch(self, path: str) -> bool:
        # S3 cannot refresh an object's time in place; writers and gc keep off each
        # other with leases there (storage/leases.py). Presence is still reported (one HEAD): hot paths check
        # ``touches`` and ask presence in batches instead.
        return self.exists(path)


_loader_lock = threading.Lock()
_loader: Any = None


def _new_session(profile: str | None) -> Any:
    """A fresh botocore session (credentials resolved anew) sharing one model loader:
    loading botocore's service models is most of the cost of opening a store (0.6 s)."""
    global _loader
    import botocore.session

    session = botocore.session.Session(profile=profile) if profile else botocore.session.get_session()
    with _loader_lock:
        if _loader is None:
            _loader = session.get_component("data_loader")
    session.register_component("data_loader", _loader)
    return session


__all__ = ["MULTIPART_THRESHOLD", "ObjectReader", "S3Backend", "is_precondition_failed"]
