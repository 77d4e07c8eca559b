"""A tiny real training run used by the manager tests (run as a subprocess).

    python train_script.py STORE OUT MODE STEPS [KILL_AT]

MODE ``full``: train STEPS steps without snapshots. ``crash``: snapshot every 5
steps and SIGKILL ourselves right after the snapshot of step KILL_AT is durable
(plus two more training steps, so the live state has moved on). ``resume``:
restore the latest snapshot and train to STEPS. ``preempt``: handle SIGTERM,
send it to ourselves at step KILL_AT, and let maybe_save take the final snapshot.
Losses of every step run and the final state go to OUT (JSON + safetensors).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from safetensors.torch import save_file

import ckpt


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    return model, opt, sched


def step_once(model, opt, sched):
    x = torch.randn(8, 16)  # consumes the global RNG: restored by RNGState
    y = torch.randint(0, 4, (8,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def main() -> None:
    store, out, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    kill_at = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    torch.set_num_threads(1)
    model, opt, sched = build()
    torch.manual_seed(1234)
    state = {"model": model, "optim": opt, "sched": sched, "rng": ckpt.RNGState(), "step": 0}
    losses = {}
    mgr = ckpt.CheckpointManager(store, "run", every_n_steps=5, handle_signals=mode == "preempt",
                                 save_mode="overlap" if os.environ.get("CKPT_TEST_OVERLAP") == "1" else "async")
    start = 0
    if mode == "resume":
        start = mgr.restore_latest(state)
        assert start is not None and state["step"] == start
    for step in range(start + 1, steps + 1):
        losses[step] = step_once(model, opt, sched).hex()
        state["step"] = step
        if mode == "preempt" and step == kill_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if mode in ("crash", "preempt") and mgr.maybe_save(step, state) and step == kill_at:
            mgr.wait()
            step_once(model, opt, sched)
            step_once(model, opt, sched)
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    with open(out + ".json", "w") as f:
        json.dump(losses, f)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        flat.update({f"optim.{i}.{k}": v for k, v in s.items()})
    save_file({k: v.contiguous() for k, v in flat.items()}, out + ".safetensors")


if __name__ == "__main__":
    main()
