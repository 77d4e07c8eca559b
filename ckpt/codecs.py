"""Chunk blobs: a small binary header, then the payload in one of the codecs.

Layout (little endian; docs/format.md is the spec)::

    magic  b"CKc1"   4 bytes
    codec  u8        0 raw, 1 zstd (later: byte planes, deltas)
    elem   u8        element size of the tensor the bytes came from (1 if unknown)
    flags  u8        bit 0: a 32-byte base chunk id follows (delta codecs)
    pad    u8        0
    length u64       decoded length in bytes
    [base  32 bytes  raw BLAKE3 digest of the base chunk]
    payload

The chunk's id is the BLAKE3 of the *decoded* bytes, so any codec can store any
chunk and readers always re-hash after decoding.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import zstandard

from storage.errors import CorruptObjectError
from storage.objects import object_id

MAGIC = b"CKc1"
_HEAD = struct.Struct("<4sBBBBQ")
HAS_BASE = 1

RAW = 0
ZSTD = 1
CODEC_NAMES = {RAW: "raw", ZSTD: "zstd"}

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstandard compressors must not be shared between threads: one per thread and level.
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


@dataclass(frozen=True)
class ChunkHeader:
    codec: int
    elem: int
    length: int
    base: str | None
    size: int  # header bytes


def encode_chunk(data: bytes | memoryview, *, level: int = 3, min_saving: float = 0.02, elem: int = 1) -> bytes:
    """Encode ``data`` as a chunk blob: zstd if it saves at least ``min_saving``, else raw."""
    n = len(data)
    comp = _compressor(level).compress(data) if n else b""
    if n and len(comp) <= n * (1.0 - min_saving):
        return _HEAD.pack(MAGIC, ZSTD, elem, 0, 0, n) + comp
    return _HEAD.pack(MAGIC, RAW, elem, 0, 0, n) + bytes(data)


def parse_header(blob: bytes | memoryview, oid: str = "?") -> ChunkHeader:
    """Validate and parse a chunk blob's header. Raises :class:`CorruptObjectError`."""
    if len(blob) < _HEAD.size:
        raise CorruptObjectError("chunk", oid, f"blob of {len(blob)} bytes is shorter than a chunk header")
    magic, codec, elem, flags, _pad, length = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptObjectError("chunk", oid, "bad magic (not a ckpt chunk)")
    if codec not in CODEC_NAMES:
        raise CorruptObjectError("chunk", oid, f"unknown codec {codec}")
    # Every header field is checked, so that no bit of a blob can flip unnoticed.
    if elem not in (1, 2, 4, 8) or flags & ~HAS_BASE or _pad:
        raise CorruptObjectError("chunk", oid, "invalid header fields")
    size = _HEAD.size
    base = None
    if flags & HAS_BASE:
        if len(blob) < size + 32:
            raise CorruptObjectError("chunk", oid, "truncated base id")
        base = bytes(blob[size : size + 32]).hex()
        size += 32
    return ChunkHeader(codec, elem, length, base, size)


def decode_chunk(blob: bytes | memoryview, oid: str, expected_length: int, *, max_length: int) -> bytes:
    """Decode a chunk blob, check its length and hash against ``oid``; return the bytes.

    Never returns bytes that do not hash to ``oid``: any mismatch raises
    :class:`CorruptObjectError`. The decoded size is checked against
    ``expected_length`` (from the manifest) before anything is allocated.
    """
    h = parse_header(blob, oid)
    if h.length != expected_length:
        raise CorruptObjectError("chunk", oid, f"header says {h.length} bytes, manifest says {expected_length}")
    if h.length > max_length:
        raise CorruptObjectError("chunk", oid, f"claims {h.length} decoded bytes, over the {max_length} limit")
    payload = memoryview(blob)[h.size :]
    if h.codec == RAW:
        data = bytes(payload)
        if len(data) != h.length:
            raise CorruptObjectError("chunk", oid, f"raw payload is {len(data)} bytes, expected {h.length}")
    else:
        try:
            if zstandard.frame_content_size(payload) != h.length:
                raise CorruptObjectError("chunk", oid, "zstd frame size disagrees with the header")
            data = _decompressor().decompress(payload, max_output_size=h.length)
        except zstandard.ZstdError as e:
            raise CorruptObjectError("chunk", oid, f"zstd: {e}") from None
        if len(data) != h.length:
            raise CorruptObjectError("chunk", oid, "decoded length differs from the header")
    if object_id(data) != oid:
        raise CorruptObjectError("chunk", oid, "decoded bytes do not match the chunk id")
    return data
