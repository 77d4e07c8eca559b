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
import re
import signal
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ckpt._deprecation import deprecated
from ckpt.errors import RefNotFoundError
from ckpt.settings import Settings
from ckpt.snapshot.retention import KeepBest, Retention, count_setting
from ckpt.snapshot.run import SNAPSHOT_FORMAT, SaveResult, SnapshotError, SnapshotPath, SnapshotRun, modified_under_save

if TYPE_CHECKING:
    from ckpt.store.store import Store

log = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d+)$")
SAVE_MODES = ("async", "sync", "overlap")
UNCHANGED_BY = ("version", "hash")

__all__ = ["SAVE_MODES", "CheckpointManager", "KeepBest", "SaveStats", "SnapshotError", "modified_under_save"]


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
    "finished" and ends the job.

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
        **deprecated: Any,
    ) -> None:
        from ckpt.store.store import Store
        from ckpt_store.storage.refs import validate_ref_name

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
        self.store = store if isinstance(store, Store) else Store.init(store, settings=settings)
        self.run = validate_ref_name(run)
        self.save_mode = save_mode
        self.preempt_exit_code = preempt_exit_code
        self.preempted = False
        self.last_save: SaveStats | None = None
        self._target = SnapshotRun(self.store, self.run, delta_vs_previous)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._inflight: Future[None] | None = None
        self._metrics: dict[int, dict[str, float]] = {}
        self._old_handlers: dict[int, Any] = {}
        self._path: SnapshotPath
        if process_group is not None:
            if save_mode == "overlap":
                raise ValueError("save_mode='overlap' is for one process; with process_group use 'async' or 'sync'")
            from ckpt.snapshot.distributed import DistributedSnapshots

            self._path = DistributedSnapshots(self._target, process_group, timeout_s)
        else:
            from ckpt.snapshot.local import LocalSnapshots

            self._path = LocalSnapshots(self._target, overlap=save_mode == "overlap", unchanged_by=unchanged_by)
        if handle_signals:
            self._install_signals()

    # -- saving ------------------------------------------------------------------
    def ref(self, step: int) -> str:
        """The ref of the snapshot of ``step``: ``RUN/step-N``."""
        return self._target.ref(step)

    def maybe_save(self, step: int, state: dict[str, Any], metrics: dict[str, float] | None = None) -> bool:
        """Save if ``step`` is a multiple of ``every_n_steps``; True if it saved.

        After a preemption signal (``handle_signals=True``) it saves whatever the step,
        waits until that snapshot is durable, closes the manager and raises
        ``SystemExit(preempt_exit_code)``."""
        if self.preempted:
            self.save(step, state, metrics)
            self.close()
            log.warning("preempted: snapshot of step %d is durable; exiting with %d", step, self.preempt_exit_code)
            raise SystemExit(self.preempt_exit_code)
        if self.every_n_steps and step % self.every_n_steps == 0:
            self.save(step, state, metrics)
            return True
        return False

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """Snapshot ``state`` as step ``step``. Returns once what must be copied is copied
        (``save_mode="sync"``: once the snapshot is durable)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError("step must be a non-negative int")
        self.wait()
        t0 = time.perf_counter()
        snapshot = {"format": SNAPSHOT_FORMAT, "run": self.run, "step": step, "metrics": dict(metrics or {})}
        background = self.save_mode != "sync"
        job = self._path.save(step, state, snapshot, background=background)
        blocked = time.perf_counter() - t0

        def finish() -> None:
            t1 = time.perf_counter()
            result = job()
            self._saved(step, snapshot["metrics"], result, blocked, time.perf_counter() - t1)

        if background:
            self._inflight = self._pool.submit(finish)
        else:
            finish()

    def _saved(self, step: int, metrics: dict[str, float], r: SaveResult, blocked: float, background: float) -> None:
        self._metrics[step] = metrics
        self.last_save = SaveStats(step, blocked, background, r.written_bytes, r.logical_bytes, r.staged_tensors,
                                   r.reused_tensors, r.copied_at_step_bytes)
        if r.prunes:  # in a group the coordinator alone prunes, so that ranks never race to remove a ref
            self._retain()

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
        """Block until the in-flight save is durable; raise its error if it failed."""
        f, self._inflight = self._inflight, None
        if f is not None:
            f.result()

    def close(self) -> None:
        """Finish the in-flight save (raising its error) and release resources."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._restore_signals()
            self._path.close()

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
        """Steps of the run's live snapshots, oldest first."""
        prefix = f"{self.run}/"
        out = []
        for name in self.store.refs():
            m = _STEP.match(name[len(prefix):]) if name.startswith(prefix) else None
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def _metric(self, step: int) -> dict[str, float]:
        if step not in self._metrics:
            m = self.store.manifest(self.ref(step))
            self._metrics[step] = (m.extra.get("snapshot") or {}).get("metrics") or {}
        return self._metrics[step]

    def _retain(self) -> None:
        if self.retention.keeps_all:
            return
        steps = self.steps()
        metrics = {s: self._metric(s) for s in steps} if self.retention.best else {}
        keep = set(self.retention.keep(steps, metrics))
        for s in steps:
            if s not in keep:
                self.store.remove(self.ref(s))

    # -- restoring -----------------------------------------------------------------
    def restore_latest(self, state: dict[str, Any]) -> int | None:
        """Restore the newest snapshot into ``state`` in place; its step, or None if the run has none."""
        self.wait()
        try:
            mid = self.store.resolve(self._target.latest)
        except RefNotFoundError:
            return None
        return self._path.restore(state, mid)

    def restore(self, state: dict[str, Any], step: int) -> int:
        """Restore the snapshot of ``step`` into ``state`` in place."""
        self.wait()
        return self._path.restore(state, self.store.resolve(self.ref(step)))

    # -- preemption ----------------------------------------------------------------
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
