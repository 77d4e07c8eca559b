from __future__ import annotations

import os
import time

import pytest
import torch

import ckpt
from storage.gc import referenced_chunks


def _age(store_path, seconds):
    """Make every object look ``seconds`` old."""
    t = time.time() - seconds
    for root, _, files in os.walk(os.path.join(store_path, "objects")):
        for f in files:
            os.utime(os.path.join(root, f), (t, t))


def test_referenced_chunks_rule():
    m = b'{"files":[{"chunks":["' + b"a" * 64 + b'"]}],"tensors":[{"chunks":["' + b"b" * 64 + b'"],"delta_bases":[["' + b"c" * 64 + b'"]]}]}'
    assert referenced_chunks(m) == {"a" * 64, "b" * 64, "c" * 64}


def test_gc_frees_removed_ref_and_keeps_shared(tmp_path):
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    shared = torch.randn(1000)
    store.push({"shared": shared, "own": torch.randn(500)}, "a")
    store.push({"shared": shared, "own": torch.randn(500) + 5}, "b")
    store.remove("a")
    _age(path, 7200)
    dry = store.gc(grace_s=3600, dry_run=True)
    assert dry.planned == 2  # a's manifest and a's own chunk (headers are equal, so shared)
    assert store.verify().ok
    r = store.gc(grace_s=3600)
    assert len(r.deleted) == 2
    assert store.verify().ok
    assert torch.equal(store.load("b")["shared"], shared)
    assert store.gc(grace_s=0).planned == 0


def test_gc_respects_grace_period(tmp_path):
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push({"x": torch.randn(100)}, "a")
    store.remove("a")
    r = store.gc(grace_s=3600)
    assert r.deleted == [] and r.young == 3


def test_gc_keeps_history_unless_told(tmp_path):
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    first = {"x": torch.randn(100)}
    store.push(first, "a")
    store.push({"x": torch.randn(100)}, "a")
    _age(path, 10)
    store.gc(grace_s=0)
    assert torch.equal(store.load("a@1")["x"], first["x"])
    store.gc(grace_s=0, keep_history=False)
    with pytest.raises(ckpt.CkptError):
        store.load("a@1")
    assert store.verify().ok


def test_touched_objects_survive(tmp_path):
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    t = {"x": torch.randn(100)}
    store.push(t, "a")
    store.remove("a")
    _age(path, 7200)
    plan_first = store.gc(grace_s=3600, dry_run=True)
    assert plan_first.planned == 3
    store.push(t, "b")  # reuses (and touches) the same chunks
    store.gc(grace_s=3600)
    assert store.verify().ok
    assert torch.equal(store.load("b")["x"], t["x"])


def test_gc_removes_stale_temporaries(tmp_path):
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    d = tmp_path / "s" / "objects" / "chunks" / "ab"
    d.mkdir(parents=True)
    (d / ".tmp-deadbeef").write_bytes(b"partial")
    _age(path, 7200)
    r = store.gc(grace_s=3600)
    assert [x.kind for x in r.deleted] == ["temp"]
    assert not (d / ".tmp-deadbeef").exists()
