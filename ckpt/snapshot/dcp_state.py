"""How a training state maps onto DCP items, for :mod:`ckpt.snapshot.distributed`.

DCP names every item of a state dict by its key path joined with dots (an
optimizer's ``state[0]["exp_avg"]`` becomes ``optim.state.0.exp_avg``, its key
path ``("optim", "state", "0", "exp_avg")``: dict keys turn into str). A snapshot
records each item's key path (``planner_data``), so a restore can build what DCP
loads into from the snapshot itself where the live object has nothing to offer
(a fresh optimizer has no state tensors), and hand values back under their real
keys. :func:`fingerprint` summarises what a rank would save once for all ranks,
without reading tensor data, so that ranks can compare it before saving.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt.dcp.format import DcpLayout

Path = tuple[str | int, ...]


def values_planner() -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class LoadPlanner(DefaultLoadPlanner):
        """Loads a flat state dict and hands the values back by name, with their key types intact
        (DCP's own unflattening would re-key an optimizer's int-keyed state by str)."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False)
            self.values: dict[str, Any] = {}

        def load_bytes(self, read_item: Any, value: Any) -> None:
            import torch

            # ckpt.dcp.Reader's own torch.save of a value it decoded from JSON: plain Python values
            self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return LoadPlanner()


def fingerprint(key: str, value: Any) -> str:
    """A digest of what DCP would save once for all ranks, without reading tensor data:
    item names, non-tensor values, tensor dtypes and (global) shapes."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ckpt.dcp.format import encode_value
    from ckpt_store.storage.records import canonical_json

    try:
        flat, _ = flatten_state_dict({key: value})
        items = []
        for fqn, leaf in sorted(flat.items()):
            if isinstance(leaf, torch.Tensor):
                kind = "dtensor" if hasattr(leaf, "placements") else "tensor"
                items.append([fqn, kind, str(leaf.dtype), list(leaf.shape)])
            else:
                items.append([fqn, "value", encode_value(leaf, fqn)])
        raw = canonical_json(items)
    except Exception as e:  # noqa: BLE001 - the save itself reports what cannot be stored
        raw = f"unstorable: {type(e).__name__}".encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def saved_paths(layout: DcpLayout, mid: str) -> dict[str, dict[str, Path]]:
    """The snapshot's items by state key: fqn -> its path in the saved state dict."""
    from ckpt_store.storage.errors import StoreFormatError

    pd = layout.planner_data
    out: dict[str, dict[str, Path]] = {}
    for fqn in [*layout.tensors, *layout.values]:
        path = pd.get(fqn) if pd is not None else None
        if not path:
            raise StoreFormatError(f"manifest {mid}: no key path for item {fqn!r}",
                                   hint="restore it with dcp.load into a state dict of your own")
        out.setdefault(str(path[0]), {})[fqn] = tuple(path)
    # A list index is at most the items below it (a restore builds the list up to it): a larger one is
    # no state dict's (a forged record: 10**12 would have the restore allocate a list of that length).
    for key, items in out.items():
        for fqn, path in items.items():
            if any(isinstance(p, int) and not 0 <= p < len(items) for p in path):
                raise StoreFormatError(f"manifest {mid}: item {fqn!r} has the key path {str(list(path))[:120]}, "
                                       f"past the {len(items)} items saved under {key!r}")
    return out


def from_snapshot(saved: dict[str, Path], layout: DcpLayout, tensor_for: Callable[[Path, Any], Any]) -> Any:
    """A state dict of the saved structure, built from the snapshot's own record: a placeholder
    per value (DCP puts the saved one in its place) and ``tensor_for(path, item)`` per tensor."""
    root: dict[str, Any] = {}
    for fqn, path in sorted(saved.items()):
        item = layout.tensors.get(fqn)
        leaf = None if item is None else tensor_for(path[1:], item)
        if len(path) == 1:
            return leaf  # the whole value is one item
        _build(root, path[1:], leaf)
    return root


def skeleton(key: str, value: Any) -> Any:
    """The containers of plain value ``value`` as DCP walks them, each item (a DCP leaf) None, as tagged
    JSON, where the names of its items alone would rebuild them otherwise; else None. DCP names an item
    by its key path with every dict key turned into a str and keeps no dict of no items: a rebuild from
    the names (:func:`from_snapshot`, in sorted order) gives a dict's keys back sorted, as str, and
    leaves out its empty dicts, so a data loader's sources iterated in dict order were drawn in another
    order after a restart. A snapshot records this for such a value (:func:`value_target` reads it)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ckpt.format import tagged_json

    if not isinstance(value, (Mapping, list)):
        return None
    try:
        _, paths = flatten_state_dict({key: value})
        leaves = {tuple(p) for p in paths.values()}

        def walk(x: Any, path: Path) -> Any:
            if isinstance(x, Mapping):  # (DCP walks every mapping)
                return {k: walk(v, (*path, str(k))) for k, v in x.items()}
            if isinstance(x, list) and path not in leaves:
                return [walk(v, (*path, i)) for i, v in enumerate(x)]
            return None

        rebuilt: dict[str, Any] = {}
        for path in sorted(leaves, key=lambda p: ".".join(map(str, p))):
            if len(path) > 1:
                _build(rebuilt, path[1:], None)
        skel = walk(value, (key,))

        def unsupported(path: str, what: str) -> Exception:
            return ValueError(path)

        ours = tagged_json.encode(skel, key, unsupported=unsupported)
        if ours != tagged_json.encode(rebuilt, key, unsupported=unsupported):
            return ours
    except ValueError:  # a key JSON cannot hold: the save itself says so
        pass
    return None


def _leaf_paths(skel: Any, path: Path) -> list[Path]:
    if isinstance(skel, Mapping):
        return [p for k, v in skel.items() for p in _leaf_paths(v, (*path, str(k)))]
    if isinstance(skel, list):
        return [p for i, v in enumerate(skel) for p in _leaf_paths(v, (*path, i))]
    return [path]


def value_target(key: str, obj: Any, saved: dict[str, Path], layout: DcpLayout, devices: dict[str, str] | None = None,
                 skel: Any = None) -> Any:
    """A plain value is replaced by the saved one: without tensors of its own to read into,
    any template will do (``"pos": None``), so the target is the snapshot's own structure (its
    :func:`skeleton` where it recorded one: dict keys in their order and type, empty dicts kept),
    each tensor made on the device ``devices`` names for it (the snapshot's record; else the CPU):
    :class:`~ckpt.snapshot.run.SnapshotError` where this machine lacks it, or where the skeleton
    does not hold exactly the items saved."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ckpt.errors import CkptError
    from ckpt.format import tagged_json
    from ckpt.format.dtypes import to_torch
    from ckpt.snapshot.run import SnapshotError
    from ckpt.snapshot.state import device_here

    flat, _ = flatten_state_dict({"v": obj})
    if any(isinstance(v, torch.Tensor) for v in flat.values()):
        return obj  # its tensors are read in place, and must match the snapshot's
    devices = devices or {}

    def tensor_for(rel: Path, item: Any) -> Any:  # (named as a single-process snapshot names it: key/a/0)
        where = device_here("/".join((key, *map(str, rel))), devices.get(item.fqn))
        return torch.empty(tuple(item.size), dtype=to_torch(item.dtype), device=where)

    if skel is not None:
        try:
            root = {key: tagged_json.decode(skel, "snapshot state")}
        except CkptError as e:
            raise SnapshotError(f"the snapshot's record of the structure of state[{key!r}] is malformed ({e})",
                                hint="restore from another snapshot") from None
        leaves = _leaf_paths(root[key], (key,))
        if not isinstance(root[key], (dict, list)) or sorted(map(str, leaves)) != sorted(map(str, saved.values())):
            raise SnapshotError(f"the snapshot's record of the structure of state[{key!r}] does not name the items saved",
                                hint="restore from another snapshot")
        for fqn, path in saved.items():
            item = layout.tensors.get(fqn)
            set_at(root, path, None if item is None else tensor_for(path[1:], item))
        return root[key]
    if not saved:
        return {}  # an empty dict has no items of its own (an empty list is a value)
    return from_snapshot(saved, layout, tensor_for)


def optimizer_target(key: str, opt: Any, saved: dict[str, Path], layout: DcpLayout, step: int) -> Any:
    """What DCP loads an optimizer's snapshot into. A fresh optimizer has no state tensors yet
    (AdamW makes them at its first step), so its ``state_dict()`` would receive nothing; this
    target has the saved structure with one tensor per saved one: the optimizer's existing
    tensor where it fits (read in place), else a new one of the saved dtype and size on its
    parameter's device (sharded like it, for a DTensor parameter). The per-parameter state the
    snapshot lacks is absent from it, as it was in the run that saved it."""
    import torch

    from ckpt.format.dtypes import to_torch
    from ckpt.snapshot.run import SnapshotError
    from ckpt.snapshot.state import optimizers_in

    inner = optimizers_in({key: opt})[0]
    params = [p for group in inner.param_groups for p in group["params"]]

    def tensor_for(rel: Path, item: Any) -> Any:
        dtype, size = to_torch(item.dtype), tuple(item.size)
        param, existing = None, None
        if len(rel) >= 3 and rel[0] == "state":
            index = int(rel[1]) if str(rel[1]).isascii() and str(rel[1]).isdigit() else -1  # ("²" is a digit int() refuses)
            if not 0 <= index < len(params):
                raise SnapshotError(f"state[{key!r}]: the snapshot of step {step} has optimizer state for parameter "
                                    f"{rel[1]}; this optimizer has {len(params)} parameters",
                                    hint="build the optimizer over the same parameters, in the same order")
            param = params[index]
            existing = inner.state.get(param, {}).get(rel[2]) if len(rel) == 3 else None
        if isinstance(existing, torch.Tensor) and tuple(existing.shape) == size and existing.dtype == dtype:
            return existing
        if param is not None and hasattr(param, "placements") and tuple(param.shape) == size:
            return torch.empty_like(param.detach(), dtype=dtype)  # a DTensor sharded like its parameter
        device = param.device if param is not None and size else torch.device("cpu")  # steps: CPU scalars
        return torch.empty(size, dtype=dtype, device=device)

    target = from_snapshot(saved, layout, tensor_for)
    return target if isinstance(target, dict) else {}


def load_optimizer(key: str, opt: Any, got: dict[str, Any], step: int) -> None:
    from ckpt.snapshot.run import SnapshotError

    sd = dict(got)
    sd["state"] = {int(i): v for i, v in got.get("state", {}).items()}  # saved by index, named by str
    sd.setdefault("param_groups", [])
    try:
        opt.load_state_dict(sd)
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"state[{key!r}]: the snapshot of step {step} does not fit this optimizer: {e}",
                            hint="build the optimizer with the same parameter groups as the run that saved it") from e


def _build(root: dict[str, Any], rel: Path, leaf: Any) -> None:
    """Put ``leaf`` at ``rel`` under ``root``, making dicts (str steps) and lists (int steps)."""
    if not rel:
        raise ValueError("an item at the top of an optimizer's state dict")
    cur: Any = root
    for here, nxt in zip(rel, rel[1:]):
        child = _get(cur, here)
        if child is None:
            child = [] if isinstance(nxt, int) else {}
            _put(cur, here, child)
        cur = child
    _put(cur, rel[-1], leaf)


def _get(cur: Any, step: str | int) -> Any:
    if isinstance(cur, list):
        return cur[step] if isinstance(step, int) and step < len(cur) else None
    return cur.get(step)


def _put(cur: Any, step: str | int, value: Any) -> None:
    if isinstance(cur, list):
        assert isinstance(step, int)
        cur.extend([None] * (step + 1 - len(cur)))
    cur[step] = value


def set_at(root: Any, path: Path, value: Any) -> None:
    """Set the item at a DCP key path, whose dict steps are ``str(key)`` of the real keys."""
    cur = root
    for step in path[:-1]:
        cur = cur[_real_key(cur, step)]
    cur[_real_key(cur, path[-1])] = value


def _real_key(cur: Any, step: str | int) -> Any:
    if isinstance(cur, Mapping) and step not in cur:
        return next(k for k in cur if str(k) == step)
    return step
