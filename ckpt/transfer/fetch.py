"""Fetching one chunk: read it (from a local store a raw chunk straight into place, from a remote
one in one request, through the local chunk cache), decode it following its delta chain (bases
through the decoded-base cache), and verify it against its id. The I/O half (:func:`read_chunk`,
:func:`read_ahead`) and the CPU half (:func:`decode_read`) are apart so that :func:`get_chunks`
(reading.py) runs them on different threads; :func:`fetch_chunk` runs both."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ckpt.codecs.buffers import SPARES, empty_buffer, thread_buffer
from ckpt.codecs.chunk import MAX_HEADER, RAW, ChunkHeader, decode_chunk, parse_header, raw_header
from ckpt.settings import Settings
from ckpt.transfer.base_cache import base_cache
from ckpt_store.storage.errors import CorruptObjectError, ObjectNotFoundError
from ckpt_store.storage.objects import ObjectStore, object_hasher, object_id

# A reader follows delta chains at most this deep, whatever the writer's setting:
# it bounds work on a corrupt store (a blob naming itself as its base, say).
MAX_CHAIN = 64

T = TypeVar("T")


def fetch_base(objects: ObjectStore, cid: str, length: int, settings: Settings, by: str,
               _depth: int = 0, blobs: Mapping[str, bytes | None] | None = None, *, verify: bool = True, ask: bool = True,
               strict: bool = False, _above: tuple[str, ...] = ()) -> tuple[bytes | bytearray | memoryview, tuple[str, ...]]:
    """:func:`fetch_chunk` for a chunk wanted as the base of chunk ``by``: served from the
    store's decoded-base cache when it is there. (Chunks are named by their bytes, so a
    cached chunk is the chunk; whether it is still in the store is the caller's question.)
    ``blobs``: chunk blobs already read (None: found missing from the store; see :func:`read_ahead`).

    ``verify=False``: the base is only an input of ``by``'s decoding, whose result is
    hashed against ``by``'s id, so its own hash may be left out (see :func:`decode_read`).
    A base that is kept (in the decoded-base cache, or decoded into the local chunk cache)
    is always verified first: it may be served again.

    ``ask=False``: served by the cache where it holds the base, but neither counted as an ask nor
    kept: the caller knows it is the base's last use (see :func:`put_chunks`' ``keep_bases``).

    ``strict=True`` (its callers verify too): every base down its chain is verified before it is used (see :func:`decode_read`)."""
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
        item = fetch_chunk(objects, cid, length, settings, _depth, out=out, blobs=blobs, verify=verify or keep,
                           strict=strict, _above=_above)
        if keep:
            assert cache is not None
            cache.put(cid, item)
    return item


_READ_INTO_MIN = 256 << 10  # smallest chunk read in two steps, header then straight into place


class BlobBuffers:
    """Buffers for chunk blobs read from a remote store, handed back once a blob is
    decoded and reused: a fresh buffer per blob cost the kernel's page faults and zeroing
    and a zero fill of our own (perf of a 512 MB fp32 pull from SeaweedFS: 8% of its CPU).
    Every buffer holds ``size`` bytes; at most ``keep`` wait for reuse (the others go).
    It starts with those the process's last read left, and :meth:`close` leaves its own to the next
    (:class:`~ckpt.codecs.buffers.SpareBuffers`)."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._free: list[memoryview] = SPARES.take(size)[:keep]
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """The read is over (no blob of this pool's is in use): its buffers go to the next read."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            free, self._free = self._free, []
        SPARES.leave(self.size, free, self.keep)

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
class ChunkRead:
    """What :func:`read_chunk` got: a blob to decode, or a raw chunk already read into ``out``."""

    blob: bytes | bytearray | memoryview | None
    into: int = 0  # raw chunks: the blob's bytes past its header (those that fit were read into ``out``)
    bases: Mapping[str, bytes | None] = field(default_factory=dict)  # blobs of the chain below read ahead (None: missing)
    cached: bool = False  # served by the local chunk cache (a bad one is dropped and fetched again)
    digest: str | None = None  # raw chunks read locally: the id of the bytes read into ``out``, hashed as they came


def read_remote(objects: ObjectStore, cid: str, length: int, settings: Settings, out: memoryview | None,
                 buffers: BlobBuffers | None = None, *, stale: ChunkRead | None = None) -> ChunkRead:
    """One GET of chunk ``cid`` from a remote store (or its blob from the local cache). A raw
    chunk's body is read off the socket straight into ``out``; any other blob into one
    buffer of its size (from ``buffers`` where given). What is fetched is kept in the cache.
    ``stale``: what the cache served, found wrong: the store is read past the cache, and its blob
    replaces the entry unless it is the same blob (see :func:`refetch`)."""
    cache = objects.cache if stale is None else None
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
            return ChunkRead(None, length, cached=True) if "raw" in got else ChunkRead(got["blob"], cached=True)
    try:
        head = objects.backend.read_split(objects.path("chunks", cid), MAX_HEADER, place)
    except FileNotFoundError:
        raise ObjectNotFoundError("chunk", cid) from None
    if stale is not None and objects.cache is not None and not _same(stale, got.get("blob")):
        objects.cache.drop(cid)  # a damaged (or another store's) entry: never served again, replaced below
    if "raw" in got:
        assert out is not None
        if objects.cache is not None:
            objects.cache.put(cid, (head[: got["raw"]], out))
        return ChunkRead(None, length)
    if objects.cache is not None:
        try:
            decoded_later = _kept_decoded(parse_header(got["blob"], cid), len(got["blob"]))
        except CorruptObjectError:
            decoded_later = False  # reported when it is decoded
        if not decoded_later:
            objects.cache.put(cid, (got["blob"],))  # (one kept decoded is put once decoded: decode_read)
    return ChunkRead(got["blob"])


def _same(read: ChunkRead, blob: bytes | bytearray | memoryview | None) -> bool:
    """Whether ``read`` holds the blob ``blob`` (not known for raw chunks read into place: no)."""
    return read.blob is not None and blob is not None and memoryview(read.blob) == memoryview(blob)


def _kept_decoded(h: ChunkHeader, stored: int) -> bool:
    """Whether the local chunk cache keeps the chunk of a blob of ``stored`` bytes with header
    ``h`` decoded (as a raw blob) rather than as stored: a whole chunk (not a delta) that its
    codec shrank by less than half. A cached re-pull of it then costs a read and a hash instead
    of decoding it again (zstd decodes ~1 GB/s per core here, and it was most of a warm pull's
    CPU), for at most twice the disk. Deltas stay as stored: they are small, and their bases
    are kept decoded."""
    return h.codec != RAW and h.base is None and 2 * stored >= h.length


def read_chunk(objects: ObjectStore, cid: str, length: int, settings: Settings, out: memoryview | None = None,
                buffers: BlobBuffers | None = None) -> ChunkRead:
    """The I/O half of :func:`fetch_chunk`: from a local store a raw chunk is read straight
    into ``out`` (its header first); anything else comes back as its blob. (A small chunk
    is read whole: a second read costs more than copying it.) A remote store that streams
    reads it in one request (:func:`read_remote`), through the local chunk cache."""
    if objects.backend.streams:
        return read_remote(objects, cid, length, settings, out, buffers=buffers)
    if out is not None and objects.backend.reads_into and settings.max_chunk_size >= length == len(out) >= _READ_INTO_MIN:
        path = objects.path("chunks", cid)
        try:
            head = parse_header(objects.backend.read_range(path, 0, MAX_HEADER), cid)
            if head.codec == RAW and head.length != length:
                raise CorruptObjectError("chunk", cid, f"raw blob holds {head.length} bytes, the manifest says {length}")
            if head.codec == RAW:  # hashed block by block as it is read, each block still in the CPU's caches
                hasher = object_hasher()
                size = objects.backend.read_into(path, head.size, out, each=hasher.update)
                return ChunkRead(None, size - head.size, digest=hasher.hexdigest())
        except FileNotFoundError:
            raise ObjectNotFoundError("chunk", cid) from None
    return ChunkRead(objects.get("chunks", cid))


def read_ahead(objects: ObjectStore, cid: str, length: int, settings: Settings, out: memoryview | None = None,
                buffers: BlobBuffers | None = None) -> ChunkRead:
    """:func:`read_chunk`, and the blobs of the delta chain below the chunk that neither the base
    cache nor the local chunk cache holds (as deep as this store writes chains): on a remote store
    the reading threads fetch them too, so a decoding thread does not wait on them request by
    request. A base in the local chunk cache is left to the decoding thread, which reads it
    straight into its buffer and hashes it once (read ahead, it would be read into fresh memory,
    checked against its entry's trailer, then copied and hashed again)."""
    got = read_chunk(objects, cid, length, settings, out, buffers)
    cache = base_cache(objects, settings)
    bases: dict[str, bytes | None] = {}
    blob: bytes | bytearray | memoryview | None = got.blob
    while blob is not None and len(bases) <= settings.max_delta_depth:
        try:
            base = parse_header(blob, cid).base
        except CorruptObjectError:
            break  # the decoding thread reports it
        if base is None or base in bases or (cache is not None and base in cache) or \
                (objects.cache is not None and objects.cache.has(base)):
            break  # (a base in the local chunk cache is read by the decoding thread, straight into place)
        try:
            blob = bases[base] = objects.get("chunks", base)
        except ObjectNotFoundError:
            bases[base] = None  # the decoding thread reports it (or finds the cached blob above wrong), not asking again
            break
    return ChunkRead(got.blob, got.into, bases, got.cached)


def decode_read(objects: ObjectStore, cid: str, length: int, settings: Settings, got: ChunkRead, _depth: int = 0,
                 out: memoryview | None = None, verify: bool = True, strict: bool = False, _above: tuple[str, ...] = (),
                 ) -> tuple[bytes | bytearray | memoryview, tuple[str, ...]]:
    """The CPU half of :func:`fetch_chunk`: verify (and decode) what :func:`read_chunk` got.

    A delta's base is decoded without hashing it (``verify=False``, down its chain): the
    delta's own result is hashed, and wrong base bytes cannot give the right result. That
    saves hashing every base once more (a MiniLM fine-tune loaded from a local store: 8% of
    its CPU). Only when the result fails is the base fetched again, verified, so
    that a damaged copy of it is found (a cache entry dropped and fetched again) and the
    error names the chunk that is damaged. ``verify=False`` (a base of a chunk above) leaves
    the hash of this chunk to that caller.

    That second fetch is ``strict``: every base down the chain is verified before the level above
    uses it, so the retry costs one decode and one hash per level, and a failure there is the
    damage of the level that failed. (Trying each level of the retry unverified first cost about
    depth²/2 decodes: 1,681 for a chain of 64 damaged halfway, against 97 now.)

    ``_above``: the chunks whose decoding asked for this one, down from the top. A base among them
    is a loop, and the damage of this level's blob (a cache entry, say, that is fetched again):
    followed, it ended 64 levels down naming a chunk there, and the cached blob that made the loop
    was never fetched again."""
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
    if h.base in _above:
        raise CorruptObjectError("chunk", cid, f"stored as a delta against {h.base}, a chunk above it in its own delta chain")
    above = (*_above, cid)
    if h.base is not None:
        base, below = fetch_base(objects, h.base, length, settings, cid, _depth + 1, got.bases, verify=strict, strict=strict,
                                 _above=above)
        chain = (h.base, *below)
    try:
        # (a chunk the local chunk cache keeps decoded is checked before it is kept)
        data = decode_chunk(got.blob, cid, length, max_length=settings.max_chunk_size, base=base, out=out,
                            verify=verify or keep_decoded)
    except CorruptObjectError:
        if h.base is None or not verify or strict:
            raise  # (an unchecked base: the chunk above finds out and asks again, verified; a checked one: this blob is damaged)
        base, below = fetch_base(objects, h.base, length, settings, cid, _depth + 1, got.bases, strict=True, _above=above)
        chain = (h.base, *below)
        data = decode_chunk(got.blob, cid, length, max_length=settings.max_chunk_size, base=base, out=out)
    if keep_decoded:
        assert objects.cache is not None
        # Replaces the blob as stored where the cache had it (read ahead as a base, or cached before).
        objects.cache.put(cid, (raw_header(h.elem, length), data), replace=True)
    return data, chain


def cache_at_fault(objects: ObjectStore, cid: str, got: ChunkRead, e: CorruptObjectError | ObjectNotFoundError) -> bool:
    """Whether the failure ``e`` of decoding ``got`` (chunk ``cid``) may lie in the local chunk cache's
    entry of ``cid``, which is then worth dropping and fetching again: only where the cache served it,
    and the failure is its own (its bytes or its hash), or a base its header names is missing from the
    store (the entry may be another store's blob of the chunk, a delta against a base of that store's).
    A base damaged further down is not: it was fetched again at its own level, and the sound entries
    above it stay (each was dropped and fetched again, and the top chunk's chain walked once more)."""
    if not got.cached or objects.cache is None:
        return False
    if e.object_id == cid:
        return True
    if not isinstance(e, ObjectNotFoundError) or got.blob is None:
        return False
    try:
        return parse_header(got.blob, cid).base == e.object_id
    except CorruptObjectError:
        return True


def refetch(objects: ObjectStore, cid: str, length: int, settings: Settings, got: ChunkRead,
            e: CorruptObjectError | ObjectNotFoundError, out: memoryview | None, decode: Callable[[ChunkRead], T]) -> T:
    """After decoding ``got`` (chunk ``cid``) failed with ``e``: where the local chunk cache's entry may
    be at fault (:func:`cache_at_fault`), the chunk read again from the store (into ``out``, as
    :func:`read_remote` reads) and ``decode`` d. The entry is dropped and replaced only if the store's
    blob differs; if it is the same, decoding it would fail again (and on a damaged chain each level
    above would retry too: 2**depth decodes of a chain that names itself), so ``e`` is raised: the
    damage, or the missing base, is the store's. Raises ``e`` too where the cache is not at fault."""
    if not cache_at_fault(objects, cid, got, e):
        raise e
    fresh = read_remote(objects, cid, length, settings, out, stale=got)
    if _same(got, fresh.blob):
        raise e
    return decode(fresh)


def check_claim(cid: str, length: int, settings: Settings) -> None:
    """A manifest is outside data: no buffer is sized by a length no chunk can have."""
    if length > settings.max_chunk_size:
        raise CorruptObjectError("chunk", cid, f"the checkpoint says {length} bytes, more than any chunk "
                                 f"({settings.max_chunk_size}, CKPT_MAX_CHUNK_SIZE)")


def fetch_chunk(objects: ObjectStore, cid: str, length: int, settings: Settings, _depth: int = 0,
                out: memoryview | None = None, blobs: Mapping[str, bytes | None] | None = None, verify: bool = True,
                strict: bool = False, _above: tuple[str, ...] = ()) -> tuple[bytes | bytearray | memoryview, tuple[str, ...]]:
    """Decoded, verified bytes of chunk ``cid`` and its delta chain: the ids of every base its
    decoding walked, nearest first (empty: no base).

    With ``out`` (``length`` writable bytes: a slice of a tensor's memory) the bytes
    land there: from a local store a raw chunk is read straight into it (its header
    first) and hashed in place; others are decoded into it. On error its contents are
    unspecified. ``blobs``: chunk blobs already read, used instead of reading them again.
    ``verify=False``: for a delta's base only; ``strict=True``: every base verified before it is used
    (see :func:`decode_read`).
    """
    if _depth > MAX_CHAIN:
        raise CorruptObjectError("chunk", cid, f"delta chain longer than {MAX_CHAIN}")
    check_claim(cid, length, settings)
    if blobs and cid in blobs:
        blob = blobs[cid]
        if blob is None:  # read ahead: the store lacks it
            raise ObjectNotFoundError("chunk", cid)
        got = ChunkRead(blob, bases=blobs)
    else:
        got = read_chunk(objects, cid, length, settings, out)
    try:
        return decode_read(objects, cid, length, settings, got, _depth, out, verify, strict, _above)
    except (CorruptObjectError, ObjectNotFoundError) as e:
        return refetch(objects, cid, length, settings, got, e, out,
                       lambda fresh: decode_read(objects, cid, length, settings, fresh, _depth, out, verify, strict, _above))


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
