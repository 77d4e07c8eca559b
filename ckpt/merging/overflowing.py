"""Elements whose math overflowed the compute dtype though no input held an inf or NaN, computed again in float64
(:func:`computed_again`, for :func:`ckpt.merging.computing.cast_back`), and what tells them: where the inputs hold
an inf or NaN (:func:`mark_nonfinite`). The order each method's math runs in: :mod:`ckpt.merging.formulas`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckpt.merging.formulas import weights_in
from ckpt.merging.methods import MergeMethod

if TYPE_CHECKING:
    import torch

AGAIN_BLOCK = 1 << 16  # elements computed again at a time


def computed_again(f: Callable[[list[torch.Tensor]], torch.Tensor], pieces: Iterable[list[torch.Tensor]], mask: torch.Tensor,
                   cd: torch.dtype) -> torch.Tensor:
    """``f`` (a merge's elementwise math, on copies it may consume) at the elements ``mask`` marks (where the math
    overflowed in the compute dtype ``cd``), computed again in float64 from ``pieces``: the inputs' values there
    (1-D, in their dtype), a piece of the elements at a time, in order. The same operations in the same order, each
    rounded to float64, whose range float32 values times weights within float32's range cannot leave. Float64
    inputs can: for them the parts are scaled by 2^-k and the result by 2^k, for the least k of 1, 2, 4, … 1024 at
    which the math is finite (k = 0 is the math that overflowed). Scaling by a power of two is exact and the math is
    homogeneous (``f(s·x) = s·f(x)``: sums, differences, products by constant weights), so each operation rounds as
    it did, as if float64's exponent had no bound, except where a term becomes subnormal or zero once scaled
    (float64's subnormals lose bits; 1e-300 beside 2^1000 − 2^1000 would vanish): such an element is not
    computed. A result past float64's range is inf; NaN where not computed. Returned rounded to ``cd`` (inf past
    its range), on the mask's device; a block of elements at a time (a few small scratch tensors)."""
    import torch

    out = torch.full((int(mask.sum()),), math.nan, dtype=cd, device=mask.device)
    at = 0
    for parts in pieces:
        n = parts[0].numel()
        for start in range(0, n, AGAIN_BLOCK):
            block = [p[start : start + AGAIN_BLOCK].to(mask.device, torch.float64) for p in parts]  # (copies: f consumes)
            todo = torch.ones(block[0].shape, dtype=torch.bool, device=mask.device)
            k = 0 if cd != torch.float64 else 1
            while k <= 1024 and bool(todo.any()):
                where = todo.nonzero().squeeze(1)
                lost = None  # where a nonzero term scaled falls below float64's least normal value (it loses bits)
                if k:
                    lost = torch.zeros(where.shape, dtype=torch.bool, device=mask.device)
                    for b in block:
                        v = b[where]
                        lost.logical_or_(v.abs().lt(2.0 ** (k - 1022)).logical_and_(v.ne(0)))
                scaled = [b[where].mul_(2.0**-k) for b in block]
                r = f(scaled)
                fine = r.isfinite()
                if lost is not None:
                    fine.logical_and_(lost.logical_not())
                    todo[where[lost]] = False  # (a larger k loses more)
                # scaled back in two steps: 2^1024 is past float64's range (a product past it is inf, as it should be)
                out[at + start + where[fine]] = r[fine].mul_(2.0 ** (k // 2)).mul_(2.0 ** (k - k // 2)).to(cd)
                todo[where[fine]] = False
                k = max(1, 2 * k)
        at += n
    return out


def mark_nonfinite(x: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor | None:
    """``held`` (where the inputs before ``x`` hold an inf or NaN; None: nowhere) with ``x``'s added: inputs
    (in the compute dtype) are marked one at a time, and a mask made only once one holds an inf or NaN
    (an aminmax each before, no scratch). :func:`cast_back` tells by it an input's inf, which stays
    inf, from one the math made past the compute dtype's range (bfloat16's range is nearly float32's:
    a bfloat16 merge past it overflows there first)."""
    import torch

    if x.numel() and not all(math.isfinite(float(v)) for v in torch.aminmax(x)):
        bad = x.isfinite().logical_not_()
        return bad if held is None else held.logical_or_(bad)
    return held


def plain_average(xs: Sequence[torch.Tensor], cd: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain average of ``xs`` in the compute dtype ``cd``, summed in input order (a new tensor:
    ``xs`` are left as they are), and where they hold an inf or NaN (:func:`mark_nonfinite`)."""
    acc = xs[0].to(cd, copy=True)
    held = mark_nonfinite(acc, None)
    for x in xs[1:]:
        y = x.to(cd)
        held = mark_nonfinite(y, held)
        acc.add_(y)
    return acc.div_(len(xs)), held


Pieces = Callable[["torch.Tensor"], Iterable[list["torch.Tensor"]]]


def masked_pieces(xs: Sequence[torch.Tensor]) -> Pieces:
    """For :func:`computed_again`: the values of tensors ``xs`` (in memory) at a mask, a block of the mask at a time."""
    def pieces(mask: torch.Tensor) -> Iterator[list[torch.Tensor]]:
        flat, flats = mask.reshape(-1), [x.reshape(-1) for x in xs]
        for at in range(0, flat.numel(), AGAIN_BLOCK):
            m = flat[at : at + AGAIN_BLOCK]
            if bool(m.any()):
                yield [f[at : at + AGAIN_BLOCK][m] for f in flats]
    return pieces


def average_again(xs: Sequence[torch.Tensor], cd: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """For :func:`cast_back`: :func:`plain_average` of ``xs`` computed again where it overflowed."""
    import torch

    pieces = masked_pieces(xs)
    return lambda mask: computed_again(lambda ys: plain_average(ys, torch.float64)[0], pieces(mask), mask, cd)


def method_again(method: MergeMethod, params: Mapping[str, Any], name: str, with_base: bool, cd: torch.dtype,
                 pieces: Pieces) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For :func:`cast_back`: ``method``'s math computed again at a mask, from ``pieces(mask)`` (the inputs' values
    there, and the base's last where ``with_base``, a piece at a time); None where the method is not elementwise
    (it cannot be). Its weights are those of the math in ``cd`` (:func:`weights_in`), not float64's own."""
    if not method.elementwise:
        return None
    same = {**params, "weights": weights_in(params, cd), "normalize": False}

    def math_of(ys: list[torch.Tensor]) -> torch.Tensor:
        return method.combine(ys[:-1], ys[-1], same, name) if with_base else method.combine(ys, None, same, name)

    return lambda mask: computed_again(math_of, pieces(mask), mask, cd)
