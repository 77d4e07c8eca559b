"""The write side of a push: hash every chunk, and encode (as a delta against a base where one is
given and pays) and write those the store lacks, on threads within a memory bound (:func:`put_chunks`)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from ckpt.codecs.chunk import encode_chunk
from ckpt.format.entries import split_lengths
from ckpt.format.manifest import Manifest
from ckpt.progress import NullProgress, Progress
from ckpt.settings import Settings
from ckpt.transfer.fetch import fetch_base, stored_chain
from ckpt.transfer.parallel import BATCH_BYTES, results_of, run_parallel
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


@dataclass(frozen=True, slots=True)
class PutTask:
    """One chunk to store: the ``length`` bytes that ``source(offset, length)`` returns. The source's
    reader and a place in it, not a closure per chunk: a push holds a task per chunk to the commit,
    and a model of 100,000 tiny tensors held 100,000 closures (~360 bytes a task, now ~120)."""

    source: Callable[[int, int], bytes | memoryview]
    offset: int
    length: int
    elem: int = 1
    base: str | None = None  # chunk to try a delta against (same length)
    # The length of ``base``'s delta chain as its manifest records it (-1: unknown). A hint:
    # a remote store then fetches a base only where a delta against it may be kept.
    base_depth: int = -1

    def read(self) -> bytes | memoryview:
        return self.source(self.offset, self.length)


@dataclass(frozen=True)
class Recorded:
    """Codec and delta chain of chunks as a stored manifest records them (``chains``), and when the
    store wrote that manifest (``time``, the store's clock): what :func:`put_chunks` names for a
    chunk the store holds instead of reading its header (a request each on a remote store).

    A record stands for the blob only where the blob was written no later than the manifest (whole
    seconds of the store's clock: what a listing or a HEAD says): that manifest's writer named the
    chain of this very blob (chunks are created exclusively, so a writer names the stored blob's
    chain, not its own encoding's), and such a blob is replaced only after a gc took it, which none
    does while a live manifest names it, or to be stored whole (a copy over a delta it cannot name,
    a commit writing a vanished chunk again): then the record names more bases than the blob needs,
    which keeps more alive, never less. A blob written later (taken by a gc, created anew in another
    encoding, so that the record might name fewer bases than it needs and let gc free one) has its
    header read. (A manifest's ``codecs`` are for display, and a persisted snapshot's say raw for
    blobs persisting compressed: a record passes that on, as the base's manifest shows it.)"""

    chains: Mapping[str, tuple[int, tuple[str, ...]]]
    time: float

    @classmethod
    def of(cls, objects: ObjectStore, manifest_id: str | None, manifest: Manifest | None) -> Recorded | None:
        """The records of stored manifest ``manifest_id`` (``manifest``), on a store where they stand for
        blobs: one that creates chunks exclusively and cannot touch them (a remote one; a local one
        reads a header from its own disk). Costs one request (the manifest's time); None elsewhere,
        or where the manifest is gone or its store cannot say when it was written."""
        if manifest is None or manifest_id is None or objects.backend.touches or not objects.creates_chunks_exclusively:
            return None
        chains = {cid: (codec, chain) for t in manifest.tensors if t.codecs and len(t.codecs) == len(t.chunks)
                  for cid, codec, chain in zip(t.chunks, t.codecs, t.chains(), strict=True)}
        if not chains:
            return None
        when = objects.backend.written(objects.path("manifests", manifest_id))
        return cls(chains, when) if when else None

    def get(self, oid: str, written: float) -> tuple[int, tuple[str, ...]] | None:
        """Codec and chain of chunk ``oid`` whose blob the store wrote at ``written``, where a record stands for it."""
        if written <= 0 or math.floor(written) > math.floor(self.time):
            return None
        return self.chains.get(oid)


@dataclass(frozen=True)
class PutResult:
    id: str
    length: int
    stored: int  # bytes written now (0 when the chunk was already there)
    codec: int
    bases: tuple[str, ...]  # every chunk decoding this one needs (its delta chain)


def put_chunks(objects: ObjectStore, tasks: Sequence[PutTask], settings: Settings, progress: Progress | None = None,
               bundled: BundleBases | None = None, keep_bases: bool = True, recorded: Recorded | None = None) -> list[PutResult]:
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
    ``recorded``: codecs and chains of chunks the store holds, as a manifest records them (a remote
    store otherwise reads each such chunk's header: a request each). A chunk that appears more than
    once (a model's norms of ones) is stored and looked up once.
    """
    # A remote store is latency-bound: keep as many requests in flight as it allows
    # (existence checks run on the encoding workers, uploads on the I/O workers).
    remote = objects.backend.concurrency
    io_workers = max(settings.io_workers, remote)
    io = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="ckpt-io")
    # Encoded blobs waiting for (or in) their upload: at most 2 per I/O thread, and at most
    # ``inflight_mb`` of chunks (large chunk sizes would otherwise hold gigabytes).
    slots = threading.BoundedSemaphore(max(2, min(2 * io_workers, (settings.inflight_mb << 20) // settings.chunk_size)))
    # The writes not done, and those failed: a done Future (its Condition, lock and deque) kept per
    # chunk for the whole push held 1 KB each, as the first tasks' Events did (see ``firsts``).
    writes: dict[Future[None], None] = {}
    writes_lock = threading.Lock()
    # Two pushes may encode one new chunk differently (against other bases, or whole) at once: where
    # creates are exclusive the first blob stays and the other push records the stored blob's chain
    # (with the last write winning, a manifest could name a chain its blob does not decode with, and
    # gc would free the base the blob needs).
    exclusive = objects.creates_chunks_exclusively
    lost: set[str] = set()

    def write(path: str, oid: str, blob: tuple[bytes | memoryview, ...]) -> None:
        if not exclusive:
            objects.backend.write(path, blob)
        elif not objects.backend.create_exclusive(path, blob):
            with writes_lock:
                lost.add(oid)

    # Remote stores: one listing instead of a HEAD per chunk (and when each was written).
    written = None if objects.backend.touches else objects.written_times("chunks", len(tasks), times=recorded is not None)
    # Each chunk id's first task stores it; a later one waits for that and takes its result. Once
    # stored, its entry is the result alone: an Event (with its Condition, lock and deque) kept per
    # chunk for the whole push held 1 KB each (a merge of 100,000 tiny tensors: 100 MB).
    firsts: dict[str, tuple[threading.Event, list[PutResult]] | PutResult] = {}

    def put(task: PutTask) -> PutResult:
        data = task.read()
        if isinstance(data, memoryview) and not data.readonly:
            # Memory another thread may write (a live tensor): hashed, encoded and written
            # from one copy, else the stored blob need not hold the bytes its id names, and
            # every later push of those bytes would dedup against the damaged blob.
            data = bytes(data)
        oid = object_id(data)
        with writes_lock:
            first = firsts.get(oid)
            if first is None:
                firsts[oid] = mine = (threading.Event(), [])
        if isinstance(first, PutResult):
            return replace(first, length=task.length, stored=0)
        if first is not None:
            first[0].wait()  # (set once the first task's put returns or fails)
            if first[1]:
                return replace(first[1][0], length=task.length, stored=0)
            return store(task, data, oid)  # the first failed: its error stops the push anyway
        try:
            mine[1].append(store(task, data, oid))
            with writes_lock:
                firsts[oid] = mine[1][0]  # (those waiting hold the Event)
            return mine[1][0]
        finally:
            mine[0].set()

    def done(fut: Future[None]) -> None:
        slots.release()
        if not fut.cancelled() and fut.exception() is None:
            with writes_lock:
                writes.pop(fut, None)

    def store(task: PutTask, data: bytes | memoryview, oid: str) -> PutResult:
        path = objects.path("chunks", oid)
        # A local store refreshes a reused chunk's time (keeps a concurrent gc off it,
        # docs/format.md) and learns it is there in one call; a remote one asks the batch.
        known = None
        if written is None:
            held = objects.backend.touch(path)
        else:
            when = written(oid)
            held = when is not None
            if when is not None and recorded is not None:
                known = recorded.get(oid, when)
        if held:
            codec, chain = known if known is not None else stored_chain(objects, oid)
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
        except BaseException:  # (RuntimeError once the push stopped: the writes queued are dropped)
            slots.release()
            raise
        with writes_lock:
            writes[fut] = None
        # Its slot is free once the write is done, or dropped unstarted (an encoding thread waiting
        # for a slot then goes on, to find the push stopped).
        fut.add_done_callback(done)
        return PutResult(oid, task.length, enc.size, enc.codec, base_chain if enc.base else ())

    try:
        # Stopped (an error, Ctrl-C): the writes queued are dropped at once, not after the chunks being
        # encoded are done (up to 2 * io_workers blobs went on being written: on S3, 32 chunks, 128 MiB).
        results = run_parallel(put, tasks, max(settings.workers, min(remote, 8)), progress or NullProgress(), lambda t: t.length,
                               batch=BATCH_BYTES, on_stop=lambda: io.shutdown(wait=False, cancel_futures=True))
        with writes_lock:  # (the I/O threads' callbacks take theirs out meanwhile)
            pending = list(writes)
        results_of(pending)  # durable, or the first write error (a Ctrl-C meanwhile is acted on at once)
        found = {oid: stored_chain(objects, oid) for oid in lost}  # another writer's blob is the one stored
        for i, r in enumerate(results):
            if r.id in found:
                results[i] = PutResult(r.id, r.length, 0, *found[r.id])
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
        out.append(PutTask(read, pos, n, elem, bases[i] if i < len(bases) else None, len(chains[i]) if i < len(chains) else -1))
        pos += n
    return out

