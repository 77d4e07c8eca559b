"""The metadata index under concurrent pushers (real processes), on a local store and on S3.

Several processes push fine-tunes of one base with no ``--base`` (so each push chooses its
base from the index), remove refs as they go, and append to the index at once, while
another process runs ``gc`` (locally: deleting, with a 1 s grace; on S3, which cannot
protect a reused chunk by touching it, ``gc --dry-run``, then a real gc once the pushers
are done). Afterwards: no push failed, the store verifies, every live ref loads bit for
bit, the index brought up to date lists exactly what the refs hold, and ``ls``, ``du``
and ``gc --dry-run`` say the same with and without the index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

import ckpt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PUSHERS = 3

# Safetensors files need no torch: the workers start quickly.
PUSHER = r"""
import json, sys, numpy as np, ckpt
from safetensors.numpy import save_file
url, me, rounds, tmp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = ckpt.Store.open(url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
base = np.random.default_rng(0).standard_normal((4, 128, 128), dtype=np.float32)
out = []
for r in range(rounds):
    rng = np.random.default_rng(1000 * me + r)
    t = {f"l{i}.w": base[i] + np.float32(1e-3) * rng.standard_normal((128, 128), dtype=np.float32) for i in range(4)}
    path = f"{tmp}/p{me}-{r}.safetensors"
    save_file(t, path)
    ref = f"ft/p{me}-{r % 3}"
    res = store.push_report(path, ref)
    out.append({"ref": ref, "id": res.id, "file": path})
    if r % 4 == 3:
        store.remove(f"ft/p{me}-{(r + 1) % 3}")
        out.append({"ref": f"ft/p{me}-{(r + 1) % 3}", "removed": True})
print(json.dumps(out))
"""

GC = r"""
import json, os, sys, time, ckpt
url, stop, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
store = ckpt.Store.open(url)
runs = deleted = 0
while not os.path.exists(stop):
    rep = store.gc(grace_s=1.0, dry_run=dry)
    runs += 1
    deleted += len(rep.deleted) if not dry else 0
    time.sleep(0.3 if dry else 0.05)  # S3 (dry): leave the test server to the pushers
print(json.dumps({"runs": runs, "deleted": deleted}))
"""


def _base_file(tmp: Path) -> str:
    from safetensors.numpy import save_file

    base = np.random.default_rng(0).standard_normal((4, 128, 128), dtype=np.float32)
    path = tmp / "base.safetensors"
    save_file({f"l{i}.w": base[i] for i in range(4)}, str(path))
    return str(path)


def _run(url: str, tmp: Path, rounds: int, gc_dry: bool) -> tuple[list[dict], dict]:
    store = ckpt.Store.init(url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    store.push(_base_file(tmp), "ft/base")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    stop = tmp / "stop"
    gc = subprocess.Popen([sys.executable, "-c", GC, url, str(stop), "1" if gc_dry else "0"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pushers = [subprocess.Popen([sys.executable, "-c", PUSHER, url, str(i), str(rounds), str(tmp)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(PUSHERS)]
    events: list[dict] = []
    try:
        for p in pushers:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            events += json.loads(out.strip().splitlines()[-1])
    finally:
        time.sleep(0.3)
        stop.touch()
        gc_out, gc_err = gc.communicate(timeout=300)
    assert gc.returncode == 0, gc_err[-3000:]
    return events, json.loads(gc_out.strip().splitlines()[-1])


def _back_to_removal(entries: list) -> list:
    """``entries`` (newest first) up to and including the newest removal."""
    gone = next((i for i, e in enumerate(entries) if e.target is None), len(entries))
    return entries[:gone + 1]


def _check(url: str, events: list[dict]) -> None:
    from safetensors.numpy import load_file

    store = ckpt.Store.open(url)
    plain = ckpt.Store.open(url, settings=ckpt.Settings.from_env(index=False))
    if store.index is None:
        pytest.skip("this store keeps no index")
    report = store.verify()
    assert report.ok, report.problems[:5]
    # The index, checked against the refs, holds every entry every process wrote, back to each ref's
    # newest removal (what is older keeps nothing alive: a snapshot keeps no record of it).
    view = store.index.view(exact=True, history=True)
    assert view.entries() == {n: _back_to_removal(es) for n, es in plain.refs_db.all_entries().items()}
    assert store.ls().refs == plain.ls().refs and store.du() == plain.du()
    a, b = store.gc(grace_s=0, dry_run=True), plain.gc(grace_s=0, dry_run=True)
    assert sorted(a.deleted, key=str) == sorted(b.deleted, key=str) and a.live_chunks == b.live_chunks
    # Every live ref loads bit for bit; some chose a base from the index (fine-tunes of one base).
    last: dict[str, dict] = {}
    for e in events:
        last[e["ref"]] = e
    live = store.refs()
    bases = 0
    for ref, e in last.items():
        if e.get("removed"):
            assert ref not in live
            continue
        assert live[ref].target == e["id"]
        want = load_file(e["file"])
        got = store.load(ref)
        assert sorted(got) == sorted(want)
        for n, arr in want.items():
            assert got[n].numpy().tobytes() == arr.tobytes()
        bases += store.manifest(e["id"]).lineage.get("base") is not None
    assert bases > 0


def test_local_pushers_and_gc_with_the_index(tmp_path):
    url = str(tmp_path / "store")
    events, gc_stats = _run(url, tmp_path, rounds=8, gc_dry=False)
    assert gc_stats["runs"] > 2
    _check(url, events)


@pytest.mark.slow  # 15-60 s on the 2-core machine (three processes against one S3 server)
def test_s3_pushers_with_the_index(s3_url, tmp_path):
    events, gc_stats = _run(s3_url, tmp_path, rounds=4, gc_dry=True)
    assert gc_stats["runs"] > 0
    ckpt.Store.open(s3_url).gc(grace_s=0)  # nothing is pushing now: a real gc
    _check(s3_url, events)
