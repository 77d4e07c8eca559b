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

from ckpt_store.storage.backends.base import Data, joined
from ckpt_store.storage.backends.s3_direct import PUT
from ckpt_store.storage.backends.s3_errors import client_error, is_precondition_failed
from ckpt_store.storage.errors import StorageIOError
from ckpt_store.storage.retry import progressed

log = logging.getLogger(__name__)

# Objects this large go up as a multipart upload with parts of half this size,
# several parts in flight at once. Chunks (4 MiB by default) and manifests stay single PUTs.
MULTIPART_THRESHOLD = 16 * 1024 * 1024


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
