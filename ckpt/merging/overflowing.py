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


def computed_again(f: Callable[[list[torch.Tensor]], torch.Tensor], pieces: Iterable[Piece], x: torch.Tensor,
                   mask: torch.Tensor, products: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> None:
    """``f`` (a merge's elementwise math, on copies it may consume) at the elements ``mask`` marks (where the math
    overflowed in ``x``'s dtype, the compute dtype), computed again in float64 into ``x`` (contiguous), and their
    marks cleared in ``mask``, from ``pieces``: (a flat position, ``mask`` flat from there, the inputs' values from
    there, in their dtype), a piece at a time. The same operations in the same order (the weights rounded as the
    compute dtype's math rounds them: :func:`method_again`), each rounded to float64, whose range float32 values
    times weights within float32's range cannot leave. Float64 inputs can: for them the parts are scaled by 2^-k and the
    result by 2^k, for the least k of 1, 2, 4, … 1024 at which the math is finite (k = 0 is the math that
    overflowed). Scaling by a power of two is exact and the math is homogeneous (``f(s·x) = s·f(x)``: sums,
    differences, products by constant weights, a division by a count), so each operation rounds as it did, as if
    float64's exponent had no bound, except a product or quotient that falls below float64's least normal value once
    scaled (there float64 keeps fewer bits; a sum or difference that falls there is exact): an input there, a product
    there (``products``: the values of ``f``'s products, unscaled, from the parts: ``w_i·x_i``, ``λ_i·(x_i − base)``),
    or, where ``products`` is None, a result at or below it (``f`` ends in a division: the plain average's). Such an
    element is not computed (1e-300 beside 2^1000 − 2^1000 would vanish; a product rounded there moves the sum
    after it). A result past float64's range is inf; rounded to ``x``'s dtype (inf past its range). Where not
    computed ``x`` keeps the math's value, and ``mask`` its mark; one not computed for losing bits is NaN (the math's
    inf there would be clipped by ``--overflow saturate``, far from its value: a NaN is refused in either mode). A block of elements at a time: a few small scratch
    tensors, none the tensor's size."""
    xf, mf = x.view(-1), mask.view(-1)
    for at, marked, parts in pieces:
        for start in range(0, marked.numel(), AGAIN_BLOCK):
            _again_block(f, marked[start : start + AGAIN_BLOCK], [p[start : start + AGAIN_BLOCK] for p in parts], at + start,
                         xf, mf, products)
        del marked, parts  # (the next piece is read while these would hold this one's chunks)


def _again_block(f: Callable[[list[torch.Tensor]], torch.Tensor], marked: torch.Tensor, parts: list[torch.Tensor],
                 at: int, xf: torch.Tensor, mf: torch.Tensor,
                 products: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None) -> None:
    """:func:`computed_again` of one block of elements (flat position ``at``; ``xf``, ``mf``: ``x`` and ``mask`` flat):
    its scratch is freed when it returns, before the next block's (or piece's) is made."""
    import torch

    normal = 2.0**-1022
    sel = marked.nonzero().squeeze(1)
    if not sel.numel():
        return
    pos = sel + at
    block = [p[sel].to(xf.device, torch.float64) for p in parts]  # (f consumes copies)
    del sel
    todo = torch.ones(pos.shape, dtype=torch.bool, device=xf.device)
    k = 0 if xf.dtype != torch.float64 else 1
    # each element's least nonzero input or product: once, whatever k (a larger k loses more)
    low = least_nonzero(block + (products(block) if products is not None else [])) if k else None
    while k <= 1024 and bool(todo.any()):
        where = todo.nonzero().squeeze(1)
        r = f([b[where].mul_(2.0**-k) for b in block])
        fine = r.isfinite()
        if low is not None:
            lost = low[where].lt(normal * 2.0**k)
            if products is None:  # a quotient at the least normal value may have rounded up to it
                lost.logical_or_(r.abs().le(normal).logical_and_(r.ne(0)))
            fine.logical_and_(lost.logical_not())
            todo[where[lost]] = False  # (a larger k loses more)
            # NaN, refused in either overflow mode: the math's inf kept there, ``saturate`` would clip it to the
            # largest value (an average of 1e-308 stored as 1.8e308)
            xf[pos[where[lost]]] = math.nan
        # scaled back in two steps: 2^1024 is past float64's range (a product past it is inf, as it should be)
        xf[pos[where[fine]]] = r[fine].mul_(2.0 ** (k // 2)).mul_(2.0 ** (k - k // 2)).to(xf.dtype)
        mf[pos[where[fine]]] = False
        todo[where[fine]] = False
        k = max(1, 2 * k)


def least_nonzero(ts: list[torch.Tensor]) -> torch.Tensor:
    """For :func:`computed_again`: elementwise, the least magnitude of ``ts`` (float64, one shape) that is not zero
    (inf where all are)."""
    import torch

    out = torch.full(ts[0].shape, math.inf, dtype=torch.float64, device=ts[0].device)
    for t in ts:
        a = t.abs()
        out = torch.minimum(out, a.masked_fill_(a.eq(0), math.inf))
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


Piece = tuple[int, "torch.Tensor", list["torch.Tensor"]]  # (flat position, the mask from there, the inputs from there)
Pieces = Callable[["torch.Tensor"], Iterable[Piece]]
Again = Callable[["torch.Tensor", "torch.Tensor"], None]


def masked_pieces(xs: Sequence[torch.Tensor]) -> Pieces:
    """For :func:`computed_again`: the values of tensors ``xs`` (in memory) at a mask: one piece, flat views."""
    def pieces(mask: torch.Tensor) -> Iterator[Piece]:
        yield 0, mask.reshape(-1), [x.reshape(-1) for x in xs]
    return pieces


def average_again(xs: Sequence[torch.Tensor]) -> Again:
    """For :func:`cast_back`: :func:`plain_average` of ``xs`` computed again where it overflowed."""
    import torch

    pieces = masked_pieces(xs)  # (its one rounding a scale moves: the division, checked on the result)
    return lambda x, mask: computed_again(lambda ys: plain_average(ys, torch.float64)[0], pieces(mask), x, mask)


def method_again(method: MergeMethod, params: Mapping[str, Any], name: str, with_base: bool, cd: torch.dtype,
                 pieces: Pieces) -> Again | None:
    """For :func:`cast_back`: ``method``'s math computed again at a mask, from ``pieces(mask)`` (the inputs' values
    there, and the base's last where ``with_base``, a piece at a time); None where the method is not elementwise
    (it cannot be). Its weights are those of the math in ``cd`` (:func:`weights_in`), not float64's own."""
    if not method.elementwise:
        return None
    same = {**params, "weights": weights_in(params, cd), "normalize": False}

    def math_of(ys: list[torch.Tensor]) -> torch.Tensor:
        return method.combine(ys[:-1], ys[-1], same, name) if with_base else method.combine(ys, None, same, name)

    def products(ys: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each input's product (``w_i·x_i``; ``λ_i·(x_i − base)`` with a base: not ``λ_i·x_i``, which a
        difference far below the inputs leaves normal): the math of that input alone, its difference from the
        base in its place, the base 0. Of the inputs halved, the product doubled back: ``x_i − base`` can overflow, its
        half cannot (an input below 2^-1021, which halving would round, is refused by itself)."""
        import torch

        hs = [y * 0.5 for y in ys]
        ds = [h - hs[-1] for h in hs[:-1]] + [torch.zeros_like(hs[-1])] if with_base else hs
        n = len(ds) - (1 if with_base else 0)
        return [math_of([d.clone() if i == j else torch.zeros_like(d) for i, d in enumerate(ds)]).mul_(2.0) for j in range(n)]

    return lambda x, mask: computed_again(math_of, pieces(mask), x, mask, products)
