"""What every way of saving a run's snapshots shares: where they go, what a save reports,
and the interface a snapshot path implements for :class:`~ckpt.snapshot.manager.CheckpointManager`.

The manager owns the schedule, the one save in flight, retention, preemption and the
statistics; a *path* owns how state becomes a snapshot and back: one process
(:class:`~ckpt.snapshot.local.LocalSnapshots`) or every rank of a process group through
torch.distributed.checkpoint (:class:`~ckpt.snapshot.distributed.DistributedSnapshots`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ckpt.errors import CkptError

if TYPE_CHECKING:
    from ckpt.format.manifest import Manifest
    from ckpt.snapshot.tiers import Tiers
    from ckpt.store.store import Store

SNAPSHOT_SOURCE = "snapshot"  # Manifest.source of a single process's snapshot (a process group's is "dcp")
SNAPSHOT_FORMAT = 1  # the "snapshot" record in a snapshot manifest's extra (docs/format.md)
# Format 2: as 1, where the state's tree uses a tag added later (tagged_json.LATER_TAGS: a torch.dtype, a set...), which a
# reader of format 1 would hand out as the dict {"__dtype__": ...}: it refuses format 2 instead.
SNAPSHOT_TORCH_FORMAT = 2
SNAPSHOT_FORMATS = (SNAPSHOT_FORMAT, SNAPSHOT_TORCH_FORMAT)


def is_snapshot(m: Manifest) -> bool:
    """Whether ``m`` is a snapshot a :class:`~ckpt.snapshot.manager.CheckpointManager` wrote: told by what
    wrote it (its source), never by a key of ``extra`` alone, which a pushed ``.pt`` fills with its entries
    (a top-level entry named ``snapshot``). A damaged snapshot record is still a snapshot."""
    from ckpt.dcp.format import DCP_SOURCE

    return m.source == SNAPSHOT_SOURCE or (m.source == DCP_SOURCE and "snapshot" in m.extra)


class SnapshotError(CkptError):
    """A snapshot could not be saved or restored."""


class TierWarning(RuntimeWarning):
    """A snapshot tier (the local tier, a peer, persisting to the durable store) failed one
    save or restore; training goes on and the next save tries that tier again."""


class ResumeWarning(RuntimeWarning):
    """A restore was exact, but the run after it will not be bit-identical to an uninterrupted
    one, for a reason outside the snapshot (e.g. DDP's gradient buckets, which every new
    process lays out afresh)."""


def not_a_snapshot(mid: str, source: str) -> SnapshotError:
    """The error of a restore of manifest ``mid`` (of ``source``), which no snapshot manager wrote (:func:`is_snapshot`):
    a checkpoint pushed under a run's ref name (``RUN/step-N``, ``RUN/latest``) is never restored as training state,
    nor passed over for an older step, whatever tier or group restores it."""
    return SnapshotError(f"checkpoint {mid[:12]} is not a snapshot: it was pushed ({source}), not saved by a CheckpointManager",
                         hint="push it under a name outside the run and `ckpt rm` this one, or restore another step")


def modified_under_save(names: list[str]) -> SnapshotError:
    """The error of an overlapped save (``save_mode="overlap"``) whose tensors changed under it."""
    listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return SnapshotError(
        f"{listed} {'was' if len(names) == 1 else 'were'} modified in place while save() read "
        f"{'it' if len(names) == 1 else 'them'} in the background; with save_mode='overlap' only the "
        "optimizer's step may change parameters and optimizer state, and it waits for the snapshot")


@dataclass(frozen=True)
class SnapshotRun:
    """Where a run's snapshots go: refs ``RUN/step-N`` and the alias ``RUN/latest`` in ``store``.
    ``delta``: encode each snapshot against the previous one. ``bundles``: whether snapshots carry
    bundles of their small chunks (None: where ``store`` is remote; True for a local tier persisted
    to a remote store, see :func:`ckpt.store.push.push_source`)."""

    store: Store
    name: str
    delta: bool = False
    bundles: bool | None = None

    def ref(self, step: int) -> str:
        return f"{self.name}/step-{step}"

    @property
    def latest(self) -> str:
        return f"{self.name}/latest"


@dataclass(frozen=True)
class SaveResult:
    """What the background part of one save wrote (None where this process does not know)."""

    id: str | None
    written_bytes: int | None = None
    logical_bytes: int | None = None
    staged_tensors: int | None = None
    reused_tensors: int | None = None
    copied_at_step_bytes: int = 0
    prunes: bool = True  # whether this process applies retention (one rank of a group does)
    fell_back: str | None = None  # why the snapshot went to the fallback store instead (the local tier failed)
    persisted: bool = False  # the path persisted it itself (``persist_to``)
    persist_error: str | None = None  # why persisting it failed
    replicated_bytes: int | None = None  # stored bytes this rank sent to its replicas (local tiers in a group)
    tier_error: str | None = None  # what this rank's local tier failed to keep of a snapshot saved (a full tier)
    tier_full: bool = False  # this rank's local tier ran out of space in this save (the next one makes room)


SaveJob = Callable[[], SaveResult]


class SnapshotPath(Protocol):
    """How state becomes a snapshot and back; driven by the manager, one save at a time."""

    def save(self, step: int, state: dict[str, Any], snapshot: dict[str, Any], *, background: bool,
             fallback: SnapshotRun | None = None, persist_to: SnapshotRun | None = None) -> SaveJob:
        """Take what must be taken before training may go on (the blocking part) and return
        the rest, which the manager runs in its save thread (``background``) or at once.
        ``snapshot`` is the record to store (format, run, step, metrics); a path may add to it.
        ``fallback``: where to write it if this path's store fails (reported in ``SaveResult.fell_back``).
        ``persist_to``: a path that persists snapshots itself (``SaveResult.persisted``) copies this
        one there after saving it; others leave that to the manager."""
        ...

    def restore(self, state: dict[str, Any], manifest_id: str, tiers: Tiers | None = None) -> int:
        """Restore snapshot ``manifest_id`` into ``state`` in place; its step. ``tiers``: the stores
        to read it from, nearest first; the path adds the bytes each served to ``tiers.served``."""
        ...

    def reuse_nothing(self) -> None:
        """The next save reuses nothing of (is no delta against) the snapshot last written or restored: this path's
        store may have lost it (a refill removed damaged copies, and the steps naming them)."""
        ...

    def close(self) -> None:
        """Release what the path holds (hooks, streams)."""
        ...
