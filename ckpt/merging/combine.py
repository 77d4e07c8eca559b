"""Merge stored checkpoints into a new one, tensor by tensor, through the ordinary push path.

The plan is made from manifests alone, before any tensor is read: parameters are
validated, every tensor name, dtype and shape is checked across the inputs (and the
base), and each tensor is either

* **reused**: every input holds the same chunks (and so does the base when the
  method has one) and the method returns identical inputs unchanged, or the tensor
  is missing from some input and ``missing="base"`` takes it from the base; its
  chunks go into the new manifest as they are, unread;
* **merged**: read from each input through the lazy reader, upcast to the compute
  dtype (float32; float64 for float64 inputs), combined by the method (see
  :mod:`ckpt.merging.methods`) and cast back to the input dtype (values past its range stop
  the merge, or are clipped: :func:`~ckpt.merging.computing.cast_back`);
* **averaged** (``new_tensors="average"``): a tensor the base lacks (a classification
  head that every fine-tune added), or one that some inputs lack and the base cannot
  fill, is the plain average of the inputs that hold it (summed in input order in the
  compute dtype, then divided; where the sum overflows, computed again in float64: see
  :mod:`ckpt.merging.formulas`; unread when they all hold the same chunks). The method's math needs a
  base value for every tensor, so without the option such a tensor is an error that
  names it and this option.

Merged tensors are computed lazily, one at a time, when push's workers first ask
for one of their chunks, and dropped once their last chunk is handed on. Their inputs
are read one tensor at a time per input, or a batch of small ones (the next tensors
to merge, together at most ``BATCH_BYTES``, 1 MiB, per input): see :class:`~ckpt.merging.computing.BatchedInputs`. Memory
therefore stays near (inputs + 2) × the largest tensor (or 1 MiB) for linear, task-arithmetic,
dare (linear combine) and slerp, and (inputs + 3) × for ties and dare's ties combine
(their masks and sums), plus the push pipeline's buffers (a few chunks per thread); never whole models
(benchmarks/results/merge.md and tests/ckpt/merging/test_combine.py measure it). Elements whose math overflowed
are computed again into the merged tensor (:mod:`ckpt.merging.overflowing`), from the inputs' chunks that hold
them, read again a chunk's span at a time in every input: a few chunks per input more, not the inputs' tensors
(every element overflowing, 4 inputs of 4 MiB tensors in 1 MiB chunks: 30-35 MiB, the same inputs' merge
that overflows nothing 25-30, 4 MiB of the difference the code of the recompute's torch kernels, paged in;
the recompute holds 11 MiB beyond what it starts with, a span and a block's scratch, less than the inputs it follows). Beside that: from a
remote store, the inputs' bundles of small chunks that the merge's reads keep for the whole merge
(each fetched once; within ``inflight_mb`` in all, 256 MiB by default), and into one, the output's
chunks of at most 64 KiB (a quarter of its bytes at most), held until the push copies them into
the output's bundle; and the store's decoded-base cache (``base_cache_mb``), which the reads of
inputs stored as deltas against one base fill (the merged push keeps none of its delta bases
there). The result is pushed like any checkpoint: its
chunks dedup against the store and are delta-encoded against the base (else the
first input), and its lineage records the inputs' ids, the method and every
parameter value (``ckpt show`` prints it). The weights go to one ``model.safetensors``
with the first input's safetensors metadata; the first input's other files (a model
folder's config.json, tokenizer files...) are carried over as they are, except weights
in other formats (``.bin``, ``.pt``...) and shard indexes, which would describe weights
the merge did not make.

>>> import torch, ckpt
>>> store = ckpt.Store.init("memory://merge-doctest")
>>> _ = store.push({"w": torch.tensor([1.0, 2.0])}, "m/a")
>>> _ = store.push({"w": torch.tensor([3.0, 6.0])}, "m/b")
>>> r = ckpt.merge(["m/a", "m/b"], "linear", name="m/avg", store=store)
>>> store.load("m/avg")["w"].tolist()
[2.0, 4.0]
>>> store.manifest("m/avg").lineage["merge"]["params"]
{'normalize': True, 'weights': [1.0, 1.0]}
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.errors import InvalidMergeError, InvalidSourceError
from ckpt.format.dtypes import bit_identical, from_torch
from ckpt.format.entries import TensorEntry, chunk_count
from ckpt.merging.calls import positionals
from ckpt.merging.computing import (
    OVERFLOW,
    BatchedInputs,
    LazyTensor,
    SmallKept,
    cast_back,
    step_computation,
    step_sources,
)
from ckpt.merging.methods import MethodRegistry, default_registry
from ckpt.merging.overflowing import average_again, mark_nonfinite, masked_pieces, method_again, plain_average
from ckpt.merging.planning import FLOAT_DTYPES, cannot_merge, check_one_model, check_whole_tensors, plan_steps
from ckpt.progress import Progress
from ckpt.transfer.pipeline import BUNDLE_CHUNK_MAX, BUNDLE_SHARE
from ckpt_store.storage.records import canonical_json
from ckpt_store.storage.refs import validate_ref_name

if TYPE_CHECKING:
    import torch

    from ckpt.store.reader import CheckpointReader
    from ckpt.store.store import Store

log = logging.getLogger(__name__)

MISSING = ("error", "base")
NEW_TENSORS = ("error", "average")


@dataclass(frozen=True)
class MergeResult:
    """What a merge made: the new checkpoint's id and how each tensor was obtained."""

    id: str
    name: str | None
    method: str
    params: dict[str, Any]
    inputs: tuple[str, ...]  # checkpoint ids, in input order
    base: str | None
    merged: int  # tensors computed by the method
    reused: int  # tensors whose chunks were taken unread (identical inputs)
    from_base: tuple[str, ...]  # tensors missing from some input, taken from the base
    new_chunks: int
    written_bytes: int
    logical_bytes: int
    seconds: float
    averaged: tuple[str, ...] = ()  # tensors the base lacks, averaged over the inputs holding them
    files: tuple[str, ...] = ()  # the first input's other files (config.json, tokenizer...), carried over


# Files of the first input a merge does not carry: weights it did not merge (other formats), and
# shard indexes naming shards it does not write (the merge writes one model.safetensors).
_NOT_CARRIED = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".pkl", ".npz", ".index.json")


class _StoredFile:
    """The bytes of a file of a stored checkpoint (verified, as any read), for a merge to carry over."""

    def __init__(self, store: Store, chunk_size: int, entry: Any) -> None:
        self._store, self._cs, self._entry = store, chunk_size, entry

    def read(self, offset: int, length: int) -> bytes:
        from ckpt.transfer.pipeline import fetch_chunk, spans

        out = bytearray(length)
        for cid, n, at in spans(self._entry.chunks, self._entry.size, self._cs):
            lo, hi = max(offset, at), min(offset + length, at + n)
            if lo < hi:
                data, _ = fetch_chunk(self._store.objects, cid, n, self._store.settings)
                out[lo - offset : hi - offset] = memoryview(data)[lo - at : hi - at]
        return bytes(out)


def _carried(reader: CheckpointReader, weights_file: str) -> list[Any]:
    """The first input's files that are not weights: a merge of model folders stays a model folder."""
    return [f for f in reader.manifest.files if f.kind == "blob" and not f.path.endswith(_NOT_CARRIED)
            and f.path.split("/")[0] != weights_file]


def merge(inputs: Sequence[str], method: str = "linear", *legacy: str, name: str | None, store: Store | None = None,
          params: Mapping[str, Any] | None = None, base: str | None = None, missing: str = "error",
          new_tensors: str = "error", message: str | None = None, metadata: dict[str, Any] | None = None,
          registry: MethodRegistry | None = None, progress: Progress | None = None, overflow: str = "error",
          _remix: dict[str, Any] | None = None, _pinned: Sequence[str] | None = None) -> MergeResult:
    """Merge checkpoints ``inputs`` (refs) with ``method`` and store the result as ``name``.

    ``params`` are the method's parameters (see :mod:`ckpt.merging.methods` or ``ckpt merge
    --list-methods``); strings are parsed as the CLI does. ``base`` is the checkpoint the
    inputs were fine-tuned from (needed by task-arithmetic, ties and dare); with
    ``missing="base"``, tensors absent from some input are taken from it. With
    ``new_tensors="average"``, a tensor the base lacks (a classification head the
    fine-tunes added) or that some inputs lack and the base cannot supply is the plain
    average of the inputs that hold it; by default it is an error naming it. A tensor whose merged
    values fall past its dtype's range (which the cast makes inf, or NaN in float8 dtypes without an
    infinity) is an :class:`InvalidMergeError` naming it, raised when it is computed (no ref is
    written), or with ``overflow="saturate"`` clipped to ± the dtype's largest, with a warning naming
    it; an input's inf stays inf (see :func:`~ckpt.merging.computing.cast_back`). Where the float32 math
    overflows though the result fits (an average of values near the largest), linear, task-arithmetic and
    the plain average compute those elements again in float64 (:mod:`ckpt.merging.formulas`): the
    result, not an error. A NaN the math makes from finite inputs (``inf − inf``, ``0 × inf`` after an
    overflow) is an :class:`InvalidMergeError` in either mode. Raises
    :class:`InvalidMergeError` for an unknown method, a bad parameter, a wrong number of
    inputs, tensors that do not line up (names, dtypes, shapes) or are stored as the shards
    of a distributed checkpoint — all before any tensor data is read —, :class:`TensorMismatchError`
    for an input holding several models (weights in several folders: a diffusers pipeline), and
    the errors of :meth:`Store.resolve` for unknown refs.
    """
    from ckpt.store.push import push_source
    from ckpt.store.sources import FileIn, from_tensors

    started = time.perf_counter()
    (inputs, method), store = positionals("merge", (inputs, method, *legacy), (None, "linear"), store)
    registry = registry or default_registry()
    m = registry.get(method)
    bound = m.bind(params, len(inputs), base is not None)
    if missing not in MISSING:
        raise InvalidMergeError(f"missing must be one of {', '.join(MISSING)}, got {missing!r}")
    if new_tensors not in NEW_TENSORS:
        raise InvalidMergeError(f"new_tensors must be one of {', '.join(NEW_TENSORS)}, got {new_tensors!r}")
    if overflow not in OVERFLOW:
        raise InvalidMergeError(f"overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")
    if missing == "base" and base is None:
        raise InvalidMergeError("taking missing tensors from the base needs a base", hint="pass --base REF")
    if name is not None:
        validate_ref_name(name)
    if metadata is not None:
        canonical_json(metadata)
    # _pinned: the checkpoint ids the inputs named when the caller judged them (remix scores
    # them first): a ref moved since must not swap in a checkpoint nobody looked at.
    readers = [store.reader(ref) for ref in (inputs if _pinned is None else _pinned)]
    base_reader = store.reader(base) if base is not None else None
    for ref, r in zip([*inputs, base], [*readers, base_reader]):
        if r is not None:
            check_whole_tensors(ref, r)
            check_one_model(ref, r)
    steps = plan_steps(m, bound, readers, base_reader, missing, list(inputs), base, new_tensors)

    cs = store.settings.chunk_size
    specs = {s.name: (s.dtype, s.shape, s.nbytes) for s in steps}
    st_meta = readers[0].metadata()
    src = from_tensors({}, "tensors", {}, st_meta, known=specs)
    carried = _carried(readers[0], src.files[0].path)
    src.files += [FileIn(f.path, "blob", f.size, src=_StoredFile(store, readers[0].manifest.chunk_size, f)) for f in carried]
    gate = threading.Lock()
    keep_small = min(BUNDLE_CHUNK_MAX, cs // 4) if store.objects.backend.streams else 0  # as push's small_chunks picks them
    reuse: dict[str, TensorEntry] = {}
    by_name = {s.name: s for s in steps}
    reads = BatchedInputs([by_name[t.name] for t in src.files[0].tensors if by_name[t.name].reuse is None],
                          step_sources(m, readers, base_reader))
    kept = SmallKept(sum(s.nbytes for s in steps if s.reuse is None or s.reuse[0].manifest.chunk_size != cs) // BUNDLE_SHARE)
    for t in src.files[0].tensors:
        s = by_name[t.name]
        if s.reuse is not None and s.reuse[0].manifest.chunk_size == cs:
            reuse[t.name] = s.reuse[1]
        else:
            t.src = LazyTensor(step_computation(s, m, bound, readers, base_reader, reads, overflow), chunk_count(s.nbytes, cs), gate,
                               keep_small, kept)
    merged = sum(1 for s in steps if s.reuse is None and s.average is None)
    from_base = tuple(s.name for s in steps if s.reuse is not None and s.reuse[0] is base_reader and base_reader is not None
                      and any(s.name not in r for r in readers))
    averaged = tuple(s.name for s in steps if s.average is not None)
    log.info("merge %s of %d inputs: %d tensors to compute, %d reused", method, len(inputs), merged, len(steps) - merged)

    delta_base = base_reader if base_reader is not None else readers[0]
    parent = None
    if name is not None:
        current = store.refs_db.current(name)
        parent = current.target if current else None
    record: dict[str, Any] = {
        "method": m.name, "params": bound, "inputs": [r.id for r in readers], "input_refs": list(inputs),
        "base": base_reader.id if base_reader is not None else None, "base_ref": base, "missing": missing,
    }
    if averaged:  # recorded only when used: earlier merges' lineage (and ids) stay as they were
        record["new_tensors"] = {"mode": new_tensors, "averaged": list(averaged)}
    if overflow != "error":  # recorded only when asked for, as above
        record["overflow"] = overflow
    if carried:  # recorded only when used, as above
        record["files"] = {"from": readers[0].id, "paths": [f.path for f in carried]}
    if _remix is not None:
        record["remix"] = _remix
    with reads.pool:
        try:
            result = push_source(store, src, name, message=message, metadata=metadata, base_id=delta_base.id,
                                 base_manifest=delta_base.manifest,  # (parsed already: not again)
                                 lineage={"parent": parent, "base": delta_base.id, "merge": record}, reuse=reuse,
                                 progress=progress, pool=reads.pool,  # (delta bases from the bundles it keeps)
                                 keep_bases=False)  # (the reads asked for them: no one asks again)
        finally:  # the readers' own reading threads (a tensor copied whole at another chunk size)
            for r in (*readers, base_reader):
                if r is not None:
                    r.close()
    return MergeResult(result.id, name, m.name, bound, tuple(r.id for r in readers), record["base"], merged,
                       len(steps) - merged - len(from_base) - len(averaged), from_base, result.new_chunks, result.written_bytes,
                       result.logical_bytes, time.perf_counter() - started, averaged, tuple(f.path for f in carried))


def _dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s safetensors name, or torch's name for one a checkpoint cannot hold (float4, complex32)."""
    try:
        return from_torch(dtype)
    except InvalidSourceError:
        return str(dtype).removeprefix("torch.")


def merge_state_dicts(inputs: Sequence[Mapping[str, torch.Tensor]], method: str = "linear", *,
                      params: Mapping[str, Any] | None = None, base: Mapping[str, torch.Tensor] | None = None,
                      registry: MethodRegistry | None = None, new_tensors: str = "error",
                      overflow: str = "error") -> dict[str, torch.Tensor]:
    """The same math on in-memory state dicts (same names, dtypes and shapes everywhere): no store involved.

    A tensor ``base`` lacks (for a method that uses it) is an error, or with
    ``new_tensors="average"`` the plain average of the inputs, as in :func:`merge`; so is
    ``overflow`` (merged values past the dtype's range).

    >>> import torch
    >>> merge_state_dicts([{"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}])["w"].tolist()
    [1.5]
    """
    import torch

    m = (registry or default_registry()).get(method)
    bound = m.bind(params, len(inputs), base is not None)
    if overflow not in OVERFLOW:
        raise InvalidMergeError(f"overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")
    for i, sd in enumerate(inputs[1:], 1):  # a tensor of one input only was dropped, or a KeyError
        odd = sorted(set(sd).symmetric_difference(inputs[0]))
        if odd:
            where = "input 0" if odd[0] in inputs[0] else f"input {i}"
            raise InvalidMergeError(f"{odd[0]} is in {where} and not in input {i if where == 'input 0' else 0}"
                                    + (f" (and {len(odd) - 1} more differ)" if len(odd) > 1 else ""),
                                    hint="the inputs must hold the same tensors")
    out: dict[str, torch.Tensor] = {}
    for name, first in inputs[0].items():
        xs = [sd[name] for sd in inputs]
        if any(x.dtype != first.dtype or x.shape != first.shape for x in xs):
            raise InvalidMergeError(f"{name} differs in dtype/shape between inputs")
        if base is not None and m.needs_base and name in base and (base[name].dtype != first.dtype or base[name].shape != first.shape):
            # a base of another shape broadcast into the inputs: a result, and a wrong one
            raise InvalidMergeError(f"{name} differs in dtype/shape between the inputs ({first.dtype}{list(first.shape)}) "
                                    f"and the base ({base[name].dtype}{list(base[name].shape)})")
        dtype = _dtype_name(first.dtype)
        if dtype not in FLOAT_DTYPES:  # the store's rule: E8M0 scales, integers, complex... are no weights to mix
            if any(not bit_identical(x, first) for x in xs[1:]):  # (by bits: a NaN is itself)
                raise InvalidMergeError(cannot_merge(name, dtype))
            out[name] = first.clone()
            continue
        if base is not None and m.needs_base and name not in base:
            if new_tensors != "average":
                raise InvalidMergeError(f"the base has no {name}", hint="pass new_tensors=\"average\" to average it over the inputs")
            cd = torch.float64 if first.dtype == torch.float64 else torch.float32
            acc, held = plain_average(xs, cd)
            out[name] = cast_back(acc, dtype, name, held, overflow, average_again(xs))
            continue
        b = base[name] if base is not None and m.needs_base else None
        if m.identity(bound) and all(bit_identical(x, first) for x in xs[1:] + ([b] if b is not None else [])):
            out[name] = first.clone()  # as the store path does: identical inputs come back unchanged
            continue
        cd = torch.float64 if first.dtype == torch.float64 else torch.float32
        b = b.to(cd, copy=True) if b is not None else None
        ys, held = [x.to(cd, copy=True) for x in xs], None
        for y in ys + ([b] if b is not None else []):
            held = mark_nonfinite(y, held)
        again = method_again(m, bound, name, b is not None, cd, masked_pieces(xs + ([base[name]] if b is not None else [])))
        with torch.no_grad():
            out[name] = cast_back(m.combine(ys, b, bound, name), dtype, name, held, overflow, again)
    return out
