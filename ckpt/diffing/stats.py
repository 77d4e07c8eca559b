"""The statistics of a diff: pure functions of two tensors (:func:`tensor_stats`), and the stored size
of one tensor's bytes as a delta against another's (:func:`delta_bytes`). Used by :mod:`ckpt.diffing.compare`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt.format.dtypes import bit_pattern
from ckpt.format.entries import split_lengths
from ckpt.progress import NullProgress
from ckpt.transfer.pipeline import run_parallel
from ckpt_store.storage.objects import object_id

if TYPE_CHECKING:
    import torch


# Elements per block of the float64 statistics pass: bounds the scratch memory (2 x 8 MiB)
# while keeping the number of small torch calls (each a thread-pool round trip) low.
_BLOCK = 1 << 20
# The squares of float64 values past 1.3e154 overflow: a block holding such values sums its squares
# scaled by 2**-2*_SHIFT (exact: a power of two), and so do the others where one did.
_SHIFT = 600


@dataclass(frozen=True)
class TensorStats:
    """Statistics of ``b - a`` (same shape). Norms are L2 over all elements, in float64.

    ``relative_change`` is ‖b−a‖/‖a‖ and ``cosine`` is a·b/(‖a‖‖b‖). NaN and inf are
    reported as such, never hidden: an element that changed to or from NaN (or inf) makes
    ``max_abs_diff`` and ``relative_change`` NaN (or inf) and counts in ``nonfinite``.
    Elements whose bits did not change contribute 0 to ``b - a``, so a NaN that stays
    where it was is not a change. ``relative_change`` is None where it is undefined
    (‖a‖ = 0 with a change); ``cosine`` is None where undefined or not finite.
    """

    changed_elements: int
    relative_change: float | None
    max_abs_diff: float | None
    cosine: float | None
    norm_a: float
    norm_b: float
    norm_diff: float
    nonfinite: int = 0  # changed elements that are NaN or ±inf in a or in b


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _as_real(t: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.view_as_real(t).reshape(-1) if t.is_complex() else t.reshape(-1)


def _nan_max(x: float, y: float) -> float:
    """max() that keeps a NaN from either side (Python's max(0.0, nan) is 0.0)."""
    return math.nan if math.isnan(x) or math.isnan(y) else max(x, y)


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def _int_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element of real ``x`` that is an integer in [-2**63, 2**64] (any element of an integer
    dtype, a whole float in range) as int64 bits equal to it modulo 2**64, and a mask of where it is."""
    import torch

    if x.dtype == torch.uint64:
        return x.view(torch.int64), torch.ones(x.shape, dtype=torch.bool)
    if _is_integer(x.dtype):
        return x.to(torch.int64), torch.ones(x.shape, dtype=torch.bool)
    f = x.to(torch.float64)  # exact for every float dtype
    ok = torch.isfinite(f) & (f == f.trunc()) & (f >= -(2.0**63)) & (f <= 2.0**64)
    f = torch.where(ok, f, 0.0)
    return torch.where(f >= 2.0**63, f - 2.0**64, f).to(torch.int64), ok  # (f - 2**64 is exact there)


def _integer_difference(xa: torch.Tensor, xb: torch.Tensor, da: torch.Tensor, db: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``xb - xa`` in float64 (``da``, ``db``: their float64 values), exact before its one rounding
    wherever both values are integers (:func:`_int_bits`), so never 0 for two that differ; of the
    float64 values elsewhere. With a mask of where both are integers."""
    import torch

    d = db - da
    sa, oka = _int_bits(xa)
    sb, okb = _int_bits(xb)
    # The bits' difference in two halves (no overflow): the values' difference modulo 2**64, and so the
    # values' own give or take multiples of 2**64, which the float64 difference (off by far less)
    # decides; added to the high half, so that the sum is rounded once.
    high, low = (sb >> 32).sub(sa >> 32), (sb & 0xFFFFFFFF).sub(sa & 0xFFFFFFFF).to(torch.float64)
    wraps = torch.round((d - (high.to(torch.float64) * 2.0**32 + low)) / 2.0**64).to(torch.int64)
    exact = high.add(wraps * 2**32).to(torch.float64) * 2.0**32 + low
    both = oka & okb
    d[both] = exact[both]
    return d, both


def tensor_stats(a: torch.Tensor, b: torch.Tensor, *, block: int = _BLOCK) -> TensorStats:
    """Change statistics of ``b`` against ``a`` (same shape; dtypes may differ).

    An element is *changed* when its bit pattern differs (same dtype) or its value
    differs (different dtypes). Sums run in float64 over blocks of ``block`` elements,
    so the scratch memory is a few blocks whatever the tensor size.

    >>> import torch
    >>> s = tensor_stats(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]))
    >>> s.changed_elements, s.relative_change, s.max_abs_diff, s.cosine
    (1, 0.8, 4.0, 0.6)
    >>> s = tensor_stats(torch.tensor([3.0, 4.0]), torch.tensor([3.0, float("nan")]))
    >>> s.max_abs_diff, s.relative_change, s.nonfinite
    (nan, nan, 1)
    """
    import torch

    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    same_dtype = a.dtype == b.dtype
    if a.is_complex() != b.is_complex():
        # A real tensor against a complex one (x against x + 0j): as complex both, or their real views
        # (two numbers per complex element) would not line up.
        a, b = a.to(torch.complex128), b.to(torch.complex128)
    # Counted block by block too: a whole-tensor comparison sums a bool tensor through an int64 copy
    # (8 bytes per element: twice a float32 tensor) and across dtypes holds float64 copies of both.
    ea, eb = a.reshape(-1), b.reshape(-1)
    pa, pb = (bit_pattern(ea), bit_pattern(eb)) if same_dtype else (ea, eb)
    changed, sums, mad, nonfinite = 0, [], 0.0, 0  # sums: (a·a, b·b, d·d, whether scaled) per block
    for i in range(0, ea.numel(), block):
        n = ea[i : i + block].numel()
        ra, rb = _as_real(ea[i : i + block]), _as_real(eb[i : i + block])
        da, xb = ra.to(torch.float64), rb.to(torch.float64)  # (exact for every float dtype)
        # rb - ra, a fresh tensor (changed in place below: b is the caller's), never 0 where the values
        # differ: where an integer dtype takes part, exact before its one rounding (in float64 a change
        # of 1 in an integer past 2**53 read as none); two floats need no more (float64 holds both exactly).
        integers = _is_integer(ra.dtype) or _is_integer(rb.dtype)
        db, both = _integer_difference(ra, rb, da, xb) if integers else (xb - da, None)
        if same_dtype:
            changed += int((pa[i : i + block] != pb[i : i + block]).sum())
        else:  # values, exactly (integers as integers, and against floats where the float is whole)
            # elsewhere an integer stands against a value that is none (a fraction, inf, NaN, a float past
            # the integers, which float64 may round an integer up to): different; NaN against NaN is no
            # change (bits cannot be compared across dtypes)
            differs = ~both | (db != 0) if both is not None else (da != xb) & ~(da.isnan() & xb.isnan())
            changed += int(differs.reshape(n, -1).any(dim=1).sum())
        ssa, ssb = float(torch.dot(da, da)), float(torch.dot(xb, xb))
        sd = float(torch.dot(db, db))
        if not math.isfinite(sd):
            # Rare path: a NaN or inf in the block. Unchanged elements (NaN - NaN, inf - inf)
            # are no change; the changed ones that involve NaN/inf are counted and kept.
            same = (bit_pattern(ra) == bit_pattern(rb)) if same_dtype else ((da == xb) | (da.isnan() & xb.isnan()))
            db.masked_fill_(same, 0.0)
            bad = ~(torch.isfinite(da) & torch.isfinite(xb))
            nonfinite += int((bad & ~same).sum())
            sd = float(torch.dot(db, db))
        scaled = not math.isfinite(ssa + ssb + sd) and bool(torch.isfinite(da).all()) and bool(torch.isfinite(xb).all())
        if scaled:  # every value finite, yet a sum of squares past float64's range (or b - a itself)
            k = 2.0**-_SHIFT
            sa_, sb_ = da * k, xb * k
            ds = torch.where(torch.isfinite(db), db * k, sb_ - sa_)
            ssa, ssb, sd = float(torch.dot(sa_, sa_)), float(torch.dot(sb_, sb_)), float(torch.dot(ds, ds))
            del sa_, sb_, ds
        sums.append((ssa, ssb, sd, scaled))
        if db.numel():
            mad = _nan_max(mad, float(db.abs_().max()))
    # Norms at the scale of the blocks (rel and cos are ratios: any scale gives them), and as they are.
    shift = _SHIFT if any(block[3] for block in sums) else 0
    try:
        na, nb, nd = _norms(sums, shift)
    except OverflowError:  # each block's sum within range, their total not (fsum raises)
        shift = _SHIFT
        na, nb, nd = _norms(sums, shift)
    if changed == 0:
        rel: float | None = 0.0
        mad = 0.0
    elif math.isnan(nd) or math.isnan(na):
        rel = math.nan
    else:
        rel = nd / na if na else None  # a change of a zero tensor has no relative size
    # From |b-a|^2 = |a|^2 + |b|^2 - 2 a.b: 1 - cos = (|b-a|^2 - (|a| - |b|)^2) / (2 |a| |b|),
    # which keeps the digits of a tiny change that a.b / (|a| |b|) would round away.
    cos = 1.0 - (nd - abs(na - nb)) * (nd + abs(na - nb)) / (2.0 * na * nb) if na and nb else math.nan
    if math.isfinite(cos):
        cos = max(-1.0, min(1.0, cos))
    return TensorStats(changed, rel, mad, _finite(cos), _ldexp(na, shift), _ldexp(nb, shift), _ldexp(nd, shift), nonfinite)


def _norms(sums: list[tuple[float, float, float, bool]], shift: int) -> tuple[float, float, float]:
    """The three norms of the blocks' sums of squares, at the scale 2**-shift (scaled blocks are already)."""
    a, b, d = (math.sqrt(math.fsum(block[i] if block[3] else math.ldexp(block[i], -2 * shift) for block in sums))
               for i in range(3))
    return a, b, d


def _ldexp(x: float, n: int) -> float:
    """``x * 2**n``, inf past float64's range (math.ldexp raises there)."""
    try:
        return math.ldexp(x, n)
    except OverflowError:
        return math.inf


def delta_bytes(a: bytes | memoryview | None, b: bytes | memoryview, *, chunk_size: int, elem: int,
                a_ids: Sequence[str] | None = None, b_ids: Sequence[str] | None = None,
                known: set[str] | None = None, level: int = 1, min_saving: float = 0.02,
                workers: int = 1) -> int:
    """Bytes the store would write for tensor data ``b`` pushed against ``a`` (or alone).

    ``b`` is cut into chunks of ``chunk_size``; a chunk whose id is in ``known`` (chunks
    the store already has, e.g. all of A's) costs nothing and joins ``known``; the others
    are encoded exactly as push encodes them (``codecs.encode_chunk``), against the
    chunk at the same position of ``a`` when ``a`` has the same length.
    """
    from ckpt.codecs.chunk import encode_chunk

    known = set() if known is None else known
    bv = memoryview(b).cast("B")
    av = memoryview(a).cast("B") if a is not None and len(a) == len(b) else None
    jobs: list[tuple[int, int, str | None]] = []
    pos = 0
    for i, n in enumerate(split_lengths(len(bv), chunk_size)):
        cid = b_ids[i] if b_ids is not None else object_id(bv[pos : pos + n])
        if cid not in known:
            known.add(cid)
            base_id = None
            if av is not None:
                base_id = a_ids[i] if a_ids is not None else object_id(av[pos : pos + n])
            jobs.append((pos, n, base_id))
        pos += n

    def size(job: tuple[int, int, str | None]) -> int:
        p, n, base_id = job
        base = av[p : p + n] if base_id is not None and av is not None else None
        return len(encode_chunk(bv[p : p + n], elem=elem, level=level, min_saving=min_saving,
                                base=base, base_id=base_id).blob)

    return sum(run_parallel(size, jobs, workers, NullProgress(), lambda j: j[1]))
