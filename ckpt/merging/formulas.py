"""The per-tensor math of the merge methods (:mod:`ckpt.merging.methods` names them and checks their parameters).

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
  ``t = 0`` / ``t = 1`` return ``x_0`` / ``x_1`` unchanged. Ω is taken over the elements finite in
  both inputs: a NaN or inf stays NaN or inf in the result at its element (as in the other
  methods) and the rest is slerp, not a linear interpolation for want of an angle.

Where a step overflows the compute dtype though no input holds an inf or NaN at that element (two
values near float32's largest, summed; ``2·x_0 − x_1``; ``inf − inf`` or ``0 × inf`` after it), the
result there is inf or NaN. ``linear`` and ``task-arithmetic`` (elementwise: ``MergeMethod.elementwise``),
and the plain average of ``new_tensors="average"`` (``((x_0 + x_1) + …) / n``), compute those elements
again, alone, in float64: the same operations in the same order, each rounded to float64 (for float64
inputs, on inputs scaled by a power of two, and the result scaled back: each rounding as in float64,
its exponent unbounded, and refused where a nonzero input, product or quotient would fall subnormal once scaled), with the weights
the compute dtype's math took (:func:`weights_in`); the result is rounded to the compute dtype, then cast back as any other.
Every other element keeps the bytes of the order above. ``ties``, ``dare`` and ``slerp`` do not (an
element's result depends on the whole tensor): an inf there is past the range, and a NaN is refused
(:func:`ckpt.merging.computing.cast_back`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def weights_in(p: Mapping[str, Any], dtype: torch.dtype) -> list[float]:
    """The weights of ``linear`` and ``task-arithmetic`` as their math in the compute dtype ``dtype`` uses them:
    normalised in float64 where ``p["normalize"]`` says, then each rounded to ``dtype`` (torch rounds a Python
    scalar to a float32 tensor's dtype: the float32 math multiplies by these). The elements computed again in
    float64 (:func:`ckpt.merging.overflowing.computed_again`) take the same ones, so that each operation is the
    float32 order's own."""
    import torch

    ws = list(p["weights"])
    if p.get("normalize", False):
        total = math.fsum(ws)
        ws = [w / total for w in ws]
    return torch.tensor(ws, dtype=torch.float64).to(dtype).tolist()


def _weighted_sum(terms: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``((w_0·t_0 + w_1·t_1) + …)`` in place on ``terms``; each step rounded on its own."""
    acc = terms[0].mul_(weights[0])
    for t, w in zip(terms[1:], weights[1:]):
        acc.add_(t.mul_(w))
    return acc


def merge_linear(xs: list[torch.Tensor], base: torch.Tensor | None, p: Mapping[str, Any], name: str) -> torch.Tensor:
    return _weighted_sum(xs, weights_in(p, xs[0].dtype))


def merge_task_arithmetic(xs: list[torch.Tensor], base: torch.Tensor | None, p: Mapping[str, Any], name: str) -> torch.Tensor:
    assert base is not None
    return _weighted_sum([x.sub_(base) for x in xs], weights_in(p, base.dtype)).add_(base)


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
    """(a·a, b·b, a·b) in float64 over the elements finite in both, over small blocks (little
    scratch memory); of ``a`` and ``b`` times ``scale``, a power of two, where float64 values past
    1.3e154 overflow them (slerp needs their ratios only: at any scale, the same)."""
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    aa, bb, ab = [], [], []
    for i in range(0, fa.numel(), block):
        x, y = fa[i : i + block].double(), fb[i : i + block].double()  # (copies)
        odd = x.isfinite().logical_and_(y.isfinite()).logical_not_()
        if bool(odd.any()):  # a NaN or inf has no angle: one dot product of NaN made every element linear
            x.masked_fill_(odd, 0.0)
            y.masked_fill_(odd, 0.0)
        if scale != 1.0:
            x, y = x * scale, y * scale
        aa.append(float(torch.dot(x, x)))
        bb.append(float(torch.dot(y, y)))
        ab.append(float(torch.dot(x, y)))
    try:
        dots = math.fsum(aa), math.fsum(bb), math.fsum(ab)
    except OverflowError:  # (fsum of sums each in range, their total not)
        dots = (math.inf,) * 3
    if scale == 1.0 and not all(map(math.isfinite, dots)):
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
