"""How deep may delta chains grow? Stored bytes vs restore time, training snapshots.

One training run (the GPT + AdamW of benchmarks/snapshot.py, smaller), snapshotted every
``--every`` steps into one store per ``max_delta_depth`` setting, with delta encoding on
(``CheckpointManager(delta_vs_previous=True)``): each snapshot is tried as a delta against the
previous one, and a chunk whose base chain is already ``max_delta_depth`` long is stored
whole (a keyframe). Same states for every setting. Reported per setting: bytes stored
over all snapshots, bytes of the later snapshots relative to the first, and the time to
restore the last snapshot into the live model and optimizer (median of 3, page cache
warm), which pays for decoding its chain.

    python benchmarks/delta_depth.py            # writes benchmarks/results/delta_depth.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from snapshot import Training, gpt_config  # noqa: E402

import ckpt  # noqa: E402
from ckpt.settings import Settings  # noqa: E402

DEPTHS = [0, 1, 2, 4, 8, 16]


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "objects").rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-m", type=float, default=15.0, help="model size, millions of parameters")
    ap.add_argument("--snapshots", type=int, default=17)
    ap.add_argument("--every", type=int, default=5, help="training steps between snapshots")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "delta_depth.md"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    t_start = time.time()
    tr = Training.build(gpt_config(args.params_m))
    root = Path(tempfile.mkdtemp(prefix="ckpt-depth-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    mgrs = {}
    for d in DEPTHS:
        settings = Settings.from_env(min_saving=0.10, max_delta_depth=d, fsync=False)
        store = ckpt.Store.init(str(root / f"depth{d}"), settings=settings)
        mgrs[d] = ckpt.CheckpointManager(store, "run", save_mode="sync", delta_vs_previous=d > 0)
    sizes: dict[int, list[int]] = {d: [] for d in DEPTHS}
    state = {"model": tr.model, "optim": tr.opt}
    for i in range(args.snapshots):
        for _ in range(args.every):
            tr.train_step()
        for d, mgr in mgrs.items():
            before = du(root / f"depth{d}")
            mgr.save(tr.step, state)
            sizes[d].append(du(root / f"depth{d}") - before)
        print(f"snapshot {i + 1}/{args.snapshots} at step {tr.step}: " +
              ", ".join(f"d{d} {sizes[d][-1] / 1e6:.1f} MB" for d in DEPTHS), flush=True)
    want = {k: v.detach().clone() for k, v in tr.tensors().items()}
    restore: dict[int, float] = {}
    depth_of_last: dict[int, int] = {}
    for d, mgr in mgrs.items():
        times = []
        for _ in range(3):
            with torch.no_grad():
                for p in tr.model.parameters():
                    p.zero_()
            t0 = time.perf_counter()
            mgr.restore(state, tr.step)
            times.append(time.perf_counter() - t0)
        got = tr.tensors()
        assert all(torch.equal(got[k].view(torch.uint8) if got[k].dim() else got[k], want[k].view(torch.uint8) if want[k].dim() else want[k]) for k in want), d
        restore[d] = statistics.median(times)
        m = mgr.store.manifest(f"run/step-{tr.step}")
        depth_of_last[d] = max((len(c) for t in m.tensors for c in t.chains()), default=0)
        mgr.close()
    state_mb = tr.state_bytes() / 1e6
    lines = [
        "# Delta chain depth: stored bytes vs restore time (training snapshots)",
        "",
        f"Command: `python benchmarks/delta_depth.py --params-m {args.params_m:g} --snapshots {args.snapshots} --every {args.every}`  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; run took {time.time() - t_start:.0f} s; "
        f"commit {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}; "
        f"{os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}",
        "",
        f"State: {tr.describe()}. {args.snapshots} snapshots, {args.every} training steps apart, saved with "
        "`CheckpointManager(delta_vs_previous=True)` into a store in /dev/shm (no fsync) per setting; restore = `restore(state, last step)` "
        "into the live model and optimizer, median of 3, every hash verified, result compared bit for bit.",
        "",
        "| max_delta_depth | stored, all snapshots (MB) | vs depth 0 | mean later snapshot / first | deepest chain in last snapshot | restore last (s) | vs depth 0 |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in DEPTHS:
        total = sum(sizes[d])
        later = statistics.mean(sizes[d][1:]) / sizes[d][0]
        lines.append(f"| {d} | {total / 1e6:,.0f} | {total / sum(sizes[0]):.3f} | {later:.3f} | {depth_of_last[d]} | "
                     f"{restore[d]:.3f} | {restore[d] / restore[0]:.2f}x |")
    lines += ["", f"State size {state_mb:,.0f} MB per snapshot before compression.", ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
