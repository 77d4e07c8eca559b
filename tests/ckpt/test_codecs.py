from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.codecs import RAW, ZSTD, decode_chunk, encode_chunk, parse_header
from storage.errors import CorruptObjectError
from storage.objects import object_id


@given(st.binary(max_size=5000), st.integers(1, 19))
@settings(max_examples=200, deadline=None)
def test_roundtrip_any_bytes(data, level):
    blob = encode_chunk(data, level=level)
    assert decode_chunk(blob, object_id(data), len(data), max_length=1 << 20) == data


def test_compressible_is_zstd_and_noise_is_raw():
    import os

    assert parse_header(encode_chunk(b"\0" * 10000)).codec == ZSTD
    assert parse_header(encode_chunk(os.urandom(10000))).codec == RAW


@given(st.binary(min_size=1, max_size=2000), st.data())
@settings(max_examples=200, deadline=None)
def test_any_single_bit_flip_is_detected(data, draw):
    blob = bytearray(encode_chunk(data))
    i = draw.draw(st.integers(0, len(blob) * 8 - 1))
    blob[i // 8] ^= 1 << (i % 8)
    with pytest.raises(CorruptObjectError):
        decode_chunk(bytes(blob), object_id(data), len(data), max_length=1 << 20)


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_garbage_blobs_never_crash(blob):
    with pytest.raises(CorruptObjectError):
        decode_chunk(blob, "0" * 64, 10, max_length=1 << 20)


def test_decompression_bomb_rejected_before_allocating():
    data = b"\0" * 1_000_000
    blob = encode_chunk(data)
    with pytest.raises(CorruptObjectError, match="over the"):
        decode_chunk(blob, object_id(data), len(data), max_length=1000)
    with pytest.raises(CorruptObjectError, match="manifest says"):
        decode_chunk(blob, object_id(data), 10, max_length=1 << 30)
