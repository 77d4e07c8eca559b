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
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckpt.errors import CkptError, RefNotFoundError, TensorMismatchError
from ckpt.format.manifest import TensorEntry
from ckpt.settings import Settings
from ckpt.snapshot.state import Stateful, flatten, tensor_refs, unflatten

if TYPE_CHECKING:
    import torch

    from ckpt.snapshot.live import LiveTensors
    from ckpt.store.store import Store

log = logging.getLogger(__name__)
SNAPSHOT_FORMAT = 1
_STEP = re.compile(r"^step-(\d+)$")


class SnapshotError(CkptError):
    """A snapshot could not be saved or restored."""


def modified_under_save(names: list[str]) -> SnapshotError:
    """The error of an overlapped save (``overlap_copy=True``) whose tensors changed under it."""
    listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return SnapshotError(
        f"{listed} {'was' if len(names) == 1 else 'were'} modified in place while save() read "
        f"{'it' if len(names) == 1 else 'them'} in the background; with overlap_copy=True only the "
        "optimizer's step may change parameters and optimizer state, and it waits for the snapshot")


class CheckpointManager:
    """Saves and restores the state of one training run in a ckpt store.

    Snapshots are ordinary checkpoints: refs ``RUN/step-N`` plus the alias
    ``RUN/latest``, visible to ``ckpt ls/log/show/pull/diff``.

    ``save(step, state)`` blocks only while tensors that changed since the previous
    snapshot are copied into a reusable staging area (pinned memory for CUDA
    tensors); hashing, encoding (as a delta against the previous snapshot where that
    is smaller, with ``delta=True``) and writing run in the background. One save is in flight at a time:
    the next one waits for it, so memory stays at about one copy of the state. An
    error in the background is raised by the next ``save``, ``wait`` or ``close``.

    A tensor is known to be unchanged when it is the same storage with the same
    in-place version counter (``tensor._version``) as at the previous save; its
    chunks are then reused without reading it. Where versions cannot be trusted
    (a fused optimizer in the state, or after a restore) every tensor is staged and
    unchanged chunks are found by hash instead. Writes through ``.data`` also bypass
    the counter: pass ``trust_version=False`` if your code does that.

    Restore reads in parallel straight into the live tensors (module parameters and
    buffers, an optimizer's existing state tensors; other state gets new tensors that
    its ``load_state_dict`` receives), re-hashing every byte. A restore that fails
    part way (a damaged chunk, say) has overwritten some of them: restore again, from
    another snapshot if need be.

    Retention, applied after each save: keep the last ``keep_last`` snapshots, every
    snapshot whose step is a multiple of ``keep_every``, and the ``keep_best[2]``
    best by metric ``keep_best[0]`` (``"min"`` or ``"max"`` as ``keep_best[1]``).
    Other snapshot refs are removed; ``ckpt gc`` frees their data.

    ``delta`` is off by default: a delta against the previous snapshot (with
    compression kept wherever it saves 10%, not 25%) wrote 0.55-0.63x the bytes of
    a plain save of dense training state in the benchmark, but costs the background
    pipeline a read of the previous snapshot and every restore a chain of decodes
    (benchmarks/results/snapshot.md).

    ``overlap_copy=True`` (with ``async_save``) goes further: the parameters and state
    of the optimizers in ``state`` are not copied by ``save`` at all. They cannot change
    before the optimizer's next ``step()``, so the save thread reads them in place while
    forward and backward run; a step pre-hook on each optimizer then copies only what
    the save has not read yet before letting the step modify them (CUDA tensors: the
    step waits for their copy to pinned memory). When the background keeps up, the
    step does not wait and no staging copy exists (benchmarks/results/snapshot.md:
    blocked 0.006 s for 1.2 GB, peak memory 1.33x the state instead of 2.30x);
    :attr:`step_wait_s` adds up the steps' waits. Everything else in the state is
    copied before ``save`` returns. Nothing but the optimizer step may modify those
    tensors in place meanwhile: a change is caught by the version counter and fails
    that snapshot (raised by the next ``save``/``wait``/``close``; never published).

    ``handle_signals=True`` installs SIGTERM/SIGUSR1 handlers (preemption): the
    in-flight save is finished, :attr:`preempted` becomes True, and the next
    :meth:`maybe_save` takes a final snapshot, waits until it is durable and raises
    ``SystemExit(preempt_exit_code)``. The default, 143 (128 + SIGTERM), is the status
    the signal itself would have ended the process with: schedulers (SLURM, Kubernetes,
    torchrun's elastic agent) read it as "killed, requeue or restart", where 0 reads as
    "finished" and ends the job.

    A snapshot is durable when :meth:`wait` (or :meth:`close`) returns; ``save`` and
    ``maybe_save`` return earlier (``async_save``), so a crash right after them may
    resume from the previous snapshot.

    Settings are checked at construction (``ValueError`` naming the parameter):
    ``every_n_steps``, ``keep_last``, ``keep_every`` and a ``keep_best`` count are
    ints >= 1 (not bools) or None; ``timeout_s`` a finite number > 0;
    ``preempt_exit_code`` an int in 0..255.

    With ``process_group`` (e.g. ``torch.distributed.group.WORLD``) every rank calls
    the same ``save``/``restore_latest``: snapshots are saved and restored through
    ``torch.distributed.checkpoint`` (sharded state, resharded on restore), and a rank
    that fails or dies makes the others raise after ``timeout_s`` (ckpt/snapshot/distributed.py).
    Per rank: :class:`~ckpt.snapshot.state.RNGState` (Python, NumPy, torch CPU and CUDA
    generators) and anything wrapped in :class:`~ckpt.snapshot.state.PerRank` are saved once per
    rank and each rank gets its own back (so only on as many ranks). Everything else
    (modules, optimizers, schedulers, grad scalers, plain values) is assumed identical
    on every rank, as under DDP, or sharded as DTensors; rank 0's copy of a replicated
    tensor is saved, and a save whose non-tensor values or tensor shapes differ between
    ranks is refused. Optimizers are restored exactly even when fresh (no state before
    their first step). A restore that cannot place every saved item, or would give one
    rank's per-rank state to another, raises :class:`SnapshotError` on every rank.
    """

    def __init__(
        self,
        store: str | Store,
        run: str,
        *,
        every_n_steps: int | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[str, str] | tuple[str, str, int] | list[Any] | None = None,
        async_save: bool = True,
        overlap_copy: bool = False,
        handle_signals: bool = False,
        trust_version: bool = True,
        delta: bool = False,
        settings: Settings | None = None,
        process_group: Any = None,
        timeout_s: float = 1800.0,
        preempt_exit_code: int = 143,
    ) -> None:
        from ckpt.store.store import Store
        from ckpt_store.storage.refs import validate_ref_name

        every_n_steps = _count("every_n_steps", every_n_steps)
        keep_last = _count("keep_last", keep_last)
        keep_every = _count("keep_every", keep_every)
        keep_best = _keep_best(keep_best)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, not {timeout_s!r}")
        if isinstance(preempt_exit_code, bool) or not isinstance(preempt_exit_code, int) or not 0 <= preempt_exit_code <= 255:
            raise ValueError(f"preempt_exit_code must be an int in 0..255 (an exit status), not {preempt_exit_code!r}")
        if overlap_copy and not async_save:
            raise ValueError("overlap_copy=True needs async_save=True (the copy overlaps training only in the background)")
        if settings is None and not isinstance(store, Store):
            # Restores are on the critical path of every restart: keep compression only
            # where it saves at least 25%, so most chunks restore as one read into the
            # tensor plus a hash. Measured on the benchmark's 1.2 GB GPT + AdamW state:
            # at 10%, 0.72 of the bytes and a 0.48 s warm restore; at 30%, 0.86 and 0.27 s
            # (weights and first moments save ~17% and stay raw; second moments compress).
            # delta=True asks for bytes over restore speed: there 10%.
            settings = Settings.from_env(min_saving=0.10 if delta else 0.25)
        self.store = store if isinstance(store, Store) else Store.open(store, settings=settings, create=True)
        self.run = validate_ref_name(run)
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.keep_best = keep_best
        self.preempt_exit_code = preempt_exit_code
        self.async_save = async_save
        self.overlap_copy = overlap_copy
        self._copied = threading.Event()  # clear while an overlapped copy is pending
        self._copied.set()
        self._step_hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        self.step_wait_s = 0.0  # seconds optimizer steps waited for overlapped copies, in all
        self._live: LiveTensors | None = None  # the in-flight save's tensors read in place
        self.trust_version = trust_version
        self.delta = delta
        self.preempted = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._inflight: Future[None] | None = None
        self._lock = threading.Lock()
        self._staging: dict[str, torch.Tensor] = {}
        self._keys: dict[str, tuple[Any, ...]] = {}  # identity + version at the previous save
        # The tensors those keys describe, held so that their memory cannot be freed and
        # reused by a new tensor with the same address and version (torch.get_rng_state()
        # returns a fresh tensor each call, often at the address of the last one).
        self._held: dict[str, Any] = {}
        self._last: tuple[str, dict[str, TensorEntry]] | None = None  # previous snapshot: id, entries
        self._metrics: dict[int, dict[str, float]] = {}
        self._streams: dict[Any, Any] = {}  # CUDA device -> its copy stream
        self._old_handlers: dict[int, Any] = {}
        self.last_save_stats: dict[str, float] = {}
        if handle_signals:
            self._install_signals()
        self._dist = None
        if process_group is not None:
            from ckpt.snapshot.distributed import DistributedSnapshots

            self._dist = DistributedSnapshots(self, process_group, timeout_s)

    # -- saving ------------------------------------------------------------------
    def ref(self, step: int) -> str:
        return f"{self.run}/step-{step}"

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
        """Snapshot ``state`` as step ``step``. Returns once tensors are staged (or saved, if not async)."""
        import time

        if not isinstance(step, int) or step < 0:
            raise ValueError("step must be a non-negative int")
        self.wait()
        if self._dist is not None:
            return self._dist.save(step, state, metrics)
        t0 = time.perf_counter()
        tensors, tree = flatten(state)
        optimizers = _optimizers(state)
        defer = _optimizer_storages(optimizers) if self.overlap_copy else frozenset()
        staged, reuse, keys, pending, live = self._stage(
            tensors, trust=self.trust_version and not _has_fused_optimizer(optimizers), defer=defer)
        held = {n: t.detach() for n, t in tensors.items()}
        ready, in_place = None, None
        if live or pending:
            self._hook_optimizers(optimizers)
        if live:
            from ckpt.snapshot.live import LiveTensors

            in_place = self._live = LiveTensors(live, {n: keys[n][1] for n in live})
        if pending:
            self._copied.clear()
            devices = {t.device for _, _, t in pending if t.device.type == "cuda"}
            if devices:
                import torch

                # the copies start after the work queued so far on each device, not later work
                ready = {d: torch.cuda.current_stream(d).record_event() for d in devices}
        blocked = time.perf_counter() - t0
        snapshot = {"format": SNAPSHOT_FORMAT, "run": self.run, "step": step, "tree": tree,
                    "metrics": dict(metrics or {})}

        def job() -> None:
            try:
                if pending:
                    self._copy_pending(pending, keys, ready)
                self._write(step, staged, reuse, keys, held, snapshot, blocked, in_place)
            finally:
                self._live = None  # the optimizer steps no longer wait on it; its copies go with it

        if self.async_save:
            self._inflight = self._pool.submit(job)
        else:
            job()

    def _stage(self, tensors: dict[str, torch.Tensor], trust: bool, defer: frozenset[int] = frozenset(),
               ) -> tuple[dict[str, torch.Tensor], dict[str, TensorEntry], dict[str, tuple[Any, ...]],
                          list[tuple[str, torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """Copy changed tensors into the staging area; the rest reuse the previous snapshot's entries.

        Without ``trust`` every tensor is staged (and unchanged chunks are found by
        their hash in the background instead). Tensors whose storage is in ``defer``
        are not copied now: CUDA ones are returned as (name, staging buffer, tensor) to
        copy in the background, contiguous CPU ones as ``live`` (read in place, see
        ckpt/snapshot/live.py; they need no staging buffer)."""
        import torch

        staged: dict[str, torch.Tensor] = {}
        reuse: dict[str, TensorEntry] = {}
        keys: dict[str, tuple[Any, ...]] = {}
        pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        live: dict[str, torch.Tensor] = {}
        previous = self._last[1] if self._last else {}
        cuda = []
        for name, t in tensors.items():
            t = t.detach()
            key = (t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device, t.stride())
            keys[name] = key
            if trust and self._keys.get(name) == key and name in previous:
                reuse[name] = previous[name]
                continue
            deferred = bool(defer) and t.untyped_storage().data_ptr() in defer
            if deferred and t.device.type == "cpu" and t.is_contiguous():
                live[name] = staged[name] = t
                self._staging.pop(name, None)
                continue
            buf = self._staging.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
                self._staging[name] = buf
            if deferred:
                pending.append((name, buf, t))
            elif t.device.type == "cuda":
                cuda.append((buf, t))
            else:
                buf.copy_(t)
            staged[name] = buf
        if cuda:
            self._copy_from_cuda(cuda)
        for name in set(self._staging) - set(tensors):
            del self._staging[name]  # the state shrank: free what no longer has a source
        return staged, reuse, keys, pending, live

    def _copy_pending(self, pending: list[tuple[str, torch.Tensor, torch.Tensor]], keys: dict[str, tuple[Any, ...]],
                      ready: Any) -> None:
        """The overlapped copy (in the save thread): stage ``pending``, release the optimizer
        steps waiting for it, then check that no tensor changed while it was copied."""
        try:
            cuda = [(buf, t) for _, buf, t in pending if t.device.type == "cuda"]
            for _, buf, t in pending:
                if t.device.type != "cuda":
                    buf.copy_(t)
            if cuda:
                self._copy_from_cuda(cuda, ready)
        finally:
            self._copied.set()
        changed = [name for name, _, t in pending if t._version != keys[name][1]]
        if changed:
            raise modified_under_save(changed)

    def _hook_optimizers(self, optimizers: list[Any]) -> None:
        for opt in optimizers:
            if id(opt) not in self._step_hooks:
                self._step_hooks[id(opt)] = opt.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        import time

        live = self._live
        if live is None and self._copied.is_set():
            return
        t0 = time.perf_counter()
        if live is not None:
            live.release()  # copies what the save has not read yet
        self._copied.wait()
        self.step_wait_s += time.perf_counter() - t0

    def _copy_from_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready: dict[Any, Any] | None = None) -> None:
        """Device-to-host copies into pinned buffers on a side stream per device, ordered
        after the work already queued on that device's current stream (or after the
        events ``ready``, recorded by the training thread when this runs in another)."""
        import torch

        by_device: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for buf, t in pairs:
            by_device.setdefault(t.device, []).append((buf, t))
        streams = []
        for device, group in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            if ready is not None:
                stream.wait_event(ready[device])
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # also makes the stream's device current
                for buf, t in group:
                    buf.copy_(t, non_blocking=True)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()  # the staged bytes are complete before training may touch them

    def _write(self, step: int, staged: dict[str, torch.Tensor], reuse: dict[str, TensorEntry],
               keys: dict[str, tuple[Any, ...]], held: dict[str, Any], snapshot: dict[str, Any], blocked: float,
               live: LiveTensors | None = None) -> None:
        import time

        from ckpt.store.push import push_source
        from ckpt.store.sources import from_tensors

        t0 = time.perf_counter()
        try:
            known = {n: (e.dtype, e.shape, e.nbytes) for n, e in reuse.items()}
            # tensors read in place until the optimizer steps come from ``live``
            in_place = {n: live.source(n) for n in live.names} if live is not None else None
            src = from_tensors(staged, "snapshot", {"snapshot": snapshot}, None, known, in_place)
            base = self._last[0] if (self._last and self.delta) else None
            result = push_source(self.store, src, self.ref(step), base_id=base, reuse=reuse,
                                 lineage={"parent": self._last[0] if self._last else None, "base": base, "merge": None},
                                 aliases=(f"{self.run}/latest",))
            m = result.manifest
            assert m is not None
        except BaseException:
            self._last, self._keys, self._held = None, {}, {}  # next save starts over: no reuse of unknown state
            raise
        self._last = (result.id, {t.name: t for t in m.tensors})
        self._keys, self._held = keys, held
        self._metrics[step] = snapshot["metrics"]
        self.last_save_stats = {"step": step, "blocked_s": blocked, "background_s": time.perf_counter() - t0,
                                "written_bytes": result.written_bytes, "logical_bytes": result.logical_bytes,
                                "staged_tensors": len(staged), "reused_tensors": len(reuse),
                                "copied_at_step_bytes": live.copied_bytes if live is not None else 0}
        self._retain()

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
            for handle in self._step_hooks.values():
                handle.remove()
            self._step_hooks = {}

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
        for name in self.store.refs_db.live():
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
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return
        steps = self.steps()
        keep = set(steps[-self.keep_last:]) if self.keep_last else set()
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        if self.keep_best:
            name, mode, count = self.keep_best
            scored = [(self._metric(s)[name], s) for s in steps if name in self._metric(s)]
            scored.sort(reverse=mode == "max")
            keep |= {s for _, s in scored[:count]}
        if steps:
            keep.add(steps[-1])  # never prune what latest points at
        for s in steps:
            if s not in keep:
                self.store.remove(self.ref(s))

    # -- restoring -----------------------------------------------------------------
    def restore_latest(self, state: dict[str, Any]) -> int | None:
        """Restore the newest snapshot into ``state`` in place; its step, or None if the run has none."""
        self.wait()
        try:
            mid = self.store.resolve(f"{self.run}/latest")
        except RefNotFoundError:
            return None
        return self._restore(state, mid)

    def restore(self, state: dict[str, Any], step: int) -> int:
        """Restore the snapshot of ``step`` into ``state`` in place."""
        self.wait()
        return self._restore(state, self.store.resolve(self.ref(step)))

    def _restore(self, state: dict[str, Any], mid: str) -> int:
        import torch

        from ckpt.format.dtypes import to_torch
        from ckpt.store.load import fill

        if self._dist is not None:
            return self._dist.restore(state, mid)
        m = self.store.get_manifest(mid)
        snap = m.extra.get("snapshot")
        if not isinstance(snap, dict) or snap.get("format") != SNAPSHOT_FORMAT or "tree" not in snap:
            raise SnapshotError(f"checkpoint {mid[:12]} is not a snapshot of this ckpt version")
        tree: dict[str, Any] = snap["tree"]
        missing = sorted(set(state) - set(tree))
        if missing:
            raise TensorMismatchError(f"snapshot of step {snap['step']} has no {missing}", hint="restore a subset of keys")
        entries = {t.name: t for t in m.tensors}
        pairs: list[tuple[TensorEntry, torch.Tensor]] = []
        decoded: dict[str, torch.Tensor] = {}
        loaders = []
        used: set[int] = set()  # storages already written by this restore: never two writers
        for key, obj in state.items():
            kind, value = tree[key]["kind"], tree[key]["value"]
            names = tensor_refs(value)
            if isinstance(obj, torch.nn.Module):
                live = {f"{key}/{k}": v for k, v in obj.state_dict().items()}
                extra, absent = sorted(set(names) - set(live)), sorted(set(live) - set(names))
                if extra or absent:
                    raise TensorMismatchError(f"{key}: snapshot and module differ: not in module {extra[:10]}, "
                                              f"not in snapshot {absent[:10]}")
                pairs += [(entries[n], live[n]) for n in names]  # straight into the parameters
                used.update(t.untyped_storage().data_ptr() for t in live.values() if t.numel())
                continue
            # An optimizer's (or any Stateful's) own tensors of the right shape and dtype are
            # written in place, and load_state_dict() then adopts them without a copy: no
            # fresh allocation (page faults) for the largest part of a training state.
            live_t = _live_tensors(key, obj) if kind == "stateful" else {}
            for n in names:
                e = entries[n]
                t = live_t.get(n)
                if t is None or tuple(t.shape) != e.shape or t.dtype != to_torch(e.dtype) or t.untyped_storage().data_ptr() in used:
                    t = torch.empty(e.shape, dtype=to_torch(e.dtype))
                elif t.numel():
                    used.add(t.untyped_storage().data_ptr())
                decoded[n] = t
                pairs.append((e, t))
            loaders.append((key, obj, kind, value))
        # Restoring writes tensors without bumping their version counters: forget
        # what the last save saw, so the next one stages everything again.
        self._keys, self._held = {}, {}
        self._last = (mid, entries)
        fill(self.store, m, pairs)
        for key, obj, kind, value in loaders:
            restored = unflatten(value, decoded)
            if kind == "stateful" and isinstance(obj, Stateful):
                obj.load_state_dict(restored)
            else:
                state[key] = restored
        return int(snap["step"])

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



def _count(name: str, value: Any) -> int | None:
    """A retention or schedule setting: None, or an int >= 1 (a bool is not a count)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, not {value!r}")
    return value


def _keep_best(value: Any) -> tuple[str, str, int] | None:
    """``(metric, "min" | "max"[, count >= 1])`` as a 3-tuple (count 1 by default)."""
    if value is None:
        return None
    shape = "keep_best must be (metric, 'min' | 'max'[, count >= 1])"
    if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
        raise ValueError(f"{shape}, not {value!r}")
    metric, mode, count = value[0], value[1], (value[2] if len(value) == 3 else 1)
    if not isinstance(metric, str) or not metric or mode not in ("min", "max"):
        raise ValueError(f"{shape}, not {value!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{shape}: the count must be an int >= 1, not {count!r}")
    return (metric, mode, count)


def _live_tensors(key: str, obj: Any) -> dict[str, Any]:
    """The tensors ``obj.state_dict()`` hands out, by their snapshot names (empty if it cannot say)."""
    if not isinstance(obj, Stateful):
        return {}
    try:
        tensors, _ = flatten({key: obj})
    except Exception:  # noqa: BLE001 - a state that cannot be flattened is restored into new tensors
        return {}
    return tensors


def _optimizers(state: dict[str, Any]) -> list[Any]:
    """The optimizers in ``state`` whose ``step`` runs the update, unwrapped: a wrapper such
    as accelerate's ``AcceleratedOptimizer`` (what a transformers ``Trainer`` holds) is an
    ``Optimizer`` subclass that never ran ``Optimizer.__init__`` and steps the one it wraps,
    so hooks go on that one."""
    import torch

    found = []
    for obj in state.values():
        if isinstance(obj, torch.optim.Optimizer):
            while isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
                obj = obj.optimizer
            found.append(obj)
    return found


def _optimizer_storages(optimizers: list[Any]) -> frozenset[int]:
    """Storages (by address) that only ``optimizers`` change: their parameters and
    per-parameter state. An overlapped copy may defer these."""
    import torch

    ptrs: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            ptrs.update(p.untyped_storage().data_ptr() for p in group["params"])
        for per_param in opt.state.values():
            ptrs.update(v.untyped_storage().data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
    return frozenset(ptrs)


def _has_fused_optimizer(optimizers: list[Any]) -> bool:
    """Fused optimizers update parameters and moments in place without bumping
    ``tensor._version``: with one in the state, versions cannot be trusted."""
    return any(any(g.get("fused") for g in o.param_groups) for o in optimizers)
