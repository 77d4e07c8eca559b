"""What changed between two checkpoints, tensor by tensor.

Either side is a ref in a store, a local file or directory (anything ``push`` takes),
or a dict of tensors. Tensors whose chunk ids are equal are identical by construction
(a chunk id is the hash of its bytes) and are reported so without reading their data;
the rest are streamed one pair at a time through the lazy reader (small ones read in
batches of up to 1 MiB), so memory stays at about two tensors. The statistics are pure functions of the two tensors
(:func:`tensor_stats`); the stored size of "B as a delta against A" is estimated by
encoding B's chunks against A's with the store's own codecs (:func:`delta_bytes`).

>>> import torch, ckpt
>>> store = ckpt.Store.init("memory://diff-doctest")
>>> w = torch.arange(4, dtype=torch.float32)
>>> _ = store.push({"w": w, "b": torch.ones(2)}, "m/a")
>>> _ = store.push({"w": w * 2, "b": torch.ones(2)}, "m/b")
>>> report = ckpt.diff("m/a", "m/b", store=store)
>>> [(t.name, t.status, t.changed_elements) for t in report.tensors]
[('b', 'identical', 0), ('w', 'changed', 3)]
>>> report.tensors[1].relative_change
1.0
>>> report.summary.identical_unread, report.summary.changed
(1, 1)
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt.diffing.sides import Side, TensorMeta, open_side
from ckpt.format.dtypes import bit_identical, bit_pattern, byte_view, itemsize
from ckpt.format.manifest import split_lengths
from ckpt.format.names import name_selected
from ckpt.progress import NullProgress, Progress, reporting
from ckpt.transfer.pipeline import run_parallel
from ckpt_store.storage.objects import object_id

if TYPE_CHECKING:
    import torch

    from ckpt.store.store import Store

STATUSES = ("identical", "changed", "added", "removed", "shape_changed", "dtype_changed")
SORT_KEYS = ("order", "name", "status", "relative_change", "max_abs_diff", "changed_elements", "cosine", "delta_bytes")
# Elements per block of the float64 statistics pass: bounds the scratch memory (2 x 8 MiB)
# while keeping the number of small torch calls (each a thread-pool round trip) low.
_BLOCK = 1 << 20


# -- statistics: pure functions of two tensors -----------------------------------------------


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
    changed, ssa, ssb, ssd, mad, nonfinite = 0, [], [], [], 0.0, 0
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
        ssa.append(float(torch.dot(da, da)))
        ssb.append(float(torch.dot(xb, xb)))
        sd = float(torch.dot(db, db))
        if not math.isfinite(sd):
            # Rare path: a NaN or inf in the block. Unchanged elements (NaN - NaN, inf - inf)
            # are no change; the changed ones that involve NaN/inf are counted and kept.
            same = (bit_pattern(ra) == bit_pattern(rb)) if same_dtype else ((da == xb) | (da.isnan() & xb.isnan()))
            db.masked_fill_(same, 0.0)
            bad = ~(torch.isfinite(da) & torch.isfinite(xb))
            nonfinite += int((bad & ~same).sum())
            sd = float(torch.dot(db, db))
        ssd.append(sd)
        if db.numel():
            mad = _nan_max(mad, float(db.abs_().max()))
    na, nb, nd = math.sqrt(math.fsum(ssa)), math.sqrt(math.fsum(ssb)), math.sqrt(math.fsum(ssd))
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
    return TensorStats(changed, rel, mad, _finite(cos), na, nb, nd, nonfinite)


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


# -- the report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorDiff:
    """One tensor's record. Statistics are None where they do not apply (added,
    removed or reshaped tensors) or are undefined (see :class:`TensorStats`)."""

    name: str
    status: str  # one of STATUSES
    dtype_a: str | None
    dtype_b: str | None
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    numel: int
    changed_elements: int | None
    relative_change: float | None
    max_abs_diff: float | None
    cosine: float | None
    delta_bytes: int | None  # estimated stored bytes of B's tensor as a delta against A's
    read: bool  # False: decided from the manifests (chunk ids) alone
    nonfinite_elements: int | None = None  # changed elements that are NaN or ±inf in A or B (None: not compared)

    @property
    def nonfinite(self) -> bool:
        """A NaN or inf is part of the change (a diverged fine-tune): such rows sort first."""
        return bool(self.nonfinite_elements) or any(
            v is not None and not math.isfinite(v) for v in (self.max_abs_diff, self.relative_change))

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values: NaN and inf become the strings "nan", "inf", "-inf"
        (JSON has no such numbers), and ``nonfinite`` flags the record."""
        d = {k: _json_number(v) for k, v in asdict(self).items()}
        d["shape_a"] = list(self.shape_a) if self.shape_a is not None else None
        d["shape_b"] = list(self.shape_b) if self.shape_b is not None else None
        d["nonfinite"] = self.nonfinite
        return d


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


@dataclass(frozen=True)
class DiffSummary:
    tensors: int
    identical: int
    identical_unread: int  # identical by chunk ids: no data read
    changed: int
    added: int
    removed: int
    shape_changed: int
    dtype_changed: int
    elements: int  # elements of the tensors compared element by element
    changed_elements: int
    bytes_a: int
    bytes_b: int
    relative_change: float | None  # ‖B−A‖/‖A‖ over every tensor compared element by element (NaN/inf as such)
    delta_bytes: int | None  # stored bytes of B pushed as a delta against A (estimate; None: not estimated)
    nonfinite: int = 0  # tensors whose change involves NaN or inf


@dataclass(frozen=True)
class DiffReport:
    """Per-tensor records (A's order, then tensors only B has) and a summary."""

    a: str
    b: str
    a_id: str | None
    b_id: str | None
    tensors: list[TensorDiff]
    summary: DiffSummary
    options: dict[str, Any] = field(default_factory=dict)

    def select(self, sort: str = "order", top: int | None = None) -> list[TensorDiff]:
        """Records sorted by ``sort`` (one of SORT_KEYS; largest change first, cosine
        smallest first, None last), the first ``top`` of them. By every statistic,
        records whose change involves NaN or inf come first (NaN before inf)."""
        if sort not in SORT_KEYS:
            raise ValueError(f"unknown sort key {sort!r}; one of {', '.join(SORT_KEYS)}")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise ValueError(f"top must be an int >= 1 (or None for every tensor), not {top!r}")
        rows = list(self.tensors)
        if sort == "name":
            rows.sort(key=lambda t: t.name)
        elif sort == "status":
            rows.sort(key=lambda t: STATUSES.index(t.status))
        elif sort != "order":
            sign = 1.0 if sort == "cosine" else -1.0

            def key(t: TensorDiff) -> tuple[int, float]:
                v = getattr(t, sort)
                if isinstance(v, float) and math.isnan(v):
                    return (0, 0.0)
                if t.nonfinite or (isinstance(v, float) and math.isinf(v)):
                    return (1, sign * v if isinstance(v, float) and math.isinf(v) else 0.0)
                return (2, sign * v) if v is not None else (3, 0.0)

            rows.sort(key=key)
        return rows if top is None else rows[:top]

    def to_json(self, sort: str = "order", top: int | None = None) -> dict[str, Any]:
        """``{"a", "b", "tensors": [...], "summary": {...}}``; the summary covers every
        tensor that passed include/exclude, ``tensors`` only the selected ones."""
        return {
            "a": {"ref": self.a, "id": self.a_id},
            "b": {"ref": self.b, "id": self.b_id},
            "tensors": [t.to_json() for t in self.select(sort, top)],
            "summary": {k: _json_number(v) for k, v in asdict(self.summary).items()},
            "options": self.options,
        }


def diff(a: object, b: object, store: Store | None = None, *, include: Sequence[str] | None = None,
         exclude: Sequence[str] | None = None, estimate_delta: bool = True,
         progress: Progress | None = None, refs_only: bool = False) -> DiffReport:
    """Compare checkpoint ``b`` against ``a``, tensor by tensor.

    ``a`` and ``b`` are refs of ``store`` (default: the default store), paths of files
    or directories ``push`` accepts (an existing path wins over a ref of the same name),
    or dicts of tensors. ``include``/``exclude`` are globs on tensor names. With
    ``estimate_delta``, B's changed chunks are encoded against A's with the store's
    codecs to tell what pushing B after A would store. Raises the errors of
    :meth:`Store.reader` and :func:`ckpt.store.sources.open_source` for bad refs or files.
    With ``refs_only``, ``a`` and ``b`` are refs of ``store`` whatever they look like: no
    local file is ever opened (for inputs from untrusted places, like the web view's URLs).
    """
    from ckpt.settings import Settings

    side_a, store = open_side(a, store, refs_only)
    try:
        side_b, store = open_side(b, store, refs_only)
    except BaseException:
        side_a.close()
        raise
    settings = store.settings if store is not None else Settings.from_env()
    # Chunk ids are comparable only when both sides are cut the same way: a stored
    # side dictates the size; a local side is hashed at that size.
    cs = side_b.chunk_size or side_a.chunk_size or settings.chunk_size
    try:
        names = [n for n in side_a.meta if name_selected(n, include, exclude)]
        names += [n for n in side_b.meta if n not in side_a.meta and name_selected(n, include, exclude)]
        known = side_a.all_chunk_ids(cs) if estimate_delta else set()
        rows: list[TensorDiff] = []
        sums = [0.0, 0.0]  # squared norms of A and of B - A over compared tensors
        with reporting(progress, "diff", sum(side_b.meta[n].nbytes for n in names if n in side_b.meta)) as bar:
            for batch in _batches(names, side_a, side_b, cs, estimate_delta):
                # The tensors of a batch are read together (one pass of the read pipeline per side):
                # one by one, 10,000 small tensors paid for 20,000 passes (and on S3 waited for each
                # request in turn). They are compared in order: the estimate's ``known`` grows in order.
                read = [n for n, row in batch if row is None]
                ta = side_a.tensors([n for n in read if n in side_a.meta]) if read else {}
                tb = side_b.tensors(read) if read else {}
                for name, decided in batch:
                    s = None
                    if decided is None:
                        decided, s = _compare(name, side_a, side_b, cs, known, settings, estimate_delta,
                                              ta.pop(name, None), tb.pop(name))
                    if s is not None:
                        sums[0] += s.norm_a**2
                        sums[1] += s.norm_diff**2
                    rows.append(decided)
                    bar.advance(side_b.meta[name].nbytes if name in side_b.meta else 0)
    finally:
        side_a.close()
        side_b.close()
    count = {s: sum(1 for r in rows if r.status == s) for s in STATUSES}
    compared = [r for r in rows if r.changed_elements is not None]
    summary = DiffSummary(
        tensors=len(rows), identical=count["identical"],
        identical_unread=sum(1 for r in rows if r.status == "identical" and not r.read),
        changed=count["changed"], added=count["added"], removed=count["removed"],
        shape_changed=count["shape_changed"], dtype_changed=count["dtype_changed"],
        elements=sum(r.numel for r in compared), changed_elements=sum(r.changed_elements or 0 for r in compared),
        bytes_a=sum(side_a.meta[r.name].nbytes for r in rows if r.name in side_a.meta),
        bytes_b=sum(side_b.meta[r.name].nbytes for r in rows if r.name in side_b.meta),
        relative_change=math.sqrt(sums[1]) / math.sqrt(sums[0]) if sums[0] else (0.0 if not sums[1] else None),
        delta_bytes=sum(r.delta_bytes or 0 for r in rows) if estimate_delta else None,
        nonfinite=sum(1 for r in rows if r.nonfinite),
    )
    return DiffReport(side_a.label, side_b.label, side_a.id, side_b.id, rows, summary,
                      {"include": list(include or []), "exclude": list(exclude or []), "chunk_size": cs})


def _row(name: str, ma: TensorMeta | None, mb: TensorMeta | None, estimate: bool, status: str, numel: int,
         stats: TensorStats | None = None, dbytes: int | None = None, read: bool = True) -> TensorDiff:
    return TensorDiff(name, status, ma.dtype if ma else None, mb.dtype if mb else None,
                      ma.shape if ma else None, mb.shape if mb else None, numel,
                      stats.changed_elements if stats else (0 if status == "identical" else None),
                      stats.relative_change if stats else (0.0 if status == "identical" else None),
                      stats.max_abs_diff if stats else (0.0 if status == "identical" else None),
                      stats.cosine if stats else None,
                      dbytes if estimate else None, read,
                      stats.nonfinite if stats else (0 if status == "identical" else None))


def _decided(name: str, side_a: Side, side_b: Side, cs: int, estimate: bool) -> TensorDiff | None:
    """The record of ``name`` where no tensor data is needed for it (removed, identical by chunk ids,
    added or reshaped without an estimate); None where :func:`_compare` needs B's tensor (and A's)."""
    ma, mb = side_a.meta.get(name), side_b.meta.get(name)
    if mb is None:
        assert ma is not None
        return _row(name, ma, mb, estimate, "removed", math.prod(ma.shape), dbytes=0, read=False)
    numel = math.prod(mb.shape)
    if ma is None:
        # nothing to compare: its data is read only for the estimate
        return None if estimate else _row(name, ma, mb, estimate, "added", numel, read=False)
    if ma.dtype == mb.dtype and ma.shape == mb.shape:
        ids_a, ids_b = side_a.chunk_ids(name, cs), side_b.chunk_ids(name, cs)
        if ids_a is not None and ids_a == ids_b:
            return _row(name, ma, mb, estimate, "identical", numel, dbytes=0, read=False)  # equal hashes: equal bytes
    if ma.shape != mb.shape and not estimate:
        return _row(name, ma, mb, estimate, "shape_changed", numel, read=False)
    return None


# A batch of tensors read together holds at most this many bytes (a tensor larger goes alone) and
# this many tensors: memory stays at about two tensors, or two batches of small ones.
_BATCH_BYTES = 1 << 20
_BATCH_TENSORS = 256


def _batches(names: list[str], side_a: Side, side_b: Side, cs: int,
             estimate: bool) -> Iterator[list[tuple[str, TensorDiff | None]]]:
    """``names`` in order, in batches, each with its record where :func:`_decided` gives it (None:
    its data is to be read), a batch's tensors to be read within the bounds above."""
    batch: list[tuple[str, TensorDiff | None]] = []
    size = count = 0
    for name in names:
        row = _decided(name, side_a, side_b, cs, estimate)
        if row is None:
            n = side_b.meta[name].nbytes + (side_a.meta[name].nbytes if name in side_a.meta else 0)
            if count and (size + n > _BATCH_BYTES or count == _BATCH_TENSORS):
                yield batch
                batch, size, count = [], 0, 0
            size, count = size + n, count + 1
        batch.append((name, row))
    if batch:
        yield batch


def _compare(name: str, side_a: Side, side_b: Side, cs: int, known: set[str], settings: Any, estimate: bool,
             ta: torch.Tensor | None, tb: torch.Tensor) -> tuple[TensorDiff, TensorStats | None]:
    """The record of ``name``, which :func:`_decided` left undecided, from A's tensor ``ta`` (None
    where A has none) and B's ``tb``."""
    ma, mb = side_a.meta.get(name), side_b.meta[name]

    def row(status: str, numel: int, stats: TensorStats | None = None, dbytes: int | None = None) -> TensorDiff:
        return _row(name, ma, mb, estimate, status, numel, stats, dbytes)

    numel = math.prod(mb.shape)
    elem = itemsize(mb.dtype) or 1
    elem = elem if elem in (1, 2, 4, 8) else 1
    if ma is None or ta is None:
        return row("added", numel, dbytes=_estimate(None, tb, None, side_b.chunk_ids(name, cs), cs, elem, known, settings, estimate)), None
    ids_a = side_a.chunk_ids(name, cs) if ma.nbytes == mb.nbytes else None
    dbytes = _estimate(ta if ma.dtype == mb.dtype and ma.nbytes == mb.nbytes else None, tb, ids_a,
                       side_b.chunk_ids(name, cs), cs, elem, known, settings, estimate)
    if ma.shape != mb.shape:
        return row("shape_changed", numel, dbytes=dbytes), None
    if itemsize(ma.dtype) is None or itemsize(mb.dtype) is None:
        # A dtype ckpt does not know (both sides read as bytes): equal or not by bytes; no values to compare.
        if ma.dtype != mb.dtype:
            return row("dtype_changed", numel, dbytes=dbytes), None
        return row("identical" if bit_identical(ta, tb) else "changed", numel, dbytes=dbytes), None
    stats = tensor_stats(ta, tb)
    if ma.dtype != mb.dtype:
        return row("dtype_changed", numel, stats, dbytes), stats
    return row("identical" if stats.changed_elements == 0 else "changed", numel, stats, dbytes), stats


def _estimate(ta: torch.Tensor | None, tb: torch.Tensor, ids_a: Sequence[str] | None, ids_b: Sequence[str] | None,
              cs: int, elem: int, known: set[str], settings: Any, estimate: bool) -> int | None:
    if not estimate:
        return None
    return delta_bytes(byte_view(ta) if ta is not None else None, byte_view(tb), chunk_size=cs, elem=elem,
                       a_ids=ids_a if ta is not None else None, b_ids=ids_b, known=known,
                       level=settings.zstd_level, min_saving=settings.min_saving, workers=settings.workers)


def plot(report: DiffReport, path: str | os.PathLike[str], store: Store | None = None) -> str:
    """Draw the relative change of every tensor to ``path`` (PNG): see :mod:`ckpt.diffing.plot`.
    ``path`` may not lie inside a local store (``store``, the one diffed from, or any other)."""
    from ckpt.diffing.plot import plot_report

    return plot_report(report, path, store)
