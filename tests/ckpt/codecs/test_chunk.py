"""Every codec is bit-exact for every byte pattern, and every damaged blob is detected."""

from __future__ import annotations

import mmap
import os
import struct
import sys

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.codecs import planes as codecs
from ckpt.codecs import transforms
from ckpt.codecs.chunk import GSUB, PLANES, RAW, SUB, XOR, ZSTD, decode_chunk, encode_chunk, parse_header
from ckpt_store.storage.errors import CorruptObjectError
from ckpt_store.storage.objects import object_id

try:
    from ckpt.codecs import _native as NATIVE
except ImportError:  # pragma: no cover - builds without a C compiler
    NATIVE = None

ELEMS = st.sampled_from([1, 2, 4, 8])


def _roundtrip(data: bytes, **kw) -> int:
    enc = encode_chunk(data, **kw)
    assert bytes(decode_chunk(enc.blob, object_id(data), len(data), max_length=1 << 24, base=kw.get("base"))) == data
    return enc.codec


@st.composite
def aligned(draw, elem=None, max_elems=3000):
    e = draw(ELEMS) if elem is None else elem
    n = draw(st.integers(0, max_elems)) * e
    return e, draw(st.binary(min_size=n, max_size=n))


@given(aligned(), st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_roundtrip_any_bytes(case, level):
    elem, data = case
    _roundtrip(data, elem=elem, level=level)


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_delta_roundtrip_any_bytes(draw):
    elem, new = draw.draw(aligned(elem=draw.draw(st.sampled_from([2, 4, 8]))))
    base = draw.draw(st.one_of(
        st.binary(min_size=len(new), max_size=len(new)),
        st.just(bytes(b ^ 1 for b in new)),  # nearly equal: the delta codecs win
    ))
    _roundtrip(new, elem=elem, base=base, base_id="b" * 64)


SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 6e4, -6e4, 1.0, -1.0], dtype=np.float32)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_special_values_and_nan_payloads(dtype):
    rng = np.random.default_rng(0)
    base = np.concatenate([SPECIAL.astype(dtype), rng.standard_normal(50_000).astype(dtype)])
    new = base.copy()
    new[len(SPECIAL):] += (1e-3 * rng.standard_normal(50_000)).astype(dtype)
    raw = new.view(np.dtype(f"u{new.itemsize}"))
    raw[4] |= 0x3  # a NaN with a payload
    raw[5] ^= 1  # a subnormal's last bit
    codec = _roundtrip(new.tobytes(), elem=new.itemsize, base=base.tobytes(), base_id="c" * 64)
    assert codec in (GSUB, XOR)


def test_codec_choice():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(1 << 18).astype(np.float32)
    assert parse_header(encode_chunk(b"\0" * 10000).blob).codec == ZSTD
    assert parse_header(encode_chunk(os.urandom(1 << 16), elem=4).blob).codec == RAW
    assert parse_header(encode_chunk(w.tobytes(), elem=4).blob).codec == PLANES
    ft = (w + (1e-4 * rng.standard_normal(w.shape)).astype(np.float32)).tobytes()
    enc = encode_chunk(ft, elem=4, base=w.tobytes(), base_id="d" * 64)
    assert enc.codec == GSUB and enc.base == "d" * 64
    assert len(enc.blob) < 0.6 * len(ft)


def _plane_modes(blob: bytes) -> list[int]:
    h = parse_header(blob)
    payload = memoryview(blob)[h.size :]
    return [payload[1 + 5 * k] for k in range(payload[0] & ~codecs.COUNTED)]


@pytest.mark.parametrize("native", [True, False])
def test_sparse_planes_are_stored_as_bit_planes(native, monkeypatch):
    """A plane of mostly zeros with a few live low bits (the high byte of small deltas) is
    stored bit-transposed: smaller than zstd alone makes it, decoded bit for bit."""
    if not native:
        monkeypatch.setattr(codecs, "native", None)
    rng = np.random.default_rng(0)
    n = 1 << 18
    hi = (rng.random(n) < 0.3) * rng.integers(0, 4, n)
    x = ((hi << 8) | rng.integers(0, 256, n)).astype("<u2").tobytes()
    enc = encode_chunk(x, elem=2)
    assert enc.codec == PLANES and _plane_modes(enc.blob) == [codecs.PLANE_RAW, codecs.PLANE_BITS]
    plane = np.frombuffer(x, np.uint8)[1::2].tobytes()
    assert enc.size < 8 + 1 + 10 + n + 0.9 * len(zstandard.ZstdCompressor(level=1).compress(plane))
    assert bytes(decode_chunk(enc.blob, object_id(x), len(x), max_length=1 << 24)) == x
    # the same bytes whichever kernels wrote them
    monkeypatch.setattr(codecs, "native", None)
    assert encode_chunk(x, elem=2).blob == enc.blob


@pytest.mark.parametrize("native", [True, False])
def test_planes_that_follow_the_plane_above_are_sorted_by_it(native, monkeypatch):
    """A low byte that depends on the high byte (as the low bytes of deltas depend on their
    magnitude) is stored in the high byte's order: smaller, decoded bit for bit."""
    if not native:
        monkeypatch.setattr(codecs, "native", None)
    rng = np.random.default_rng(1)
    n = 1 << 18
    hi = rng.integers(0, 16, n)
    x = ((hi << 8) | (hi * 16 + rng.integers(0, 4, n))).astype("<u2").tobytes()
    enc = encode_chunk(x, elem=2)
    modes = _plane_modes(enc.blob)
    assert modes[0] & codecs.PLANE_SORTED and not modes[1] & codecs.PLANE_SORTED
    low = np.frombuffer(x, np.uint8)[0::2].tobytes()
    assert enc.size < 0.8 * (n + len(zstandard.ZstdCompressor(level=1).compress(low)))
    assert bytes(decode_chunk(enc.blob, object_id(x), len(x), max_length=1 << 24)) == x
    monkeypatch.setattr(codecs, "native", None)
    assert encode_chunk(x, elem=2).blob == enc.blob
    # the top plane has no plane above it: a table that says otherwise is corrupt
    blob = bytearray(enc.blob)
    blob[parse_header(enc.blob).size + 1 + 5] |= codecs.PLANE_SORTED
    with pytest.raises(CorruptObjectError, match="damaged"):
        decode_chunk(bytes(blob), object_id(x), len(x), max_length=1 << 24)


def _adam_like_step(n: int = 300_000) -> tuple[bytes, bytes]:
    """fp32 weights and the same after a sign-like step on most of them: GSUB, with planes 0 and 1 sorted."""
    rng = np.random.default_rng(0)
    base = (rng.standard_normal(n) * 0.02).astype(np.float32)
    new = (base - 1e-5 * np.sign(rng.standard_normal(n)) * (rng.random(n) < 0.9)).astype(np.float32)
    return new.tobytes(), base.tobytes()


def _counts_frame(blob: bytes) -> tuple[int, int]:
    """Where a COUNTED chunk's slot-count frame starts in the blob, and its length."""
    h = parse_header(blob)
    at = h.size + 1 + 5 * (blob[h.size] & ~codecs.COUNTED)
    (size,) = struct.unpack_from("<I", blob, at)
    return at + 4, size


@pytest.mark.parametrize("native", [True, False])
def test_large_chunks_store_their_permutations_slot_counts(native, monkeypatch):
    """A chunk of COUNTS_MIN elements or more stores the slot counts of its permutations
    (GSUB's, then each sorted plane's), so the decoder need not count them: the same bytes
    from either kernels, decoded bit for bit by either. Blobs without them (written before
    this format, or small) still decode."""
    if not native:
        monkeypatch.setattr(codecs, "native", None)
    new, base = _adam_like_step()
    bid, oid = object_id(base), object_id(new)
    enc = encode_chunk(new, elem=4, base=base, base_id=bid)
    h = parse_header(enc.blob)
    assert enc.codec == GSUB and enc.blob[h.size] == 4 | codecs.COUNTED
    ordered = [k for k, m in enumerate(_plane_modes(enc.blob)) if m & codecs.PLANE_SORTED]
    assert ordered == [0, 1]
    start, size = _counts_frame(enc.blob)
    counts = codecs._counts_unpack(enc.blob[start : start + size], 2048 + 2 * 512, oid)
    assert np.array_equal(counts[:2048], transforms.group_counts(base, 4))
    assert size < 2000  # about 1.3 KB on a 4 MiB chunk of a real fine-tune: 0.07% of its stored bytes
    assert bytes(decode_chunk(enc.blob, oid, len(new), max_length=1 << 24, base=base)) == new
    other = None if codecs.native is not None else NATIVE  # the kernels this run did not use
    if native or other is not None:
        monkeypatch.setattr(codecs, "native", other)
        assert encode_chunk(new, elem=4, base=base, base_id=bid).blob == enc.blob
        assert bytes(decode_chunk(enc.blob, oid, len(new), max_length=1 << 24, base=base)) == new
    # the format without counts: the same blob less the frame and the flag
    monkeypatch.setattr(codecs, "COUNTS_MIN", 1 << 40)
    old = encode_chunk(new, elem=4, base=base, base_id=bid).blob
    assert old == enc.blob[: h.size] + bytes([4]) + enc.blob[h.size + 1 : start - 4] + enc.blob[start + size :]
    for kernels in (None, NATIVE):
        monkeypatch.setattr(codecs, "native", kernels)
        assert bytes(decode_chunk(old, oid, len(new), max_length=1 << 24, base=base)) == new


@pytest.mark.parametrize("native", [True, False])
def test_wrong_slot_counts_are_corruption_never_a_wild_read(native, monkeypatch):
    """The decoder trusts stored counts to place bytes, so every way of getting them wrong
    must end in CorruptObjectError: counts that do not add up, a count moved to another
    value, all of a half's counts on the first value (the pointers of every other value
    then start at the end of the data: the C kernels read ahead into a buffer twice the
    data, never past it) or on the last."""
    if not native:
        monkeypatch.setattr(codecs, "native", None)
    new, base = _adam_like_step()
    oid = object_id(new)
    blob = encode_chunk(new, elem=4, base=base, base_id=object_id(base)).blob
    start, size = _counts_frame(blob)
    counts = codecs._counts_unpack(blob[start : start + size], 2048 + 2 * 512, oid)
    for at, part in [(0, 2048), (2048, 512), (2560, 512)]:  # GSUB's, plane 0's, plane 1's
        half = part // 2
        for how in ("sum", "moved", "first", "last"):
            c = counts.copy()
            for lo in (at, at + half):
                total = int(c[lo : lo + half].sum())
                if how == "sum":
                    c[lo] += 1
                elif how == "moved":
                    v = lo + int(np.argmax(c[lo : lo + half]))
                    c[v] -= 1
                    c[lo + (v - lo + 1) % half] += 1
                else:
                    c[lo : lo + half] = 0
                    c[lo if how == "first" else lo + half - 1] = total
            frame = codecs._counts_pack([c], 1)
            bad = blob[: start - 4] + struct.pack("<I", len(frame)) + frame + blob[start + size :]
            with pytest.raises(CorruptObjectError, match="slot counts"):  # found by the counts check, not only by the hash
                decode_chunk(bad, oid, len(new), max_length=1 << 24, base=base)
    # a frame of the wrong size, and a flag with nothing to count
    frame = codecs._counts_pack([counts[:-1]], 1)
    bad = blob[: start - 4] + struct.pack("<I", len(frame)) + frame + blob[start + size :]
    with pytest.raises(CorruptObjectError, match="wrong size"):
        decode_chunk(bad, oid, len(new), max_length=1 << 24, base=base)
    plain = encode_chunk(new, elem=4)  # PLANES, nothing sorted: no counts
    h = parse_header(plain.blob)
    assert plain.codec == PLANES and plain.blob[h.size] == 4
    flagged = plain.blob[: h.size] + bytes([4 | codecs.COUNTED]) + plain.blob[h.size + 1 : h.size + 21] + \
        struct.pack("<I", len(frame)) + frame + plain.blob[h.size + 21 :]
    with pytest.raises(CorruptObjectError, match="nothing to count"):
        decode_chunk(flagged, oid, len(new), max_length=1 << 24)


def test_a_plain_planes_win_is_explored_before_the_whole_chunk_is_encoded():
    """With a base only GSUB tries the sorted and bit-plane forms on the sample; when the
    delta does not pay (an unrelated base) and plain planes win, they are explored before
    the whole chunk is encoded, so the chunk still gets its sorted plane."""
    rng = np.random.default_rng(1)
    n = 1 << 18
    hi = rng.integers(0, 16, n)
    x = ((hi << 8) | (hi * 16 + rng.integers(0, 4, n))).astype("<u2").tobytes()
    base = rng.integers(0, 1 << 16, n).astype("<u2").tobytes()
    enc = encode_chunk(x, elem=2, base=base, base_id=object_id(base))
    assert enc.codec == PLANES and _plane_modes(enc.blob)[0] & codecs.PLANE_SORTED
    assert enc.blob == encode_chunk(x, elem=2).blob  # as if no base had been offered
    assert bytes(decode_chunk(enc.blob, object_id(x), len(x), max_length=1 << 24)) == x


@given(st.sampled_from([np.float16, np.float32, np.float64]), st.sampled_from(["near", "far", "same", "bits"]),
       st.integers(0, 2**32 - 1))
@settings(max_examples=24, deadline=None)
def test_candidates_that_stop_early_do_not_change_the_choice(dtype, relation, seed):
    """On the sample, candidates stop once they are larger than the best so far: the
    blob is the one a full comparison of every candidate gives."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(50_000) * 0.05).astype(dtype)
    new = {"near": base + (rng.standard_normal(base.shape) * 1e-4).astype(dtype),
           "far": rng.standard_normal(base.shape).astype(dtype),
           "same": base.copy(),
           "bits": base.view(f"u{base.itemsize}") ^ rng.integers(0, 4, base.shape).astype(f"u{base.itemsize}")}[relation]
    args = dict(elem=base.itemsize, base=base.tobytes(), base_id=object_id(base.tobytes()))
    early = encode_chunk(np.ascontiguousarray(new).tobytes(), **args)
    import ckpt.codecs.chunk as chunk_codec  # (the encoder encode_chunk calls)

    full = chunk_codec.planes_encode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk_codec, "planes_encode", lambda *a, limit=None, **kw: full(*a, **kw))
        assert encode_chunk(np.ascontiguousarray(new).tobytes(), **args).blob == early.blob


DATA = os.path.join(os.path.dirname(__file__), "data")


def _pre_counts_chunks():
    """The chunks of tests/ckpt/codecs/data/*.blob, which ckpt wrote before chunks stored slot
    counts (commit 283f23d): name, data, base, the start of the chunk id."""
    rng = np.random.default_rng(7)
    n = 300_000
    base = (rng.standard_normal(n) * 0.02).astype(np.float32)
    step = (base - 1e-5 * np.sign(rng.standard_normal(n)) * (rng.random(n) < 0.9)).astype(np.float32)
    yield "gsub-fp32", step, base, "3c4caf25b23f77db"  # planes 0 and 1 sorted
    b16 = ((rng.standard_normal(2 * n) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    ft = (b16.astype(np.int32) + rng.integers(-2, 3, b16.shape) * (rng.random(b16.shape) < 0.3)).astype(np.uint16)
    yield "gsub-bf16", ft, b16, "1763fb01ae8b6e0c"
    hi = rng.integers(0, 16, 1 << 18)
    yield "planes-u16", ((hi << 8) | (hi * 16 + rng.integers(0, 4, 1 << 18))).astype("<u2"), None, "6de3e8417903ffe8"


@pytest.mark.parametrize("native", [True, False])
def test_blobs_written_before_slot_counts_still_read(native, monkeypatch):
    """Stores written before chunks carried slot counts stay readable: their blobs decode
    bit for bit, and today's writer with counts turned off writes them byte for byte."""
    if not native:
        monkeypatch.setattr(codecs, "native", None)
    for name, new, base, prefix in _pre_counts_chunks():
        data = new.tobytes()
        oid = object_id(data)
        assert oid.startswith(prefix), f"{name}: numpy no longer generates the fixture's data"
        with open(os.path.join(DATA, f"{name}.blob"), "rb") as f:
            blob = f.read()
        args = dict(base=base.tobytes(), base_id=object_id(base.tobytes())) if base is not None else {}
        assert bytes(decode_chunk(blob, oid, len(data), max_length=1 << 24, base=args.get("base"))) == data
        now = encode_chunk(data, elem=new.itemsize, **args).blob
        assert now[parse_header(now).size] & codecs.COUNTED and len(now) < len(blob) + 2000
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(codecs, "COUNTS_MIN", 1 << 40)
            assert encode_chunk(data, elem=new.itemsize, **args).blob == blob


def test_delta_without_base_is_an_error():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(1 << 16).astype(np.float32)
    ft = (w + np.float32(1e-5)).tobytes()
    enc = encode_chunk(ft, elem=4, base=w.tobytes(), base_id="d" * 64)
    with pytest.raises(CorruptObjectError, match="needs its base"):
        decode_chunk(enc.blob, object_id(ft), len(ft), max_length=1 << 24)
    with pytest.raises(CorruptObjectError):  # the wrong base never yields wrong bytes
        decode_chunk(enc.blob, object_id(ft), len(ft), max_length=1 << 24, base=bytes(len(ft)))


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_any_single_bit_flip_never_yields_wrong_bytes(draw):
    """A flipped bit is an error, unless it lies in a field the decoder ignores
    (inside a compressor's own framing) and the decoded bytes still hash to the id."""
    elem, data = draw.draw(aligned(max_elems=500))
    if not data:
        data = bytes(elem)
    base = bytes(b ^ 2 for b in data) if elem > 1 and draw.draw(st.booleans()) else None
    blob = bytearray(encode_chunk(data, elem=elem, base=base, base_id="e" * 64 if base else None).blob)
    i = draw.draw(st.integers(0, len(blob) * 8 - 1))
    blob[i // 8] ^= 1 << (i % 8)
    try:
        got = decode_chunk(bytes(blob), object_id(data), len(data), max_length=1 << 20, base=base)
    except CorruptObjectError:
        return
    assert i >= 16 * 8 and bytes(got) == data  # never in our header, never different bytes


@given(st.binary(max_size=300), st.sampled_from([None, b"\0" * 10]))
@settings(max_examples=500, deadline=None)
def test_garbage_blobs_never_crash(blob, base):
    with pytest.raises(CorruptObjectError):
        decode_chunk(blob, "0" * 64, 10, max_length=1 << 20, base=base)


@given(st.sampled_from([PLANES, SUB, XOR, GSUB]), st.binary(min_size=0, max_size=200), st.integers(0, 1 << 40))
@settings(max_examples=500, deadline=None)
def test_garbage_planes_payloads_never_crash(codec, payload, length):
    import struct

    flags = 1 if codec in (SUB, XOR, GSUB) else 0
    blob = struct.pack("<4sBBBBQ", b"CKc1", codec, 4, flags, 0, length) + (b"f" * 32 if flags else b"") + payload
    with pytest.raises(CorruptObjectError):
        decode_chunk(blob, "0" * 64, length, max_length=1 << 20, base=bytes(length) if length < 1 << 20 else None)


def test_decompression_bomb_rejected_before_allocating():
    data = b"\0" * 1_000_000
    blob = encode_chunk(data).blob
    with pytest.raises(CorruptObjectError, match="over the"):
        decode_chunk(blob, object_id(data), len(data), max_length=1000)
    with pytest.raises(CorruptObjectError, match="manifest says"):
        decode_chunk(blob, object_id(data), 10, max_length=1 << 30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
@pytest.mark.parametrize("kind", ["raw", "zstd", "planes"])
def test_a_chunk_from_a_peer_decoded_into_fresh_memory_has_its_pages_faulted_in_first(kind, advised):
    """A peer restore decodes the chunks it receives into a fresh optimizer's moments, memory never
    touched: the copy took a page fault per 4 KiB page (a 1.2 GB GPT + AdamW peer restore, rank 1:
    1.84 -> 1.56 CPU-s with them faulted in first). Its target's whole pages are faulted in with one
    madvise first, as a local read does, and the decode stays exact. (Only there: in decode_chunk itself
    it ran on every decode, a pull's fresh buffers too, for no gain measured.)"""
    from ckpt.snapshot.peer_targets import decode_into_targets
    from ckpt.snapshot.tiers import Tiers

    page = mmap.PAGESIZE
    n = 64 * page
    data = {"raw": os.urandom(n), "zstd": bytes(n), "planes": np.arange(n // 4, dtype=np.float32).tobytes()}[kind]
    enc = encode_chunk(data, elem=1 if kind != "planes" else 4, min_saving=1.0 if kind == "raw" else 0.02)
    assert enc.codec == {"raw": RAW, "zstd": ZSTD, "planes": PLANES}[kind]
    area = mmap.mmap(-1, n + page)
    out = memoryview(area)[100 : 100 + n]  # pages 1..63 whole; 0 and 64 partly
    tiers = Tiers([])
    assert decode_into_targets(object_id(data), memoryview(enc.blob), [out], tiers, n)
    assert bytes(out) == data and advised == [63 * page]
    assert decode_into_targets(object_id(data), memoryview(enc.blob), [out], tiers, n)
    assert advised == [63 * page]  # memory in place: not advised again
    assert decode_chunk(enc.blob, object_id(data), n, max_length=n, out=memoryview(mmap.mmap(-1, n))) is not None
    assert advised == [63 * page]  # a decode elsewhere (a pull's buffers) is not advised
