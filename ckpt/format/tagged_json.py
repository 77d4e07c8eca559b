"""Tagged JSON: how non-tensor values are stored, never as pickle (docs/format.md).

Plain JSON values stay as they are. What JSON cannot say is a one-key object whose key
is a tag: ``{"__tuple__": [...]}``, ``{"__dict__": [[k, v], ...]}`` for a dict whose
keys are not all plain strings (an optimizer's state is keyed by int),
``{"__float__": "inf"}`` for inf/-inf/nan, ``{"__bytes__": "<hex>"}``,
``{"__dtype__": "bfloat16"}`` for a ``torch.dtype`` and ``{"__device__": "cuda:0"}`` for a
``torch.device`` (which ``torch.load(weights_only=True)`` allows, so some configs save them),
``{"__complex__": [real, imag]}``, ``{"__set__": [items in the order of their JSON]}`` and
``{"__bytearray__": "<hex>"}`` (which it allows too), and ``{"__tensor__": NAME}`` where a tree points at a
stored tensor. Where asked for (``exact``: a pushed .pt's structure), the types that loader gives
back too: ``{"__odict__": [[[k, v], ...], {attribute: value}]}`` for an ``OrderedDict`` (a module's
``state_dict()``, whose ``_metadata`` attribute holds the module versions ``load_state_dict`` reads),
``{"__size__": [ints]}`` for a ``torch.Size`` and ``{"__parameter__": [{"__tensor__": NAME},
requires_grad]}`` for an ``nn.Parameter``, ``{"__requires_grad__": [{"__tensor__": NAME}]}`` for a plain tensor that
requires grad, and ``{"__shared__": [that tensor's value, NAME]}`` for a tensor
that shares the memory of the one named NAME met before it (tied weights: the same storage, offset,
shape, strides and dtype), which it shares again when decoded; ``{"__shared__": [value, NAME, true]}`` where it
is the very object met before by NAME, which it is again when decoded; ``{"__view__": [value, NAME, offset,
strides]}`` for a view at another offset or shape of the contiguous tensor NAME met before it (its offset in
elements from that tensor's first), or met after it (a view saved before its base), which it is again when decoded.

How a tensor is written (its reference, and in an exact tree its type, requires_grad and the memory it
shares) is :mod:`ckpt.format.tensor_values`'s part.

Snapshots (``ckpt.snapshot.state``) and distributed checkpoints (``ckpt.dcp.format``)
both write and read values through this module: one encoder, one strict decoder.

>>> enc = encode({"lr": 0.1, 0: (1, float("inf"))}, "x", unsupported=lambda p, d: ValueError(p))
>>> enc
{'__dict__': [['lr', 0.1], [0, {'__tuple__': [1, {'__float__': 'inf'}]}]]}
>>> decode(enc, "x")
{'lr': 0.1, 0: (1, inf)}
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ckpt.format.tensor_values import GRAD, PARAMETER, SHARED, TENSOR, TENSOR_TAGS, VIEW, Spans, TensorPlaces, decode_tensor, spans_hold
from ckpt_store.storage.errors import StoreFormatError
from ckpt_store.storage.records import canonical_json

DTYPE = "__dtype__"
DEVICE = "__device__"
COMPLEX = "__complex__"
SET = "__set__"
BYTEARRAY = "__bytearray__"
TORCH_TAGS = (DTYPE, DEVICE)  # tags of torch values
# Tags added after the others: a record using one is of a version older readers refuse (docs/format.md:
# manifest version 3, snapshot format 2, ckpt-dcp version 2), and a dict an earlier version wrote with
# such a key, in any other shape than the tag's, still reads as that dict.
LATER_TAGS = (*TORCH_TAGS, COMPLEX, SET, BYTEARRAY)
ODICT = "__odict__"
SIZE = "__size__"
# Tags of the exact types (encode's ``exact``), added after LATER_TAGS in the same way (manifest version 4).
EXACT_TAGS = (ODICT, SIZE, PARAMETER, SHARED, GRAD, VIEW)
TAGS = ("__tuple__", "__dict__", "__float__", "__bytes__", *LATER_TAGS, *EXACT_TAGS, TENSOR)
MAX_DEPTH = 64
MAX_EXPANSION = 8


class ExpansionGuard:
    """Counts the items of the lists, tuples and dicts a walk enters (and the bytes of long strings)
    against those of the distinct objects among them. Pickle shares objects: a .pt of 2 KB can hold a
    list that holds itself twice, 40 times over, and one of a few MB a list of a million numbers under
    a thousand keys; a walk entering each reference expands them to 2**40 or 10**9 entries (hours, and
    all memory). Sharing a few (one state dict under two keys) stays far below ``MAX_EXPANSION``
    times what there is."""

    def __init__(self) -> None:
        self.walked = 0
        self.held = 0
        self._seen: set[int] = set()  # ids of objects the walked object keeps alive meanwhile

    def enter(self, x: Any) -> bool:
        """Count entering ``x``; False once the walk has entered far more than there is."""
        n = len(x)
        if isinstance(x, (str, bytes, bytearray)) and n < 1024:  # short ones: a key shared by every parameter's state
            return True
        self.walked += n
        if id(x) not in self._seen:
            self._seen.add(id(x))
            self.held += n
        return self.walked <= MAX_EXPANSION * self.held + 4096


def encode(x: Any, path: str, *, unsupported: Callable[[str, str], Exception],
           tensor: Callable[[str, Any], str | None] | None = None, reserved: Collection[str] = (),
           guard: ExpansionGuard | None = None, exact: bool = False) -> Any:
    """``x`` as tagged JSON.

    ``path`` names ``x``; nested values get ``path/i`` (list and tuple items),
    ``path/KEY`` (dict values) and ``path/kI`` (non-string dict keys). ``tensor(path, t)``,
    when given, receives each tensor, which becomes ``{"__tensor__": NAME}``, NAME being what
    it returns, or ``path`` where it returns None; without it a tensor is unsupported. A dict with a key in ``reserved`` (or a tag) is written
    in the ``__dict__`` form so that it cannot be misread. Anything else raises
    ``unsupported(path, "a module.Type")``, and so does a dict subclass with defaults for
    missing keys (``defaultdict``, ``Counter``): decoded as a plain dict, it would raise
    ``KeyError`` where the original gave a default. (Other dict subclasses, such as the
    ``OrderedDict`` of a module's ``state_dict()``, come back as plain dicts, unless ``exact``: then an
    ``OrderedDict`` (and its attributes), a ``torch.Size`` and an ``nn.Parameter`` use ``EXACT_TAGS``.) A dict keeps
    its key order: records are canonical JSON, whose objects have their keys sorted, so a
    dict whose keys are not in sorted order is written in the ``__dict__`` form. A value whose
    shared lists, dicts and long strings would expand it far past what it holds is unsupported too
    (``guard``, one :class:`ExpansionGuard` for a walk over several values, or its own).
    """
    walk = guard if guard is not None else ExpansionGuard()
    places = TensorPlaces()  # (exact) where each tensor met lies

    def enc(x: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            return _raise(unsupported(path, "value nested too deeply"))
        if isinstance(x, (tuple, list, dict, set, str, bytes, bytearray)) and not walk.enter(x):
            return _raise(unsupported(path, "a value whose lists, dicts or strings are shared so often that it expands "
                                            "to far more than it holds"))
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x) if math.isfinite(x) else {"__float__": repr(float(x))}
        if isinstance(x, complex):
            return {COMPLEX: [enc(x.real, path, depth + 1), enc(x.imag, path, depth + 1)]}
        if isinstance(x, bytes):
            return {"__bytes__": x.hex()}
        if isinstance(x, bytearray):
            return {BYTEARRAY: x.hex()}
        if isinstance(x, set):
            items = [enc(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]
            if uses_tags(items, (TENSOR,)):
                return _raise(unsupported(path, "a set holding a tensor"))
            return set_value(items)
        if exact and type(x) is _torch().Size:
            return {SIZE: [enc(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]
        if isinstance(x, dict):
            if hasattr(type(x), "__missing__"):  # it would come back a plain dict, raising KeyError where it gave a default
                return _raise(unsupported(path, f"a {type(x).__module__}.{type(x).__name__} (a dict with defaults for missing "
                                                "keys, which would come back as a plain dict)"))
            if exact and type(x) is OrderedDict:
                attrs = vars(x)
                if not all(_attribute_name(k) for k in attrs):
                    return _raise(unsupported(path, "an OrderedDict with attributes other than plain names"))
                return {ODICT: [[[enc(k, f"{path}/k{i}", depth + 1), enc(v, f"{path}/{k}", depth + 1)]
                                 for i, (k, v) in enumerate(x.items())], enc(attrs, f"{path}/attrs", depth + 1)]}
            # Records are canonical JSON, which writes an object's keys sorted: a dict in any other
            # order (a module's state_dict, a data loader's sources) is written as pairs, in its order.
            if plain_keys(list(x), reserved):
                return {k: enc(v, f"{path}/{k}", depth + 1) for k, v in x.items()}
            return {"__dict__": [[enc(k, f"{path}/k{i}", depth + 1), enc(v, f"{path}/{k}", depth + 1)]
                                 for i, (k, v) in enumerate(x.items())]}
        if _is_dtype(x):
            return {DTYPE: str(x).removeprefix("torch.")}
        if _is_device(x):
            return {DEVICE: str(x)}
        if tensor is not None and _is_tensor(x):
            name = tensor(path, x)
            ref = {TENSOR: path if name is None else name}
            if not exact:
                return ref
            return places.value(x, ref)
        if type(x).__module__ == "numpy" and getattr(x, "shape", None) == ():  # numpy scalars
            return enc(x.item(), path, depth + 1)
        return _raise(unsupported(path, f"a {type(x).__module__}.{type(x).__name__}"))

    tree = enc(x, path, 0)
    places.finish()  # (exact) pieces of one storage that no tensor covers, joined
    return tree


def decode(x: Any, what: str, *, tensor: Callable[[str], Any] | None = None, later: bool = True, exact: bool = False,
           torch_values: bool = True, span_bytes: int | None = None) -> Any:
    """Inverse of :func:`encode`; :class:`StoreFormatError` for anything it would not write.

    ``tensor(name)`` resolves ``{"__tensor__": name}``; without it such a value is an error.
    ``later``: whether the record is of a version that has ``LATER_TAGS``; in one before them
    (``False``) a dict holding such a key is the plain dict that version wrote; ``exact`` likewise for
    ``EXACT_TAGS``. ``torch_values=False`` (a reader checking a record, which need not import torch):
    a ``torch.Size`` comes back as a tuple and a Parameter as what ``tensor`` gives. ``span_bytes``: the most
    memory the storages of pieces (``__view__`` spans) may take together, one past it refused before it is allocated (a damaged or
    forged length must not take all memory); its caller knows the bytes of the tensors the record names.
    """

    made: dict[str, Any] = {}  # each tensor's name -> the value decoded at its place (a __shared__ object's target)
    spans = Spans()  # each span's name -> the storage its pieces are put in (a __view__ of five items)
    shape = {**(_LATER_SHAPE if later else {}), **(_EXACT_SHAPE if exact else {})}  # tag -> the type of its value

    def dec(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise StoreFormatError(f"{what}: value nested too deeply")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [dec(v, depth + 1) for v in x]
        if not isinstance(x, dict):
            raise StoreFormatError(f"{what}: bad value")
        if len(x) == 1 and isinstance(next(iter(x.values())), shape.get(next(iter(x)), ())):
            tag, v = next(iter(x.items()))
            inner = lambda e: dec(e, depth + 1)  # noqa: E731
            value = _exact(tag, v, inner, torch_values, made, spans, span_bytes) if tag in EXACT_TAGS else _later(tag, v, inner)
            if value is None:
                raise StoreFormatError(f"{what}: bad {tag} value")
            if tag in TENSOR_TAGS:
                made[tensor_refs(v)[0]] = value
            return value
        if exact and len(x) == 1 and next(iter(x)) in EXACT_TAGS:
            # (a record with these tags writes a dict keyed by one as pairs, ``__dict__``: this is no value it wrote)
            raise StoreFormatError(f"{what}: bad {next(iter(x))} value")
        # Any other dict holding one of LATER_TAGS (or EXACT_TAGS) is what versions before those tags wrote as a plain dict.
        tags = [k for k in x if k in TAGS and k not in LATER_TAGS and k not in EXACT_TAGS]
        if not tags:
            return {k: dec(v, depth + 1) for k, v in x.items()}
        tag, v = tags[0], x[tags[0]]
        if len(x) == 1:
            try:
                if tag == "__tuple__" and isinstance(v, list):
                    return tuple(dec(e, depth + 1) for e in v)
                if tag == "__dict__" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
                    out = {dec(k, depth + 1): dec(val, depth + 1) for k, val in v}
                    if len(out) == len(v):  # else two pairs of one key (1 and True, say): a value would be lost
                        return out
                if tag == "__float__" and v in ("inf", "-inf", "nan"):
                    return float(v)
                if tag == "__bytes__" and isinstance(v, str):
                    return bytes.fromhex(v)
                if tag == TENSOR and isinstance(v, str) and tensor is not None:
                    t = tensor(v)
                    made.setdefault(v, t)  # (a __shared__ looks its target up by name again: keep the value at its place)
                    return t
            except (TypeError, ValueError):
                pass
        raise StoreFormatError(f"{what}: bad {tag} value")

    out = dec(x, 0)
    if not spans_hold(spans):
        raise StoreFormatError(f"{what}: bad {VIEW} value (a storage of pieces, most of it no tensor's memory)")
    return out


_LATER_SHAPE: dict[str, type] = {DTYPE: str, DEVICE: str, BYTEARRAY: str, COMPLEX: list, SET: list}
_EXACT_SHAPE: dict[str, type] = {ODICT: list, SIZE: list, PARAMETER: list, SHARED: list, GRAD: list, VIEW: list}


def _exact(tag: str, v: list[Any], dec: Callable[[Any], Any], torch_values: bool, made: Mapping[str, Any],
           spans: Spans, span_bytes: int | None) -> Any:
    """The value of one of EXACT_TAGS (``v`` a list), or None where ``v`` is not what :func:`encode` writes."""
    if tag == SIZE:
        ok = all(isinstance(d, int) and not isinstance(d, bool) and -(1 << 63) <= d < 1 << 63 for d in v)
        return None if not ok else _torch().Size(v) if torch_values else tuple(v)
    if tag in TENSOR_TAGS:
        return decode_tensor(tag, v, dec, torch_values, made, spans, span_bytes)
    if len(v) != 2 or not isinstance(v[1], dict):
        return None
    items, attrs = dec({"__dict__": v[0]}), dec(v[1])
    if not isinstance(attrs, dict) or not all(_attribute_name(k) for k in attrs):
        return None
    out = OrderedDict(items)
    vars(out).update(attrs)
    return out


def _later(tag: str, v: Any, dec: Callable[[Any], Any]) -> Any:
    """The value of one of LATER_TAGS (``v`` of its shape), or None where ``v`` is not what :func:`encode` writes."""
    if tag == DTYPE:
        return _dtypes().get(v)
    if tag == DEVICE:
        return _device(v)
    try:
        if tag == BYTEARRAY:
            return bytearray.fromhex(v)
        items = [dec(e) for e in v]
        if tag == COMPLEX:
            return complex(*items) if len(items) == 2 and all(type(e) is float for e in items) else None
        out = set(items)  # (TypeError: an item a set cannot hold, such as a list)
        return out if len(out) == len(items) else None
    except (TypeError, ValueError):
        return None


def _attribute_name(k: Any) -> bool:
    """Whether ``k`` may name an attribute of an OrderedDict (``_metadata``): never one of its class
    (``items``, ``__reduce__``...), which would hide the method pickle and its users call."""
    return isinstance(k, str) and not k.startswith("__") and not hasattr(OrderedDict, k)


def tensor_refs(tree: Any) -> list[str]:
    """Names of every tensor a tagged-JSON tree points at, in order."""
    out: list[str] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, Mapping):
            if TENSOR in x:
                out.append(x[TENSOR])
            else:
                stack.extend(reversed(list(x.values())))
        elif isinstance(x, list):
            stack.extend(reversed(x))
    return out


def uses_tags(tree: Any, tags: Collection[str] = TAGS) -> bool:
    """Whether :func:`encode` needed a tag (one of ``tags``) anywhere in ``tree`` (else ``tree`` is
    the value itself, in plain JSON).

    >>> uses_tags(encode([1, {"a": 2.5}], "x", unsupported=ValueError)), uses_tags(encode([(1,)], "x", unsupported=ValueError))
    (False, True)
    """
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, Mapping):
            if any(k in tags for k in x):
                return True
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def plain_keys(keys: list[Any], reserved: Collection[str] = ()) -> bool:
    """Whether :func:`encode` writes a dict with ``keys`` (in its order) as a plain JSON object: strings, none a tag
    or in ``reserved``, in sorted order (records are canonical JSON, whose objects have their keys sorted); else
    in the ``__dict__`` form, which keeps its order."""
    return all(isinstance(k, str) and k not in TAGS and k not in reserved for k in keys) and all(
        a < b for a, b in zip(keys, keys[1:]))


def set_value(items: list[Any]) -> dict[str, list[Any]]:
    """A set, given as its items' tagged JSON, as :func:`encode` writes it: the items in the order of their JSON,
    not of the set's (which differs between processes), so that one content has one id."""
    return {SET: sorted(items, key=canonical_json)}


def _torch() -> Any:
    import torch

    return torch


def _is_dtype(x: Any) -> bool:
    import torch

    return isinstance(x, torch.dtype)


def _dtypes() -> dict[str, Any]:
    """Every ``torch.dtype`` by its name (``bfloat16``): looked up in this table, never by
    ``getattr(torch, name)``, which could import any submodule a stored name chose."""
    import torch

    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def _is_device(x: Any) -> bool:
    import torch

    return isinstance(x, torch.device)


_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,9})?")


def _device(name: str) -> Any:
    """The ``torch.device`` ``name`` spells (``cuda:0``), or None: torch parses only a plain
    ``type[:index]``, and refuses types it does not know."""
    import torch

    if not _DEVICE.fullmatch(name):
        return None
    try:
        return torch.device(name)
    except (RuntimeError, ValueError):
        return None


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _raise(e: Exception) -> Any:
    raise e


__all__ = ["BYTEARRAY", "COMPLEX", "DEVICE", "DTYPE", "EXACT_TAGS", "LATER_TAGS", "MAX_DEPTH", "MAX_EXPANSION", "ODICT", "PARAMETER",
           "SET", "SHARED", "SIZE", "ExpansionGuard", "GRAD", "TORCH_TAGS", "VIEW",
           "TAGS", "TENSOR", "decode", "encode", "tensor_refs"]
