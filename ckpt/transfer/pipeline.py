"""The parallel part of push and pull: hash, encode and write chunks; fetch, decode, verify.

Hashing (blake3), zstd and file I/O release the GIL, so a thread pool of
``Settings.workers`` threads uses every core. Each task reads its own bytes
when it runs, so memory in flight stays at about ``workers`` chunks.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ckpt.codecs.chunk import (
    MAX_HEADER,
    RAW,
    ChunkHeader,
    decode_chunk,
    empty_buffer,
    encode_chunk,
    parse_header,
    raw_header,
    thread_buffer,
)
from ckpt.errors import ReaderClosedError
from ckpt.format.dtypes import byte_view
from ckpt.format.manifest import BundleEntry, Manifest, TensorEntry, split_lengths
from ckpt.progress import NullProgress, Progress
from ckpt.settings import Settings
from ckpt_store.storage.errors import CorruptObjectError, ObjectNotFoundError
from ckpt_store.storage.objects import ObjectStore, object_hasher, object_id

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int, progress: Progress, weight: Callable[[T], int],
                 batch: int = 0) -> list[R]:
    """``[fn(x) for x in items]`` on a thread pool; the first error cancels the rest and is raised.

    ``batch``: consecutive items are handed to a thread together while their weights add
    up to at most this (an item heavier than that goes alone), so that many small items
    (a model's biases and norms, a chunk each) do not each pay for a hand-off between
    threads (about 80 us each here: a tenth of the time of loading a MiniLM fine-tune).
    """
    if not items:
        return []
    lock = threading.Lock()
    weights = [weight(x) for x in items]
    groups: list[range] = []
    start, total = 0, 0
    for i, w in enumerate(weights):
        if i > start and total + w > batch:
            groups.append(range(start, i))
            start, total = i, 0
        total += w
    groups.append(range(start, len(items)))

    def run(group: range) -> list[R]:
        out = []
        for i in group:
            out.append(fn(items[i]))
            with lock:
                progress.advance(weights[i])
        return out

    if len(groups) == 1 and sum(weights) <= BATCH_BYTES:
        # Little work for one thread: run here. A pool per call started and joined a thread each time
        # (a diff of 10,000 small tensors calls this three times per tensor: most of its time). (Not
        # more work: the chunk-sized buffers of thread_buffer would stay with the calling thread.)
        return run(groups[0])
    with ThreadPoolExecutor(max_workers=min(workers, len(groups)), thread_name_prefix="ckpt") as pool:
        try:
            futures: list[Future[list[R]]] = [pool.submit(run, g) for g in groups]
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            return [r for f in futures for r in f.result()]
        finally:
            # The first error, or Ctrl-C (SIGTERM) in this thread, starts no further group: the
            # running ones end, the rest are dropped (leaving the ``with`` alone ran every one).
            pool.shutdown(wait=True, cancel_futures=True)


# Items handed to a worker thread at once by push and pull: up to this many bytes of
# consecutive small chunks (a 4 MiB chunk goes alone).
BATCH_BYTES = 1 << 20


# A reader follows delta chains at most this deep, whatever the writer's setting:
# it bounds work on a corrupt store (a blob naming itself as its base, say).
MAX_CHAIN = 64


class ChunkCache:
    """Decoded, verified chunks by id within a byte budget, least recently used first out.

    A chunk is kept only when a second chunk asks for it: a base wanted by one delta
    (the base of a merge's output, or a snapshot's chunk under the next snapshot's,
    asked again only when a chain is walked from further up) costs no memory; one that
    several deltas need (the base of a family) is decoded at most twice. Keeping chunks
    that are never asked for again is not free: in the GPT run, whose chains asked for
    every chunk twice from the same delta, it made loading 20-25% slower (fresh memory,
    and a larger working set in the caches).
    """

    def __init__(self, budget: int, remember: int = 1 << 16) -> None:
        self.budget = budget
        self.size = 0
        self.hits = 0  # lookups answered (tests read it)
        self._items: OrderedDict[str, tuple[bytes | bytearray | memoryview, tuple[str, ...]]] = OrderedDict()
        self._seen: OrderedDict[str, str] = OrderedDict()  # ids asked for by one chunk (its id), not kept
        self._remember = remember
        self._lock = threading.Lock()

    def get(self, cid: str) -> tuple[bytes | bytearray | memoryview, tuple[str, ...]] | None:
        with self._lock:
            item = self._items.get(cid)
            if item is None:
                return None
            self._items.move_to_end(cid)
            self.hits += 1
            return item

    def __contains__(self, cid: str) -> bool:
        with self._lock:
            return cid in self._items

    def ask(self, cid: str, by: str = "") -> bool:
        """Record that chunk ``by`` wants ``cid`` (not in the cache); True when another chunk
        asked for it before: then the caller decodes it into memory of its own and
        :meth:`put` s it."""
        with self._lock:
            first = self._seen.get(cid)
            if first is not None and first != by:
                del self._seen[cid]
                return True
            self._seen[cid] = by
            if len(self._seen) > self._remember:
                self._seen.popitem(last=False)
            return False

    def put(self, cid: str, item: tuple[bytes | bytearray | memoryview, int]) -> None:
        """Keep ``item`` (its bytes must stay as they are), oldest out past the budget."""
        n = len(item[0])
        with self._lock:
            if cid in self._items or n > self.budget:
                return
            self._items[cid] = item
            self.size += n
            while self.size > self.budget:
                _, (old, _) = self._items.popitem(last=False)
                self.size -= len(old)

    def offer(self, cid: str, item: tuple[bytes | bytearray | memoryview, int], by: str = "") -> None:
        """Keep ``item`` if another chunk asked for ``cid`` before ``by``; otherwise remember the ask."""
        if self.ask(cid, by):
            self.put(cid, item)


_caches: weakref.WeakKeyDictionary[ObjectStore, ChunkCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def base_cache(objects: ObjectStore, settings: Settings) -> ChunkCache | None:
    """The decoded-base cache of this open store (``settings.base_cache_mb``; None when 0)."""
    if settings.base_cache_mb <= 0:
        return None
    with _caches_lock:
        cache = _caches.get(objects)
        if cache is None:
            cache = _caches[objects] = ChunkCache(settings.base_cache_mb << 20)
        return cache


def fetch_base(objects: ObjectStore, cid: str, length: int, settings: Settings, by: str,
               _depth: int = 0, blobs: Mapping[str, bytes] | None = None, *, verify: bool = True, ask: bool = True,
               ) -> tuple[bytes | bytearray | memoryview, tuple[str, ...]]:
    """:func:`fetch_chunk` for a chunk wanted as the base of chunk ``by``: served from the
    store's decoded-base cache when it is there. (Chunks are named by their bytes, so a
    cached chunk is the chunk; whether it is still in the store is the caller's question.)
    ``blobs``: chunk blobs already read (see :func:`_read_ahead`).

    ``verify=False``: the base is only an input of ``by``'s decoding, whose result is
    hashed against ``by``'s id, so its own hash may be left out (see :func:`_decode_read`).
    A base that is kept (in the decoded-base cache, or decoded into the local chunk cache)
    is always verified first: it may be served again.

    ``ask=False``: served by the cache where it holds the base, but neither counted as an ask nor
    kept: the caller knows it is the base's last use (see :func:`put_chunks`' ``keep_bases``)."""
    cache = base_cache(objects, settings)
    item = cache.get(cid) if cache is not None else None
    if item is None:
        keep = ask and cache is not None and cache.ask(cid, by)
        # A base not kept is decoded into a buffer of this thread's, one per chain level
        # (chunks of this store's size, chains as deep as this store writes; a larger
        # claim, or a deeper chain from another writer or a damaged store, gets memory
        # of its own, released after use): fresh memory for every base would cost page
        # faults and cache misses (the GPT run loaded 20-30% slower with the cache on).
        reuse = not keep and length <= settings.chunk_size and _depth <= settings.max_delta_depth + 1
        out = thread_buffer(length, f"base{_depth}") if reuse else None
        item = fetch_chunk(objects, cid, length, settings, _depth, out=out, blobs=blobs, verify=verify or keep)
        if keep:
            assert cache is not None
            cache.put(cid, item)
    return item


_READ_INTO_MIN = 256 << 10  # smallest chunk read in two steps, header then straight into place


class BlobBuffers:
    """Buffers for chunk blobs read from a remote store, handed back once a blob is
    decoded and reused: a fresh buffer per blob cost the kernel's page faults and zeroing
    and a zero fill of our own (perf of a 512 MB fp32 pull from SeaweedFS: 8% of its CPU).
    Every buffer holds ``size`` bytes; at most ``keep`` wait for reuse (the others go)."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview:
        """``n`` bytes of a buffer of this pool's (one of its own if ``n`` is larger, or small:
        a small blob in a whole buffer would cost more memory than its page faults cost time)."""
        if _READ_INTO_MIN <= n <= self.size:
            with self._lock:
                buf = self._free.pop() if self._free else None
            return (buf if buf is not None else empty_buffer(self.size))[:n]
        return empty_buffer(n)

    def give(self, blob: object) -> None:
        """Hand back a blob from :meth:`take`: its bytes are no longer used."""
        base = blob.obj if isinstance(blob, memoryview) else None
        if isinstance(base, np.ndarray) and base.nbytes == self.size:
            with self._lock:
                if len(self._free) < self.keep:
                    self._free.append(memoryview(base))


@dataclass(frozen=True)
class _Read:
    """What :func:`_read_chunk` got: a blob to decode, or a raw chunk already read into ``out``."""

    blob: bytes | bytearray | memoryview | None
    into: int = 0  # raw chunks: the blob's bytes past its header (those that fit were read into ``out``)
    bases: Mapping[str, bytes] = field(default_factory=dict)  # blobs of the delta chain below, read ahead
    cached: bool = False  # served by the local chunk cache (a bad one is dropped and fetched again)
    digest: str | None = None  # raw chunks read locally: the id of the bytes read into ``out``, hashed as they came


def _read_remote(objects: ObjectStore, cid: str, length: int, settings: Settings, out: memoryview | None,
                 use_cache: bool = True, buffers: BlobBuffers | None = None) -> _Read:
    """One GET of chunk ``cid`` from a remote store (or its blob from the local cache). A raw
    chunk's body is read off the socket straight into ``out``; any other blob into one
    buffer of its size (from ``buffers`` where given). What is fetched is kept in the cache."""
    cache = objects.cache if use_cache else None
    got: dict[str, Any] = {}

    def place(head: bytes, size: int) -> memoryview:
        got.clear()
        if out is not None and len(out) == length and settings.max_chunk_size >= length:
            try:
                h = parse_header(head, cid)
            except CorruptObjectError:
                h = None  # reported when the blob is decoded
            if h is not None and h.codec == RAW and h.length == length and size - h.size == length:
                k = len(head) - h.size
                out[:k] = head[h.size:]
                got["raw"] = h.size
                return out[k:]
        if size > settings.max_chunk_size + MAX_HEADER:
            raise CorruptObjectError("chunk", cid, f"blob of {size} bytes is larger than any chunk")
        blob = got["blob"] = buffers.take(size) if buffers is not None else empty_buffer(size)
        blob[: len(head)] = head
        return blob[len(head):]

    if cache is not None:
        # Read as a remote blob is (a chunk kept decoded straight into ``out``), and not
        # hashed here: every caller decodes and verifies the chunk against its id, and drops
        # a cached blob that fails and fetches it again (get_chunks, fetch_chunk).
        try:
            cached = cache.read_split(cid, MAX_HEADER, place)
        except CorruptObjectError:  # larger than any chunk
            cache.drop(cid)
            cached = None
        if cached is not None:
            return _Read(None, length, cached=True) if "raw" in got else _Read(got["blob"], cached=True)
    try:
        head = objects.backend.read_split(objects.path("chunks", cid), MAX_HEADER, place)
    except FileNotFoundError:
        raise ObjectNotFoundError("chunk", cid) from None
    if "raw" in got:
        assert out is not None
        if objects.cache is not None:
            objects.cache.put(cid, (head[: got["raw"]], out))
        return _Read(None, length)
    if objects.cache is not None:
        try:
            decoded_later = _kept_decoded(parse_header(got["blob"], cid), len(got["blob"]))
        except CorruptObjectError:
            decoded_later = False  # reported when it is decoded
        if not decoded_later:
            objects.cache.put(cid, (got["blob"],))  # (one kept decoded is put once decoded: _decode_read)
    return _Read(got["blob"])


def _kept_decoded(h: ChunkHeader, stored: int) -> bool:
    """Whether the local chunk cache keeps the chunk of a blob of ``stored`` bytes with header
    ``h`` decoded (as a raw blob) rather than as stored: a whole chunk (not a delta) that its
    codec shrank by less than half. A cached re-pull of it then costs a read and a hash instead
    of decoding it again (zstd decodes ~1 GB/s per core here, and it was most of a warm pull's
    CPU), for at most twice the disk. Deltas stay as stored: they are small, and their bases
    are kept decoded."""
    return h.codec != RAW and h.base is None and 2 * stored >= h.length


def _read_chunk(objects: ObjectStore, cid: str, length: int, settings: Settings, out: memoryview | None = None,
                buffers: BlobBuffers | None = None) -> _Read:
    """The I/O half of :func:`fetch_chunk`: from a local store a raw chunk is read straight
    into ``out`` (its header first); anything else comes back as its blob. (A small chunk
    is read whole: a second read costs more than copying it.) A remote store that streams
    reads it in one request (:func:`_read_remote`), through the local chunk cache."""
    if objects.backend.streams:
        return _read_remote(objects, cid, length, settings, out, buffers=buffers)
    if out is not None and objects.backend.reads_into and settings.max_chunk_size >= length == len(out) >= _READ_INTO_MIN:
        path = objects.path("chunks", cid)
        try:
            head = parse_header(objects.backend.read_range(path, 0, MAX_HEADER), cid)
            if head.codec == RAW and head.length != length:
                raise CorruptObjectError("chunk", cid, f"raw blob holds {head.length} bytes, the manifest says {length}")
            if head.codec == RAW:  # hashed block by block as it is read, each block still in the CPU's caches
                hasher = object_hasher()
                size = objects.backend.read_into(path, head.size, out, each=hasher.update)
                return _Read(None, size - head.size, digest=hasher.hexdigest())
        except FileNotFoundError:
            raise ObjectNotFoundError("chunk", cid) from None
    return _Read(objects.get("chunks", cid))


def _read_ahead(objects: ObjectStore, cid: str, length: int, settings: Settings, out: memoryview | None = None,
                buffers: BlobBuffers | None = None) -> _Read:
    """:func:`_read_chunk`, and the blobs of the delta chain below the chunk that neither the base
    cache nor the local chunk cache holds (as deep as this store writes chains): on a remote store
    the reading threads fetch them too, so a decoding thread does not wait on them request by
    request. A base in the local chunk cache is left to the decoding thread, which reads it
    straight into its buffer and hashes it once (read ahead, it would be read into fresh memory,
    checked against its entry's trailer, then copied and hashed again)."""
    got = _read_chunk(objects, cid, length, settings, out, buffers)
    cache = base_cache(objects, settings)
    bases: dict[str, bytes] = {}
    blob = got.blob
    while blob is not None and len(bases) <= settings.max_delta_depth:
        try:
            base = parse_header(blob, cid).base
        except CorruptObjectError:
            break  # the decoding thread reports it
        if base is None or base in bases or (cache is not None and base in cache) or \
                (objects.cache is not None and objects.cache.has(base)):
            break  # (a base in the local chunk cache is read by the decoding thread, straight into place)
        blob = bases[base] = objects.get("chunks", base)
    return _Read(got.blob, got.into, bases, got.cached)


def _decode_read(objects: ObjectStore, cid: str, length: int, settings: Settings, got: _Read, _depth: int = 0,
                 out: memoryview | None = None, verify: bool = True) -> tuple[bytes | bytearray | memoryview, tuple[str, ...]]:
    """The CPU half of :func:`fetch_chunk`: verify (and decode) what :func:`_read_chunk` got.

    A delta's base is decoded without hashing it (``verify=False``, down its chain): the
    delta's own result is hashed, and wrong base bytes cannot give the right result. That
    saves hashing every base once more (a MiniLM fine-tune loaded from a local store: 8% of
    its CPU). Only when the result fails is the base fetched again, verified, so
    that a damaged copy of it is found (a cache entry dropped and fetched again) and the
    error names the chunk that is damaged. ``verify=False`` (a base of a chunk above) leaves
    the hash of this chunk to that caller."""
    if got.blob is None:
        assert out is not None
        if got.into != length:
            raise CorruptObjectError("chunk", cid, f"raw blob of {got.into} bytes does not hold the {length} bytes the manifest says")
        if verify and (got.digest if got.digest is not None else object_id(out)) != cid:
            raise CorruptObjectError("chunk", cid, "decoded bytes do not match the chunk id")
        return out, ()
    h = parse_header(got.blob, cid)
    keep_decoded = objects.cache is not None and _kept_decoded(h, len(got.blob))
    base, chain = None, ()
    if h.base == cid:
        raise CorruptObjectError("chunk", cid, "stored as a delta against itself")
    if h.base is not None:
        base, below = fetch_base(objects, h.base, length, settings, cid, _depth + 1, got.bases, verify=False)
        chain = (h.base, *below)
    try:
        # (a chunk the local chunk cache keeps decoded is checked before it is kept)
        data = decode_chunk(got.blob, cid, length, max_length=settings.max_chunk_size, base=base, out=out,
                            verify=verify or keep_decoded)
    except CorruptObjectError:
        if h.base is None or not verify:
            raise  # (an unchecked base: the chunk above finds out and asks again, verified)
        base, below = fetch_base(objects, h.base, length, settings, cid, _depth + 1, got.bases)
        chain = (h.base, *below)
        data = decode_chunk(got.blob, cid, length, max_length=settings.max_chunk_size, base=base, out=out)
    if keep_decoded:
        assert objects.cache is not None
        # Replaces the blob as stored where the cache had it (read ahead as a base, or cached before).
        objects.cache.put(cid, (raw_header(h.elem, length), data), replace=True)
    return data, chain


def _check_claim(cid: str, length: int, settings: Settings) -> None:
    """A manifest is outside data: no buffer is sized by a length no chunk can have."""
    if length > settings.max_chunk_size:
        raise CorruptObjectError("chunk", cid, f"the checkpoint says {length} bytes, more than any chunk "
                                 f"({settings.max_chunk_size}, CKPT_MAX_CHUNK_SIZE)")


def fetch_chunk(objects: ObjectStore, cid: str, length: int, settings: Settings, _depth: int = 0,
                out: memoryview | None = None, blobs: Mapping[str, bytes] | None = None, verify: bool = True,
                ) -> tuple[bytes | bytearray | memoryview, tuple[str, ...]]:
    """Decoded, verified bytes of chunk ``cid`` and its delta chain: the ids of every base its
    decoding walked, nearest first (empty: no base).

    With ``out`` (``length`` writable bytes: a slice of a tensor's memory) the bytes
    land there: from a local store a raw chunk is read straight into it (its header
    first) and hashed in place; others are decoded into it. On error its contents are
    unspecified. ``blobs``: chunk blobs already read, used instead of reading them again.
    ``verify=False``: for a delta's base only (see :func:`_decode_read`).
    """
    if _depth > MAX_CHAIN:
        raise CorruptObjectError("chunk", cid, f"delta chain longer than {MAX_CHAIN}")
    _check_claim(cid, length, settings)
    if blobs and cid in blobs:
        got = _Read(blobs[cid], bases=blobs)
    else:
        got = _read_chunk(objects, cid, length, settings, out)
    try:
        return _decode_read(objects, cid, length, settings, got, _depth, out, verify)
    except CorruptObjectError:
        if not got.cached or objects.cache is None:
            raise
        objects.cache.drop(cid)  # a damaged cache entry: never served, fetched again
        fresh = _read_remote(objects, cid, length, settings, out, use_cache=False)
        if got.blob is not None and fresh.blob is not None and memoryview(fresh.blob) == memoryview(got.blob):
            # The store holds what the cache held: decoding it again would fail again, and on
            # a damaged chain each level above would retry too (2**depth decodes of a chain
            # that names itself). The damage is in the store, or below this chunk.
            raise
        return _decode_read(objects, cid, length, settings, fresh, _depth, out, verify)


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


def stored_chain(objects: ObjectStore, cid: str) -> tuple[int, tuple[str, ...]]:
    """Codec of the stored blob ``cid`` and the ids of every base its decoding needs (headers only)."""
    chain: list[str] = []
    codec = -1
    cur: str | None = cid
    while cur is not None:
        if len(chain) > MAX_CHAIN:
            raise CorruptObjectError("chunk", cid, f"delta chain longer than {MAX_CHAIN}")
        try:
            head = objects.backend.read_range(objects.path("chunks", cur), 0, MAX_HEADER)
        except FileNotFoundError:
            raise ObjectNotFoundError("chunk", cur) from None
        h = parse_header(head, cur)
        if cur == cid:
            codec = h.codec
        else:
            chain.append(cur)
        cur = h.base
    return codec, tuple(chain)


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


def _decode_into(task: GetTask, got: _Read) -> memoryview | None:
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
# only is not stored twice): push's _bundle, and what a merge holds back for it.
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
    delta chains (:func:`_read_ahead`): a sliding window that starts the next read as
    soon as a chunk is taken for decoding (never batches that wait for their slowest
    member), at most twice as many reads as there are reading threads and at most
    ``settings.inflight_mb`` of chunks fetched but not yet taken for decoding (beyond the one
    a decoding thread waits for), which bounds memory
    whichever side is slower. A chunk served by the local cache that fails to decode
    is dropped from the cache and fetched again.

    ``manifest``: the checkpoint (or checkpoints) the tasks read. From a remote store, the small
    chunks its bundles hold are served from them (:func:`_from_bundles`): a few requests, not one each.
    ``pool``: the reading threads to use (a caller's :class:`ReadPool`, kept between calls, with the
    bundles fetched through it); by default a pool of this call's own, ended before it returns.
    """
    todo = list(tasks)
    for t in todo:
        _check_claim(t.id, t.length, settings)
    progress = progress or NullProgress()
    stats = GetStats(len(todo))
    for m in [manifest] if isinstance(manifest, Manifest) else manifest or ():
        if m.bundles and objects.backend.streams:
            todo = _from_bundles(objects, todo, m, settings, progress, pool)
    readers = max(settings.io_workers, objects.backend.concurrency)
    ahead = 2 * readers
    limit = settings.inflight_mb << 20
    lock = threading.Lock()
    reads: dict[int, Future[_Read]] = {}
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
            got = _read_chunk(objects, task.id, task.length, settings, task.into)
        else:
            assert io is not None
            with lock:
                # The window slides: every chunk up to this one, then more while the
                # count and byte bounds allow.
                while submitted < len(todo) and (submitted <= i or (
                        submitted < i + ahead and inflight + todo[submitted].length <= limit)):
                    t = todo[submitted]
                    try:
                        reads[submitted] = io.submit(_read_ahead, objects, t.id, t.length, settings, t.into, buffers)
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
            data, _ = _decode_read(objects, task.id, task.length, settings, got, out=_decode_into(task, got))
        except CorruptObjectError:
            if not got.cached or objects.cache is None:
                raise
            objects.cache.drop(task.id)
            got = _read_remote(objects, task.id, task.length, settings, task.into, use_cache=False)
            data, _ = _decode_read(objects, task.id, task.length, settings, got, out=_decode_into(task, got))
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
    return stats
