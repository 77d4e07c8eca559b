"""Chunk blobs: a small binary header, then the payload in one of the codecs.

Layout (little endian; docs/format.md is the spec)::

    magic  b"CKc1"   4 bytes
    codec  u8        see CODECS
    elem   u8        element size of the tensor the bytes came from: 1, 2, 4 or 8
    flags  u8        bit 0: a 32-byte base chunk id follows (delta codecs)
    pad    u8        0
    length u64       decoded length in bytes
    [base  32 bytes  raw BLAKE3 digest of the base chunk]
    payload

The chunk's id is the BLAKE3 of the *decoded* bytes, so any codec can store any
chunk, and :func:`decode_chunk` always re-hashes what it decoded.

Codecs (pure functions of bytes; the encoder keeps whichever is smallest):

========  ===  ==============================================================
raw        0   the bytes as they are
zstd       1   one zstd frame
planes     2   byte planes: byte k of every element stored as its own stream,
               each zstd-compressed (perhaps bit-transposed, or sorted by the
               plane above it, first) or stored raw
xor        3   planes of (chunk XOR base)
sub        4   planes of zigzag(ordered(chunk) - ordered(base)), see transforms.py
gsub       5   sub with the elements in a stable order by the base's top 10 bits
========  ===  ==============================================================
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import zstandard

from ckpt.codecs.buffers import Parts, compressor, decompressor
from ckpt.codecs.ids import CODEC_NAMES, DELTA_CODECS, GSUB, PLANES, RAW, SUB, XOR, ZSTD
from ckpt.codecs.planes import Plan, planes_decode, planes_encode
from ckpt_store.storage.errors import CorruptObjectError
from ckpt_store.storage.objects import object_id

MAGIC = b"CKc1"
_HEAD = struct.Struct("<4sBBBBQ")
HAS_BASE = 1
MAX_HEADER = _HEAD.size + 32


@dataclass(frozen=True)
class ChunkHeader:
    codec: int
    elem: int
    length: int
    base: str | None
    size: int  # header bytes


@dataclass(frozen=True)
class Encoded:
    # The blob in pieces (header, payload): a raw payload stays a view of the caller's
    # bytes, and the pieces go to Backend.write as they are, so a chunk on its way to
    # the disk is never copied only to be joined.
    parts: Parts
    codec: int
    base: str | None  # id of the base chunk the blob needs, if any

    @property
    def size(self) -> int:
        return _size(self.parts)

    @property
    def blob(self) -> bytes:
        return b"".join(self.parts)


def _pack(codec: int, elem: int, length: int, base: str | None, payload: Parts) -> Parts:
    head = _HEAD.pack(MAGIC, codec, elem, HAS_BASE if base else 0, 0, length)
    return (head + (bytes.fromhex(base) if base else b""), *payload)


def raw_header(elem: int, length: int) -> bytes:
    """The header of a raw blob of ``length`` bytes of ``elem``-byte elements: with the bytes
    after it, the blob of those bytes stored as they are."""
    return bytes(_pack(RAW, elem, length, None, ())[0])


def _size(parts: Parts) -> int:
    return sum(len(p) for p in parts)


def _sample(data: memoryview, elem: int, parts: int = 4, size: int = 16 * 1024) -> memoryview | bytes:
    """A few element-aligned slices spread over the chunk, to pick a codec cheaply.
    (4 x 16 KiB: against 4 x 32 KiB, the codecs encode the MiniLM fp32 family 17% faster
    on two threads (906 / 775 MB/s), bf16 25% and the GPT run 11%, for 0.04% more bytes
    in each; 4 x 8 KiB gained nothing more and cost 0.13%. Each of the sample's zstd
    calls has a fixed cost, and there are a few dozen of them per chunk.)"""
    n = len(data)
    if n <= parts * size * 2:
        return data
    step = (n - size) // (parts - 1) // elem * elem
    return b"".join(data[i * step : i * step + size] for i in range(parts))


def encode_chunk(
    data: bytes | memoryview,
    *,
    elem: int = 1,
    level: int = 1,
    min_saving: float = 0.02,
    base: bytes | memoryview | None = None,
    base_id: str | None = None,
) -> Encoded:
    """Encode ``data`` in the smallest of the codecs that apply.

    With ``base`` (the decoded bytes of chunk ``base_id``, same length), the delta
    codecs are tried as well. The choice is made on a sample of the chunk, then
    the winner encodes the whole chunk; anything that does not save at least
    ``min_saving`` is stored raw.
    """
    view = memoryview(data).cast("B")
    n = len(view)
    if elem not in (1, 2, 4, 8) or n % elem:
        elem = 1
    if min_saving >= 1.0:  # no encoding saves everything: stored raw, without trying any
        return Encoded(_pack(RAW, elem, n, None, (view,)), RAW, None)
    # Each candidate encodes (data, base, plan) -> payload, so the same function scores
    # the sample and then encodes the whole chunk, following the plan the sample taught:
    # a plane found incompressible is stored raw without trying zstd on it (the low
    # mantissa bytes of floats: noise, and most of the work), and a mostly-zero plane
    # that compressed better bit-transposed is transposed without comparing again.
    # (A candidate given a limit may give up, returning None, once it is sure to lose.)
    candidates: list[tuple[int, Callable[..., Parts | None]]] = []
    if n and elem == 1:
        candidates.append((ZSTD, lambda d, b, p, limit=None: (compressor(level, len(d)).compress(d),)))
    elif n:
        candidates.append((PLANES, lambda d, b, p, limit=None: planes_encode(d, elem, level, min_saving, plan=p, limit=limit)))
        if base is not None and base_id is not None and len(base) == n:
            candidates.append((GSUB, lambda d, b, p, limit=None: planes_encode(d, elem, level, base=b, codec=GSUB, plan=p, limit=limit)))
            candidates.append((XOR, lambda d, b, p, limit=None: planes_encode(d, elem, level, base=b, codec=XOR, plan=p, limit=limit)))
    bview = memoryview(base).cast("B") if base is not None else None
    plan = Plan()  # with no sample to learn from, the whole chunk's pass learns
    payload: Parts | None = None
    sample = _sample(view, elem)
    if candidates and (len(candidates) > 1 or len(sample) < n):
        sbase = _sample(bview, elem) if bview is not None else None
        # With a base, only GSUB (the usual winner) tries the bit-plane and sorted forms on
        # the sample; the others are tried raw-or-zstd, and explored only if one wins that
        # way. The same bytes on all three benchmark families, 4-9% faster encoding.
        delta = any(c in DELTA_CODECS for c, _ in candidates)
        plans = [Plan(explore=c == GSUB or not delta) for c, _ in candidates]
        # GSUB (the usual winner) first; the others stop once they are larger than the
        # best so far: the same choice (ties still go to the first candidate), fewer zstd calls.
        tried: list[Parts | None] = [None] * len(candidates)
        for i in sorted(range(len(candidates)), key=lambda i: candidates[i][0] != GSUB):
            done = [t for t in tried if t is not None]
            _, fn = candidates[i]
            tried[i] = fn(sample, sbase, plans[i], limit=min(map(_size, done)) if done else None)
        best = min((i for i, t in enumerate(tried) if t is not None), key=lambda i: _size(tried[i]))
        if not plans[best].explore:
            _, winner = candidates[best]
            plans[best] = Plan()
            tried[best] = winner(sample, sbase, plans[best])
        candidates, plan = [candidates[best]], plans[best]
        plan.learning = False
        if len(sample) == n:  # the "sample" was the whole chunk: its encoding is the answer
            payload = tried[best]
            assert payload is not None
    if candidates:
        codec, fn = candidates[0]
        if payload is None:
            payload = fn(view, bview, plan)
            assert payload is not None  # no limit: never gives up
        if _size(payload) <= n * (1.0 - min_saving):
            b = base_id if codec in DELTA_CODECS else None
            return Encoded(_pack(codec, elem, n, b, payload), codec, b)
    return Encoded(_pack(RAW, elem, n, None, (view,)), RAW, None)


def parse_header(blob: bytes | memoryview, oid: str = "?") -> ChunkHeader:
    """Validate and parse a chunk blob's header. Raises :class:`CorruptObjectError`."""
    if len(blob) < _HEAD.size:
        raise CorruptObjectError("chunk", oid, f"blob of {len(blob)} bytes is shorter than a chunk header")
    magic, codec, elem, flags, pad, length = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptObjectError("chunk", oid, "bad magic (not a ckpt chunk)")
    if codec not in CODEC_NAMES:
        raise CorruptObjectError("chunk", oid, f"unknown codec {codec}")
    # Every header field is checked, so that no bit of a blob can flip unnoticed.
    if elem not in (1, 2, 4, 8) or flags & ~HAS_BASE or pad or bool(flags & HAS_BASE) != (codec in DELTA_CODECS):
        raise CorruptObjectError("chunk", oid, "invalid header fields")
    size = _HEAD.size
    base = None
    if flags & HAS_BASE:
        if len(blob) < size + 32:
            raise CorruptObjectError("chunk", oid, "truncated base id")
        base = bytes(blob[size : size + 32]).hex()
        size += 32
    return ChunkHeader(codec, elem, length, base, size)


def decode_chunk(
    blob: bytes | memoryview,
    oid: str,
    expected_length: int,
    *,
    max_length: int,
    base: bytes | memoryview | None = None,
    out: memoryview | None = None,
    verify: bool = True,
) -> bytes | bytearray | memoryview:
    """Decode a chunk blob, check its length and hash against ``oid``; return the bytes.

    Delta blobs need ``base``: the decoded bytes of the chunk named in the header
    (the caller fetches it; see ``fetch.fetch_chunk``). Never returns bytes that
    do not hash to ``oid``: any mismatch raises :class:`CorruptObjectError`. The
    decoded size is checked against ``expected_length`` (from the manifest) before
    anything is allocated, so a blob cannot make the reader allocate more.
    ``verify=False`` leaves the hash out: only for a delta's base, whose delta's result the
    caller hashes (``fetch.decode_read``).

    With ``out`` (a writable buffer of ``expected_length`` bytes, a tensor's memory
    say) the bytes are decoded straight into it and ``out`` is returned; after an
    error its contents are unspecified.
    """
    h = parse_header(blob, oid)
    if h.length != expected_length:
        raise CorruptObjectError("chunk", oid, f"header says {h.length} bytes, manifest says {expected_length}")
    if h.length > max_length:
        raise CorruptObjectError("chunk", oid, f"claims {h.length} decoded bytes, over the {max_length} limit")
    if h.length % h.elem:
        raise CorruptObjectError("chunk", oid, "length is not a whole number of elements")
    if out is not None and len(out) != h.length:
        raise ValueError(f"decode_chunk: out has {len(out)} bytes, the chunk {h.length}")
    payload = memoryview(blob)[h.size :]
    data: bytes | bytearray | memoryview
    if h.codec == RAW:
        data = payload  # a view: no copy of the chunk on the read path
        if len(data) != h.length:
            raise CorruptObjectError("chunk", oid, f"raw payload is {len(data)} bytes, expected {h.length}")
    elif h.codec == ZSTD:
        try:
            if zstandard.frame_content_size(payload) != h.length:
                raise CorruptObjectError("chunk", oid, "zstd frame size disagrees with the header")
            data = decompressor().decompress(payload, max_output_size=h.length)
        except zstandard.ZstdError as e:
            raise CorruptObjectError("chunk", oid, f"zstd: {e}") from None
        if len(data) != h.length:
            raise CorruptObjectError("chunk", oid, "decoded length differs from the header")
    else:
        if h.codec in DELTA_CODECS and (base is None or len(base) != h.length):
            raise CorruptObjectError("chunk", oid, f"delta against {h.base} needs its base ({h.length} bytes)")
        data = planes_decode(payload, h.length, h.elem, oid, h.codec, base, out)
    if out is not None and data is not out:
        out[:] = data
        data = out
    if verify and object_id(data) != oid:
        raise CorruptObjectError("chunk", oid, "decoded bytes do not match the chunk id")
    return data


# The codec ids are the header's: importers keep taking them from here.
__all__ = ["CODEC_NAMES", "DELTA_CODECS", "GSUB", "HAS_BASE", "MAGIC", "MAX_HEADER", "PLANES", "RAW", "SUB", "XOR", "ZSTD",
           "ChunkHeader", "Encoded", "decode_chunk", "encode_chunk", "parse_header", "raw_header"]
