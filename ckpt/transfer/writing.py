"""The write side of a push: hash every chunk, and encode (as a delta against a base where one is
given and pays) and write those the store lacks, on threads within a memory bound (:func:`put_chunks`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ckpt.codecs.chunk import encode_chunk
from ckpt.format.entries import split_lengths
from ckpt.progress import NullProgress, Progress
from ckpt.settings import Settings
from ckpt.transfer.fetch import fetch_base, stored_chain
from ckpt.transfer.parallel import BATCH_BYTES, run_parallel
from ckpt.transfer.reading import BundleBases
from ckpt_store.storage.errors import CorruptObjectError, ObjectNotFoundError
from ckpt_store.storage.objects import ObjectStore, object_id

log = logging.getLogger(__name__)


def _delta_base(objects: ObjectStore, base: str, task: PutTask, oid: str, settings: Settings,
                bundled: BundleBases | None = None, keep: bool = True,
                ) -> tuple[bytes | bytearray | memoryview | None, tuple[str, ...]]:
    """The decoded bytes of chunk ``base`` (``task``'s) and its delta chain, when a delta of chunk ``oid``
    against it keeps every chain within ``settings.max_delta_depth``; else ``(None, ())``.

    A local store reads the base's headers first (cheap), and refreshes the base's time
    so that a concurrent gc keeps it. A remote store would pay a request per header: there
    the depth the base's manifest records (``task.base_depth``) decides whether to fetch
    the base at all, and the chain recorded is the one its decoding walked, not the
    manifest's (a wrong record only costs a fetch: the chunk is then stored whole). ``bundled``:
    bases a bundle holds are taken from it (with the chain the base's manifest records). ``keep``:
    whether the decoded-base cache may keep the base (see :func:`fetch_base`'s ``ask``).
    """
    limit = settings.max_delta_depth
    if objects.backend.touches or task.base_depth < 0:
        _, chain = stored_chain(objects, base)
        if len(chain) >= limit or (objects.backend.touches and not objects.refresh("chunks", base)):
            return None, ()
        data, _ = fetch_base(objects, base, task.length, settings, oid, ask=keep)
        return data, chain
    if task.base_depth >= limit:
        return None, ()
    got = bundled.get(base, task.length) if bundled is not None else None
    if got is not None:
        return got if len(got[1]) < limit else (None, ())
    data, chain = fetch_base(objects, base, task.length, settings, oid, ask=keep)
    return (data, chain) if len(chain) < limit else (None, ())


@dataclass(frozen=True)
class PutTask:
    read: Callable[[], bytes | memoryview]
    length: int
    elem: int = 1
    base: str | None = None  # chunk to try a delta against (same length)
    # The length of ``base``'s delta chain as its manifest records it (-1: unknown). A hint:
    # a remote store then fetches a base only where a delta against it may be kept.
    base_depth: int = -1


@dataclass(frozen=True)
class PutResult:
    id: str
    length: int
    stored: int  # bytes written now (0 when the chunk was already there)
    codec: int
    bases: tuple[str, ...]  # every chunk decoding this one needs (its delta chain)


def put_chunks(objects: ObjectStore, tasks: Sequence[PutTask], settings: Settings, progress: Progress | None = None,
               bundled: BundleBases | None = None, keep_bases: bool = True) -> list[PutResult]:
    """Hash every chunk, and encode and write those the store lacks. Returns results in task order.

    A chunk with a ``base`` is also tried as a delta against it, unless the base's
    own chain is already ``settings.max_delta_depth`` long (then it is stored whole:
    a keyframe, so that reading never decodes more than that many levels).

    Encoding runs on ``settings.workers`` threads (CPU); each finished blob is
    written by one of ``settings.io_workers`` threads, so that the latency of
    many small durable writes (fsync) overlaps with encoding and with itself. At
    most ``2 * io_workers`` blobs (and ``inflight_mb`` of chunks) wait for their write, which bounds memory.
    ``bundled``: delta bases that a bundle holds are read from it (:class:`BundleBases`).
    ``keep_bases=False``: no base fetched is kept by the decoded-base cache (one it holds is still
    served from it): for a push whose bases were just read by the same operation and are not asked
    for again (a merge's, which would otherwise fill the cache with every chunk of its first input).
    """
    # A remote store is latency-bound: keep as many requests in flight as it allows
    # (existence checks run on the encoding workers, uploads on the I/O workers).
    remote = objects.backend.concurrency
    io_workers = max(settings.io_workers, remote)
    io = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="ckpt-io")
    # Encoded blobs waiting for (or in) their upload: at most 2 per I/O thread, and at most
    # ``inflight_mb`` of chunks (large chunk sizes would otherwise hold gigabytes).
    slots = threading.BoundedSemaphore(max(2, min(2 * io_workers, (settings.inflight_mb << 20) // settings.chunk_size)))
    writes: list[Future[None]] = []
    writes_lock = threading.Lock()
    # Two pushes may encode one new chunk differently (against other bases, or whole) at once: where
    # creates are exclusive the first blob stays and the other push records the stored blob's chain
    # (with the last write winning, a manifest could name a chain its blob does not decode with, and
    # gc would free the base the blob needs).
    exclusive = objects.creates_chunks_exclusively
    lost: set[str] = set()

    def write(path: str, oid: str, blob: tuple[bytes | memoryview, ...]) -> None:
        try:
            if not exclusive:
                objects.backend.write(path, blob)
            elif not objects.backend.create_exclusive(path, blob):
                with writes_lock:
                    lost.add(oid)
        finally:
            slots.release()

    stored = objects.presence("chunks", len(tasks))  # remote stores: one listing instead of a HEAD per chunk

    def put(task: PutTask) -> PutResult:
        data = task.read()
        if isinstance(data, memoryview) and not data.readonly:
            # Memory another thread may write (a live tensor): hashed, encoded and written
            # from one copy, else the stored blob need not hold the bytes its id names, and
            # every later push of those bytes would dedup against the damaged blob.
            data = bytes(data)
        oid = object_id(data)
        path = objects.path("chunks", oid)
        # A local store refreshes a reused chunk's time (keeps a concurrent gc off it,
        # docs/format.md) and learns it is there in one call; a remote one asks the batch.
        if objects.backend.touch(path) if objects.backend.touches else stored(oid):
            codec, chain = stored_chain(objects, oid)
            return PutResult(oid, task.length, 0, codec, chain)
        base_bytes, base_chain = None, ()
        if task.base is not None and task.base != oid and settings.max_delta_depth > 0:
            try:
                base_bytes, chain_b = _delta_base(objects, task.base, task, oid, settings, bundled, keep_bases)
                base_chain = (task.base, *chain_b) if base_bytes is not None else ()
            except ObjectNotFoundError:
                base_bytes = None  # the base is gone (gc): store this chunk whole
            except CorruptObjectError as e:  # a damaged base must not stop every push of its shape
                log.warning("chunk %s, chosen as a delta base, is damaged (%s): storing this chunk whole; "
                            "`ckpt verify` names what needs it", task.base[:12], e)
                base_bytes = None
        enc = encode_chunk(data, elem=task.elem, level=settings.zstd_level, min_saving=settings.min_saving,
                           base=base_bytes, base_id=task.base if base_bytes is not None else None)
        slots.acquire()
        try:
            fut = io.submit(write, path, oid, enc.parts)
        except BaseException:
            slots.release()
            raise
        with writes_lock:
            writes.append(fut)
        return PutResult(oid, task.length, enc.size, enc.codec, base_chain if enc.base else ())

    try:
        results = run_parallel(put, tasks, max(settings.workers, min(remote, 8)), progress or NullProgress(), lambda t: t.length,
                               batch=BATCH_BYTES)
        for f in writes:
            f.result()  # durable, or the first write error
        for i, r in enumerate(results):
            if r.id in lost:  # another writer's blob is the one stored
                codec, chain = stored_chain(objects, r.id)
                results[i] = PutResult(r.id, r.length, 0, codec, chain)
        return results
    finally:
        io.shutdown(wait=True, cancel_futures=True)  # after an error or Ctrl-C: no write queued behind it


def rewrite_whole(objects: ObjectStore, tasks: Mapping[str, PutTask], settings: Settings) -> dict[str, PutResult]:
    """Write again, each whole (decodable without a base), the chunks ``tasks`` maps from their
    ids: chunks a push named that vanished before its commit (storage/commit.py). Returns what
    storing each did. A task whose bytes no longer hash to its id (its source changed) is left
    out: the commit then finds that chunk missing and says so."""
    def one(item: tuple[str, PutTask]) -> PutResult | None:
        cid, task = item
        data = task.read()
        if len(data) != task.length or object_id(data) != cid:
            return None
        enc = encode_chunk(data, elem=task.elem, level=settings.zstd_level, min_saving=settings.min_saving)
        objects.backend.write(objects.path("chunks", cid), enc.parts)
        return PutResult(cid, task.length, enc.size, enc.codec, ())

    done = run_parallel(one, list(tasks.items()), max(settings.workers, min(objects.backend.concurrency, 8)), NullProgress(),
                        lambda item: item[1].length)
    return {r.id: r for r in done if r is not None}


def put_tasks(read: Callable[[int, int], bytes | memoryview], offset: int, nbytes: int, chunk_size: int, elem: int,
              bases: Sequence[str] = (), chains: Sequence[tuple[str, ...]] = ()) -> list[PutTask]:
    """Tasks storing ``nbytes`` bytes that ``read(offset, length)`` returns, from ``offset``, as
    chunks of ``chunk_size``; chunk i tries a delta against ``bases[i]`` where there is one
    (whose delta chain is ``chains[i]`` as its manifest records it, where given)."""
    out = []
    pos = offset
    for i, n in enumerate(split_lengths(nbytes, chunk_size)):
        out.append(PutTask(lambda p=pos, n=n: read(p, n), n, elem, bases[i] if i < len(bases) else None,
                           len(chains[i]) if i < len(chains) else -1))
        pos += n
    return out

