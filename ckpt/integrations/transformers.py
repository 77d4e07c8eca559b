"""Hugging Face transformers: snapshot a ``Trainer`` run into a ckpt store and resume it.

>>> from transformers import Trainer
>>> from ckpt.integrations.transformers import CkptCallback
>>> cb = CkptCallback("memory://hf-doctest", "run1", every_n_steps=50, keep_last=3)
>>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])   # doctest: +SKIP
>>> trainer.train(resume_from_checkpoint=cb.resume_dir(trainer))   # None: no snapshot, start fresh   # doctest: +SKIP

A snapshot of step N is taken where the Trainer would write its own checkpoint: after
the step's logging and evaluation (which draw from the RNG and update callback states
such as early stopping's), at the next ``on_step_begin``/``on_epoch_begin`` or, for the
last step, at the final log, before ``load_best_model_at_end`` swaps the weights. It
holds the model, the optimizer, the LR scheduler, the AMP grad scaler if any, the
RNG states and the ``TrainerState`` (global step, epoch, log history, callback
states) as JSON. No ``.pt`` file is written or read: nothing is pickled.

Resuming goes through the Trainer's own ``resume_from_checkpoint`` so that its loop
fast-forwards the dataloader exactly as it does for its own checkpoints.
:meth:`CkptCallback.resume_dir` restores the model in place from the store and
writes a small directory with what that loop reads from disk — ``trainer_state.json``
and the model as ``model.safetensors`` (the Trainer insists on loading weights from
it). The optimizer, scheduler and scaler are then restored in place in
``on_train_begin``, once the Trainer has built them, and the RNG states at the point
where the Trainer would load its ``rng_state.pth`` (before the first batch of the
resumed epoch, or right after the skipped batches mid-epoch).
Single process only, as :class:`ckpt.CheckpointManager` without a process group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

try:
    from transformers import (
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from transformers.trainer_callback import ExportableState
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("ckpt.integrations.transformers needs transformers: pip install 'ckpt-store[transformers]'") from e

from ckpt.errors import RefNotFoundError, TensorMismatchError
from ckpt.snapshot.manager import CheckpointManager, SnapshotError
from ckpt.snapshot.retention import KeepBest
from ckpt.snapshot.state import RNGState
from ckpt.snapshot.steps import snapshot_step
from ckpt.store.destination import check_dir_destination

log = logging.getLogger(__name__)

_MARKER = ".ckpt-resume"  # in a directory resume_dir wrote: it may write there again


class CkptCallback(TrainerCallback):
    """Save a ``Trainer`` run to ``store`` as snapshots ``RUN/step-N``; resume with :meth:`resume_dir`.

    ``every_n_steps`` counts optimizer steps (``state.global_step``); None follows
    the Trainer's own schedule (``save_strategy``/``save_steps``). ``keep_last``,
    ``keep_every``, ``keep_best`` and ``save_mode`` are those of
    :class:`ckpt.CheckpointManager`; with ``keep_best=ckpt.KeepBest(metric, mode)`` the last
    logged value of ``metric`` (e.g. ``"loss"``) is recorded with each snapshot.
    ``save_mode="overlap"`` fits the Trainer's loop: between a snapshot (taken after the
    step) and the next optimizer step only gradients change, so the parameters and
    Adam moments are read while the next batch's forward and backward run.

    Pass ``resume_dir(trainer)`` to ``trainer.train(resume_from_checkpoint=...)`` on every run, the first
    too (it returns None there): the states of the Trainer's other callbacks (early stopping) and its AMP
    scaler are reached through the Trainer it is given, and ``train`` refuses to start where there are
    such states and the callback was not given the Trainer.

    ``handle_signals=True`` (preemption; the Trainer installs no handler of its own): after a
    SIGTERM or SIGUSR1 the step under way finishes, is snapshotted where a periodic snapshot
    would be (after its logging and evaluation), and once that snapshot is durable the process
    exits with status 143, so that a scheduler requeues the job; a resume continues from it.
    """

    def __init__(self, store: Any, run: str, *, every_n_steps: int | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: KeepBest | None = None, save_mode: str = "async",
                 handle_signals: bool = False, **deprecated: Any) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1 (or None to follow save_steps)")
        self.every_n_steps = every_n_steps
        self.keep_best = KeepBest.coerce(keep_best)
        self.manager = CheckpointManager(store, run, keep_last=keep_last, keep_every=keep_every,
                                         keep_best=self.keep_best, save_mode=save_mode, handle_signals=handle_signals,
                                         **deprecated)
        self.restored_step: int | None = None
        self._trainer: Any = None
        self._pending_rng: int | None = None  # step whose RNG state is still to be restored
        self._pending_restore = False  # resume_dir ran: on_train_begin restores optimizer and scheduler
        self._save_due = False  # on_step_end found a snapshot due: taken once the step's log and evaluation ran
        self._data: dict[str, Any] = {}  # what the Trainer's place in the data depends on, recorded with each snapshot
        self._restored_data: dict[str, Any] = {}  # the same, recorded with the snapshot resume_dir restored

    # -- resuming ------------------------------------------------------------------
    def resume_dir(self, trainer: Any, dest: str | os.PathLike[str] | None = None, step: int | None = None) -> str | None:
        """Prepare ``trainer`` to resume from the run's latest snapshot (or ``step``).

        Returns the directory to pass as ``trainer.train(resume_from_checkpoint=...)``
        (default ``<output_dir>/ckpt-resume``; new, empty or written by resume_dir before),
        or None when the run has no snapshot.
        Raises :class:`ckpt.errors.TensorMismatchError` if the model does not fit it, and
        :class:`ckpt.snapshot.manager.SnapshotError` if it was trained with another batch size or
        ``gradient_accumulation_steps`` (the Trainer would resume at another place in the data:
        it counts steps in batches of today's size and accumulation; ``train`` refuses in the same
        way a dataset of another number of batches; with ``ignore_data_skip=True`` the Trainer skips nothing
        and both may change), or ``dest`` holds files that resume_dir did not write (or a symbolic link); and
        :class:`ckpt.errors.DestinationError` if it lies inside a store (as a pull there is refused).
        """
        self._trainer = trainer
        out = os.fspath(dest) if dest is not None else os.path.join(trainer.args.output_dir, "ckpt-resume")
        # Its files are none of a store's (the store snapshotted to, when output_dir is that store, or any other).
        check_dir_destination(out, self.manager.store, "resume_dir")
        if step is None:
            try:
                m = self.manager.store.manifest(f"{self.manager.run}/latest")
            except RefNotFoundError:
                return None
            step = snapshot_step(m)  # (a record read from the store: anything but a step is refused)
            if step is None:
                raise SnapshotError(f"{self.manager.run}/latest is not a snapshot", hint="resume_dir(trainer, step=N)")
        if os.path.lexists(out) and not os.path.isdir(out):
            raise SnapshotError(f"{out} exists and is not a directory", hint="pass resume_dir(trainer, dest=...) a new or empty directory")
        if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, _MARKER)):
            # save_pretrained deletes stale-looking model-0000i-of-0000n shards there, and the Trainer
            # would unpickle an optimizer.pt or rng_state.pth it finds (the latter over our RNG state).
            raise SnapshotError(f"{out} holds files that resume_dir did not write",
                                hint="pass resume_dir(trainer, dest=...) an empty or new directory")
        # Its files are written in place (open(), save_pretrained): a link at one of their names would have
        # the file it leads to, someone's, overwritten. None is resume_dir's: it makes only files.
        links = sorted(n for n in os.listdir(out) if os.path.islink(os.path.join(out, n))) if os.path.isdir(out) else []
        if links:
            raise SnapshotError(f"{out} holds a symbolic link ({links[0]}); resume_dir writes its own files there, "
                                "never through a link", hint="remove the link (what it leads to stays), or pass "
                                                             "resume_dir(trainer, dest=...) a new directory")
        values: dict[str, Any] = {"trainer_state": None, "data": None}
        try:  # the TrainerState and the data position as JSON, checked before the model is touched
            self.manager.restore(values, step)
        except TensorMismatchError:  # a snapshot of an earlier release, which recorded no data position
            del values["data"]
            self.manager.restore(values, step)
        state, data = values["trainer_state"], values.get("data") or {}
        if not isinstance(state, dict) or not isinstance(data, dict):
            raise SnapshotError(f"the snapshot of step {step} of {self.manager.run!r} is malformed: its trainer state or "
                                "data position is not a record", hint="resume from another snapshot (resume_dir(trainer, step=N))")
        # The Trainer reads trainer_state.json as TrainerState(**fields): a field it lacks raises a TypeError there.
        unknown = sorted(str(k) for k in set(state) - {f.name for f in dataclasses.fields(TrainerState)})
        if unknown:
            raise SnapshotError(f"the snapshot of step {step} of {self.manager.run!r} has trainer state fields this "
                                f"transformers does not know: {', '.join(unknown[:5])}",
                                hint="resume with the transformers version that saved it")
        saved, now = data.get("gradient_accumulation_steps"), trainer.args.gradient_accumulation_steps
        if saved is not None and saved != now and not trainer.args.ignore_data_skip:
            # The Trainer skips global_step * gradient_accumulation_steps batches (and counts epochs
            # in steps of that many batches) with today's value.
            raise SnapshotError(f"the snapshot of step {step} of {self.manager.run!r} was trained with "
                                f"gradient_accumulation_steps={saved}, this Trainer's is {now}: it would resume at "
                                "another place in the data",
                                hint=f"resume with gradient_accumulation_steps={saved}, or pass ignore_data_skip=True "
                                     "to go on from the start of an epoch")
        saved, now = state.get("train_batch_size"), trainer.args.train_batch_size
        if saved is not None and saved != now and not trainer.args.auto_find_batch_size:
            # The Trainer finds its place in the data as global_step batches of today's size.
            raise SnapshotError(f"the snapshot of step {step} of {self.manager.run!r} was trained with batch size {saved}, "
                                f"this Trainer's is {now}: it would resume at another place in the data",
                                hint=f"resume with per_device_train_batch_size={saved}, or start a new run name")
        self.manager.restore({"model": trainer.model}, step)  # in place
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, _MARKER), "w").close()
        with open(os.path.join(out, "trainer_state.json"), "w") as f:
            json.dump(values["trainer_state"], f, indent=2, sort_keys=True)
        if hasattr(trainer.model, "save_pretrained"):  # tied weights written as the Trainer expects them
            trainer.model.save_pretrained(out)
        else:
            from safetensors.torch import save_model

            save_model(trainer.model, os.path.join(out, "model.safetensors"))
        self.restored_step, self._pending_restore = step, True
        self._restored_data = data
        return out

    def _rest(self, optimizer: Any, lr_scheduler: Any) -> dict[str, Any]:
        state: dict[str, Any] = {"optimizer": optimizer, "scheduler": lr_scheduler}
        scaler = getattr(getattr(self._trainer, "accelerator", None), "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        if args.world_size > 1:
            raise SnapshotError(f"CkptCallback runs in one process; this run has {args.world_size}",
                                hint="use ckpt.CheckpointManager(process_group=...) in a custom loop")
        if self.every_n_steps is None and args.save_strategy == "no":
            raise SnapshotError("CkptCallback(every_n_steps=None) follows the Trainer's save schedule, and this "
                                "Trainer's save_strategy is 'no': no snapshot would ever be taken",
                                hint="pass every_n_steps=N (and keep save_strategy='no' for no pickled checkpoint-N/ folders)")
        others = set(state.stateful_callbacks or {}) - {type(control).__name__}
        if self._trainer is None and (others or getattr(optimizer, "scaler", None) is not None):
            # The callbacks' live states and the scaler are reached through the Trainer, which no callback
            # hook is given: without it each snapshot held their states as they were when train() began.
            what = f"the states of {', '.join(sorted(others))}" if others else "the AMP grad scaler"
            raise SnapshotError(f"CkptCallback cannot snapshot {what}: it reaches them through the Trainer, "
                                "which it learns from resume_dir(trainer)",
                                hint="call trainer.train(resume_from_checkpoint=cb.resume_dir(trainer)) on a first run "
                                     "too: resume_dir returns None when there is nothing to resume")
        loader = kw.get("train_dataloader")
        try:
            batches = len(loader) if loader is not None else None
        except TypeError:  # an iterable dataset: no epochs to place a step in
            batches = None
        self._data = {"gradient_accumulation_steps": args.gradient_accumulation_steps, "batches_per_epoch": batches}
        if not self._pending_restore:
            return
        self._pending_restore = False
        if state.global_step != self.restored_step:
            raise SnapshotError(f"the Trainer resumed at step {state.global_step}, not at the snapshot's "
                                f"{self.restored_step}", hint="pass resume_dir(trainer) to trainer.train(resume_from_checkpoint=...)")
        saved = self._restored_data.get("batches_per_epoch")
        if saved is not None and batches is not None and saved != batches and not args.ignore_data_skip:
            # The Trainer counts the epochs trained and the batches to skip in this epoch with today's number.
            raise SnapshotError(f"the snapshot of step {self.restored_step} of {self.manager.run!r} was trained with "
                                f"{saved} batches an epoch, this Trainer's dataset makes {batches}: it would resume at "
                                "another place in the data",
                                hint="resume with the dataset the run was trained with, or pass ignore_data_skip=True "
                                     "to go on from the start of an epoch")
        assert self.restored_step is not None
        self.manager.restore(self._rest(optimizer, lr_scheduler), self.restored_step)
        self._pending_rng = self.restored_step

    def _restore_rng(self) -> None:
        step, self._pending_rng = self._pending_rng, None
        if step is not None:
            self.manager.restore({"rng": RNGState()}, step)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._save_if_due(state, control, **kw)  # before the new epoch's dataloader draws its order
        # Resuming at an epoch boundary: the Trainer loads RNG before the epoch's first batch.
        if self._pending_rng is not None and float(state.epoch or 0).is_integer():
            self._restore_rng()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._save_if_due(state, control, **kw)
        # Mid-epoch: after the skipped batches have been fetched, as the Trainer does.
        self._restore_rng()

    # -- saving --------------------------------------------------------------------
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: Any = None, optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        step = state.global_step
        due = step % self.every_n_steps == 0 if self.every_n_steps else control.should_save
        # Not yet: the Trainer logs and evaluates this step after on_step_end, drawing from the
        # RNG (the eval dataloader's seed) and updating callback states, as a resumed run won't.
        self._save_due = due and step != self.restored_step

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        # Following the Trainer's schedule, save_strategy "epoch" and "best" decide after on_step_end (at the
        # epoch's end, after an evaluation): the Trainer has just written its checkpoint of this step.
        if self.every_n_steps is None and state.global_step != self.restored_step:
            self._save_due = True

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if logs and "train_runtime" in logs:  # the end of training, before load_best_model_at_end
            self._save_if_due(state, control, **kw)

    def _save_if_due(self, state: TrainerState, control: TrainerControl, model: Any = None, optimizer: Any = None,
                     lr_scheduler: Any = None, **kw: Any) -> None:
        # Preempted (handle_signals): the last finished step is snapshotted here whatever the schedule,
        # and save() exits once it is durable.
        if self.manager.preempted and self._pending_rng is not None:
            # Nothing has run since the restore: the snapshot of this step is the one restored, and taking
            # it again now would replace it with the RNG state of this process, not yet restored.
            self.manager.close()
            log.warning("preempted before the first step after resuming step %d; exiting with %d",
                        state.global_step, self.manager.preempt_exit_code)
            raise SystemExit(self.manager.preempt_exit_code)
        if self._save_due or (self.manager.preempted and state.global_step > 0):
            self._save_due = False
            self.save(state, control, model, optimizer, lr_scheduler)

    def save(self, state: TrainerState, control: TrainerControl, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
        """Snapshot now as step ``state.global_step`` (returns once staged; after a preemption signal,
        once durable, by raising ``SystemExit(143)``)."""
        snapshot = {"model": model, **self._rest(optimizer, lr_scheduler), "rng": RNGState(),
                    "trainer_state": self._trainer_state(state, control), "data": self._data}
        metrics: dict[str, float] = {}
        if self.keep_best:
            name = self.keep_best.metric
            logged = [h[name] for h in state.log_history if name in h]
            if logged:
                metrics[name] = float(logged[-1])
        if self.manager.preempted:
            self.manager.maybe_save(state.global_step, snapshot, metrics)  # the final snapshot: durable, then SystemExit
        else:
            self.manager.save(state.global_step, snapshot, metrics)

    def _trainer_state(self, state: TrainerState, control: TrainerControl) -> dict[str, Any]:
        """``TrainerState`` as the Trainer writes ``trainer_state.json``, callback states brought up to date."""
        out: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(state)))
        handler = getattr(self._trainer, "callback_handler", None)
        stateful = [cb for cb in (handler.callbacks if handler else []) if isinstance(cb, ExportableState)]
        # As the Trainer records them (TrainerState builds the record): several callbacks of one class as a list.
        out.setdefault("stateful_callbacks", {}).update(TrainerState(stateful_callbacks=[*stateful, control]).stateful_callbacks)
        return out

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._save_if_due(state, control, **kw)
        self.manager.wait()

    def close(self) -> None:
        """Finish the in-flight snapshot and release the manager."""
        self.manager.close()
