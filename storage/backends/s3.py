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
"""

from __future__ import annotations

import copy
import errno
import http.client
import logging
import math
import posixpath
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

from ckpt_store.storage.backends.base import Backend, Data, Entry, joined, too_large
from ckpt_store.storage.backends.s3_direct import GET, HEAD, LIST, PUT, ClientOnly, DirectRequests
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
from ckpt_store.storage.backends.watchdog import MIN_RATE, allowed, socket_of, watch
from ckpt_store.storage.errors import StorageIOError, StoreLocationError
from ckpt_store.storage.retry import RetryPolicy, call_with_retries, progressed

log = logging.getLogger(__name__)
T = TypeVar("T")

# Objects this large go up as a multipart upload with parts of half this size,
# several parts in flight at once. Chunks (4 MiB by default) and manifests stay single PUTs.
MULTIPART_THRESHOLD = 16 * 1024 * 1024
# A LIST page holds at most this many keys (S3's limit).
LIST_PAGE = 1000
# What one LIST request costs in HEADs: AWS prices a LIST 12.5x a HEAD, and a full page
# (~250 KB) takes longer to send. A listing is used only where it is cheaper by this measure.
LIST_COST = 10
# s3fs options that mean nothing here (listings are never cached anyway): accepted, ignored.
_IGNORED_OPTIONS = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_concurrency",
                    "default_block_size", "default_fill_cache", "version_aware", "cache_regions"}
_MISSING = {"NoSuchKey", "404", "NotFound"}
# What botocore accepts as a bucket name (AWS itself is stricter: it answers for those).
_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")
# Operations whose 404 is no missing object: a listing, a write (S3 answers neither with 404).
_NOT_OF_ONE_OBJECT = ("write", "create", "list")


class ObjectReader:
    """An open GET: ``size`` bytes of body to take with :meth:`readinto` (then :meth:`close`).

    The body is read off the socket straight into the caller's buffer: urllib3's
    ``readinto`` reads into a new ``bytes`` of the size asked and copies that over (with
    http.client, two copies and a fresh allocation per read), so where the response
    allows it (:func:`_socket_reader`) the reads go to http.client's own ``readinto``
    below it. Measured on SeaweedFS on loopback, 64 GETs of 4 MiB on 16 threads: 0.46 s
    of client CPU through urllib3, 0.30 s this way.
    """

    def __init__(self, body: Any, size: int, patience: float = 60.0) -> None:
        self._body = body
        self.size = size
        self._direct = _socket_reader(body)
        # The whole body by then, or its socket is shut down and the read reports a timeout.
        self._limit = allowed(patience, size)
        self._deadline = watch(socket_of(getattr(getattr(body, "_raw_stream", None), "_fp", None)), self._limit)

    def readinto(self, buf: memoryview) -> int:
        """Fill ``buf`` from the body; returns the bytes read (short only at the end of the body)."""
        got = 0
        n = len(buf)
        read = self._body.readinto if self._direct is None else self._read_direct
        try:
            while got < n:
                k = read(buf[got:])
                if not k:
                    break
                got += k
                progressed()  # a slow body that moves on is no server that stopped answering
        except Exception:
            self._timed_out()
            raise
        if got < n:
            self._timed_out()
        return got

    def read_all(self) -> bytes:
        """The whole body, as botocore builds it (one copy off the socket); short is an error."""
        try:
            data = self._body.read()
        except Exception:
            self._timed_out()
            raise
        if len(data) != self.size:
            self._timed_out()
            raise ConnectionResetError(f"short body: {len(data)} of {self.size} bytes")
        return data  # type: ignore[no-any-return]

    def _timed_out(self) -> None:
        if self._deadline.fired:
            raise TimeoutError(f"a body of {self.size} bytes was not in after {self._limit:.1f} s "
                               f"(it came slower than {MIN_RATE >> 10} KiB/s)")

    def _read_direct(self, buf: memoryview) -> int:
        try:
            return int(self._direct.readinto(buf))  # type: ignore[union-attr]
        except (TimeoutError, ConnectionError):
            raise
        except (OSError, http.client.HTTPException) as e:  # what urllib3 would report as a dropped connection
            raise ConnectionResetError(f"reading the response body: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self._deadline.cancel()
        raw = getattr(self._body, "_raw_stream", None)
        if self._direct is not None and self._direct.isclosed() and raw is not None and not self._deadline.fired:
            raw.release_conn()  # read to its end: the connection goes back to the pool
        self._body.close()  # otherwise closes the connection: a body left half read cannot be reused


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


def _socket_reader(body: Any) -> Any:
    """The http.client response under botocore's ``StreamingBody`` and urllib3's response,
    when the body can be read from it directly: a plain (not chunked, not encoded) body of
    which nothing has been read yet, with no response checksum for botocore to check. Else
    None (then reads go through urllib3)."""
    if hasattr(body, "_checksum"):
        return None  # botocore checks a response checksum on this body (config_kwargs asked for it): let it
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or fp.chunked or fp.length is None:
        return None
    headers = getattr(raw, "headers", None) or {}
    if headers.get("content-encoding", "identity").lower() != "identity" or getattr(raw, "_fp_bytes_read", None) != 0 \
            or len(getattr(raw, "_decoded_buffer", ())) or not callable(getattr(raw, "release_conn", None)):
        return None
    return fp


class S3Backend(Backend):
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
    page_keys = 0  # keys a LIST page may hold; 0: the server's maximum (1,000 on S3). Tests page with fewer.

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

    def _get(self, path: str, start: int = 0, length: int | None = None) -> tuple[Any, int, int]:
        """(body, bytes in the body, size of the object) of a GET of ``path`` from ``start``.

        Sent directly (storage/backends/s3_direct.py) once the client has shown how."""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(path)}
        if start or length is not None:
            kw["Range"] = f"bytes={start}-" + ("" if length is None else str(start + length - 1))
        direct = self._direct
        try:
            r, answer = direct.call(GET, kw["Key"], lambda: direct.get(kw["Key"], kw.get("Range")), (200, 206, 416),
                                    lambda: self.client.get_object(**kw))
        except Exception as e:
            if (client_error(e) or ("", 0))[1] == 416:  # a range past the end: nothing there
                return None, 0, self.size(path)
            raise
        if r is None:
            n, size = _sizes(path, answer.get("ContentLength"), answer.get("ContentRange"))
            return answer["Body"], n, size
        if r.status_code == 416:
            r.raw.close()
            return None, 0, self.size(path)
        n, size = _sizes(path, r.headers.get("content-length"), r.headers.get("content-range"))
        return direct.body(r, n), n, size

    def read(self, path: str, limit: int | None = None) -> bytes:
        def get() -> tuple[bytes, int]:
            body, n, _ = self._get(path)
            if body is None:
                return b"", 0
            if limit is not None and n > limit:
                body.close()  # refused on the size the response announces, before its body is read
                return b"", n
            return self._whole(body, n), n

        data, n = self._call("read", path, get)
        if limit is not None and n > limit:
            raise too_large(path, n, limit)
        return data

    def read_range(self, path: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""

        def get() -> bytes:
            body, n, _ = self._get(path, start, length)
            return self._whole(body, n)

        return self._call("read", path, get)

    def _reader(self, body: Any, n: int) -> ObjectReader:
        return ObjectReader(body, n, patience=float(self.client.meta.config.read_timeout or 60))

    def _whole(self, body: Any, n: int) -> bytes:
        if body is None:
            return b""
        reader = self._reader(body, n)
        try:
            return reader.read_all()
        finally:
            reader.close()

    def read_into(self, path: str, start: int, buf: memoryview, each: Callable[[memoryview], object] | None = None) -> int:
        """Fill ``buf`` with the object's bytes from ``start``, read off the socket into it; return the object's size.
        ``each``: called once with the part filled (see :meth:`Backend.read_into`)."""

        def get() -> int:
            body, n, size = self._get(path, start, len(buf) if len(buf) else None)
            if body is None:
                return size
            reader = self._reader(body, n)
            try:
                got = reader.readinto(buf[:n])
            finally:
                reader.close()
            if got != min(n, len(buf)):
                raise ConnectionResetError(f"short body: {got} of {n} bytes")
            return size

        size = self._call("read", path, get)
        filled = min(len(buf), max(0, size - start))
        if each is not None and filled:
            each(buf[:filled])
        return size

    def read_split(self, path: str, first: int, place: Callable[[bytes, int], memoryview]) -> bytes:
        """One GET: the first bytes, then the rest of the body read off the socket into ``place``'s buffer."""

        def get() -> bytes:
            body, n, _ = self._get(path)
            if body is None:
                place(b"", 0)
                return b""
            reader = self._reader(body, n)
            try:
                head = bytearray(min(first, n))
                if reader.readinto(memoryview(head)) != len(head):
                    raise ConnectionResetError("short body")
                buf = place(bytes(head), n)
                if len(buf) != n - len(head) or reader.readinto(buf) != len(buf):
                    raise ConnectionResetError(f"short body of {path}")
                return bytes(head)
            finally:
                reader.close()

        return self._call("read", path, get)

    def open_read(self, path: str) -> ObjectReader:
        """A GET of the whole of ``path``, its body not yet read (retried until the response headers arrive)."""

        def get() -> ObjectReader:
            body, n, _ = self._get(path)
            return self._reader(body, n)

        return self._call("read", path, get)

    def write(self, path: str, data: Data) -> None:
        blob = joined(data)
        self._call("write", path, lambda: self._put(path, blob))

    def _put(self, path: str, blob: bytes, *, create: bool = False) -> None:
        cond = {"IfNoneMatch": "*"} if create else {}
        key = self._key(path)
        direct = self._direct
        if len(blob) < MULTIPART_THRESHOLD:
            r, _ = direct.call(PUT, key, lambda: direct.put(key, blob, create=create), (200, 412) if create else (200,),
                               lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=blob, **cond))
            if r is not None:
                direct.finish(r)
                if r.status_code == 412:  # (a create of an object that exists: as the client would raise it)
                    raise FileExistsError(errno.EEXIST, "the object exists (HTTP 412)", path)
            return
        part = MULTIPART_THRESHOLD // 2
        up = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        view = memoryview(blob)
        try:
            def send(i: int) -> dict[str, Any]:
                r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=up, PartNumber=i + 1,
                                            Body=bytes(view[i * part:(i + 1) * part]))
                return {"PartNumber": i + 1, "ETag": r["ETag"]}

            with ThreadPoolExecutor(max_workers=max(1, min(8, self.concurrency)), thread_name_prefix="ckpt-s3-part") as pool:
                parts = []
                for done in pool.map(send, range(math.ceil(len(blob) / part))):
                    parts.append(done)
                    progressed()  # a large upload that moves on is retried as before
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up,
                                                  MultipartUpload={"Parts": parts}, **cond)
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up)
            except Exception:  # noqa: BLE001 - the upload's own error is the one to report
                log.debug("abort of multipart upload %s failed", up)
            raise

    def create_exclusive(self, path: str, data: Data) -> bool:
        """Create ``path`` only if absent (``If-None-Match: *``); True if this call created it.

        A 412 is read back: the object may be ours, from an attempt whose success
        response was lost before the retry that got the 412. ``data`` must be unique to
        this call for that to tell the two apart (ref entries carry a writer token).
        """
        data = joined(data)
        if not self.conditional_writes:
            return self._create_unconditional(path, data)

        def attempt() -> bool:
            try:
                self._put(path, data, create=True)
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

    def _list_page(self, prefix: str, token: str | None, delimiter: str, start_after: str = "") -> dict[str, Any]:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if start_after:
            kw["StartAfter"] = start_after
        if self.page_keys:
            kw["MaxKeys"] = self.page_keys
        if token:
            kw["ContinuationToken"] = token
        if delimiter:
            kw["Delimiter"] = delimiter

        def page() -> dict[str, Any]:
            direct = self._direct
            r, answer = direct.call(LIST, "", lambda: direct.list(prefix, token, delimiter, self.page_keys, start_after), (200,),
                                    lambda: self.client.list_objects_v2(**kw))
            return direct.page(r) if r is not None else answer  # type: ignore[no-any-return]

        where = prefix[len(self.prefix):] if self.prefix else prefix  # (errors name the store's URL and this below it)
        return self._call("list", where.strip("/"), page)

    def _pages(self, key_prefix: str, delimiter: str = "", start_after: str = "",
               prefixes: bool = False) -> Iterator[tuple[list[tuple[str, dict[str, Any] | None]], bool]]:
        """The listing of ``key_prefix`` page by page: each page's (path in the store, object) pairs,
        and whether more pages follow (the next is asked for only when the caller goes on). Keys from
        after ``start_after`` only, where given; ``prefixes``: each common prefix too (the path
        without its trailing delimiter), with None for its object.

        A listing is the server's word, checked like any outside data: a key that is not below
        ``key_prefix``, or whose path has an empty, ``.`` or ``..`` segment, is left out (a
        server that ignores the prefix would otherwise hand this store another store's objects);
        a continuation token given twice is an error (the listing would never end)."""
        token: str | None = None
        seen: set[str] = set()
        while True:
            page = self._list_page(key_prefix, token, delimiter, "" if token else start_after)
            found: list[tuple[str, dict[str, Any] | None]] = []
            listed = [(o.get("Key"), o) for o in page.get("Contents", [])]
            if prefixes:
                listed += [(p.get("Prefix"), None) for p in page.get("CommonPrefixes", []) if isinstance(p, dict)]
            for key, o in listed:
                if not isinstance(key, str) or not key.startswith(key_prefix):
                    continue
                rel = key[len(self.prefix) + 1 :] if self.prefix else key
                if o is None and rel.endswith(delimiter):
                    rel = rel[: -len(delimiter)]
                if rel and not rel.endswith("/") and not any(p in ("", ".", "..") for p in rel.split("/")):
                    found.append((rel, o))
            token = page.get("NextContinuationToken")
            more = bool(page.get("IsTruncated") and token)
            yield found, more
            if not more:
                return
            assert token is not None
            if token in seen:
                raise StorageIOError(f"list s3://{self.bucket}/{key_prefix} failed: the server gave the same "
                                     "continuation token twice (its listing would never end)")
            seen.add(token)

    def _list_keys(self, prefix: str, delimiter: str = "") -> Iterator[Entry]:
        """Objects whose path starts with directory ``prefix`` (one LIST request per 1000)."""
        key_prefix = self._key(prefix).rstrip("/") + "/" if (prefix or self.prefix) else ""
        for page, _ in self._pages(key_prefix, delimiter):
            for rel, o in page:
                try:
                    yield Entry(rel, int(o.get("Size", 0)), float(o["LastModified"].timestamp()))
                except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
                    raise StorageIOError(f"list s3://{self.bucket}/{key_prefix} failed: the server listed "
                                         f"{rel!r} without a size and time") from None

    def list(self, prefix: str) -> Iterator[Entry]:
        yield from self._list_keys(prefix)

    def children(self, prefix: str, after: str = "") -> Iterator[tuple[list[tuple[str, bool]], bool]]:
        # One LIST page per 1000 names, from the first after ``after`` (StartAfter): a key below a name
        # rolls up into that name's common prefix (a "folder").
        key_prefix = self._key(prefix).rstrip("/") + "/" if (prefix or self.prefix) else ""
        cut = len(prefix.rstrip("/")) + 1 if prefix else 0
        for page, more in self._pages(key_prefix, "/", key_prefix + after if after else "", prefixes=True):
            names: dict[str, bool] = {}
            for rel, o in page:  # (a key below a name, from a server that ignores the delimiter, makes it a folder too)
                name, _, below = rel[cut:].partition("/")
                names[name] = names.get(name, True) and o is not None and not below
            yield sorted(names.items()), more

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

    def list_all(self, prefix: str, lookups: int) -> set[str] | None:
        """Every path below ``prefix``, if listing them costs less than ``lookups`` HEADs
        (at most ``lookups // LIST_COST`` pages of 1000); None as soon as it would cost more."""
        max_pages = lookups // LIST_COST
        if max_pages < 1:
            return None
        key_prefix = self._key(prefix).rstrip("/") + "/" if (prefix or self.prefix) else ""
        found: set[str] = set()
        for n, (page, more) in enumerate(self._pages(key_prefix)):
            found.update(rel for rel, _ in page)
            if more and n + 1 == max_pages:
                return None  # (before asking for the next page)
        return found

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


def _sizes(path: str, length: Any, content_range: Any) -> tuple[int, int]:
    """(bytes in a GET's body, size of the object) from its Content-Length and Content-Range: the
    server's word, so an answer without them, or with ones that are not numbers, is an error
    saying so (a body is read by its length: one sent without it is refused, never guessed)."""
    try:
        n = int(length)
        size = int(str(content_range).rsplit("/", 1)[1]) if content_range else n
    except (TypeError, ValueError, IndexError):
        raise StorageIOError(f"cannot read {path}: the server's answer has no usable Content-Length "
                             f"({length!r}) or Content-Range ({content_range!r})", retryable=True) from None
    if n < 0 or size < 0:
        raise StorageIOError(f"cannot read {path}: the server's answer gives a negative size", retryable=True)
    return n, size


__all__ = ["MULTIPART_THRESHOLD", "ObjectReader", "S3Backend", "is_precondition_failed"]
