"""Several processes pushing overlapping checkpoints into one S3 bucket at once.

Each process pushes checkpoints that share a tensor with every other process's, points
its own refs at them, and moves one shared ref after every push. Afterwards no update
is lost: the shared ref's history has one entry per push, numbered without gaps, every
process's refs are right, the shared tensor is stored once, and the store verifies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
np = pytest.importorskip("numpy")
from s3support import KEY, SECRET  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Pushing safetensors files needs no torch, so the workers start quickly.
WORKER = r"""
import json, os, sys, time, ckpt
url, me, go, files = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
store = ckpt.Store.open(url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
store.refs()  # warm: the S3 client is up before the race starts
open(f"{go}.ready-{me}", "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
ids = []
for k, path in enumerate(files):
    cid = store.push(path, f"w{me}/step-{k}", delta=False)  # no base search: this is about races
    store.refs_db.set("shared/latest", cid)
    ids.append(cid)
print(json.dumps(ids))
"""


@pytest.mark.parametrize("workers, pushes", [(3, 2), pytest.param(6, 4, marks=pytest.mark.slow)])
def test_processes_pushing_at_once_lose_nothing(workers, pushes, s3_main, tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    import ckpt

    rng = np.random.default_rng(0)
    common = rng.standard_normal((256, 256), dtype=np.float32)  # the same bytes in every process's pushes
    files = {}
    for i in range(workers):
        for k in range(pushes):
            p = tmp_path / f"w{i}-{k}.safetensors"
            save_file({"common": common, "own": rng.standard_normal((128, 128), dtype=np.float32),
                       "step": np.array([k], dtype=np.int64)}, str(p))
            files.setdefault(i, []).append(str(p))
    url = f"s3://{s3_main.new_bucket()}/store"
    creds = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": s3_main.endpoint}
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    ckpt.Store.init(url)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, url, str(i), str(go), *files[i]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(workers)]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.ready-{i}").exists() for i in range(workers)) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a worker died before the start"
        time.sleep(0.05)
    go.touch()  # they start pushing together
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))

    store = ckpt.Store.open(url)
    history = store.log("shared/latest")
    assert [e.seq for e in history] == list(range(workers * pushes, 0, -1))  # no gap, no lost entry
    assert sorted(e.target for e in history) == sorted(cid for ids in results for cid in ids)
    for i, ids in enumerate(results):
        for k, cid in enumerate(ids):
            assert store.resolve(f"w{i}/step-{k}") == cid
    report = store.verify()
    assert report.ok, report.problems
    # the common tensor is stored once, however many processes pushed it at the same time
    chunk_sets = [{c for t in store.manifest(cid).tensors if t.name == "common" for c in t.chunks}
                  for ids in results for cid in ids]
    assert all(s == chunk_sets[0] for s in chunk_sets)


def test_two_pushes_storing_one_chunk_differently_keep_every_checkpoint_whole(s3_url, tmp_path, monkeypatch):
    """As tests/test_concurrency.py's test of that name, on S3: push B looked for its chunks
    before push A wrote them and stores them as deltas. A's blobs stay (If-None-Match) and B
    records them; with B's PUTs landing last, A could no longer load once B and its base went."""
    import torch
    from safetensors.torch import save_file

    import ckpt

    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(128, 512, generator=g)}
    ft = {"w": base["w"] + 1e-3 * torch.randn(128, 512, generator=g)}
    save_file(ft, str(tmp_path / "ft.safetensors"))
    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    store.push(base, "base")
    a = store.push(str(tmp_path / "ft.safetensors"), "a/ft", delta=False)
    assert a.manifest is not None
    written_by_a = set(a.manifest.tensors[0].chunks)
    real_times, looked = store.objects.written_times, set()

    def times_as_before_a_wrote(kind, lookups, **kw):  # B's look at A's chunks came before A wrote them
        stored = real_times(kind, lookups, **kw)
        return lambda oid: None if oid in written_by_a and not looked.add(oid) else stored(oid)

    monkeypatch.setattr(store.objects, "written_times", times_as_before_a_wrote)
    store.push(str(tmp_path / "ft.safetensors"), "b/ft", base="base")
    assert looked == written_by_a  # B encoded A's chunks as deltas of its own
    monkeypatch.setattr(store.objects, "written_times", real_times)
    for ref in ("b/ft", "base"):
        store.remove(ref)
    store.gc(grace_s=0)
    got = ckpt.Store.open(s3_url).load("a/ft")
    assert got["w"].view(torch.uint8).equal(ft["w"].view(torch.uint8))
    report = store.verify()
    assert report.ok, report


@pytest.mark.parametrize("moved", [False, True])
def test_verify_while_a_gc_frees_earlier_versions_reports_no_damage(moved, s3_url, tmp_path, monkeypatch):
    """`ckpt verify` read the manifests of a ref's earlier versions, then a `gc --no-history` run
    elsewhere deleted them and their chunks before verify fetched the chunks: verify said "chunk ...
    is missing from the store" and exited 1 for a sound store (seen with one process pushing, one
    running gc --no-history, one verify, on S3). A version freed meanwhile is freed, not damaged;
    so is a version that was current when verify began, moved on by a push and freed since
    (``moved``). A chunk missing that the current version needs is still damage."""
    import torch

    import ckpt
    import ckpt.transfer.pipeline as pipeline  # (verify takes run_parallel from there when it runs)

    g = torch.Generator().manual_seed(1)
    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    for _ in range(3):
        store.push({"w": torch.randn(128, 256, generator=g)}, "m")
    other = ckpt.Store.open(s3_url)  # another process's view: it pushes and collects
    real = pipeline.run_parallel

    def gc_meanwhile(*args, **kwargs):  # once every manifest is read, before any chunk is fetched
        if moved:
            other.push({"w": torch.randn(128, 256, generator=g)}, "m")
        other.gc(grace_s=0, keep_history=False)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "run_parallel", gc_meanwhile)
    report = store.verify()
    assert report.ok, report.problems
    assert sorted(report.freed) == ["m@1", "m@2"]  # (the labels as verify began)
    monkeypatch.setattr(pipeline, "run_parallel", real)
    current = store.manifest("m").tensors[0].chunks[0]
    store.backend.delete(store.objects.path("chunks", current))
    report = store.verify()
    assert not report.ok and "m" in report.damaged_refs


def test_verify_while_a_ref_is_removed_and_collected_reports_no_damage(s3_url, monkeypatch):
    """As above, one step earlier: verify listed the refs, then `ckpt rm x` and a gc elsewhere
    deleted x's checkpoint before verify read its manifest: "manifest ... is missing", exit 1,
    for a ref that no longer exists in a sound store."""
    import torch

    import ckpt
    import ckpt.store.maintenance as maintenance

    g = torch.Generator().manual_seed(2)
    store = ckpt.Store.init(s3_url)
    store.push({"w": torch.randn(64, 64, generator=g)}, "keep")
    store.push({"w": torch.randn(64, 64, generator=g)}, "x")
    other = ckpt.Store.open(s3_url)
    real = maintenance.gc_roots

    def removed_meanwhile(*args, **kwargs):  # once the refs are read, before any manifest is
        found = real(*args, **kwargs)
        if "x" in other.refs():
            other.remove("x")
            other.gc(grace_s=0)
        return found

    monkeypatch.setattr(maintenance, "gc_roots", removed_meanwhile)
    report = store.verify()
    assert report.ok and not report.damaged_refs and not report.freed, report.problems
    store.backend.delete(store.objects.path("manifests", store.resolve("keep")))
    report = store.verify()  # a current manifest missing, its ref still there: damage, as before
    assert not report.ok and "keep" in report.damaged_refs
