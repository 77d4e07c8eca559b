"""Concurrency: several processes push overlapping checkpoints into one local store while
another runs ``gc`` with a short grace period, over and over.

What must hold afterwards (issue 8, docs/format.md "Garbage collection"): nothing a live
ref needs was deleted (``verify`` passes, every version of every live ref loads bit for
bit), every ref's history holds every update every process made (none lost), and no push
failed. It is not vacuous: the pushers remove refs as they go, so there is garbage, gc
deletes some of it, and the pushers keep re-pushing the same tensors, so they reuse
objects gc is deleting at that moment.

Real processes (``subprocess``), a real store on disk, real torch tensors.
``CKPT_CONCURRENCY_SECONDS`` sets how long the pushers run (default 6).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt

PUSHERS = 4
POOL = 24  # tensors shared by every pusher, 64 KiB each (one chunk)

COMMON = r'''
import json, os, random, sys, time
import torch
torch.set_num_threads(1)
import ckpt

def pool_tensor(k):
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randn(16384, generator=g)
'''

PUSHER = COMMON + r'''
store_url, me, seconds, log_path = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
store = ckpt.Store.open(store_url)
rng = random.Random(me)
end = time.time() + seconds
errors = 0
with open(log_path, "w") as log:
    r = 0
    while time.time() < end or r < 6:
        picks = rng.sample(range(24), 6)
        tensors = {f"t{j}": pool_tensor(k) for j, k in enumerate(picks)}
        ref = "shared/latest" if r % 4 == 3 else f"p{me}/c{r % 3}"
        try:
            res = store.push(tensors, ref, message=f"p{me} r{r}")
            log.write(json.dumps({"op": "push", "ref": ref, "id": res.id, "picks": picks}) + "\n")
        except Exception as e:  # counted and reported: the test requires none
            errors += 1
            log.write(json.dumps({"op": "error", "ref": ref, "error": f"{type(e).__name__}: {e}"}) + "\n")
        if r % 5 == 4:  # make garbage: a removed ref keeps nothing alive
            victim = f"p{me}/c{rng.randrange(3)}"
            try:
                store.remove(victim)
                log.write(json.dumps({"op": "remove", "ref": victim}) + "\n")
            except ckpt.CkptError:
                pass  # not live right now
        log.flush()
        r += 1
print(json.dumps({"rounds": r, "errors": errors}))
'''

GC = COMMON + r'''
store_url, stop_path = sys.argv[1], sys.argv[2]
store = ckpt.Store.open(store_url)
runs = deleted = 0
while not os.path.exists(stop_path):
    rep = store.gc(grace_s=1.0)
    runs += 1
    deleted += len(rep.deleted)
    time.sleep(0.05)
print(json.dumps({"runs": runs, "deleted": deleted}))
'''


def pool_tensor(k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randn(16384, generator=g)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.slow
def test_pushers_and_gc_at_once_lose_nothing(tmp_path: Path) -> None:
    store_url = str(tmp_path / "store")
    ckpt.Store.init(store_url)
    _race(store_url, tmp_path, {})


@pytest.mark.slow
def test_pushers_and_gc_at_once_lose_nothing_on_s3(tmp_path: Path, s3_main: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on S3, where nothing can be touched: gc locks and writer leases (storage/leases.py)
    keep gc off the chunks a push reuses, chunks whose refs the pushers keep removing."""
    from s3support import KEY, SECRET

    creds = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": s3_main.endpoint}
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    store_url = f"s3://{s3_main.new_bucket()}/store"
    ckpt.Store.init(store_url)
    _race(store_url, tmp_path, {})


def _race(store_url: str, tmp_path: Path, extra_env: dict[str, str]) -> None:
    seconds = float(os.environ.get("CKPT_CONCURRENCY_SECONDS", "6"))
    env = {**os.environ, "CKPT_CHUNK_SIZE": str(64 * 1024), "OMP_NUM_THREADS": "1", **extra_env}
    stop = tmp_path / "stop"
    gc = subprocess.Popen([sys.executable, "-c", GC, store_url, str(stop)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = [tmp_path / f"pusher{i}.jsonl" for i in range(PUSHERS)]
    pushers = [subprocess.Popen([sys.executable, "-c", PUSHER, store_url, str(i), str(seconds), str(logs[i])], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(PUSHERS)]
    results = []
    try:
        for p in pushers:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        stop.touch()
        gc_out, gc_err = gc.communicate(timeout=300)
    assert gc.returncode == 0, gc_err[-3000:]
    gc_stats = json.loads(gc_out.strip().splitlines()[-1])

    events = [[json.loads(line) for line in path.read_text().splitlines()] for path in logs]
    errors = [e for ev in events for e in ev if e["op"] == "error"]
    assert not errors, errors[:5]
    assert sum(r["errors"] for r in results) == 0

    store = ckpt.Store.open(store_url)
    report = store.verify()
    assert report.ok, report.problems[:5]

    # Every push is in its ref's history, in each process's order; no entry is extra.
    pushed: dict[str, list[dict]] = defaultdict(list)
    for ev in events:
        for e in ev:
            if e["op"] == "push":
                pushed[e["ref"]].append(e)
    entries_by_ref = store.refs_db.all_entries()  # newest first
    history = {name: [e for e in reversed(entries) if e.target is not None] for name, entries in entries_by_ref.items()}
    for ref, pushes in pushed.items():
        got = [e.target for e in history[ref]]
        assert sorted(got) == sorted(p["id"] for p in pushes), ref
    for i, ev in enumerate(events):  # per process, the shared ref's updates keep their order
        mine = [e["id"] for e in ev if e["op"] == "push" and e["ref"] == "shared/latest"]
        order = [t for t in (e.target for e in history["shared/latest"]) if t in set(mine)]
        assert order == [m for m in mine if m in set(order)], f"pusher {i}"

    # Every version of every live ref since its last removal loads bit for bit (gc keeps
    # a live ref's history; a removal ends what the name kept alive).
    want = {k: as_bytes(pool_tensor(k)) for k in range(POOL)}
    by_id = {p["id"]: p["picks"] for pushes in pushed.values() for p in pushes}
    live = store.refs()
    checked = 0
    for ref in live:
        since_removal = []
        for e in entries_by_ref[ref]:
            if e.target is None:
                break
            since_removal.append(e)
        for entry in since_removal:
            tensors = store.load(entry.target)
            picks = by_id[entry.target]
            assert sorted(tensors) == sorted(f"t{j}" for j in range(len(picks)))
            for j, k in enumerate(picks):
                assert as_bytes(tensors[f"t{j}"]) == want[k], (ref, entry.seq, j)
            checked += 1
    assert checked >= PUSHERS * 3

    # Not vacuous: there was garbage, gc ran during the pushes and deleted some.
    removes = sum(1 for ev in events for e in ev if e["op"] == "remove")
    assert removes > 0 and gc_stats["runs"] > 3, gc_stats
    assert gc_stats["deleted"] > 0, gc_stats
    print(f"\nconcurrency: {sum(r['rounds'] for r in results)} pushes by {PUSHERS} processes, {removes} removes, "
          f"gc {gc_stats['runs']} runs deleted {gc_stats['deleted']} objects; {checked} ref versions checked")


def test_a_teammate_reuses_and_collects_objects_another_user_wrote(tmp_path):
    """A team store on a shared disk (a group-writable folder, umask 002): objects follow the
    umask, so another user's push can touch the chunks it reuses (gc's protection) and another
    user's gc can condemn and put them back. With objects always 0644, a teammate's push that
    reused one failed with "cannot touch ...: permission denied"."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(256, 256, generator=g), "b": torch.randn(64, generator=g)}
    ft = {"w": base["w"], "b": base["b"] + 1}  # reuses w's chunk
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(ft, str(tmp_path / "ft.safetensors"))
    url = str(tmp_path / "store")
    old = os.umask(0o002)
    try:
        ckpt.Store.init(url).push(str(tmp_path / "base.safetensors"), "base")
        objects = [p for p in (tmp_path / "store" / "objects").rglob("*") if p.is_file()]
        assert objects and all(p.stat().st_mode & 0o777 == 0o664 for p in objects)
        if os.geteuid() != 0 or not shutil.which("setpriv"):
            return  # what follows needs another user: root giving up its powers over others' files
        for p in objects:
            os.chown(p, 65534, -1)  # written by someone else, of the same group
        exe = str(Path(sys.executable).parent / "ckpt")
        caps = "-dac_override,-fowner,-dac_read_search"
        as_teammate = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", exe, "--store", url]
        for args in (["push", str(tmp_path / "ft.safetensors"), "ft", "--base", "base"], ["rm", "base"],
                     ["gc", "--grace", "0s"], ["verify"]):
            r = subprocess.run(as_teammate + args, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, (args, r.stderr)
    finally:
        os.umask(old)
    got = ckpt.Store.open(url).load("ft")
    assert all(got[k].view(torch.uint8).equal(ft[k].view(torch.uint8)) for k in ft)


def test_two_pushes_storing_one_chunk_differently_keep_every_checkpoint_whole(tmp_path, monkeypatch):
    """Push A stores a fine-tune whole; push B, which looked for its chunks before A wrote them,
    stores the same chunks as deltas against a base. The first blob stays and B records it: with
    B's blob renamed over A's, A's manifest named no base for a chunk that needed one, and once B
    and the base were removed, gc freed that base and A could no longer load."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(128, 512, generator=g)}
    ft = {"w": base["w"] + 1e-3 * torch.randn(128, 512, generator=g)}
    save_file(ft, str(tmp_path / "ft.safetensors"))
    store = ckpt.Store.init(str(tmp_path / "store"), settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    store.push(base, "base")
    a = store.push(str(tmp_path / "ft.safetensors"), "a/ft", delta=False)
    assert a.manifest is not None
    backend = store.objects.backend
    written_by_a = {store.objects.path("chunks", c) for c in a.manifest.tensors[0].chunks}
    real_touch, looked = backend.touch, set()

    def touch_as_before_a_wrote(path: str) -> bool:  # B's first look at A's chunks came before A wrote them
        if path in written_by_a and path not in looked:
            looked.add(path)
            return False
        return real_touch(path)

    monkeypatch.setattr(backend, "touch", touch_as_before_a_wrote)
    store.push(str(tmp_path / "ft.safetensors"), "b/ft", base="base")
    assert looked == written_by_a  # B encoded A's chunks as deltas of its own
    monkeypatch.undo()
    for ref in ("b/ft", "base"):
        store.remove(ref)
    store.gc(grace_s=0)
    got = ckpt.Store.open(str(tmp_path / "store")).load("a/ft")
    assert got["w"].view(torch.uint8).equal(ft["w"].view(torch.uint8))
    report = store.verify()
    assert report.ok, report
