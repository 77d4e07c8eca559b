"""PyTorch Lightning: snapshot a run into a ckpt store and resume it from there.

>>> import pytorch_lightning as pl
>>> from ckpt.integrations.lightning import CkptCallback
>>> cb = CkptCallback("memory://lightning-doctest", "run1", every_n_steps=50, keep_last=3)
>>> trainer = pl.Trainer(max_steps=1000, callbacks=[cb], logger=False,   # doctest: +SKIP
...                      enable_checkpointing=False)
>>> trainer.fit(model, datamodule)   # resumes from run1/latest if the run has a snapshot   # doctest: +SKIP

Each snapshot holds what Lightning's own ``trainer.fit(ckpt_path=...)`` restores —
the LightningModule, every optimizer and LR scheduler, the precision plugin (AMP
scaler), the fit loop's progress (global step, epoch, batch position, and the state
of resumable dataloaders) and the other callbacks' ``state_dict()`` — plus the RNG
states, which Lightning's checkpoints leave out. It is taken at the same point as
``ModelCheckpoint(every_n_train_steps=N)`` (``on_train_batch_end``), so Lightning's
own restart logic picks up at the next batch. On SIGTERM (preemption), which Lightning
turns into the end of ``fit`` after the current batch (its ``SIGTERMException``, a
``SystemExit`` of status 0), that batch's step is saved too, and once that snapshot is
durable the exception carries status 143 (``preempt_exit_code``): a scheduler reads the
job as killed and requeues it, where 0 would read as finished. A SIGTERM that comes after
the batch's end (during the validation that follows it, or at the end of the epoch) ends
``fit`` there; that step is saved then, as it stood when its batch ended: the loop position
and RNG states are those taken at ``on_train_batch_end`` (a few small copies per batch), the
rest has not changed since. The state in the middle of validation cannot be resumed exactly:
Lightning would resume it as a run that had finished the step's validation, and at an
epoch's end it then draws one more shuffle from the RNG than the uninterrupted run does.
Resumed, the step's validation is skipped, as for every snapshot taken at a batch's end.
Resuming happens in ``on_fit_start``: after the strategy has built the optimizers and
moved the model, before the first batch; tensors are decoded straight into the live
parameters and optimizer state.

Exact resume mid-epoch needs what it needs with Lightning's own checkpoints: a
dataloader that can resume (``state_dict``/``load_state_dict``, e.g.
``torchdata``'s ``StatefulDataLoader``); a plain DataLoader restarts its epoch.
Snapshots at epoch boundaries resume exactly with any dataloader. Lightning finds its
place in an epoch by counting batches: a snapshot records the batch size and the batches
per epoch, and resuming it with others is refused (``SnapshotError`` at ``on_train_start``,
before the first batch) where that count would name another sample: mid-epoch, or at the
end of an epoch shorter than the new ones (Lightning would go on with it).
Not stored: anything a LightningModule adds in ``on_save_checkpoint`` (give it a
``Stateful`` attribute instead) and logger state. Single process only.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

try:
    import pytorch_lightning as pl
    from pytorch_lightning.utilities.exceptions import SIGTERMException
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("ckpt.integrations.lightning needs PyTorch Lightning: pip install 'ckpt-store[lightning]'") from e

from ckpt.snapshot.manager import CheckpointManager, SnapshotError
from ckpt.snapshot.retention import KeepBest
from ckpt.snapshot.state import RNGState

log = logging.getLogger(__name__)


class _FitLoop:
    """The fit loop's progress counters as a Stateful (Lightning's ``checkpoint["loops"]["fit_loop"]``);
    ``saved``: those taken earlier, saved instead of the loop's own now."""

    def __init__(self, trainer: pl.Trainer, saved: dict[str, Any] | None = None) -> None:
        self.trainer, self.saved = trainer, saved

    def state_dict(self) -> dict[str, Any]:
        return self.saved if self.saved is not None else self.trainer.fit_loop.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state)


class _RNGTaken(RNGState):
    """The RNG states taken earlier (a snapshot of them), saved as an RNGState's."""

    def __init__(self, taken: dict[str, Any]) -> None:
        self.taken = taken

    def state_dict(self) -> dict[str, Any]:
        return self.taken


class _Callbacks:
    """Every other callback's ``state_dict()``, keyed by ``state_key`` as in Lightning's checkpoints."""

    def __init__(self, trainer: pl.Trainer, skip: pl.Callback) -> None:
        self.callbacks = {cb.state_key: cb for cb in trainer.callbacks if cb is not skip}

    def state_dict(self) -> dict[str, Any]:
        return {key: sd for key, cb in self.callbacks.items() if (sd := cb.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, sd in state.items():
            if key in self.callbacks:
                self.callbacks[key].load_state_dict(sd)
            else:
                log.warning("snapshot has state for callback %s, which this trainer does not have", key)


class CkptCallback(pl.Callback):
    """Save a Lightning run to ``store`` as snapshots ``RUN/step-N`` and resume it at fit start.

    ``every_n_steps`` counts optimizer steps (``trainer.global_step``).
    ``keep_last``, ``keep_every``, ``keep_best`` and ``save_mode`` are those of
    :class:`ckpt.CheckpointManager`; ``metrics`` names entries of
    ``trainer.callback_metrics`` to record with each snapshot (for ``keep_best``).
    With ``resume=False`` the run starts fresh even if the store has snapshots of it (or from
    ``trainer.fit(ckpt_path=...)``, which is refused where a snapshot would be resumed too).
    After ``fit``, :attr:`restored_step` is the step resumed from (None if none) and
    every snapshot taken is durable, also when ``fit`` raised. Preempted (SIGTERM), ``fit``
    raises Lightning's ``SIGTERMException`` (a ``SystemExit``) with status
    ``preempt_exit_code`` (default 143, as the signal itself would have ended the process;
    an int in 0..255) once the final snapshot is durable.

    Raises :class:`ckpt.snapshot.manager.SnapshotError` under a multi-process strategy.
    """

    def __init__(self, store: Any, run: str, *, every_n_steps: int, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: KeepBest | None = None,
                 metrics: tuple[str, ...] = (), save_mode: str = "async", resume: bool = True,
                 preempt_exit_code: int = 143, **deprecated: Any) -> None:
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        self.store, self.run = store, run
        self.every_n_steps = every_n_steps
        keep_best = KeepBest.coerce(keep_best)
        self.metrics = tuple(metrics) + ((keep_best.metric,) if keep_best and keep_best.metric not in metrics else ())
        self.resume = resume
        self._manager_kwargs: dict[str, Any] = {"keep_last": keep_last, "keep_every": keep_every,
                                                "keep_best": keep_best, "save_mode": save_mode,
                                                "preempt_exit_code": preempt_exit_code, **deprecated}
        self.manager: CheckpointManager | None = None
        self.restored_step: int | None = None
        self._last_saved: int | None = None
        self._batch_start_step: int | None = None
        # (step, fit loop state, RNG states) as the last training batch that stepped the optimizer ended: what a
        # final snapshot records when the SIGTERM comes after that (during validation, at the epoch's end)
        self._batch_end: tuple[int, dict[str, Any], dict[str, Any]] | None = None
        self._restored_data: Any = None  # the data position recorded with the snapshot resumed from

    def _state(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_end: bool = False) -> dict[str, Any]:
        state: dict[str, Any] = {"model": pl_module}
        for i, opt in enumerate(trainer.optimizers):
            state[f"optimizer{i}"] = opt
        for i, config in enumerate(trainer.lr_scheduler_configs):
            state[f"scheduler{i}"] = config.scheduler
        state["precision"] = trainer.precision_plugin
        taken = self._batch_end if batch_end else None
        state["loops"] = _FitLoop(trainer, taken[1] if taken else None)
        state["callbacks"] = _Callbacks(trainer, self)
        state["rng"] = _RNGTaken(taken[2]) if taken else RNGState()
        # Not restored into the trainer: kept to check that a resume lands where the run stopped.
        state["trainer"] = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                            "data": _data_position(trainer)}
        return state


    def _check_data_position(self, trainer: pl.Trainer) -> None:
        """Refuse to go on from a snapshot with another batch size or epoch length where the loop's place in
        its epoch, a count of batches, would name other samples than the run had reached: mid-epoch, or at
        the end of an epoch shorter than the new ones (Lightning then goes on with that epoch)."""
        saved, self._restored_data = self._restored_data, None
        if saved is None:
            return  # a snapshot of an earlier release
        at, per_epoch = (saved.get("batch_in_epoch"), saved.get("batches_per_epoch")) if isinstance(saved, dict) else (None, None)
        if not isinstance(at, int) or not isinstance(per_epoch, (int, type(None))) or not isinstance(saved.get("batch_sizes"), list):
            raise SnapshotError(f"the snapshot of step {self.restored_step} of {self.run!r} is malformed: its record of the "
                                "data position is not one this callback writes", hint="resume from another snapshot")
        if not at:
            return  # at the start of an epoch
        now = _data_position(trainer)
        if (saved["batch_sizes"], per_epoch) == (now["batch_sizes"], now["batches_per_epoch"]):
            return
        if at >= (per_epoch or float("inf")) and at >= (now["batches_per_epoch"] or float("inf")):
            return  # the epoch had ended, and has here too: the next one starts afresh
        raise SnapshotError(
            f"the snapshot of step {self.restored_step} of {self.run!r} was taken {saved['batch_in_epoch']} batches into "
            f"an epoch of {saved.get('batches_per_epoch')} batches of size {_sizes(saved.get('batch_sizes'))}; this "
            f"trainer's epochs are {now['batches_per_epoch']} batches of size {_sizes(now['batch_sizes'])}: it would "
            "resume at another place in the data",
            hint="resume with the batch size and data the run was trained with, or start a new run name")

    # -- hooks -------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.manager is not None:
            return
        if trainer.world_size > 1:
            raise SnapshotError(f"CkptCallback runs in one process; this trainer has {trainer.world_size}",
                                hint="use ckpt.CheckpointManager(process_group=...) in a custom loop")
        self.manager = CheckpointManager(self.store, self.run, **self._manager_kwargs)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.manager is not None
        # What restore_latest would resume (the newest of every tier), asked before anything is restored.
        latest = self.manager.latest_step() if self.resume and trainer.ckpt_path is not None else None
        if latest is not None:
            # Lightning restored the module from it before this hook and restores the optimizers, schedulers
            # and loop position from it after: the run would go on with the snapshot's weights and the rest of it.
            # Refused before the snapshot is restored: the module keeps what Lightning gave it, the RNG its state.
            raise SnapshotError(f"trainer.fit(ckpt_path={trainer.ckpt_path!r}) resumes from that checkpoint, and this "
                                f"callback from step {latest} of {self.run!r}: the run would mix the two",
                                hint="pass CkptCallback(..., resume=False) to resume from the Lightning checkpoint, "
                                     "its next snapshots going to the store; or leave out ckpt_path (on SLURM, "
                                     "Lightning's auto-requeue sets it to its hpc checkpoint: pass "
                                     "plugins=[SLURMEnvironment(auto_requeue=False)], this callback handles preemption)")
        state = self._state(trainer, pl_module)
        self.restored_step = self.manager.restore_latest(state) if self.resume else None
        if self.restored_step is not None:
            log.info("resumed %s from step %d", self.run, self.restored_step)
            recorded = state["trainer"]  # the snapshot's (restore replaced the value)
            self._restored_data = recorded.get("data") if isinstance(recorded, dict) else None
        self._last_saved = trainer.global_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_data_position(trainer)  # once the train dataloader is set up, before its first batch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        stepped = step != self._batch_start_step
        # Preempted (SIGTERM): Lightning ends fit after this batch; save it too, if the optimizer
        # stepped in it (mid-accumulation the partial gradients could not be resumed).
        final = trainer.received_sigterm and stepped
        # Several batches share a global step under gradient accumulation: save once.
        if (step % self.every_n_steps == 0 or final) and step != self._last_saved:
            self.save(trainer, pl_module)
        elif stepped:
            self._batch_end = (step, copy.deepcopy(trainer.fit_loop.state_dict()), RNGState().state_dict())

    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Snapshot now as step ``trainer.global_step`` (returns once staged)."""
        self._save(trainer, pl_module)

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_end: bool = False) -> None:
        if self.manager is None:
            raise SnapshotError("CkptCallback.save() is called from within trainer.fit (which sets the callback up)",
                                hint="call it from a hook or the module's training code while fit runs")
        metrics = {k: float(trainer.callback_metrics[k]) for k in self.metrics if k in trainer.callback_metrics}
        self.manager.save(trainer.global_step, self._state(trainer, pl_module, batch_end), metrics)
        self._last_saved = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.manager is not None:
            self.manager.wait()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook when fit raises: the in-flight snapshot is finished here.
        if self.manager is None:
            return
        step = trainer.global_step
        if isinstance(exception, SIGTERMException) and self._batch_end is not None and self._batch_end[0] == step != self._last_saved:
            # The signal came after the step's on_train_batch_end (during validation, at the epoch's end), and
            # Lightning ended fit from there: the step is saved now, as its batch ended (see the module docstring).
            try:
                self._save(trainer, pl_module, batch_end=True)
            except Exception:  # noqa: BLE001 - do not mask the exception that ends fit
                log.exception("final snapshot of %s at step %d failed", self.run, step)
        manager, self.manager = self.manager, None
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - do not mask the exception that ends fit
            log.exception("in-flight snapshot of %s failed while fit ended with %r", self.run, exception)
        if isinstance(exception, SIGTERMException):
            # Lightning's preemption exit has status 0, which a scheduler reads as "finished" (never requeued).
            exception.code = manager.preempt_exit_code
            log.warning("preempted at step %d, every snapshot taken durable: exiting with %d", trainer.global_step,
                        manager.preempt_exit_code)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.manager is not None:
            manager, self.manager = self.manager, None
            manager.close()


def _data_position(trainer: pl.Trainer) -> dict[str, Any]:
    """What the fit loop's place in the data depends on: the batch size of each training dataloader
    (None where it cannot say), the batches in an epoch (None: unknown) and how many of this epoch's ran."""
    from torch.utils.data import DataLoader

    def sizes(loaders: Any) -> list[Any]:
        if isinstance(loaders, dict):
            return [b for v in loaders.values() for b in sizes(v)]
        if isinstance(loaders, (list, tuple)):
            return [b for v in loaders for b in sizes(v)]
        size = getattr(loaders, "batch_size", None)
        if isinstance(loaders, DataLoader) and size is None:
            size = getattr(loaders.batch_sampler, "batch_size", None)
        return [size if isinstance(size, int) else None]  # recorded as JSON: whatever else a loader has is unknown

    n = trainer.num_training_batches
    return {"batch_sizes": sizes(trainer.train_dataloader), "batches_per_epoch": int(n) if n != float("inf") else None,
            "batch_in_epoch": trainer.fit_loop.epoch_loop.batch_progress.current.ready}


def _sizes(sizes: Any) -> str:
    return ", ".join(map(str, sizes)) if isinstance(sizes, list) else str(sizes)
