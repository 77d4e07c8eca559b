"""A tiny real training run with a local snapshot tier, for tests/ckpt/test_tiers.py (run as a subprocess).

    python tiers_script.py DURABLE LOCAL OUT MODE STEPS [KILL_AT]

Snapshots go to the local tier LOCAL every 2 steps and to the durable store DURABLE
every 10. MODE ``full``: train STEPS steps. ``crash``: SIGKILL ourselves right after the
(local) snapshot of step KILL_AT is saved, two training steps later. ``resume``: restore
the latest snapshot, write ``mgr.last_restore`` to OUT.restore.json, train to STEPS.
``resumebig``: ``resume`` for a ``midsave`` run. ``midsave``: save step 2, dump the state to OUT.step2.safetensors, then start the save
of step 4 (with a 64 MB tensor that changed) and SIGKILL ourselves while its chunks are
being written, before its manifest. Losses of every step run and the final state go
to OUT (JSON + safetensors).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
from safetensors.torch import save_file
from train_script import build, step_once

import ckpt


def dump(model, opt, path):
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        flat.update({f"optim.{i}.{k}": v for k, v in s.items()})
    save_file({k: v.contiguous() for k, v in flat.items()}, path)


def kill_when_chunks_appear(local: str, before: int) -> None:
    """SIGKILL this process once the save in flight has written some chunks of step 4, but no ref."""
    chunks = os.path.join(local, "objects", "chunks")
    refs = ckpt.Store.open(local).refs

    def count() -> int:
        return sum(len(files) for _, _, files in os.walk(chunks))

    def watch() -> None:
        while count() < before + 2:
            time.sleep(0.0005)
        if "run/step-4" not in refs():
            print("KILLED-MID-SAVE", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    durable, local, out, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    kill_at = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    torch.set_num_threads(1)
    model, opt, sched = build()
    torch.manual_seed(1234)
    state = {"model": model, "optim": opt, "sched": sched, "rng": ckpt.RNGState(), "step": 0}
    if mode in ("midsave", "resumebig"):
        state["big"] = torch.zeros(16 << 20)
    mgr = ckpt.CheckpointManager(durable, "run", every_n_steps=10, local=local, local_every_n_steps=2)
    start = 0
    if mode in ("resume", "resumebig"):
        start = mgr.restore_latest(state)
        assert start is not None and state["step"] == start
        with open(out + ".restore.json", "w") as f:
            json.dump(mgr.last_restore, f)
        dump(model, opt, out + ".restored.safetensors")
    losses = {}
    for step in range(start + 1, steps + 1):
        losses[step] = step_once(model, opt, sched).hex()
        state["step"] = step
        if mode == "midsave" and step == 4:
            state["big"] = torch.randn(16 << 20)
            kill_when_chunks_appear(local, sum(len(f) for _, _, f in os.walk(os.path.join(local, "objects", "chunks"))))
            mgr.save(step, state)
            mgr.wait()
            time.sleep(5)  # the watcher kills us; getting here means the save finished first
            sys.exit(3)
        saved = mgr.maybe_save(step, state)
        if saved and mode == "midsave":
            mgr.wait()
            dump(model, opt, out + ".step2.safetensors")
        elif saved and step == kill_at:
            mgr.wait()
            assert mgr.last_save is not None and mgr.last_save.tier == "local"
            step_once(model, opt, sched)
            step_once(model, opt, sched)
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    with open(out + ".json", "w") as f:
        json.dump(losses, f)
    dump(model, opt, out + ".safetensors")


if __name__ == "__main__":
    main()
