"""What :class:`~ckpt.snapshot.manager.CheckpointManager`'s mixins share: the attributes its ``__init__``
sets (declared here, set there) and, for a type checker, the methods one mixin calls on another.

Each concern of the manager is a mixin of its own module (saving.py, persisting.py, restoring.py,
pruning.py, preemption.py), and each reads state that only ``CheckpointManager.__init__`` sets: this base
says what that state is, so that a reader of a mixin finds each attribute's type and meaning in one place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt.format.manifest import Manifest
    from ckpt.snapshot.distributed import DistributedSnapshots
    from ckpt.snapshot.local_tier import LocalTier
    from ckpt.snapshot.persisting import PersistStats
    from ckpt.snapshot.retention import Retention
    from ckpt.snapshot.run import SaveJob, SaveResult, SnapshotPath, SnapshotRun
    from ckpt.snapshot.saving import SaveStats
    from ckpt.store.store import Store


class ManagerState:
    """The state of a :class:`~ckpt.snapshot.manager.CheckpointManager` its mixins read and write (set by
    its ``__init__``; nothing here has a value of its own)."""

    # -- settings ----------------------------------------------------------------------------
    store: Store  # the durable store
    run: str
    every_n_steps: int | None  # snapshots persisted to the durable store every N steps
    local_every_n_steps: int | None  # snapshots into the local tier every N steps
    retention: Retention
    save_mode: str  # one of manager.SAVE_MODES
    preempt_exit_code: int
    _distributed: bool  # with a process group
    _local_compress: bool  # the local tier encodes chunks as the durable store does

    # -- where snapshots go --------------------------------------------------------------------
    _durable: SnapshotRun  # the run in the durable store
    _local: LocalTier | None  # the local tier, if any
    _target: SnapshotRun  # where a save goes first: the local tier's run, else the durable one
    _path: SnapshotPath  # one process (LocalSnapshots) or a process group (DistributedSnapshots)

    # -- saving --------------------------------------------------------------------------------
    _pool: ThreadPoolExecutor  # the save thread: one save in flight
    _inflight: Future[None] | None  # the save (or a restore's refill) in flight
    _closed: bool
    last_save: SaveStats | None
    _saves: int  # saves made so far, numbered in order (a persist moves RUN/latest only to a newer one)
    _saved_step: int | None  # the step of the newest save (with a local tier)
    _latest_id: str | None  # the id RUN/latest named when last checked or saved (see Saving._check_latest)
    _latest_warned: bool  # the check of RUN/latest warned (once per manager)
    _warned: set[str]  # what _warn_once said
    _said_local_only: bool  # the warning that no snapshot is persisted (a local tier, no every_n_steps)

    # -- the local tier and persisting ---------------------------------------------------------
    _local_full: bool  # the last local save ran out of space (on this rank): make room first
    _persist_pool: ThreadPoolExecutor  # the persist thread: one persist at a time
    _persisting: Future[None] | None  # the persist loop running
    _persist_slot: tuple[int, int, str | None] | None  # (step, save number, checkpoint id) due next; a newer one takes its place
    _persist_lock: threading.Lock  # the slot, the tier's pinned steps
    _durable_lock: threading.Lock  # moving RUN/latest in the durable store: never to an older save
    _published: int  # the number of the save RUN/latest names (0: one of an earlier process)
    _durable_step: int | None  # the step RUN/latest names in the durable store,
    _durable_known: bool  # once read (at the first save with a local tier)
    _persist_pending: bool  # a persist failed: the next save persists
    _unpersistable: tuple[Exception, str | None] | None  # a persist's failure on a damaged tier chunk, and its snapshot
    last_persist: PersistStats | None

    # -- restoring -----------------------------------------------------------------------------
    last_restore: dict[str, int] | None  # {"step", and bytes per tier}

    # -- retention -----------------------------------------------------------------------------
    _retaining: threading.Lock  # one retention at a time (the persist thread and a direct save)
    _retained: set[int] | None  # the durable steps retention counts: listed once, then each saved (a hint)
    _metrics: dict[int, dict[str, float]]  # keep_best's metrics of the steps retention counts
    _snapshot_ids: dict[int, tuple[str, bool]]  # step -> (manifest id, whether a snapshot)

    # -- preemption ----------------------------------------------------------------------------
    preempted: bool
    _final_step: int | None  # in a group: the step of the final snapshot the ranks agreed on
    _old_handlers: dict[int, Any]  # signal -> the handler installed before ours

    if TYPE_CHECKING:  # methods one mixin calls on another (defined by the manager or a mixin)
        @property
        def _group_path(self) -> DistributedSnapshots: ...
        def wait(self) -> None: ...
        def close(self) -> None: ...
        def ref(self, step: int) -> str: ...
        def _wait_save(self) -> None: ...
        def _check_open(self, what: str, verb: str) -> None: ...
        def _tier_warning(self, message: str) -> None: ...
        def _warn_once(self, message: str) -> None: ...
        def _latest_manifest(self, parsed: dict[str, Manifest]) -> tuple[str, Manifest]: ...
        def _check_latest(self) -> None: ...
        def _tiered(self, step: int, job: SaveJob, persist: bool, seq: int) -> Callable[[], SaveResult | None]: ...
        def _make_room(self, step: int, state: dict[str, Any]) -> None: ...
        def _take_unpersistable(self) -> tuple[Exception, str | None] | None: ...
        def _forget_unpersistable(self, e: Exception, mid: str | None) -> None: ...
        def _retain(self, saved: int) -> None: ...
        def _final_snapshot_due(self, step: int) -> bool: ...
