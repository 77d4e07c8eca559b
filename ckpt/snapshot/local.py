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
its chunks are then reused without reading it: a parameter, or an optimizer's state, only
(:func:`~ckpt.snapshot.state.trusted`: batch norm's statistics change without a bump). Every other
tensor is staged at every save; where it is found unchanged by hash since the snapshot the save continues from,
a local tier makes no room for it (:func:`_unchanged_by_hash`). A restore records the tensors it wrote so too
(their versions as the restore left them). Where versions cannot be trusted (a fused optimizer
in the state, or ``unchanged_by="hash"``), and after a failed save, every tensor is staged and
unchanged chunks are found by hash instead.

Restoring: :mod:`ckpt.snapshot.local_restore`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt.format.entries import TensorEntry
from ckpt.format.tagged_json import LATER_TAGS, uses_tags
from ckpt.snapshot.local_restore import LocalRestoring
from ckpt.snapshot.restore_checks import snapshot_records
from ckpt.snapshot.run import (
    SNAPSHOT_SOURCE,
    SNAPSHOT_TORCH_FORMAT,
    SaveJob,
    SaveResult,
    SnapshotError,
    SnapshotRun,
    modified_under_save,
)
from ckpt.snapshot.state import (
    autograd_flags,
    flatten,
    optimizers_in,
    tensor_devices,
    trusted,
    version_key,
    version_trusted,
)
from ckpt.store.source_tensors import storable_dtype

if TYPE_CHECKING:
    import torch

    from ckpt.snapshot.live import LiveTensors
    from ckpt.store.store import Store

log = logging.getLogger(__name__)


class LocalSnapshots(LocalRestoring):
    """The :class:`~ckpt.snapshot.run.SnapshotPath` of a single process."""

    def __init__(self, run: SnapshotRun, *, overlap: bool = False, unchanged_by: str = "version",
                 room: Callable[[int, list[int], bool | None, str | None], object] | None = None) -> None:
        self.run = run
        # A local tier's room made before a write (LocalTier.fit): the step, the sizes of the tensors written that
        # are not known to be unchanged, whether the snapshot carries bundles, and the id of the snapshot whose chunks it
        # reuses or deltas against, or the last one written or restored where the save relies on it (what it does not
        # count is found there by hash), never dropped; None where it names none or relies on none (every tensor counted:
        # it may go); it raises (ENOSPC) where the medium cannot hold them.
        self.room = room
        self.store = run.store
        self.overlap = overlap
        self.trust_version = unchanged_by == "version"
        self._copied = threading.Event()  # clear while an overlapped copy is pending
        self._copied.set()
        self._step_hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        # Fused optimizers bump no version counter: one kept out of the state (the model saved alone) went unseen, and
        # every snapshot after the first held the first's bytes. One stepping anywhere in the process while this path
        # lives turns version counters off for good (the keys recorded since say nothing).
        self._fused = _FusedWatch() if self.trust_version else None
        if self._fused is not None:
            weakref.finalize(self, self._fused.remove)  # (a manager dropped unclosed: the process-wide hook goes too)
        self.step_wait_s = 0.0  # seconds optimizer steps waited for overlapped copies, in all
        self._live: LiveTensors | None = None  # the in-flight save's tensors read in place
        self._staging: dict[str, torch.Tensor] = {}
        self._keys: dict[str, tuple[Any, ...]] = {}  # identity + version at the previous save
        # The tensors those keys describe, held so that their memory cannot be freed and
        # reused by a new tensor with the same address and version (torch.get_rng_state()
        # returns a fresh tensor each call, often at the address of the last one).
        self._held: dict[str, Any] = {}
        self._last: tuple[str, dict[str, TensorEntry]] | None = None  # previous snapshot: id, entries
        self._since: str | None = None  # the last snapshot written or restored here, a failed save since or not (_keys')
        self._since_entries: dict[str, TensorEntry] | None = None  # its entries
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

        tensors, tree, optimizers, trust = self._flatten(state)
        blind = _blind(state, tensors, optimizers)  # (staged: found unchanged by hash)
        for name, t in tensors.items():
            storable_dtype(name, t)  # refused here, not in the background (where a local tier only warns)
        overlap = self.overlap and not (fallback is not None and self._failing)
        defer = _optimizer_storages(optimizers) if overlap else frozenset()
        staged, reuse, keys, pending, live = self._stage(tensors, trust=trust, defer=defer, blind=blind)
        changed = self._changes(tensors, keys, trust)  # what a local tier makes room for before the write
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
                  **snapshot_records(state)}

        def job() -> SaveResult:
            try:
                if pending:
                    self._copy_pending(pending, keys, ready)
                try:
                    # (the hash, in the background)
                    counted = self._unchanged_by_hash(changed, staged, reuse, blind, live) if changed and self.room else changed
                    result = self._write(step, staged, reuse, keys, held, record, in_place,
                                         None if counted is None else list(counted.values()))
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

    def save_sizes(self, state: dict[str, Any]) -> tuple[list[int], list[int] | None, str | None]:
        """The bytes of ``state``'s tensors, and of those not known to be unchanged since the last snapshot this path
        wrote or restored (:meth:`_changes`; None where versions cannot tell): what a save of it adds to a local
        tier that holds none of it, and that holds that snapshot; and that snapshot's id (the one it continues from)."""
        tensors, _, optimizers, trust = self._flatten(state)
        blind = _blind(state, tensors, optimizers)
        changed = self._changes(tensors, {n: _key(t.detach(), n in blind) for n, t in tensors.items()}, trust)
        if changed:  # (rare: after a full tier) read here, what the save will stage
            changed = self._unchanged_by_hash(changed, {n: t.detach() for n, t in tensors.items()}, None, blind)
        return [t.numel() * t.element_size() for t in tensors.values()], \
            None if changed is None else list(changed.values()), self._since

    def _flatten(self, state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any, list[Any], bool]:
        """``state``'s tensors and structure (:func:`flatten`), its optimizers, and whether their version counters say
        which tensors are unchanged (not with ``unchanged_by="hash"`` nor a fused optimizer, which bumps none)."""
        tensors, tree = flatten(state)
        optimizers = optimizers_in(state)
        fused = _has_fused_optimizer(optimizers) or (self._fused is not None and self._fused.seen)
        return tensors, tree, optimizers, self.trust_version and not fused

    def _changes(self, tensors: dict[str, torch.Tensor], keys: dict[str, tuple[Any, ...]], trust: bool) -> dict[str, int] | None:
        """The sizes of ``tensors`` (their version ``keys`` now) not known to be unchanged since the last snapshot
        written or restored here: each one whose key is not the one recorded then, or that has none (a new name, an
        optimizer's moments made by its first step; one a restore did not record): what a local tier makes room for.
        (Left out, such a tensor was never counted: the room check and the room made after a failed save took too
        little, and the save failed again at every step.) None where versions cannot tell at all (``trust`` False, or
        no snapshot recorded): a fused optimizer's frozen base is found unchanged by hash, never counted. Kept across a
        failed save: it reuses nothing, but what changed since that snapshot still says what the next save adds."""
        if not trust or not self._keys:
            return None
        return {n: t.numel() * t.element_size() for n, t in tensors.items() if self._keys.get(n) != keys[n]}

    def _unchanged_by_hash(self, changed: dict[str, int], staged: dict[str, torch.Tensor],
                           reuse: dict[str, TensorEntry] | None, blind: set[str],
                           live: dict[str, torch.Tensor] | None = None) -> dict[str, int]:
        """``changed`` without the tensors ``blind`` names (their versions say nothing: not :func:`trusted`)
        that hold the bytes of their entry in the snapshot the save continues from (``_since``): their chunks are
        there, and a local tier keeps it; not where its chunks were not this store's when recorded (a restore read
        them elsewhere): this save writes them. (Counted at every save, a constant plain tensor made a full tier drop
        that snapshot.) Where that is also the previous snapshot and this store held the entry's chunks when it was
        recorded (not one a restore read elsewhere), the entry moves from ``staged`` to ``reuse``: not hashed again."""
        import torch

        from ckpt.format.dtypes import to_torch
        from ckpt.format.entries import split_lengths
        from ckpt_store.storage.objects import object_id

        entries = self._since_entries or {}
        previous = self._last[1] if self._last and self._last[0] == self._since else {}
        out = dict(changed)
        for n in changed.keys() & blind:
            t, e = staged.get(n), entries.get(n)
            if t is None or e is None or (live and n in live) or tuple(t.shape) != e.shape or t.dtype != to_torch(e.dtype):
                continue
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            lengths = split_lengths(e.nbytes, self.store.settings.chunk_size)
            same, pos = len(lengths) == len(e.chunks), 0
            for k, cid in zip(lengths, e.chunks):
                if not same or object_id(memoryview(raw[pos:pos + k])) != cid:
                    same = False  # (changed: hashed up to its first changed chunk here, whole by the pipeline)
                    break
                pos += k
            # (and its chunks are here: after a restore that read some from another tier, this save writes them)
            if same and (n in self._keys or _all_here(self.store, e)):
                del out[n]
                if reuse is not None and previous.get(n) == e and n in self._keys:
                    reuse[n] = e
                    del staged[n]
        return out

    def _stage(self, tensors: dict[str, torch.Tensor], trust: bool, defer: frozenset[int] = frozenset(),
               *, blind: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, TensorEntry], dict[str, tuple[Any, ...]],
                          list[tuple[str, torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """Copy changed tensors into the staging area; the rest reuse the previous snapshot's entries.

        Without ``trust`` every tensor is staged (and unchanged chunks are found by
        their hash in the background instead), and so is every tensor ``blind`` names (not
        :func:`~ckpt.snapshot.state.trusted`). Tensors whose storage is in ``defer``
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
            key = keys[name] = _key(t, name in blind)
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
               live: LiveTensors | None = None, changed: list[int] | None = None) -> SaveResult:
        from ckpt.store.push import push_source
        from ckpt.store.sources import from_tensors

        try:
            if self.room is not None:  # before a byte is written (a failure resets what the next save reuses, below)
                # (the snapshot this one continues from, the last written or restored (``_last`` after a restore that
                # failed midway), is kept where the save relies on it: entries reused, deltas against it, or tensors
                # ``changed`` does not count (unchanged since it, found there by hash; all of them where versions cannot
                # tell: unchanged_by="hash", a fused optimizer), after a failed save too. Dropped, those were written
                # again uncounted. Where every tensor is counted it may go: a later step the run went back from.)
                since = self._since or (self._last[0] if self._last else None)
                relies = reuse or (self._last and self.run.delta) or len(changed or []) < len(staged) + len(reuse)
                self.room(step, changed or [], self.run.bundles, since if relies else None)
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
            # The next save reuses nothing of unknown state; the versions of the last snapshot still say what changed since.
            self._last = None
            raise
        self._last = (result.id, {t.name: t for t in m.tensors})
        self._since, self._since_entries = result.id, self._last[1]
        self._keys, self._held = keys, held
        return SaveResult(result.id, result.written_bytes, result.logical_bytes, len(staged), len(reuse),
                          live.copied_bytes if live is not None else 0)

    def reuse_nothing(self) -> None:
        """The next save reuses no entry of the snapshot last written or restored and continues from none (writes in
        full, counted whole for the room): the store may have lost chunks it names (a refill removed damaged copies, and
        the steps naming them)."""
        self._last, self._since, self._since_entries, self._keys, self._held = None, None, None, {}, {}

    def _write_elsewhere(self, run: SnapshotRun, error: Exception, step: int, staged: dict[str, torch.Tensor],
                         reuse: dict[str, TensorEntry], snapshot: dict[str, Any], live: LiveTensors | None) -> SaveResult:
        """The snapshot that could not be written to this path's store, written to ``run``'s instead:
        the chunks it reuses from this store's previous snapshot are copied over first (as stored)."""
        from ckpt.snapshot.tiers import caught, out_of_space
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
        # this path's store did not take the snapshot: its next one reuses nothing (the versions say what changed)
        self._last = None
        return SaveResult(result.id, result.written_bytes, result.logical_bytes, len(staged), len(reuse),
                          live.copied_bytes if live is not None else 0, fell_back=caught(log, "local tier", error),
                          tier_full=out_of_space(error))

    def close(self) -> None:
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks = {}
        if self._fused is not None:
            self._fused.remove()


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


def _blind(state: dict[str, Any], tensors: dict[str, torch.Tensor], optimizers: list[Any]) -> set[str]:
    """The names of ``tensors`` whose version counters say nothing (not :func:`~ckpt.snapshot.state.trusted`)."""
    pairs = version_trusted(state, optimizers)
    return {n for n, t in tensors.items() if not trusted(t, pairs)}


def _key(t: torch.Tensor, blind: bool) -> tuple[Any, ...]:
    """``t``'s :func:`~ckpt.snapshot.state.version_key`, one that equals no other where it is ``blind`` (not
    :func:`~ckpt.snapshot.state.trusted`: its version counter says nothing, it is read at every save)."""
    key = version_key(t)
    return (*key, object()) if blind else key


class _FusedWatch:
    """Whether a fused optimizer has stepped in this process since it was made: a step pre-hook on every optimizer
    (torch's process-wide one) notes it; never unset. The hook never fails a step."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.seen = False

        def hook(optimizer: Any, args: Any, kwargs: Any, watch: _FusedWatch = self) -> None:
            if not watch.seen:
                try:
                    watch.seen = _has_fused_optimizer([optimizer])
                except Exception:  # noqa: BLE001 - an optimizer of another shape: taken as fused, never its step's failure
                    watch.seen = True

        self._handle = register_optimizer_step_pre_hook(hook)

    def remove(self) -> None:
        self._handle.remove()  # (again: nothing)


def _has_fused_optimizer(optimizers: list[Any]) -> bool:
    """Fused optimizers update parameters and moments in place without bumping
    ``tensor._version``: with one in the state, versions cannot be trusted."""
    return any(any(g.get("fused") for g in o.param_groups) for o in optimizers)


def _all_here(store: Store, entry: TensorEntry) -> bool:
    """Whether ``store`` (a local tier: a stat each) holds every chunk of ``entry`` and the delta bases it names."""
    ids = {*entry.chunks, *(b for chain in entry.delta_bases for b in chain)}
    return store.objects.has_many("chunks", ids) >= ids
