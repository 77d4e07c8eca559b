"""Past this machine, by simulation: the fraction of time lost to failures at 1k, 16k and 100k GPUs,
durable-only checkpoints against local + peer tiers, each at its best interval (Young/Daly).

Run from the repository root (pure arithmetic, no torch)::

    python benchmarks/restart_sim.py                 # prints the table
    python benchmarks/restart_sim.py --out benchmarks/results/restart_sim.md

What it assumes (every figure is a flag; the defaults are printed with the table):

* **Failures**: the system's mean time to failure falls with scale as M(N) = 8 h x (N/1024)^-0.729,
  the power law through the two published figures the issue cites: about 8 h at 1,024 GPUs and
  14 min at 131,072 (Meta, "Revisiting Reliability in Large-Scale ML Research Clusters", 2024).
  Failures are independent and exponential (memoryless), as Young's and Daly's analyses assume.
* **State**: 16 bytes per parameter (bf16 weights and gradients' master copy in fp32, Adam's two
  moments); the model grows with the cluster (70B at 1k, 405B at 16k, 2T at 100k GPUs) and is
  fully sharded, so each GPU holds state/N.
* **Save stall**: both schemes save asynchronously; training stalls only for the copy of the GPU's
  shard to pinned host memory (``--stage-gbps`` per GPU). One save is in flight at a time, so the
  interval is at least the time the save takes to land (its write time).
* **Durable store**: aggregate write and read bandwidth ``--durable-gbps`` shared by all GPUs (a
  large parallel file system or object store); a restart reads the whole state back from it.
* **Local tier**: each GPU's shard written to host memory at ``--local-gbps`` per GPU and sent to
  ``--replicas`` peers at ``--peer-gbps`` per GPU (network). The defaults are the figures measured by
  benchmarks/restart.py on a 2-core VM (benchmarks/results/restart.md, 1.2 GB state): far below a real
  node's memory and network bandwidth, so the checked-in results also show node-class figures.
  A restart reads from memory, a replaced node's ranks from a peer (the slower: it sets the restart).
  A failure that takes a rank and all its replicas (``--p-lost``) falls back to the durable store,
  which the local tier persists to in the background at its own best interval.
* **Restart overhead**: ``--restart-s`` seconds per failure on top of reading the state back
  (rescheduling, process start, communicator set-up), the same for both schemes.

Waste per unit time for a scheme with save stall C, interval t, expected age of the newest snapshot
at a failure t/2 + W (W: the time a save takes to land), and restart R: C/t + (t/2 + W + R)/M. The
best t is Daly's sqrt(2 C M) - C, but never below W (one save in flight). The tiered scheme pays that
with its local interval for the failures it covers and with its durable interval for the rest.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

GB = 1e9
SCALES = ((1024, 70e9), (16384, 405e9), (100_000, 2e12))


def mttf_s(n: int) -> float:
    """System MTTF in seconds at ``n`` GPUs: 8 h at 1,024, 14 min at 131,072, a power law between."""
    a = math.log((8 * 3600) / (14 * 60)) / math.log(131072 / 1024)
    return 8 * 3600 * (n / 1024) ** -a


def best_interval(stall: float, mttf: float, floor: float) -> float:
    """Daly's first-order optimum, never shorter than the time a save takes to land."""
    t = math.sqrt(2 * stall * mttf) - stall if stall < 2 * mttf else mttf
    return max(t, floor, 1e-9)


@dataclass(frozen=True)
class Outcome:
    interval_s: float
    restart_s: float
    waste: float  # fraction of time lost: save stalls + lost work + restarts
    durable_interval_s: float | None = None


def durable_only(n: int, params: float, a: argparse.Namespace) -> Outcome:
    m = mttf_s(n)
    state = 16 * params
    stall = state / n / (a.stage_gbps * GB)
    write = state / (a.durable_gbps * GB)
    restart = a.restart_s + state / (a.durable_gbps * GB)
    t = best_interval(stall, m, write)
    return Outcome(t, restart, stall / t + (t / 2 + write + restart) / m)


def tiered(n: int, params: float, a: argparse.Namespace) -> Outcome:
    m = mttf_s(n)
    state = 16 * params
    shard = state / n
    stall = shard / (a.stage_gbps * GB)
    write_local = shard / (a.local_gbps * GB) + a.replicas * shard / (a.peer_gbps * GB)
    restart_local = a.restart_s + max(shard / (a.local_gbps * GB), shard / (a.peer_gbps * GB))
    t_local = best_interval(stall, m, write_local)
    # the durable tier: persisted in the background (no stall of its own), for the failures the
    # local and peer tiers cannot serve, which come p_lost times as often
    write_d = state / (a.durable_gbps * GB)
    restart_d = a.restart_s + state / (a.durable_gbps * GB)
    t_d = best_interval(stall, m / a.p_lost, write_d)
    lost = (1 - a.p_lost) * (t_local / 2 + write_local + restart_local) + a.p_lost * (t_d / 2 + write_d + restart_d)
    return Outcome(t_local, restart_local, stall / t_local + lost / m, t_d)


def table(a: argparse.Namespace) -> str:
    rows = ["| GPUs | model | MTTF | scheme | interval | restart | time lost |", "|---|---|---|---|---|---|---|"]
    for n, params in SCALES:
        m = mttf_s(n)
        d, t = durable_only(n, params, a), tiered(n, params, a)
        rows.append(f"| {n:,} | {params / 1e9:g}B | {m / 60:.0f} min | durable only | {_dur(d.interval_s)} | "
                    f"{_dur(d.restart_s)} | {100 * d.waste:.1f}% |")
        rows.append(f"| | | | local + peer (+ durable every {_dur(t.durable_interval_s or 0)}) | {_dur(t.interval_s)} | "
                    f"{_dur(t.restart_s)} | {100 * t.waste:.1f}% |")
    return "\n".join(rows)


def _dur(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--durable-gbps", default="100,1000", help="durable store, aggregate GB/s (write = read); a table for each")
    ap.add_argument("--stage-gbps", type=float, default=25.0, help="GPU -> pinned host copy, GB/s per GPU")
    # defaults: measured by benchmarks/restart.py on a loaded 2-core VM (311 MB: local tier 1.63 s, peer over loopback gloo 5.17 s)
    ap.add_argument("--local-gbps", type=float, default=1.5, help="local tier write/read, GB/s per GPU")
    ap.add_argument("--peer-gbps", type=float, default=0.33, help="replication/restore from a peer, GB/s per GPU")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--p-lost", type=float, default=0.02, help="share of failures that take a rank and all its replicas")
    ap.add_argument("--restart-s", type=float, default=60.0, help="restart overhead besides reading the state")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    head = [
        "# Time lost to failures, by simulation: durable-only against local + peer tiers",
        "",
        f"Command: `{' '.join(['python benchmarks/restart_sim.py', *sys.argv[1:]])}` (from the repository root)",
        "",
        f"Assumptions (module docstring of `benchmarks/restart_sim.py`): staging copy {a.stage_gbps:g} GB/s per GPU; local tier "
        f"{a.local_gbps:g} GB/s per GPU; peers {a.peer_gbps:g} GB/s per GPU, {a.replicas} replica(s); {100 * a.p_lost:g}% of "
        f"failures lose a rank and its replicas; restart overhead {a.restart_s:g} s; 16 bytes of state per parameter, fully "
        "sharded; MTTF 8 h at 1,024 GPUs falling as (N/1024)^-0.729 (14 min at 131,072). Each scheme at its best interval "
        "(Daly, at least one save's write time).",
        "",
    ]
    body = []
    for gbps in (float(x) for x in str(a.durable_gbps).split(",")):
        a.durable_gbps = gbps
        body += [f"## Durable store at {gbps:g} GB/s aggregate (write = read)", "", table(a), ""]
    text = "\n".join(head + body + [
        "*interval*: between snapshots (the local one for the tiered scheme); *restart*: overhead plus reading "
        "the state back; *time lost*: save stalls + work since the newest snapshot + restarts, as a share of wall time.",
        "The first-order formulas assume the lost share is small: past ~20% read a figure as \"does not keep up\", not as a "
        "precise share. The durable bandwidths bracket a large parallel file system or object store; the restart overhead "
        "is the same for both schemes and bounds what tiers can save.",
        "",
    ])
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
