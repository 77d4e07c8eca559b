"""Merge methods: the per-tensor math, and a registry that names each method and declares its parameters.

Every method is a pure function ``combine(inputs, base, params, name) -> tensor`` over
tensors already in the compute dtype (float32; float64 for float64 inputs). The
tensors are the caller's own copies: the math works in place on them, which is what
keeps a merge at about (inputs + 2) tensors of memory. ``name`` (the tensor's name)
only seeds DARE's random masks, so that each tensor's mask depends on the seed and
the tensor, not on the order tensors are processed in.

Summation order (it fixes every rounding, so results are reproducible bit for bit):

* ``linear``: weights are normalised in float64 (``w_i / fsum(w)``, unless
  ``normalize=false``), each ``w_i`` rounds to the compute dtype, and
  ``out = ((w_0·x_0 + w_1·x_1) + w_2·x_2) + …``, each product and sum rounded on its own (no FMA).
* ``task-arithmetic``: ``d_i = λ_i·(x_i − base)``, ``s = ((d_0 + d_1) + d_2) + …``, ``out = s + base``.
* ``ties``: ``d_i = w_i·(x_i − base)``; trim each ``d_i`` to the elements with
  ``|d_i| ≥`` its k-th largest magnitude, ``k = ceil(density·numel)`` (elements tied at
  the threshold are all kept; NaN counts as the largest); elected sign ``σ = sign(((d_0 + d_1) + …))``; with
  ``a_i = [sign(d_i) = σ and d_i ≠ 0]``: ``num = Σ a_i·d_i``, ``den = Σ a_i·w_i`` (same
  order), ``τ = num / den`` (0 where ``den = 0``; ``τ = num`` with ``normalize=false``; NaN
  where the sum is NaN: no sign to elect),
  ``out = λ·τ + base``.
* ``dare``: ``d_i = (x_i − base)·m_i / density`` where ``m_i`` keeps each element with
  probability ``density`` (``torch.rand < density`` from a CPU generator seeded with
  :func:`dare_seed`), then ``linear`` combine: ``out = λ·((w_0·d_0 + w_1·d_1) + …) + base``,
  or ``ties`` combine: the TIES sign election and mean above on ``w_i·d_i``, untrimmed.
* ``slerp``: ``out = c_0·x_0 + c_1·x_1`` with ``c_0 = sin((1−t)Ω)/sin Ω``,
  ``c_1 = sin(tΩ)/sin Ω``, Ω the angle between the flattened tensors (float64
  dot products); linear interpolation when ``sin Ω < 1e-6`` or a norm is 0;
  ``t = 0`` / ``t = 1`` return ``x_0`` / ``x_1`` unchanged.

The registry is built explicitly (:func:`default_registry`); nothing registers itself
on import, and registering a name twice is an error.

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


# -- the math ----------------------------------------------------------------------------------


def _weighted_sum(terms: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``((w_0·t_0 + w_1·t_1) + …)`` in place on ``terms``; each step rounded on its own."""
    acc = terms[0].mul_(weights[0])
    for t, w in zip(terms[1:], weights[1:]):
        acc.add_(t.mul_(w))
    return acc


def merge_linear(xs: list[torch.Tensor], base: torch.Tensor | None, p: Mapping[str, Any], name: str) -> torch.Tensor:
    ws = list(p["weights"])
    if p["normalize"]:
        total = math.fsum(ws)
        ws = [w / total for w in ws]
    return _weighted_sum(xs, ws)


def merge_task_arithmetic(xs: list[torch.Tensor], base: torch.Tensor | None, p: Mapping[str, Any], name: str) -> torch.Tensor:
    assert base is not None
    return _weighted_sum([x.sub_(base) for x in xs], p["weights"]).add_(base)


def trim_(d: torch.Tensor, density: float) -> torch.Tensor:
    """Zero every element of ``d`` below its k-th largest magnitude, ``k = ceil(density·numel)``."""
    n = d.numel()
    k = math.ceil(density * n)
    if n == 0 or k >= n:
        return d
    # The k-th largest magnitude, found by partitioning one scratch copy in place
    # (torch.kthvalue/topk would add a copy with int64 indices: 3x the tensor).
    mag = d.abs().reshape(-1).numpy()
    mag.partition(n - k)
    threshold = float(mag[n - k])
    del mag
    if math.isnan(threshold):  # NaN sorts above every number: the k largest are all NaN (compared to
        return d.masked_fill_(d.isnan().logical_not_(), 0)  # a NaN threshold, nothing was trimmed at all)
    return d.masked_fill_(d.abs() < threshold, 0)


def ties_combine(ds: list[torch.Tensor], weights: Sequence[float], normalize: bool,
                 block: int = 1 << 16) -> torch.Tensor:
    """Sign election and disjoint (weighted) mean of deltas ``ds`` already scaled by their weights.

    Works in place, a block of elements at a time: every step is elementwise, so the
    sums, masks and counts live in block-sized scratch (in cache) and each block's
    result overwrites ``ds[0]``'s block once all the inputs' blocks are read. The merge
    thus holds no tensor-sized temporary beyond its inputs; the ``ds`` are consumed.
    """
    import torch

    flat = [d.reshape(-1) for d in ds]  # views of contiguous tensors (a copy otherwise)
    out = flat[0]
    for start in range(0, out.numel(), block):
        part = [f[start : start + block] for f in flat]
        total = part[0].clone()
        for d in part[1:]:
            total.add_(d)
        pos, neg = total > 0, total < 0  # the elected sign (neither where the sum is 0)
        # Where the sum is NaN (a NaN, or +inf against -inf) there is no sign to elect: the result is NaN, as
        # task-arithmetic's sum is there, never the base as if no input had changed the element.
        undefined = total.isnan()
        num = total.zero_()  # reuse the buffer
        den = torch.zeros_like(num) if normalize else None
        for d, w in zip(part, weights):
            agree = ((d > 0) & pos).logical_or_((d < 0) & neg)
            if den is not None:
                den.add_(agree, alpha=w)  # exact: adds w or 0
            num.add_(d.masked_fill_(agree.logical_not_(), 0))
        if den is not None:
            num.div_(den.masked_fill_(den == 0, 1.0))  # where no input agrees num is 0: the result is 0
        part[0].copy_(num.masked_fill_(undefined, math.nan))
    return out.view(ds[0].shape)


def merge_ties(xs: list[torch.Tensor], base: torch.Tensor | None, p: Mapping[str, Any], name: str) -> torch.Tensor:
    assert base is not None
    ds = [trim_(x.sub_(base).mul_(w), p["density"]) for x, w in zip(xs, p["weights"])]
    return ties_combine(ds, p["weights"], p["normalize"]).mul_(p["lambda"]).add_(base)


def dare_seed(seed: int, name: str, index: int) -> int:
    """The generator seed of input ``index``'s mask for tensor ``name``: 63 bits of BLAKE3."""
    import blake3

    return int.from_bytes(blake3.blake3(f"{seed}\0{name}\0{index}".encode()).digest()[:8], "little") >> 1


def dare_mask(shape: Sequence[int], density: float, seed: int) -> torch.Tensor:
    """Bernoulli(density) keep-mask: ``torch.rand(shape) < density`` from a CPU generator seeded with ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.rand(tuple(shape), generator=g) < density


def merge_dare(xs: list[torch.Tensor], base: torch.Tensor | None, p: Mapping[str, Any], name: str) -> torch.Tensor:
    assert base is not None
    density = p["density"]
    ds = []
    for i, x in enumerate(xs):
        d = x.sub_(base)
        if density < 1.0:
            d.mul_(dare_mask(d.shape, density, dare_seed(p["seed"], name, i))).div_(density)
        ds.append(d)
    if p["combine"] == "ties":
        tau = ties_combine([d.mul_(w) for d, w in zip(ds, p["weights"])], p["weights"], True)
    else:
        tau = _weighted_sum(ds, p["weights"])
    return tau.mul_(p["lambda"]).add_(base)


def _dots(a: torch.Tensor, b: torch.Tensor, block: int = 1 << 16, scale: float = 1.0) -> tuple[float, float, float]:
    """(a·a, b·b, a·b) in float64, over small blocks (little scratch memory); of ``a`` and ``b``
    times ``scale``, a power of two, where float64 values past 1.3e154 overflow them (slerp needs
    their ratios only: at any scale, the same)."""
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    aa, bb, ab = [], [], []
    for i in range(0, fa.numel(), block):
        x, y = fa[i : i + block].double(), fb[i : i + block].double()
        if scale != 1.0:
            x, y = x * scale, y * scale
        aa.append(float(torch.dot(x, x)))
        bb.append(float(torch.dot(y, y)))
        ab.append(float(torch.dot(x, y)))
    try:
        dots = math.fsum(aa), math.fsum(bb), math.fsum(ab)
    except OverflowError:  # (fsum of sums each in range, their total not)
        dots = (math.inf,) * 3
    if scale == 1.0 and not all(map(math.isfinite, dots)) and bool(torch.isfinite(fa).all() and torch.isfinite(fb).all()):
        return _dots(a, b, block, 2.0**-600)  # finite values whose squares overflow (an angle of NaN: no slerp)
    return dots


def merge_slerp(xs: list[torch.Tensor], base: torch.Tensor | None, p: Mapping[str, Any], name: str) -> torch.Tensor:
    a, b = xs
    t = p["t"]
    if t == 0.0:
        return a
    if t == 1.0:
        return b
    aa, bb, ab = _dots(a, b)
    na, nb = math.sqrt(aa), math.sqrt(bb)
    c0, c1 = 1.0 - t, t
    if na > 0 and nb > 0:
        omega = math.acos(max(-1.0, min(1.0, ab / (na * nb))))
        s = math.sin(omega)
        if s >= 1e-6:
            c0, c1 = math.sin((1.0 - t) * omega) / s, math.sin(t * omega) / s
    return a.mul_(c0).add_(b.mul_(c1))


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
    merge_linear, identity=lambda p: bool(p["normalize"]) or _weight_sum(p["weights"]) == 1.0, min_inputs=1, check=_check_linear)
TASK_ARITHMETIC = MergeMethod(
    "task-arithmetic", "base + Σ λ_i (input_i − base)",
    (Param("weights", "floats", None, "λ_i: scale of each input's task vector"),),
    merge_task_arithmetic, identity=_always, needs_base=True, min_inputs=1, check=_check_scale)
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
