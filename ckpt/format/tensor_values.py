"""How tagged JSON (ckpt/format/tagged_json.py, docs/format.md) writes a tensor in a tree: a reference to
a stored tensor, ``{"__tensor__": NAME}``, and, in an exact tree (a pushed .pt's structure), what
``torch.load(weights_only=True)`` gives back beside the tensor's bytes: an ``nn.Parameter``
(``{"__parameter__": [ref, requires_grad]}``), a plain tensor's requires_grad (``{"__requires_grad__": [ref]}``),
and the memory it shares with a tensor met before it: the same object (``{"__shared__": [value, NAME, true]}``),
the same place (``{"__shared__": [value, NAME]}``) or a view into it (``{"__view__": [value, NAME, offset, strides]}``);
and pieces of one storage no tensor of the walk covers (``{"q": w[:4], "k": w[4:]}``): the first met is a view of a
storage of ``length`` elements, ``{"__view__": [value, ITS OWN NAME, offset, strides, length]}`` (a span), and the others
``__view__`` values naming it, their offsets counted from that storage's first element.
A reader gives that sharing back only after checking the bytes agree: never one tensor's memory for another's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TENSOR = "__tensor__"
PARAMETER = "__parameter__"
SHARED = "__shared__"
GRAD = "__requires_grad__"
VIEW = "__view__"
TENSOR_TAGS = (PARAMETER, SHARED, GRAD, VIEW)  # (exact tags: manifest version 4)
# (exact) Contiguous tensors per storage a later view is looked up in, and tensors met before one that may cover them:
# a flat buffer of many stays linear. The tensors past them are joined at the end of the walk (a span), not stored apart.
MAX_BASES = 16
# A span is written only where it is at most this many times the elements its pieces hold: the rest of it is memory
# no tensor of the file shows, which a reader fills with zeros (a few bytes of a huge storage are stored apart).
SPAN_SLACK = 2


class Spans(dict[str, list[Any]]):
    """The spans one decode has made: each one's name -> its storage (as elements), which of them a tensor holds, and
    how many elements its tensors hold; ``taken``: the bytes of those storages together, counted as each is made (summed
    again for each span, a forged manifest making each of its thousands of tensors head a span of its own took time
    growing with their square)."""

    taken: int = 0


class TensorPlaces:
    """Where each tensor of one exact walk lies, so that one met again is written as the object, the memory or
    the view it shares with the one met before (``x`` the walked value keeps them all alive: ids stay theirs)."""

    def __init__(self) -> None:
        self.memory: dict[tuple[Any, ...], str] = {}  # where each tensor's bytes lie -> the name of the first there
        self.objects: dict[int, str] = {}  # id of each tensor met -> the name it was first met by
        self.bases: dict[tuple[Any, ...], list[tuple[int, int, str]]] = {}  # storage -> contiguous tensors in it: span, name
        # storage -> tensors in it met without a base (a transposed weight before the weight): span, value written
        self.orphans: dict[tuple[Any, ...], list[tuple[int, int, list[int], dict[str, Any]]]] = {}
        # storage -> every tensor met in it, in walk order: span, strides, value written, name, elements (:meth:`finish`)
        self.members: dict[tuple[Any, ...], list[tuple[int, int, list[int], dict[str, Any], str, int]]] = {}

    def value(self, x: Any, ref: dict[str, str]) -> Any:
        """Tensor ``x``, stored as ``ref`` (``{"__tensor__": NAME}``), as an exact tree holds it."""
        import torch

        memory, objects, bases = self.memory, self.objects, self.bases  # (the walk's hot path: plain locals)
        value = {PARAMETER: [ref, x.requires_grad]} if type(x) is torch.nn.Parameter else {GRAD: [ref]} if x.requires_grad else ref
        same = objects.setdefault(id(x), ref[TENSOR])
        if same != ref[TENSOR]:  # the very object met before (torch.load gives it back as one object)
            return {SHARED: [value, same, True]}
        if x.is_nested or x.layout != torch.strided or x.is_meta or x.numel() == 0:
            return value  # (no plain memory, which a push refuses; empty tensors may all lie at one address)
        try:
            where = (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), x.dtype, tuple(x.shape), x.stride())
        except (RuntimeError, NotImplementedError, TypeError):  # a subclass without storage of its own
            return value
        first = memory.setdefault(where, ref[TENSOR])
        if first != ref[TENSOR]:
            return {SHARED: [value, first]}
        # A view at another offset or shape of a contiguous tensor met before (torch.save keeps one storage):
        # its offset in that tensor and its strides, so that a reader can make it that view again.
        off, storage = x.storage_offset(), where[:2] + (x.dtype,)
        end = off + 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
        # (an expanded tensor repeats its memory: stored apart) Each one met, with the value the tree holds, for finish()
        member = self.members.setdefault(storage, []) if all(st or n == 1 for n, st in zip(x.shape, x.stride())) else []
        base = next(((start, name) for start, stop, name in bases.get(storage, ()) if start <= off and end <= stop), None)
        if base is not None:
            view = {VIEW: [value, base[1], off - base[0], list(x.stride())]}
            member.append((off, end, list(x.stride()), view, ref[TENSOR], x.numel()))
            return view
        member.append((off, end, list(x.stride()), value, ref[TENSOR], x.numel()))
        if x.is_contiguous() and len(bases.setdefault(storage, [])) < MAX_BASES:
            bases[storage].append((off, end, ref[TENSOR]))
            # Tensors met before it that lie within it (``{"t": w.t(), "w": w}``) become views of it, a name met later
            # (the reader looks its stored tensor up): each one's value is rewritten in place.
            for start, stop, strides, written in self.orphans.get(storage, ()):
                if off <= start and stop <= end:
                    inner = written[VIEW][0] if VIEW in written else dict(written)
                    written.clear()
                    written[VIEW] = [inner, ref[TENSOR], start - off, strides]
        if len(self.orphans.setdefault(storage, [])) < MAX_BASES:
            self.orphans[storage].append((off, end, list(x.stride()), value))
        return value

    def finish(self) -> None:
        """At the end of the walk: the tensors of each storage that still lie in memory of their own once read
        (two or more not marked as views: pieces of a storage no tensor covers, ``{"q": w[:4], "k": w[4:]}``, or
        views past :data:`MAX_BASES`) are joined: the first met becomes a span, a view of the storage they lie in
        (manifest version 6), and every other tensor of that storage a view of it (each value rewritten in place)."""
        for members in self.members.values():
            if sum(VIEW not in written for _, _, _, written, _, _ in members) < 2:
                continue  # (one tensor, or one with its views: marked already)
            start, stop = min(m[0] for m in members), max(m[1] for m in members)
            if stop - start > SPAN_SLACK * sum(m[5] for m in members):
                continue
            anchor = members[0][4]
            for i, (off, _, strides, written, _, _) in enumerate(members):
                inner = written[VIEW][0] if VIEW in written else dict(written)
                written.clear()
                written[VIEW] = [inner, anchor, off - start, strides] + ([stop - start] if i == 0 else [])


def joins_pieces(tree: Any) -> bool:
    """Whether exact tree ``tree`` holds a span (a ``__view__`` of five items: :meth:`TensorPlaces.finish` writes one
    since manifest version 6)."""
    stack: list[Any] = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            if list(x) == [VIEW] and isinstance(x[VIEW], list) and len(x[VIEW]) == 5:
                return True
            stack.extend(x.values())
    return False


def views_ahead(tree: Any) -> bool:
    """Whether exact tree ``tree`` holds a ``__view__`` naming a tensor met later in its walk (a view saved before
    its base: :class:`TensorPlaces` writes one since manifest version 5). The tree may be outside data not yet
    decoded (a manifest's version is checked against it first): a name that is no string names nothing here."""
    met: set[str] = set()
    stack: list[Any] = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, tuple):  # (a view's base, looked at once its own value is walked: JSON holds no tuple)
            if x[0] not in met:
                return True
        elif isinstance(x, list):
            stack.extend(reversed(x))
        elif isinstance(x, dict) and list(x) == [TENSOR]:
            if isinstance(x[TENSOR], str):
                met.add(x[TENSOR])
        elif isinstance(x, dict) and list(x) == [VIEW] and isinstance(x[VIEW], list) and len(x[VIEW]) == 4:
            stack.extend((((x[VIEW][1],),) if isinstance(x[VIEW][1], str) else ()) + (x[VIEW][0],))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return False


def decode_tensor(tag: str, v: list[Any], dec: Callable[[Any], Any], torch_values: bool, made: Mapping[str, Any],
                  spans: Spans, span_bytes: int | None = None) -> Any:
    """The value of one of TENSOR_TAGS (``v`` a list), or None where ``v`` is not what :class:`TensorPlaces`
    writes. ``dec`` decodes a nested value; ``made``: each tensor's name -> the value decoded at its place;
    ``spans``: the spans made so far (:func:`spans_hold` checks them once the walk is done); ``span_bytes``: the most memory the
    spans may take together (None: as much as allocations get)."""
    if tag == SHARED:
        return _shared(v, dec, torch_values, made)
    if tag == VIEW:
        return _span(v, dec, torch_values, spans, span_bytes) if len(v) == 5 else _view(v, dec, torch_values, made, spans)
    if tag in (PARAMETER, GRAD):  # a Parameter [ref, requires_grad]; a plain tensor that requires grad [ref]
        if not (len(v) == (2 if tag == PARAMETER else 1) and isinstance(v[0], dict) and list(v[0]) == [TENSOR]
                and (tag == GRAD or isinstance(v[1], bool))):
            return None
        t = dec(v[0])
        if not torch_values:
            return t
        import torch

        try:  # (RuntimeError: an integer tensor cannot require grad)
            if type(t) is not torch.Tensor:
                return None
            return torch.nn.Parameter(t, requires_grad=v[1]) if tag == PARAMETER else t.requires_grad_(True)
        except RuntimeError:
            return None
    return None


def _shared(v: list[Any], dec: Callable[[Any], Any], torch_values: bool, made: Mapping[str, Any]) -> Any:
    """A ``__shared__`` value: its tensor (or Parameter), made to share the memory of the tensor it names,
    whose bytes, dtype and shape it must have; with a third item ``true``, the very object decoded at that
    name's place, which must be of its type and requires_grad too; None where ``v`` is not what
    :class:`TensorPlaces` writes."""
    same = len(v) == 3 and v[2] is True
    if not ((len(v) == 2 or same) and _names_another(v[0], v[1])):  # (v[1] read only where there is one)
        return None
    first = made.get(v[1])  # (before decoding: a name met later is in ``made`` after, never the object met before)
    t, other = dec(v[0]), dec({TENSOR: v[1]})
    if not torch_values:
        return t
    import torch

    # (``other`` may be a view by now, met after its base or before: its bytes in its own order, as ``t`` holds them)
    if not (isinstance(t, torch.Tensor) and type(other) is torch.Tensor and (t.dtype, t.shape) == (other.dtype, other.shape)
            and _same_bytes(t, other)):
        return None  # (named as shared, but other bytes: never handed out as the same tensor)
    if same:
        return first if type(first) is type(t) and first.requires_grad == t.requires_grad else None
    with torch.no_grad():
        t.set_(other.untyped_storage(), other.storage_offset(), other.shape, other.stride())
    return t


def _view(v: list[Any], dec: Callable[[Any], Any], torch_values: bool, made: Mapping[str, Any], spans: Spans) -> Any:
    """A ``__view__`` value ``[VALUE, NAME, offset, strides]``: its tensor made the view, at ``offset`` elements
    into the contiguous tensor decoded at NAME's place (or, NAME met later, its stored tensor) and with ``strides``,
    whose bytes there it must be; NAME a span met before: a piece of its storage (:func:`_into_span`).
    None where ``v`` is not what :class:`TensorPlaces` writes (a view reaching outside that tensor, other bytes)."""
    if not (len(v) == 4 and _names_another(v[0], v[1]) and _ints([v[2]]) and isinstance(v[3], list) and _ints(v[3])):
        return None
    t = dec(v[0])
    if not torch_values:
        return t
    if v[1] in spans:
        return _into_span(t, spans[v[1]], v[2], v[3])
    # (a tensor met later, whose place gives back the stored tensor it now shares: a view saved before its base)
    base = made[v[1]] if v[1] in made else dec({TENSOR: v[1]})
    import torch

    if not (isinstance(base, torch.Tensor) and isinstance(t, torch.Tensor) and base.is_contiguous() and base.dtype == t.dtype
            and len(v[3]) == t.dim() and t.numel() > 0
            and v[2] + 1 + sum((n - 1) * st for n, st in zip(t.shape, v[3])) <= base.numel()):
        return None
    at = base.storage_offset() + v[2]
    view = base.detach().as_strided(t.shape, v[3], at)
    if not _same_bytes(view, t):
        return None  # (named as a view, but other bytes: never handed out as that memory)
    with torch.no_grad():
        t.set_(base.untyped_storage(), at, t.shape, v[3])
    return t


def _span(v: list[Any], dec: Callable[[Any], Any], torch_values: bool, spans: Spans,
          span_bytes: int | None) -> Any:
    """A span, ``__view__`` value ``[VALUE, ITS OWN NAME, offset, strides, length]``: a storage of ``length`` elements
    (zeros where no tensor of it lies), its tensor put there at ``offset`` with ``strides``; the ``__view__`` values
    naming it put theirs. None where ``v`` is not what :class:`TensorPlaces` writes."""
    if not (_names_another(v[0], "") and v[1] == _name(v[0]) and _ints([v[2], v[4]]) and v[4] > 0 and isinstance(v[3], list)
            and _ints(v[3])):
        return None
    t = dec(v[0])
    if not torch_values:
        return t
    import torch

    # (past the bound, with the spans made before it: damaged, refused before its memory is taken; every span
    # counts, since a forged manifest could make each tensor head a span of its own)
    if not isinstance(t, torch.Tensor) or (span_bytes is not None and spans.taken + v[4] * t.element_size() > span_bytes):
        return None
    try:  # (a length no memory holds: damaged, as :func:`spans_hold` finds a length past its tensors)
        span = [torch.zeros(v[4], dtype=t.dtype), torch.zeros(v[4], dtype=torch.bool), 0]
    except RuntimeError:
        return None
    spans[v[1]] = span
    spans.taken += v[4] * t.element_size()
    return _into_span(t, span, v[2], v[3])


def _into_span(t: Any, span: list[Any], offset: int, strides: list[int]) -> Any:
    """Tensor ``t`` put into ``span``'s storage at ``offset`` with ``strides``, its bytes copied there: where a tensor
    put there before lies, they must be the bytes it holds (never one tensor's bytes changed by another's)."""
    import torch

    memory, held = span[0], span[1]
    if not (isinstance(t, torch.Tensor) and t.dtype == memory.dtype and len(strides) == t.dim() and t.numel() > 0
            and offset + 1 + sum((n - 1) * st for n, st in zip(t.shape, strides)) <= memory.numel()):
        return None
    place, taken = memory.as_strided(t.shape, strides, offset), held.as_strided(t.shape, strides, offset)
    with torch.no_grad():
        if bool(taken.any()) and not _same_bytes(place[taken], t.detach()[taken]):
            return None
        try:  # (RuntimeError: memory it repeats, which no pushed tensor has)
            place.copy_(t)
            taken.fill_(True)
        except RuntimeError:
            return None
        if not _same_bytes(place, t):  # (places met twice within it, holding other bytes)
            return None
        span[2] += t.numel()
        t.set_(memory.untyped_storage(), offset, t.shape, strides)
    return t


def spans_hold(spans: Spans) -> bool:
    """Whether each span (:func:`decode_tensor`) is at most ``SPAN_SLACK`` times the elements its tensors hold, as
    :class:`TensorPlaces` writes it: else most of it is memory no tensor shows (a damaged length)."""
    return all(memory.numel() <= SPAN_SLACK * n for memory, _, n in spans.values())


def _ints(xs: list[Any]) -> bool:
    """Whether ``xs`` are ints that an offset, a length or a stride can be."""
    return all(type(n) is int and 0 <= n < 1 << 62 for n in xs)


def _name(ref: dict[str, Any]) -> str:
    """The tensor name in ``ref``, the value a tensor is written as (:func:`_names_another` checked it)."""
    tag = next(iter(ref))
    return ref[TENSOR] if tag == TENSOR else ref[tag][0][TENSOR]


def _same_bytes(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` (one dtype and shape) hold the same bytes, element by element in their own
    layouts: compared as integers of the element's size (NaNs by their bits), with no copy of a strided one."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None:  # (16-byte elements: as bytes, each side made contiguous)
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a.view(ints), b.view(ints))


def _names_another(ref: Any, name: Any) -> bool:
    """Whether ``ref`` is the value a tensor is written as (a reference, or a Parameter or requires-grad tag
    holding one) and ``name`` a string naming another tensor."""
    tag = next(iter(ref)) if isinstance(ref, dict) and len(ref) == 1 else None
    if tag in (PARAMETER, GRAD) and isinstance(ref[tag], list) and ref[tag]:
        ref = ref[tag][0]
    return isinstance(ref, dict) and list(ref) == [TENSOR] and isinstance(name, str) and name != ref[TENSOR]


__all__ = ["GRAD", "MAX_BASES", "PARAMETER", "SHARED", "SPAN_SLACK", "TENSOR", "TENSOR_TAGS", "VIEW", "Spans", "TensorPlaces",
           "decode_tensor", "joins_pieces", "spans_hold", "views_ahead"]
