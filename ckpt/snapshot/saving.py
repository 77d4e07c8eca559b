"""The save side of :class:`~ckpt.snapshot.manager.CheckpointManager`: ``save``/``maybe_save``, the
snapshot record with its metrics, the check of RUN/latest before it moves, and what a finished save
records (:class:`SaveStats`). A save into the local tier goes on in :mod:`ckpt.snapshot.persisting`."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from ckpt.errors import CkptError, RefNotFoundError
from ckpt.snapshot.manager_state import ManagerState
from ckpt.snapshot.run import SNAPSHOT_FORMAT, SaveResult, is_snapshot
from ckpt.snapshot.tiers import caught, describe

log = logging.getLogger(__name__)


def _recorded(step: int, metrics: dict[str, float] | None) -> dict[str, Any]:
    """The metrics a snapshot records, as Python numbers: a 0-dim tensor or a NumPy scalar (the loss a
    training loop has at hand) is converted; anything else that is no number raises ValueError here,
    before anything is saved (JSON cannot hold it, keep_best cannot rank it). A NaN or infinite value
    (a diverged loss) is left out, with a warning: it must neither stop the training loop nor rank as
    the best."""
    import numbers

    out: dict[str, Any] = {}
    for name, v in (metrics or {}).items():
        if type(v) not in (int, float, bool):
            if isinstance(v, numbers.Integral):
                v = int(v)
            elif isinstance(v, numbers.Real):  # a NumPy float, say
                v = float(v)
            else:
                try:
                    v = v.item()  # a 0-dim tensor
                except (AttributeError, TypeError, ValueError, RuntimeError):  # no number, or several
                    v = None
            if type(v) not in (int, float, bool):
                raise ValueError(f"metric {name!r} of step {step} must be a number (or a 0-dim tensor, a NumPy "
                                 f"scalar), not {type(metrics[name]).__name__}: {metrics[name]!r:.80}")
        if isinstance(v, float) and not math.isfinite(v):
            log.warning("step %d: metric %s is %s, not recorded: this snapshot never counts as the best", step, name, v)
            continue
        out[name] = v
    return out


@dataclass(frozen=True)
class SaveStats:
    """What one save cost: seconds it blocked training and ran in the background, and what
    it wrote (None where this rank does not know: only the coordinator of a group does)."""

    step: int
    blocked_s: float
    background_s: float
    written_bytes: int | None = None
    logical_bytes: int | None = None
    staged_tensors: int | None = None
    reused_tensors: int | None = None
    copied_at_step_bytes: int = 0
    tier: str = "store"  # where it went: "local" (the local tier) or "store" (the durable store)
    replicated_bytes: int | None = None  # stored bytes this rank sent to its replica ranks (None: no replication)


class Saving(ManagerState):
    """``CheckpointManager``'s saving methods (a mixin: the state they use is
    :class:`~ckpt.snapshot.manager_state.ManagerState`'s)."""

    def ref(self, step: int) -> str:
        """The ref of the snapshot of ``step``: ``RUN/step-N``."""
        return self._target.ref(step)

    def maybe_save(self, step: int, state: dict[str, Any], metrics: dict[str, float] | None = None) -> bool:
        """Save if ``step`` is a multiple of ``every_n_steps``; True if it saved.

        After a preemption signal (``handle_signals=True``) it saves whatever the step,
        waits until that snapshot is durable, closes the manager and raises
        ``SystemExit(preempt_exit_code)``."""
        if self._final_snapshot_due(step):
            self.save(step, state, metrics, persist=True)
            self.close()
            log.warning("preempted: snapshot of step %d is durable; exiting with %d", step, self.preempt_exit_code)
            raise SystemExit(self.preempt_exit_code)
        durable = bool(self.every_n_steps) and step % self.every_n_steps == 0
        local = bool(self._local and self.local_every_n_steps) and step % self.local_every_n_steps == 0
        if durable or local:
            self.save(step, state, metrics, persist=durable)
            return True
        return False

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float] | None = None, *,
             persist: bool | None = None) -> None:
        """Snapshot ``state`` as step ``step``. Returns once what must be copied is copied
        (``save_mode="sync"``: once the snapshot is durable).

        With a local tier the snapshot goes there, and is then persisted to the durable
        store in the background when ``persist`` (default: ``step`` is a multiple of
        ``every_n_steps``, or an earlier persist failed). If the local tier fails (full,
        say) a snapshot to persist is written to the durable store directly, and any other
        is skipped, with a :class:`TierWarning` each: training goes on."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError("step must be a non-negative int")
        self._check_open(f"snapshot of step {step} not saved", "save")
        self._wait_save()
        if self._local is None:  # (with a local tier a persist moves it later)
            self._check_latest()
        t0 = time.perf_counter()
        snapshot = {"format": SNAPSHOT_FORMAT, "run": self.run, "step": step, "metrics": _recorded(step, metrics)}
        background = self.save_mode != "sync"
        unpersistable = None
        if self._local is None:
            job = self._path.save(step, state, snapshot, background=background)
        else:
            if persist is None:
                persist = bool(self.every_n_steps) and step % self.every_n_steps == 0
            persist = persist or self._persist_pending or self._behind_durable(step)
            if not persist and not self.every_n_steps and not self._said_local_only:  # (said once: not formatted each save)
                self._said_local_only = True
                self._tier_warning(f"snapshots of run {self.run!r} are kept in the local tier only: this CheckpointManager has no "
                                f"every_n_steps, so none is persisted to {self.store.url} but a preemption's final one (the "
                                "loss of the machine loses them); pass every_n_steps=M (a multiple of local_every_n_steps), "
                                "or save(..., persist=True)")
            self._saves += 1
            self._saved_step = step
            unpersistable = self._take_unpersistable()  # (a persist failed on damaged chunks of the tier)
            if unpersistable is not None:
                self._path.reuse_nothing()  # (this save's job removes them first: finish below)
            if self._local_full:
                self._make_room(step, state)
            if self._distributed:  # the ranks persist together, in the save thread
                from ckpt.snapshot.group import GroupUnavailable

                try:
                    saving = self._group_path.save(step, state, snapshot, background=background, persist_to=self._durable,
                                                   persist=persist)
                    persist = self._group_path.persisting  # agreed: one rank alone may know the run went back, say
                except GroupUnavailable as e:
                    # The ranks could not agree on a working group: as for a tier failure, unless this
                    # snapshot is due to the durable store (raised, as without tiers). Due as the ranks
                    # agreed (e.persist), not by this rank's own view: a rank that raised while the others
                    # went on training would leave them waiting for it in their next collective.
                    self._persist_pending = persist or e.persist
                    if e.persist:
                        raise
                    self._tier_warning(f"local tiers: snapshot of step {step} not saved ({e}); the next save tries again")
                    return
            else:
                saving = self._path.save(step, state, snapshot, background=background, fallback=self._durable if persist else None)
            job = self._tiered(step, saving, persist, self._saves)
        blocked = time.perf_counter() - t0

        def finish() -> None:
            if unpersistable is not None:
                self._forget_unpersistable(*unpersistable)
            t1 = time.perf_counter()
            result = job()
            if result is not None:
                self._saved(step, snapshot["metrics"], result, blocked, time.perf_counter() - t1)

        if background:
            self._inflight = self._pool.submit(finish)
        else:
            finish()

    def _behind_durable(self, step: int) -> bool:
        """Whether the durable store's RUN/latest names a step at or after ``step``: this save begins a
        new timeline (the run went back to an earlier snapshot, or began anew under its name). It is
        persisted then, as every save is without a local tier: else a restart would take up the
        abandoned timeline's newer step."""
        from ckpt.snapshot.steps import snapshot_step

        if not self._durable_known:
            try:
                # (RUN/latest missing: the newest step, as a restart would resume it, so that a run gone back
                # below it persists its saves and a restart resumes them, not that step)
                self._durable_step = snapshot_step(self._latest_manifest({})[1])
            except RefNotFoundError:
                self._durable_step = None
            except Exception as e:  # noqa: BLE001 - unreadable now: the persists due say more
                log.warning("could not read %s in %s (%s)", self._durable.latest, self.store.url, caught(log, "durable store", e))
                return False
            self._durable_known = True
        return self._durable_step is not None and step <= self._durable_step

    def _check_latest(self) -> None:
        """Warn (once) where the durable RUN/latest names a checkpoint a user pushed there (no snapshot), which
        this save is about to move away from: the next restart would otherwise resume without a word of it.
        Called before every write of it: a save without tiers; with tiers, a save due to the durable store (a
        full tier's direct save there, a group's persist) and, right before it moves RUN/latest, a persist. One
        ref read each; a manifest read only where RUN/latest changed since this manager last saw it.
        In a group rank 0 alone checks (no collective: a failed read only skips the check)."""
        if self._latest_warned or getattr(self._path, "rank", 0) != 0:
            return
        try:
            entry = self.store.refs_db.current(self._durable.latest)
            if entry is None or entry.target == self._latest_id:
                return
            self._latest_id = entry.target
            m = self.store.manifest(entry.target)
        except CkptError as e:
            log.warning("could not read %s in %s (%s)", self._durable.latest, self.store.url, describe(e))
            return
        if not is_snapshot(m):
            self._latest_warned = True
            self._tier_warning(f"{self._durable.latest} names checkpoint {entry.target[:12]}, pushed there ({m.source}), "
                               f"not a snapshot: this save moves {self._durable.latest} to its own snapshot; the pushed "
                               f"one stays in its history (`ckpt log {self._durable.latest}`): push it under a name "
                               "outside the run")

    def _saved(self, step: int, metrics: dict[str, float], r: SaveResult, blocked: float, background: float) -> None:
        if r.id is not None and (self._local is None or r.fell_back is not None or r.persisted):
            self._latest_id = r.id  # (RUN/latest names it now: the next save's check reads no manifest)
        if self.retention.best:  # (nothing else reads them)
            self._metrics[step] = metrics
        tier = "local" if self._local is not None and r.fell_back is None else "store"
        self.last_save = SaveStats(step, blocked, background, r.written_bytes, r.logical_bytes, r.staged_tensors,
                                   r.reused_tensors, r.copied_at_step_bytes, tier, r.replicated_bytes)
        if r.prunes and self._local is None:  # in a group the coordinator alone prunes, so that ranks never race to remove a ref
            self._retain(step)
