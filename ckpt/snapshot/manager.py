"""The training-loop manager: asynchronous, incremental snapshots and in-place restore.

This module holds :class:`CheckpointManager`'s settings, its construction, ``wait`` and ``close``; each
of its other concerns is a mixin of its own module: saving (saving.py), the local tier and persisting
to the durable store (persisting.py), restoring (restoring.py), retention applied to the store
(pruning.py) and preemption signals (preemption.py).

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
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ckpt._deprecation import deprecated
from ckpt.settings import Settings
from ckpt.snapshot.local_tier import LocalTierUsage
from ckpt.snapshot.persisting import Persisting, PersistStats
from ckpt.snapshot.preemption import Preemption
from ckpt.snapshot.pruning import Pruning
from ckpt.snapshot.restoring import Restoring
from ckpt.snapshot.retention import KeepBest, Retention, count_setting
from ckpt.snapshot.run import SnapshotError, SnapshotRun, TierWarning, modified_under_save
from ckpt.snapshot.saving import SaveStats, Saving
from ckpt.snapshot.steps import latest_manifest
from ckpt.transfer.parallel import results_of

if TYPE_CHECKING:
    from ckpt.format.manifest import Manifest
    from ckpt.snapshot.distributed import DistributedSnapshots
    from ckpt.store.store import Store

log = logging.getLogger(__name__)
SAVE_MODES = ("async", "sync", "overlap")
UNCHANGED_BY = ("version", "hash")

__all__ = ["SAVE_MODES", "CheckpointManager", "KeepBest", "LocalTierUsage", "PersistStats", "SaveStats", "SnapshotError",
           "TierWarning", "modified_under_save"]


class CheckpointManager(Saving, Persisting, Restoring, Pruning, Preemption):
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
    is not read at all: its chunks are reused (after a restore: the same as the restore left
    it). Only parameters and optimizer state are trusted so: every other tensor (a module's buffers, what a
    Stateful wrapper or a plain value hands out) is read at every save, ``torch.batch_norm`` updating running
    statistics in place without bumping their counters; its unchanged chunks are found by hash. Where versions cannot be trusted (a fused optimizer in the state, or one that stepped anywhere in the process while the manager lived) every tensor is
    staged and unchanged chunks are found by hash instead; ``"hash"`` always does that (writes through
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
    copying the chunks it lacks, raw ones compressed on the way (:attr:`last_persist`); without
    ``every_n_steps`` only ``save(..., persist=True)`` and a preemption's final snapshot are (the first
    save that persists nothing warns). :meth:`restore_latest` takes the
    newest snapshot of any tier, each chunk from the nearest tier holding it with a correct
    hash; :attr:`last_restore` is ``{"step", "local", "peer", "store"}`` (bytes per tier, the stored headers read to check the entries included).
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
        self._final_step = None  # in a group: the step of the final snapshot the ranks agreed on
        self.last_save = None
        self.last_persist = None
        self.last_restore = None
        self._durable = SnapshotRun(self.store, self.run, delta_vs_previous)
        self._distributed = process_group is not None
        if not isinstance(local_compress, bool):
            raise ValueError(f"local_compress must be True or False, not {local_compress!r}")
        self._local_compress = local_compress
        self._retaining = threading.Lock()  # see _retain
        # The durable steps retention counts: the run's, listed once (at the first retention), then each
        # one saved there; a hint, each checked against the store at every retention (see _retain).
        self._retained = None
        self._latest_id = None  # the id RUN/latest named when last checked or saved (see _check_latest)
        self._latest_warned = False
        self._warned = set()  # what _warn_once said
        self._said_local_only = False  # the warning that no snapshot is persisted (a local tier, no every_n_steps)
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
        self._persisting = None
        self._persist_slot = None  # (step, save number, checkpoint id)
        self._persist_lock = threading.Lock()
        self._durable_lock = threading.Lock()  # moving RUN/latest in the durable store: never to an older save
        # Saves are numbered in the order they are made: a persist moves RUN/latest only to a save newer
        # than the one it names (its number; 0: a save of an earlier process), whatever their steps.
        self._saves = 0
        self._saved_step = None  # the step of the newest save (with a local tier)
        self._published = 0
        self._durable_step = None  # the step RUN/latest names in the durable store,
        self._durable_known = False  # once read (at the first save with a local tier)
        self._persist_pending = False  # a persist failed: the next save persists
        self._unpersistable: tuple[Exception, str | None] | None = None  # a persist's failure on a damaged tier chunk
        self._inflight = None
        self._closed = False
        # keep_best's metrics of the steps retention counts (a step's manifest holds them too): those it removes are dropped
        self._metrics = {}
        self._snapshot_ids = {}  # retention: step -> (manifest id, whether a snapshot)
        self._old_handlers = {}
        if process_group is not None:
            if save_mode == "overlap":
                raise ValueError("save_mode='overlap' is for one process; with process_group use 'async' or 'sync'")
            from ckpt.snapshot.distributed import DistributedSnapshots

            self._path = DistributedSnapshots(self._target, process_group, timeout_s, local=self._local, replicas=replicas,
                                              replica_stride=replica_stride, replica_nodes=replica_nodes)
        else:
            from ckpt.snapshot.local import LocalSnapshots

            self._path = LocalSnapshots(self._target, overlap=save_mode == "overlap", unchanged_by=unchanged_by,
                                        room=self._local.fit if self._local else None)
        if handle_signals:
            self._install_signals()

    def _latest_manifest(self, parsed: dict[str, Manifest]) -> tuple[str, Manifest]:
        """:func:`~ckpt.snapshot.steps.latest_manifest` of the durable store (the id ``RUN/latest`` names, or
        the run's newest snapshot), warning once of each fallback; ``parsed``: the manifests read, by id."""
        return latest_manifest(self.store, self.run, self._warn_once, parsed)

    def _warn_once(self, message: str) -> None:
        """A :class:`TierWarning` this manager has not given yet (``latest_step()`` then ``restore_latest()``
        meet the same missing RUN/latest: one warning says it)."""
        if message not in self._warned:
            self._warned.add(message)
            self._tier_warning(message)

    def _tier_warning(self, message: str) -> None:
        log.warning("%s", message)
        warnings.warn(message, TierWarning, stacklevel=2)

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
        except Exception:
            self._wait_persist()
            raise
        # (Ctrl-C, SIGTERM: at once, not after a persist in flight too, which may take minutes)
        self._wait_persist()

    def _wait_persist(self) -> None:
        while True:  # the loop may have been started again meanwhile
            with self._persist_lock:
                p = self._persisting
            if p is None or p.done():
                break
            results_of([p])  # a failed persist warned; it never raises

    def _check_open(self, what: str, verb: str) -> None:
        """Raise :class:`SnapshotError` (``what``: what did not happen) once the manager is closed: its save
        thread is gone, and its local tier, let go, may be another manager's by now (which prunes and collects
        it without grace); ``verb``: what to do with a new manager instead."""
        if self._closed:
            raise SnapshotError(f"{what}: this CheckpointManager of run {self.run!r} is closed",
                                hint=f"{verb} with a new CheckpointManager (or {verb} before leaving its `with` block)")

    def _wait_save(self) -> None:
        f = self._inflight
        if f is None:
            return
        try:  # (not f.result(): a Ctrl-C another thread took would wait for the whole save)
            results_of([f])
        finally:
            if f.done():  # its error raised once; interrupted, it is still in flight: the next save waits for it
                self._inflight = None

    def close(self) -> None:
        """Finish the in-flight save (raising its error) and release resources (a later save raises
        :class:`SnapshotError`)."""
        self._closed = True
        try:
            self.wait()
            unpersistable = self._take_unpersistable() if self._local is not None else None
            if unpersistable is not None:  # (no save comes to remove them: a restart's saves would reuse them)
                self._forget_unpersistable(*unpersistable)
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

    @property
    def _group_path(self) -> DistributedSnapshots:
        """The snapshot path of a manager with a process group."""
        from ckpt.snapshot.distributed import DistributedSnapshots

        assert isinstance(self._path, DistributedSnapshots)
        return self._path


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
