"""The retention of a :class:`~ckpt.snapshot.manager.CheckpointManager` applied to the store: the run's
live steps (``steps()``), which of them retention counts (snapshots only, never a checkpoint pushed
under the run's name) and removing the others' refs. The rules themselves are
:mod:`ckpt.snapshot.retention`."""

from __future__ import annotations

import logging

from ckpt.errors import CkptError, RefConflictError, RefNotFoundError
from ckpt.snapshot.manager_state import ManagerState
from ckpt.snapshot.run import is_snapshot
from ckpt.snapshot.steps import run_steps, snapshot_test
from ckpt.snapshot.tiers import caught, describe

log = logging.getLogger(__name__)


class Pruning(ManagerState):
    """``CheckpointManager``'s retention methods (a mixin: the state they use is
    :class:`~ckpt.snapshot.manager_state.ManagerState`'s)."""

    def steps(self) -> list[int]:
        """Steps of the run's live snapshots, oldest first. A checkpoint pushed under the run's name
        (``RUN/step-N``) is none: told by its summary in the store's metadata index, else by its manifest;
        one that cannot be read is listed (restoring it names the damage)."""
        found, view = run_steps(self.store, self.run)
        snapshot = snapshot_test(self.store, found.values(), view=view)
        return sorted(s for s, mid in found.items() if snapshot(mid))

    def _metric(self, step: int) -> dict[str, float]:
        if step not in self._metrics:
            m = self.store.manifest(self.ref(step))
            snap = m.extra.get("snapshot")
            self._metrics[step] = (snap.get("metrics") if isinstance(snap, dict) else None) or {}
        return self._metrics[step]

    def _snapshot_id(self, step: int, mid: str) -> bool:
        """Whether ``mid``, which RUN/step-``step`` names, is a snapshot (:func:`~ckpt.snapshot.run.is_snapshot`),
        read once per step and id. A checkpoint pushed under the run's name is not (with a warning): retention
        neither counts nor removes it. One that cannot be read is left alone too (the next save reads again)."""
        seen = self._snapshot_ids.get(step)
        if seen is not None and seen[0] == mid:
            return seen[1]
        try:
            known = is_snapshot(self.store.manifest(mid))
        except CkptError as e:
            log.warning("retention: %s unreadable (%s): not counted, kept", self.ref(step), describe(e))
            return False
        self._snapshot_ids[step] = (mid, known)
        if not known:
            log.warning("retention: %s is not a snapshot (pushed under the run's name): not counted, kept", self.ref(step))
        return known

    def _retain(self, saved: int) -> None:
        """Apply the retention rules after the snapshot of step ``saved`` landed in the durable store.

        The steps counted are those this manager knows of (the run's, listed at its first retention,
        and each saved since), each checked against the store: a save costs requests per step kept,
        not a listing of every step the run ever saved. One another process saved meanwhile is not
        counted, which only keeps more (each rule keeps a step where fewer others compete with it);
        one removed meanwhile is not counted either (counted, it would take the place of one to keep)."""
        if self.retention.keeps_all:
            return
        # One at a time: the persist thread and a direct save can both get here, and the second
        # to remove a ref would raise RefNotFoundError out of save().
        from ckpt.snapshot.steps import snapshot_step
        from ckpt_store.storage.errors import StoreFormatError

        with self._retaining:
            if self._retained is None:
                from ckpt.store.catalog import snapshot_kinds

                found, view = run_steps(self.store, self.run)
                # The snapshots among them, told by the index's summaries, not a manifest read each; the rest
                # (a pushed one, or one they cannot tell) are read below: a pushed one is named in a warning.
                kinds = snapshot_kinds(self.store, found.values(), view)
                self._snapshot_ids.update({s: (mid, True) for s, mid in found.items() if kinds.get(mid, (False, 0.0))[0]})
                self._retained = set(found)
            self._retained.add(saved)
            steps = []
            targets: dict[int, str] = {}  # what each counted step named when checked: removed only while it still does
            for s in sorted(self._retained):
                try:
                    entry = self.store.refs_db.current(self.ref(s))
                except StoreFormatError:  # damaged: not counted, never removed (as steps() leaves it out)
                    continue
                if entry is None:
                    self._retained.discard(s)
                    self._snapshot_ids.pop(s, None)
                elif self._snapshot_id(s, entry.target):  # a checkpoint pushed under the name is not counted, never removed
                    steps.append(s)
                    targets[s] = entry.target
            metrics = {s: self._metric(s) for s in steps} if self.retention.best else {}
            try:  # below the newest step where the run went back: the last ones are counted up to it
                latest = snapshot_step(self.store.manifest(self._durable.latest))
            except Exception as e:  # noqa: BLE001 - no ref, or unreadable now: every step counts, as before
                if not isinstance(e, RefNotFoundError):
                    log.warning("retention: could not read %s (%s); counting every step", self._durable.latest,
                                caught(log, "retention", e))
                latest = None
            keep = set(self.retention.keep(steps, metrics, latest))
            for s in [s for s in list(self._metrics) if s not in keep]:  # (a step not yet counted is read again)
                self._metrics.pop(s, None)
            for s in steps:
                if s not in keep:
                    self._retained.discard(s)
                    self._snapshot_ids.pop(s, None)
                    try:
                        self.store.remove(self.ref(s), expect=targets[s])
                    except RefNotFoundError:
                        pass  # removed meanwhile, by another process
                    except RefConflictError:  # pushed over meanwhile: not this manager's snapshot any more
                        log.warning("retention: %s moved while it was being pruned: kept", self.ref(s))
