"""A pushed .pt's structure in a manifest (docs/format.md): the object the file held, as tagged JSON under
``extra[STRUCTURE]``, and the checks a reader makes of it: each tensor once, at the place its flat name
spells, beside the same values ``extra`` holds by flat name."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from ckpt.format.tagged_json import EXACT_TAGS, LATER_TAGS, ODICT, SET, SIZE, TAGS, TENSOR, plain_keys, set_value, tensor_refs, uses_tags
from ckpt.format.tensor_values import TENSOR_TAGS
from ckpt_store.storage.errors import StoreFormatError
from ckpt_store.storage.records import canonical_json

# The key of ``extra`` holding a pushed .pt's structure (docs/format.md): no entry of a state dict is
# named by the empty string (check_tensor_name refuses it), so it is never one of its values.
STRUCTURE = ""
# A structure repeats the values ``extra`` holds by name: past this size (values of millions of
# numbers) it is not kept, so that it never doubles a manifest towards what readers accept.
MAX_STRUCTURE_BYTES = 16 << 20


def check_structure(extra: Mapping[str, Any], tree: Any, names: Counter[str], exact: bool, what: str) -> None:
    """A pushed .pt's structure, ``extra[STRUCTURE]`` (``tree`` decoded, of a version with the exact types
    where ``exact``), is a dict that names each of the tensors ``names`` counts once, and nothing else,
    each at the place its flat name spells (``model.0.weight`` at ``["model"][0]["weight"]``), and holds the
    values the rest of ``extra`` holds by flat name: one that does not would pull a file holding other tensors
    than the checkpoint, or holding them where ``load`` and a safetensors pull do not (two layers' weights
    swapped). Raises :class:`StoreFormatError`."""
    if not isinstance(tree, dict):
        raise StoreFormatError(f"{what}: its structure is a {type(tree).__name__}, not the dict a pushed file holds")
    if Counter(tensor_refs(extra[STRUCTURE])) != names:
        raise StoreFormatError(f"{what}: its structure does not name each of its tensors once")
    # (decoded above, so well formed) Each value with the flat name of its place: None where no tensor
    # is in a state dict pushed (a dict key, a set's item, the value of a key neither str nor int).
    values: dict[str, Any] = {}  # each value the structure holds where a flattening names one, by that name
    stack: list[tuple[Any, str | None]] = [(extra[STRUCTURE], "")]
    while stack:
        x, at = stack.pop()
        if at and not _holds_entries(x, exact):
            values[at], at = x, None  # (kept whole: nothing within it has a flat name)
        if isinstance(x, list):
            stack.extend((v, _place(at, i)) for i, v in enumerate(x))
        elif not isinstance(x, dict):
            continue
        elif list(x) == [TENSOR]:
            if x[TENSOR] != at:
                raise StoreFormatError(f"{what}: its structure holds tensor {x[TENSOR]!r} "
                                       + (f"at {at!r}" if at is not None else "where no tensor is (a dict key or a set)"))
        elif list(x) == ["__dict__"] or (list(x) == [ODICT] and exact):  # (an OrderedDict's attributes hold none)
            pairs = x["__dict__"] if "__dict__" in x else x[ODICT][0]
            stack.extend(p for k, v in pairs for p in ((k, None), (v, _place(at, k))))
        elif len(x) == 1 and next(iter(x)) in TENSOR_TAGS and exact:  # (a tensor named after it, its value first)
            stack.append((next(iter(x.values()))[0], at))
        elif list(x) == ["__tuple__"]:
            stack.extend((v, _place(at, i)) for i, v in enumerate(x["__tuple__"]))
        elif len(x) == 1 and next(iter(x)) in LATER_TAGS:  # a set's items (the other tags hold no tensor)
            stack.extend((v, None) for v in x.values())
        else:
            stack.extend((v, _place(at, k)) for k, v in x.items())
    # The values by flat name (extra_values(), a safetensors pull's metadata) are those the structure holds
    # (a .pt pull): a structure holding another (an epoch of 4, by name 3) would give two answers.
    flat = {k: v for k, v in extra.items() if k != STRUCTURE}
    for name in sorted(set(values) | set(flat)):
        if name not in values or name not in flat or canonical_json(_flat_value(values[name], exact)) != canonical_json(flat[name]):
            raise StoreFormatError(f"{what}: its structure and its value {name!r} disagree")


def _holds_entries(x: Any, exact: bool) -> bool:
    """Whether the flattening walks into structure value ``x`` (a non-empty dict, a list or tuple holding a
    tensor, a tensor), rather than keeping it whole as one value."""
    if isinstance(x, list):
        return uses_tags(x, (TENSOR,))
    if not isinstance(x, dict):
        return False
    tag = next(iter(x)) if len(x) == 1 else None
    if tag == "__dict__" or (tag == ODICT and exact):
        return bool(x[tag] if tag == "__dict__" else x[tag][0])
    if tag == TENSOR or (exact and tag in TENSOR_TAGS):
        return True  # (a tensor, its tag holding its reference: the structure decoded)
    if tag == "__tuple__":
        return uses_tags(x, (TENSOR,))
    return not (tag in TAGS and (exact or tag not in EXACT_TAGS)) and bool(x)  # (before version 4 those were a dict's keys)


def _flat_value(x: Any, exact: bool) -> Any:
    """Structure value ``x`` as ``extra`` holds it by name: without the exact types (encode's ``exact``), an
    ``OrderedDict`` written as a dict and a ``torch.Size`` as a tuple (``exact``: in a version that has them;
    before, such a key was a plain dict's)."""
    if isinstance(x, list):
        return [_flat_value(v, exact) for v in x]
    if not isinstance(x, dict):
        return x
    if list(x) == [SIZE] and exact:
        return {"__tuple__": x[SIZE]}
    if list(x) == [ODICT] and exact:
        pairs = [[_flat_value(k, exact), _flat_value(v, exact)] for k, v in x[ODICT][0]]
        return dict(pairs) if plain_keys([k for k, _ in pairs]) else {"__dict__": pairs}
    if list(x) == [SET] and isinstance(x[SET], list):
        return set_value([_flat_value(v, exact) for v in x[SET]])
    return {k: _flat_value(v, exact) for k, v in x.items()}


def _place(at: str | None, key: Any) -> str | None:
    """The flat name of the value at ``key`` of the value whose place is ``at`` (source_tensors' flattening)."""
    if at is None or isinstance(key, bool) or not isinstance(key, (str, int)):
        return None
    return f"{at}.{key}" if at else str(key)
