"""Past this machine, by simulation: the fraction of a large job's time lost to failures,
with durable-only checkpoints against local + peer tiers, each at its best interval.

    python benchmarks/restart_sim.py [--state-gb 10] [--markdown benchmarks/results/restart_sim.md]

Model (first order, Young/Daly). A job of N GPUs fails as a whole whenever one of them
fails; failures are a Poisson process with system MTBF ``M = M_gpu / N``. Checkpoints are
taken every ``tau`` seconds; each blocks training for ``delta`` (the staging copy into host
memory). A failure loses on average ``tau / 2`` of work, then pays the restart ``R``:
a fixed part ``T0`` (rescheduling, process start, collective init) plus reading the
state back. The expected fraction of time lost is

    waste(tau) = delta / tau + (tau / 2 + R) / M

minimised at ``tau* = sqrt(2 * delta * M)`` (Young), but never below the time one
background save needs to finish (a save cannot start before the previous one is on its
tier): ``tau >= S / write_bandwidth``.

* **Durable only.** Every rank writes and reads its state ``S`` through the shared
  store, whose aggregate bandwidth ``B_agg`` is split among the N ranks.
* **Tiers.** Snapshots go to host memory every ``tau_l`` and are replicated to a peer;
  the durable store gets one as often as its bandwidth allows, in the background (no
  stall). After a failure, surviving ranks read their local tier and the replaced rank
  reads its replica over the network, so ``R = T0 + S / min(B_local, B_peer)``. With
  probability ``p_corr`` a failure also takes the replica (a correlated failure: a rack,
  a switch); then the job falls back to the newest durable snapshot.

The per-rank rates default to what benchmarks/results/snapshot.md measured on this
machine (2 cores): staging copy 1.2 GB in 0.104 s; ckpt restore from memory-backed
files 3.44 GB/s warm; background encode + write 1.2 GB in 2.82 s. Everything else is an
assumption, printed with the table.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

GB = 1e9

# Published failure rates, as GPU-hours between failures of one GPU's share of a job.
FAILURE_MODELS = {
    # Meta RSC-1, "Revisiting Reliability in Large-Scale ML Research Clusters" (2024):
    # mean time to failure 7.9 h for 1,024-GPU jobs.
    "RSC-1: MTTF 7.9 h at 1,024 GPUs": 7.9 * 1024,
    # Llama 3 (2024): 419 unexpected interruptions in 54 days of training on 16,384 GPUs.
    "Llama 3: 419 interruptions in 54 days at 16,384 GPUs": 54 * 24 / 419 * 16384,
}


@dataclass(frozen=True)
class Rates:
    state_gb: float  # state one rank restores (its shard of parameters + optimizer state)
    stage_gbps: float  # blocking copy into host memory (the save's stall)
    local_read_gbps: float  # restore from the node-local tier (memory-backed)
    local_write_gbps: float  # background encode + write into the local tier
    peer_gbps: float  # restore of a replica from a peer over the network
    node_durable_gbps: float  # one rank's link to the durable store, at best
    durable_agg_gbps: float  # the durable store's aggregate bandwidth, shared by all ranks
    restart_fixed_s: float  # rescheduling, process start, collective init
    p_corr: float  # fraction of failures that also lose the replica


@dataclass(frozen=True)
class Plan:
    interval_s: float
    restart_s: float
    waste: float


def best(delta: float, m: float, floor: float, lost: float) -> tuple[float, float]:
    """(tau, waste) minimising delta/tau + (tau/2)/m * share + lost/m, with tau >= floor."""
    tau = max(math.sqrt(2 * delta * m), floor)
    return tau, delta / tau + tau / 2 / m + lost / m


def durable_only(r: Rates, n: int, m: float) -> Plan:
    bw = min(r.node_durable_gbps, r.durable_agg_gbps / n) * GB
    s = r.state_gb * GB
    restart = r.restart_fixed_s + s / bw
    tau, waste = best(s / (r.stage_gbps * GB), m, s / bw, restart)
    return Plan(tau, restart, min(waste, 1.0))


def tiered(r: Rates, n: int, m: float) -> Plan:
    s = r.state_gb * GB
    durable_bw = min(r.node_durable_gbps, r.durable_agg_gbps / n) * GB
    tau_d = s / durable_bw  # persisted as often as the store's bandwidth allows, off the critical path
    restart_t = r.restart_fixed_s + s / (min(r.local_read_gbps, r.peer_gbps) * GB)
    restart_d = r.restart_fixed_s + s / durable_bw
    delta = s / (r.stage_gbps * GB)
    # Failures the tiers survive lose tau_l/2; the correlated ones lose tau_d/2 and read the store.
    m_eff = m / (1 - r.p_corr)
    tau_l = max(math.sqrt(2 * delta * m_eff), s / (r.local_write_gbps * GB))
    waste = delta / tau_l + ((1 - r.p_corr) * (tau_l / 2 + restart_t) + r.p_corr * (tau_d / 2 + restart_d)) / m
    return Plan(tau_l, (1 - r.p_corr) * restart_t + r.p_corr * restart_d, min(waste, 1.0))


def table(r: Rates, sizes: list[int]) -> str:
    lines = []
    for label, gpu_hours in FAILURE_MODELS.items():
        lines += [f"### {label} (one GPU's share fails every {gpu_hours:,.0f} h)", "",
                  "| GPUs | job MTBF | durable only: interval | restart | **time lost** | tiers: local interval | restart (expected) | **time lost** | lost, tiers vs durable |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for n in sizes:
            m = gpu_hours * 3600 / n
            d, t = durable_only(r, n, m), tiered(r, n, m)
            lines.append(f"| {n:,} | {_dur(m)} | {_dur(d.interval_s)} | {_dur(d.restart_s)} | **{d.waste:.1%}** | "
                         f"{_dur(t.interval_s)} | {_dur(t.restart_s)} | **{t.waste:.1%}** | {t.waste / d.waste:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def _dur(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-gb", type=float, default=10.0, help="state one rank restores, GB (default 10)")
    p.add_argument("--stage-gbps", type=float, default=1.2 / 0.104, help="measured: staging copy, GB/s")
    p.add_argument("--local-read-gbps", type=float, default=3.44, help="measured: ckpt restore from memory, GB/s")
    p.add_argument("--local-write-gbps", type=float, default=1.2 / 2.82, help="measured: background save, GB/s")
    p.add_argument("--peer-gbps", type=float, default=1.0, help="assumed: replica over the network, GB/s")
    p.add_argument("--node-durable-gbps", type=float, default=2.0, help="assumed: one rank to the durable store, GB/s")
    p.add_argument("--durable-agg-gbps", type=float, default=1000.0, help="assumed: the durable store in all, GB/s")
    p.add_argument("--restart-fixed-s", type=float, default=120.0, help="assumed: restart cost besides reading state, s")
    p.add_argument("--p-corr", type=float, default=0.02, help="assumed: share of failures that also lose the replica")
    p.add_argument("--gpus", default="1024,16384,100000")
    p.add_argument("--markdown", help="also write the report here")
    a = p.parse_args(argv)
    r = Rates(a.state_gb, a.stage_gbps, a.local_read_gbps, a.local_write_gbps, a.peer_gbps, a.node_durable_gbps,
              a.durable_agg_gbps, a.restart_fixed_s, a.p_corr)
    sizes = [int(x) for x in a.gpus.split(",")]
    report = "\n".join([
        "# Time lost to failures at scale: durable-only checkpoints against local + peer tiers (simulation)", "",
        f"Command: `python benchmarks/restart_sim.py {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip() + "", "",
        "First-order model (Young/Daly), each configuration at its best interval; the model and its sources are in "
        "the module docstring of `benchmarks/restart_sim.py`. Inputs:", "",
        f"- state restored per rank: {r.state_gb:g} GB (a shard of parameters and optimizer state)",
        f"- measured on this machine (benchmarks/results/snapshot.md): staging copy {r.stage_gbps:.1f} GB/s "
        f"(the save's stall), restore from memory-backed files {r.local_read_gbps:.2f} GB/s, background encode + write "
        f"{r.local_write_gbps:.2f} GB/s (2 cores)",
        f"- assumed: replica over the network {r.peer_gbps:g} GB/s; durable store {r.node_durable_gbps:g} GB/s per rank at "
        f"best and {r.durable_agg_gbps:g} GB/s in all, shared by every rank; fixed restart cost {r.restart_fixed_s:g} s; "
        f"{r.p_corr:.0%} of failures also lose the replica (then the durable tier serves)",
        "- *interval*: between snapshots on the tier that restores most failures; *restart*: fixed cost plus reading "
        "the state back (for tiers, the expectation over both kinds of failure); *time lost*: save stalls + lost work + "
        "restarts, as a share of wall time (capped at 100%)", "",
        table(r, sizes),
        "What it shows: with durable-only checkpoints the shared store's bandwidth, split among more ranks, sets "
        "both how often a job can save and how long a restart reads, so the loss grows with scale; the tiers "
        "restore at per-node speed whatever the job size and can save every few minutes, so what is left is "
        "mostly the fixed restart cost. The model ignores failures during a restart and the cost of replication "
        "traffic to training (it runs in the background). A first-order model is only a guide once the loss passes "
        "about 30% (failures during restarts then compound): read those rows as \"does not make progress\", not as a figure.",
    ])
    print(report)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
