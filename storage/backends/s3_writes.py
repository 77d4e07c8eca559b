"""Writing objects to S3 (:class:`S3Writes`, a part of :class:`~ckpt_store.storage.backends.s3.S3Backend`):
one PUT, or a multipart upload from ``MULTIPART_THRESHOLD`` bytes, and the exclusive create,
with ``If-None-Match`` or, on servers without it, check-then-write."""

from __future__ import annotations

import errno
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckpt_store.storage.backends.base import Data, Upload, joined
from ckpt_store.storage.backends.s3_direct import PUT
from ckpt_store.storage.backends.s3_errors import client_error, is_precondition_failed
from ckpt_store.storage.errors import StorageIOError
from ckpt_store.storage.retry import progressed

log = logging.getLogger(__name__)

# Objects this large go up as a multipart upload with parts of half this size,
# several parts in flight at once. Chunks (4 MiB by default) and manifests stay single PUTs.
MULTIPART_THRESHOLD = 16 * 1024 * 1024
# Pages of a listing of unfinished uploads (1,000 each) before gc takes the server for one that never ends
MAX_UPLOAD_PAGES = 10_000


class S3Writes:
    """The writes of :class:`~ckpt_store.storage.backends.s3.S3Backend`, which it is mixed into
    (through its client, bucket, retries and direct requests)."""

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

    def incomplete_uploads(self, before: float) -> tuple[list[Upload], int]:
        """The multipart uploads of this store's own objects (below its ``objects/`` and ``index/``, where ckpt writes
        objects large enough for one: only there, a store at a bucket's root too; the rest of the bucket is someone
        else's) begun before ``before`` and never completed nor aborted, each with the bytes of its parts; and how
        many younger ones there are (a push's in flight, likely). One that sent a part since ``before`` is young too (a
        large object still going up; and moto's server dates every upload in 2010). A page per 1,000 uploads, and a
        request for the parts of each old one. A server whose pages do not move on is an error (gc warns of it)."""
        old: list[Upload] = []
        young = 0
        for sub in ("objects/", "index/"):
            prefix = self._key(sub)
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            seen: set[tuple[Any, Any]] = set()
            while True:
                page = self._call("list", sub.rstrip("/"), lambda: self.client.list_multipart_uploads(**kw))
                for u in page.get("Uploads") or []:
                    key, uid, begun = u.get("Key"), u.get("UploadId"), u.get("Initiated")
                    path = key[len(prefix) - len(sub):] if isinstance(key, str) and key.startswith(prefix) else None
                    if path is None or any(p in ("", ".", "..") for p in path.split("/")) or not uid \
                            or not hasattr(begun, "timestamp"):
                        continue  # (not an object of this store, whatever the server answered: never touched)
                    size, last = (0, 0.0) if begun.timestamp() >= before else self._upload_parts(key, uid)
                    if max(begun.timestamp(), last) >= before:
                        young += 1
                    else:
                        old.append(Upload(path, uid, begun.timestamp(), size))
                markers = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
                if not page.get("IsTruncated") or not any(markers):
                    break
                if markers in seen or len(seen) >= MAX_UPLOAD_PAGES:
                    raise StorageIOError(f"list {self.url}/{sub} uploads failed: the server's pages do not move on")
                seen.add(markers)
                kw["KeyMarker"], kw["UploadIdMarker"] = markers
        return old, young

    def _upload_parts(self, key: str, uid: str) -> tuple[int, float]:
        """The bytes of an upload's parts so far, and when the last of them was sent (0.0: none). S3 holds at
        most 10,000 parts an upload, 1,000 a page: a listing that goes on past that, or back, is cut there."""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "UploadId": uid}
        total, last = 0, 0.0
        try:
            for _ in range(11):
                page = self._call("list", "", lambda: self.client.list_parts(**kw))
                for p in page.get("Parts") or []:
                    total += int(p.get("Size") or 0)
                    if hasattr(p.get("LastModified"), "timestamp"):
                        last = max(last, p["LastModified"].timestamp())
                marker = page.get("NextPartNumberMarker")
                if not page.get("IsTruncated") or not isinstance(marker, int) or marker <= kw.get("PartNumberMarker", 0):
                    break
                kw["PartNumberMarker"] = marker
        except (StorageIOError, TypeError, ValueError):
            pass  # (ended meanwhile, or the server lists no parts: its size is unknown, not an error)
        return total, last

    def abort_upload(self, upload: Upload) -> bool:
        key = self._key(upload.path)

        def abort() -> bool:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload.upload_id)
            except Exception as e:
                ce = client_error(e)
                if ce is not None and (ce[0] == "NoSuchUpload" or ce[1] == 404):
                    return False  # completed or aborted meanwhile
                raise
            return True

        return self._call("write", upload.path, abort)

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
