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
  :mod:`ckpt.merging.methods`) and cast back to the input dtype;
* **averaged** (``new_tensors="average"``): a tensor the base lacks (a classification
  head that every fine-tune added), or one that some inputs lack and the base cannot
  fill, is the plain average of the inputs that hold it (in input order, in the
  compute dtype; unread when they all hold the same chunks). The method's math needs a
  base value for every tensor, so without the option such a tensor is an error that
  names it and this option.

Merged tensors are computed lazily, one at a time, when push's workers first ask
for one of their chunks, and dropped once their last chunk is handed on. Their inputs
are read one tensor at a time per input, or a batch of small ones (the next tensors
to merge, together at most ``BATCH_BYTES``, 1 MiB, per input): see :class:`_Inputs`. Memory
therefore stays near (inputs + 2) × the largest tensor (or 1 MiB) for linear, task-arithmetic,
dare (linear combine) and slerp, and (inputs + 3) × for ties and dare's ties combine
(their masks and sums), plus the push pipeline's buffers (a few chunks per thread); never whole models
(benchmarks/results/merge.md and tests/ckpt/merging/test_combine.py measure it). Beside that: from a
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.errors import InvalidMergeError, TensorMismatchError
from ckpt.format.dtypes import bit_identical, byte_view, to_torch
from ckpt.format.manifest import Manifest, TensorEntry, chunk_count
from ckpt.merging.calls import positionals
from ckpt.merging.methods import MergeMethod, MethodRegistry, default_registry
from ckpt.progress import Progress
from ckpt.transfer.pipeline import BUNDLE_CHUNK_MAX, BUNDLE_SHARE
from ckpt_store.storage.records import canonical_json
from ckpt_store.storage.refs import validate_ref_name

if TYPE_CHECKING:
    import torch

    from ckpt.store.reader import CheckpointReader
    from ckpt.store.store import Store

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
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


@dataclass(frozen=True)
class _Step:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    reuse: tuple[CheckpointReader, TensorEntry] | None  # take these chunks (or bytes) as they are
    average: tuple[CheckpointReader, ...] | None = None  # compute the plain average of these inputs
    # the inputs are cut at other chunk sizes: their chunk ids cannot say whether they are equal,
    # so their bytes are compared when read (:func:`_inputs_themselves`)
    cut_otherwise: bool = False


def _plan(method: MergeMethod, params: Mapping[str, Any], readers: list[CheckpointReader],
          base: CheckpointReader | None, missing: str, labels: list[str], base_label: str | None,
          new_tensors: str = "error") -> list[_Step]:
    """One step per output tensor, from the manifests; every mismatch is reported before any read."""
    names: list[str] = []
    seen: set[str] = set()
    for r in readers + ([base] if base is not None and missing == "base" else []):
        for n in r.keys():
            if n not in seen:
                seen.add(n)
                names.append(n)
    problems: list[str] = []
    fillable, new = [], []  # tensors --fill-from-base could supply; tensors the base cannot
    steps: list[_Step] = []
    identity = method.identity(params)
    compared = readers + ([base] if method.needs_base and base is not None else [])  # must line up
    one_cut = len({r.manifest.chunk_size for r in compared}) == 1  # chunk ids are comparable
    for name in names:
        lacking = [lab for lab, r in zip(labels + [f"{base_label} (base)"], compared) if name not in r]
        if lacking:
            in_base = base is not None and name in base
            if missing == "base" and in_base:
                e = base.info(name)  # type: ignore[union-attr]
                held = [e] + [r.info(name) for r in readers if name in r]  # the inputs that have it must agree
                if len({(h.dtype, h.shape) for h in held}) > 1:
                    problems.append(f"{name} differs in dtype/shape: " + ", ".join(f"{h.dtype}{list(h.shape)}" for h in held))
                    continue
                steps.append(_Step(name, e.dtype, e.shape, e.nbytes, (base, e)))
            elif new_tensors == "average" and not in_base:
                step = _average_step(name, [r for r in readers if name in r], one_cut, problems)
                if step is not None:
                    steps.append(step)
            else:
                (new if base is not None and not in_base else fillable).append(name)
                problems.append(f"{name} is missing from {', '.join(lacking)}")
            continue
        entries = [r.info(name) for r in compared]
        if len({(e.dtype, e.shape) for e in entries}) > 1:
            problems.append(f"{name} differs in dtype/shape: " + ", ".join(f"{e.dtype}{list(e.shape)}" for e in entries))
            continue
        first = entries[0]
        same = one_cut and len({e.chunks for e in entries}) == 1
        if same and (identity or first.dtype not in FLOAT_DTYPES):
            steps.append(_Step(name, first.dtype, first.shape, first.nbytes, (readers[0], first)))
        elif first.dtype not in FLOAT_DTYPES and one_cut:
            problems.append(_differs(name, first.dtype))
        else:
            steps.append(_Step(name, first.dtype, first.shape, first.nbytes, None, cut_otherwise=not one_cut))
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        hints = []
        if fillable:
            hints.append("pass --fill-from-base (missing=\"base\") with --base to take tensors some inputs lack from the base")
        if new:
            hints.append(f"the base has no {new[0]}" + (f" (nor {len(new) - 1} more)" if len(new) > 1 else "")
                         + ": pass --new-tensors average (new_tensors=\"average\") to average such tensors over the inputs that have them")
        raise InvalidMergeError("inputs do not line up: " + "; ".join(problems[:8]) + more, hint="; ".join(hints) or None)
    return steps


def _average_step(name: str, holders: list[CheckpointReader], one_cut: bool, problems: list[str]) -> _Step | None:
    """The step for a tensor the base lacks: the plain average of ``holders`` (unread if they agree bit for bit)."""
    entries = [r.info(name) for r in holders]
    first = entries[0]
    if len({(e.dtype, e.shape) for e in entries}) > 1:
        problems.append(f"{name} differs in dtype/shape: " + ", ".join(f"{e.dtype}{list(e.shape)}" for e in entries))
        return None
    if one_cut and len({e.chunks for e in entries}) == 1:
        return _Step(name, first.dtype, first.shape, first.nbytes, (holders[0], first), tuple(holders))
    if first.dtype not in FLOAT_DTYPES and one_cut:
        problems.append(_differs(name, first.dtype))
        return None
    return _Step(name, first.dtype, first.shape, first.nbytes, None, tuple(holders), cut_otherwise=not one_cut)


def _differs(name: str, dtype: str) -> str:
    return f"{name} is {dtype} and differs between inputs: only floating-point tensors can be merged"


def _inputs_themselves(step: _Step, xs: list[torch.Tensor]) -> bool:
    """For inputs cut at other chunk sizes (their chunk ids cannot be compared), whether their bytes
    are equal: equal inputs then give themselves, as inputs cut alike do when their ids say so, so
    the result does not depend on the cut; unequal ones that are not floating point cannot be
    merged. Inputs cut alike were compared by their ids when planned: False, with no pass over them."""
    if not step.cut_otherwise:
        return False
    same = all(bit_identical(x, xs[0]) for x in xs[1:])
    if not same and step.dtype not in FLOAT_DTYPES:
        raise InvalidMergeError(_differs(step.name, step.dtype))
    return same


class _LazyTensor:
    """The bytes of one output tensor, computed on the first read of any of its chunks
    and dropped after the last one is handed out. ``gate`` lets one tensor be computed
    at a time, which bounds memory whatever the number of push workers."""

    def __init__(self, compute: Callable[[], torch.Tensor], chunks: int, gate: threading.Lock, keep_small: int = 0,
                 kept: _SmallKept | None = None) -> None:
        self._compute = compute
        self._left = chunks
        self._gate = gate
        self._lock = threading.Lock()
        self._view: memoryview | None = None
        # A push to a remote store reads its chunks of at most ``keep_small`` bytes again, once all
        # are stored, to bundle them: those are kept (they are copied into the bundle anyway).
        self._keep_small = keep_small
        self._kept = kept
        self._small: dict[int, bytes] = {}

    def read(self, offset: int, length: int) -> bytes | memoryview:
        with self._lock:
            if self._view is None:
                if self._left <= 0:  # read again after the last chunk: only the bundle does that
                    return self._small.get(offset, b"")  # (a chunk not kept is left out of the bundle)
                with self._gate:
                    self._view = byte_view(self._compute()).toreadonly()  # private: the push need not copy it
            out = self._view[offset : offset + length]  # keeps the tensor alive until encoded
            if length <= self._keep_small and (self._kept is None or self._kept.take(length)):
                self._small[offset] = bytes(out)
            self._left -= 1
            if self._left == 0:
                self._view = None
            return out


class _SmallKept:
    """The bytes of small chunks the lazy tensors of one merge keep for the push's bundle, in all: at
    most a quarter of the bytes they compute, past which the push makes no bundle (see
    :func:`ckpt.store.push.push_source`). Without it a merge of a model of small tensors only (norms,
    biases, small experts) into S3 held every chunk of its output to the end, for a bundle never
    made: the whole model."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Whether ``n`` more bytes may be kept (they then count)."""
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True


def _load_trim() -> Callable[[], object] | None:
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_trim()


def _trim() -> None:
    """Hand freed memory back to the OS (glibc). Without it, glibc's dynamic mmap threshold
    keeps freed tensor-sized blocks in per-thread arenas and RSS grows well past what is
    live (benchmarks/results/merge.md measures both)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# The inputs of small tensors are read in batches: up to this many bytes (and tensors) of each input
# at once, the next tensors to merge with the one asked for; a tensor larger than that is read alone.
BATCH_BYTES = 1 << 20
BATCH_TENSORS = 256


class _Inputs:
    """Reads the inputs of the merged tensors, in one pool of reading threads for the whole merge.
    A tensor of at most ``BATCH_BYTES`` is read with the next small ones in push order, each read
    with all its inputs in one parallel pass (from S3, 1,000 tiny tensors read one by one waited
    for 1,000 rounds of requests); the inputs read ahead are held until their tensor is computed,
    at most ``BATCH_BYTES`` per input. ``order``: the steps that read their inputs, in push order."""

    def __init__(self, order: list[_Step], sources: Callable[[_Step], list[CheckpointReader]]) -> None:
        from ckpt.transfer.pipeline import ReadPool

        self._order = order
        self._at = {s.name: i for i, s in enumerate(order)}
        self._sources = sources
        self._ahead: dict[str, list[torch.Tensor]] = {}
        self._ahead_bytes = 0
        self._lock = threading.Lock()
        self.pool = ReadPool()

    def read(self, step: _Step) -> list[torch.Tensor]:
        """Tensor ``step.name`` of each of its inputs (verified, as any read)."""
        with self._lock:
            xs = self._ahead.pop(step.name, None)
            if xs is not None:
                self._ahead_bytes -= step.nbytes
                return xs
            batch = [step]
            if step.nbytes <= BATCH_BYTES and step.name in self._at:
                size = step.nbytes + self._ahead_bytes
                for s in self._order[self._at[step.name] + 1:]:
                    if s.name in self._ahead:
                        continue
                    if len(batch) == BATCH_TENSORS or size + s.nbytes > BATCH_BYTES:
                        break
                    batch.append(s)
                    size += s.nbytes
            got = self._fetch(batch)
            for s in batch[1:]:
                self._ahead[s.name] = got[s.name]
                self._ahead_bytes += s.nbytes
            return got[step.name]

    def _fetch(self, steps: list[_Step]) -> dict[str, list[torch.Tensor]]:
        import torch

        from ckpt.transfer.pipeline import get_chunks, into_tasks

        out: dict[str, list[torch.Tensor]] = {}
        tasks = []
        manifests: dict[str, Manifest] = {}
        for step in steps:
            out[step.name] = []
            for r in self._sources(step):
                t = torch.empty(step.shape, dtype=to_torch(step.dtype))
                tasks += into_tasks(r.manifest.chunk_size, [(r.info(step.name), t)])
                out[step.name].append(t)
                manifests[r.id] = r.manifest
        store = self._sources(steps[0])[0].store
        # the small chunks from the inputs' bundles (each fetched once, kept by the pool), not a request each
        get_chunks(store.objects, tasks, store.settings, manifest=list(manifests.values()), pool=self.pool)
        return out


def _sources_fn(method: MergeMethod, readers: list[CheckpointReader], base: CheckpointReader | None,
                ) -> Callable[[_Step], list[CheckpointReader]]:
    """The checkpoints a computed step reads: the holders of an averaged tensor; else the inputs and,
    where the method has one, the base (as the chunk ids are compared)."""
    both = readers + ([base] if method.needs_base and base is not None else [])
    return lambda step: list(step.average) if step.average is not None else both


def _compute_fn(step: _Step, method: MergeMethod, params: Mapping[str, Any], readers: list[CheckpointReader],
                base: CheckpointReader | None, reads: _Inputs) -> Callable[[], torch.Tensor]:
    identity = method.identity(params)

    def compute() -> torch.Tensor:
        import torch

        if step.reuse is not None:  # same chunks, but cut at another chunk size: copy the bytes
            return step.reuse[0].get_tensor(step.name)
        cd = torch.float64 if step.dtype == "F64" else torch.float32
        _trim()
        if step.average is not None:  # a tensor the base lacks: the plain average, in input order
            xs = reads.read(step)
            if _inputs_themselves(step, xs):
                return xs[0]
            acc = xs[0].to(cd)
            for x in xs[1:]:
                acc.add_(x.to(cd))
            del xs
            return acc.div_(len(step.average)).to(to_torch(step.dtype)).contiguous()
        xs = reads.read(step)  # (the base too, where the method has one: see _sources_fn)
        if (identity or step.dtype not in FLOAT_DTYPES) and _inputs_themselves(step, xs):
            return xs[0]
        for i, x in enumerate(xs):
            xs[i] = x.to(cd)  # one at a time: an upcast copy replaces its source
        b = xs.pop() if method.needs_base and base is not None else None
        with torch.no_grad():
            out = method.combine(xs, b, params, step.name)
        del xs, b
        out = out.to(to_torch(step.dtype)).contiguous()
        _trim()
        return out

    return compute


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


def _whole_tensors(ref: str, reader: CheckpointReader) -> None:
    """Refuse a distributed (DCP) checkpoint that stores a tensor as several shards: its entries are
    the shards, and merging shard by shard is not merging the tensors (ties and dare trim by magnitude,
    slerp interpolates by angle, each over the whole tensor), nor is the result the model's layout."""
    from ckpt.dcp.format import DCP_SOURCE, decode_layout

    m = reader.manifest
    if m.source != DCP_SOURCE:
        return
    split = [t.fqn for t in decode_layout(m.extra, f"checkpoint {ref}").tensors.values() if [s.sizes for s in t.shards] != [t.size]]
    if split:
        raise InvalidMergeError(f"{ref} is a distributed (DCP) checkpoint that stores {split[0]!r}"
                                f"{f' and {len(split) - 1} more' if len(split) > 1 else ''} as shards: merge combines whole tensors",
                                hint=f"consolidate it first (ckpt pull {ref} model.safetensors; ckpt push model.safetensors NAME) "
                                "and merge that")


def _one_model(ref: str, reader: CheckpointReader) -> None:
    """Refuse a folder of several models (a diffusers pipeline's unet/, text_encoder/, vae/): merge
    pairs tensors by name and writes one model.safetensors, so names two files share would be lost,
    and weights from several folders would land in one file beside configs left without theirs.
    Say how to merge the components one by one."""
    def refuse(why: str, part: str) -> TensorMismatchError:
        return TensorMismatchError(
            f"{ref}: {why}: it holds several models (a diffusers pipeline?), and merge combines the tensors of one model",
            hint=f"merge each model on its own: push its folder from every input (ckpt push PIPELINE/{part} "
            f"NAME/{part}; `ckpt pull {ref} DIR` writes a stored one back) and merge those refs")

    seen: dict[str, str] = {}
    for t in reader.manifest.tensors:
        if seen.setdefault(t.name, t.file) != t.file:
            raise refuse(f"tensor {t.name!r} appears in two files ({seen[t.name]} and {t.file})",
                         t.file.rpartition("/")[0] or "FOLDER")
    folders = sorted({f.path.rpartition("/")[0] for f in reader.manifest.files if f.kind == "safetensors"})
    if len(folders) > 1:
        shown = ", ".join(f"{d}/" if d else "./" for d in folders[:4]) + (" ..." if len(folders) > 4 else "")
        raise refuse(f"its weights are in {len(folders)} folders ({shown})", folders[-1] or "FOLDER")


def _carried(reader: CheckpointReader, weights_file: str) -> list[Any]:
    """The first input's files that are not weights: a merge of model folders stays a model folder."""
    return [f for f in reader.manifest.files if f.kind == "blob" and not f.path.endswith(_NOT_CARRIED)
            and f.path.split("/")[0] != weights_file]


def merge(inputs: Sequence[str], method: str = "linear", *legacy: str, name: str | None, store: Store | None = None,
          params: Mapping[str, Any] | None = None, base: str | None = None, missing: str = "error",
          new_tensors: str = "error", message: str | None = None, metadata: dict[str, Any] | None = None,
          registry: MethodRegistry | None = None, progress: Progress | None = None,
          _remix: dict[str, Any] | None = None, _pinned: Sequence[str] | None = None) -> MergeResult:
    """Merge checkpoints ``inputs`` (refs) with ``method`` and store the result as ``name``.

    ``params`` are the method's parameters (see :mod:`ckpt.merging.methods` or ``ckpt merge
    --list-methods``); strings are parsed as the CLI does. ``base`` is the checkpoint the
    inputs were fine-tuned from (needed by task-arithmetic, ties and dare); with
    ``missing="base"``, tensors absent from some input are taken from it. With
    ``new_tensors="average"``, a tensor the base lacks (a classification head the
    fine-tunes added) or that some inputs lack and the base cannot supply is the plain
    average of the inputs that hold it; by default it is an error naming it. Raises
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
            _whole_tensors(ref, r)
            _one_model(ref, r)
    steps = _plan(m, bound, readers, base_reader, missing, list(inputs), base, new_tensors)

    cs = store.settings.chunk_size
    specs = {s.name: (s.dtype, s.shape, s.nbytes) for s in steps}
    st_meta = readers[0].metadata()
    src = from_tensors({}, "tensors", {}, st_meta, known=specs)
    carried = _carried(readers[0], src.files[0].path)
    src.files += [FileIn(f.path, "blob", f.size, src=_StoredFile(store, readers[0].manifest.chunk_size, f)) for f in carried]
    gate = threading.Lock()
    keep_small = min(BUNDLE_CHUNK_MAX, cs // 4) if store.objects.backend.streams else 0  # as push's _bundle picks them
    reuse: dict[str, TensorEntry] = {}
    by_name = {s.name: s for s in steps}
    reads = _Inputs([by_name[t.name] for t in src.files[0].tensors if by_name[t.name].reuse is None],
                     _sources_fn(m, readers, base_reader))
    kept = _SmallKept(sum(s.nbytes for s in steps if s.reuse is None or s.reuse[0].manifest.chunk_size != cs) // BUNDLE_SHARE)
    for t in src.files[0].tensors:
        s = by_name[t.name]
        if s.reuse is not None and s.reuse[0].manifest.chunk_size == cs:
            reuse[t.name] = s.reuse[1]
        else:
            t.src = _LazyTensor(_compute_fn(s, m, bound, readers, base_reader, reads), chunk_count(s.nbytes, cs), gate,
                                keep_small, kept)
    merged = sum(1 for s in steps if s.reuse is None and s.average is None)
    from_base = tuple(s.name for s in steps if s.reuse is not None and s.reuse[0] is base_reader and base_reader is not None
                      and any(s.name not in r for r in readers))
    averaged = tuple(s.name for s in steps if s.average is not None)
    log.info("merge %s of %d inputs: %d tensors to compute, %d reused", method, len(inputs), merged, len(steps) - merged)

    delta_base = base_reader.id if base_reader is not None else readers[0].id
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
    if carried:  # recorded only when used, as above
        record["files"] = {"from": readers[0].id, "paths": [f.path for f in carried]}
    if _remix is not None:
        record["remix"] = _remix
    with reads.pool:
        try:
            result = push_source(store, src, name, message=message, metadata=metadata, base_id=delta_base,
                                 lineage={"parent": parent, "base": delta_base, "merge": record}, reuse=reuse,
                                 progress=progress, pool=reads.pool,  # (delta bases from the bundles it keeps)
                                 keep_bases=False)  # (the reads asked for them: no one asks again)
        finally:  # the readers' own reading threads (a tensor copied whole at another chunk size)
            for r in (*readers, base_reader):
                if r is not None:
                    r.close()
    return MergeResult(result.id, name, m.name, bound, tuple(r.id for r in readers), record["base"], merged,
                       len(steps) - merged - len(from_base) - len(averaged), from_base, result.new_chunks, result.written_bytes,
                       result.logical_bytes, time.perf_counter() - started, averaged, tuple(f.path for f in carried))


def merge_state_dicts(inputs: Sequence[Mapping[str, torch.Tensor]], method: str = "linear", *,
                      params: Mapping[str, Any] | None = None, base: Mapping[str, torch.Tensor] | None = None,
                      registry: MethodRegistry | None = None, new_tensors: str = "error") -> dict[str, torch.Tensor]:
    """The same math on in-memory state dicts (same names, dtypes and shapes everywhere): no store involved.

    A tensor ``base`` lacks (for a method that uses it) is an error, or with
    ``new_tensors="average"`` the plain average of the inputs, as in :func:`merge`.

    >>> import torch
    >>> merge_state_dicts([{"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}])["w"].tolist()
    [1.5]
    """
    import torch

    m = (registry or default_registry()).get(method)
    bound = m.bind(params, len(inputs), base is not None)
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
        if not first.is_floating_point():
            if any(not torch.equal(x, first) for x in xs):
                raise InvalidMergeError(f"{name} is {first.dtype} and differs between inputs")
            out[name] = first.clone()
            continue
        if base is not None and m.needs_base and name not in base:
            if new_tensors != "average":
                raise InvalidMergeError(f"the base has no {name}", hint="pass new_tensors=\"average\" to average it over the inputs")
            cd = torch.float64 if first.dtype == torch.float64 else torch.float32
            acc = xs[0].to(cd, copy=True)
            for x in xs[1:]:
                acc.add_(x.to(cd))
            out[name] = acc.div_(len(xs)).to(first.dtype)
            continue
        b = base[name] if base is not None and m.needs_base else None
        if m.identity(bound) and all(bit_identical(x, first) for x in xs[1:] + ([b] if b is not None else [])):
            out[name] = first.clone()  # as the store path does: identical inputs come back unchanged
            continue
        cd = torch.float64 if first.dtype == torch.float64 else torch.float32
        b = b.to(cd, copy=True) if b is not None else None
        with torch.no_grad():
            out[name] = m.combine([x.to(cd, copy=True) for x in xs], b, bound, name).to(first.dtype)
    return out


