"""What a loaded state dict holds, made flat and plain: names for nested entries, and
the raw bytes of each tensor, or a clear error.

* Nested mappings are flattened by joining keys with ``.``; int keys (optimizer state
  is keyed by parameter index) are written in decimal; other key types are refused, and
  so are two entries that end up with the same name (``{'a': {'b': x}, 'a.b': y}``,
  ``{0: x, '0': y}``), naming both: one of them would otherwise be lost. Empty mappings
  are kept as JSON ``{}``. A list or tuple that holds a tensor (at any depth) is
  flattened as the mapping of its indexes: a Lightning checkpoint's
  ``optimizer_states[0]['state'][0]['exp_avg']`` is ``optimizer_states.0.state.0.exp_avg``.
  Other lists and tuples are values, kept whole as JSON. Where the flat names are not the whole
  story (a nested dict, a list, an int key, an OrderedDict and its ``_metadata``, a torch.Size, a
  Parameter), the structure itself is kept too, under
  ``extra[STRUCTURE]``, so that a pull to a torch file gives it back (docs/format.md).
* Tensors must have plain bytes: sparse, meta, quantized and nested tensors and wrapper
  subclasses (DTensor...) are refused with a hint saying how to convert them. Lazy
  conjugate/negative views are resolved; other subclasses are read through the plain
  tensor underneath.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from ckpt.errors import InvalidSourceError, ResourceLimitError, first_line
from ckpt.format.dtypes import byte_view, from_torch
from ckpt.format.names import MAX_NAME, check_tensor_name
from ckpt.format.structure import MAX_STRUCTURE_BYTES, STRUCTURE
from ckpt.format.tagged_json import EXACT_TAGS, ExpansionGuard, encode, uses_tags
from ckpt.store.source_files import show
from ckpt_store.storage.records import canonical_json

logger = logging.getLogger(__name__)


def flatten_state_dict(obj: Mapping[Any, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Nested mappings as flat names (``{'a': {'b': x}}`` -> ``a.b``): tensors, and the other values
    as tagged JSON (:mod:`ckpt.format.tagged_json`; plain JSON where no value needs a tag).

    Lists and tuples that hold a tensor are walked as mappings of their indexes.

    Refused, never resolved by dropping one: two entries with the same name, keys other
    than str or int, a mapping or list that contains itself, names past ``MAX_NAME``, values
    that tagged JSON cannot hold (an arbitrary object)."""
    import torch

    holders = _tensor_holders(obj, torch.Tensor)
    tensors: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # flat name -> the keys it came from, to name both sides of a collision
    stack: list[tuple[Iterator[tuple[Any, Any]], str, str, int]] = [(iter(obj.items()), "", "", id(obj))]
    open_ids = {id(obj)}  # the mappings being walked: meeting one again is a cycle
    guard = ExpansionGuard()  # meeting one again elsewhere is sharing, walked again, within bounds
    guard.enter(obj)
    flat = all(isinstance(k, str) for k in obj)  # then its flat names are its keys: no structure to keep
    while stack:  # not recursive: nesting depth is the file's choice
        items, prefix, keys, oid = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            open_ids.discard(oid)
            continue
        k, v = item
        if isinstance(k, bool) or not isinstance(k, (str, int)):
            raise InvalidSourceError(path, f"key {show(repr(k))[:80]} (in {keys or 'the top level'}) is a {type(k).__name__}; "
                                     "only str and int keys name entries", hint="save it again with string keys")
        if isinstance(k, int) and k.bit_length() > 4 * MAX_NAME:  # str() of it would be refused by Python, or too long
            raise InvalidSourceError(path, f"entry {keys}[{k.bit_length()}-bit int] has a name past {MAX_NAME} characters")
        name = prefix + str(k)
        spell = f"{keys}[{show(repr(k))}]"
        if len(name) > MAX_NAME:
            raise InvalidSourceError(path, f"entry {spell[:120]}... has a name longer than {MAX_NAME} characters "
                                     "(nested too deeply, or keys too long)")
        if (isinstance(v, Mapping) and v) or id(v) in holders:
            if id(v) in open_ids:
                raise InvalidSourceError(path, f"entry {spell} contains itself (a reference cycle)")
            if not guard.enter(v):
                raise InvalidSourceError(path, f"entry {spell[:120]} is reached through so many shared lists and dicts "
                                         f"that the file would flatten to far more entries than it holds ({guard.walked:,} "
                                         f"items walked, {guard.held:,} distinct)", hint="save each list or dict once")
            stack.append((iter(v.items() if isinstance(v, Mapping) else enumerate(v)), name + ".", spell, id(v)))
            open_ids.add(id(v))
            flat = False
            continue
        if name in spelled:
            raise InvalidSourceError(path, f"entries {spelled[name]} and {spell} both flatten to the name {name!r}",
                                     hint="nested keys are joined with '.'; rename one of them and save again")
        spelled[name] = spell
        if isinstance(v, torch.Tensor):
            tensors[name] = v
            continue
        check_tensor_name(name, "entry name")
        if isinstance(v, Mapping):  # empty: kept, so that nothing the file holds is dropped
            extra[name] = {}
            continue
        extra[name] = encode(v, spell, guard=guard, unsupported=lambda at, kind: InvalidSourceError(
            path, f"entry {at[:120]} is {kind}, neither a tensor nor a plain value",
            hint="other entries are kept as JSON: str, int, float, complex, bool, None, bytes, bytearray, torch.dtype, torch.device, "
                 "and lists, tuples and dicts of these"))
    # A flat dict's flat names and values are all of it, unless it holds what only an exact structure keeps:
    # decided from types in one pass, so that a plain state dict's push builds no structure to throw away.
    tree = None if flat and type(obj) is dict and _plain(obj, tensors) else _structure(obj, path, tensors)
    if flat and tree is not None and not uses_tags(tree, EXACT_TAGS):
        tree = None
    if tree is not None:
        extra[STRUCTURE] = tree
    return tensors, extra


def _plain(obj: Mapping[str, Any], tensors: dict[str, Any]) -> bool:
    """Whether flat dict ``obj`` holds none of what ``EXACT_TAGS`` keep: each tensor a plain ``Tensor``
    that needs no grad, alone in its storage (no tied weights, views or one object twice), and no
    ``torch.Size`` nor ``OrderedDict`` among its values (walked after encode, so within its bounds)."""
    import torch

    storages: set[Any] = set()
    for t in tensors.values():
        if type(t) is not torch.Tensor or t.requires_grad:
            return False
        try:
            where = (t.device, t.untyped_storage().data_ptr()) if t.numel() else id(t)
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own: let the structure decide
            return False
        if where in storages:
            return False
        storages.add(where)
    stack = [v for v in obj.values() if not isinstance(v, torch.Tensor)]
    while stack:
        x = stack.pop()
        if type(x) in (OrderedDict, torch.Size):
            return False
        if isinstance(x, dict):
            stack.extend((*x.keys(), *x.values()))
        elif isinstance(x, (list, tuple, set)):
            stack.extend(x)
    return True


class _NoStructure(Exception):
    pass


def _structure(obj: Mapping[Any, Any], path: str, tensors: dict[str, Any]) -> Any | None:
    """``obj`` as tagged JSON, each tensor as ``{"__tensor__": its flat name}`` (``tensors``, in the
    order the flattening met them); None where tagged JSON cannot hold it (nested deeper than
    ``MAX_DEPTH``, a mapping that is not a dict) or it is past ``MAX_STRUCTURE_BYTES``: such a
    checkpoint pulls flat."""
    order = iter(tensors.items())

    def named(at: str, t: Any) -> str:
        name, mine = next(order, ("", None))
        if mine is not t:  # both walks go depth first in the same order; anything else would misname a tensor
            raise _NoStructure
        return name

    try:
        tree = encode(obj, path, unsupported=lambda at, kind: _NoStructure(), tensor=named, exact=True)
    except _NoStructure:
        logger.info("%s: its structure is not kept (not a tree of dicts, lists and tuples tagged JSON holds); "
                    "it pulls as a flat dict", path)
        return None
    if next(order, None) is not None:
        return None
    if len(canonical_json(tree)) > MAX_STRUCTURE_BYTES:
        logger.info("%s: its structure is not kept (its values are past %d bytes); it pulls as a flat dict",
                    path, MAX_STRUCTURE_BYTES)
        return None
    return tree


def _tensor_holders(obj: Any, tensor: type) -> set[int]:
    """The ids of the mappings, lists and tuples within ``obj`` that hold a ``tensor`` at any
    depth: one walk, each container once, children before parents (not recursive: nesting
    depth is the file's choice). A container met again through a cycle counts as what was
    known of it then; the flattening refuses the cycle."""
    def children(x: Any) -> list[Any]:
        return list(x.values() if isinstance(x, Mapping) else x)

    holds: set[int] = set()
    seen: dict[int, Any] = {}  # id -> the container (kept alive, so that no id is reused meanwhile)
    stack: list[tuple[Any, list[Any] | None]] = [(obj, None)]
    while stack:
        x, kids = stack.pop()
        if kids is not None:  # its children are done
            if any(isinstance(c, tensor) or id(c) in holds for c in kids):
                holds.add(id(x))
            continue
        if id(x) in seen:
            continue
        seen[id(x)] = x
        kids = children(x)
        stack.append((x, kids))
        stack.extend((c, None) for c in kids if isinstance(c, (Mapping, list, tuple)) and id(c) not in seen)
    return holds


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _refuse_kind(name: str, t: Any) -> None:
    """Tensors whose bytes are not a plain dense array are refused, saying how to convert them."""
    import torch

    cls = type(t)
    why = hint = ""
    if getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        if cls.__name__ == "DTensor":
            why = "a DTensor (sharded across ranks)"
            hint = "gather it with .full_tensor() first, or save sharded state with ckpt's torch.distributed.checkpoint support"
        else:
            why = f"a {show(cls.__name__)}, a tensor subclass without plain bytes of its own"
            hint = "convert it to a plain torch.Tensor first"
    elif t.is_nested:
        why, hint = "a nested tensor", "store its components as separate tensors (t.unbind())"
    elif t.layout != torch.strided:
        why = f"a {str(t.layout).removeprefix('torch.')} (not strided) tensor"
        hint = "convert it with .to_dense() first" + (", or store its indices and values as tensors" if t.is_sparse else "")
    elif t.is_quantized:
        why, hint = "a quantized tensor", "store t.dequantize(), or t.int_repr() with its scale and zero point"
    elif t.is_meta:
        why, hint = "a meta tensor, which has no data", "load real weights into it (e.g. to_empty() then load_state_dict) first"
    if why:
        raise InvalidSourceError(repr(name), f"is {why}", hint=hint)


def storable_dtype(name: str, t: Any) -> str:
    """``t``'s dtype as stored; raises :class:`InvalidSourceError` if ``t`` cannot be stored (its kind
    or dtype). For callers that stage tensors to write them later (a snapshot): refused at once."""
    import contextlib

    import torch

    plain = getattr(torch._C, "DisableTorchFunctionSubclass", contextlib.nullcontext)
    with plain():
        _refuse_kind(name, t)
        try:
            return from_torch(t.dtype)
        except InvalidSourceError:
            raise InvalidSourceError(repr(name), f"has dtype {t.dtype}, which ckpt cannot store",
                                     hint="cast it to a safetensors dtype first") from None


def plain_bytes(name: str, t: Any, budget: list[int]) -> tuple[str, tuple[int, ...], memoryview, Any]:
    """``t``'s dtype, shape, bytes and the dense tensor that owns them. Subclasses are read
    through the plain tensor underneath (their ``__torch_function__`` could substitute
    other data); ``budget``: bytes of copies the machine can still hold."""
    import contextlib

    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidSourceError("state dict", f"{name!r} is a {type(t).__name__}, not a tensor")
    plain = getattr(torch._C, "DisableTorchFunctionSubclass", contextlib.nullcontext)
    with plain():
        dtype = storable_dtype(name, t)
        copied = t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg()
        need = t.numel() * t.element_size() if copied else 0
        if need > budget[0]:  # a few bytes of .pt can describe a huge tensor over tiny storage (stride 0)
            raise ResourceLimitError(f"{name!r}: pushing needs a {need:,}-byte dense copy of it, more than this machine's memory",
                                     hint="make it contiguous and smaller first, or push it from a bigger machine")
        budget[0] -= need
        try:
            dense = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
            if type(dense) is not torch.Tensor:
                dense = dense.as_subclass(torch.Tensor)
            return dtype, tuple(dense.shape), byte_view(dense), dense
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            first = show(first_line(e, type(e).__name__)[:200])
            if "alloc" in first.lower() or "memory" in first.lower():
                raise ResourceLimitError(f"{name!r}: cannot copy it out: {first}") from None
            raise InvalidSourceError(repr(name), f"its bytes cannot be read: {first}",
                                     hint="convert it to a plain dense tensor first") from None
