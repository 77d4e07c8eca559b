"""Merge methods: a registry that names each method, declares its parameters and checks them.

Each method's per-tensor math, and the order its sums run in, is in :mod:`ckpt.merging.formulas`.
The registry is built explicitly (:func:`default_registry`); nothing registers itself on import,
and registering a name twice is an error.

>>> reg = default_registry()
>>> reg.names()
['linear', 'task-arithmetic', 'ties', 'dare', 'slerp']
>>> reg.get("ties").bind({"density": "0.5"}, n_inputs=2, has_base=True)["density"]
0.5
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.errors import InvalidMergeError
from ckpt.merging.formulas import merge_dare, merge_linear, merge_slerp, merge_task_arithmetic, merge_ties

if TYPE_CHECKING:
    import torch

_HINT = "see `ckpt merge --list-methods`"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


# -- parameters --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One parameter of a method: its name, type, default, valid range and help.

    ``kind`` is ``float``, ``int``, ``bool``, ``choice`` or ``floats`` (one float per
    input; the default ``None`` means 1.0 each). ``low``/``high`` bound numbers
    (``low_open``/``high_open`` exclude the bound itself). CLI strings are parsed
    (``"0.5"``, ``"true"``, ``"1,0.5"``).
    """

    name: str
    kind: str
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    def range_text(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bool":
            return "true or false"
        if self.low is None and self.high is None:
            return "any" if self.kind != "floats" else "one per input"
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        text = f"{'(' if self.low_open or self.low is None else '['}{lo}, {hi}{')' if self.high_open or self.high is None else ']'}"
        return f"{text}, one per input" if self.kind == "floats" else text

    def default_text(self) -> str:
        if self.kind == "floats" and self.default is None:
            return "1.0 each"
        return str(self.default).lower() if self.kind == "bool" else str(self.default)

    def parse(self, value: Any, n_inputs: int, method: str) -> Any:
        """``value`` checked (and parsed from a string) into this parameter's type; raises InvalidMergeError."""
        where = f"{method}: parameter {self.name}"
        if self.kind == "floats":
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise InvalidMergeError(f"{where} takes one number per input, got {value!r}", hint=_HINT)
            if len(items) != n_inputs:
                raise InvalidMergeError(f"{where} has {len(items)} values for {n_inputs} inputs", hint="give one per input, e.g. 1,0.5")
            return [self._number(x, float, where) for x in items]
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            raise InvalidMergeError(f"{where} must be true or false, got {value!r}", hint=_HINT)
        if self.kind == "choice":
            if value not in self.choices:
                raise InvalidMergeError(f"{where} must be one of {', '.join(self.choices)}, got {value!r}", hint=_HINT)
            return value
        return self._number(value, int if self.kind == "int" else float, where)

    def _number(self, value: Any, typ: type, where: str) -> Any:
        try:
            if isinstance(value, bool) or (typ is int and isinstance(value, float)):
                raise ValueError
            x = typ(value.strip()) if isinstance(value, str) else typ(value)
        except (TypeError, ValueError):
            raise InvalidMergeError(f"{where} must be {'an integer' if typ is int else 'a number'}, got {value!r}", hint=_HINT) from None
        except OverflowError:  # float() of an integer past any float (10**400)
            raise InvalidMergeError(f"{where} must be finite, got a number too large for a float", hint=_HINT) from None
        if typ is float and not math.isfinite(x):  # (an int is finite however large: isfinite() of 10**400 overflows)
            raise InvalidMergeError(f"{where} must be finite, got {value!r}", hint=_HINT)
        below = self.low is not None and (x <= self.low if self.low_open else x < self.low)
        above = self.high is not None and (x >= self.high if self.high_open else x > self.high)
        if below or above:
            got = f"{x:g}" if typ is float else str(x)  # (an int past any float cannot be formatted with :g)
            raise InvalidMergeError(f"{where} must be in {self.range_text().removesuffix(', one per input')}, got {got}", hint=_HINT)
        return x


@dataclass(frozen=True)
class MergeMethod:
    """A named merge: its math, its parameters and how many inputs it takes."""

    name: str
    summary: str
    params: tuple[Param, ...]
    combine: Callable[[list[torch.Tensor], torch.Tensor | None, Mapping[str, Any], str], torch.Tensor]
    # True when merging identical inputs (and an identical base) gives them back
    # unchanged for these parameters: such tensors are reused without being read.
    identity: Callable[[Mapping[str, Any]], bool]
    needs_base: bool = False
    # True when each output element is the same function of the inputs' (and the base's) element, homogeneous
    # (sums and differences times constant weights: f(s·x) = s·f(x)): elements whose math overflowed are then
    # computed again in float64 (:func:`~ckpt.merging.overflowing.computed_again`), not refused.
    elementwise: bool = False
    min_inputs: int = 1
    max_inputs: int | None = None
    # Checks that involve several parameters: returns what is wrong, or None.
    check: Callable[[Mapping[str, Any]], str | None] | None = None

    def bind(self, params: Mapping[str, Any] | None, n_inputs: int, has_base: bool) -> dict[str, Any]:
        """Every parameter's value (given or default), validated. Raises InvalidMergeError."""
        given = dict(params or {})
        known = {p.name for p in self.params}
        unknown = sorted(set(given) - known)
        if unknown:
            raise InvalidMergeError(f"{self.name} has no parameter {', '.join(unknown)}; it takes {', '.join(sorted(known)) or 'none'}", hint=_HINT)
        if n_inputs < self.min_inputs or (self.max_inputs is not None and n_inputs > self.max_inputs):
            want = str(self.min_inputs) if self.max_inputs == self.min_inputs else f"at least {self.min_inputs}" + (
                f" and at most {self.max_inputs}" if self.max_inputs is not None else "")
            raise InvalidMergeError(f"{self.name} takes {want} inputs, got {n_inputs}")
        if self.needs_base and not has_base:
            raise InvalidMergeError(f"{self.name} needs a base checkpoint", hint="pass --base REF (the model the inputs were fine-tuned from)")
        out: dict[str, Any] = {}
        for p in self.params:
            if p.name in given:
                out[p.name] = p.parse(given[p.name], n_inputs, self.name)
            else:
                out[p.name] = [1.0] * n_inputs if p.kind == "floats" and p.default is None else p.default
        problem = self.check(out) if self.check is not None else None
        if problem:
            raise InvalidMergeError(f"{self.name}: {problem}", hint=_HINT)
        return out


class MethodRegistry:
    """Merge methods by name. Built explicitly; a second method of the same name is refused."""

    def __init__(self, methods: Iterable[MergeMethod] = ()) -> None:
        self._methods: dict[str, MergeMethod] = {}
        for m in methods:
            self.register(m)

    def register(self, method: MergeMethod) -> None:
        if method.name in self._methods:
            raise InvalidMergeError(f"a merge method named {method.name!r} is already registered",
                                    hint="choose another name; methods are never silently replaced")
        self._methods[method.name] = method

    def get(self, name: str) -> MergeMethod:
        try:
            return self._methods[name]
        except KeyError:
            raise InvalidMergeError(f"unknown merge method {name!r}; known: {', '.join(self._methods)}", hint=_HINT) from None

    def names(self) -> list[str]:
        return list(self._methods)

    def __iter__(self) -> Iterator[MergeMethod]:
        return iter(self._methods.values())

    def __contains__(self, name: object) -> bool:
        return name in self._methods


def describe(method: MergeMethod) -> str:
    """A few lines for ``--list-methods``: summary, inputs, then one line per parameter."""
    inputs = f"{method.min_inputs}" if method.max_inputs == method.min_inputs else f"{method.min_inputs}+"
    lines = [f"{method.name}: {method.summary}",
             f"  inputs: {inputs}{'; needs --base' if method.needs_base else ''}"]
    for p in method.params:
        lines.append(f"  {p.name} ({p.kind}, {p.range_text()}; default {p.default_text()}): {p.help}")
    return "\n".join(lines)


# -- the built-in methods ----------------------------------------------------------------------

_WEIGHTS = Param("weights", "floats", None, "weight of each input, in input order")
_LAMBDA = Param("lambda", "float", 1.0, "scale of the merged task vector added to the base", low=0.0)


def _always(p: Mapping[str, Any]) -> bool:
    return True


_F32_MAX = 3.4028234663852886e38  # a weight past it makes every float32 element infinite


def _weight_sum(ws: Sequence[float]) -> float:
    """``math.fsum`` of finite weights, or inf where the sum overflows (fsum raises there)."""
    try:
        return math.fsum(ws)
    except OverflowError:
        return math.inf


def _check_linear(p: Mapping[str, Any]) -> str | None:
    total = _weight_sum(p["weights"])
    if not math.isfinite(total):
        return "the weights' sum is larger than any float: scale them down (only their ratios count when normalised)"
    if not p["normalize"] and max(abs(w) for w in p["weights"]) > _F32_MAX:
        return f"a weight beyond {_F32_MAX:.3g} makes every float32 element infinite: scale the weights down"
    return "weights sum to 0 and cannot be normalised (pass normalize=false)" if p["normalize"] and total == 0 else None


def _check_scale(p: Mapping[str, Any]) -> str | None:
    """Weights and lambda within float32's range (the compute dtype), and so the weights' sum, which ties
    divides by: past it a task vector scaled by a weight is inf (every element inf or NaN, or ties' bare
    RuntimeError), and ties' sum of weights inf (every task vector divided down to 0: the base comes back)."""
    total = _weight_sum([abs(w) for w in p["weights"]])
    if total > _F32_MAX:
        return f"the weights' magnitudes add up to {total:g}, beyond float32's largest number ({_F32_MAX:.3g}): scale them down"
    lam = p.get("lambda", 1.0)
    return f"lambda {lam:g} is beyond float32's largest number ({_F32_MAX:.3g}): scale it down" if abs(lam) > _F32_MAX else None


def _check_dare(p: Mapping[str, Any]) -> str | None:
    if p["combine"] == "ties" and min(p["weights"]) <= 0:
        return "the ties combine needs weights > 0"
    # The kept entries are scaled by 1/density, a weight like any other: past float32's range every one
    # is inf, and where density rounds to 0 in float32 every dropped one is 0/0, NaN.
    if p["density"] < 1 / _F32_MAX:
        return (f"density {p['density']!r} scales the entries it keeps by 1/density, beyond float32's largest "
                f"number ({_F32_MAX:.3g}): give a density of at least {1 / _F32_MAX:.3g}")
    return _check_scale(p)


LINEAR = MergeMethod(
    "linear", "weighted average of the inputs",
    (_WEIGHTS, Param("normalize", "bool", True, "divide the weights by their sum")),
    merge_linear, identity=lambda p: bool(p["normalize"]) or _weight_sum(p["weights"]) == 1.0, min_inputs=1, check=_check_linear,
    elementwise=True)
TASK_ARITHMETIC = MergeMethod(
    "task-arithmetic", "base + Σ λ_i (input_i − base)",
    (Param("weights", "floats", None, "λ_i: scale of each input's task vector"),),
    merge_task_arithmetic, identity=_always, needs_base=True, min_inputs=1, check=_check_scale, elementwise=True)
TIES = MergeMethod(
    "ties", "TIES: trim each task vector to its largest entries, elect a sign per element, average the agreeing ones",
    (Param("density", "float", 0.2, "fraction of each task vector kept (largest magnitudes)", low=0.0, high=1.0, low_open=True),
     Param("weights", "floats", None, "weight of each input's task vector", low=0.0, low_open=True),
     Param("normalize", "bool", True, "divide by the weights of the agreeing inputs (a mean) rather than sum"),
     _LAMBDA),
    merge_ties, identity=_always, needs_base=True, min_inputs=1, check=_check_scale)
DARE = MergeMethod(
    "dare", "DARE: drop task-vector entries at random (keep with probability density), rescale by 1/density, combine",
    (Param("density", "float", 0.5, "probability of keeping each entry", low=0.0, high=1.0, low_open=True),
     Param("combine", "choice", "linear", "how the rescaled task vectors are combined", choices=("linear", "ties")),
     Param("weights", "floats", None, "weight of each input's task vector (ties combine: must be > 0)"),
     _LAMBDA,
     Param("seed", "int", 0, "seed of the random masks (same seed, same result)", low=0)),
    merge_dare, identity=_always, needs_base=True, min_inputs=1, check=_check_dare)
SLERP = MergeMethod(
    "slerp", "spherical interpolation between two inputs, tensor by tensor",
    (Param("t", "float", 0.5, "0 gives the first input, 1 the second", low=0.0, high=1.0),),
    merge_slerp, identity=_always, min_inputs=2, max_inputs=2)

BUILTIN_METHODS: tuple[MergeMethod, ...] = (LINEAR, TASK_ARITHMETIC, TIES, DARE, SLERP)


def default_registry() -> MethodRegistry:
    """A new registry holding the built-in methods (add your own with ``register``)."""
    return MethodRegistry(BUILTIN_METHODS)
