"""A tiny real transformers ``Trainer`` run for tests/ckpt/integrations/test_transformers.py.

    python hf_script.py STORE OUTDIR MODE STEPS [KILL_AT]

A 2-layer GPT-2 built from a config (no download) on synthetic tokens, with dropout,
AdamW and a linear warmup/decay schedule; 4 optimizer steps per epoch, shuffled.
MODE ``full``: train STEPS steps, no snapshots. ``crash``: snapshot every 2 steps and
SIGKILL ourselves one step after the snapshot of step KILL_AT is durable. ``preempt``: the
callback handles signals, and we SIGTERM ourselves in step KILL_AT (expect exit 143). ``stop``:
the same without the kill, stopping at KILL_AT + 1 (in-process tests). ``resume``:
a fresh model (other initial weights) and Trainer resumed from the store, to STEPS.
``resume-preempt``: the same with signals handled, SIGTERMed before its first step (expect exit 143).
``evaluate=True`` (in-process only) evaluates every 2 steps and keeps the best eval loss.
:func:`train` returns per-step losses (float.hex) and the final tensors; the script
writes them to OUTDIR/result.json and OUTDIR/result.safetensors.
"""

from __future__ import annotations

import os
import signal

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ckpt import KeepBest
from ckpt.integrations.transformers import CkptCallback

EVERY = 2


class Record(TrainerCallback):
    """Exact per-step losses (the Trainer only logs rounded averages) and the crash trigger."""

    def __init__(self, model: torch.nn.Module, cb: CkptCallback | None, kill_at: int, stop_only: bool,
                 preempt: bool = False) -> None:
        self.stop_only, self.preempt = stop_only, preempt
        self.pending: list[str] = []
        self.losses: dict[int, str] = {}
        self.cb, self.kill_at = cb, kill_at
        model.register_forward_hook(lambda m, i, out: self.pending.append(out.loss.item().hex()) if m.training else None)

    def on_step_end(self, args, state, control, **kw):
        (self.losses[state.global_step],) = self.pending
        self.pending.clear()
        if self.preempt and state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGTERM)  # preempted in this step: the callback snapshots it, then exits 143
        elif self.cb is not None and self.kill_at > 0 and state.global_step == self.kill_at + 1:
            self.cb.manager.wait()  # the snapshot of KILL_AT (taken as this step began) is durable...
            if self.stop_only:
                control.should_training_stop = True  # in-process: the Trainer object is dropped here
            else:
                os.kill(os.getpid(), signal.SIGKILL)  # ...and the live state has moved past it


def train(store: str, outdir: str, mode: str, steps: int, kill_at: int = -1, overlap: bool = False,
          evaluate: bool = False) -> tuple[dict, dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(99 if mode.startswith("resume") else 0)  # a resumed model must get its weights from the store
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
        g = torch.Generator().manual_seed(1)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 12), generator=g)]
        args = TrainingArguments(output_dir=outdir, max_steps=steps,
                                 per_device_train_batch_size=4, learning_rate=5e-3, warmup_steps=3,
                                 lr_scheduler_type="linear", weight_decay=0.01, optim="adamw_torch", save_strategy="no",
                                 report_to=[], disable_tqdm=True, use_cpu=True, seed=7, logging_steps=1,
                                 dataloader_num_workers=0, eval_strategy="steps" if evaluate else "no", eval_steps=EVERY)
        cb = CkptCallback(store, "hf", every_n_steps=EVERY, keep_last=2, save_mode="overlap" if overlap else "async",
                          keep_best=KeepBest("eval_loss", "min", 1) if evaluate else None,
                          handle_signals=mode in ("preempt", "resume-preempt")) if mode != "full" else None
        record = Record(model, cb if mode in ("crash", "stop", "preempt") else None, kill_at, mode == "stop", mode == "preempt")
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4] if evaluate else None,
                          callbacks=[c for c in (cb, record) if c])
        resume = cb.resume_dir(trainer) if mode in ("resume", "resume-preempt") else None
        if mode == "resume-preempt":
            os.kill(os.getpid(), signal.SIGTERM)  # preempted again before the first resumed step
        trainer.train(resume_from_checkpoint=resume)
        if cb is not None:
            cb.close()
        losses: dict = dict(record.losses)
        if mode == "resume":
            assert cb is not None and cb.restored_step is not None
            losses["restored"] = cb.restored_step
        flat = {f"model.{k}": v for k, v in model.state_dict().items()}
        for i, s in trainer.optimizer.state_dict()["state"].items():
            flat.update({f"optim.{i}.{k}": v for k, v in s.items()})
        flat["sched.last_epoch"] = torch.tensor(trainer.lr_scheduler.last_epoch)
        flat["global_step"] = torch.tensor(trainer.state.global_step)
        return losses, flat
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    # run_script puts tests/ (where integration_util lives) on PYTHONPATH.
    from integration_util import script_main

    script_main(train)


if __name__ == "__main__":
    main()
