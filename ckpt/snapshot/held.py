"""The modules and optimizers a state holds, Stateful wrappers looked into: whose parameters a save trusts by version.

A save reuses a tensor unread where its address and version counter say it is unchanged, and only where it is a
parameter or optimizer state (:func:`~ckpt.snapshot.state.version_trusted`). Those are found in the state's values and,
through the wrapper DCP's docs teach (``AppState`` holding the model and the optimizer) or
:class:`~ckpt.snapshot.state.PerRank`, in what a
Stateful value holds: read as stored, without running the objects' code, bounded and cycle-safe.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

from ckpt.snapshot.state import Stateful, unwrapped_optimizer

__all__ = ["held_in"]


# Objects (and containers) deep, the state's value the first: PerRank(AppState) -> its list -> the modules in it
_HELD_DEPTH = 3
_HELD_ITEMS = 256  # items of one dict, list or tuple looked at, at most (the first: what lies further goes unfound)
_HELD_LOOKS = 4096  # attributes and items looked at per state value, at most
_PLAIN = frozenset({int, float, bool, str, bytes, type(None)})  # (nothing held in them: not looked into)


def held_in(state: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The modules and optimizers (unwrapped: :func:`~ckpt.snapshot.state.optimizers_in`) of ``state``: its values,
    and those that a Stateful value holds (DCP's ``AppState``, :class:`~ckpt.snapshot.state.PerRank`) in its instance
    attributes, or in a dict, list or tuple there (its values), and so on in what it holds, up to :data:`_HELD_DEPTH`
    objects and containers deep. Read as stored, never through the objects' code (no property, method or
    ``__getattr__`` runs: an object whose class makes up its ``__dict__`` is not looked into); each object once
    (cycles); the first :data:`_HELD_ITEMS` items of a container (a huge list), :data:`_HELD_LOOKS` values in all per
    state value. What goes unfound is read at every save (:func:`~ckpt.snapshot.state.version_trusted`), never trusted.

    >>> import torch, ckpt.snapshot.held as s
    >>> class AppState:
    ...     def __init__(self, model, optim): self.model, self.optim = model, optim
    ...     def state_dict(self): return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}
    ...     def load_state_dict(self, sd): ...
    >>> model = torch.nn.Linear(2, 2)
    >>> optim = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> s.held_in({"app": AppState(model, optim)}) == ([model], [optim])
    True
    """
    import torch

    modules: dict[int, Any] = {}
    optimizers: dict[int, Any] = {}

    def take(x: Any) -> bool:
        if issubclass(type(x), torch.nn.Module):  # (type(x): isinstance would ask x for its __class__)
            modules.setdefault(id(x), x)
        elif issubclass(type(x), torch.optim.Optimizer):
            x = unwrapped_optimizer(x)
            optimizers.setdefault(id(x), x)
        else:
            return False
        return True

    for obj in state.values():
        if take(obj) or not isinstance(obj, Stateful) or isinstance(obj, type):
            continue
        seen: set[int] = set()
        looks = [_HELD_LOOKS]

        def values(x: Any) -> list[Any]:
            """At most what ``looks`` has left of ``x``'s items (a container's) or attributes (an object's), read through
            the built-in types' own iterators (not a subclass's ``__iter__`` or ``values()``)."""
            kind, most = type(x), min(looks[0], _HELD_ITEMS)
            if issubclass(kind, dict):
                found = iter(dict.values(x))
            elif issubclass(kind, list):
                found = list.__iter__(x)
            elif issubclass(kind, tuple):
                found = tuple.__iter__(x)
            elif (attributes := _instance_dict(x)) is not None:
                found, most = iter(dict.values(attributes)), looks[0]
            else:
                return []
            try:
                got = list(itertools.islice(found, max(most, 0)))
            except RuntimeError:  # (changed by another thread meanwhile)
                return []
            looks[0] -= len(got)
            return got

        def visit(x: Any, depth: int) -> None:
            seen.add(id(x))
            for v in values(x):
                if type(v) not in _PLAIN and not take(v) and depth < _HELD_DEPTH and id(v) not in seen:
                    visit(v, depth + 1)

        visit(obj, 1)
    return list(modules.values()), list(optimizers.values())


def _instance_dict(x: Any) -> dict[str, Any] | None:
    """``x``'s instance attributes (``vars(x)``) where its class keeps them as Python does (not a property of its own,
    nor a module's namespace); read without running its code."""
    for klass in type(x).__mro__:
        slot = klass.__dict__.get("__dict__")
        if slot is not None:
            if type(slot) is not types.GetSetDescriptorType:
                return None
            d = slot.__get__(x)
            return d if type(d) is dict else None
    return None

