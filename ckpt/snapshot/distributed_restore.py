"""The restore side of :class:`~ckpt.snapshot.distributed.DistributedSnapshots`: the ranks agree on the
snapshot (:meth:`DistributedRestoring.choose` with local tiers, else :meth:`DistributedRestoring.resolve`)
and every rank restores it through a DCP load (:meth:`DistributedRestoring.restore`).

Restoring is exact or raises :class:`~ckpt.snapshot.run.SnapshotError`: an optimizer is
restored from the snapshot's own record of its state (a fresh one has none to load
into, as torch's ``get_state_dict``/``set_state_dict`` also handle), and every saved
item of a restored key must land somewhere: a snapshot item the live object has no
place for, a per-rank object restored on another number of ranks, or one the
snapshot saved once for all ranks is refused rather than left at its current value.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

from torch.distributed.checkpoint.api import CheckpointException

from ckpt.snapshot.dcp_state import (
    Path,
    load_optimizer,
    optimizer_target,
    saved_paths,
    set_at,
    value_target,
    values_planner,
)
from ckpt.snapshot.restore_checks import check_records, check_saved_state
from ckpt.snapshot.state import (
    Stateful,
    autograd_flag_sets,
    is_per_rank,
    recorded_devices,
    with_autograd_flags,
)
from ckpt.snapshot.steps import snapshot_step
from ckpt.snapshot.tiers import COLLECTIVE_FAILURES, address, caught, describe
from ckpt_store.storage.chunk_lists import recorded_chains

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from traceback import FrameSummary

    from ckpt.snapshot.group import CheckpointGroup
    from ckpt.snapshot.peers import Peers
    from ckpt.snapshot.run import SnapshotRun
    from ckpt.snapshot.tiers import Tiers
    from ckpt.store.store import Store

FAILURES = (Exception, CheckpointException)  # DCP's CheckpointException derives from BaseException

log = logging.getLogger(__name__)


def first_failure(e: BaseException, rank: int) -> tuple[int, BaseException, Sequence[FrameSummary] | None]:
    """The rank that failed first, its own error, and where it was raised (the error arrives pickled, without its
    traceback: DCP sends the frames beside it), where DCP gathered the ranks' errors; else (``rank``, ``e``, None)."""
    if isinstance(e, CheckpointException) and e.failures:
        r, (err, trace) = next(iter(sorted(e.failures.items())))
        return r, err, trace
    return rank, e, None


T = TypeVar("T")


class DistributedRestoring:
    """The restore side of :class:`~ckpt.snapshot.distributed.DistributedSnapshots`, on its attributes
    (declared here) and its ``group``, ``agree`` and ``tag``."""

    run: SnapshotRun
    rank: int
    world: int
    timeout_s: float
    checkpoint_group: CheckpointGroup
    peers: Peers | None
    last_id: str | None

    def choose(self, durable: Store, latest: str, warn: Callable[[str], None]) -> tuple[int, str, Tiers] | None:
        """:meth:`Peers.choose <ckpt.snapshot.peers.Peers.choose>` on a group the ranks agreed on."""
        assert self.peers is not None
        self.agree("restore")
        try:
            return self.peers.choose(durable, latest, warn)
        except FAILURES as e:
            from ckpt.errors import CkptError

            self.checkpoint_group.failed(e)
            if isinstance(e, CkptError):
                raise
            raise self._restore_error(e) from e

    def resolve(self, find: Callable[[], T]) -> T | None:
        """What ``find()`` (a manifest id, say) gives on rank 0 (None where it raises RefNotFoundError), the
        same on every rank: ranks that each resolved a ref could see it apart (a shared file system's
        stale listing, a read that failed) and load different snapshots, or one none. Another failure
        of rank 0's is raised on every rank as a :class:`~ckpt.snapshot.run.SnapshotError`."""
        import torch.distributed as dist

        from ckpt.errors import RefNotFoundError
        from ckpt.snapshot.run import SnapshotError

        self.agree("restore")
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("id", find())
            except RefNotFoundError:
                box[0] = ("id", None)
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                box[0] = ("error", caught(log, "restore", e))
        try:
            dist.broadcast_object_list(box, src=self.checkpoint_group.ranks[0], group=self.group)
        except FAILURES as e:
            self.checkpoint_group.failed(e)
            raise self._restore_error(e) from e
        kind, value = box[0]
        if kind == "error":
            raise SnapshotError(f"restore not done: rank 0 could not resolve the snapshot ({value})",
                                hint="restore again once the store answers; see rank 0's log")
        return value

    def _said(self, rank: int, err: BaseException, where: str, trace: Sequence[FrameSummary] | None = None) -> str:
        """:func:`~ckpt.snapshot.tiers.describe` of rank ``rank``'s failure ``err`` (:func:`first_failure`); where it is
        this rank's own, a bug is logged too (:func:`~ckpt.snapshot.tiers.caught`: once, by the rank that met it)."""
        return caught(log, where, err, COLLECTIVE_FAILURES, trace) if rank == self.rank else describe(err)

    def _restore_error(self, e: BaseException) -> Exception:
        """The SnapshotError a restore raises (from ``e``) where a collective failed: a peer died, or
        did not answer within timeout_s (gloo raises a RuntimeError)."""
        from ckpt.snapshot.run import SnapshotError

        return SnapshotError(f"rank {self.rank}: restore not done: the ranks could not exchange what they restore "
                             f"({caught(log, 'restore', e, COLLECTIVE_FAILURES)})", hint=f"another rank failed, died or took longer than "
                             f"timeout_s={self.timeout_s:g}; see its log; nothing was restored")

    def restore(self, state: dict[str, Any], mid: str, tiers: Tiers | None = None) -> int:
        self.agree("restore")
        try:
            return self._restore(state, mid, tiers)
        except FAILURES as e:
            self.checkpoint_group.failed(e)
            raise

    def _restore(self, state: dict[str, Any], mid: str, tiers: Tiers | None = None) -> int:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from ckpt.dcp.checkpoint import Reader
        from ckpt.snapshot.run import SnapshotError

        try:
            step, targets, flat, paths, flags = self._plan_restore(state, mid, tiers)
            problem = None
        except Exception as e:  # noqa: BLE001 - every rank learns of it below, then raises
            problem = e
        # The ranks agree before the collective load: a rank that refuses must not leave the
        # others waiting in it for timeout_s.
        verdicts: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(verdicts, None if problem is None else f"{type(problem).__name__}: {problem}", group=self.group)
        except FAILURES as e:
            raise self._restore_error(e) from e
        if problem is not None:
            raise problem
        refused = next(((r, v) for r, v in enumerate(verdicts) if v is not None), None)
        if refused is not None:
            raise SnapshotError(f"rank {self.rank}: restore refused on rank {refused[0]}: {refused[1]}",
                                hint="see that rank's error; nothing was restored")
        planner = values_planner()
        try:
            if tiers is not None and self.peers is not None:
                planner = self._load_from_tiers(flat, mid, tiers)
            else:
                dcp.load(flat, storage_reader=Reader(self.run.store, mid, tiers=tiers), process_group=self.group, planner=planner)
        except FAILURES as e:
            rank, err, trace = first_failure(e, self.rank)
            raise SnapshotError(f"restore of step {step} failed on rank {rank}: {self._said(rank, err, 'restore', trace)}",
                                hint="the state may be partly overwritten: restore again, or from another snapshot") from e
        for fqn, value in planner.values.items():  # tensors were read in place
            set_at(targets, paths[fqn], value)
        for fqn in {*flags.get("requires_grad", ()), *flags.get("parameters", ())} & set(paths):
            t = flat[fqn]  # flagged once written (a Parameter wraps the tensor DCP wrote)
            param = fqn in flags.get("parameters", ())
            if isinstance(t, torch.Tensor) and (not t.requires_grad and fqn in flags.get("requires_grad", ())
                                                or isinstance(t, torch.nn.Parameter) != param):
                set_at(targets, paths[fqn], with_autograd_flags(fqn, t.detach(), flags))
        for key, obj in state.items():
            got = targets[key]
            if is_per_rank(obj):
                obj.load_state_dict(got[self.tag])
            elif isinstance(obj, torch.optim.Optimizer):
                load_optimizer(key, obj, got, step)
            elif isinstance(obj, Stateful) and not isinstance(obj, type):
                obj.load_state_dict(got)
            else:
                state[key] = got
        _warn_if_ddp_resume_is_inexact(state)
        self.last_id = mid
        return step

    def _load_from_tiers(self, flat: dict[str, Any], mid: str, tiers: Tiers) -> Any:
        """DCP loads through the tiers. Where every rank's tier names the snapshot, each rank first
        reads from its own tier alone: a restart whose tiers are intact reads once, with no planning
        pass before it. Where some rank's tier lacks it (a replaced machine), a dry run of the load
        plan says which chunks each rank reads, and those its tier lacks come from peers first.
        Either load is lenient: a chunk no tier served with a correct hash (missing, or a damaged
        local copy) is noted, fetched from a peer that holds it, and all ranks load once more, each
        chunk from the nearest tier with a correct hash. Returns the planner holding the values."""
        import torch.distributed.checkpoint as dcp

        from ckpt.dcp.checkpoint import Reader
        from ckpt.snapshot.peer_targets import NeedsRecorder, target_ranges

        peers = self.peers
        assert peers is not None
        if tiers.every_rank_holds:  # (the same on every rank: from the gathered inventories)
            tiers.reach = 1
        else:
            recorder = NeedsRecorder(tiers, target_ranges(flat))
            dcp.load(flat, storage_reader=Reader(self.run.store, mid, tiers=recorder), process_group=self.group,
                     planner=values_planner())
            tiers.targets = {(cid, address(v), len(v)) for cid, views in recorder.into.items() for v in views}
            # and the bases of the deltas among them (delta_vs_previous: chunks of the step before, which a
            # replaced machine's tier lacks too): the load decodes a delta with bases from its own tier
            chains = recorded_chains(tiers.get_manifest(mid).to_json())
            asked = tiers.needed = recorder.asked.union(*(chains.get(c, ()) for c in recorder.asked))
            peers.fetch(tiers, asked, exclude_local=set(), into=recorder.into)
            recorder.into.clear()
        tiers.lenient = True
        planner = values_planner()
        try:
            dcp.load(flat, storage_reader=Reader(self.run.store, mid, tiers=tiers), process_group=self.group, planner=planner)
        finally:
            missed, tiers.unserved = set(tiers.unserved), set()
            tiers.lenient, tiers.reach = False, None
        if not any(peers.gather(bool(missed))):
            return planner
        if missed:  # and the bases of each missed delta: one may be why it missed (damaged on the way, or here)
            chains = recorded_chains(tiers.get_manifest(mid).to_json())
            missed = missed.union(*(chains.get(c, ()) for c in missed))
        peers.fetch(tiers, missed, exclude_local=missed)
        tiers.served.update(dict.fromkeys(tiers.served, 0))
        planner = values_planner()
        dcp.load(flat, storage_reader=Reader(self.run.store, mid, tiers=tiers), process_group=self.group, planner=planner)
        return planner

    def _plan_restore(self, state: dict[str, Any], mid: str, tiers: Tiers | None = None,
                      ) -> tuple[int, dict[str, Any], dict[str, Any], dict[str, Path], dict[str, Any]]:
        """Check the snapshot against ``state`` and build what DCP loads into: (step, the targets
        by state key, the same flattened by DCP name, each name's key path, and the snapshot's
        record of which tensors require grad or are Parameters, by DCP name)."""
        import torch
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        from ckpt.dcp.consolidate import check_entries
        from ckpt.dcp.format import decode_layout
        from ckpt.format.dtypes import to_torch
        from ckpt.snapshot.run import SNAPSHOT_FORMATS, SnapshotError, is_snapshot, not_a_snapshot

        m = tiers.get_manifest(mid) if tiers is not None else self.run.store.manifest(mid)
        if not is_snapshot(m):
            raise not_a_snapshot(mid, m.source)
        snap = m.extra.get("snapshot")
        if not isinstance(snap, dict) or snap.get("format") not in SNAPSHOT_FORMATS or not snap.get("ranks"):
            raise SnapshotError(f"checkpoint {mid[:12]} is not a distributed snapshot of this ckpt version",
                                hint="restore it with a CheckpointManager made without a process group")
        step = snapshot_step(m)
        if step is None:
            raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of its step is malformed")
        for field in ("keys", "per_rank"):  # lists of state keys, compared as sets (_check_keys)
            names = snap.get(field)
            if names is not None and not (isinstance(names, list) and all(isinstance(k, str) for k in names)):
                raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of its {field} is malformed")
        layout = decode_layout(m.extra, f"manifest {mid}")
        check_entries(m, layout.tensors.values(), f"manifest {mid}")  # before a target is allocated from the layout's sizes
        flags = autograd_flag_sets(snap.get("autograd", {}), {n: to_torch(item.dtype) for n, item in layout.tensors.items()})
        if flags is None:
            raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of autograd flags is malformed")
        devices = recorded_devices(snap.get("devices", {}))
        skeletons = snap.get("skeletons", {})
        if not isinstance(skeletons, dict):
            raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of its values' structure is malformed")
        saved = saved_paths(layout, mid)
        self._check_keys(state, snap, saved, step)
        check_records(snap, state, mid, step)
        for key, obj in state.items():  # before anything is written (DCP writes modules' tensors in place)
            if not is_per_rank(obj):
                check_saved_state(key, obj, _saved_fields(saved.get(key, {}), layout.values), step)
        targets: dict[str, Any] = {}
        for key, obj in state.items():
            if is_per_rank(obj):
                targets[key] = {self.tag: obj.state_dict()}
            elif isinstance(obj, torch.optim.Optimizer):
                targets[key] = optimizer_target(key, obj, saved.get(key, {}), layout, step)
            elif isinstance(obj, Stateful) and not isinstance(obj, type):
                targets[key] = obj.state_dict()
            else:
                targets[key] = value_target(key, obj, saved.get(key, {}), layout, devices, skeletons.get(key))
        # DCP's own (private) flattening: the names must be exactly those it gave the items when saving
        flat, paths = flatten_state_dict(targets)
        self._check_placed(state, saved, paths, step)
        return step, targets, flat, paths, flags

    def _check_keys(self, state: dict[str, Any], snap: dict[str, Any], saved: dict[str, dict[str, Path]], step: int) -> None:
        """Every key is in the snapshot, and per-rank state meets per-rank state saved by as many ranks."""
        from ckpt.errors import TensorMismatchError
        from ckpt.snapshot.run import SnapshotError

        keys = set(snap["keys"]) if isinstance(snap.get("keys"), list) else set(saved)
        missing = sorted(set(state) - keys)
        if missing:
            raise TensorMismatchError(f"snapshot of step {step} has no {missing}", hint="restore a subset of keys")
        per_rank = set(snap.get("per_rank") or ())
        world = snap.get("world")
        for key, obj in state.items():
            if is_per_rank(obj) and key not in per_rank:
                raise SnapshotError(
                    f"state[{key!r}] differs per rank, but the snapshot of step {step} holds one copy for all ranks "
                    "(saved by a ckpt that did not keep it per rank): every rank would get the same one",
                    hint=f"drop {key!r} from the state to resume with the streams as they are, or restore without it")
            if is_per_rank(obj) and world != self.world:
                raise SnapshotError(
                    f"state[{key!r}] is per rank: the snapshot of step {step} holds it for {world} ranks, "
                    f"this group has {self.world}",
                    hint=f"restore on {world} ranks, or drop {key!r} from the state (each rank keeps its current one)")
            if key in per_rank and not is_per_rank(obj):
                raise SnapshotError(
                    f"state[{key!r}] was saved per rank (one copy each); a {type(obj).__name__} cannot take one back",
                    hint="pass the kind of object that was saved (ckpt.RNGState() or ckpt.snapshot.state.PerRank(...))")

    def _check_placed(self, state: dict[str, Any], saved: dict[str, dict[str, Path]], paths: dict[str, Path], step: int) -> None:
        """Both ways: every saved item of a restored key has a place in the live state, and every
        item of the live state is in the snapshot. DCP itself skips the first silently."""
        from ckpt.errors import TensorMismatchError
        from ckpt.snapshot.run import SnapshotError

        wanted: dict[str, set[str]] = {}
        for fqn, path in paths.items():
            wanted.setdefault(str(path[0]), set()).add(fqn)
        for key, obj in state.items():
            have = {f for f, p in saved.get(key, {}).items() if not is_per_rank(obj) or (len(p) > 1 and p[1] == self.tag)}
            want = wanted.get(key, set())
            unplaced, absent = sorted(have - want), sorted(want - have)
            if unplaced:
                raise SnapshotError(
                    f"state[{key!r}] ({type(obj).__name__}) has no place for {_listed(unplaced)} of the snapshot of "
                    f"step {step}: restoring would leave them at their current values",
                    hint="restore into the kind of object that was saved, its state initialised as it was then")
            if absent:
                raise TensorMismatchError(f"{key}: not in snapshot of step {step}: {_listed(absent)}",
                                          hint="restore into the kind of object that was saved")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _warn_if_ddp_resume_is_inexact(state: dict[str, Any]) -> None:
    """Warn (:class:`~ckpt.snapshot.run.ResumeWarning`) when a restored DDP module's next step will
    not sum gradients as an uninterrupted run would.

    DDP lays its gradient buckets out in registration order and, after the first backward of
    each new ``DistributedDataParallel``, rebuilds them in the order the gradients became ready.
    An uninterrupted run rebuilt them at its first step; a resumed one runs its first step on the
    initial layout. The all-reduce then splits the flat buffer differently, and with more than two
    ranks floating-point addition is not associative: the resumed run's gradients, and so its
    optimizer moments, differ in their last bits from the uninterrupted run's (measured: 3 gloo
    ranks, 5 of 48 moments one ulp apart three steps later), though the restored state is exact.
    With ``find_unused_parameters=True`` DDP never rebuilds its buckets, and a resumed run is
    bit-identical on any number of ranks."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ckpt.snapshot.run import ResumeWarning

    for key, obj in state.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        for module in obj.modules():
            if not isinstance(module, DistributedDataParallel):
                continue
            rebuilds = module.static_graph or not module.find_unused_parameters
            fresh = not getattr(module, "_has_rebuilt_buckets", False)  # private in torch: unknown counts as fresh
            if rebuilds and fresh and dist.get_world_size(module.process_group) > 2:
                warnings.warn(
                    f"{key!r}: the state was restored exactly, but DDP lays out its gradient buckets afresh in "
                    "a new process, so with more than 2 ranks the gradients of the next step are summed in "
                    "another order than in an uninterrupted run and differ in their last bits; construct "
                    "DistributedDataParallel(..., find_unused_parameters=True) (it never rebuilds its buckets) "
                    "for a bit-identical resume", ResumeWarning, stacklevel=_outside_ckpt())
                return


def _outside_ckpt() -> int:
    """The ``stacklevel`` of the first caller outside the ckpt package, seen from the function that
    calls :func:`warnings.warn` (however many of ckpt's frames lie between)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _saved_fields(items: dict[str, Path], values: dict[str, Any]) -> dict[Any, Any]:
    """The top level of a key's saved state as far as the snapshot's layout tells before a load: each field's
    plain value where it is one item (an LR scheduler's ``base_lrs``), else True (tensors, nested values)."""
    # Not dcp_state.from_snapshot: it sorts and builds every key's whole tree (12x this at 30,000 items, measured).
    fields: dict[Any, Any] = {}
    for fqn, path in items.items():
        if len(path) >= 2:
            fields[path[1]] = values[fqn] if len(path) == 2 and fqn in values else True
    return fields
