"""2-rank distributed save/load: ckpt.dcp.Writer/Reader beside DCP's FileSystemWriter/Reader.

    python benchmarks/dcp.py [--layers 8] [--d-model 512] [--vocab 16384] [--dir /tmp] [--out benchmarks/results/dcp.md]

Two gloo ranks on the CPU shard a GPT decoder (benchmarks/models.py, TinyGPT) with FSDP2
and train it with AdamW; the state (model + optimizer, fp32, DCP ``get_state_dict``) is
about 500 MB at the defaults. Sequence, identical for both contenders:

1. one training step, then **save 1** of the state by each contender (ckpt into a fresh
   store as ref ``bench/state``; DCP into a fresh directory);
2. one more training step, then **save 2** (ckpt: the same ref, so unchanged chunks are
   deduplicated and, by default, changed ones delta-encoded against save 1 where smaller;
   "ckpt, no delta" is ``Writer(..., delta=False)``: dedup and compression only; DCP: a
   new directory);
3. **load** of save 2 into the live state (page cache warm), checked bit for bit against a
   copy taken at the save.

Times: wall seconds on rank 0 between two barriers (the save or load is done on every
rank); medians of ``--reps`` repetitions of the whole sequence. Bytes written: growth of
the store (ckpt) or the new directory (DCP), read from the file system after the save.
Both fsync what they write. ckpt uses its default Settings (compression kept where it
saves 2%), DCP its defaults (``thread_count=1`` per rank, ``torch.save`` format).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


CONTENDERS = ("ckpt", "ckpt_nodelta", "dcp")
LABELS = {"ckpt": "ckpt", "ckpt_nodelta": "ckpt, no delta", "dcp": "DCP FileSystemWriter"}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def rank_main(rank: int, world: int, args: argparse.Namespace, init: str, work: str, out: str) -> None:
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckpt.dcp
    from benchmarks.models import GPTConfig, TinyGPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=8, context=64)
    model = TinyGPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)

    def train_step() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=gen)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    def state():
        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def local_bits(sd) -> list[bytes]:
        out = []
        for v in (x for part in sd.values() for x in _leaves(part)):
            t = v.to_local() if hasattr(v, "to_local") else v
            if isinstance(t, torch.Tensor):
                out.append(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return out

    rows = []
    for rep in range(args.reps):
        where = {c: os.path.join(work, f"{c}-{rep}") for c in CONTENDERS}
        writers = {"ckpt": lambda save: ckpt.dcp.Writer(where["ckpt"], "bench/state"),
                   "ckpt_nodelta": lambda save: ckpt.dcp.Writer(where["ckpt_nodelta"], "bench/state", delta=False),
                   "dcp": lambda save: dcp.FileSystemWriter(f"{where['dcp']}/save-{save}")}
        readers = {"ckpt": lambda: ckpt.dcp.Reader(where["ckpt"], "bench/state"),
                   "ckpt_nodelta": lambda: ckpt.dcp.Reader(where["ckpt_nodelta"], "bench/state"),
                   "dcp": lambda: dcp.FileSystemReader(f"{where['dcp']}/save-2")}
        rec = {}
        for save in (1, 2):
            train_step()
            sd = state()
            for c in CONTENDERS:
                before = dir_bytes(where[c]) if rank == 0 and os.path.exists(where[c]) else 0
                rec[f"{c}_save{save}_s"] = timed(lambda: dcp.save(sd, storage_writer=writers[c](save)))
                rec[f"{c}_save{save}_bytes"] = (dir_bytes(where[c]) - before) if rank == 0 else 0
        saved = local_bits(sd)
        for name, reader in readers.items():
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().zero_()
            target = state()
            rec[f"{name}_load_s"] = timed(lambda: dcp.load(target, storage_reader=reader()))
            rec[f"{name}_exact"] = local_bits(target) == saved
        rec["state_bytes"] = sum(len(b) for b in saved)
        rows.append(rec)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def main() -> None:
    import json

    import torch
    import torch.multiprocessing as mp

    from ckpt.settings import Settings

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dcp.md"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="ckpt-bench-dcp-", dir=args.dir)
    t0 = time.time()
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    try:
        out = os.path.join(work, "results.json")
        mp.start_processes(rank_main, args=(2, args, os.path.join(work, "pg"), work, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            per_rank = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    reps = per_rank[0]
    exact = all(r[f"{n}_exact"] for ranks in per_rank for r in ranks for n in CONTENDERS)
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0] if not k.endswith("_exact")}
    state_mb = sum(ranks[0]["state_bytes"] for ranks in per_rank) / 1e6
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    lines = [
        "# Distributed saves: ckpt.dcp.Writer/Reader beside DCP's FileSystemWriter/Reader (2 gloo ranks, CPU)", "",
        f"Command: `{cmd}` (from the repository root)  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; whole run {time.time() - t0:.0f} s; "
        f"commit {commit}", "",
        f"- nproc {os.cpu_count()}, Python {platform.python_version()}, torch {torch.__version__}; work dir {args.dir}",
        "- **the machine was shared** with other engineers' builds and tests while this ran: absolute times are noisy; "
        "compare the two contenders within this run",
        f"- state: TinyGPT (vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers) + AdamW, FSDP2 over 2 ranks, "
        f"{state_mb:,.0f} MB of fp32 tensors; medians of {args.reps} repetitions", "",
        f"- ckpt settings: {Settings.from_env()}", "",
        "Method: the module docstring of `benchmarks/dcp.py`. MB = 10^6 bytes; ratios are against DCP's "
        "FileSystemWriter/Reader in the same run.", "",
        "| operation | contender | seconds | MB written | time vs DCP | bytes vs DCP |",
        "|---|---|---|---|---|---|",
    ]
    for label, key in (("save 1 (fresh)", "save1"), ("save 2 (after a training step)", "save2"), ("load of save 2 (warm)", "load")):
        for c in CONTENDERS:
            secs = med[f"{c}_{key}_s"]
            mb = med.get(f"{c}_{key}_bytes")
            ref_mb = med.get(f"dcp_{key}_bytes")
            lines.append(f"| {label} | {LABELS[c]} | {secs:.2f} | {'-' if mb is None else f'{mb / 1e6:,.1f}'} | "
                         f"{secs / med[f'dcp_{key}_s']:.2f}x | {'-' if mb is None else f'{mb / ref_mb:.2f}x'} |")
    lines += ["", f"Every load was bit-identical to the state saved: {'yes' if exact else 'NO'}.", ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
