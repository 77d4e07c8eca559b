"""``CheckpointManager`` across ranks: every rank calls the same ``save``/``restore_latest``.

With a process group, a snapshot is a DCP save through :class:`ckpt.dcp.Writer`
(each rank writes its own shards; the coordinator commits ``RUN/step-N`` and
``RUN/latest`` once all have finished) and a restore is a DCP load, resharded to
the current layout. Checkpoint collectives run on a gloo group of their own, with
its own timeout: an asynchronous save never interleaves with the training's
collectives, and a rank that dies makes the others fail with
:class:`~ckpt.snapshot.run.SnapshotError` after ``timeout_s`` instead of hanging. A group
whose collective failed is rebuilt by all ranks at the next save (ckpt/snapshot/group.py).

What is per rank and what is shared (DCP saves a tensor that is not a DTensor once):

* **Per rank**: :class:`~ckpt.snapshot.state.RNGState` (Python's ``random``, NumPy's global
  generator, torch's CPU generator and every CUDA one) and anything wrapped in
  :class:`~ckpt.snapshot.state.PerRank`. Each rank saves its own copy under
  ``KEY.rank-R`` and gets its own back, so restoring needs the same number of ranks.
* **Shared**: everything else (modules, optimizers, schedulers, grad scalers, plain
  values) is assumed identical on every rank, as DDP keeps it, or sharded as
  DTensors (FSDP2, tensor parallel). Rank 0's copy of a replicated tensor is saved
  (with DDP, buffers such as BatchNorm statistics are rank 0's, which DDP broadcasts
  anyway). Each save compares the ranks' non-tensor values and tensor shapes and
  refuses, naming the key, when they differ: wrap per-rank state in ``PerRank``.
  Metrics passed to ``save`` are rank 0's.

Restoring: :mod:`ckpt.snapshot.distributed_restore`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException

from ckpt.snapshot.dcp_state import fingerprint, skeleton
from ckpt.snapshot.distributed_restore import FAILURES, DistributedRestoring, first_failure
from ckpt.snapshot.group import CheckpointGroup
from ckpt.snapshot.restore_checks import snapshot_records
from ckpt.snapshot.run import SaveResult, SnapshotRun
from ckpt.snapshot.state import (
    Stateful,
    autograd_flags,
    is_per_rank,
    tensor_devices,
)
from ckpt.snapshot.tiers import COLLECTIVE_FAILURES, caught, out_of_space

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ckpt.snapshot.local_tier import LocalTier
    from ckpt.snapshot.peers import Peers
    from ckpt.snapshot.run import SaveJob

log = logging.getLogger(__name__)


class DistributedSnapshots(DistributedRestoring):
    """The :class:`~ckpt.snapshot.run.SnapshotPath` of every rank of a process group."""

    def __init__(self, run: SnapshotRun, process_group: Any, timeout_s: float, *, local: LocalTier | None = None,
                 replicas: int = 0, replica_stride: int = 1, replica_nodes: Sequence[Any] | None = None) -> None:
        """``local``: this rank's local tier, where ``run`` points (snapshots are replicated to
        ``replicas`` peer ranks, see ckpt/snapshot/peers.py); else ``run`` is the durable store."""
        import torch.distributed as dist

        self.run = run
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.timeout_s = timeout_s
        # Every member calls this in the same order (it is part of constructing the manager).
        self.checkpoint_group = CheckpointGroup(process_group, timeout_s)
        self.last_id: str | None = None
        self.persisting = False  # whether the save last prepared persists (the ranks' agreed decision)
        self.peers: Peers | None = None
        if local is not None:
            from ckpt.snapshot.peers import Peers

            self.peers = Peers(local, self.group, replicas, stride=replica_stride, nodes=replica_nodes)

    @property
    def group(self) -> Any:
        """The gloo group the checkpoint collectives run on (a new one after :meth:`agree` rebuilt it)."""
        return self.checkpoint_group.pg

    def agree(self, what: str, persist: bool = False) -> bool:
        """Before a save or restore (every rank alike): rebuild the group if a collective on it failed
        on any rank. Returns whether any rank asked to ``persist`` the save. Raises
        :class:`~ckpt.snapshot.group.GroupUnavailable` when the ranks cannot."""
        asked = self.checkpoint_group.agree(what, persist)
        if self.peers is not None:
            self.peers.group = self.group
        return asked

    @property
    def tag(self) -> str:
        """The key under which this rank's copy of per-rank state is saved."""
        return f"rank-{self.rank}"

    # -- saving ------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], snapshot: dict[str, Any], *, background: bool,
             fallback: SnapshotRun | None = None, persist_to: SnapshotRun | None = None, persist: bool = True) -> SaveJob:
        """The ranks persist the snapshot to ``persist_to`` if any of them asks to (``persist``): each
        decides from what it alone knows (its own read of the durable store, its own failed persist), and
        a rank that persisted alone would wait for the others in a collective they never join. The
        decision is :attr:`persisting`, the same on every rank."""
        from ckpt.dcp.checkpoint import Writer

        persist = self.agree(f"snapshot of step {step}", persist and persist_to is not None)
        prepared: dict[str, Any] = {}
        per_rank = []
        for key, obj in state.items():
            if is_per_rank(obj):
                prepared[key] = {self.tag: obj.state_dict()}
                per_rank.append(key)
            elif isinstance(obj, Stateful) and not isinstance(obj, type):
                prepared[key] = obj.state_dict()
            else:
                prepared[key] = obj
        self.persisting = self._check_identical(step, {k: v for k, v in prepared.items() if k not in per_rank}, persist)
        persist_to = persist_to if self.persisting else None
        tensors = _tensors(prepared)  # (DCP name -> (tensor, its state key)), flattened once for both records
        flags = autograd_flags({n: t for n, (t, key) in tensors.items() if key not in per_rank})
        # A plain value's tensors come back as new tensors (value_target): where they lived is recorded
        devices = tensor_devices({n: t for n, (t, key) in tensors.items() if not isinstance(state[key], Stateful)})
        # A plain value's dicts, rebuilt from DCP's names alone, would come back sorted, str-keyed, without their empty dicts
        shapes = {k: sk for k, v in prepared.items() if not isinstance(state[k], Stateful) and (sk := skeleton(k, v)) is not None}
        record = {**snapshot, "ranks": True, "world": self.world, "keys": sorted(state), "per_rank": sorted(per_rank),
                  **({"autograd": flags} if flags else {}), **({"devices": devices} if devices else {}),
                  **({"skeletons": shapes} if shapes else {}), **snapshot_records(state)}
        base = self.last_id if self.run.delta else None
        if self.peers is not None:
            from ckpt.snapshot.peers import TierWriter

            writer: Writer = TierWriter(self.run.store, self.run.ref(step), base=base, delta=base is not None,
                                        extra={"snapshot": record})
        else:
            writer = Writer(self.run.store, self.run.ref(step), base=base, delta=base is not None, aliases=(self.run.latest,),
                            extra={"snapshot": record})
        if background:
            # What dcp.async_save does (its default stager), but the copy stays ours: a snapshot
            # due to the durable store whose local save fails is written there from it.
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                staged = stager.stage(prepared)
            finally:
                stager.close()
            return lambda: self._write(step, staged, writer, record, persist_to)
        return lambda: self._write(step, prepared, writer, record, persist_to)

    def _write(self, step: int, state: dict[str, Any], writer: Any, record: dict[str, Any],
               persist_to: SnapshotRun | None) -> SaveResult:
        try:
            return self._write_collectively(step, state, writer, record, persist_to)
        except FAILURES as e:
            self.checkpoint_group.failed(e)
            raise

    def _write_collectively(self, step: int, state: dict[str, Any], writer: Any, record: dict[str, Any],
                            persist_to: SnapshotRun | None) -> SaveResult:
        """The collective save of ``state`` through ``writer``; with local tiers, a snapshot due to
        ``persist_to`` whose local save failed on some rank (every rank learns it from DCP) is
        written to the durable store directly, as without tiers (:attr:`SaveResult.fell_back`)."""
        import torch.distributed.checkpoint as dcp

        try:
            md = dcp.save(state, storage_writer=writer, process_group=self.group, planner=_planner())
        except FAILURES as e:  # any failure of any rank: one clear error
            if self.peers is None or persist_to is None or not (isinstance(e, CheckpointException) and e.failures):
                raise self._error(step, e) from e  # (no agreement: a rank died or hung; the durable save would too)
            return self._write_durably(step, state, record, persist_to, e)
        return self._done(step, writer, persist_to, md.storage_meta.checkpoint_id if md.storage_meta else None)

    def _write_durably(self, step: int, state: dict[str, Any], record: dict[str, Any], run: SnapshotRun,
                       cause: CheckpointException) -> SaveResult:
        import torch.distributed.checkpoint as dcp

        from ckpt.dcp.checkpoint import Writer

        writer = Writer(run.store, run.ref(step), delta=False, aliases=(run.latest,), extra={"snapshot": record})
        try:
            dcp.save(state, storage_writer=writer, process_group=self.group, planner=_planner())
        except FAILURES as e:
            raise self._error(step, e) from e
        last = writer.last  # set on the coordinator, which committed the snapshot
        rank, err, trace = first_failure(cause, self.rank)
        return SaveResult(last.id if last else None, last.written_bytes if last else None,
                          last.logical_bytes if last else None, prunes=self.rank == 0,
                          fell_back=f"rank {rank}: {self._said(rank, err, 'local tier', trace)}", tier_full=out_of_space(cause, self.rank))

    def _check_identical(self, step: int, shared: dict[str, Any], persist: bool) -> bool:
        """Refuse (on every rank alike) shared state whose values or tensor shapes differ between ranks:
        DCP would save one rank's copy and restore it on all of them; and a save whose ``step`` differs
        between ranks (a preemption signal that one rank saw before its ``maybe_save`` and another
        after): it would record the coordinator's step over the other ranks' state. Returns whether
        any rank asked to ``persist`` (gathered with the state's fingerprints: no collective of its own)."""
        import torch.distributed as dist

        from ckpt.snapshot.run import SnapshotError

        mine = {key: fingerprint(key, value) for key, value in shared.items()}
        gathered: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(gathered, (mine, persist, step), group=self.group)
        except FAILURES as e:  # a peer died or stalled since the ranks agreed on the group
            from ckpt.snapshot.group import GroupUnavailable

            self.checkpoint_group.failed(e)
            raise GroupUnavailable(f"snapshot of step {step} not saved: {caught(log, 'checkpoint group', e, COLLECTIVE_FAILURES)}",
                                   hint=f"a rank failed, died or took longer than timeout_s={self.timeout_s:g}; "
                                   "the ranks rebuild the checkpoint group at the next save", persist=persist) from e
        steps = sorted({s for _, _, s in gathered})
        if len(steps) > 1:
            raise SnapshotError(f"snapshot not saved: the ranks saved different steps ({', '.join(map(str, steps))}); "
                                "a snapshot holds one step of every rank",
                                hint="call save/maybe_save with the same step on every rank (after a preemption "
                                "signal, at the same step everywhere)")
        everyone = [fingerprints for fingerprints, _, _ in gathered]
        keys = sorted(set().union(*everyone))
        differ = [k for k in keys if any(d.get(k) != everyone[0].get(k) for d in everyone)]
        if differ:
            raise SnapshotError(
                f"snapshot of step {step} not saved: state {differ[:5]} differs between ranks "
                "(non-tensor values, tensor shapes or keys); one rank's copy would be restored on all of them",
                hint="make it identical on every rank, or wrap per-rank state in ckpt.snapshot.state.PerRank(...) "
                "so that each rank saves and restores its own")
        return any(asked for _, asked, _ in gathered)

    def _error(self, step: int, e: BaseException) -> Exception:
        from ckpt.snapshot.run import SnapshotError

        rank, err, trace = first_failure(e, self.rank)
        where = f"on rank {rank}, " if err is not e else ""
        return SnapshotError(
            f"rank {self.rank}: distributed save of {self.run.ref(step)} failed ({where}{self._said(rank, err, 'distributed save', trace)}); "
            f"{self.run.latest} still names the previous snapshot",
            hint=f"another rank failed, died or took longer than timeout_s={self.timeout_s:g}; see its log",
        )

    def reuse_nothing(self) -> None:
        """This rank names no delta base for the next save: its tier may have lost the snapshot last written or
        restored (a refill removed damaged copies, and the steps naming them). The coordinator's choice is every
        rank's: where the coordinator still names it, a rank whose tier lacks it writes its chunks whole
        (:class:`~ckpt.snapshot.peers.TierWriter`), the others deltas as usual."""
        self.last_id = None

    def _done(self, step: int, writer: Any, persist_to: SnapshotRun | None = None, saved_id: str | None = None) -> SaveResult:
        """``saved_id``: the checkpoint id dcp.save returned, the coordinator's commit on every rank. (A
        rank that read the ref instead could fail where its view of the store lags, alone, after the
        save succeeded everywhere.)"""
        if self.peers is not None:
            return self._tiers_done(step, writer, persist_to)
        last = writer.last  # set on the coordinator, which committed the snapshot
        self.last_id = last.id if last is not None else saved_id
        if last is None:
            return SaveResult(self.last_id, prunes=False)
        return SaveResult(last.id, last.written_bytes, last.logical_bytes)

    def _tiers_done(self, step: int, writer: Any, persist_to: SnapshotRun | None) -> SaveResult:
        """Local tiers: every rank gets the manifest, the replicas their chunks; then, if asked,
        the snapshot is persisted to ``persist_to``'s store."""
        from ckpt_store.storage.chunk_lists import referenced_chunks

        peers = self.peers
        assert peers is not None
        mid, data, unkept = peers.publish(getattr(writer, "published", None))
        own, sent, failed = peers.replicate(step, mid, set(referenced_chunks(data)), record=unkept is None)
        self.last_id = mid
        try:
            peers.local.drop_after(step)  # a run taken back to an earlier step: its later ones are abandoned
            peers.local.prune()
        except Exception as e:  # noqa: BLE001 - the next save prunes again
            failed = "; ".join(filter(None, (failed, f"old snapshots not dropped ({caught(log, 'local tier', e)})")))
        problem = None
        if persist_to is not None:
            problem, forgot = peers.persist(step, mid, data, own, persist_to.store, persist_to.latest, persist_to.ref(step))
            if forgot:  # (damaged chunks removed from this rank's tier, with the steps naming them: this one too)
                self.reuse_nothing()
        last = writer.last
        coordinator = self.rank == 0
        return SaveResult(mid, last.written_bytes if last and coordinator else None,
                          last.logical_bytes if last and coordinator else None, prunes=coordinator,
                          persisted=persist_to is not None and problem is None, persist_error=problem,
                          replicated_bytes=sent, tier_error="; ".join(filter(None, (unkept, failed))) or None,
                          tier_full=peers.tier_full)

    def close(self) -> None:
        return None


def _planner() -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    # Rank 0's copy of a replicated tensor, not whichever rank DCP's balancing picks:
    # under DDP rank 0's buffers are the ones broadcast at the next forward.
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def _tensors(state: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """The tensors in ``state``, by their DCP names, each with the key of ``state`` it is under."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ckpt.dcp.format import UnsupportedStateError

    _one_name_each(state, "state")
    try:
        flat, paths = flatten_state_dict(state)
    except ValueError as e:  # DCP names an item by its key path joined with dots, each key as str: two gave one name
        raise UnsupportedStateError(f"the state cannot be saved through a process group: {e} (two key paths, such as "
                                    "{1: ..., '1': ...} or {'a.b': ..., 'a': {'b': ...}}, give one name)",
                                    hint="give each dict key a distinct str() with no dots in it") from None
    return {n: (t, str(paths[n][0])) for n, t in flat.items() if isinstance(t, torch.Tensor)}


def _one_name_each(value: Any, path: str) -> None:
    """Refuse a dict in ``value`` with two keys of one ``str()`` (1 and '1'): DCP names an item by its key path, each
    key as a str, so their items are told apart only where what they hold differs, and their structure cannot be
    rebuilt (merged into one dict, or a traceback at every restore) -- before anything is written."""
    import torch

    from ckpt.dcp.format import UnsupportedStateError

    if isinstance(value, Mapping):
        seen: dict[str, Any] = {}
        for k in value:
            if (s := str(k)) in seen:
                raise UnsupportedStateError(f"the state cannot be saved through a process group: {path} has keys "
                                            f"{seen[s]!r} and {k!r}, which DCP names alike ({s!r})",
                                            hint="give each dict key a distinct str()")
            seen[s] = k
        for k, v in value.items():
            _one_name_each(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            _one_name_each(v, f"{path}[{i}]")
