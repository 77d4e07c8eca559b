"""Bad input: each case is a clear error naming the problem, and nothing is stored."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch
from safetensors.torch import save_file

import ckpt
from ckpt.errors import InvalidNameError, InvalidSourceError, UnsafeInputError


def _valid(tmp_path):
    p = tmp_path / "ok.safetensors"
    save_file({"w": torch.randn(100, 10), "b": torch.randn(10)}, p)
    return p


def _header(obj) -> bytes:
    js = json.dumps(obj).encode()
    return struct.pack("<Q", len(js)) + js


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda b: b[:-7], "truncated"),
        (lambda b: b[:5], "too short"),
        (lambda b: b + b"junk", "trailing"),
        (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "claims"),
        (lambda b: b[:8] + b"[" + b[9:], "JSON"),
        (lambda b: _header({"w": {"dtype": "F32", "shape": [1 << 30, 1 << 30], "data_offsets": [0, 4]}}) + b"\0" * 4, "needs"),
        (lambda b: _header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}) + b"\0" * 8, "gap"),
        (lambda b: _header({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}) + b"\0" * 4, "bad shape"),
        (lambda b: _header({"__metadata__": {"a": 1}}), "__metadata__"),
        (lambda b: _header({"a\x00b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}) + b"\0", "invalid tensor name"),
    ],
)
def test_malformed_safetensors(tmp_path, store, make, words):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(make(_valid(tmp_path).read_bytes()))
    with pytest.raises((InvalidSourceError, InvalidNameError), match=words):
        store.push(bad, "x")
    assert store.refs() == {}
    assert list(store.objects.list("chunks")) == []


def test_duplicate_keys_rejected(tmp_path, store):
    js = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    bad = tmp_path / "dup.safetensors"
    bad.write_bytes(struct.pack("<Q", len(js)) + js + b"\0")
    with pytest.raises(InvalidSourceError, match="duplicate"):
        store.push(bad, "x")


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_payload_is_refused_without_running(tmp_path, store):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "x": _Evil(marker)}, evil)
    with pytest.raises(UnsafeInputError, match="refused"):
        store.push(evil, "x")
    assert not marker.exists()
    raw = tmp_path / "raw.bin"
    raw.write_bytes(pickle.dumps({"x": _Evil(marker)}))
    with pytest.raises(InvalidSourceError):
        store.push(raw, "x")
    assert not marker.exists()
    assert store.refs() == {}


def test_pt_that_is_not_a_dict(tmp_path, store):
    p = tmp_path / "t.pt"
    torch.save(torch.zeros(3), p)
    with pytest.raises(InvalidSourceError, match="not a state dict"):
        store.push(p, "x")


def test_missing_and_empty_sources(tmp_path, store):
    with pytest.raises(InvalidSourceError, match="no such file"):
        store.push(tmp_path / "nope.safetensors", "x")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(InvalidSourceError, match="no .safetensors"):
        store.push(tmp_path / "emptydir", "x")


def test_hf_index_must_match_shards(tmp_path, store):
    d = tmp_path / "m"
    d.mkdir()
    save_file({"a": torch.zeros(2)}, d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"b": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(InvalidSourceError, match="'b' is not in shard"):
        store.push(d, "x")


@pytest.mark.parametrize("name", ["../x", "/abs", "a\x07b", "a/../b", "x" * 300])
def test_bad_ref_names_rejected_before_io(tmp_path, store, name):
    with pytest.raises(InvalidNameError):
        store.push(_valid(tmp_path), name)
    assert list(store.objects.list("chunks")) == []


def test_non_tensor_values(store):
    with pytest.raises(InvalidSourceError, match="not a tensor"):
        store.push({"w": [1, 2]}, "x")
