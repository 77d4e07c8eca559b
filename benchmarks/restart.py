"""Restart time: a fresh process to its training state restored, from each snapshot tier, beside torch.load.

Run from the repository root::

    . .venv/bin/activate
    python benchmarks/restart.py                  # ~25M-param GPT + AdamW (300 MB of state)
    python benchmarks/restart.py --params-m 100   # the 1.2 GB state of benchmarks/snapshot.py

It prints markdown tables and writes them, with the command, date and machine facts, to
``benchmarks/results/restart.md`` (``--out`` changes that).

One process trains a GPT-style decoder (benchmarks/models.py) with AdamW and saves the
same state ``{"model", "optim"}`` with each contender; restores then run in fresh child
processes (``--reps`` each, medians), each building the model and a fresh AdamW and
restoring into them, and checking the result bit for bit against the saved state:

* ``torch.load cold`` / ``warm``: ``torch.save`` of both state dicts into one file on local
  disk; cold evicts it from the page cache first (``POSIX_FADV_DONTNEED``), warm reads it once
  before; ``torch.load(weights_only=True)`` + ``load_state_dict``;
* ``ckpt durable cold`` / ``warm``: ``CheckpointManager.restore_latest`` from the durable store
  on local disk (cold: every chunk file evicted);
* ``ckpt local tier``: the same run with ``local=`` a tier under /dev/shm (host memory),
  whose newest snapshot is also in the durable store: every byte comes from the local tier;
* ``ckpt peer (gloo)``: two ranks (``process_group``, ``replicas=1``) saved local snapshots;
  rank 1's tier is wiped (a replaced machine) and both restart: rank 1's time, all its bytes
  from rank 0 over gloo on this machine's loopback (until ``restore_latest`` returns: the
  rank's tier then keeps what it fetched in the background, before its next save);
* with ``--s3``, the durable store in S3 (SeaweedFS on 127.0.0.1, started here as the tests
  start it, on the same cores): ``boto3 download + torch.load`` (TransferManager, 16 threads,
  8 MiB parts, into a file on local disk, then as above) beside ``ckpt durable S3``, a restore
  with an empty local tier and no chunk cache (a replaced machine), with the GETs it made.

``--device cuda`` puts the model and AdamW on the GPU (saves stage through pinned host memory,
restores copy into device tensors, ``torch.load`` maps to the device the tensors were saved on);
its run has no peer row (two ranks would need a GPU each). ``benchmarks/gpu_check.sh`` runs it.

Each restore row also gives the CPU seconds the restore took (every thread of its process): on a
shared machine they move much less with the others' load than its wall time. ``--only NAME``
(repeatable) restores only the rows named (the saves always run), for an A/B of one tier.

Saves: per tier, the time ``save`` blocks training and the background time per save, over
``--saves`` saves with one training step before each (local tier every step, persisted on
the last one: its persist time is the copy of the chunks the durable store lacked).
"""

from __future__ import annotations

import argparse
import datetime
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
from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

MB = 1e6
ROWS = ("torch.load cold", "torch.load warm", "ckpt durable cold", "ckpt durable warm", "ckpt local tier",
        "boto3 download + torch.load (S3)", "ckpt durable S3", "ckpt peer (gloo), rank 1")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the state (built the same way in every process) ------------------------------------------------
def build(params_m: float, device: str = "cpu"):
    import torch

    from benchmarks.models import GPTConfig, TinyGPT

    best = min(range(64, 2049, 64), key=lambda x: abs(_params(x) - params_m * 1e6))  # d_model, a multiple of 64
    cfg = GPTConfig(vocab_size=32000, d_model=best, n_layers=12, n_heads=best // 64, context=128)
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, opt


def _params(d: int) -> int:
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + 8 * d * d + 4 * d + d
    return 2 * 32000 * d + 128 * d + 12 * per_block + 2 * d


def train_step(model, opt, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (2, 65), generator=g).to(next(model.parameters()).device)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def digest(model, opt) -> str:
    import hashlib

    import torch

    def raw(v) -> bytes:
        return v.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes()

    h = hashlib.blake2b(digest_size=16)
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(raw(v))
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{i}.{k}".encode())
            h.update(raw(v))
    return h.hexdigest()


def cpu_s() -> float:
    """CPU seconds this process has used (every thread, user and system): on a shared machine a
    restore's wall time moves with the others' load, its CPU time much less."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def sync(device: str) -> None:
    """Wait for ``device``'s queued work, so that a time taken after it counts the restore's copies."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{device}: {torch.cuda.get_device_name(device)} (restores copy into device tensors; saves stage through pinned host memory)"
    return "the CPU"


def evict(path: Path) -> None:
    """Drop ``path`` (a file, or every file below a folder) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


# -- children ---------------------------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    """One fresh process: build, restore, report (JSON on stdout)."""
    t_start = float(args.t0)
    import torch

    import ckpt

    torch.set_num_threads(2)
    model, opt = build(args.params_m, args.device)
    sync(args.device)
    t_built, cpu_built = time.time(), cpu_s()
    t_restored = cpu_restored = None  # restore_latest returned: the state is restored (what follows is shutdown)
    report: dict = {}
    if args.mode == "torch.load":
        sd = torch.load(args.path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    elif args.mode == "boto3":
        import boto3
        from boto3.s3.transfer import TransferConfig

        bucket, _, key = args.path.removeprefix("s3://").partition("/")
        tc = TransferConfig(max_concurrency=16, multipart_chunksize=8 << 20, multipart_threshold=8 << 20)
        boto3.client("s3").download_file(bucket, key, args.local, Config=tc)
        sd = torch.load(args.local, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        os.unlink(args.local)
    elif args.mode in ("durable", "local"):
        mgr = ckpt.CheckpointManager(args.path, "bench", local=args.local if args.mode == "local" else None)
        gets = _count_gets(mgr.store) if args.path.startswith("s3://") else None
        step = mgr.restore_latest({"model": model, "optim": opt})
        sync(args.device)
        t_restored, cpu_restored = time.time(), cpu_s()
        assert step is not None
        report["tiers"] = mgr.last_restore
        if gets is not None:
            report["gets"] = gets[0]
        mgr.close()
    elif args.mode == "peer":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=2)
        if args.phase == "save":
            train_step(model, opt, 1)
        elif args.rank == 1:
            shutil.rmtree(os.path.join(args.local, "rank-1"), ignore_errors=True)  # a replaced machine
        dist.barrier()
        t_built, cpu_built = time.time(), cpu_s()
        mgr = ckpt.CheckpointManager(args.path, "bench", local=args.local, local_every_n_steps=1, replicas=1,
                                     process_group=dist.group.WORLD, timeout_s=600)
        if args.phase == "save":
            mgr.save(1, {"model": model, "optim": opt})
            mgr.wait()
        else:
            assert mgr.restore_latest({"model": model, "optim": opt}) == 1
            t_restored, cpu_restored = time.time(), cpu_s()
            report["tiers"] = mgr.last_restore
        mgr.close()
        dist.barrier()
    sync(args.device)
    t_done = t_restored if t_restored is not None else time.time()
    cpu_done = cpu_restored if cpu_restored is not None else cpu_s()
    report.update(restore_s=t_done - t_built, cpu_s=cpu_done - cpu_built, total_s=t_done - t_start, digest=digest(model, opt))
    print(json.dumps(report), flush=True)


def _count_gets(store) -> list[int]:
    """Count the GETs ``store``'s S3 backend makes from now on (every object: refs, manifests, chunks)."""
    n = [0]
    real = store.objects.backend._get

    def counting(*a, **k):
        n[0] += 1
        return real(*a, **k)

    store.objects.backend._get = counting
    return n


def start_s3(work: Path, state: dict, torch_file: Path) -> tuple[object, str, str, int]:
    """SeaweedFS on 127.0.0.1 (credentials and endpoint in this process's environment, which the
    children inherit; no chunk cache), holding the state as a ckpt snapshot and as ``torch_file``.
    Returns (the server, the store's URL, the torch file's URL, the snapshot's chunk count)."""
    sys.path[:0] = [str(ROOT / "tests")]
    import s3support

    import ckpt
    from benchmarks.s3 import start_seaweedfs

    (work / "seaweedfs").mkdir()
    server = start_seaweedfs(work / "seaweedfs")
    os.environ.update(AWS_ACCESS_KEY_ID=s3support.KEY, AWS_SECRET_ACCESS_KEY=s3support.SECRET,
                      AWS_ENDPOINT_URL=server.endpoint, AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true", CKPT_CACHE="0")
    bucket = server.new_bucket()
    url = f"s3://{bucket}/store"
    mgr = ckpt.CheckpointManager(url, "bench")
    mgr.save(1, state)
    mgr.wait()
    mgr.close()
    name, _, prefix = bucket.partition("/")
    key = f"{prefix}/state.pt" if prefix else "state.pt"
    s3support.client(server.endpoint).upload_file(str(torch_file), name, key)
    chunks = len(ckpt.Store.open(url).manifest("bench/latest").chunk_lengths())
    return server, url, f"s3://{name}/{key}", chunks


def spawn(args: argparse.Namespace, mode: str, path: Path | str, **kw) -> dict:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--path", str(path), "--params-m", str(args.params_m),
           "--device", args.device, "--t0", repr(time.time())]
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"{mode} child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def peer_restore(args: argparse.Namespace, work: Path, local: Path, phase: str) -> list[dict]:
    init = work / f"pg-{phase}-{time.time_ns()}"
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, __file__, "--child", "--mode", "peer", "--path", str(work / "peer-durable"), "--params-m",
               str(args.params_m), "--t0", repr(time.time()), "--local", str(local), "--rank", str(rank),
               "--init", str(init), "--phase", phase]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    out = []
    for p in procs:
        so, se = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"peer child failed:\n{se[-3000:]}")
        out.append(json.loads(so.strip().splitlines()[-1]))
    return out


# -- the run ----------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-m", type=float, default=25.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "restart.md"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--s3", action="store_true", help="also restore from a durable store in S3 (SeaweedFS on 127.0.0.1)")
    ap.add_argument("--device", default="cpu", help="where the model and optimizer live: cpu, or cuda (saves stage through "
                    "pinned host buffers, restores copy into device tensors; no peer rows: two ranks need a GPU each)")
    ap.add_argument("--only", action="append", help="restore only this row (a source's name in the table, e.g. "
                    "'ckpt local tier'; repeat for more); the saves always run")
    ap.add_argument("--child", action="store_true")
    for a in ("mode", "path", "t0", "local", "rank", "init", "phase"):
        ap.add_argument(f"--{a}")
    args = ap.parse_args()
    if args.child:
        if args.rank is not None:
            args.rank = int(args.rank)
        return child(args)
    only = None if args.only is None else set(args.only)
    if only is not None and not only <= set(ROWS):
        ap.error(f"--only: no row named {', '.join(sorted(only - set(ROWS)))}; rows: {', '.join(ROWS)}")

    import torch

    import ckpt

    t_run = time.time()
    # ckpt's bytecode written once, as an installed package's is: where PYTHONDONTWRITEBYTECODE is set
    # (this environment sets it), every fresh process would otherwise compile the modules it imports
    import compileall

    for d in ("ckpt", "storage"):
        compileall.compile_dir(str(ROOT / d), quiet=1)
    torch.set_num_threads(2)
    work = Path(args.work or tempfile.mkdtemp(prefix="ckpt-restart-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="ckpt-restart-", dir="/dev/shm"))
    model, opt = build(args.params_m, args.device)
    nparams = sum(p.numel() for p in model.parameters())
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in opt.state_dict()["state"].values() for v in s.values())
    log(f"GPT {nparams / 1e6:.1f}M params + AdamW: {state_bytes / MB:.0f} MB; work {work}, tier {shm}")

    # saves: durable only, then local tier every step persisted on the last
    saves: dict[str, list] = {"durable": [], "local": [], "persist": []}
    mgr = ckpt.CheckpointManager(str(work / "durable-only"), "bench")
    for i in range(1, args.saves + 1):
        train_step(model, opt, i)
        mgr.save(i, state)
        mgr.wait()
        saves["durable"].append((mgr.last_save.blocked_s, mgr.last_save.background_s))
    mgr.close()
    mgr = ckpt.CheckpointManager(str(work / "durable"), "bench", every_n_steps=args.saves, local=str(shm / "tier"),
                                 local_every_n_steps=1)
    for i in range(1, args.saves + 1):
        train_step(model, opt, 100 + i)
        mgr.maybe_save(i, state)
        mgr.wait()
        saves["local"].append((mgr.last_save.blocked_s, mgr.last_save.background_s))
    saves["persist"].append(mgr.last_persist)
    usage = mgr.local_tier
    mgr.close()
    want = digest(model, opt)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, work / "state.pt")
    server, s3_store, s3_file, s3_chunks = start_s3(work, state, work / "state.pt") if args.s3 else (None, "", "", 0)
    evict(work / "state.pt")
    log("saved; restoring in fresh processes")

    results: dict[str, list[dict]] = {}

    def runs(name: str) -> bool:
        return only is None or name in only

    def rec(name: str, r: dict) -> None:
        assert r["digest"] == want, f"{name}: restored state differs from the saved one"
        results.setdefault(name, []).append(r)
        log(f"{name}: restore {r['restore_s']:.3f} s ({r['cpu_s']:.3f} CPU-s), from process start {r['total_s']:.3f} s "
            f"{r.get('tiers', '')}")

    # Restores from a file on disk, its pages evicted first (cold) or read in (warm): row, kind, path.
    on_disk = [(f"{label} {temp}", kind, path, prepare) for label, kind, path in
               (("torch.load", "torch.load", work / "state.pt"), ("ckpt durable", "durable", work / "durable"))
               for temp, prepare in (("cold", evict), ("warm", warm))]
    for _ in range(args.reps):
        for name, kind, path, prepare in on_disk:
            if runs(name):
                prepare(path)
                rec(name, spawn(args, kind, path))
        if runs("ckpt local tier"):
            rec("ckpt local tier", spawn(args, "local", work / "durable", local=shm / "tier"))
        if server is not None and runs("boto3 download + torch.load (S3)"):
            rec("boto3 download + torch.load (S3)", spawn(args, "boto3", s3_file, local=work / "downloaded.pt"))
        if server is not None and runs("ckpt durable S3"):
            rec("ckpt durable S3", spawn(args, "durable", s3_store))
    if server is not None:
        server.stop()  # type: ignore[attr-defined]
    # peer: two ranks save once, then restart with rank 1's tier wiped (CPU state: with CUDA, each rank needs its own GPU)
    peer_local = shm / "peer"
    peers = args.device == "cpu" and runs("ckpt peer (gloo), rank 1")
    if peers:
        peer_restore(args, work, peer_local, "save")
    peer_want = None
    for _ in range(args.reps if peers else 0):
        r0, r1 = peer_restore(args, work, peer_local, "restore")
        peer_want = peer_want or r0["digest"]
        assert r1["digest"] == r0["digest"] == peer_want and r1["tiers"]["peer"] > 0 and r1["tiers"]["store"] == 0
        results.setdefault("ckpt peer (gloo), rank 1", []).append(r1)
        log(f"peer: rank 1 restore {r1['restore_s']:.3f} s {r1['tiers']}; rank 0 {r0['restore_s']:.3f} s")
        peer_restore_refill(args, work, peer_local)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    def ratio(r: float, base: str) -> str:
        return f"{r / med(base, 'restore_s'):.2f}x" if base in results else "-"

    lines = [
        "# Restart: a fresh process to its training state restored, per snapshot tier",
        "",
        f"Command: `{' '.join(shlex.quote(a) for a in ['python', 'benchmarks/restart.py', *sys.argv[1:]])}` (from the repository root)  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; whole run {time.time() - t_run:.0f} s",
        "",
        f"- nproc {os.cpu_count()}, {platform.platform()}; Python {platform.python_version()}, torch {torch.__version__}",
        f"- model and optimizer on {device_name(args.device)}",
        f"- state: GPT decoder {nparams / 1e6:.1f}M params + AdamW, fp32: {state_bytes / MB:.0f} MB; durable store on local disk "
        f"({work}), local tier in /dev/shm; {args.reps} restores each in fresh processes, medians",
        "- *restore*: from the model and a fresh AdamW built to the state restored (what a restart adds to building "
        "the model); *from process start*: includes the interpreter, `import torch` and building",
        "- every restore checked bit for bit against the saved state (parameters and optimizer moments)",
        "- ckpt's bytecode is compiled before the restores (`compileall`), as an installed package's is; torch's is in site-packages",
        "",
        "## Restore",
        "",
        "| source | restore s | restore CPU s | from process start s | vs torch.load cold | vs torch.load warm | bytes by tier (local / peer / store) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in results:
        r = med(name, "restore_s")
        tiers = results[name][-1].get("tiers")
        by = f"{tiers['local'] / MB:.0f} / {tiers['peer'] / MB:.0f} / {tiers['store'] / MB:.0f} MB" if tiers else "-"
        lines.append(f"| {name} | {r:.3f} | {med(name, 'cpu_s'):.3f} | {med(name, 'total_s'):.3f} | {ratio(r, 'torch.load cold')} | "
                     f"{ratio(r, 'torch.load warm')} | {by} |")
    # The baselines move between reps on this shared machine (torch.load warm 0.7-2.1 s in one run): each row's every
    # rep, and its fastest against the baselines' fastest, so that a ratio of medians is not read alone.
    def fastest(name: str) -> float:
        return min(r["restore_s"] for r in results[name])

    def fast_ratio(name: str, base: str) -> str:
        return f"{fastest(name) / fastest(base):.2f}x" if base in results else "-"

    lines += ["", "Every repetition (restore s, in the order run), and the fastest against the baselines' fastest:", "",
              "| source | reps s | fastest s | vs torch.load cold, fastest | vs torch.load warm, fastest |", "|---|---|---|---|---|"]
    for name in results:
        reps = " / ".join(f"{r['restore_s']:.3f}" for r in results[name])
        lines.append(f"| {name} | {reps} | {fastest(name):.3f} | {fast_ratio(name, 'torch.load cold')} | "
                     f"{fast_ratio(name, 'torch.load warm')} |")
    if server is not None and "ckpt durable S3" in results:  # (not run where --only leaves it out)
        gets = sorted({r["gets"] for r in results["ckpt durable S3"]})
        lines += ["", f"S3: SeaweedFS on 127.0.0.1 (same cores), no chunk cache. `ckpt durable S3` made "
                      f"{', '.join(map(str, gets))} GETs (refs, manifest, chunks) for a snapshot of {s3_chunks} chunks: "
                      "its small chunks come from the snapshot's bundle."]
    p = saves["persist"][0]
    lines += [
        "",
        f"## Saves ({args.saves} saves, one training step before each; medians)",
        "",
        "| tier | save blocks training s | background s per save |",
        "|---|---|---|",
        f"| durable store only (disk, fsync) | {statistics.median(b for b, _ in saves['durable']):.3f} | "
        f"{statistics.median(g for _, g in saves['durable']):.3f} |",
        f"| local tier (/dev/shm) | {statistics.median(b for b, _ in saves['local']):.3f} | "
        f"{statistics.median(g for _, g in saves['local']):.3f} |",
        f"| persist local -> durable (copy of missing chunks, background) | 0 | {p.seconds:.3f} "
        f"({p.chunks_sent} chunks, {p.bytes_sent / MB:.0f} MB sent; {p.chunks_present} present) |",
        "",
        f"Local tier after the saves: {len(usage.steps)} snapshots, {usage.bytes / MB:.0f} MB of host memory.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)
    shutil.rmtree(shm, ignore_errors=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def peer_restore_refill(args: argparse.Namespace, work: Path, local: Path) -> None:
    """After a restore with rank 1's tier wiped, save again so that the next repetition starts from the same tiers."""
    shutil.rmtree(local, ignore_errors=True)
    peer_restore(args, work, local, "save")


if __name__ == "__main__":
    main()
