"""Merging four fine-tunes of all-MiniLM-L6-v2: time and peak memory per method, ckpt beside mergekit.

Run from the repository root, after ``python benchmarks/data.py`` (or with
``CKPT_BENCH_DATA`` pointing at its output)::

    . .venv/bin/activate
    python benchmarks/merge.py                                   # ckpt only
    python benchmarks/merge.py --mergekit /tmp/venv-mk/bin/python   # and mergekit

mergekit is never installed into the project's environment (it pins its own
dependencies and could replace torch); give the Python of a separate venv where
``pip install torch==2.13.0 && pip install mergekit`` worked. Without it, or when it
fails, the report says why.

What is measured, for each method (medians of ``--reps`` runs, interleaved):

* **ckpt**: ``ckpt.merge`` of the four fine-tunes (and the base where the method
  uses one) from a store that holds them as pushed (the fine-tunes delta-encoded
  against the base), the result pushed into that store (hash, delta-encode against
  the base, write, fsync). Each run gets its own hard-linked copy of the store, so no
  run dedups against another's result. One fresh process per run: wall time of the
  merge call, the process's peak RSS, and its peak RSS above what it held before the
  merge. The same again with glibc's mmap threshold fixed at 1 MiB
  (``MALLOC_MMAP_THRESHOLD_``), which hands every freed tensor straight back to the
  OS, so that RSS shows what the merge holds rather than what glibc keeps in its
  per-thread arenas.
* **mergekit**: ``mergekit-yaml`` on the same safetensors files (as Hugging Face
  directories with the shipped config.json), writing one safetensors file; wall
  time and peak RSS (VmHWM) of the process, and the time and peak RSS of a
  process that only imports mergekit, for reference. The outputs are compared with
  ckpt's tensor by tensor.

The report goes to stdout and ``benchmarks/results/merge.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
# Run as a script, Python puts benchmarks/ first on sys.path, where benchmarks/storage.py
# would shadow the ``storage`` package that ckpt imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
REPO = os.path.dirname(_HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MiB = 1 << 20
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "merge.md")
INPUTS = 4

# (label, ckpt method, ckpt params, mergekit method, mergekit per-model params, mergekit global params, inputs, uses base)
METHODS: list[tuple[str, str, dict[str, Any], str, dict[str, Any], dict[str, Any], int, bool]] = [
    ("linear", "linear", {}, "linear", {"weight": 1.0}, {}, INPUTS, False),
    ("task-arithmetic", "task-arithmetic", {}, "task_arithmetic", {"weight": 1.0}, {}, INPUTS, True),
    ("ties (density 0.2)", "ties", {"density": 0.2}, "ties", {"weight": 1.0, "density": 0.2}, {}, INPUTS, True),
    ("dare linear (density 0.5)", "dare", {"density": 0.5}, "dare_linear", {"weight": 1.0, "density": 0.5}, {"normalize": False}, INPUTS, True),
    ("dare ties (density 0.5)", "dare", {"density": 0.5, "combine": "ties"}, "dare_ties", {"weight": 1.0, "density": 0.5}, {}, INPUTS, True),
    ("slerp (t 0.5, 2 inputs)", "slerp", {"t": 0.5}, "slerp", {}, {"t": 0.5}, 2, False),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the data ----------------------------------------------------------------------------------


def minilm_files(data_dir: str | None) -> tuple[Path, list[Path]]:
    """The base and the first four (not held-out) fp32 fine-tunes, in the data script's order."""
    from benchmarks.data import FINE_TUNES, FP32_DIR, resolve_out

    root = resolve_out(data_dir) / FP32_DIR
    base = root / "base.safetensors"
    fts = [root / f"{spec.name}.safetensors" for spec in FINE_TUNES if not spec.heldout][:INPUTS]
    missing = [str(p) for p in [base, *fts] if not p.exists()]
    if missing:
        raise SystemExit(f"missing benchmark data: {', '.join(missing)}; run `python benchmarks/data.py` first")
    return base, fts


# -- ckpt runs (one child process each) --------------------------------------------------------

# Peak RSS from the process's own /proc/self/status: ru_maxrss would start at the RSS of the
# process that forked it (it survives fork and exec), here this benchmark's.
STATUS = """
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
"""

CHILD = STATUS + r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, ckpt
store = ckpt.Store.open(sys.argv[2])
spec = json.loads(sys.argv[3])
torch.ones(1 << 20).mul_(2)  # torch's allocator and thread pool are warm before the baseline
hwm0 = status("VmHWM:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS, so VmHWM below is the merge's own peak
rss0 = status("VmRSS:")
t = time.perf_counter()
r = ckpt.merge(store, spec["inputs"], spec["method"], name="bench/out", params=spec["params"], base=spec["base"])
seconds = time.perf_counter() - t
hwm1 = status("VmHWM:")
print(json.dumps({"seconds": seconds, "peak": max(hwm0, hwm1), "before": rss0, "merge_peak": hwm1,
                  "written": r.written_bytes, "merged": r.merged, "reused": r.reused}))
"""


def ckpt_run(store_dir: str, spec: dict[str, Any], fixed_threshold: bool, scratch: str) -> dict[str, Any]:
    copy = os.path.join(scratch, "run-store")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(store_dir, copy, copy_function=os.link)  # objects are immutable: links are a safe copy
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MiB)
    out = subprocess.run([sys.executable, "-c", CHILD, REPO, copy, json.dumps(spec)], capture_output=True,
                         text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- mergekit runs -----------------------------------------------------------------------------


def hf_dirs(scratch: str, files: list[Path]) -> list[str]:
    """Each safetensors file as a Hugging Face directory mergekit can read (config.json + weights)."""
    from benchmarks.data import shipped_model_dir

    out = []
    for f in files:
        d = os.path.join(scratch, "hf", f.stem)
        os.makedirs(d, exist_ok=True)
        shutil.copy(shipped_model_dir() / "config.json", os.path.join(d, "config.json"))
        link = os.path.join(d, "model.safetensors")
        if not os.path.lexists(link):
            os.symlink(f, link)
        out.append(d)
    return out


def mergekit_config(method: str, per_model: dict[str, Any], params: dict[str, Any], models: list[str], base: str | None) -> str:
    lines = [f"merge_method: {method}", "dtype: float32"]
    if base is not None:
        lines.append(f"base_model: {base}")
    lines.append("models:")
    for m in models:
        lines.append(f"  - model: {m}")
        if per_model:
            lines.append("    parameters: {" + ", ".join(f"{k}: {v}" for k, v in per_model.items()) + "}")
    if params:
        lines.append("parameters: {" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items()) + "}")
    return "\n".join(lines) + "\n"


def time_rss(cmd: list[str]) -> tuple[float, int, subprocess.CompletedProcess[str]]:
    """Wall seconds of ``cmd`` and the peak RSS (bytes) it reports as ``@@hwm`` on stderr (-1 if none)."""
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("@@hwm")), None)
    return wall, int(line.split()[1]) if line else -1, r


# mergekit 0.1.5 crashes on BertModel before merging anything: mergekit/plan.py concatenates a
# list and a tuple (``[w_in.name] + (w_in.aliases or [])``) for optional weights with aliases,
# here embeddings.position_ids. This runs mergekit-yaml with that one expression fixed in
# memory (``list(...)``); nothing else changes, and the unpatched failure is reported too.
MK_BUG = "[w_in.name] + (w_in.aliases or [])"
MK_WRAPPER = STATUS + f"""
import importlib.util, sys
import mergekit
spec = importlib.util.find_spec("mergekit.plan")
src = open(spec.origin).read()
if {MK_BUG!r} in src:
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mergekit.plan"] = mod
    exec(compile(src.replace({MK_BUG!r}, "[w_in.name] + list(w_in.aliases or [])"), spec.origin, "exec"), mod.__dict__)
from mergekit.scripts.run_yaml import main
sys.argv = ["mergekit-yaml", *sys.argv[1:]]
try:
    main()
finally:
    print("@@hwm", status("VmHWM:"), file=sys.stderr)
"""


def mergekit_run(python: str, config: str, scratch: str, patched: bool = True) -> tuple[float, int, str]:
    out = os.path.join(scratch, "mk-out")
    shutil.rmtree(out, ignore_errors=True)
    cfg = os.path.join(scratch, "mk.yaml")
    with open(cfg, "w") as f:
        f.write(config)
    cmd = [python, "-c", MK_WRAPPER] if patched else [os.path.join(os.path.dirname(python), "mergekit-yaml")]
    wall, rss, r = time_rss([*cmd, cfg, out, "--no-copy-tokenizer", "--no-write-model-card", "--quiet", "--random-seed", "0"])
    if r.returncode != 0:
        lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip() and not set(ln.strip()) <= set("~^")]
        tail = " | ".join(lines[-3:])
        raise RuntimeError(f"mergekit-yaml exited {r.returncode}: {tail[:400]}")
    return wall, rss, out


def compare(ours: dict[str, Any], theirs_dir: str) -> tuple[float, float, bool]:
    """(max |ckpt - mergekit|, that over max |ckpt|, bit-identical?) over the tensors both have."""
    import torch
    from safetensors.torch import load_file

    theirs: dict[str, torch.Tensor] = {}
    for f in sorted(Path(theirs_dir).glob("*.safetensors")):
        theirs.update(load_file(str(f)))
    worst, scale, same = 0.0, 0.0, True
    for name, t in ours.items():
        if name not in theirs or not t.is_floating_point():
            continue
        o = theirs[name].to(t.dtype)
        same = same and torch.equal(o.view(torch.int32), t.view(torch.int32))
        worst = max(worst, float((o.double() - t.double()).abs().max()))
        scale = max(scale, float(t.double().abs().max()))
    return worst, worst / scale if scale else 0.0, same


# -- the report --------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="benchmark data directory (default: $CKPT_BENCH_DATA, else ./bench-data)")
    ap.add_argument("--mergekit", metavar="PYTHON", help="the python of a venv where mergekit is installed")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    import ckpt

    started = time.perf_counter()
    base_file, ft_files = minilm_files(args.data)
    model_bytes = base_file.stat().st_size
    scratch = tempfile.mkdtemp(prefix="ckpt-merge-bench-")
    try:
        store_dir = os.path.join(scratch, "store")
        store = ckpt.Store.init(store_dir)
        log("pushing the base and four fine-tunes")
        store.push(str(base_file), "minilm/base")
        refs = []
        for f in ft_files:
            refs.append(f"minilm/{f.stem}")
            store.push(str(f), refs[-1])
        stored = store.du().stored
        largest = max(t.nbytes for t in store.manifest("minilm/base").tensors)

        mk_python = args.mergekit
        mk_note = None
        mk_dirs: list[str] = []
        mk_import_rss = None
        mk_import_s = 0.0
        mk_unpatched = None
        if mk_python:
            probe = subprocess.run([mk_python, "-c", "import torch, mergekit; from importlib.metadata import version; "
                                    "print(torch.__version__, version('mergekit'))"], capture_output=True, text=True)
            if probe.returncode != 0:
                mk_note = f"mergekit does not import from {mk_python}: {probe.stderr.strip().splitlines()[-1][:300]}"
                mk_python = None
            else:
                mk_versions = probe.stdout.strip()
                mk_dirs = hf_dirs(scratch, [base_file, *ft_files])
                mk_import_s, mk_import_rss, _ = time_rss([mk_python, "-c", STATUS + "import sys, mergekit.merge, mergekit.config, torch\n"
                                                          "print('@@hwm', status('VmHWM:'), file=sys.stderr)"])
                try:
                    mergekit_run(mk_python, mergekit_config("linear", {"weight": 1.0}, {}, mk_dirs[1:3], None), scratch, patched=False)
                    mk_unpatched = "runs unpatched"
                except RuntimeError as e:
                    mk_unpatched = str(e)
                log(f"mergekit unpatched: {mk_unpatched}")
        else:
            mk_note = "not run: no --mergekit python given"

        rows = []
        for label, method, params, mk_method, mk_per, mk_params, n, uses_base in METHODS:
            spec = {"inputs": refs[:n], "method": method, "params": params, "base": "minilm/base" if uses_base else None}
            runs: dict[str, list[Any]] = {"ckpt": [], "ckpt_fixed": [], "mk": []}
            error = None
            for rep in range(args.reps):
                log(f"{label}: run {rep + 1}/{args.reps}")
                runs["ckpt"].append(ckpt_run(store_dir, spec, False, scratch))
                runs["ckpt_fixed"].append(ckpt_run(store_dir, spec, True, scratch))
                if mk_python and error is None:
                    cfg = mergekit_config(mk_method, mk_per, mk_params, mk_dirs[1 : 1 + n], mk_dirs[0] if uses_base else
                                          (mk_dirs[1] if mk_method == "slerp" else None))
                    try:
                        runs["mk"].append(mergekit_run(mk_python, cfg, scratch))
                    except RuntimeError as e:
                        error = str(e)
            # the merged tensors of the last ckpt run against mergekit's last output
            diff = None
            if runs["mk"]:
                copy = ckpt.Store.open(os.path.join(scratch, "run-store"))
                diff = compare(copy.load("bench/out"), runs["mk"][-1][2])
            med = lambda xs: statistics.median(xs)  # noqa: E731
            c, cf = runs["ckpt"], runs["ckpt_fixed"]
            rows.append({
                "label": label, "inputs": n + (1 if uses_base else 0),
                "ckpt_s": med([r["seconds"] for r in c]), "ckpt_peak": med([r["peak"] for r in c]),
                "ckpt_above": med([r["merge_peak"] - r["before"] for r in c]),
                "ckpt_fixed_above": med([r["merge_peak"] - r["before"] for r in cf]),
                "ckpt_fixed_s": med([r["seconds"] for r in cf]),
                "written": c[-1]["written"], "merged": c[-1]["merged"], "reused": c[-1]["reused"],
                "mk_s": med([r[0] for r in runs["mk"]]) if runs["mk"] else None,
                "mk_peak": med([r[1] for r in runs["mk"]]) if runs["mk"] else None,
                "mk_error": error, "diff": diff,
            })
            log(f"{label}: {rows[-1]}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    total = time.perf_counter() - started
    report = render(rows, args, largest, model_bytes, stored, mk_python, mk_note, (mk_import_s, mk_import_rss),
                    mk_versions if mk_python else None, mk_unpatched, total)
    print(report)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    return 0


NOTES = """How to read it:

- *ckpt s* is the `ckpt.merge` call: reading every input from the store (decoding the
  fine-tunes' deltas against the base, re-hashing every chunk), the math, and pushing the
  result (hashing, delta-encoding against the base, durable writes). *mergekit s* is the
  whole `mergekit-yaml` process (imports included: see the import-only process above, one
  cold run), which reads plain safetensors files and writes one without fsync.
- Peak RSS is the process's own VmHWM (/proc/self/status); ru_maxrss would start at the RSS
  of the process that forked it. *ckpt peak above start* resets VmHWM just before the merge
  and subtracts the RSS then: what the merge adds. With glibc's defaults that includes freed
  blocks glibc keeps in its per-thread arenas (its mmap threshold rises to the size of the
  largest block freed, so later tensor-sized blocks come from arenas and stay mapped); ckpt
  calls `malloc_trim` between tensors, which helps but cannot reach inside one tensor's math.
  *same, mmap threshold 1 MiB* sets `MALLOC_MMAP_THRESHOLD_=1048576`, so every freed block
  goes straight back to the OS: that is what the merge holds, to be read against
  *(models read + 2) x largest*. It includes the push pipeline (a few 4 MiB chunks being
  fetched, encoded or waiting to be written: about 40 MiB here).
- linear, task arithmetic, dare with the linear combine and slerp stay within
  (models read + 2) x the largest tensor. TIES and dare with the ties combine go past it: for
  the largest tensor they hold the inputs, the scratch copy of the magnitudes that trimming
  partitions (ties), the sum of the task vectors, the per-element weight total and a few
  bit masks, about (models read + 3) x the tensor, plus the pipeline.
- *max |ckpt - mergekit|* compares the merged tensors. linear and task arithmetic follow
  the same formula; dare draws its random masks differently from mergekit, and mergekit's
  TIES keeps exactly int(density x n) entries where ckpt keeps every entry tied at the
  threshold, so those differ by design."""


def render(rows: list[dict[str, Any]], args: argparse.Namespace, largest: int, model_bytes: int, stored: int,
           mk_python: str | None, mk_note: str | None, mk_import: tuple[float, int | None], mk_versions: str | None,
           mk_unpatched: str | None, total: float) -> str:
    import torch

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# Merging four fine-tunes of all-MiniLM-L6-v2",
        "",
        f"Command: `python benchmarks/merge.py{' --mergekit PYTHON' if mk_python else ''}` (from the repository root)  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; whole run {total:.0f} s",
        "",
        f"- nproc {os.cpu_count()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"ckpt commit {commit}{' (with uncommitted changes)' if dirty else ''}; settings at their defaults; "
        f"load average at the end {os.getloadavg()[0]:.1f}",
        f"- inputs: the base and the first four fp32 fine-tunes of benchmarks/data.py (one model: {mib(model_bytes)} MiB, "
        f"104 tensors, the largest {mib(largest)} MiB: embeddings.word_embeddings.weight); the store holds all five in "
        f"{mib(stored)} MiB (fine-tunes delta-encoded against the base)",
        f"- medians of {args.reps} runs, methods and tools interleaved; every ckpt run is a fresh process merging from "
        "its own hard-linked copy of that store and pushing the result into it (delta-encoded against the base, fsynced)",
        "- mergekit: " + (f"{mk_versions} (torch, mergekit) from {mk_python}, in its own venv; `mergekit-yaml --no-copy-tokenizer "
                          f"--no-write-model-card --random-seed 0`, dtype float32, CPU, default threads; a process that only imports it "
                          f"takes {mk_import[0]:.1f} s and peaks at {mib(mk_import[1] or 0)} MiB. " + (
                              "It runs on these models as installed." if mk_unpatched == "runs unpatched" else
                              f"As installed it fails on these models ({mk_unpatched}); the numbers below run it with "
                              "that bug fixed in memory (MK_WRAPPER in this script)")
                          if mk_python else (mk_note or "not run")),
        "",
        "| method | models read | ckpt s | ckpt peak RSS MiB (process) | ckpt peak above start MiB | same, mmap threshold 1 MiB | (models read + 2) x largest MiB | mergekit s | mergekit peak RSS MiB | max \\|ckpt - mergekit\\| |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = (r["inputs"] + 2) * largest
        if r["diff"] is None:
            diff = "-"
        else:
            worst, rel, same = r["diff"]
            diff = ("identical bits" if same else "equal values (signs of zero differ)" if worst == 0
                    else f"{worst:.2e} ({rel:.1e} of max \\|w\\|)")
        mk = (f"{r['mk_s']:.2f}", mib(r["mk_peak"])) if r["mk_s"] is not None else (("failed", "-") if r["mk_error"] else ("-", "-"))
        lines.append(f"| {r['label']} | {r['inputs']} | {r['ckpt_s']:.2f} | {mib(r['ckpt_peak'])} | {mib(r['ckpt_above'])} | "
                     f"{mib(r['ckpt_fixed_above'])} | {mib(bound)} | {mk[0]} | {mk[1]} | {diff} |")
    lines += ["", NOTES]
    errors = [f"- {r['label']}: {r['mk_error']}" for r in rows if r["mk_error"]]
    if errors:
        lines += ["", "mergekit failures:", *errors]
    lines += ["", "Per method, ckpt computed / reused tensors and bytes written into the store:", ""]
    lines += [f"- {r['label']}: {r['merged']} computed, {r['reused']} reused unread, {mib(r['written'])} MiB written" for r in rows]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
