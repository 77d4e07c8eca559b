"""The local tier of a :class:`~ckpt.snapshot.manager.CheckpointManager`: its settings checked and the
tier opened (:meth:`Persisting._local_tier`), and what a save into it does next: the tier's bounds (a
failed or full tier warns, training goes on) and persisting its snapshots to the durable store in the
background, one at a time, the newest due taking the place of a waiting one (:class:`PersistStats`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.snapshot.manager_state import ManagerState
from ckpt.snapshot.retention import count_setting
from ckpt.snapshot.run import SaveJob, SaveResult, SnapshotError
from ckpt.snapshot.tiers import COLLECTIVE_FAILURES, caught, out_of_space

if TYPE_CHECKING:
    from ckpt.snapshot.local_tier import LocalTier, LocalTierUsage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PersistStats:
    """What persisting one local snapshot to the durable store cost: seconds in the background,
    and the chunks and stored bytes it copied (those the durable store lacked)."""

    step: int
    seconds: float
    chunks_sent: int
    bytes_sent: int
    chunks_present: int


class Persisting(ManagerState):
    """``CheckpointManager``'s local-tier and persist methods (a mixin: the state they use is
    :class:`~ckpt.snapshot.manager_state.ManagerState`'s)."""

    def _local_tier(self, local: Any, every: int | None, keep: int, max_bytes: int | None, replicas: int,
                    process_group: Any) -> LocalTier | None:
        """Check the tier settings; the local tier, if asked for."""
        from ckpt.snapshot.local_paths import adopt_old_key, check_default_layout, default_local_path, private_root
        from ckpt.snapshot.local_tier import LocalTier

        self.local_every_n_steps = count_setting("local_every_n_steps", every)
        count_setting("local_keep", keep)
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"local_max_bytes must be an int >= 1 or None, not {max_bytes!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas must be an int >= 0, not {replicas!r}")
        if local is None or local is False:
            for name, value in (("local_every_n_steps", every), ("local_max_bytes", max_bytes)):
                if value is not None:
                    raise ValueError(f"{name} applies to the local tier: pass it with local=True or local=PATH")
            if replicas:
                raise ValueError("replicas copy the local tier to peers: pass it with local=True or local=PATH")
            return None
        rank = None
        if process_group is not None:
            import torch.distributed as dist

            rank = dist.get_rank()  # global: the tier directory of this process on its node
        elif replicas:
            raise ValueError("replicas need a process group (peer ranks to copy the local tier to)")
        if self.every_n_steps and self.local_every_n_steps and self.every_n_steps % self.local_every_n_steps:
            raise ValueError(f"every_n_steps ({self.every_n_steps}) must be a multiple of local_every_n_steps "
                             f"({self.local_every_n_steps}): a persisted snapshot is a local one copied")
        if self.local_every_n_steps is None:
            self.local_every_n_steps = self.every_n_steps
        if local is True:
            path = default_local_path(self.store.config.store_id, self.store.url, self.run, rank)
            private_root(path.parent.parent if rank is not None else path.parent)
            if adopt_old_key(path, self.store.config.store_id, self.store.url, self.run, rank):
                log.info("local tier: the tier of run %r kept at its old default path moved to %s", self.run, path)
            check_default_layout(path, rank)
        else:
            path = os.fspath(local) if rank is None else os.path.join(os.fspath(local), f"rank-{rank}")
        return LocalTier(path, self.run, keep=keep, max_bytes=max_bytes, settings=self.store.settings,
                         compress=self._local_compress, durable=self.store, reset_foreign=local is True)

    @property
    def local_tier(self) -> LocalTierUsage | None:
        """What the local tier holds now (its path, steps and bytes: host memory under /dev/shm);
        None without one."""
        return self._local.usage() if self._local else None

    def _tiered(self, step: int, job: SaveJob, persist: bool, seq: int) -> Callable[[], SaveResult | None]:
        """``job`` (a save into the local tier), then the tier's bounds and the persist it asks for.
        A tier failure is a warning; a failed direct save to the durable store is raised."""
        local = self._local
        assert local is not None

        def run() -> SaveResult | None:
            try:
                if persist:  # the fallback may move RUN/latest in the durable store (a group's persist does)
                    with self._durable_lock:
                        self._check_latest()
                        result = job()
                        if result.fell_back is not None:
                            self._published, self._durable_step = seq, step
                else:
                    result = job()
            except SnapshotError as e:
                # One process: the state itself (modified under an overlapped save), not a tier failure.
                # A group: a snapshot due to the durable store that no tier took (its direct save
                # failed too, or a rank died) is raised as without tiers.
                if not self._distributed or persist:
                    raise
                self._tier_warning(f"local tiers: snapshot of step {step} not saved ({e}); the next save tries again")
                self._free_leftovers()
                self._local_full = out_of_space(e, getattr(self._path, "rank", None))
                return None
            except Exception as e:  # noqa: BLE001 - the local tier failed; training goes on
                # (a group's save runs collectives: a peer gone fails them with gloo's RuntimeError)
                also = COLLECTIVE_FAILURES if self._distributed else ()
                self._tier_warning(f"local tier: snapshot of step {step} not saved ({caught(log, 'local tier', e, also)}); "
                                   "the next save tries again")
                local.drop(step)
                self._free_leftovers()
                self._local_full = out_of_space(e)
                self._persist_pending = self._persist_pending or persist
                return None
            self._local_full = result.tier_full  # (a group: its path says so for this rank)
            if result.fell_back is not None:
                self._tier_warning(f"local tier: snapshot of step {step} not saved ({result.fell_back}); "
                                   "it was written to the durable store directly")
                self._persist_pending = False
                self._free_leftovers()
                if result.prunes:  # in a group, the coordinator alone
                    self._retain(step)
                return result
            if result.tier_error is not None:
                self._tier_warning(f"local tier: part of the snapshot of step {step} not kept ({result.tier_error}); "
                                   "the next save tries again")
            if result.persist_error is not None:
                self._persist_pending = True
                self._tier_warning(f"persisting the snapshot of step {step} to {self.store.url} failed "
                                   f"({result.persist_error}); the next save persists again")
            elif result.persisted:
                self._durable_step = step
                self._persist_pending = False
                if result.prunes:
                    self._retain(step)
            if self._distributed:
                return result  # the path pruned its tier and persisted
            try:
                local.drop_after(step)
                local.prune()
            except Exception as e:  # noqa: BLE001
                self._tier_warning(f"local tier: could not drop old snapshots ({caught(log, 'local tier', e)})")
            if persist:
                self._persist_pending = False
                self._request_persist(step, seq, result.id)
            return result

        return run

    def _make_room(self, step: int, state: dict[str, Any]) -> None:
        """The last local save found the tier full (it ran out of space, or was refused before it wrote): drop
        older snapshots where the medium's free space with what they free holds what this save adds (its tensors
        known to change since the last snapshot, not a frozen base the tier holds), and the newest too only where
        that does not and the room for all of its tensors then is (:meth:`LocalTier.make_room`), so that the tier
        holds the newest step again instead of refusing every save; else none (another tenant of the medium holds
        the room), and the tier keeps what it has. Until this save lands, a restart restores from the durable store."""
        from ckpt.snapshot.local import LocalSnapshots

        local = self._local
        assert local is not None
        self._local_full = False
        try:
            if self._distributed:
                # (a group's rank holds its shards and replicas instead: make_room estimates those; the snapshot the group
                # continues from is never dropped before the others, as on one process: it dropped the step the run went
                # back to first, and kept the timeline it left; on a compressing tier too it asks for the most one holds:
                # it knows no raw bytes of its next save (DCP plans its shards as it writes): a state grown since its
                # snapshots (AdamW's moments after a snapshot of step 0) is not counted, and its saves may keep failing)
                dropped = local.make_room(step, None, since=self._group_path.last_id)
            else:
                assert isinstance(self._path, LocalSnapshots)
                sizes, changed, since = self._path.save_sizes(state)
                bundles = self._path.run.bundles
                whole = local.bound(sizes, bundles, raw=True)  # (a compressing tier caps its estimate by these)
                dropped = local.make_room(step, whole if changed is None else local.bound(changed, bundles, raw=True), whole, since)
        except Exception as e:  # noqa: BLE001
            self._tier_warning(f"local tier: could not make room for step {step} ({caught(log, 'local tier', e)})")
            return
        if dropped:
            self._tier_warning(f"local tier: full at its last save; dropped step(s) {', '.join(map(str, dropped))} "
                               f"to make room for step {step}")

    def _free_leftovers(self) -> None:
        """Free what a failed local save left in the tier (chunks no snapshot names), so that a full
        tier has room again for the next save."""
        local = self._local
        assert local is not None
        try:
            local.prune()
        except Exception as e:  # noqa: BLE001
            log.warning("local tier: could not free the leftovers of a failed save (%s)", caught(log, "local tier", e))

    def _request_persist(self, step: int, seq: int, mid: str | None) -> None:
        local = self._local
        assert local is not None
        with self._persist_lock:
            local.pinned.add(step)
            if self._persist_slot is not None and self._persist_slot[0] != step:
                self._unpin(self._persist_slot[0])  # superseded before it started: never persisted
            self._persist_slot = (step, seq, mid)
            if self._persisting is None or self._persisting.done():
                self._persisting = self._persist_pool.submit(self._persist_loop)

    def _persist_loop(self) -> None:
        while True:
            with self._persist_lock:
                slot, self._persist_slot = self._persist_slot, None
            if slot is None:
                return
            self._persist(*slot)

    def _persist(self, step: int, seq: int, mid: str | None) -> None:
        """Copy the local snapshot of ``step`` (checkpoint ``mid``, where the save knows it) to the durable
        store: only the chunks it lacks, as stored."""
        from ckpt.snapshot.peer_refill import names_a_chunk_lost
        from ckpt.store.copy import copy_refs

        local = self._local
        assert local is not None
        t0 = time.perf_counter()
        try:
            # By the id this run saved, not what the tier's ref names now: a tier in a shared /dev/shm is
            # anyone's to write, and a ref moved there would else be published as this run's snapshot.
            spec = local.ref(step) if mid is None else f"{mid}:{local.ref(step)}"
            report = copy_refs(local.store, self.store, [spec], recode=not self._local_compress)
            with self._durable_lock:
                # Checked again right before the move: a user's push made while the local job and the copy ran (seconds
                # for a large state) would else be moved away from without a word (one ref read a persist).
                if seq > self._published:  # (a save made since may have gone there directly)
                    self._check_latest()
                    self.store.refs_db.set(self._durable.latest, report.refs[local.ref(step)], alias=True)
                    self._latest_id = report.refs[local.ref(step)]
                    self.store.objects.backend.flush()
                    self._published, self._durable_step = seq, step
            self.last_persist = PersistStats(step, time.perf_counter() - t0, report.chunks_sent, report.bytes_sent,
                                             report.chunks_present)
            self._retain(step)
        except Exception as e:  # noqa: BLE001 - the durable store still holds the previous snapshot
            self._persist_pending = True
            if names_a_chunk_lost(e):
                with self._persist_lock:  # (the next save removes its damaged chunks from the tier, in its thread)
                    self._unpersistable = (e, mid)
            self._tier_warning(f"persisting the snapshot of step {step} to {self.store.url} failed ({caught(log, 'persist', e)}); "
                               "the next save persists again")
        finally:
            with self._persist_lock:
                self._unpin(step)

    def _take_unpersistable(self) -> tuple[Exception, str | None] | None:
        """A persist's failure on a chunk the tier holds damaged or lacks, and the snapshot it persisted (the next
        save deals with it: :meth:`_forget_unpersistable`), once."""
        with self._persist_lock:
            found, self._unpersistable = self._unpersistable, None
            return found

    def _forget_unpersistable(self, e: Exception, mid: str | None) -> None:
        """A persist that failed on a chunk the tier holds damaged (or lacks) would fail at every save after it
        (:func:`~ckpt.snapshot.peer_refill.forget_unpersistable`): those of the snapshot's chunks go, with the steps
        naming them. Run by the next save, in its thread, before it writes the tier (a save running meanwhile
        would reuse on their presence chunks that only the steps removed named, and lose them to the tier's gc);
        that save reuses nothing of the snapshot before (its caller said so: saving.py)."""
        from ckpt.snapshot.peer_refill import forget_unpersistable
        from ckpt_store.storage.chunk_lists import referenced_chunks

        local = self._local
        assert local is not None
        try:  # (every chunk of the snapshot checked: one persist finds them all, not one per failed persist)
            chunks = referenced_chunks(local.store.objects.get_manifest(mid)) if mid is not None else []
        except Exception:  # noqa: BLE001 - the chunk named by the error is checked all the same
            chunks = []
        removed = forget_unpersistable(local, e, chunks)
        if removed is not None:
            self._tier_warning(f"local tier: {removed} (found by a persist that failed on them)")

    def _unpin(self, step: int) -> None:
        """Let the tier prune ``step`` again (under ``_persist_lock``). A save of an earlier step made
        since began a new timeline: its ``drop_after`` kept ``step`` only because it was pinned, and as
        the tier's newest step a restart would resume it. It goes now."""
        local = self._local
        assert local is not None
        local.pinned.discard(step)
        if self._saved_step is not None and step > self._saved_step:
            try:
                local.drop_after(self._saved_step)
            except Exception as e:  # noqa: BLE001 - the next save of an earlier step drops it again
                self._tier_warning(f"local tier: could not drop step {step} of the timeline the run left "
                                   f"({caught(log, 'local tier', e)})")
