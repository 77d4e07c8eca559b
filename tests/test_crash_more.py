"""Crash campaign, part two: SIGKILL of gc, pull, copy and training-loop saves at random moments.

(``tests/test_crash.py`` kills pushes.) Each trial starts a real process on a fresh copy
of a prepared store, kills it with SIGKILL after a random delay (stratified over the
duration of an uncrashed run, so kills land early, midway and late), then checks:

* ``verify`` passes, and every live ref (every step snapshot) loads bit for bit;
* gc: objects a killed gc had condemned come back (the next gc recovers them), and a
  complete gc afterwards leaves no garbage;
* pull: the destination is absent or byte-identical to the checkpoint, never partial;
* copy: the destination verifies; the copy run again completes and transfers only what
  was left;
* training saves: the latest snapshot restores to exactly the state the run had at
  that step (hashes logged by the run before each save), and earlier snapshots too.

``CKPT_CRASH_TRIALS`` sets the number of trials per kind (default 3 here; the long mode
in benchmarks/results/hardening.md uses 25+). ``CKPT_CRASH_REPORT=FILE`` appends
one JSON line per trial for the results table.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs SIGKILL and fork")

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

import ckpt  # noqa: E402
from ckpt_store.storage.chunk_lists import referenced_chunks  # noqa: E402

TRIALS = int(os.environ.get("CKPT_CRASH_TRIALS_MORE", os.environ.get("CKPT_CRASH_TRIALS", "3")))
SEED = int(os.environ.get("CKPT_CRASH_SEED", "0"))
REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {**os.environ, "CKPT_CHUNK_SIZE": str(64 * 1024), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("CKPT_STORE", None)
    return env


def _cli_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "ckpt"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "cli.main"]


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _record(kind: str, **fields: object) -> None:
    path = os.environ.get("CKPT_CRASH_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")


def _delays(kind: str, duration: float) -> list[float]:
    slots = list(range(TRIALS))
    random.Random(f"{kind}-{SEED}").shuffle(slots)
    return [((slots[i] + random.Random(f"{kind}-{SEED}-{i}").random()) / TRIALS) ** 1.5 * 1.1 * duration
            for i in range(TRIALS)]


def _kill_after(cmd: list[str], delay: float, cwd: str | None = None) -> tuple[str, str]:
    """Run ``cmd``, SIGKILL it after ``delay`` s (unless done). Returns (outcome, stderr tail)."""
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
    try:
        p.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    if p.returncode == -signal.SIGKILL:
        return "killed", ""
    return ("finished" if p.returncode == 0 else f"failed ({p.returncode})"), err.decode(errors="replace")[-2000:]


def _timed(cmd: list[str]) -> float:
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return time.monotonic() - t0


def _garbage(store: ckpt.Store) -> list[str]:
    live: set[str] = set()
    for hist in store.refs_db.all_entries().values():
        for e in hist[:1] if hist[0].alias else hist:  # an alias keeps only its current target
            if e.target is None:
                break
            live.add(e.target)
    chunks: set[str] = set()
    for mid in live:
        chunks |= referenced_chunks(store.objects.get_manifest(mid))
    root = Path(store.backend.local_path("") or "")
    found = [str(p.relative_to(root)) for p in root.rglob(".tmp-*")]
    found += [o.id for o in store.objects.list("manifests") if o.id not in live]
    found += [o.id for o in store.objects.list("chunks") if o.id not in chunks]
    return found


# -- a store with refs to keep and refs to collect ---------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    """A store holding 6 live refs and 6 removed ones (aged: all collectable), with expected tensors."""
    root = tmp_path_factory.mktemp("prepared")
    url = str(root / "store")
    os.environ["CKPT_CHUNK_SIZE"] = str(64 * 1024)
    try:
        store = ckpt.Store.init(url)
        g = torch.Generator().manual_seed(99)
        want = {}
        base = {"emb": torch.randn(256, 256, generator=g), "w": torch.randn(512, 256, generator=g).to(torch.bfloat16)}
        for i in range(12):
            t = {k: (v + 0.01 * i * torch.randn(v.shape, generator=g).to(v.dtype)) for k, v in base.items()}
            t["own"] = torch.randn(64 * 1024, generator=g)
            ref = f"keep/{i}" if i % 2 == 0 else f"drop/{i}"
            store.push(t, ref)
            if i % 2 == 0:
                want[ref] = {k: _bits(v) for k, v in t.items()}
        for i in range(1, 12, 2):
            store.remove(f"drop/{i}")
        src = root / "big.safetensors"
        save_file({f"t{i}": torch.randn(256 * 1024, generator=g) for i in range(6)}, str(src))
        store.push(str(src), "file")
    finally:
        os.environ.pop("CKPT_CHUNK_SIZE", None)
    old = time.time() - 7200
    for p in (root / "store" / "objects").rglob("*"):
        os.utime(p, (old, old))
    return root, url, want, src.read_bytes()


def _fresh(prepared, dst: Path) -> str:
    shutil.copytree(prepared[1], dst)
    return str(dst)


def _check_store(url: str, want: dict[str, dict[str, bytes]], file_bytes: bytes, tmp: Path) -> list[str]:
    problems = []
    store = ckpt.Store.open(url)
    r = store.verify()
    if not r.ok:
        problems.append(f"verify: {r.problems[:3]}")
    for ref, tensors in want.items():
        got = store.load(ref)
        if {k: _bits(v) for k, v in got.items()} != tensors:
            problems.append(f"{ref} differs")
    out = tmp / f"check-{time.monotonic_ns()}.safetensors"
    store.pull("file", out)
    if out.read_bytes() != file_bytes:
        problems.append("file ref pulls different bytes")
    out.unlink()
    return problems


def test_sigkill_gc(prepared, tmp_path: Path) -> None:
    _, _, want, file_bytes = prepared
    calib = _fresh(prepared, tmp_path / "calib")
    duration = _timed([*_cli_cmd(), "--store", calib, "gc", "--grace", "0s"])
    assert _garbage(ckpt.Store.open(calib)) == []
    failures = []
    for i, delay in enumerate(_delays("gc", duration)):
        url = _fresh(prepared, tmp_path / f"t{i}")
        outcome, err = _kill_after([*_cli_cmd(), "--store", url, "gc", "--grace", "0s"], delay)
        problems = [f"gc {outcome}: {err}"] if outcome not in ("killed", "finished") else []
        condemned = len(list(Path(url).rglob(".tmp-gc-*")))
        problems += _check_store(url, want, file_bytes, tmp_path)  # a killed gc loses nothing live...
        rep = ckpt.Store.open(url).gc(grace_s=0)  # ...and the next one finishes its work
        left = _garbage(ckpt.Store.open(url))
        if left:
            problems.append(f"garbage after a complete gc: {left[:3]}")
        problems += _check_store(url, want, file_bytes, tmp_path)
        _record("gc", trial=i, delay=round(delay, 3), outcome=outcome, condemned_left=condemned,
                recovered=rep.recovered, problems=problems)
        if problems:
            failures.append((i, delay, outcome, problems))
        shutil.rmtree(url)
    assert not failures, failures


def test_sigkill_pull(prepared, tmp_path: Path) -> None:
    _, url, want, file_bytes = prepared
    before = sorted((str(p), p.stat().st_mtime_ns) for p in Path(url).rglob("*"))
    out = tmp_path / "out"
    out.mkdir()
    duration = _timed([*_cli_cmd(), "--store", url, "pull", "file", str(out / "calib.safetensors")])
    failures = []
    for i, delay in enumerate(_delays("pull", duration)):
        dest = out / f"t{i}.safetensors"
        outcome, err = _kill_after([*_cli_cmd(), "--store", url, "pull", "file", str(dest)], delay)
        problems = [f"pull {outcome}: {err}"] if outcome not in ("killed", "finished") else []
        if dest.exists() and dest.read_bytes() != file_bytes:
            problems.append("destination exists but differs (a partial pull was exposed)")
        if outcome == "finished" and not dest.exists():
            problems.append("pull finished but wrote nothing")
        _record("pull", trial=i, delay=round(delay, 3), outcome=outcome, complete=dest.exists(), problems=problems)
        if problems:
            failures.append((i, delay, outcome, problems))
    assert sorted((str(p), p.stat().st_mtime_ns) for p in Path(url).rglob("*")) == before, "pull modified the store"
    assert not failures, failures


# -- training-loop saves -----------------------------------------------------------------

TRAIN = r'''
import hashlib, json, sys, torch
torch.set_num_threads(1)
import ckpt
store, log_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
state = {"model": model, "optim": opt, "step": 0}

def digest():
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode()); h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for i, s in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{i}.{k}".encode()); h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

with ckpt.CheckpointManager(store, "run", keep_last=3, keep_every=4) as mgr, open(log_path, "w") as log:
    for step in range(1, steps + 1):
        x = torch.randn(32, 256)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        state["step"] = step
        log.write(json.dumps({"step": step, "digest": digest()}) + "\n"); log.flush()
        mgr.save(step, state)
'''


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(_bits(v))
    for i, s in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{i}.{k}".encode())
            h.update(_bits(v))
    return h.hexdigest()


def _fresh_state():
    torch.manual_seed(5)  # different from the run: only a real restore can match its digests
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(1, 256)).sum().backward()
    opt.step()  # optimizer state exists, to be overwritten in place
    return model, opt, {"model": model, "optim": opt, "step": 0}


@pytest.mark.slow
def test_sigkill_training_saves(tmp_path: Path) -> None:
    steps = 12
    calib = tmp_path / "calib"
    duration = _timed([sys.executable, "-c", TRAIN, str(calib), str(tmp_path / "calib.log"), str(steps)])
    failures = []
    for i, delay in enumerate(_delays("train", duration)):
        url, log = tmp_path / f"t{i}", tmp_path / f"t{i}.log"
        outcome, err = _kill_after([sys.executable, "-c", TRAIN, str(url), str(log), str(steps)], delay)
        problems = [f"training {outcome}: {err}"] if outcome not in ("killed", "finished") else []
        digests = {}
        if log.exists():
            for line in log.read_text().splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue  # the last line may be torn by the kill
                digests[e["step"]] = e["digest"]
        restored = None
        if url.exists():
            store = ckpt.Store.open(str(url))
            r = store.verify()
            if not r.ok:
                problems.append(f"verify: {r.problems[:3]}")
            snaps = sorted(int(n.rsplit("-", 1)[1]) for n in store.refs() if n.startswith("run/step-"))
            model, opt, state = _fresh_state()
            with ckpt.CheckpointManager(store, "run") as mgr:
                restored = mgr.restore_latest(state)
                if restored is not None:
                    # latest is written before the step ref: it may be one snapshot ahead
                    # of the step refs (killed in between), never behind them.
                    if (snaps and restored < max(snaps)) or state["step"] != restored:
                        problems.append(f"latest is step {restored}, snapshots {snaps}")
                    if _digest(model, opt) != digests.get(restored):
                        problems.append(f"step {restored} restored to a different state")
                for s in snaps:
                    model, opt, state = _fresh_state()
                    mgr.restore(state, s)
                    if _digest(model, opt) != digests.get(s):
                        problems.append(f"snapshot step {s} differs from the run at that step")
            if outcome == "finished" and restored != steps:
                problems.append(f"finished run restores step {restored}")
            store.gc(grace_s=0)
            if _garbage(store):
                problems.append("garbage left after gc")
        _record("train-save", trial=i, delay=round(delay, 3), outcome=outcome, restored_step=restored, problems=problems)
        if problems:
            failures.append((i, delay, outcome, problems))
    assert not failures, failures


@pytest.mark.slow
def test_sigkill_copy(prepared, tmp_path: Path) -> None:
    """A copy killed mid-way leaves a valid destination; run again, it sends only what is left."""
    _, url, want, file_bytes = prepared
    refs = [*sorted(want), "file"]

    def copy_cmd(dst: str) -> list[str]:
        return [*_cli_cmd(), "copy", *refs, "--from", url, "--to", dst, "--json"]

    calib = str(tmp_path / "calib")
    duration = _timed(copy_cmd(calib))
    full = json.loads(subprocess.run(copy_cmd(str(tmp_path / "calib2")), env=_env(), capture_output=True, text=True,
                                     timeout=600).stdout)
    failures = []
    for i, delay in enumerate(_delays("copy", duration)):
        dst = str(tmp_path / f"t{i}")
        outcome, err = _kill_after(copy_cmd(dst), delay)
        problems = [f"copy {outcome}: {err}"] if outcome not in ("killed", "finished") else []
        landed = 0
        if Path(dst, "ckpt-store.json").exists():
            store = ckpt.Store.open(dst)
            r = store.verify()
            if not r.ok:
                problems.append(f"verify after the kill: {r.problems[:3]}")
            for ref in store.refs():  # whatever ref landed is complete and bit-exact
                landed += 1
                if ref == "file":
                    out = tmp_path / f"c{i}.safetensors"
                    store.pull(ref, out)
                    if out.read_bytes() != file_bytes:
                        problems.append("file differs")
                    out.unlink()
                elif {k: _bits(v) for k, v in store.load(ref).items()} != want[ref]:
                    problems.append(f"{ref} differs")
        r1 = subprocess.run(copy_cmd(dst), env=_env(), capture_output=True, text=True, timeout=600)
        again = json.loads(r1.stdout) if r1.returncode == 0 else {}
        if r1.returncode != 0:
            problems.append(f"copy again failed: {r1.stderr[-500:]}")
        elif again["chunks_sent"] > full["chunks_sent"]:
            problems.append(f"resumed copy sent {again['chunks_sent']} chunks, a full copy sends {full['chunks_sent']}")
        problems += _check_store(dst, want, file_bytes, tmp_path) if r1.returncode == 0 else []
        r2 = subprocess.run(copy_cmd(dst), env=_env(), capture_output=True, text=True, timeout=600)
        if r2.returncode != 0 or json.loads(r2.stdout)["chunks_sent"] != 0:
            problems.append(f"a third copy sent something: {r2.stdout[-300:]}")
        _record("copy", trial=i, delay=round(delay, 3), outcome=outcome, refs_landed=landed,
                resumed_chunks=again.get("chunks_sent"), full_chunks=full["chunks_sent"], problems=problems)
        if problems:
            failures.append((i, delay, outcome, problems))
        shutil.rmtree(dst, ignore_errors=True)
    assert not failures, failures
