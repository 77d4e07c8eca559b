"""The read side: many chunks fetched, decoded and verified in parallel within a memory bound
(:func:`get_chunks`), the tasks that say where each lands, a checkpoint's small chunks served from its
bundles, and the reading threads one operation shares (:class:`ReadPool`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ckpt.codecs.buffers import empty_buffer, thread_buffer
from ckpt.codecs.chunk import MAX_HEADER, RAW, parse_header
from ckpt.errors import ReaderClosedError
from ckpt.format.dtypes import byte_view
from ckpt.format.entries import BundleEntry, TensorEntry, split_lengths
from ckpt.format.manifest import Manifest
from ckpt.progress import NullProgress, Progress
from ckpt.settings import Settings
from ckpt.transfer.fetch import (
    BlobBuffers,
    ChunkRead,
    check_claim,
    decode_read,
    read_ahead,
    read_chunk,
    refetch,
)
from ckpt.transfer.parallel import BATCH_BYTES, run_parallel
from ckpt_store.storage.errors import CorruptObjectError, ObjectNotFoundError
from ckpt_store.storage.objects import ObjectStore, object_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GetTask:
    id: str
    length: int
    sink: Callable[[bytes], None] | None = None  # receives the verified decoded bytes (valid during the call only)
    into: memoryview | None = None  # or: where they are decoded in place (``length`` bytes)


def spans(chunks: Iterable[str], nbytes: int, chunk_size: int, base: int = 0) -> Iterator[tuple[str, int, int]]:
    """(chunk id, length, offset) of each chunk of ``nbytes`` bytes laid out from offset ``base``."""
    pos = base
    for cid, n in zip(chunks, split_lengths(nbytes, chunk_size)):
        yield cid, n, pos
        pos += n


def sink_tasks(chunks: Iterable[str], nbytes: int, chunk_size: int, sink_at: Callable[[int], Callable[[bytes], None]],
               base: int = 0) -> list[GetTask]:
    """Tasks fetching the chunks of ``nbytes`` bytes laid out from ``base``; each chunk's verified
    bytes go to ``sink_at(its offset)``."""
    return [GetTask(cid, n, sink_at(pos)) for cid, n, pos in spans(chunks, nbytes, chunk_size, base)]


def into_tasks(chunk_size: int, pairs: Iterable[tuple[TensorEntry, Any]]) -> list[GetTask]:
    """Tasks decoding each entry's chunks straight into its destination tensor's memory
    (CPU, contiguous, of the entry's size)."""
    tasks: list[GetTask] = []
    for entry, dst in pairs:
        view = byte_view(dst)
        tasks += [GetTask(cid, n, into=view[pos : pos + n]) for cid, n, pos in spans(entry.chunks, entry.nbytes, chunk_size)]
    return tasks


@dataclass
class GetStats:
    """What :func:`get_chunks` did: chunks read, and the most bytes of chunks that were
    fetched or being fetched but not yet taken for decoding at once (remote stores)."""

    chunks: int = 0
    peak_inflight: int = 0


def _decode_into(task: GetTask, got: ChunkRead) -> memoryview | None:
    """Where ``task``'s chunk is decoded: its ``into``; for a sink, a buffer of this thread's,
    reused chunk after chunk, unless the blob is raw (the sink gets a view of the blob).

    A pull hands every chunk to a sink that writes it at its offset in the file. Decoded
    into fresh memory, each chunk cost page faults and the kernel zeroing those pages;
    decoding into a file mapped in memory instead (no copy of our own) cost as much, the
    kernel zeroing every new page of the file before the decoder wrote it (perf: 14% of a
    pull's CPU), and more on S3. From a buffer that stays in the CPU caches the copy into
    the page cache is the cheapest of the three (a 512 MB fp32 pull from a local store:
    1.51 s of CPU with fresh buffers, 1.23 s like this).
    """
    if task.into is not None or task.sink is None or got.blob is None:
        return task.into
    try:
        if parse_header(got.blob, task.id).codec == RAW:
            return None
    except CorruptObjectError:
        return None  # reported by the decoding
    return thread_buffer(task.length, "sink")


# Chunks of at most this many bytes are copied into a checkpoint's bundle when it is pushed to a
# remote store (ckpt.format.manifest.BundleEntry): a request each costs more than their bytes.
BUNDLE_CHUNK_MAX = 64 << 10
# ... and only where they hold at most 1/BUNDLE_SHARE of the bytes pushed (a model of small tensors
# only is not stored twice): push's bundle_small, and what a merge holds back for it.
BUNDLE_SHARE = 4


def readable_bundles(manifest: Manifest, settings: Settings) -> list[BundleEntry]:
    """The bundles of ``manifest`` worth reading: as a push writes one (members back to back), no larger
    than ``settings.inflight_mb`` (a manifest is outside data: it must not make a reader allocate what
    it says). Another's members are fetched one by one."""
    return [b for b in manifest.bundles
            if b.nbytes == sum(n for _, _, n in b.members) and b.nbytes <= settings.inflight_mb << 20]


def _from_bundles(objects: ObjectStore, todo: list[GetTask], manifest: Manifest, settings: Settings,
                  progress: Progress, pool: ReadPool | None = None) -> list[GetTask]:
    """Serve the tasks of ``todo`` whose chunks a bundle of ``manifest`` holds from the bundle
    (fetched, decoded and verified as chunks of its own), each member checked against its own
    id; returns the tasks left. A bundle that cannot be read (missing, damaged), or that claims
    more bytes than its members hold or than ``settings.inflight_mb`` (a manifest is outside
    data: it must not make a reader allocate what it says), serves nothing: its members are then
    fetched one by one, as without it. With ``pool``, a bundle fetched is kept for the pool's later
    calls (:meth:`ReadPool.bundle`): fetched once per operation, not once per batch."""
    for b in readable_bundles(manifest, settings):
        where = {cid: (off, n) for cid, off, n in b.members}
        mine = [t for t in todo if t.id in where and where[t.id][1] == t.length]
        if len(mine) < (1 if pool is not None and pool.bundle(b.chunks) is not None else 2):
            continue
        buf = _bundle_bytes(objects, b, manifest, settings, pool)
        if buf is None:
            continue
        served: set[int] = set()
        for t in mine:
            off, n = where[t.id]
            piece = buf[off : off + n]
            # (shorter where the pool kept another manifest's bundle of these chunks, one of another
            # length: a hostile input of a merge made that a bare ValueError, a member of its length
            # hashing to its id)
            if len(piece) != n or object_id(piece) != t.id:
                continue  # not what the manifest says it is: fetched on its own below
            if t.into is not None:
                t.into[:] = piece
            if t.sink is not None:
                t.sink(piece if t.into is None else t.into)
            progress.advance(n)
            served.add(id(t))
        todo = [t for t in todo if id(t) not in served]
    return todo


def _bundle_bytes(objects: ObjectStore, b: BundleEntry, manifest: Manifest, settings: Settings,
                  pool: ReadPool | None) -> memoryview | None:
    """The bytes of bundle ``b`` of ``manifest`` (a bundle :func:`_from_bundles` may read): kept by
    ``pool`` where a call on it fetched it, else fetched, each of its chunks verified (and kept by
    ``pool``, within its budget); None where it cannot be read (missing, damaged), or where ``pool``
    has no room left to keep it: every later call of the operation would fetch it again (a merge
    whose inputs' bundles outgrow the budget fetched the second one whole for each batch of small
    tensors, every byte of it some hundred times at 256 MiB): its members are then fetched one by one."""
    kept = pool.bundle(b.chunks) if pool is not None else None
    if kept is not None:
        return kept
    if pool is not None and (pool.unreadable(b.chunks) or not pool.room(b.nbytes, settings.inflight_mb << 20)):
        return None
    buf = empty_buffer(b.nbytes)
    pieces = [GetTask(cid, n, into=buf[pos : pos + n]) for cid, n, pos in spans(b.chunks, b.nbytes, manifest.chunk_size)]
    try:
        get_chunks(objects, pieces, settings, pool=pool)
    except (ObjectNotFoundError, CorruptObjectError) as e:
        log.warning("bundle of %d small chunks unreadable (%s): fetching them one by one", len(b.members), e)
        if pool is not None:  # not tried again by the operation's later calls (each fetched it up to the damage)
            pool.unreadable(b.chunks, mark=True)
        return None
    if pool is not None:
        pool.keep_bundle(b.chunks, buf, settings.inflight_mb << 20)
    return buf


class BundleBases:
    """Delta bases for a push, from the bundles of the checkpoint they belong to (``manifest``): the
    merged push of a merge from S3 deltas its small chunks against input A's, which a GET each
    fetched, one after another, though A's bundle holds them all and the merge's reads keep it
    (``pool``). Each base taken is checked against its id; its delta chain is the one ``manifest``
    records for it, as for any chunk a manifest takes over from another (a merge's reused tensors)."""

    def __init__(self, objects: ObjectStore, manifest: Manifest, settings: Settings, pool: ReadPool) -> None:
        self._objects, self._manifest, self._settings, self._pool = objects, manifest, settings, pool
        self._where = {cid: (b, off, n) for b in readable_bundles(manifest, settings) for cid, off, n in b.members}
        self._chains = {cid: chain for t in manifest.tensors for cid, chain in zip(t.chunks, t.chains()) if cid in self._where}
        self._lock = threading.Lock()  # one fetch of a bundle, whatever the number of pushing threads
        self._unread: set[tuple[str, ...]] = set()  # bundles that could not be read (or kept): not tried again

    def get(self, cid: str, length: int) -> tuple[memoryview, tuple[str, ...]] | None:
        """The bytes of chunk ``cid`` (``length`` of them) and its delta chain, or None where no bundle holds it."""
        at = self._where.get(cid)
        if at is None or at[2] != length or cid not in self._chains:
            return None
        b, off, n = at
        with self._lock:
            if b.chunks in self._unread:
                return None
            buf = _bundle_bytes(self._objects, b, self._manifest, self._settings, self._pool)
            if buf is None or self._pool.bundle(b.chunks) is None:  # unreadable, or past the pool's budget
                self._unread.add(b.chunks)  # (fetched again for every base, it would cost more than it saves)
            if buf is None:
                return None
        piece = buf[off : off + n]
        return (piece, self._chains[cid]) if len(piece) == length and object_id(piece) == cid else None


class ReadPool:
    """The reading threads of one operation of many :func:`get_chunks` calls (a merge reads each
    input once per tensor or batch): started once, at the first call that needs them, instead of
    a pool per call (a thread start per input per tensor), and ended by :meth:`close` (a ``with``
    block). Threads left by a pool that is never closed end when it is garbage-collected."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0
        self._lock = threading.Lock()
        self._bundles: dict[tuple[str, ...], memoryview] = {}  # fetched and decoded, by their chunk ids
        self._bundle_bytes = 0
        self._unreadable: set[tuple[str, ...]] = set()
        self._closes = 0

    def closes(self) -> int:
        """How many times the pool was closed: a read that sees this change was cut short by a close."""
        with self._lock:
            return self._closes

    def bundle(self, chunks: tuple[str, ...]) -> memoryview | None:
        """The bundle stored as ``chunks``, if a call on this pool fetched it (its members are
        still checked against their ids as each is served)."""
        with self._lock:
            return self._bundles.get(chunks)

    def unreadable(self, chunks: tuple[str, ...], mark: bool = False) -> bool:
        """Whether a call on this pool found the bundle stored as ``chunks`` missing or damaged
        (``mark``: record that it did)."""
        with self._lock:
            if mark:
                self._unreadable.add(chunks)
            return chunks in self._unreadable

    def room(self, nbytes: int, budget: int) -> bool:
        """Whether a bundle of ``nbytes`` bytes would be kept within ``budget`` bytes in all."""
        with self._lock:
            return self._bundle_bytes + nbytes <= budget

    def keep_bundle(self, chunks: tuple[str, ...], buf: memoryview, budget: int) -> None:
        """Keep bundle ``buf`` for the later calls of this operation, within ``budget`` bytes in all."""
        with self._lock:
            if chunks not in self._bundles and self._bundle_bytes + len(buf) <= budget:
                self._bundles[chunks] = buf
                self._bundle_bytes += len(buf)

    def executor(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._workers < workers:  # (more readers asked for: a larger pool)
                if self._pool is not None:
                    self._pool.shutdown(wait=False)  # its running reads end; their callers wait for them
                self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-read")
                self._workers = workers
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._closes += 1
            self._bundles.clear()
            self._bundle_bytes = 0
            self._unreadable.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ReadPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_chunks(objects: ObjectStore, tasks: Iterable[GetTask], settings: Settings, progress: Progress | None = None,
               manifest: Manifest | Sequence[Manifest] | None = None, pool: ReadPool | None = None) -> GetStats:
    """Fetch, decode (following delta chains) and verify chunks in parallel, into each task's
    ``into`` buffer and/or handing the bytes to its ``sink``.

    ``workers`` threads decode and verify, taking the chunks in order, while the reads
    run ahead of them: a disk, like a remote store, answers several reads at once faster
    than one at a time (benchmarks/results/snapshot.md: a cold restore, 2 reading
    threads -> 8), but more decoding threads than cores only contend for the GIL and
    evict each other's buffers from the caches (the MiniLM fp32 family from a store in
    memory: 803 MB/s with 8 threads reading and decoding, 920 like this).

    A local store is asked to prefetch the next ``2 * io_workers`` chunks (the kernel
    reads them in the background) and each decoding thread reads its own chunk: no
    hand-off between threads per chunk. Elsewhere ``io_workers`` threads (or as many as
    the remote store allows) read the blobs ahead into memory, with the blobs of their
    delta chains (:func:`read_ahead`): a sliding window that starts the next read as
    soon as a chunk is taken for decoding (never batches that wait for their slowest
    member), at most twice as many reads as there are reading threads and at most
    ``settings.inflight_mb`` of chunks fetched but not yet taken for decoding (beyond the one
    a decoding thread waits for), which bounds memory
    whichever side is slower. A chunk served by the local cache that fails to decode
    is fetched again, its entry replaced where the store's blob differs (:func:`refetch`).

    ``manifest``: the checkpoint (or checkpoints) the tasks read. From a remote store, the small
    chunks its bundles hold are served from them (:func:`_from_bundles`): a few requests, not one each.
    ``pool``: the reading threads to use (a caller's :class:`ReadPool`, kept between calls, with the
    bundles fetched through it); by default a pool of this call's own, ended before it returns.
    """
    todo = list(tasks)
    for t in todo:
        check_claim(t.id, t.length, settings)
    progress = progress or NullProgress()
    stats = GetStats(len(todo))
    for m in [manifest] if isinstance(manifest, Manifest) else manifest or ():
        if m.bundles and objects.backend.streams:
            todo = _from_bundles(objects, todo, m, settings, progress, pool)
    readers = max(settings.io_workers, objects.backend.concurrency)
    ahead = 2 * readers
    limit = settings.inflight_mb << 20
    lock = threading.Lock()
    reads: dict[int, Future[ChunkRead]] = {}
    submitted = 0  # reads are submitted for todo[:submitted]
    inflight = 0  # bytes of chunks submitted and not yet taken for decoding
    hinted = objects.backend.prefetches
    own = None if hinted or pool is not None else ThreadPoolExecutor(max_workers=readers, thread_name_prefix="ckpt-read")
    closes = pool.closes() if pool is not None else 0
    io = None if hinted else own if own is not None else pool.executor(readers)  # type: ignore[union-attr]

    def closed() -> None:
        """Raise :class:`ReaderClosedError` where another thread closed ``pool`` since this call began:
        its queued reads are cancelled and it takes no more (a bare CancelledError or RuntimeError)."""
        if pool is not None and pool.closes() != closes:
            raise ReaderClosedError("the reader was closed while this read was under way (by another thread, or a "
                                    "with-block left): the read did not finish",
                                    hint="close a reader only once its reads have returned; a later read starts it again")
    # Blobs in flight: at most ``ahead`` read ahead and one per decoding thread.
    buffers = None if hinted else BlobBuffers(settings.chunk_size + MAX_HEADER, ahead + settings.workers)

    def get(i: int) -> None:
        nonlocal submitted, inflight
        task = todo[i]
        if hinted:  # read in this thread, having asked the disk for the reads ahead
            with lock:
                ahead_ids = [todo[j].id for j in range(submitted, min(len(todo), i + ahead))]
                submitted = max(submitted, i + ahead)
            for cid in ahead_ids:
                objects.backend.prefetch(objects.path("chunks", cid))
            got = read_chunk(objects, task.id, task.length, settings, task.into)
        else:
            assert io is not None
            with lock:
                # The window slides: every chunk up to this one, then more while the
                # count and byte bounds allow.
                while submitted < len(todo) and (submitted <= i or (
                        submitted < i + ahead and inflight + todo[submitted].length <= limit)):
                    t = todo[submitted]
                    try:
                        reads[submitted] = io.submit(read_ahead, objects, t.id, t.length, settings, t.into, buffers)
                    except RuntimeError:  # its threads were shut down: by a close?
                        closed()
                        raise
                    inflight += t.length
                    submitted += 1
                stats.peak_inflight = max(stats.peak_inflight, inflight)
                pending = reads.pop(i)
            try:
                got = pending.result()
            except CancelledError:
                closed()
                raise
            finally:
                with lock:
                    inflight -= task.length
        try:
            data, _ = decode_read(objects, task.id, task.length, settings, got, out=_decode_into(task, got))
        except (CorruptObjectError, ObjectNotFoundError) as e:
            def decode(fresh: ChunkRead) -> tuple[Any, tuple[str, ...]]:
                nonlocal got
                got = fresh  # (its buffer handed back below)
                return decode_read(objects, task.id, task.length, settings, fresh, out=_decode_into(task, fresh))

            data, _ = refetch(objects, task.id, task.length, settings, got, e, task.into, decode)
        if task.sink is not None:
            task.sink(data)  # type: ignore[arg-type]
        if buffers is not None and got.blob is not None:
            buffers.give(got.blob)  # decoded and handed on: nothing refers to it any more

    try:
        run_parallel(get, range(len(todo)), settings.workers, progress, lambda i: todo[i].length,
                     batch=BATCH_BYTES)
    finally:
        if own is not None:
            own.shutdown(wait=True, cancel_futures=True)
        elif reads:  # after an error: this call's reads queued in the shared pool are dropped, running ones ended
            # (only those: wait() never returns for a read cancelled where no thread takes it up, as
            # when the pool is closed by another thread mid-read, which hung the read for good)
            wait([f for f in reads.values() if not f.cancel()])
        if buffers is not None:
            buffers.close()  # (every read of this call has ended: its buffers serve the next call)
    return stats
