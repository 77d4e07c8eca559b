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
from typing import TYPE_CHECKING, Any

from ckpt.diffing.report import SORT_KEYS, STATUSES, DiffReport, DiffSummary, TensorDiff
from ckpt.diffing.sides import Side, TensorMeta, open_side
from ckpt.diffing.stats import TensorStats, delta_bytes, tensor_stats
from ckpt.format.dtypes import bit_identical, byte_view, itemsize
from ckpt.format.names import name_selected
from ckpt.progress import Progress, reporting

if TYPE_CHECKING:
    import torch

    from ckpt.store.store import Store

# The report (report.py) and the statistics (stats.py) are named here too, where callers import them.
__all__ = ["SORT_KEYS", "STATUSES", "DiffReport", "DiffSummary", "TensorDiff", "TensorStats", "delta_bytes", "diff", "plot",
           "tensor_stats"]


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
        norms: tuple[list[float], list[float]] = ([], [])  # of A and of B - A, per compared tensor
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
                        norms[0].append(s.norm_a)
                        norms[1].append(s.norm_diff)
                    rows.append(decided)
                    bar.advance(side_b.meta[name].nbytes if name in side_b.meta else 0)
    finally:
        side_a.close()
        side_b.close()
    # the norm of the tensors' norms: hypot never squares one (norm**2 past 1.3e154 overflowed); a NaN
    # stays NaN (hypot(inf, nan) is inf)
    norm_a, norm_d = (math.nan if any(math.isnan(n) for n in ns) else math.hypot(*ns) for ns in norms)
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
        relative_change=norm_d / norm_a if norm_a else (0.0 if not norm_d else None),
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
