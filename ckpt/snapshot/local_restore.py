"""The restore side of :class:`~ckpt.snapshot.local.LocalSnapshots`: a snapshot restored into the
live state in place. Every record is checked before anything is written; a module's tensors, and an
optimizer's (or any ``Stateful``'s) of the right shape and dtype, are written straight into; each
object's ``load_state_dict`` runs once every tensor is written."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt.errors import CkptError, TensorMismatchError
from ckpt.format.entries import TensorEntry
from ckpt.snapshot.restore_checks import check_records, check_saved_state
from ckpt.snapshot.run import (
    SNAPSHOT_FORMATS,
    SNAPSHOT_TORCH_FORMAT,
    SnapshotError,
    is_snapshot,
    not_a_snapshot,
)
from ckpt.snapshot.state import (
    Stateful,
    autograd_flag_sets,
    device_here,
    flatten,
    recorded_devices,
    unflatten,
    version_key,
    with_autograd_flags,
)

if TYPE_CHECKING:
    from ckpt.snapshot.tiers import Tiers
    from ckpt.store.store import Store


class LocalRestoring:
    """The restore side of :class:`~ckpt.snapshot.local.LocalSnapshots`, on its attributes (declared here)."""

    store: Store
    _keys: dict[str, tuple[Any, ...]]
    _held: dict[str, Any]
    _last: tuple[str, dict[str, TensorEntry]] | None
    _since: str | None
    _since_entries: dict[str, TensorEntry] | None

    def restore(self, state: dict[str, Any], mid: str, tiers: Tiers | None = None) -> int:
        """Restore ``mid`` into ``state`` in place; its step. ``tiers``: where to read it from,
        chunk by chunk, nearest first (default: this path's store)."""
        import torch

        from ckpt.format.dtypes import to_torch
        from ckpt.snapshot.steps import snapshot_step
        from ckpt.snapshot.tiers import Tiers

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
        check_records(snap, state, mid, step)  # (after the records: a plain value saved for an object has its own error)
        pairs: list[tuple[TensorEntry, torch.Tensor]] = []
        decoded: dict[str, torch.Tensor] = {}
        fresh: list[str] = []  # tensors made for the restore: they get the saved autograd flags
        loaders = []
        used: set[int] = set()  # storages already written by this restore: never two writers
        for key, obj in state.items():
            kind, value = tree[key]["kind"], tree[key]["value"]
            names, structure = records[key]
            if isinstance(obj, torch.nn.Module):
                held = obj.state_dict()
                live = {f"{key}/{k}": v for k, v in held.items() if isinstance(v, torch.Tensor)}
                # (a module's extra state (get_extra_state) may be a plain value: saved in the record, not as a tensor)
                saved_keys = set(structure) if isinstance(structure, dict) else set()
                extra = sorted(f"{key}/{k}" for k in saved_keys - set(held))
                absent = sorted({f"{key}/{k}" for k in set(held) - saved_keys} | (set(live) - set(names)))
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
                if len(live) == len(held) and {t.untyped_storage().data_ptr() for t in (*obj.parameters(), *obj.buffers())
                                               if t.numel()}.issuperset(ptrs):
                    pairs += [(entries[n], live[n]) for n in names]  # straight into the parameters
                    used.update(ptrs)
                    continue
                # Its state_dict() hands out copies (a state dict hook's, or _save_to_state_dict's): written
                # into them, the module would keep its values; or holds extra state (set_extra_state takes it).
                # Loaded through its load_state_dict, as torch does.
                kind = "stateful"
            if kind == "stateful":
                _check_param_groups(key, obj, structure)  # before anything is written
                check_saved_state(key, obj, structure, step)
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
        # What the last save saw no longer describes the state (recorded again below, once all is restored).
        self._keys, self._held, self._since = {}, {}, None
        # the next snapshot's parent (and delta base): only one this path's store holds
        self._last = (mid, entries) if self.store.objects.has_many("manifests", [mid]) else None
        tiers.fill(mid, pairs)
        for n in fresh:  # flagged once written (a Parameter wraps the tensor the fill wrote)
            decoded[n] = with_autograd_flags(n, decoded[n], flags)
        # Each tensor written as its entry's bytes, by its version as after the fill (the fill bumps no version counter);
        # not one whose memory another entry wrote too (tied weights): it holds the last writer's bytes
        alone = _written_alone(pairs)
        filled = {n: version_key(t) for n, t in ({e.name: t for e, t in pairs} | decoded).items() if n in alone}
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
        if self._last is not None:
            self._keys, self._held = _restored_keys(state, filled, self._served_here(tiers, entries))
            self._since, self._since_entries = mid, entries
        return step

    def _served_here(self, tiers: Tiers, entries: dict[str, TensorEntry]) -> set[str]:
        """The names of ``entries`` whose chunks this path's store holds (all of them where it served every
        byte of the restore): the next save may name those chunks again without writing them."""
        here = [name for name, s in tiers.stores if s is self.store]
        if here and not any(n for name, n in tiers.served.items() if name not in here):
            return set(entries)
        held = self.store.objects.has_many("chunks", {c for e in entries.values() for c in e.chunks})
        return {n for n, e in entries.items() if held.issuperset(e.chunks)}


def _restored_keys(state: dict[str, Any], filled: dict[str, tuple[Any, ...]], names: set[str],
                   ) -> tuple[dict[str, tuple[Any, ...]], dict[str, Any]]:
    """What the next save compares its tensors with (:meth:`LocalSnapshots._stage`, as a save records it) after a
    restore that wrote ``filled`` (name -> key as the fill left it): the keys of the state's tensors of ``names``
    that are still those tensors, unchanged since (an object's ``load_state_dict`` that copied them into tensors of
    its own, or changed them in place, has them staged), and those tensors, held as a save holds them. So the next
    save stages only what changed since (training's in-place update bumps the version), and the room a local tier
    makes for it counts those."""
    try:
        now, _ = flatten(state)
    except Exception:  # noqa: BLE001 - a state the save cannot flatten either: nothing recorded, it says why
        return {}, {}
    keys = {n: k for n, t in now.items() if n in names and (k := version_key(t.detach())) == filled.get(n)}
    return keys, {n: now[n].detach() for n in keys}


def _written_alone(pairs: list[tuple[TensorEntry, Any]]) -> set[str]:
    """The names of ``pairs`` whose tensor holds its entry's bytes once the fill wrote them all: a contiguous tensor
    that shares no byte with another's (a tensor the state holds twice, tied weights, two views of one storage that
    overlap: each is written by every entry naming it, the last one wins; a non-contiguous one may overlap itself).
    Only those may be recorded as unchanged since (the others are staged and hashed by the next save)."""
    spans: list[tuple[Any, int, int, str | None]] = []  # (device, start, end, the name where it may be recorded)
    alone: set[str] = set()
    for e, t in pairs:
        if not t.numel():
            alone.add(e.name)  # (no bytes to differ)
        elif t.is_contiguous():
            spans.append((t.device, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), e.name))
        else:  # never recorded, but what it writes may be another's bytes (a transposed tie): its whole storage counts
            st = t.untyped_storage()
            spans.append((t.device, st.data_ptr(), st.data_ptr() + st.nbytes(), None))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    reach: dict[Any, int] = {}  # device -> the furthest end of the spans before (by start)
    for i, (device, start, end, name) in enumerate(spans):
        after = i + 1 < len(spans) and spans[i + 1][0] == device and spans[i + 1][1] < end
        if name is not None and reach.get(device, start) <= start and not after:
            alone.add(name)
        reach[device] = max(reach.get(device, end), end)
    return alone


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
