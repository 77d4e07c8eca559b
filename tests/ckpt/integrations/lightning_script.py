"""A tiny real Lightning run for tests/ckpt/integrations/test_lightning.py (run as a subprocess).

    python lightning_script.py STORE OUTDIR MODE STEPS [KILL_AT]

An MLP with dropout, AdamW and a per-step StepLR; 4 batches per epoch, shuffled by a
plain DataLoader (so snapshots resume exactly at epoch boundaries, see the module
docstring of ckpt.integrations.lightning). MODE ``full``: train STEPS optimizer
steps, no snapshots. ``crash``: snapshot every 4 steps through CkptCallback and
SIGKILL ourselves two steps after the snapshot of step KILL_AT is durable. ``term``:
SIGTERM ourselves during the batch of step KILL_AT (nothing else: the callback makes the
exit status 143). ``stop``:
the same, but stop the Trainer instead (in-process tests). ``resume``: a fresh model
(other initial weights) and Trainer, resumed by CkptCallback from the store, to STEPS.
A MODE prefixed ``val-`` validates every 2 batches (2 batches of validation data) and
snapshots every 3 steps; ``val-term`` SIGTERMs itself during the first batch of the
validation after step KILL_AT.
:func:`train` returns per-step losses (float.hex) and the final tensors; the script
writes them to OUTDIR/result.json and OUTDIR/result.safetensors.
"""

from __future__ import annotations

import os
import signal

import pytorch_lightning as pl
import torch

from ckpt.integrations.lightning import CkptCallback

BATCHES_PER_EPOCH = 4
EVERY = 4


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ValModule(TinyModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))


class Record(pl.Callback):
    """Exact per-step losses, and the crash (or in-process stop) two steps after KILL_AT's snapshot is durable."""

    def __init__(self, ckpt_cb: CkptCallback | None, kill_at: int, stop_only: bool, in_validation: bool = False) -> None:
        self.losses: dict[int, str] = {}
        self.ckpt_cb, self.kill_at, self.stop_only = ckpt_cb, kill_at, stop_only
        self.term = stop_only is None
        self.in_validation = in_validation

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.term and not self.in_validation and trainer.global_step == self.kill_at - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # preempted during the batch that makes step KILL_AT

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.term and self.in_validation and trainer.global_step == self.kill_at and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # preempted during validation (mode val-term)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        self.losses[step] = outputs["loss"].item().hex()
        if self.ckpt_cb is not None and not self.term and step == self.kill_at:
            self.ckpt_cb.manager.wait()  # the snapshot of KILL_AT is durable...
        if self.ckpt_cb is not None and not self.term and step == self.kill_at + 2:
            if self.stop_only:
                trainer.should_stop = True  # in-process: this Trainer is dropped after fit returns
            else:
                os.kill(os.getpid(), signal.SIGKILL)  # ...and the live state has moved past it


def train(store: str, outdir: str, mode: str, steps: int, kill_at: int = -1) -> tuple[dict, dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    validate = mode.startswith("val-")
    mode = mode.removeprefix("val-")
    try:
        torch.manual_seed(99 if mode == "resume" else 0)  # a resumed model must get its weights from the store
        module = ValModule() if validate else TinyModule()
        g = torch.Generator().manual_seed(1)
        n = 8 * BATCHES_PER_EPOCH
        data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)  # order drawn from the torch RNG
        every = 3 if validate else EVERY
        ckpt_cb = CkptCallback(store, "lit", every_n_steps=every, keep_last=2) if mode != "full" else None
        record = Record(ckpt_cb if mode in ("crash", "stop", "term") else None, kill_at,
                        None if mode == "term" else mode == "stop", validate)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             default_root_dir=outdir, callbacks=[c for c in (ckpt_cb, record) if c],
                             val_check_interval=2 if validate else None)
        val = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(16)), batch_size=8) if validate else None
        torch.manual_seed(1234)
        trainer.fit(module, loader, val)  # preempted (mode term): CkptCallback makes Lightning's SystemExit status 143
        losses: dict = dict(record.losses)
        if mode == "resume":
            assert ckpt_cb is not None and ckpt_cb.restored_step is not None
            losses = {k: v for k, v in losses.items() if k > ckpt_cb.restored_step}
            losses["restored"] = ckpt_cb.restored_step
        flat = {f"model.{k}": v for k, v in module.state_dict().items()}
        for i, s in trainer.optimizers[0].state_dict()["state"].items():
            flat.update({f"optim.{i}.{k}": v for k, v in s.items()})
        flat["sched.last_epoch"] = torch.tensor(trainer.lr_scheduler_configs[0].scheduler.last_epoch)
        flat["global_step"] = torch.tensor(trainer.global_step)
        return losses, flat
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    # run_script puts tests/ (where integration_util lives) on PYTHONPATH.
    from integration_util import script_main

    script_main(train)


if __name__ == "__main__":
    main()
