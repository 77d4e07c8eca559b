"""The merged tensors, computed as the push reads them: one at a time, each from its inputs read
in batches of small tensors, and dropped once its last chunk is handed on (memory bounds: see
:mod:`ckpt.merging.combine`)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ckpt.errors import InvalidMergeError
from ckpt.format.dtypes import bit_identical, bit_pattern, byte_view, to_torch
from ckpt.format.manifest import Manifest
from ckpt.merging.methods import MergeMethod
from ckpt.merging.overflowing import Again, Piece, average_again, mark_nonfinite, method_again, plain_average
from ckpt.merging.planning import FLOAT_DTYPES, Step, cannot_merge

if TYPE_CHECKING:
    import torch

    from ckpt.store.reader import CheckpointReader

log = logging.getLogger(__name__)

# Floating-point dtypes without an infinity: a merged value past their range has no value to become.
# torch's cast makes it NaN (float8 e4m3fnuz, e5m2fnuz) or clips it (e4m3fn, on CPU since some
# version: earlier ones gave NaN), silently either way. The others make it inf, as silently.
NO_INFINITY = ("F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
OVERFLOW = ("error", "saturate")


def cast_back(x: torch.Tensor, dtype: str, name: str, held: torch.Tensor | None, overflow: str = "error",
              again: Again | None = None) -> torch.Tensor:
    """Merged tensor ``x`` (in the compute dtype) cast to the inputs' ``dtype``, in every float dtype by
    one rule: a finite value that rounds past the dtype's largest (the cast makes it inf, or where the
    dtype has no infinity NaN or the largest) is refused with :class:`InvalidMergeError` naming the
    tensor and the count, or with ``overflow="saturate"`` clipped to ± the largest, with a warning
    naming the tensor. So is an inf where no input held an inf or NaN (``held``, from
    :func:`mark_nonfinite`: the math overflowed), or any inf where the dtype has none; a NaN where no
    input held one (the math overflowed: inf − inf, 0 × inf) is refused in either mode (saturating cannot
    give it a value). An input's inf, as the method combined it, stays inf, and its NaN stays NaN.

    ``again`` (elementwise math only) computes the elements whose math made an inf or NaN from finite inputs
    again, into ``x`` given their mask (:func:`~ckpt.merging.overflowing.computed_again`, which leaves those it
    could not as they were): those whose true value fits are then kept, not refused. Elsewhere ``x`` is left as the math made it, bit for bit."""
    import torch

    target = to_torch(dtype)
    if x.numel():
        fi = torch.finfo(target)
        # Half a step past the largest (the step from the two largest values: finfo's eps is not it for the fnuz
        # types); a value there rounds past it where the largest's last bit is odd (round half to even). For the
        # compute dtype itself (F32, F64) the limit is past every finite value: only an inf the math made is past.
        top = bit_pattern(torch.tensor([fi.max]).to(target))
        limit = fi.max + (fi.max - float((top - 1).view(target).double())) / 2
        odd = bool(int(top) & 1)
        lo, hi = (float(v) for v in torch.aminmax(x))  # (no tensor-sized scratch unless past, or a NaN hides it)
        if math.isnan(hi) or (hi >= limit if odd else hi > limit) or (lo <= -limit if odd else lo < -limit):
            x = x.contiguous()  # (again writes into it: a copy only for non-contiguous inputs in memory)
            new = x.isfinite().logical_not_()  # where the math made an inf or NaN from finite inputs
            if held is not None:
                new.logical_and_(held.logical_not())
            if again is not None and bool(new.any()):
                again(x, new)  # into x, the computed elements' marks cleared (the others keep the math's value)
            nans = int(new.logical_and_(x.isnan()).sum())
            if nans:
                raise InvalidMergeError(f"{name}: {nans} merged value{'s are' if nans > 1 else ' is'} NaN where no input holds an inf "
                                        "or NaN (the math overflowed: inf − inf, 0 × inf); --overflow saturate cannot clip a NaN",
                                        hint="lower the weights (or lambda); " + ("computed again in float64, these could not be "
                                        "without losing bits" if again is not None else "linear and task-arithmetic compute such "
                                        "elements again instead"))
            del new
            up, down = (x.ge(limit), x.le(-limit)) if odd else (x.gt(limit), x.lt(-limit))
            if dtype not in NO_INFINITY and held is not None:  # an input's inf stays inf
                kept = held.logical_and(x.isinf()).logical_not_()
                up.logical_and_(kept)
                down.logical_and_(kept)
            count = int(up.sum()) + int(down.sum())
            if count:
                what = f"{name}: {count} merged value{'s' if count > 1 else ''} past {dtype}'s range (±{fi.max:g})"
                if overflow != "saturate":
                    how = ", which has no infinity: cast back, torch makes them NaN or clips them" if dtype in NO_INFINITY \
                        else ": they would be stored as inf"
                    raise InvalidMergeError(what + how, hint=f"pass --overflow saturate (overflow=\"saturate\") to clip them "
                                            f"to ±{fi.max:g}, or lower the weights (or lambda)")
                log.warning("%s: clipped to ±%g (overflow=saturate)", what, fi.max)
                x = x.masked_fill_(up, fi.max).masked_fill_(down, -fi.max)
    return x.to(target)


def _inputs_themselves(step: Step, xs: list[torch.Tensor]) -> bool:
    """For inputs cut at other chunk sizes (their chunk ids cannot be compared), whether their bytes
    are equal: equal inputs then give themselves, as inputs cut alike do when their ids say so, so
    the result does not depend on the cut; unequal ones that are not floating point cannot be
    merged. Inputs cut alike were compared by their ids when planned: False, with no pass over them."""
    if not step.cut_otherwise:
        return False
    same = all(bit_identical(x, xs[0]) for x in xs[1:])
    if not same and step.dtype not in FLOAT_DTYPES:
        raise InvalidMergeError(cannot_merge(step.name, step.dtype))
    return same


class LazyTensor:
    """The bytes of one output tensor, computed on the first read of any of its chunks
    and dropped after the last one is handed out. ``gate`` lets one tensor be computed
    at a time, which bounds memory whatever the number of push workers. One is held per output tensor
    for the whole push: slots, no dict of small chunks until one is kept, and the computation (a
    closure over the step) dropped once done."""

    __slots__ = ("_compute", "_left", "_gate", "_lock", "_view", "_keep_small", "_kept", "_small")

    def __init__(self, compute: Callable[[], torch.Tensor], chunks: int, gate: threading.Lock, keep_small: int = 0,
                 kept: SmallKept | None = None) -> None:
        self._compute: Callable[[], torch.Tensor] | None = compute
        self._left = chunks
        self._gate = gate
        self._lock = threading.Lock()
        self._view: memoryview | None = None
        # A push to a remote store reads its chunks of at most ``keep_small`` bytes again, once all
        # are stored, to bundle them: those are kept (they are copied into the bundle anyway).
        self._keep_small = keep_small
        self._kept = kept
        self._small: dict[int, bytes] | None = None

    def read(self, offset: int, length: int) -> bytes | memoryview:
        with self._lock:
            if self._view is None:
                if self._left <= 0:  # read again after the last chunk: only the bundle does that
                    # (a chunk not kept is left out of the bundle)
                    return self._small.get(offset, b"") if self._small is not None else b""
                with self._gate:
                    self._view = byte_view(self._compute()).toreadonly()  # private: the push need not copy it
            out = self._view[offset : offset + length]  # keeps the tensor alive until encoded
            if length <= self._keep_small and (self._kept is None or self._kept.take(length)):
                if self._small is None:
                    self._small = {}
                self._small[offset] = bytes(out)
            self._left -= 1
            if self._left <= 0:
                self._view = self._compute = None
            return out


class SmallKept:
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


class BatchedInputs:
    """Reads the inputs of the merged tensors, in one pool of reading threads for the whole merge.
    A tensor of at most ``BATCH_BYTES`` is read with the next small ones in push order, each read
    with all its inputs in one parallel pass (from S3, 1,000 tiny tensors read one by one waited
    for 1,000 rounds of requests); the inputs read ahead are held until their tensor is computed,
    at most ``BATCH_BYTES`` per input. ``order``: the steps that read their inputs, in push order."""

    def __init__(self, order: list[Step], sources: Callable[[Step], list[CheckpointReader]]) -> None:
        from ckpt.transfer.pipeline import ReadPool

        self._order = order
        self._at = {s.name: i for i, s in enumerate(order)}
        self._sources = sources
        self._ahead: dict[str, list[torch.Tensor]] = {}
        self._ahead_bytes = 0
        self._lock = threading.Lock()
        self.pool = ReadPool()

    def read(self, step: Step) -> list[torch.Tensor]:
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

    def _fetch(self, steps: list[Step]) -> dict[str, list[torch.Tensor]]:
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

    def read_at(self, step: Step, mask: torch.Tensor) -> Iterator[Piece]:
        """For the elements whose math overflowed (:func:`cast_back`), once the inputs were consumed by the math:
        tensor ``step.name`` of each of its inputs where ``mask`` (shaped as the tensor) marks elements, a piece at a
        time (:data:`~ckpt.merging.overflowing.Piece`). Only the chunks that hold marked elements are read again
        (verified, as any read), one span of the largest chunk size of the inputs' at a time, in all inputs at once."""
        import torch

        from ckpt.transfer.pipeline import GetTask, get_chunks, spans

        sources = self._sources(step)
        # (one entry each: a merge refuses a tensor stored as shards before it plans, planning.check_whole_tensors)
        entries = [r.info(step.name) for r in sources]
        dt = to_torch(step.dtype)
        size = dt.itemsize
        chunks = [list(spans(e.chunks, e.nbytes, r.manifest.chunk_size)) for r, e in zip(sources, entries)]
        flat = mask.reshape(-1)
        # Elements per piece: the largest chunk size of the inputs', so each chunk is read at most twice (a piece's
        # edge inside it); by the first input's, a larger chunk of another was read once per piece (64 KiB then
        # 4 MiB chunks: 536 MiB read again for an 8 MiB tensor).
        span = max(1, max(r.manifest.chunk_size for r in sources) // size)
        manifests = list({r.id: r.manifest for r in sources}.values())
        store = sources[0].store

        def span_of(lo: int, hi: int) -> list[torch.Tensor]:
            """Bytes ``lo:hi`` of the tensor in each input, from the chunks that hold them."""
            tasks, bufs = [], []
            for r, cs in zip(sources, chunks):
                first, last = lo // r.manifest.chunk_size, (hi - 1) // r.manifest.chunk_size
                start = cs[first][2]
                buf = torch.empty(cs[last][2] + cs[last][1] - start, dtype=torch.uint8)
                view = byte_view(buf)
                tasks += [GetTask(cid, n, into=view[pos - start : pos - start + n]) for cid, n, pos in cs[first : last + 1]]
                bufs.append((buf, lo - start))
            get_chunks(store.objects, tasks, store.settings, manifest=manifests, pool=self.pool)
            parts = [buf[off : off + hi - lo] for buf, off in bufs]  # (a copy only where not at an element's bytes)
            return [(p if p.storage_offset() % size == 0 else p.clone()).view(dt) for p in parts]

        for at in range(0, flat.numel(), span):
            m = flat[at : at + span]
            if bool(m.any()):  # (read in a function: nothing here holds a span's chunks while the next is read)
                yield at, m, span_of(at * size, (at + m.numel()) * size)


def step_sources(method: MergeMethod, readers: list[CheckpointReader], base: CheckpointReader | None,
                 ) -> Callable[[Step], list[CheckpointReader]]:
    """The checkpoints a computed step reads: the holders of an averaged tensor; else the inputs and,
    where the method has one, the base (as the chunk ids are compared)."""
    both = readers + ([base] if method.needs_base and base is not None else [])
    return lambda step: list(step.average) if step.average is not None else both


def step_computation(step: Step, method: MergeMethod, params: Mapping[str, Any], readers: list[CheckpointReader],
                     base: CheckpointReader | None, reads: BatchedInputs, overflow: str = "error") -> Callable[[], torch.Tensor]:
    """The function that computes ``step``'s output tensor when its first chunk is read (``overflow``:
    see :func:`cast_back`)."""
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
            acc, held = plain_average(xs, cd)
            out = cast_back(acc, step.dtype, step.name, held, overflow, average_again(xs))
            del xs
            return out.contiguous()
        xs = reads.read(step)  # (the base too, where the method has one: see step_sources)
        if (identity or step.dtype not in FLOAT_DTYPES) and _inputs_themselves(step, xs):
            return xs[0]
        held = None  # where an input (or the base) holds an inf or NaN
        for i in range(len(xs)):  # (no loop variable: it would keep the last input alive past the math)
            xs[i] = xs[i].to(cd)  # one at a time: an upcast copy replaces its source
            held = mark_nonfinite(xs[i], held)
        b_read = method.needs_base and base is not None
        b = xs.pop() if b_read else None
        with torch.no_grad():
            out = method.combine(xs, b, params, step.name)
        del xs, b
        # (the inputs are consumed: read again where the math overflowed)
        again = method_again(method, params, step.name, b_read, cd, lambda mask: reads.read_at(step, mask))
        out = cast_back(out, step.dtype, step.name, held, overflow, again).contiguous()
        _trim()
        return out

    return compute
