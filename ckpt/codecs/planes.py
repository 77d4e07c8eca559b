"""The planes codecs (planes, xor, sub, gsub; ckpt/codecs/chunk.py chooses between them): a chunk's
elements cut into byte planes, byte k of every element as its own stream, of the chunk itself or of
its delta against a base (see transforms.py), each plane zstd-compressed (perhaps bit-transposed, or
sorted by the plane above it, first) or stored raw. :func:`planes_encode` writes a planes payload,
:func:`planes_decode` reads one; the fused C kernels (_native.c) do the work where they are built."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from ckpt.codecs import transforms
from ckpt.codecs.buffers import Parts, compressor, decompressor, thread_buffer
from ckpt.codecs.ids import DELTA_CODECS, GSUB, PLANES, SUB, XOR
from ckpt_store.storage.errors import CorruptObjectError

try:  # the fused C kernels (ckpt/codecs/_native.c); numpy does the same work where they are not built
    from ckpt.codecs import _native as native
except ImportError:  # pragma: no cover - exercised by builds without a C compiler
    native = None
if os.environ.get("CKPT_NATIVE") == "0":
    native = None


_PLANE = struct.Struct("<BI")  # per plane: mode, stored length
PLANE_RAW, PLANE_ZSTD, PLANE_BITS = 0, 1, 2  # modes: as it is; zstd; bit planes (see _bits), then zstd
PLANE_SORTED = 0x10  # mode flag: the plane is in the order of the plane above it (see _ctx), then as the mode says
# Plane count flag: the slot counts of the chunk's permutations follow the plane table
# (u32 length, one zstd frame of uint32 byte planes): GSUB's 2 x 1024 (see native.encode),
# then 2 x 256 per sorted plane, lowest plane first (see _ctx). The decoder then skips a
# counting pass over the base and over each key plane (a pass costs 0.4-0.5 ms per
# million elements, a tenth of a 4 MiB fp32 chunk's decode per permutation), for about
# 1.3 KB of counts a chunk; so only planes of COUNTS_MIN elements or more store them.
COUNTED = 0x80
COUNTS_MIN = 1 << 18
_COUNTS_SIZE = struct.Struct("<I")
# A plane is tried bit-transposed when zstd leaves it between these fractions of its size:
# mostly-zero planes with a few live low bits (the high bytes of small deltas). Planes that
# zstd already all but removes, or that are noise, gain nothing from it.
_BITS_TRY = (0.005, 0.6)


# Kernel op per planes codec: plain planes, planes of the XOR delta, planes of the SUB delta.
_OP = {PLANES: 0, XOR: 1, SUB: 2, GSUB: 3}
_APPLY = {XOR: transforms.apply_xor, SUB: transforms.apply_sub, GSUB: transforms.apply_gsub}
_UNDO = {XOR: transforms.undo_xor, SUB: transforms.undo_sub, GSUB: transforms.undo_gsub}


def _bits(data: Any, out: Any, inverse: bool = False) -> Any:
    """``out`` <- the 8 bit planes of the bytes of ``data``, bit 7 first, each packed MSB-first,
    then the ``len % 8`` tail bytes as they are (``inverse``: undo it). Same length."""
    if native is not None:
        native.bits(data, out, inverse)
        return out
    a = np.frombuffer(data, dtype=np.uint8)
    m = len(a) // 8
    if inverse:
        body = np.packbits(np.unpackbits(a[: 8 * m].reshape(8, m), axis=1).T, axis=1)
    else:
        body = np.packbits(np.unpackbits(a[: 8 * m]).reshape(8 * m, 8).T, axis=1)
    dst = np.frombuffer(out, dtype=np.uint8)
    dst[: 8 * m] = body.reshape(-1)
    dst[8 * m :] = a[8 * m :]
    return out


def _ctx_half(n: int) -> int:
    """Where the sort's slot counts split a plane of ``n`` bytes (the C kernels walk the two halves in step)."""
    return (n // 2) & ~7


def _ctx_counts(key: Any) -> np.ndarray:
    return transforms.half_counts(np.frombuffer(key, dtype=np.uint8), _ctx_half(len(key)), 256)


def _ctx(data: Any, key: Any, out: Any, inverse: bool = False, counts: np.ndarray | None = None) -> Any:
    """``out`` <- the bytes of ``data`` in a stable order by the values of ``key`` (the plane
    above; ``inverse``: put them back where they were). Same lengths.

    ``counts`` (uint32, 2 x 256): sorting writes the sort's slot counts there; undoing
    trusts them instead of counting ``key``, and ``data`` must then have ``2n + 8`` bytes
    (the plane first), so that wrong counts cannot read outside it. Returns ``out``, or
    None where given counts were not ``key``'s."""
    n = len(key)
    if native is not None:
        return out if native.ctx(data, key, out, inverse, counts) else None
    if inverse and counts is not None:
        if not np.array_equal(counts, _ctx_counts(key)):
            return None
        data = memoryview(data)[:n]
    elif counts is not None:
        counts[:] = _ctx_counts(key)
    order = np.argsort(np.frombuffer(key, dtype=np.uint8), kind="stable")
    src, dst = np.frombuffer(data, dtype=np.uint8), np.frombuffer(out, dtype=np.uint8)
    if inverse:
        dst[order] = src
    else:
        dst[:] = src[order]
    return out


@dataclass
class Plan:
    """What encoding a sample of a chunk taught about its planes, for the whole chunk."""

    raw: set[int] = field(default_factory=set)  # stored raw without trying zstd (incompressible)
    bits: set[int] = field(default_factory=set)  # bit-transposed before zstd
    sorted: set[int] = field(default_factory=set)  # in the order of the plane above, first
    learning: bool = True  # the sample's pass: try the alternatives and record the winners
    explore: bool = True  # while learning: also try the bit-plane and sorted alternatives (else raw-or-zstd only)


def _split(data: Any, base: Any, elem: int, codec: int, counts: np.ndarray | None = None) -> memoryview:
    """Plane-major bytes of ``codec``'s transform of ``data`` (against ``base``): byte k of element i at k*n + i.
    ``counts``: GSUB's slot counts go there (uint32, 2 x 1024)."""
    if native is not None:
        view = memoryview(data).cast("B")
        out = thread_buffer(len(view))
        scratch = thread_buffer(len(view), "gsub") if codec == GSUB else None
        native.encode(view, base, out, elem, _OP[codec], scratch, counts)
        return out
    if counts is not None:
        counts[:] = transforms.group_counts(base, elem)
    if codec in _APPLY:
        apply = _APPLY[codec]
        data = apply(data, base, elem)
    arr = np.frombuffer(data, dtype=np.uint8).reshape(-1, elem)
    return np.ascontiguousarray(arr.T).data.cast("B")  # one transposing pass; row k is plane k


def _counts_pack(counts: list[np.ndarray], level: int) -> bytes:
    """The slot counts, byte planes of the uint32 (their high bytes are mostly zero), in one zstd frame."""
    arr = np.concatenate(counts).astype("<u4")
    return compressor(level).compress(np.ascontiguousarray(arr.view(np.uint8).reshape(-1, 4).T).tobytes())


def _counts_unpack(frame: Any, entries: int, oid: str) -> np.ndarray:
    try:
        if zstandard.frame_content_size(frame) != 4 * entries:
            raise CorruptObjectError("chunk", oid, "planes: slot counts of the wrong size")
        raw = decompressor().decompress(frame, max_output_size=4 * entries)
    except zstandard.ZstdError as e:
        raise CorruptObjectError("chunk", oid, f"planes: slot counts: zstd: {e}") from None
    if len(raw) != 4 * entries:
        raise CorruptObjectError("chunk", oid, "planes: slot counts of the wrong size")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(4, entries)
    return np.ascontiguousarray(planes.T).view("<u4").reshape(-1).astype(np.uint32, copy=False)


def planes_encode(data: Any, elem: int, level: int, min_saving: float = 0.02, base: Any = None, codec: int = PLANES,
                  plan: Plan | None = None, limit: int | None = None) -> Parts | None:
    """Byte planes of ``data`` (or of its delta against ``base``), each zstd'd (perhaps
    bit-transposed first) or stored raw.

    Layout: u8 plane count (| COUNTED), then per plane (u8 mode, u32 length), then for
    COUNTED the slot counts (u32 length, one zstd frame), then the planes.
    The kernels and zstandard release the GIL, so chunks encode in parallel.
    ``plan``: while learning (on a sample), planes that do not compress are marked raw,
    mostly-zero planes are tried bit-transposed, and every plane but the last is tried
    in the order of the plane above it; afterwards (the whole chunk) the plan is
    followed without trying the alternatives again.
    Planes of COUNTS_MIN elements or more store the slot counts of their permutations
    (GSUB's, and each sorted plane's), so that the decoder skips a counting pass per
    permutation (see COUNTED).
    Returns the payload in pieces (table, planes), not joined: zstd's output is
    written as it is, and only raw planes are copied out of the reused split buffer;
    None as soon as it is sure to be larger than ``limit`` bytes.
    """
    n = len(memoryview(data).cast("B")) // elem
    counted = n >= COUNTS_MIN
    group_counts = np.empty(2 << transforms.KEY_BITS, dtype=np.uint32) if counted and codec == GSUB else None
    planes = _split(data, base, elem, codec, group_counts)
    cctx = compressor(level, n)
    sort_counts: dict[int, np.ndarray] = {}

    def pack(plane: Any, bits: bool) -> bytes:
        return cctx.compress(_bits(plane, thread_buffer(n, "bits")) if bits else plane)

    def sort(k: int, plane: Any, above: Any) -> Any:
        counts = sort_counts.setdefault(k, np.empty(512, dtype=np.uint32)) if counted else None
        return _ctx(plane, above, thread_buffer(n, "sorted"), counts=counts)

    heads, bodies, ordered_planes = [], [], []
    spent = 1 + elem * _PLANE.size
    for k in range(elem):
        plane = planes[k * n : (k + 1) * n]
        above = planes[(k + 1) * n : (k + 2) * n] if k + 1 < elem else None
        raw = plan is not None and k in plan.raw
        bits = plan is not None and k in plan.bits
        ordered = plan is not None and k in plan.sorted and above is not None
        src = sort(k, plane, above) if ordered else plane
        packed: bytes | memoryview = plane if raw else pack(src, bits)
        if plan is not None and plan.learning and not raw:
            if len(packed) > n * (1.0 - min_saving / 2):
                plan.raw.add(k)
            else:
                if plan.explore and _BITS_TRY[0] * n < len(packed) < _BITS_TRY[1] * n:
                    transposed = pack(src, True)
                    if len(transposed) < len(packed) * 0.98:
                        plan.bits.add(k)
                        packed, bits = transposed, True
                if plan.explore and above is not None:
                    # worth a reorder (and its cost on every read) only if it saves 2%
                    alt = pack(sort(k, plane, above), bits)
                    if len(alt) < len(packed) * 0.98:
                        plan.sorted.add(k)
                        packed, ordered = alt, True
        if packed is plane or len(packed) > n * (1.0 - min_saving):
            packed, mode = plane, PLANE_RAW
        else:
            mode = (PLANE_BITS if bits else PLANE_ZSTD) | (PLANE_SORTED if ordered else 0)
            if ordered:
                ordered_planes.append(k)
        heads.append(_PLANE.pack(mode, len(packed)))
        bodies.append(bytes(packed) if mode == PLANE_RAW else packed)
        spent += len(packed)
        if limit is not None and spent > limit:
            return None
    stored = ([group_counts] if group_counts is not None else []) + \
        ([sort_counts[k] for k in ordered_planes] if counted else [])
    if not stored:
        return (bytes([elem]) + b"".join(heads), *bodies)
    frame = _counts_pack(stored, level)
    return (bytes([elem | COUNTED]) + b"".join(heads) + _COUNTS_SIZE.pack(len(frame)), frame, *bodies)


def _unzstd_plane(frame: Any, n: int, k: int, oid: str, into: memoryview | None = None) -> Any:
    """Plane ``k``'s ``n`` bytes out of its zstd frame: into ``into[:n]`` (then ``into``
    is returned, whole), else as new bytes."""
    try:
        if zstandard.frame_content_size(frame) != n:
            raise CorruptObjectError("chunk", oid, f"planes: plane {k} has the wrong size")
        if into is None:
            body = decompressor().decompress(frame, max_output_size=n)
            got = len(body)
        else:
            body, got = into, decompressor().stream_reader(frame).readinto(into[:n])
    except zstandard.ZstdError as e:
        raise CorruptObjectError("chunk", oid, f"planes: zstd: {e}") from None
    if got != n:
        raise CorruptObjectError("chunk", oid, f"planes: plane {k} has the wrong size")
    return body


def planes_decode(payload: memoryview, length: int, elem: int, oid: str, codec: int = PLANES,
                  base: Any = None, out: memoryview | None = None) -> memoryview:
    """Decode a planes payload (undoing the delta of ``codec`` against ``base``), into ``out`` if given."""
    if len(payload) < 1 + elem * _PLANE.size or payload[0] & ~COUNTED != elem:
        raise CorruptObjectError("chunk", oid, "planes: bad plane table")
    n = length // elem
    bodies: list[Any] = []
    pos = 1 + elem * _PLANE.size
    frame = None
    if payload[0] & COUNTED:
        if len(payload) < pos + _COUNTS_SIZE.size:
            raise CorruptObjectError("chunk", oid, "planes: truncated slot counts")
        (size,) = _COUNTS_SIZE.unpack_from(payload, pos)
        frame = payload[pos + _COUNTS_SIZE.size : pos + _COUNTS_SIZE.size + size]
        pos += _COUNTS_SIZE.size + size
    for k in range(elem):
        mode, size = _PLANE.unpack_from(payload, 1 + k * _PLANE.size)
        body = payload[pos : pos + size]
        pos += size
        if len(body) != size or mode & ~PLANE_SORTED not in (PLANE_RAW, PLANE_ZSTD, PLANE_BITS) \
                or (mode & PLANE_SORTED and (k == elem - 1 or mode == PLANE_SORTED)):
            raise CorruptObjectError("chunk", oid, f"planes: plane {k} is damaged")
        bodies.append((mode, body))
    if pos != len(payload):
        raise CorruptObjectError("chunk", oid, "planes: trailing bytes")
    group_counts = None
    sort_counts: dict[int, np.ndarray] = {}
    if frame is not None:
        groups = 2 << transforms.KEY_BITS if codec == GSUB else 0
        ordered = [k for k, (mode, _) in enumerate(bodies) if mode & PLANE_SORTED]
        if not groups and not ordered:
            raise CorruptObjectError("chunk", oid, "planes: slot counts with nothing to count")
        counts = _counts_unpack(frame, groups + 512 * len(ordered), oid)
        group_counts = counts[:groups] if groups else None
        sort_counts = {k: counts[groups + 512 * i : groups + 512 * (i + 1)] for i, k in enumerate(ordered)}
    planes: list[Any] = [None] * elem
    for k in reversed(range(elem)):  # top down: a sorted plane needs the plane above it
        mode, body = bodies[k]
        form = mode & ~PLANE_SORTED
        counts = sort_counts.get(k)
        # With stored counts, a sorted plane's bytes sit in a buffer of 2n + 8 (see _ctx).
        # Otherwise a buffer per plane and step: every plane stays live until they are joined.
        padded = thread_buffer(2 * n + 8, f"plane{k}") if counts is not None else None
        if form == PLANE_ZSTD:
            body = _unzstd_plane(body, n, k, oid, into=padded)
        elif form == PLANE_BITS:
            into = padded if padded is not None else thread_buffer(n, f"unbits{k}")
            _bits(_unzstd_plane(body, n, k, oid), into[:n], inverse=True)
            body = into
        elif len(body) != n:
            raise CorruptObjectError("chunk", oid, f"planes: plane {k} has the wrong size")
        if mode & PLANE_SORTED:
            body = _ctx(body, planes[k + 1], thread_buffer(n, f"unsorted{k}"), inverse=True, counts=counts)
            if body is None:
                raise CorruptObjectError("chunk", oid, f"planes: plane {k}'s slot counts are wrong")
        planes[k] = body  # a raw plane stays a view into the payload: no copy
    if out is None:  # every byte is written below: no zeroing (bytearray's cost 0.2 ms per 4 MiB)
        out = memoryview(np.empty(length, dtype=np.uint8))
    if native is not None:
        scratch = thread_buffer(length * (1 if group_counts is None else 2), "gsub") if codec == GSUB else None
        if not native.decode(planes, base, out, elem, _OP[codec], scratch, group_counts):
            raise CorruptObjectError("chunk", oid, "planes: the slot counts are not the base's")
        return out
    if group_counts is not None and not np.array_equal(group_counts, transforms.group_counts(base, elem)):
        raise CorruptObjectError("chunk", oid, "planes: the slot counts are not the base's")
    arr = np.frombuffer(out, dtype=np.uint8).reshape(-1, elem)
    for k, body in enumerate(planes):
        arr[:, k] = np.frombuffer(body, dtype=np.uint8)
    if codec in DELTA_CODECS:
        undo = _UNDO[codec]
        out[:] = undo(out, base, elem).data.cast("B")
    return out
