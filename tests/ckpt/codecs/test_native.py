"""The fused C kernels agree bit for bit with the numpy reference, and blobs cross between them.

ckpt/codecs/_native.c is optional (built where a C compiler is present); these tests skip
without it, and the rest of the suite runs on whichever kernels are present (CI runs
with them built; `CKPT_NATIVE=0` forces numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.codecs import planes as codecs
from ckpt.codecs import transforms
from ckpt.codecs.chunk import GSUB, PLANES, SUB, XOR, decode_chunk, encode_chunk
from ckpt_store.storage.objects import object_id

native = pytest.importorskip("ckpt.codecs._native")
OPS = {PLANES: 0, XOR: 1, SUB: 2, GSUB: 3}

# Bit patterns that break naive float arithmetic: ±0, ±inf, NaN payloads, subnormals, extremes.
SPECIAL = {
    2: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFFFF, 0x0001, 0x8001, 0x7BFF, 0x3F80, 0x7F81],
    4: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 1, 0x80000001, 0x7F7FFFFF, 0x00800000],
    8: [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000001, (1 << 64) - 1, 1, (1 << 63) + 1],
}


@st.composite
def pair(draw):
    elem = draw(st.sampled_from([2, 4, 8]))
    n = draw(st.integers(0, 600))
    word = st.one_of(st.sampled_from(SPECIAL[elem]), st.integers(0, (1 << (8 * elem)) - 1))
    new = draw(st.lists(word, min_size=n, max_size=n))
    # bases: unrelated words, or the same words nudged by a few ulps (the case deltas are for)
    near = draw(st.booleans())
    base = [(w + draw(st.integers(-3, 3))) % (1 << (8 * elem)) for w in new] if near else draw(st.lists(word, min_size=n, max_size=n))
    dt = np.dtype(f"<u{elem}")
    return elem, np.array(new, dtype=dt).tobytes(), np.array(base, dtype=dt).tobytes()


def _reference_planes(data: bytes, base: bytes, elem: int, codec: int) -> bytes:
    if codec == SUB:
        data = transforms.apply_sub(data, base, elem).tobytes()
    elif codec == GSUB:
        data = transforms.apply_gsub(data, base, elem).tobytes()
    elif codec == XOR:
        data = transforms.apply_xor(data, base, elem).tobytes()
    return np.ascontiguousarray(np.frombuffer(data, np.uint8).reshape(-1, elem).T).tobytes()


@given(pair(), st.sampled_from([PLANES, XOR, SUB, GSUB]))
@settings(max_examples=400, deadline=None)
def test_kernels_match_numpy(case, codec):
    elem, new, base = case
    n = len(new) // elem
    planes = bytearray(len(new))
    scratch = bytearray(len(new)) if codec == GSUB else None
    native.encode(new, base, planes, elem, OPS[codec], scratch)
    assert bytes(planes) == _reference_planes(new, base, elem, codec)
    out = bytearray(len(new))
    split = [bytes(planes[k * n : (k + 1) * n]) for k in range(elem)]
    assert native.decode(split, base, out, elem, OPS[codec], scratch) is True
    assert bytes(out) == new
    if codec == GSUB:  # the slot counts out of encode, and decode trusting them
        counts = np.empty(2048, np.uint32)
        native.encode(new, base, bytearray(len(new)), elem, OPS[codec], scratch, counts)
        assert np.array_equal(counts, transforms.group_counts(base, elem))
        twice = bytearray(2 * len(new))
        out = bytearray(len(new))
        assert native.decode(split, base, out, elem, OPS[codec], twice, counts) is True
        assert bytes(out) == new
        if n >= 2:  # a count moved to another key: found after the gather
            key = int(np.argmax(counts[:1024]))
            counts[key] -= 1
            counts[(key + 1) % 1024] += 1
            assert native.decode(split, base, out, elem, OPS[codec], twice, counts) is False


@given(pair())
@settings(max_examples=150, deadline=None)
def test_blobs_cross_between_kernels(case):
    elem, new, base = case
    bid = object_id(base)
    with_native = encode_chunk(new, elem=elem, base=base, base_id=bid)
    saved = codecs.native
    try:
        codecs.native = None
        without = encode_chunk(new, elem=elem, base=base, base_id=bid)
        assert without.blob == with_native.blob  # same format, same bytes
        assert bytes(decode_chunk(with_native.blob, object_id(new), len(new), max_length=1 << 24, base=base)) == new
    finally:
        codecs.native = saved
    out = memoryview(bytearray(len(new)))
    assert decode_chunk(without.blob, object_id(new), len(new), max_length=1 << 24, base=base, out=out) is out
    assert bytes(out) == new


def _reference_bits(data: bytes) -> bytes:
    a = np.frombuffer(data, np.uint8)
    m = len(a) // 8
    rows = np.packbits(np.unpackbits(a[: 8 * m]).reshape(8 * m, 8).T, axis=1)  # row j: bit 7-j
    return rows.tobytes() + a[8 * m :].tobytes()


@pytest.mark.parametrize("n", [63, 64, 65, 127, 128, 129, (1 << 20) + 77])
def test_bit_planes_of_long_planes(n):
    # past 8 columns the kernels take eight at a time; the tail goes column by column
    rng = np.random.default_rng(n)
    data = (rng.integers(0, 4, n) | (rng.integers(0, 256, n) * (rng.random(n) < 0.1))).astype(np.uint8).tobytes()
    out = bytearray(n)
    native.bits(data, out, False)
    assert bytes(out) == _reference_bits(data)
    back = bytearray(n)
    native.bits(bytes(out), back, True)
    assert bytes(back) == data


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_bit_planes_match_numpy(data):
    out = bytearray(len(data))
    native.bits(data, out, False)
    assert bytes(out) == _reference_bits(data)
    back = bytearray(len(data))
    native.bits(bytes(out), back, True)
    assert bytes(back) == data
    saved = codecs.native  # the fallback of codecs._bits: the same bytes both ways
    try:
        codecs.native = None
        assert bytes(codecs._bits(data, bytearray(len(data)))) == bytes(out)
        assert bytes(codecs._bits(bytes(out), bytearray(len(data)), inverse=True)) == data
    finally:
        codecs.native = saved


@given(st.binary(max_size=300), st.integers(1, 256), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_plane_sort_matches_numpy(data, values, rnd):
    key = bytes(rnd.randrange(values) for _ in data)  # few key values: long runs of one slot counter
    out = bytearray(len(data))
    native.ctx(data, key, out, False)
    order = np.argsort(np.frombuffer(key, np.uint8), kind="stable")
    assert bytes(out) == np.frombuffer(data, np.uint8)[order].tobytes()
    back = bytearray(len(data))
    assert native.ctx(bytes(out), key, back, True) is True
    assert bytes(back) == data
    # the sort's slot counts, and the unsort trusting them (its source then 2n + 8 bytes)
    counts = np.empty(512, np.uint32)
    native.ctx(data, key, bytearray(len(data)), False, counts)
    assert np.array_equal(counts, codecs._ctx_counts(key))
    padded = bytes(out) + bytes(len(data) + 8)
    back = bytearray(len(data))
    assert native.ctx(padded, key, back, True, counts) is True
    assert bytes(back) == data
    with pytest.raises(ValueError, match="2n"):
        native.ctx(bytes(out), key, back, True, counts)
    if len(data) >= 2:
        v = int(np.argmax(counts[:256])) if counts[:256].any() else 256 + int(np.argmax(counts[256:]))
        lo = v - v % 256
        counts[v] -= 1
        counts[lo + (v + 1) % 256] += 1
        assert native.ctx(padded, key, back, True, counts) is False
        saved = codecs.native
        try:
            codecs.native = None
            assert codecs._ctx(padded, key, bytearray(len(data)), True, counts) is None
        finally:
            codecs.native = saved
    saved = codecs.native
    try:
        codecs.native = None
        assert bytes(codecs._ctx(data, key, bytearray(len(data)))) == bytes(out)
        assert bytes(codecs._ctx(bytes(out), key, bytearray(len(data)), inverse=True)) == data
    finally:
        codecs.native = saved


def test_bad_arguments_are_errors_not_crashes():
    with pytest.raises(ValueError, match="same length"):
        native.ctx(b"\0" * 8, b"\0" * 7, bytearray(8), False)
    key = bytearray(8)
    with pytest.raises(ValueError, match="overlapping"):
        native.ctx(b"\0" * 8, key, key, False)
    buf = bytearray(16)
    with pytest.raises(ValueError, match="overlap"):
        native.bits(memoryview(buf)[:8], memoryview(buf)[4:12], False)
    with pytest.raises(ValueError, match="same length"):
        native.bits(b"\0" * 8, bytearray(9), True)
    with pytest.raises(ValueError):
        native.encode(b"\0" * 8, None, bytearray(8), 3, 0)
    with pytest.raises(ValueError):
        native.encode(b"\0" * 8, b"\0" * 4, bytearray(8), 4, 2)  # base of another length
    with pytest.raises(ValueError):
        native.encode(b"\0" * 6, None, bytearray(6), 4, 0)  # not whole elements
    with pytest.raises(ValueError):
        native.decode([b"\0" * 2] * 3, None, bytearray(8), 4, 0)  # too few planes
    with pytest.raises(ValueError):
        native.decode([b"\0" * 2] * 4, None, bytearray(12), 4, 0)  # planes of the wrong size
    with pytest.raises(BufferError):
        native.encode(b"\0" * 8, None, b"\0" * 8, 4, 0)  # read-only destination
    with pytest.raises(ValueError):
        native.encode(b"\0" * 8, None, bytearray(8), 4, 7)
    with pytest.raises(ValueError, match="scratch"):
        native.encode(b"\0" * 8, b"\0" * 8, bytearray(8), 4, 3)  # gsub without its working array
    with pytest.raises(ValueError, match="scratch"):
        native.decode([b"\0" * 2] * 4, b"\0" * 8, bytearray(8), 4, 3, bytearray(4))  # one too small
