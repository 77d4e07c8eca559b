"""Snapshots of one process: staged copies, chunks written in the background, in-place restores.

``save`` copies the tensors that changed since the previous snapshot into a reusable
staging area (pinned memory for CUDA tensors) and returns the rest as a job: hashing,
encoding (a delta against the previous snapshot with ``run.delta``) and writing. With
``overlap=True`` the parameters and state of the optimizers in the state are not copied
at all: the job reads them in place while forward and backward run, and a step
pre-hook on each optimizer copies only what the job has not read yet before the step
may modify them (CUDA tensors: the step waits for their copy to pinned memory).

A tensor is known to be unchanged when it is the same storage with the same in-place
version counter (``tensor._version``) as at the previous save (``unchanged_by="version"``);
its chunks are then reused without reading it. Where versions cannot be trusted (a fused
optimizer in the state, after a restore, or ``unchanged_by="hash"``) every tensor is staged
and unchanged chunks are found by hash instead.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ckpt.errors import CkptError, TensorMismatchError
from ckpt.format.entries import TensorEntry
from ckpt.format.tagged_json import LATER_TAGS, uses_tags
from ckpt.snapshot.run import (
    SNAPSHOT_FORMATS,
    SNAPSHOT_SOURCE,
    SNAPSHOT_TORCH_FORMAT,
    SaveJob,
    SaveResult,
    SnapshotError,
    SnapshotRun,
    is_snapshot,
    modified_under_save,
    not_a_snapshot,
)
from ckpt.snapshot.state import (
    Stateful,
    autograd_flag_sets,
    autograd_flags,
    check_classes,
    device_here,
    flatten,
    optimizers_in,
    recorded_classes,
    recorded_devices,
    tensor_devices,
    unflatten,
    with_autograd_flags,
)
from ckpt.store.source_tensors import storable_dtype

if TYPE_CHECKING:
    import torch

    from ckpt.snapshot.live import LiveTensors
    from ckpt.snapshot.tiers import Tiers


class LocalSnapshots:
    """The :class:`~ckpt.snapshot.run.SnapshotPath` of a single process."""

    def __init__(self, run: SnapshotRun, *, overlap: bool = False, unchanged_by: str = "version") -> None:
        self.run = run
        self.store = run.store
        self.overlap = overlap
        self.trust_version = unchanged_by == "version"
        self._copied = threading.Event()  # clear while an overlapped copy is pending
        self._copied.set()
        self._step_hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        self.step_wait_s = 0.0  # seconds optimizer steps waited for overlapped copies, in all
        self._live: LiveTensors | None = None  # the in-flight save's tensors read in place
        self._staging: dict[str, torch.Tensor] = {}
        self._keys: dict[str, tuple[Any, ...]] = {}  # identity + version at the previous save
        # The tensors those keys describe, held so that their memory cannot be freed and
        # reused by a new tensor with the same address and version (torch.get_rng_state()
        # returns a fresh tensor each call, often at the address of the last one).
        self._held: dict[str, Any] = {}
        self._last: tuple[str, dict[str, TensorEntry]] | None = None  # previous snapshot: id, entries
        self._streams: dict[Any, Any] = {}  # CUDA device -> its copy stream
        # The last write to this path's store failed (a full local tier): an overlapped save with a
        # fallback stages copies instead, for the tensors the failed write read may have changed since.
        self._failing = False

    # -- saving ------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], snapshot: dict[str, Any], *, background: bool,
             fallback: SnapshotRun | None = None, persist_to: SnapshotRun | None = None) -> SaveJob:
        """See :class:`~ckpt.snapshot.run.SnapshotPath`. ``fallback``: where to write the snapshot
        if writing it to this path's store fails (the durable store, when the local tier is full);
        the result then names the error (:attr:`SaveResult.fell_back`)."""
        import torch

        tensors, tree = flatten(state)
        for name, t in tensors.items():
            storable_dtype(name, t)  # refused here, not in the background (where a local tier only warns)
        optimizers = optimizers_in(state)
        overlap = self.overlap and not (fallback is not None and self._failing)
        defer = _optimizer_storages(optimizers) if overlap else frozenset()
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
            gpus = {t.device for _, _, t in pending if t.device.type == "cuda"}
            if gpus:
                # the copies start after the work queued so far on each device, not later work
                ready = {d: torch.cuda.current_stream(d).record_event() for d in gpus}
        flags = autograd_flags(tensors)
        # where the tensors a restore makes anew go (a module's are written in place, wherever they are)
        devices = tensor_devices({n: t for n, t in tensors.items() if not isinstance(state[n.split("/")[0]], torch.nn.Module)})
        record = {**snapshot, **({"format": SNAPSHOT_TORCH_FORMAT} if uses_tags(tree, LATER_TAGS) else {}), "tree": tree,
                  **({"autograd": flags} if flags else {}), **({"devices": devices} if devices else {}),
                  "classes": recorded_classes(state)}

        def job() -> SaveResult:
            try:
                if pending:
                    self._copy_pending(pending, keys, ready)
                try:
                    result = self._write(step, staged, reuse, keys, held, record, in_place)
                    self._failing = False
                    return result
                except SnapshotError:
                    raise  # the state changed under the save: not the store's doing
                except Exception as e:
                    self._failing = True
                    if fallback is None:
                        raise
                    try:
                        return self._write_elsewhere(fallback, e, step, staged, reuse, record, in_place)
                    except SnapshotError as gone:
                        # Tensors read in place that the optimizer has stepped since (caught by their
                        # version counters: never stored with new values): the store's failure, not the
                        # state's. The next save with a fallback stages copies (``_failing``).
                        raise e from gone
            finally:
                self._live = None  # the optimizer steps no longer wait on it; its copies go with it

        return job

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
               keys: dict[str, tuple[Any, ...]], held: dict[str, Any], snapshot: dict[str, Any],
               live: LiveTensors | None = None) -> SaveResult:
        from ckpt.store.push import push_source
        from ckpt.store.sources import from_tensors

        try:
            known = {n: (e.dtype, e.shape, e.nbytes) for n, e in reuse.items()}
            # tensors read in place until the optimizer steps come from ``live``
            in_place = {n: live.source(n) for n in live.names} if live is not None else None
            src = from_tensors(staged, SNAPSHOT_SOURCE, {"snapshot": snapshot}, None, known, in_place, private=True)
            base = self._last[0] if (self._last and self.run.delta) else None
            result = push_source(self.store, src, self.run.ref(step), base_id=base, reuse=reuse,
                                 lineage={"parent": self._last[0] if self._last else None, "base": base, "merge": None},
                                 aliases=(self.run.latest,), bundles=self.run.bundles)
            m = result.manifest
            assert m is not None
        except BaseException:
            self._last, self._keys, self._held = None, {}, {}  # next save starts over: no reuse of unknown state
            raise
        self._last = (result.id, {t.name: t for t in m.tensors})
        self._keys, self._held = keys, held
        return SaveResult(result.id, result.written_bytes, result.logical_bytes, len(staged), len(reuse),
                          live.copied_bytes if live is not None else 0)

    def _write_elsewhere(self, run: SnapshotRun, error: Exception, step: int, staged: dict[str, torch.Tensor],
                         reuse: dict[str, TensorEntry], snapshot: dict[str, Any], live: LiveTensors | None) -> SaveResult:
        """The snapshot that could not be written to this path's store, written to ``run``'s instead:
        the chunks it reuses from this store's previous snapshot are copied over first (as stored)."""
        from ckpt.snapshot.tiers import describe, out_of_space
        from ckpt.store.copy import copy_chunks
        from ckpt.store.push import push_source
        from ckpt.store.sources import from_tensors

        if reuse:
            copy_chunks(self.store, run.store, {c for e in reuse.values() for c in e.chunks})
        known = {n: (e.dtype, e.shape, e.nbytes) for n, e in reuse.items()}
        in_place = {n: live.source(n) for n in live.names} if live is not None else None
        src = from_tensors(staged, SNAPSHOT_SOURCE, {"snapshot": snapshot}, None, known, in_place, private=True)
        result = push_source(run.store, src, run.ref(step), reuse=reuse, aliases=(run.latest,),
                             lineage={"parent": None, "base": None, "merge": None})
        # this path's store did not take the snapshot: its next one starts over (no reuse)
        self._last, self._keys, self._held = None, {}, {}
        return SaveResult(result.id, result.written_bytes, result.logical_bytes, len(staged), len(reuse),
                          live.copied_bytes if live is not None else 0, fell_back=describe(error),
                          tier_full=out_of_space(error))

    def close(self) -> None:
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks = {}

    # -- restoring -----------------------------------------------------------------
    def restore(self, state: dict[str, Any], mid: str, tiers: Tiers | None = None) -> int:
        """Restore ``mid`` into ``state`` in place; its step. ``tiers``: where to read it from,
        chunk by chunk, nearest first (default: this path's store)."""
        import torch

        from ckpt.format.dtypes import to_torch
        from ckpt.snapshot.tiers import Tiers, snapshot_step

        tiers = tiers or Tiers([("store", self.store)])
        m = tiers.get_manifest(mid)
        if not is_snapshot(m):
            raise not_a_snapshot(mid, m.source)
        snap = m.extra.get("snapshot")
        if not isinstance(snap, dict) or snap.get("format") not in SNAPSHOT_FORMATS or not isinstance(snap.get("tree"), dict):
            raise SnapshotError(f"checkpoint {mid[:12]} is not a snapshot of this ckpt version")
        tree: dict[str, Any] = snap["tree"]
        later = snap["format"] == SNAPSHOT_TORCH_FORMAT  # (format 1 has no later tags: a dict holding such a key is a dict)
        step = snapshot_step(m)
        if step is None:
            raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's step ({snap.get('step')!r:.40}) is malformed")
        entries = {t.name: t for t in m.tensors}
        flags = autograd_flag_sets(snap.get("autograd", {}), {n: to_torch(e.dtype) for n, e in entries.items()})
        if flags is None:
            raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of autograd flags is malformed")
        devices = recorded_devices(snap.get("devices", {}))
        missing = sorted(set(state) - set(tree))
        if missing:
            raise TensorMismatchError(f"snapshot of step {step} has no {missing}", hint="restore a subset of keys")
        records: dict[str, tuple[list[str], Any]] = {}  # each key's tensor names and structure, read once
        for key in state:  # a damaged (or foreign) record fails here, before anything is written
            node = tree[key]
            if not isinstance(node, dict) or node.get("kind") not in ("stateful", "value") or "value" not in node:
                raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of {key!r} is malformed")
            obj = state[key]
            if node["kind"] == "value" and isinstance(obj, Stateful) and not isinstance(obj, (type, torch.nn.Module)):
                # A plain value restored replaces the entry of the state dict: this object would be left as it is.
                raise TensorMismatchError(f"snapshot of step {step} holds {key!r} as a plain value, not as the state of an "
                                          f"object with state_dict()/load_state_dict(): this {type(obj).__name__} would "
                                          "not be restored", hint=f"pass {key!r}: None to get the value back, and load it "
                                                                  "into the object yourself; or save the object itself")
            found = _Nothing()
            try:  # its structure and the tensors it names, in one pass (decoded again, with the tensors, once written)
                structure = unflatten(node["value"], found, later=later)
            except CkptError as e:
                raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of {key!r} is malformed ({e})") from None
            unknown = [n for n in found.names if n not in entries]
            if unknown:
                raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of {key!r} names tensors it does not "
                                    f"hold ({', '.join(repr(n)[:80] for n in unknown[:3])})")
            records[key] = found.names, structure
        check_classes(snap, state, mid, step)  # (after the records: a plain value saved for an object has its own error)
        pairs: list[tuple[TensorEntry, torch.Tensor]] = []
        decoded: dict[str, torch.Tensor] = {}
        fresh: list[str] = []  # tensors made for the restore: they get the saved autograd flags
        loaders = []
        used: set[int] = set()  # storages already written by this restore: never two writers
        for key, obj in state.items():
            kind, value = tree[key]["kind"], tree[key]["value"]
            names, structure = records[key]
            if isinstance(obj, torch.nn.Module):
                live = {f"{key}/{k}": v for k, v in obj.state_dict().items()}
                extra, absent = sorted(set(names) - set(live)), sorted(set(live) - set(names))
                if extra or absent:
                    raise TensorMismatchError(f"{key}: snapshot and module differ: not in module {extra[:10]}, "
                                              f"not in snapshot {absent[:10]}")
                # a broadcast view (expand()): its elements share memory, which torch refuses to copy into
                shared = [n for n, t in live.items() if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape))]
                if shared:
                    raise TensorMismatchError(f"{key}: {', '.join(shared[:3])} {'is a view' if len(shared) == 1 else 'are views'}"
                                              " whose elements share memory (expand()): nothing can be restored into it",
                                              hint="give the module a tensor of its own there (.clone()), as torch's "
                                                   "load_state_dict needs too")
                ptrs = [t.untyped_storage().data_ptr() for t in live.values() if t.numel()]
                if {t.untyped_storage().data_ptr() for t in (*obj.parameters(), *obj.buffers()) if t.numel()}.issuperset(ptrs):
                    pairs += [(entries[n], live[n]) for n in names]  # straight into the parameters
                    used.update(ptrs)
                    continue
                # Its state_dict() hands out copies (a state dict hook's, or _save_to_state_dict's): written
                # into them, the module would keep its values. Loaded through its load_state_dict, as torch does.
                kind = "stateful"
            if kind == "stateful":
                _check_param_groups(key, obj, structure)  # before anything is written
            # An optimizer's (or any Stateful's) own tensors of the right shape and dtype are
            # written in place, and load_state_dict() then adopts them without a copy: no
            # fresh allocation (page faults) for the largest part of a training state.
            live_t = _live_tensors(key, obj) if kind == "stateful" else {}
            for n in names:
                e = entries[n]
                t = live_t.get(n)
                # (only a contiguous tensor: one that is a view, broadcast say, may share memory between
                # its elements, which torch refuses to copy into)
                if (t is None or tuple(t.shape) != e.shape or t.dtype != to_torch(e.dtype) or not t.is_contiguous()
                        or t.untyped_storage().data_ptr() in used
                        or t.requires_grad != (n in flags.get("requires_grad", ()))
                        or isinstance(t, torch.nn.Parameter) != (n in flags.get("parameters", ()))):
                    t = torch.empty(e.shape, dtype=to_torch(e.dtype), device=device_here(n, devices.get(n)))
                    fresh.append(n)
                elif t.numel():
                    used.add(t.untyped_storage().data_ptr())
                decoded[n] = t
                pairs.append((e, t))
            loaders.append((key, obj, kind, value))
        # Restoring writes tensors without bumping their version counters: forget
        # what the last save saw, so the next one stages everything again.
        self._keys, self._held = {}, {}
        # the next snapshot's parent (and delta base): only one this path's store holds
        self._last = (mid, entries) if self.store.objects.has_many("manifests", [mid]) else None
        tiers.fill(m, pairs)
        for n in fresh:  # flagged once written (a Parameter wraps the tensor the fill wrote)
            decoded[n] = with_autograd_flags(n, decoded[n], flags)
        for key, obj, kind, value in loaders:
            restored = unflatten(value, decoded, later=later)
            if kind == "stateful" and isinstance(obj, Stateful):
                try:
                    obj.load_state_dict(restored)
                except CkptError:
                    raise
                except Exception as e:  # a record that does not fit the object (damaged, or of another kind of object)
                    raise SnapshotError(f"checkpoint {mid[:12]}: {key!r} ({type(obj).__name__}) did not take the snapshot's "
                                        f"state: its load_state_dict raised {type(e).__name__}: {str(e)[:200]}",
                                        hint="restore into objects like those saved, or from another snapshot; what "
                                             "was restored before it has been written") from e
            else:
                state[key] = restored
        return step


def _check_param_groups(key: str, obj: Any, saved: Any) -> None:
    """An optimizer restored needs the snapshot's parameter groups (as many, as large): torch's
    ``load_state_dict`` refuses others, and it runs last, after the rest of the state is written.
    Checked first, so that a mismatch leaves everything as it was. ``saved``: the saved state dict's
    structure (None for each tensor)."""
    import torch

    if not isinstance(obj, torch.optim.Optimizer):
        return
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return
    want = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None
            for g in saved["param_groups"]]
    have = [len(g["params"]) for g in obj.param_groups]
    if want != have:
        raise TensorMismatchError(f"{key}: the snapshot's optimizer has parameter groups of {want} parameters, "
                                  f"this one of {have}", hint="build the optimizer over the parameters the saved run used")


class _Nothing(dict):
    """Tensors for :func:`unflatten` when only a record's structure is wanted: None for each, its name
    noted in ``names`` (in the order the record names them)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __missing__(self, name: str) -> None:
        self.names.append(name)
        return None


def _live_tensors(key: str, obj: Any) -> dict[str, Any]:
    """The tensors ``obj.state_dict()`` hands out, by their snapshot names (empty if it cannot say)."""
    if not isinstance(obj, Stateful):
        return {}
    try:
        tensors, _ = flatten({key: obj})
    except Exception:  # noqa: BLE001 - a state that cannot be flattened is restored into new tensors
        return {}
    return tensors


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
