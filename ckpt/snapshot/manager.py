"""The training-loop manager: asynchronous, incremental snapshots and in-place restore.

>>> import torch, ckpt
>>> model = torch.nn.Linear(4, 2)
>>> opt = torch.optim.AdamW(model.parameters())
>>> with ckpt.CheckpointManager("memory://manager-doctest", "run1", keep_last=2) as mgr:
...     mgr.save(10, {"model": model, "optim": opt, "step": 10})
...     mgr.wait()
...     state = {"model": model, "optim": opt, "step": 0}
...     mgr.restore_latest(state), state["step"]
(10, 10)
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ckpt._deprecation import deprecated
from ckpt.errors import CkptError, RefConflictError, RefNotFoundError
from ckpt.settings import Settings
from ckpt.snapshot.retention import KeepBest, Retention, count_setting
from ckpt.snapshot.run import (
    SNAPSHOT_FORMAT,
    SaveJob,
    SaveResult,
    SnapshotError,
    SnapshotPath,
    SnapshotRun,
    TierWarning,
    is_snapshot,
    modified_under_save,
    not_a_snapshot,
)
from ckpt.snapshot.tiers import MISSES as TIER_MISSES
from ckpt.snapshot.tiers import (
    LocalTier,
    LocalTierUsage,
    describe,
    out_of_space,
    resolve_latest,
    run_steps,
    snapshot_test,
    step_refs,
)

if TYPE_CHECKING:
    from ckpt.format.manifest import Manifest
    from ckpt.snapshot.distributed import DistributedSnapshots
    from ckpt.snapshot.tiers import Tiers
    from ckpt.store.store import Store

log = logging.getLogger(__name__)
_T = TypeVar("_T")


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
SAVE_MODES = ("async", "sync", "overlap")
UNCHANGED_BY = ("version", "hash")

__all__ = ["SAVE_MODES", "CheckpointManager", "KeepBest", "LocalTierUsage", "PersistStats", "SaveStats", "SnapshotError",
           "TierWarning", "modified_under_save"]


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


@dataclass(frozen=True)
class PersistStats:
    """What persisting one local snapshot to the durable store cost: seconds in the background,
    and the chunks and stored bytes it copied (those the durable store lacked)."""

    step: int
    seconds: float
    chunks_sent: int
    bytes_sent: int
    chunks_present: int


class CheckpointManager:
    """Saves and restores the state of one training run in a ckpt store.

    Snapshots are ordinary checkpoints: refs ``RUN/step-N`` plus the alias
    ``RUN/latest``, visible to ``ckpt ls/log/show/pull/diff``.

    **Saving** (``save_mode``):

    * ``"async"`` (default): ``save(step, state)`` blocks only while tensors that changed
      since the previous snapshot are copied into a reusable staging area (pinned memory
      for CUDA tensors); hashing, encoding and writing run in the background. One save
      is in flight at a time: the next one waits for it, so memory stays at about one
      copy of the state. An error in the background is raised by the next ``save``,
      ``wait`` or ``close``.
    * ``"sync"``: ``save`` returns when the snapshot is durable.
    * ``"overlap"``: the parameters and state of the optimizers in ``state`` are not
      copied by ``save`` at all. They cannot change before the optimizer's next
      ``step()``, so the save thread reads them in place while forward and backward run;
      a step pre-hook on each optimizer then copies only what the save has not read yet
      before letting the step modify them (CUDA tensors: the step waits for their copy to
      pinned memory). When the background keeps up, the step does not wait and no
      staging copy exists (benchmarks/results/snapshot.md: blocked 0.006 s for 1.2 GB,
      peak memory 1.33x the state instead of 2.30x); :attr:`step_wait_s` adds up the
      steps' waits. Nothing but the optimizer step may modify those tensors in place
      meanwhile: a change is caught by the version counter and fails that snapshot
      (raised by the next ``save``/``wait``/``close``; never published).

    A snapshot is durable when :meth:`wait` (or :meth:`close`) returns; ``save`` and
    ``maybe_save`` return earlier, so a crash right after them may resume from the
    previous snapshot. :attr:`last_save` says what the last completed save cost.

    **Unchanged tensors** (``unchanged_by``): with ``"version"`` (default) a tensor that
    is the same storage with the same in-place version counter as at the previous save
    is not read at all: its chunks are reused. Where versions cannot be trusted (a fused
    optimizer in the state, or after a restore) every tensor is staged and unchanged
    chunks are found by hash instead; ``"hash"`` always does that (writes through
    ``.data`` bypass the counter: choose it if your code does that).

    ``delta_vs_previous`` (off by default, unlike ``Store.push``, whose deltas are
    against a related checkpoint): encode each snapshot against the previous one. It
    wrote 0.55-0.63x the bytes of a plain save of dense training state in the benchmark,
    but costs the background a read of the previous snapshot and every restore a chain
    of decodes (benchmarks/results/snapshot.md).

    **Restore** reads in parallel straight into the live tensors (module parameters and
    buffers, an optimizer's existing state tensors; other state gets new tensors that
    its ``load_state_dict`` receives), re-hashing every byte. A restore that fails part
    way (a damaged chunk, say) has overwritten some of them: restore again, from
    another snapshot if need be.

    **Retention**, applied after each save: keep the last ``keep_last`` snapshots, every
    snapshot whose step is a multiple of ``keep_every``, and the best by
    ``keep_best=ckpt.KeepBest("loss", "min", count=1)`` (see
    :class:`~ckpt.snapshot.retention.Retention`). Other snapshot refs are removed;
    ``ckpt gc`` frees their data.

    **Preemption**: ``handle_signals=True`` installs SIGTERM/SIGUSR1 handlers: the
    in-flight save is finished, :attr:`preempted` becomes True, and the next
    :meth:`maybe_save` takes a final snapshot, waits until it is durable and raises
    ``SystemExit(preempt_exit_code)``. The default, 143 (128 + SIGTERM), is the status
    the signal itself would have ended the process with: schedulers (SLURM, Kubernetes,
    torchrun's elastic agent) read it as "killed, requeue or restart", where 0 reads as
    "finished" and ends the job. In a process group the signal reaches each rank at its own
    moment: the first rank to see it names the next step in the rendezvous store, and every
    rank takes the final snapshot at that step (one store lookup per ``maybe_save``; the ranks
    must step together, as DDP and FSDP make them).

    **Distributed**: with ``process_group`` (e.g. ``torch.distributed.group.WORLD``)
    every rank calls the same ``save``/``restore_latest``: snapshots are saved and
    restored through ``torch.distributed.checkpoint`` (sharded state, resharded on
    restore), and a rank that fails or dies makes the others raise after ``timeout_s``
    (default 1800; only with a process group). Per rank: :class:`~ckpt.snapshot.state.RNGState`
    (Python, NumPy, torch CPU and CUDA generators) and anything wrapped in
    :class:`~ckpt.snapshot.state.PerRank` are saved once per rank and each rank gets its
    own back (so only on as many ranks). Everything else (modules, optimizers,
    schedulers, grad scalers, plain values) is assumed identical on every rank, as
    under DDP, or sharded as DTensors; rank 0's copy of a replicated tensor is saved,
    and a save whose non-tensor values or tensor shapes differ between ranks is
    refused. Optimizers are restored exactly even when fresh (no state before their
    first step). A restore that cannot place every saved item, or would give one
    rank's per-rank state to another, raises :class:`SnapshotError` on every rank
    (ckpt/snapshot/distributed.py).

    **Tiers** (``local=True`` or ``local=PATH``; README "Restart in seconds", docs/format.md
    "The local tier"): snapshots go to a local tier (an ordinary store in host memory under
    /dev/shm, or on local NVMe) every ``local_every_n_steps``, bounded by ``local_keep``
    snapshots and ``local_max_bytes`` (:attr:`local_tier` says what it holds). The tier stores
    chunks raw (a save hashes and writes, a restore reads and hashes: measured on a 311 MB
    GPT + AdamW state, about half the background time of compressing them, for 1.26x the
    memory); ``local_compress=True`` encodes them as the durable store does. Every
    ``every_n_steps`` (a multiple) a snapshot is persisted to ``store`` in the background by
    copying the chunks it lacks, raw ones compressed on the way (:attr:`last_persist`). :meth:`restore_latest` takes the
    newest snapshot of any tier, each chunk from the nearest tier holding it with a correct
    hash; :attr:`last_restore` is ``{"step", "local", "peer", "store"}`` (bytes per tier).
    A save of a step at or below the durable store's newest (the run was taken back to an earlier
    snapshot, or begun anew under its name) is persisted whatever its step, and drops the later
    steps from the local tier: a restart resumes that new timeline, not the abandoned one.
    With ``process_group`` each rank's tier is ``PATH/rank-R`` and ``replicas=K`` sends each
    rank's chunks to K peers (``replica_stride`` apart, or on other nodes of
    ``replica_nodes``); the ranks persist together in the save thread. A tier that fails
    warns (:class:`TierWarning`) and the next save tries again; a snapshot due to ``store``
    whose local save failed is written there directly (in a group, by all ranks together).
    A collective that failed (a peer that did not answer within ``timeout_s``) leaves the
    checkpoint group unusable: at the next save the ranks agree to rebuild it
    (ckpt/snapshot/group.py); where not every rank arrives within ``timeout_s``, a local save
    warns and one due to ``store`` raises ``GroupUnavailable`` (a :class:`SnapshotError`).

    Settings are checked at construction (``ValueError`` naming the parameter):
    ``every_n_steps``, ``keep_last`` and ``keep_every`` are ints >= 1 (not bools) or
    None; ``save_mode`` one of :data:`SAVE_MODES`; ``timeout_s`` a finite number > 0,
    given only with ``process_group``; ``preempt_exit_code`` an int in 0..255. The
    spellings of earlier releases (``async_save``, ``overlap_copy``, ``trust_version``,
    ``delta``, ``keep_best`` as a tuple, :attr:`last_save_stats`) still work, with a
    DeprecationWarning.
    """

    def __init__(
        self,
        store: str | Store,
        run: str,
        *,
        every_n_steps: int | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: KeepBest | None = None,
        save_mode: str = "async",
        unchanged_by: str = "version",
        delta_vs_previous: bool = False,
        handle_signals: bool = False,
        preempt_exit_code: int = 143,
        process_group: Any = None,
        timeout_s: float | None = None,
        settings: Settings | None = None,
        local: bool | str | os.PathLike[str] | None = None,
        local_every_n_steps: int | None = None,
        local_keep: int = 2,
        local_max_bytes: int | None = None,
        local_compress: bool = False,
        replicas: int = 0,
        replica_stride: int = 1,
        replica_nodes: Sequence[Any] | None = None,
        **deprecated: Any,
    ) -> None:
        from ckpt.store.store import Store
        from ckpt_store.storage.errors import InvalidNameError
        from ckpt_store.storage.refs import MAX_NAME, validate_ref_name

        save_mode, unchanged_by, delta_vs_previous = _old_spellings(deprecated, save_mode, unchanged_by, delta_vs_previous)
        self.every_n_steps = count_setting("every_n_steps", every_n_steps)
        self.retention = Retention(keep_last, keep_every, KeepBest.coerce(keep_best))
        if save_mode not in SAVE_MODES:
            raise ValueError(f"save_mode must be one of {', '.join(SAVE_MODES)}, not {save_mode!r}")
        if unchanged_by not in UNCHANGED_BY:
            raise ValueError(f"unchanged_by must be 'version' or 'hash', not {unchanged_by!r}")
        if timeout_s is not None:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
                raise ValueError(f"timeout_s must be a finite number of seconds > 0, not {timeout_s!r}")
            if process_group is None:
                raise ValueError("timeout_s applies to distributed saves: pass it with process_group")
        timeout_s = 1800.0 if timeout_s is None else timeout_s
        if isinstance(preempt_exit_code, bool) or not isinstance(preempt_exit_code, int) or not 0 <= preempt_exit_code <= 255:
            raise ValueError(f"preempt_exit_code must be an int in 0..255 (an exit status), not {preempt_exit_code!r}")
        if settings is None and not isinstance(store, Store):
            # Restores are on the critical path of every restart: keep compression only
            # where it saves at least 25%, so most chunks restore as one read into the
            # tensor plus a hash. Measured on the benchmark's 1.2 GB GPT + AdamW state:
            # at 10%, 0.72 of the bytes and a 0.48 s warm restore; at 30%, 0.86 and 0.27 s
            # (weights and first moments save ~17% and stay raw; second moments compress).
            # delta_vs_previous asks for bytes over restore speed: there 10%.
            settings = Settings.from_env(min_saving=0.10 if delta_vs_previous else 0.25)
        validate_ref_name(run)
        if len(f"{run}/step-{2**64}") > MAX_NAME:  # else every save fails (with a local tier, only warns)
            raise InvalidNameError(f"run name is {len(run)} characters long; the limit is {MAX_NAME - len(f'/step-{2**64}')}, "
                                   "so that its snapshot refs RUN/step-N fit in a ref name")
        self.store = store if isinstance(store, Store) else Store.init(store, settings=settings)
        self.run = run
        self.save_mode = save_mode
        self.preempt_exit_code = preempt_exit_code
        self.preempted = False
        self._final_step: int | None = None  # in a group: the step of the final snapshot the ranks agreed on
        self.last_save: SaveStats | None = None
        self.last_persist: PersistStats | None = None
        self.last_restore: dict[str, int] | None = None
        self._durable = SnapshotRun(self.store, self.run, delta_vs_previous)
        self._distributed = process_group is not None
        if not isinstance(local_compress, bool):
            raise ValueError(f"local_compress must be True or False, not {local_compress!r}")
        self._local_compress = local_compress
        self._retaining = threading.Lock()  # see _retain
        # The durable steps retention counts: the run's, listed once (at the first retention), then each
        # one saved there; a hint, each checked against the store at every retention (see _retain).
        self._retained: set[int] | None = None
        self._latest_id: str | None = None  # the id RUN/latest named when last checked or saved (see _check_latest)
        self._latest_warned = False
        self._warned: set[str] = set()  # what _warn_once said
        self._local = self._local_tier(local, local_every_n_steps, local_keep, local_max_bytes, replicas, process_group)
        self._local_full = False  # the last local save ran out of space (on this rank): make room first
        # The local tier's snapshots carry bundles of their small chunks where the durable store is
        # remote: persisting copies them as they are, so a restore from there makes a few requests.
        self._target = (SnapshotRun(self._local.store, self.run, delta_vs_previous and local_compress,
                                    bundles=self.store.objects.backend.streams) if self._local
                        else self._durable)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._persist_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-persist")
        # One persist runs at a time; a snapshot due while one runs waits in a slot of one
        # (a newer one takes its place: the older is never persisted), so training never waits.
        self._persisting: Future[None] | None = None
        self._persist_slot: tuple[int, int] | None = None  # (step, save number)
        self._persist_lock = threading.Lock()
        self._durable_lock = threading.Lock()  # moving RUN/latest in the durable store: never to an older save
        # Saves are numbered in the order they are made: a persist moves RUN/latest only to a save newer
        # than the one it names (its number; 0: a save of an earlier process), whatever their steps.
        self._saves = 0
        self._saved_step: int | None = None  # the step of the newest save (with a local tier)
        self._published = 0
        self._durable_step: int | None = None  # the step RUN/latest names in the durable store,
        self._durable_known = False  # once read (at the first save with a local tier)
        self._persist_pending = False  # a persist failed: the next save persists
        self._inflight: Future[None] | None = None
        self._closed = False
        # keep_best's metrics of the steps retention counts (a step's manifest holds them too): those it removes are dropped
        self._metrics: dict[int, dict[str, float]] = {}
        self._snapshot_ids: dict[int, tuple[str, bool]] = {}  # retention: step -> (manifest id, whether a snapshot)
        self._old_handlers: dict[int, Any] = {}
        self._path: SnapshotPath
        if process_group is not None:
            if save_mode == "overlap":
                raise ValueError("save_mode='overlap' is for one process; with process_group use 'async' or 'sync'")
            from ckpt.snapshot.distributed import DistributedSnapshots

            self._path = DistributedSnapshots(self._target, process_group, timeout_s, local=self._local, replicas=replicas,
                                              replica_stride=replica_stride, replica_nodes=replica_nodes)
        else:
            from ckpt.snapshot.local import LocalSnapshots

            self._path = LocalSnapshots(self._target, overlap=save_mode == "overlap", unchanged_by=unchanged_by)
        if handle_signals:
            self._install_signals()

    def _local_tier(self, local: Any, every: int | None, keep: int, max_bytes: int | None, replicas: int,
                    process_group: Any) -> LocalTier | None:
        """Check the tier settings; the local tier, if asked for."""
        from ckpt.snapshot.tiers import LocalTier, default_local_path, private_root

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
            path = default_local_path(self.store.url, self.run, rank)
            private_root(path.parent.parent if rank is not None else path.parent)
        else:
            path = os.fspath(local) if rank is None else os.path.join(os.fspath(local), f"rank-{rank}")
        return LocalTier(path, self.run, keep=keep, max_bytes=max_bytes, settings=self.store.settings,
                         compress=self._local_compress, durable=self.store, reset_foreign=local is True)

    @property
    def local_tier(self) -> LocalTierUsage | None:
        """What the local tier holds now (its path, steps and bytes: host memory under /dev/shm);
        None without one."""
        return self._local.usage() if self._local else None

    # -- saving ------------------------------------------------------------------
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
        if self._closed:  # its save thread is gone, and its local tier may be another manager's by now
            raise SnapshotError(f"snapshot of step {step} not saved: this CheckpointManager of run {self.run!r} is closed",
                                hint="save with a new CheckpointManager (or save before leaving its `with` block)")
        self._wait_save()
        if self._local is None:  # (with a local tier a persist moves it later)
            self._check_latest()
        t0 = time.perf_counter()
        snapshot = {"format": SNAPSHOT_FORMAT, "run": self.run, "step": step, "metrics": _recorded(step, metrics)}
        background = self.save_mode != "sync"
        if self._local is None:
            job = self._path.save(step, state, snapshot, background=background)
        else:
            if persist is None:
                persist = bool(self.every_n_steps) and step % self.every_n_steps == 0
            persist = persist or self._persist_pending or self._behind_durable(step)
            self._saves += 1
            self._saved_step = step
            if self._local_full:
                self._make_room(step)
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
        from ckpt.snapshot.tiers import snapshot_step

        if not self._durable_known:
            try:
                # (RUN/latest missing: the newest step, as a restart would resume it, so that a run gone back
                # below it persists its saves and a restart resumes them, not that step)
                self._durable_step = snapshot_step(self.store.manifest(self._resolve_latest()))
            except RefNotFoundError:
                self._durable_step = None
            except Exception as e:  # noqa: BLE001 - unreadable now: the persists due say more
                log.warning("could not read %s in %s (%s)", self._durable.latest, self.store.url, describe(e))
                return False
            self._durable_known = True
        return self._durable_step is not None and step <= self._durable_step

    def _check_latest(self) -> None:
        """Warn (once) where the durable RUN/latest names a checkpoint a user pushed there (no snapshot), which
        this save is about to move away from: the next restart would otherwise resume without a word of it.
        Called before every write of it: a save without tiers; with tiers, a save due to the durable store (a
        full tier's direct save there, a group's persist) and a persist. One ref read each; a manifest read
        only where RUN/latest changed since this manager last saw it.
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
                self._tier_warning(f"local tier: snapshot of step {step} not saved ({describe(e)}); the next save tries again")
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
                self._tier_warning(f"local tier: could not drop old snapshots ({describe(e)})")
            if persist:
                self._persist_pending = False
                self._request_persist(step, seq)
            return result

        return run

    def _make_room(self, step: int) -> None:
        """The last local save found the tier full with nothing left to prune (it keeps its newest
        snapshot): drop that one too, so that the tier holds the newest step again instead of
        refusing every save. Until this save lands, a restart restores from the durable store."""
        local = self._local
        assert local is not None
        self._local_full = False
        try:
            dropped = local.make_room()
        except Exception as e:  # noqa: BLE001
            self._tier_warning(f"local tier: could not make room for step {step} ({describe(e)})")
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
            log.warning("local tier: could not free the leftovers of a failed save (%s)", describe(e))

    def _request_persist(self, step: int, seq: int) -> None:
        local = self._local
        assert local is not None
        with self._persist_lock:
            local.pinned.add(step)
            if self._persist_slot is not None and self._persist_slot[0] != step:
                self._unpin(self._persist_slot[0])  # superseded before it started: never persisted
            self._persist_slot = (step, seq)
            if self._persisting is None or self._persisting.done():
                self._persisting = self._persist_pool.submit(self._persist_loop)

    def _persist_loop(self) -> None:
        while True:
            with self._persist_lock:
                slot, self._persist_slot = self._persist_slot, None
            if slot is None:
                return
            self._persist(*slot)

    def _persist(self, step: int, seq: int) -> None:
        """Copy the local snapshot of ``step`` to the durable store: only the chunks it lacks, as stored."""
        from ckpt.store.copy import copy_refs

        local = self._local
        assert local is not None
        t0 = time.perf_counter()
        try:
            report = copy_refs(local.store, self.store, [local.ref(step)], recode=not self._local_compress)
            with self._durable_lock:
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
            self._tier_warning(f"persisting the snapshot of step {step} to {self.store.url} failed ({describe(e)}); "
                               "the next save persists again")
        finally:
            with self._persist_lock:
                self._unpin(step)

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
                self._tier_warning(f"local tier: could not drop step {step} of the timeline the run left ({describe(e)})")

    def _resolve_latest(self) -> str:
        """:func:`~ckpt.snapshot.tiers.resolve_latest` of the durable store, warning once of each fallback."""
        return resolve_latest(self.store, self.run, self._warn_once)

    def _warn_once(self, message: str) -> None:
        """A :class:`TierWarning` this manager has not given yet (``latest_step()`` then ``restore_latest()``
        meet the same missing RUN/latest: one warning says it)."""
        if message not in self._warned:
            self._warned.add(message)
            self._tier_warning(message)

    def _tier_warning(self, message: str) -> None:
        log.warning("%s", message)
        warnings.warn(message, TierWarning, stacklevel=2)

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

    @property
    def step_wait_s(self) -> float:
        """Seconds optimizer steps waited for overlapped copies, in all (``save_mode="overlap"``)."""
        return float(getattr(self._path, "step_wait_s", 0.0))

    @property
    def last_save_stats(self) -> dict[str, Any]:
        """Deprecated: :attr:`last_save` as a dict (empty before the first save)."""
        deprecated("last_save_stats", "last_save (a SaveStats)", stacklevel=3)
        return asdict(self.last_save) if self.last_save is not None else {}

    def wait(self) -> None:
        """Block until the in-flight save is durable (and, with a local tier, its persist has
        finished, or the tier has kept what a restore fetched from peers); raise the save's error
        if it failed."""
        try:
            self._wait_save()
        finally:
            while True:  # the loop may have been started again meanwhile
                with self._persist_lock:
                    p = self._persisting
                if p is None or p.done():
                    break
                p.result()  # a failed persist warned; it never raises

    def _wait_save(self) -> None:
        f, self._inflight = self._inflight, None
        if f is not None:
            f.result()

    def close(self) -> None:
        """Finish the in-flight save (raising its error) and release resources (a later save raises
        :class:`SnapshotError`)."""
        self._closed = True
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._persist_pool.shutdown(wait=True)
            self._restore_signals()
            self._path.close()
            if self._local is not None:
                self._local.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the original error with a save error
            try:
                self.close()
            except Exception:  # noqa: BLE001
                log.exception("in-flight snapshot failed while handling another error")

    # -- retention -------------------------------------------------------------------
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
        from ckpt.snapshot.tiers import snapshot_step
        from ckpt_store.storage.errors import StoreFormatError

        with self._retaining:
            if self._retained is None:
                self._retained = set(step_refs(self.store, self.run))  # (each checked below: a pushed one is named in a warning)
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
                    log.warning("retention: could not read %s (%s); counting every step", self._durable.latest, describe(e))
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

    # -- restoring -----------------------------------------------------------------
    def restore_latest(self, state: dict[str, Any]) -> int | None:
        """Restore the newest snapshot into ``state`` in place; its step, or None if the run has none.

        With a local tier: the newest of the local and durable snapshots, each chunk read from
        the local tier where it is there with a correct hash, else from the durable store. A
        snapshot that no tier holds completely (a local one not persisted, with a damaged
        chunk) is skipped, with a :class:`TierWarning`, for the next newest.
        :attr:`last_restore` says which step was restored and the bytes each tier served."""
        self.wait()
        if self._local is None:
            mid = self._resolve(self._resolve_latest)
            return None if mid is None else self._restore(state, mid)
        if self._distributed:
            path = self._group_path
            assert path.peers is not None
            chosen = path.choose(self.store, self._durable.latest, self._warn_once)
            if chosen is None:
                return None
            _, mid, tiers = chosen
            step = path.restore(state, mid, tiers)
            self.last_restore = {"step": step, **tiers.served}
            self._refill(step, mid, tiers)
            return step
        candidates, parsed = self._candidates()
        for i, (step, mid) in enumerate(candidates):
            try:
                return self._restore(state, mid, parsed)
            except TIER_MISSES as e:
                if i == len(candidates) - 1:
                    raise
                self._tier_warning(f"snapshot of step {step} cannot be assembled from any tier ({describe(e)}); "
                                   f"restoring step {candidates[i + 1][0]} instead")
        return None

    def latest_step(self) -> int | None:
        """The step :meth:`restore_latest` would restore first, without restoring it; None if the run
        has no snapshot in any tier. In a group the ranks choose it together, as a restore does."""
        from ckpt.snapshot.tiers import snapshot_step

        self.wait()
        if self._local is None:
            def find() -> tuple[str, int | None, str | None]:  # in a group, on rank 0 alone: every rank says the same
                mid = self._resolve_latest()
                m = self.store.manifest(mid)
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
        """Restore the snapshot of ``step`` into ``state`` in place (from the nearest tier holding each chunk)."""
        self.wait()

        def find() -> str:
            if self._local is not None:
                try:
                    return self._local.store.resolve(self.ref(step))
                except RefNotFoundError:
                    pass
            return self.store.resolve(self.ref(step))

        if not self._distributed:
            return self._restore(state, find())
        mid = self._resolve(find)
        if mid is None:  # (on every rank alike)
            raise RefNotFoundError(f"no snapshot of step {step} in run {self.run!r}", hint="see mgr.steps() or `ckpt ls`")
        return self._restore(state, mid)

    @property
    def _group_path(self) -> DistributedSnapshots:
        """The snapshot path of a manager with a process group."""
        from ckpt.snapshot.distributed import DistributedSnapshots

        assert isinstance(self._path, DistributedSnapshots)
        return self._path

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
        from ckpt.snapshot.tiers import left_behind, left_behind_message, snapshot_step

        local = self._local
        assert local is not None
        found: dict[int, str] = {}
        parsed: dict[str, Manifest] = {}
        durable: tuple[int, str, float] | None = None  # the durable RUN/latest: step, id, made at
        try:
            mid = self._resolve_latest()
            m = parsed[mid] = self.store.manifest(mid)
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

    def _restore(self, state: dict[str, Any], mid: str, parsed: dict[str, Manifest] | None = None) -> int:
        """Restore ``mid`` from this manager's tiers; ``parsed``: manifests already read, by id."""
        from ckpt.snapshot.tiers import Tiers

        peers = getattr(self._path, "peers", None)
        if peers is not None:
            tiers = peers.tiers(self.store)
        else:
            tiers = Tiers(([("local", self._local.store)] if self._local else []) + [("store", self.store)])
        if parsed and mid in parsed:
            tiers.manifests[mid] = parsed[mid]
        step = self._path.restore(state, mid, tiers)
        self.last_restore = {"step": step, **tiers.served}
        if peers is not None:
            self._refill(step, mid, tiers)
        return step

    def _refill(self, step: int, mid: str, tiers: Tiers) -> None:
        """This rank's tier keeps what the restore fetched from peers (a replaced machine's tier refills),
        in the save thread: training starts at once, and the next save (or :meth:`wait`) waits for it."""
        peers = getattr(self._path, "peers", None)
        assert peers is not None

        def run() -> None:
            try:
                problem = peers.refill(step, mid, tiers)
            except Exception as e:  # noqa: BLE001 - the restore stands; the tier is only emptier
                problem = describe(e)
            if problem is not None:
                self._tier_warning(f"local tier: the chunks of step {step} fetched from peers not kept ({problem})")

        self._inflight = self._pool.submit(run)

    # -- preemption ----------------------------------------------------------------
    def _final_snapshot_due(self, step: int) -> bool:
        """Whether ``maybe_save(step)`` takes the final snapshot of a preempted run: once a preemption
        signal came. In a group every rank takes it at the step the first rank to see a signal named
        (:meth:`~ckpt.snapshot.group.CheckpointGroup.final_step`; a store lookup per ``maybe_save`` until
        then, with ``handle_signals`` only): each rank's signal comes at its own moment, and a rank
        that saved step 7 alone would wait in the save for one already training step 8, which waits
        for it in the gradient all-reduce, until ``timeout_s``, the final snapshot lost."""
        if not self._distributed or not self._old_handlers:
            return self.preempted
        if self._final_step is None:
            self._final_step = self._group_path.checkpoint_group.final_step(step, self.preempted)
        if self._final_step is None:
            return False
        self.preempted = True
        return step >= self._final_step

    def _install_signals(self, sigs: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        def handler(signum: int, frame: object) -> None:
            log.warning("signal %d: finishing the in-flight snapshot; the next maybe_save takes a final one", signum)
            self.preempted = True
            f = self._inflight
            if f is not None:
                f.exception()  # waits; the error, if any, is raised by the final save

        for s in sigs:
            self._old_handlers[s] = signal.signal(s, handler)

    def _restore_signals(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}


_RENAMED = {"async_save": "save_mode", "overlap_copy": "save_mode", "trust_version": "unchanged_by",
            "delta": "delta_vs_previous"}


def _old_spellings(old: dict[str, Any], save_mode: str, unchanged_by: str, delta: bool) -> tuple[str, str, bool]:
    """Map the parameters of earlier releases onto today's, with a DeprecationWarning each."""
    unknown = sorted(set(old) - set(_RENAMED))
    if unknown:
        raise TypeError(f"CheckpointManager() got unexpected keyword argument(s) {', '.join(unknown)}")
    for name in old:
        deprecated(f"CheckpointManager({name}=...)", f"{_RENAMED[name]}=...", stacklevel=4)
    if "async_save" in old or "overlap_copy" in old:
        if old.get("overlap_copy") and old.get("async_save", True) is False:
            raise ValueError("overlap_copy=True needs async_save=True (the copy overlaps training only in the background)")
        save_mode = "overlap" if old.get("overlap_copy") else ("async" if old.get("async_save", True) else "sync")
    if "trust_version" in old:
        unchanged_by = "version" if old["trust_version"] else "hash"
    if "delta" in old:
        delta = bool(old["delta"])
    return save_mode, unchanged_by, delta
