"""Crash consistency: a real process pushing into a local store is SIGKILLed, then the store is checked.

The design promise (DESIGN.md, "Write order gives crash consistency"): chunks, then
manifest, then ref, each written atomically, so a crash at any point leaves at most
unreferenced objects, which ``gc`` removes. After every kill we run the store's own
``verify`` and pull every committed ref (every version of it) comparing *bytes* with
what was pushed to that ref; then ``ckpt gc --grace 0s`` must leave no temporaries and
no unreferenced objects, and the refs must still verify and pull bit-exact.

How the pushing processes are started: importing torch costs ~2.5 s here, which would
dominate a campaign of 20+ kills. So one helper process (``sys.executable -c``) imports
torch and ckpt once, single-threaded, and ``fork()``s a fresh pusher for each trial.
Each pusher is a real, separate process that the test SIGKILLs by pid; the helper only
reaps it after the kill (so the pid cannot be reused before the kill lands) and reports
its wait status.

Two kinds of crash:

* random: the kill lands after a random delay (seeded per trial, stratified over the
  measured duration of an uncrashed run so that kills land before the first ref, in the
  middle, and after the last one). ``CKPT_CRASH_TRIALS`` sets the number of trials
  (default 20), ``CKPT_CRASH_SEED`` the seed.
* injected: the pusher kills itself with SIGKILL at an exact write step (half-way
  through a chunk's temporary file, after a chunk is renamed in, before/after a
  manifest lands, before/after a ref entry is linked), so each phase is hit every run.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs fork, SIGKILL and /proc")

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

import ckpt  # noqa: E402
from ckpt_store.storage.chunk_lists import referenced_chunks  # noqa: E402
from ckpt_store.storage.errors import CkptError  # noqa: E402

CHUNK_SIZE = 1 << 20  # 1 MiB chunks in the pusher: more objects, more places to be killed
SPAN = 1.15  # random kills land in [0, SPAN * duration of an uncrashed run], denser early

# What one pusher does, in order: (kind, ref without the trial prefix, source name).
# Files share tensors (emb, layers.*), "moving" is pushed twice (a ref update), dict
# pushes go through the Python API with non-contiguous views added by the pusher.
ITEMS: list[tuple[str, str, str]] = [
    ("file", "file/base", "base.safetensors"),
    ("file", "file/ft1", "ft1.safetensors"),
    ("dict", "dict/d0", "dict0.safetensors"),
    ("hf", "hf/model", "hf"),
    ("file", "file/ft2", "ft2.safetensors"),
    ("file", "moving", "base.safetensors"),
    ("dict", "dict/d1", "dict1.safetensors"),
    ("file", "file/other", "other.safetensors"),
    ("file", "moving", "ft2.safetensors"),
]
KIND = {ref: kind for kind, ref, _ in ITEMS}

PUSHER = r'''
import json, os, signal, sys, threading, time, traceback

import torch  # noqa: F401 - imported once here; every forked pusher starts at once
from safetensors.torch import load_file
import ckpt.codecs.chunk, ckpt.format.manifest, ckpt.transfer.pipeline, ckpt.store.push, ckpt.store.sources, ckpt.store.store


def die():
    os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(1)


def arm(spec):
    """SIGKILL this process at the nth os.<fn> call whose target path contains spec["match"]."""
    lock = threading.Lock()
    seen = [0]

    def hit(path):
        if spec["match"] not in os.fspath(path).replace(os.sep, "/"):
            return False
        with lock:
            seen[0] += 1
            return seen[0] == spec["nth"]

    if spec["fn"] == "write":  # a torn temporary: half the bytes, then death
        real_write = os.write

        def write(fd, data):
            if hit(os.readlink(f"/proc/self/fd/{fd}")):
                view = memoryview(data).cast("B")
                real_write(fd, view[: len(view) // 2])
                die()
            return real_write(fd, data)

        os.write = write
        return
    real = getattr(os, spec["fn"])

    def wrapped(src, dst, *a, **k):
        if hit(dst):
            if spec["when"] == "before":
                die()
            real(src, dst, *a, **k)
            die()
        return real(src, dst, *a, **k)

    setattr(os, spec["fn"], wrapped)


def run(job):
    if job.get("inject"):
        arm(job["inject"])
    store = ckpt.store.store.Store.open(job["store"])
    for kind, ref, src in job["items"]:
        if kind == "dict":
            tensors = load_file(src)
            for k in sorted(tensors):
                if tensors[k].dim() == 2:
                    tensors[k + ".T"] = tensors[k].t()  # a non-contiguous view
            store.push(tensors, job["prefix"] + ref, metadata={"source": os.path.basename(src)})
        else:
            store.push(src, job["prefix"] + ref, message=os.path.basename(src))


out = sys.stdout
out.write("ready\n")
out.flush()
while True:
    line = sys.stdin.readline()
    if not line:
        break
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            run(job)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    out.write(f"pid {pid}\n")
    out.flush()
    sys.stdin.readline()  # "reap": the test has killed the pusher (or wants to wait for it)
    _, status = os.waitpid(pid, 0)
    out.write(f"status {status}\n")
    out.flush()
'''


# -- helpers ---------------------------------------------------------------------------


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the ``ckpt`` console script installed next to this interpreter."""
    exe = Path(sys.executable).parent / "ckpt"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "cli.main"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)


def tensor_bytes(t: Any) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class Sources:
    dir: Path
    files: dict[str, bytes] = field(default_factory=dict)  # file sources: exact bytes
    trees: dict[str, dict[str, bytes]] = field(default_factory=dict)  # hf dirs: path -> bytes
    dicts: dict[str, dict[str, tuple[Any, tuple[int, ...], bytes]]] = field(default_factory=dict)

    def path(self, name: str) -> str:
        return str(self.dir / name)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Sources:
    """Real safetensors files, a few MB each, sharing tensors with each other."""
    d = tmp_path_factory.mktemp("sources")
    g = torch.Generator().manual_seed(1234)

    def randn(*shape: int, dtype: Any = torch.float32) -> Any:
        return torch.randn(*shape, generator=g).to(dtype)

    emb = randn(512, 1024)  # 2 MiB, in base/ft1/ft2/dict1/hf
    l0 = randn(1024, 1024, dtype=torch.bfloat16)
    l1 = randn(768, 1024, dtype=torch.float16)
    l0_ft = l0.clone()
    l0_ft[:64] = randn(64, 1024, dtype=torch.bfloat16)  # only the first chunk changes
    l1_ft = l1.clone()
    l1_ft[700:] = randn(68, 1024, dtype=torch.float16)
    save_file({"emb": emb, "layers.0.weight": l0, "layers.1.weight": l1, "bias": randn(1024),
               "step": torch.tensor(1234, dtype=torch.int64)}, str(d / "base.safetensors"))
    save_file({"emb": emb, "layers.0.weight": l0_ft, "layers.1.weight": l1, "bias": randn(1024),
               "step": torch.tensor(2000, dtype=torch.int64)}, str(d / "ft1.safetensors"))
    save_file({"emb": emb, "layers.0.weight": l0_ft, "layers.1.weight": l1_ft,
               "q": torch.randint(-128, 127, (1000, 1000), generator=g, dtype=torch.int8),
               "empty": torch.empty(0, 8)}, str(d / "ft2.safetensors"), metadata={"format": "pt", "note": "ft2"})
    save_file({"x": randn(600, 1024), "mask": torch.rand(4096, generator=g) > 0.5},
              str(d / "other.safetensors"), metadata={"format": "pt"})
    save_file({"w": randn(768, 512), "h": randn(512, 1024, dtype=torch.bfloat16),
               "scalar": torch.tensor(3.25, dtype=torch.float64), "empty": torch.empty(0, 3, dtype=torch.float16),
               "flags": torch.rand(333, generator=g) > 0.3, "ids": torch.arange(1000, dtype=torch.int64)},
              str(d / "dict0.safetensors"))
    save_file({"emb": emb, "head": randn(256, 1024)}, str(d / "dict1.safetensors"))

    hf = d / "hf"
    hf.mkdir()
    shard1 = {"model.embed.weight": emb, "model.layers.0.weight": randn(512, 512)}
    shard2 = {"model.layers.1.weight": randn(512, 512), "lm_head.weight": randn(256, 512, dtype=torch.float16)}
    save_file(shard1, str(hf / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(shard2, str(hf / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in shard1}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in shard2})
    total = sum(t.numel() * t.element_size() for t in [*shard1.values(), *shard2.values()])
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (hf / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 512, "num_hidden_layers": 2}))

    src = Sources(d)
    for _, _, name in ITEMS:
        p = d / name
        if p.is_dir():
            src.trees[name] = tree_bytes(p)
        elif name.startswith("dict"):
            tensors = load_file(str(p))
            for k in sorted(tensors):
                if tensors[k].dim() == 2:
                    tensors[k + ".T"] = tensors[k].t()
            src.dicts[name] = {k: (t.dtype, tuple(t.shape), tensor_bytes(t)) for k, t in tensors.items()}
        else:
            src.files[name] = p.read_bytes()
    return src


class Pusher:
    """The helper process that forks one pusher per trial (see the module docstring)."""

    def __init__(self, workdir: Path) -> None:
        self.stderr_path = workdir / "pusher-stderr.txt"
        env = dict(os.environ)
        # Single-threaded until fork: OpenBLAS/OpenMP worker threads must not exist when
        # the helper forks, or a child could inherit a lock held by a thread it lacks.
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   CKPT_CHUNK_SIZE=str(CHUNK_SIZE))
        env.pop("CKPT_STORE", None)
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", PUSHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.running: int | None = None  # a pusher not yet reaped: its pid cannot be reused
        threading.Thread(target=self._pump, daemon=True).start()
        self._expect("ready", 120)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def stderr_tail(self, since: int = 0) -> str:
        with open(self.stderr_path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")[-4000:]

    def stderr_size(self) -> int:
        return self.stderr_path.stat().st_size

    def _expect(self, word: str, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"pusher helper silent for {timeout}s waiting for {word!r}: {self.stderr_tail()}") from None
        if line is None or not line.startswith(word):
            raise AssertionError(f"pusher helper said {line!r}, expected {word!r}: {self.stderr_tail()}")
        return line[len(word):].strip()

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def start(self, store: Path, prefix: str, src: Sources, inject: dict[str, Any] | None = None) -> int:
        job = {"store": str(store), "prefix": prefix, "inject": inject,
               "items": [[kind, ref, src.path(name)] for kind, ref, name in ITEMS]}
        self._send(json.dumps(job))
        self.running = int(self._expect("pid", 60))
        return self.running

    def reap(self, timeout: float = 120) -> int:
        """Let the helper wait for the pusher; its wait status."""
        self._send("reap")
        status = int(self._expect("status", timeout))
        self.running = None
        return status

    def close(self) -> None:
        if self.running is not None:  # a test failed mid-trial: do not leave a pusher behind
            os.kill(self.running, signal.SIGKILL)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def outcome(status: int) -> str:
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "finished"
    return f"failed (wait status {status})"


@pytest.fixture(scope="module")
def pusher(tmp_path_factory: pytest.TempPathFactory):
    p = Pusher(tmp_path_factory.mktemp("pusher"))
    yield p
    p.close()


def check_store(path: Path, src: Sources, work: Path) -> tuple[list[str], dict[str, int]]:
    """verify must be ok; every version of every ref must pull bit-exact.

    Returns (problems, committed pushes per trial prefix). Ref names are
    ``<prefix>/<ref in ITEMS>``; a ref pushed k times must hold k history entries, the
    i-th pointing at what the i-th push of that ref sent.
    """
    problems: list[str] = []
    store = ckpt.Store.open(str(path))
    report = store.verify()
    if not report.ok:
        problems.append(f"verify: {report.problems[:5]} damaged={sorted(report.damaged_refs)}")
    live = store.refs()
    if report.refs_checked != len(live):
        problems.append(f"verify checked {report.refs_checked} refs, store has {len(live)}")
    committed: dict[str, int] = defaultdict(int)
    per_prefix: dict[str, Counter[str]] = defaultdict(Counter)
    for name, history in store.refs_db.all_entries().items():
        prefix, _, rel = name.partition("/")
        pushed = [s for _, r, s in ITEMS if r == rel]
        if not pushed:
            problems.append(f"unexpected ref {name}")
            continue
        if name not in live:
            problems.append(f"{name} has history but is not live")
        if len(history) > len(pushed) or any(e.target is None for e in history):
            problems.append(f"{name}: history {[(e.seq, e.target) for e in history]} for {len(pushed)} pushes")
            continue
        committed[prefix] += len(history)
        per_prefix[prefix][rel] = len(history)
        for version, entry in enumerate(reversed(history)):
            assert entry.target is not None
            try:
                bad = compare(store, entry.target, KIND[rel], pushed[version], src, work)
            except CkptError as e:
                bad = f"{type(e).__name__}: {e}"
            if bad:
                problems.append(f"{name} (push {version + 1}, {pushed[version]}): {bad}")
    for prefix, n in committed.items():
        # One pusher pushes in order, so what committed is the first n items.
        expected = Counter(r for _, r, _ in ITEMS[:n])
        if per_prefix[prefix] != expected:
            problems.append(f"{prefix}: committed {dict(per_prefix[prefix])}, not the first {n} pushes")
    return problems, dict(committed)


def compare(store: Any, mid: str, kind: str, name: str, src: Sources, work: Path) -> str | None:
    """None if checkpoint ``mid`` holds exactly the bytes of source ``name``, else what differs."""
    dest = work / f"pull-{uuid.uuid4().hex[:8]}"
    try:
        if kind == "file":
            store.pull(mid, dest)
            got = dest.read_bytes()
            if got != src.files[name]:
                return f"pulled {len(got)} bytes differ from the {len(src.files[name])} pushed"
        elif kind == "hf":
            store.pull(mid, dest)
            got_tree, want = tree_bytes(dest), src.trees[name]
            if got_tree != want:
                diff = sorted(k for k in set(got_tree) | set(want) if got_tree.get(k) != want.get(k))
                return f"pulled directory differs in {diff}"
        else:
            tensors = store.load(mid)
            want_t = src.dicts[name]
            if sorted(tensors) != sorted(want_t):
                return f"tensor names {sorted(tensors)} != {sorted(want_t)}"
            for k, t in tensors.items():
                dtype, shape, data = want_t[k]
                if t.dtype != dtype or tuple(t.shape) != shape or tensor_bytes(t) != data:
                    return f"tensor {k}: {t.dtype}{list(t.shape)} vs {dtype}{list(shape)}, bytes equal: {tensor_bytes(t) == data}"
        return None
    finally:
        if dest.is_dir():
            shutil.rmtree(dest)
        elif dest.exists():
            dest.unlink()


def garbage(path: Path) -> list[str]:
    """Leftovers a crash may leave: temporaries anywhere, and objects no ref needs."""
    store = ckpt.Store.open(str(path))
    found = sorted(p.relative_to(path).as_posix() for p in path.rglob(".tmp-*"))
    live_manifests: set[str] = set()
    for history in store.refs_db.all_entries().values():
        if history[0].target is not None:  # live ref: its whole history is kept (gc's default)
            live_manifests.update(e.target for e in history if e.target is not None)
    live_chunks: set[str] = set()
    for mid in live_manifests:
        live_chunks |= referenced_chunks(store.objects.get_manifest(mid))
    found += [f"unreferenced manifest {o.id}" for o in store.objects.list("manifests") if o.id not in live_manifests]
    found += [f"unreferenced chunk {o.id}" for o in store.objects.list("chunks") if o.id not in live_chunks]
    return found


def gc_and_check(path: Path, src: Sources, work: Path) -> list[str]:
    """``ckpt gc --grace 0s``, then: no garbage left, verify ok, refs pull bit-exact."""
    r = cli("--store", str(path), "gc", "--grace", "0s", "--json")
    if r.returncode != 0:
        return [f"ckpt gc exited {r.returncode}: {r.stderr.strip()}"]
    problems = [f"left after gc: {g}" for g in garbage(path)]
    p, _ = check_store(path, src, work)
    return problems + p


# -- random kills ----------------------------------------------------------------------


@dataclass
class Trial:
    index: int
    delay: float
    outcome: str
    committed: int
    store: Path
    problems: list[str]


@dataclass
class Campaign:
    duration: float  # of one uncrashed run
    trials: list[Trial]
    stores: list[Path]


@pytest.fixture(scope="module")
def campaign(pusher: Pusher, sources: Sources, tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    root = tmp_path_factory.mktemp("campaign")
    work = root / "work"
    work.mkdir()

    # Two uncrashed runs into fresh stores: the baseline, and (the second, warm one) how
    # long a whole run takes.
    for run in ("calibration-cold", "calibration"):
        calib = root / run
        ckpt.Store.init(str(calib))
        t0 = time.monotonic()
        pusher.start(calib, "t00/", sources)
        status = pusher.reap()
        duration = time.monotonic() - t0
        assert outcome(status) == "finished", pusher.stderr_tail()
        problems, committed = check_store(calib, sources, work)
        assert not problems, problems
        assert committed == {"t00": len(ITEMS)}

    n = int(os.environ.get("CKPT_CRASH_TRIALS", "20"))
    seed = int(os.environ.get("CKPT_CRASH_SEED", "0"))
    slots = list(range(n))
    random.Random(f"ckpt-crash-slots-{seed}").shuffle(slots)
    trials: list[Trial] = []
    stores: list[Path] = []
    for i in range(n):
        # Stratified: trial i lands somewhere in its own slice of [0, 1], squared so that
        # more kills land early, where the first ref has not landed yet (a few tens of ms).
        rng = random.Random(f"ckpt-crash-{seed}-{i}")
        delay = ((slots[i] + rng.random()) / n) ** 2 * SPAN * duration
        # Two trials per store: the second pushes over the first one's leftovers.
        store = root / f"store{i // 2}"
        if i % 2 == 0:
            ckpt.Store.init(str(store))
            stores.append(store)
        before = {f"t{i:02d}": trials[-1].committed} if i % 2 and trials[-1].committed else {}
        err_at = pusher.stderr_size()
        prefix = f"t{i + 1:02d}"
        pid = pusher.start(store, prefix + "/", sources)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # not yet reaped by the helper: the pid is still ours
        result = outcome(pusher.reap())
        problems, committed = check_store(store, sources, work)
        if result not in ("killed", "finished"):
            problems.append(f"pusher {result}: {pusher.stderr_tail(err_at)}")
        if result == "finished" and committed.get(prefix, 0) != len(ITEMS):
            problems.append(f"pusher finished but committed {committed.get(prefix, 0)} of {len(ITEMS)} pushes")
        for p, k in before.items():
            if committed.get(p) != k:
                problems.append(f"earlier trial {p} had {k} commits, now {committed.get(p)}")
        trials.append(Trial(i + 1, delay, result, committed.get(prefix, 0), store, problems))
    print(f"\ncrash campaign: uncrashed run {duration:.2f}s; (delay s, outcome, committed/{len(ITEMS)}) per trial:")
    for t in trials:
        print(f"  t{t.index:02d} {t.delay:5.2f}s {t.outcome:8s} {t.committed}")
    return Campaign(duration, trials, stores)


@pytest.mark.slow
def test_random_sigkill_leaves_a_consistent_store(campaign: Campaign) -> None:
    bad = {f"t{t.index:02d} (delay {t.delay:.3f}s, {t.outcome})": t.problems for t in campaign.trials if t.problems}
    assert not bad, bad
    counts = [t.committed for t in campaign.trials]
    if len(counts) >= 10:  # with fewer trials the stratified delays cannot promise every phase
        assert 0 in counts, f"no trial was killed before its first ref landed: {counts}"
        assert any(0 < c < len(ITEMS) for c in counts), f"no trial was killed mid-way: {counts}"


@pytest.mark.slow
def test_gc_after_random_crashes_frees_garbage_and_keeps_refs(campaign: Campaign, sources: Sources, tmp_path: Path) -> None:
    before = {s.name: garbage(s) for s in campaign.stores}
    problems = {s.name: gc_and_check(s, sources, tmp_path) for s in campaign.stores}
    assert not {k: v for k, v in problems.items() if v}, problems
    # Not vacuous: the crashes did leave something for gc to remove.
    assert any(before.values()), before


# -- kills at exact write steps ----------------------------------------------------------

# (os function, path fragment, nth matching call, before/after the call, pushes committed)
INJECTIONS = {
    "torn-chunk-temp": ("write", "/objects/chunks/", 1, "during", 0),
    "after-3rd-chunk-lands": ("link", "/objects/chunks/", 3, "after", 0),  # a chunk takes its name by link()
    "before-2nd-manifest": ("replace", "/objects/manifests/", 2, "before", 1),
    "after-2nd-manifest": ("replace", "/objects/manifests/", 2, "after", 1),
    "before-2nd-ref-link": ("link", "/refs/", 2, "before", 1),
    "after-2nd-ref-link": ("link", "/refs/", 2, "after", 2),
    "before-ref-update": ("link", "/refs/", len(ITEMS), "before", len(ITEMS) - 1),
}


@pytest.mark.parametrize("case", sorted(INJECTIONS))
def test_sigkill_at_write_step(case: str, pusher: Pusher, sources: Sources, tmp_path: Path) -> None:
    fn, match, nth, when, expect_committed = INJECTIONS[case]
    store = tmp_path / "store"
    ckpt.Store.init(str(store))
    err_at = pusher.stderr_size()
    pusher.start(store, "t/", sources, inject={"fn": fn, "match": match, "nth": nth, "when": when})
    result = outcome(pusher.reap())
    assert result == "killed", f"{result}: {pusher.stderr_tail(err_at)}"

    problems, committed = check_store(store, sources, tmp_path)
    assert not problems, problems
    assert committed.get("t", 0) == expect_committed
    left = garbage(store)
    assert left, "the crash left nothing behind: the injection did not hit a write in progress"
    if when != "after" or fn == "link":
        assert any(".tmp-" in g for g in left), left

    problems = gc_and_check(store, sources, tmp_path)
    assert not problems, problems
