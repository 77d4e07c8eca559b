"""Writers and gc on a store that cannot touch objects (S3, fsspec): leases and gc locks.

The race these tests stage: a chunk stored long ago whose ref was removed is reused by a
new push; a gc that read the refs before the push's ref landed deletes it after the
push checked it was there. Without the locks of storage/leases.py the push publishes a
ref that cannot load (test_a_gc_between_plan_and_delete_cannot_break_a_push fails so).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckpt
from ckpt_store.storage import leases
from ckpt_store.storage.errors import StorageIOError, StoreFormatError
from ckpt_store.storage.gc import execute_gc, plan_gc
from ckpt_store.storage.leases import gc_lock, writer_lease

ROOT = Path(__file__).resolve().parents[2]


def _files(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(256, 256, generator=g)
    a = tmp_path / "a.safetensors"
    save_file({"w": shared, "a": torch.randn(16, generator=g)}, str(a))
    b_tensors = {"w": shared, "b": torch.randn(16, generator=g)}
    b = tmp_path / "b.safetensors"
    save_file(b_tensors, str(b))
    return a, b, b_tensors


def _chunks_of(store: ckpt.Store, ref: str) -> set[str]:
    from ckpt_store.storage.chunk_lists import referenced_chunks

    return referenced_chunks(store.objects.get_manifest(store.resolve(ref)))


def _locks(store: ckpt.Store) -> list[str]:
    return [e.path for e in store.objects.backend.list(leases.LOCKS)]


def _same(store: ckpt.Store, ref: str, tensors: dict[str, torch.Tensor]) -> None:
    got = store.load(ref)
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].view(torch.uint8).equal(t.contiguous().view(torch.uint8)), k


def _under_a_gc(store: ckpt.Store, garbage: set[str], write: Callable[[], object]) -> tuple[dict[str, object], set[str], bool]:
    """Run ``write`` (a push, a copy) in a thread while a gc with no grace period, holding its lock,
    has planned to delete ``garbage`` and deletes it once the writer waits for it with its lease
    written (a store that touches: once the writer is done). Returns what ``write`` returned
    ("value") or raised ("error"), what the gc deleted, and whether it held a lock."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = write()
        except Exception as e:  # noqa: BLE001 - the caller's assertions report it
            outcome["error"] = e

    with gc_lock(store.objects) as lock:
        plan = plan_gc(store.objects, store.refs_db, grace_s=0, lock=lock)
        assert garbage <= {d.name for d in plan.delete}  # the gc means to delete what the writer reuses
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        # The writer either ends (a store that touches: the reused chunks are refreshed, the plan's
        # deletes skip them) or waits for this gc with its lease written.
        while t.is_alive() and not any("/write-" in p for p in _locks(store)) and time.monotonic() < deadline:
            time.sleep(0.02)
        if lock is not None:
            t.join(1.0)
            assert t.is_alive(), "the writer went on while a gc held its lock"
        deleted = {d.name for d in execute_gc(store.objects, plan, lock=lock)}
    t.join(60)
    assert not t.is_alive()
    return outcome, deleted, lock is not None


def test_a_gc_between_plan_and_delete_cannot_break_a_push_reusing_old_chunks(store_url, tmp_path):
    store = ckpt.Store.init(store_url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    a, b, b_tensors = _files(tmp_path)
    store.push(str(a), "a", delta=False)
    reused = _chunks_of(store, "a")
    store.remove("a")  # its chunks are garbage now, old enough for a gc with no grace period
    outcome, deleted, locked = _under_a_gc(store, reused, lambda: store.push(str(b), "b", delta=False))
    # Where nothing can be touched the gc did take chunks the push had found present; the push,
    # waiting with its lease written, wrote them again before its ref moved (storage/commit.py).
    assert "error" not in outcome, outcome
    assert bool(deleted & reused & _chunks_of(store, "b")) == locked
    _same(store, "b", b_tensors)
    report = store.verify()
    assert report.ok, report
    assert _locks(store) == []


def test_a_push_reusing_old_delta_chunks_whose_bases_a_gc_took_stores_them_whole(s3_url, tmp_path):
    """The chunk a push finds present may be another writer's delta: the push names its chain. A gc
    that takes the chunk and its base before the commit leaves the base beyond this push's reach
    (its bytes are not in this push): the chunk is written whole and the manifest names no chain."""
    from ckpt_store.storage.chunk_lists import chunk_depths

    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(128, 512, generator=g)}
    ft = {"w": base["w"] + 1e-3 * torch.randn(128, 512, generator=g)}
    store.push(base, "base")
    store.push(ft, "ft1", base="base")
    deltas = {c for c, d in chunk_depths(store.objects.get_manifest(store.resolve("ft1"))).items() if d > 0}
    assert deltas, "the fine-tune is stored as deltas against the base"
    garbage = _chunks_of(store, "ft1") | _chunks_of(store, "base")
    store.remove("ft1")
    store.remove("base")
    save_file(ft, str(tmp_path / "ft.safetensors"))
    outcome, deleted, locked = _under_a_gc(store, garbage,
                                           lambda: store.push(str(tmp_path / "ft.safetensors"), "ft2", delta=False))
    assert locked and "error" not in outcome, outcome
    assert garbage <= deleted
    m = store.objects.get_manifest(store.resolve("ft2"))
    assert deltas <= _chunks_of(store, "ft2") and not any(chunk_depths(m).values())  # stored whole now
    _same(ckpt.Store.open(s3_url), "ft2", ft)
    report = store.verify()
    assert report.ok, report
    assert _locks(store) == []


def test_a_gc_between_plan_and_delete_cannot_break_a_copy_reusing_old_chunks(s3_url, tmp_path):
    """The same race for a copy into S3: what the gc took after the copy found it present is sent
    again under the copy's lease, and the copied ref loads."""
    from ckpt.store.copy import copy_refs

    settings = ckpt.Settings.from_env(chunk_size=64 * 1024)
    dst = ckpt.Store.init(s3_url, settings=settings)
    src = ckpt.Store.init(str(tmp_path / "src"), settings=settings)
    a, b, b_tensors = _files(tmp_path)
    src.push(str(b), "b", delta=False)
    dst.push(str(a), "a", delta=False)
    reused = _chunks_of(dst, "a") & _chunks_of(src, "b")
    assert reused
    dst.remove("a")
    outcome, deleted, locked = _under_a_gc(dst, reused, lambda: copy_refs(src, dst, ["b"]))
    assert locked and "error" not in outcome, outcome
    assert reused <= deleted  # taken after the copy found them present, and sent again
    _same(ckpt.Store.open(s3_url), "b", b_tensors)
    report = dst.verify()
    assert report.ok, report
    assert _locks(dst) == []


def test_a_pt_pushed_to_s3_is_let_go_before_the_commit_waits_for_a_gc(s3_url, tmp_path):
    """A .pt is read under a lease (a writer waits while the push holds it open). On S3 a push keeps
    its source open until the commit, to write again what a gc takes, but not a leased file: a
    commit waiting for a gc would hold up the training job saving over it."""
    path = tmp_path / "m.pt"
    tensors = {f"t{i}": torch.randn(1 << 16) for i in range(4)}
    torch.save(tensors, path)
    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))

    def open_here() -> bool:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                    return True
            except OSError:
                continue
        return False

    seen: dict[str, bool] = {}
    with gc_lock(store.objects) as lock:
        assert lock is not None
        t = threading.Thread(target=lambda: seen.update(id=bool(store.push(str(path), "m", delta=False))))
        t.start()
        deadline = time.monotonic() + 60
        while not any("/write-" in p for p in _locks(store)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert t.is_alive()  # waiting for this gc, its lease written
        seen["open while waiting"] = open_here()
    t.join(60)
    assert seen == {"id": True, "open while waiting": False}
    _same(store, "m", tensors)


def test_gc_keeps_what_a_writer_lease_names(s3_url, tmp_path):
    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    a, _, _ = _files(tmp_path)
    store.push(str(a), "a", delta=False)
    kept = _chunks_of(store, "a")
    mid = store.resolve("a")
    store.remove("a")
    with writer_lease(store.objects, kept, [mid]) as lease:
        assert lease is not None
        r = store.gc(grace_s=0)
        assert not {d.name for d in r.deleted} & (kept | {mid})
        assert store.objects.has_many("chunks", kept) == kept
    r = store.gc(grace_s=0)  # the writer is done and named nothing: garbage
    assert kept <= {d.name for d in r.deleted}
    assert _locks(store) == []


@pytest.mark.slow  # (3-5 s: CI time, run by .ci/run's slow pass)
def test_a_writer_goes_on_when_a_killed_gcs_lock_goes_stale(s3_url, tmp_path, monkeypatch, caplog):
    """A gc killed while it held its lock: pushes wait for it only until it is stale."""
    monkeypatch.setattr(leases, "STALE_S", 3.0)
    monkeypatch.setattr(leases, "REFRESH_S", 0.5)
    store = ckpt.Store.init(s3_url)
    script = ("import sys, time, ckpt\n"
              "from ckpt_store.storage.leases import gc_lock\n"
              "store = ckpt.Store.open(sys.argv[1])\n"
              "with gc_lock(store.objects):\n"
              "    print('locked', flush=True)\n"
              "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, s3_url], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert any("/gc-" in p for p in _locks(store))  # left behind by the killed gc
    _, b, b_tensors = _files(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ckpt_store.storage.leases"):
        t0 = time.monotonic()
        store.push(str(b), "b", delta=False)
    assert time.monotonic() - t0 < 60
    assert "waiting for a gc" in caplog.text
    _same(store, "b", b_tensors)
    store.gc(grace_s=0)  # removes the dead gc's lock
    assert _locks(store) == []


def test_a_gc_paused_past_its_lock_deletes_nothing(s3_url, tmp_path, monkeypatch):
    monkeypatch.setattr(leases, "STALE_S", 1.0)  # refreshed every REFRESH_S (15 s): stale after 0.5 s
    store = ckpt.Store.init(s3_url)
    a, _, _ = _files(tmp_path)
    store.push(str(a), "a", delta=False)
    store.remove("a")
    with gc_lock(store.objects) as lock:
        plan = plan_gc(store.objects, store.refs_db, grace_s=0, lock=lock)
        assert plan.delete
        time.sleep(0.6)  # as if the process were stopped here: writers may take the lock for a dead one's
        with pytest.raises(StorageIOError, match="not refreshed"):
            list(execute_gc(store.objects, plan, lock=lock))
    listed, _ = store.objects.inventory()
    assert {d.name for d in plan.delete if d.kind == "chunks"} <= {i.id for i in listed["chunks"]}


def test_a_lease_that_cannot_be_read_stops_gc(s3_url, tmp_path):
    store = ckpt.Store.init(s3_url)
    a, _, _ = _files(tmp_path)
    store.push(str(a), "a", delta=False)
    store.remove("a")
    store.objects.backend.write(f"{leases.LOCKS}/write-0123.json", b'{"chunks": ["../../x"], "manifests": []}')
    with pytest.raises(StoreFormatError, match="lease that cannot be read"):
        store.gc(grace_s=0)
    assert len(store.objects.inventory()[0]["chunks"]) > 0  # nothing deleted
    exe = Path(sys.executable).parent / "ckpt"
    r = subprocess.run([str(exe), "--store", s3_url, "gc", "--grace", "0s"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "lease that cannot be read" in r.stderr


def test_a_gc_before_an_alias_moves_cannot_break_a_snapshot_reusing_old_chunks(s3_url, tmp_path, monkeypatch):
    """A snapshot push moves RUN/latest and its step ref: a gc run between the manifest and those
    refs (here, in another process, just before the first ref moves) must keep what it reuses."""
    from ckpt.store.push import push_source
    from ckpt.store.sources import from_tensors

    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    a, _, b_tensors = _files(tmp_path)
    store.push(str(a), "a", delta=False)
    reused = _chunks_of(store, "a")
    store.remove("a")  # its chunks are garbage now, old enough for a gc with no grace period
    tensors = {"w": b_tensors["w"]}  # stored whole in a
    real_set = store.refs_db.set
    gcs: list[subprocess.CompletedProcess[str]] = []

    def set_after_a_gc(*args: object, **kwargs: object) -> object:
        if not gcs:
            exe = Path(sys.executable).parent / "ckpt"
            gcs.append(subprocess.run([str(exe), "--store", s3_url, "gc", "--grace", "0s"], capture_output=True,
                                      text=True, timeout=120))
        return real_set(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store.refs_db, "set", set_after_a_gc)
    src = from_tensors(tensors, "snapshot", {}, None, {}, None)
    push_source(store, src, "run/step-1", aliases=("run/latest",))
    assert gcs and gcs[0].returncode == 0, gcs
    assert reused & _chunks_of(store, "run/latest")  # the snapshot did reuse the removed ref's chunks
    for ref in ("run/latest", "run/step-1"):
        _same(ckpt.Store.open(s3_url), ref, tensors)
    report = store.verify()
    assert report.ok, report
    assert _locks(store) == []
