"""The restore side of :class:`~ckpt.snapshot.manager.CheckpointManager`: ``restore_latest``,
``latest_step`` and ``restore``, choosing the snapshot among the tiers (the newest one that can be
assembled) and reading each chunk from the nearest tier holding it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ckpt.errors import CkptError, RefNotFoundError
from ckpt.snapshot.manager_state import ManagerState
from ckpt.snapshot.run import is_snapshot, not_a_snapshot
from ckpt.snapshot.tiers import MISSES as TIER_MISSES
from ckpt.snapshot.tiers import caught, describe

if TYPE_CHECKING:
    from ckpt.format.manifest import Manifest
    from ckpt.snapshot.tiers import Tiers

_T = TypeVar("_T")
log = logging.getLogger(__name__)


class Restoring(ManagerState):
    """``CheckpointManager``'s restoring methods (a mixin: the state they use is
    :class:`~ckpt.snapshot.manager_state.ManagerState`'s)."""

    def restore_latest(self, state: dict[str, Any]) -> int | None:
        """Restore the newest snapshot into ``state`` in place; its step, or None if the run has none.

        With a local tier: the newest of the local and durable snapshots, each chunk read from
        the local tier where it is there with a correct hash, else from the durable store. A
        snapshot that no tier holds completely (a local one not persisted, with a damaged
        chunk) is skipped, with a :class:`TierWarning`, for the next newest.
        :attr:`last_restore` says which step was restored and the bytes each tier served. A closed
        manager raises :class:`SnapshotError`, as its ``save`` does."""
        self._check_open("nothing restored", "restore")
        self.wait()
        if self._local is None:
            parsed: dict[str, Manifest] = {}  # (in a group, rank 0's: the others read the one chosen)
            mid = self._resolve(lambda: self._latest_manifest(parsed)[0])
            return None if mid is None else self._restore(state, mid, parsed)
        if self._distributed:
            path = self._group_path
            assert path.peers is not None
            chosen = path.choose(self.store, self._durable.latest, self._warn_once)
            if chosen is None:
                return None
            chosen_step, mid, tiers = chosen
            try:
                step = path.restore(state, mid, tiers)
            except Exception:  # (a failed DCP load is a SnapshotError, not a tier miss)
                self._mend_after_failure(chosen_step, mid, tiers)
                raise
            self.last_restore = {"step": step, **tiers.served}
            self._refill(step, mid, tiers)
            return step
        candidates, parsed = self._candidates()
        damaged: set[str] = set()  # the tier's copies found damaged by the snapshots passed over: mended after
        for i, (step, mid) in enumerate(candidates):
            try:
                return self._restore(state, mid, parsed, damaged, last=i == len(candidates) - 1)
            except TIER_MISSES as e:
                if i == len(candidates) - 1:
                    raise
                self._tier_warning(f"snapshot of step {step} cannot be assembled from any tier ({describe(e)}); "
                                   f"restoring step {candidates[i + 1][0]} instead")
        return None

    def latest_step(self) -> int | None:
        """The step :meth:`restore_latest` would restore first, without restoring it; None if the run
        has no snapshot in any tier. In a group the ranks choose it together, as a restore does."""
        from ckpt.snapshot.steps import snapshot_step

        self._check_open("no step looked up", "look it up")
        self.wait()
        if self._local is None:
            def find() -> tuple[str, int | None, str | None]:  # in a group, on rank 0 alone: every rank says the same
                mid, m = self._latest_manifest({})
                return mid, snapshot_step(m), None if is_snapshot(m) else m.source

            found = self._resolve(find)
            if found is None:
                return None
            mid, step, pushed = found
            if pushed is not None:  # (as restore_latest refuses it, not "no snapshot")
                raise not_a_snapshot(mid, pushed)
            return step
        if self._distributed:
            chosen = self._group_path.choose(self.store, self._durable.latest, self._warn_once)
            return None if chosen is None else chosen[0]
        candidates, _ = self._candidates()
        return candidates[0][0] if candidates else None

    def restore(self, state: dict[str, Any], step: int) -> int:
        """Restore the snapshot of ``step`` into ``state`` in place (from the nearest tier holding each chunk).
        Where the local tier and the durable store hold different snapshots of ``step``, the one made last: the
        other is of a timeline the run left (a :class:`TierWarning` says so when it is the tier's)."""
        self._check_open(f"snapshot of step {step} not restored", "restore")
        self.wait()

        def find() -> str:
            if self._local is not None:
                try:
                    mid = self._local.store.resolve(self.ref(step))
                except RefNotFoundError:
                    pass
                else:
                    return self._timeline_of(step, mid)
            return self.store.resolve(self.ref(step))

        if not self._distributed:
            return self._restore(state, find())
        mid = self._resolve(find)
        if mid is None:  # (on every rank alike)
            raise RefNotFoundError(f"no snapshot of step {step} in run {self.run!r}", hint="see mgr.steps() or `ckpt ls`")
        return self._restore(state, mid)

    def _timeline_of(self, step: int, mid: str) -> str:
        """Of the local tier's snapshot ``mid`` of ``step`` and the durable store's, if another, the one made last:
        that of the timeline the run is on (the other was left when the run went back, or began anew elsewhere;
        snapshots are made in step order along a timeline, and persisting keeps a manifest's time)."""
        assert self._local is not None
        try:
            durable = self.store.resolve(self.ref(step))
        except RefNotFoundError:
            return mid
        if durable == mid:
            return mid
        try:
            theirs = self.store.manifest(durable)
            if not is_snapshot(theirs) or self._local.store.manifest(mid).created >= theirs.created:
                return mid  # (a checkpoint a user pushed as RUN/step-N is no snapshot of the run)
        except (CkptError, OSError):
            return mid  # (one of them unreadable: the tier's, as before; its restore names the damage)
        self._tier_warning(f"local tier: snapshot of step {step} was made before the durable store's: it is of a "
                           "timeline the run left; the durable store's is restored")
        return durable

    def _resolve(self, find: Callable[[], _T]) -> _T | None:
        """``find()``, None where it finds no ref; in a group rank 0's, the same on every rank."""
        if self._distributed:
            return self._group_path.resolve(find)
        try:
            return find()
        except RefNotFoundError:
            return None

    def _candidates(self) -> tuple[list[tuple[int, str]], dict[str, Manifest]]:
        """Snapshots to restore, newest first: (step, manifest id), from the local tier and the durable
        store; and the manifests parsed to choose them, by id (the restore reads one of them)."""
        from ckpt.snapshot.steps import latest_manifest, left_behind, left_behind_message, snapshot_step

        local = self._local
        assert local is not None
        found: dict[int, str] = {}
        parsed: dict[str, Manifest] = {}
        durable: tuple[int, str, float] | None = None  # the durable RUN/latest: step, id, made at
        try:
            mid, m = latest_manifest(self.store, self.run, self._warn_once, parsed, copy=local.store)
            if not is_snapshot(m):  # refused, as without a tier: never passed over for an older step, or none
                raise not_a_snapshot(mid, m.source)
            step = snapshot_step(m)
            if step is not None:
                found[step] = mid
                durable = (step, mid, m.created)
        except RefNotFoundError:
            pass

        def made(mid: str) -> float:
            m = parsed[mid] = local.store.manifest(mid)
            return m.created

        for step in local.steps():
            try:
                mid = local.store.resolve(local.ref(step))
                if durable is not None and left_behind(step, mid, lambda mid=mid: made(mid), durable):
                    self._tier_warning(left_behind_message("local tier", step, durable[0]))
                    continue
                found[step] = mid
            except TIER_MISSES as e:
                self._tier_warning(f"local tier: snapshot of step {step} unreadable ({describe(e)})")
        return sorted(found.items(), reverse=True), parsed

    def _restore(self, state: dict[str, Any], mid: str, parsed: dict[str, Manifest] | None = None,
                 damaged: set[str] | None = None, *, last: bool = True) -> int:
        """Restore ``mid`` from this manager's tiers; ``parsed``: manifests already read, by id. ``damaged``: the tier's
        copies earlier tries found damaged (their snapshots could not be assembled), mended with this one's; where
        this one cannot be assembled either, its own are added, and mended now where it is the ``last`` try (a failed
        restore leaves no damaged copy for a save to reuse: a run begun again from scratch would name it)."""
        from ckpt.snapshot.tiers import Tiers

        peers = getattr(self._path, "peers", None)
        if peers is not None:
            tiers = peers.tiers(self.store)
        else:
            tiers = Tiers(([("local", self._local.store)] if self._local else []) + [("store", self.store)])
        if parsed and mid in parsed:
            tiers.manifests[mid] = parsed[mid]
        tiers.damaged |= damaged or set()
        try:
            step = self._path.restore(state, mid, tiers)
        except Exception as e:
            if damaged is not None:
                damaged |= tiers.damaged
            if last or not isinstance(e, TIER_MISSES):  # (restore_latest tries the next only after a tier miss)
                self._mend_after_failure(None, mid, tiers)
            raise
        self.last_restore = {"step": step, **tiers.served}
        if peers is not None or tiers.damaged:
            self._refill(step, mid, tiers)
        return step

    def _mend_after_failure(self, step: int | None, mid: str, tiers: Tiers) -> None:
        """After a restore of ``mid`` failed: the damaged copies it found in the local tier mended (:meth:`_refill`), so
        that no save reuses one (a run begun again from scratch names the same chunks)."""
        if tiers.damaged and self._local is not None and not self._closed:  # (closed meanwhile: no save thread)
            self._refill(step, mid, tiers, restored=False)

    def _refill(self, step: int | None, mid: str, tiers: Tiers, *, restored: bool = True) -> None:
        """This rank's tier keeps what the restore fetched from peers (a replaced machine's tier refills), and
        verified copies replace the damaged ones its load read elsewhere (one process: that alone,
        :func:`~ckpt.snapshot.peer_refill.mend`), in the save thread: training starts at once, and the next save
        (or :meth:`wait`) waits for it, so that no save reuses a damaged copy. Chunks decoded straight into the
        tensors are read back from them, hashed again: where training changed one first, the tier does not name
        the step and a TierWarning says so, once (``wait()`` right after the restore avoids it). Not ``restored`` (the
        restore of ``mid`` failed): the damaged copies it found are mended alone. Where the mend removed or could not
        replace some, the next save reuses nothing of the snapshot restored (it may be among the steps removed)."""
        from ckpt.snapshot.peer_refill import mend

        peers = getattr(self._path, "peers", None)
        local = self._local
        assert local is not None

        def run() -> None:
            try:
                if peers is None or not restored:
                    kept, problem = True, mend(local, tiers, mid, tiers.damaged - tiers.from_peers)
                else:
                    kept, problem = peers.refill(step, mid, tiers)
            except Exception as e:  # noqa: BLE001 - the restore stands; the tier is only emptier
                kept, problem = False, caught(log, "refill", e)
            if problem is not None:
                self._path.reuse_nothing()  # (the step restored may be among those removed)
                of = "" if step is None else f" step {step}"
                if not restored:
                    said = f"damaged copies found by a failed restore{' of' + of if of else ''} not all replaced"
                elif peers is None:
                    said = f"damaged copies found restoring{of} not all replaced"
                else:
                    said = f"the chunks of{of} fetched from peers not kept"
                self._tier_warning(f"local tier: {said} ({problem})")
            elif not kept:
                self._warn_once(f"local tier: step {step}, restored from peers, is not kept there: training changed the "
                                "state before the refill read it (the peers' tiers still hold it, and this tier holds "
                                "the step again at the next save); call wait() right after restore_latest to keep it")

        self._inflight = self._pool.submit(run)
