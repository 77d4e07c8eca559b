"""Reading distributed checkpoints: stored shards into regions of tensors.

One mechanism serves every reader: a :class:`Copy` names a region of a stored
shard and the tensor view it goes to. A region that is the whole shard and a
contiguous CPU destination is decoded straight into the destination; any other
region is decoded into a buffer of the shard rows it spans, a piece of at most
:data:`PIECE_BYTES` at a time (only the chunks that overlap it are fetched), and
copied from there. The DCP :class:`~ckpt.dcp.Reader` (resharding on load),
``Store.load`` and ``load_into`` of a distributed checkpoint (whole tensors) and ``ckpt pull``
(one consolidated safetensors file) all go through :func:`run_copies`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.dcp.format import DCP_SOURCE, Shard, TensorItem, decode_layout
from ckpt.errors import TensorMismatchError
from ckpt.format.dtypes import byte_view, itemsize, to_torch
from ckpt.format.entries import TensorEntry, split_lengths
from ckpt.format.manifest import Manifest
from ckpt.format.names import name_selected
from ckpt.progress import NullProgress, Progress, reporting
from ckpt.transfer.pipeline import GetTask, ReadPool, get_chunks
from ckpt_store.storage.errors import StoreFormatError

if TYPE_CHECKING:
    import torch

    from ckpt.store.store import Store

# Bytes decoded per parallel pass: bounds the buffers (and, for a pull, the tensors) held at once.
BATCH_BYTES = 256 * 1024 * 1024
# Rows of a stored shard buffered for one piece of a region read through a buffer (one row at least):
# a region that needs every row of a large shard (stored row-sharded, loaded column-sharded) is read
# a piece at a time, not into a buffer of the whole shard.
PIECE_BYTES = BATCH_BYTES // 4


@dataclass
class Copy:
    """Region ``[src_off, src_off + lengths)`` of stored shard ``entry`` goes to ``dst``
    (a tensor of shape ``lengths`` and the entry's dtype, anywhere, any strides)."""

    entry: TensorEntry
    src_off: tuple[int, ...]
    lengths: tuple[int, ...]
    dst: torch.Tensor
    done: Callable[[torch.Tensor], None] | None = None


def narrow(t: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, o, n)
    return t


def _byte_range(shape: tuple[int, ...], off: tuple[int, ...], lengths: tuple[int, ...], elem: int) -> tuple[int, int]:
    """Smallest byte range of a row-major tensor of ``shape`` holding the region."""
    def flat(idx: Iterable[int]) -> int:
        pos = 0
        for i, n in zip(idx, shape):
            pos = pos * n + i
        return pos

    last = tuple(o + n - 1 for o, n in zip(off, lengths))
    return flat(off) * elem, (flat(last) + 1) * elem


def _direct(c: Copy) -> bool:
    """Whether ``c`` is decoded straight into its destination (the whole shard, a contiguous CPU tensor)."""
    return not any(c.src_off) and c.lengths == c.entry.shape and c.dst.device.type == "cpu" and c.dst.is_contiguous()


def _row_bytes(e: TensorEntry) -> int:
    return math.prod(e.shape[1:]) * (itemsize(e.dtype) or 1)


def _copy_bytes(c: Copy) -> int:
    """Memory the copy takes in a pass: its region, or the shard rows buffered for it."""
    if _direct(c) or not c.lengths:
        return math.prod(c.lengths) * (itemsize(c.entry.dtype) or 1)
    return c.lengths[0] * _row_bytes(c.entry)


def _pieces(c: Copy) -> list[Copy]:
    """``c`` as copies of at most :data:`PIECE_BYTES` of its shard's rows each where it goes through a
    buffer; the last one calls ``c.done`` with the whole destination."""
    if _direct(c) or not c.lengths or math.prod(c.lengths) == 0 or tuple(c.dst.shape) != c.lengths:
        return [c]  # (a destination that does not fit is refused as it is, by _run_batch)
    rows = max(1, PIECE_BYTES // max(1, _row_bytes(c.entry)))
    n = c.lengths[0]
    if n <= rows:
        return [c]
    out = [Copy(c.entry, (c.src_off[0] + i, *c.src_off[1:]), (min(rows, n - i), *c.lengths[1:]), c.dst.narrow(0, i, min(rows, n - i)))
           for i in range(0, n, rows)]
    if c.done is not None:
        done, dst = c.done, c.dst
        out[-1].done = lambda _piece: done(dst)
    return out


def run_copies(store: Store, m: Manifest, copies: list[Copy], progress: Progress | None = None,
               get: Callable[[list[GetTask], Progress], None] | None = None, pool: ReadPool | None = None) -> None:
    """Perform every copy, fetching chunks in parallel, in passes of about :data:`BATCH_BYTES`.

    ``progress`` is advanced by the decoded bytes of each chunk (the caller starts and finishes it).
    ``get(tasks, progress)`` fetches chunks instead of ``store`` (snapshot tiers). ``pool``: the
    reading threads, and the bundles fetched, of an operation of several calls (a pull's batches);
    by default this call's own: a bundle of ``m`` is fetched once, not again by each pass that
    needs a member of it (kept within ``inflight_mb``, as :class:`ReadPool` keeps them)."""
    if get is None and pool is None:
        with ReadPool() as own:
            run_copies(store, m, copies, progress, pool=own)
        return
    batch: list[Copy] = []
    size = 0
    for c in (p for c in copies for p in _pieces(c)):
        batch.append(c)
        size += _copy_bytes(c)
        if size >= BATCH_BYTES:
            _run_batch(store, m, batch, progress, get, pool)
            batch, size = [], 0
    if batch:
        _run_batch(store, m, batch, progress, get, pool)


def _run_batch(store: Store, m: Manifest, copies: list[Copy], progress: Progress | None,
               get: Callable[[list[GetTask], Progress], None] | None = None, pool: ReadPool | None = None) -> None:
    import torch

    cs = m.chunk_size
    tasks: list[GetTask] = []
    post: list[tuple[str | None, Copy]] = []
    regions: dict[str, list[Copy]] = {}  # entry -> the regions read from it through a buffer
    for c in copies:
        e = c.entry
        if tuple(c.dst.shape) != c.lengths or c.dst.dtype != to_torch(e.dtype):
            raise TensorMismatchError(f"{e.name}: region {list(c.lengths)} of {e.dtype} does not fit a "
                                      f"{c.dst.dtype} tensor of shape {list(c.dst.shape)}")
        if math.prod(c.lengths) == 0:
            post.append((None, c))
            continue
        if _direct(c):
            view = byte_view(c.dst)
            lengths = split_lengths(e.nbytes, cs)
            tasks += [GetTask(cid, n, into=view[i * cs : i * cs + n]) for i, (cid, n) in enumerate(zip(e.chunks, lengths))]
            post.append((None, c))
            continue
        regions.setdefault(e.name, []).append(c)
        post.append((e.name, c))
    slabs: dict[str, tuple[torch.Tensor, int]] = {}  # entry -> (its rows that the regions span, the first one)
    for name, cs_ in regions.items():
        e = cs_[0].entry
        slab, first, buf_tasks = _slab(e, cs_, cs)
        slabs[name] = (slab, first)
        tasks += buf_tasks
    if get is not None:
        get(tasks, progress or NullProgress())
    else:
        get_chunks(store.objects, tasks, store.settings, progress or NullProgress(), manifest=m, pool=pool)  # (its bundles too)
    with torch.no_grad():
        for name, c in post:
            if name is not None:
                slab, first = slabs[name]
                c.dst.copy_(narrow(slab, (c.src_off[0] - first, *c.src_off[1:]) if c.src_off else (), c.lengths))
            if c.done is not None:
                c.done(c.dst)


def _slab(e: TensorEntry, regions: list[Copy], cs: int) -> tuple[torch.Tensor, int, list[GetTask]]:
    """A buffer for ``regions`` of stored shard ``e``: the rows (along its first dimension) that they
    span, as a tensor, with the first row's index, and the tasks that fetch into it the chunks
    holding the regions' bytes. Not the whole shard: a tensor stored column-sharded and loaded
    row-sharded reads a few rows of each shard on each rank."""
    import torch

    elem = itemsize(e.dtype) or 1
    row = _row_bytes(e)
    first = min(c.src_off[0] for c in regions) if e.shape else 0
    end = max(c.src_off[0] + c.lengths[0] for c in regions) if e.shape else 1  # (a scalar: one row)
    want: set[int] = set()
    for c in regions:
        lo, hi = _byte_range(e.shape, c.src_off, c.lengths, elem)
        want.update(range(lo // cs, (hi - 1) // cs + 1))
    lengths = split_lengths(e.nbytes, cs)
    # bytes [start, stop) of the shard: its rows first..end and the chunks that hold the regions (which
    # may begin before the first row or end after the last), from an element boundary
    start = min(first * row, min(want) * cs) // elem * elem
    stop = -(-max(end * row, max(i * cs + lengths[i] for i in want)) // elem) * elem
    buf = torch.empty((stop - start) // elem, dtype=to_torch(e.dtype))
    view = byte_view(buf)
    tasks = [GetTask(e.chunks[i], lengths[i], into=view[i * cs - start : i * cs - start + lengths[i]]) for i in sorted(want)]
    slab = buf[(first * row - start) // elem : (end * row - start) // elem].view(*e.shape[:1] and (end - first,), *e.shape[1:])
    return slab, first, tasks


# -- whole tensors -------------------------------------------------------------------
def shard_copies(item: TensorItem, full: torch.Tensor, entries: dict[str, TensorEntry], what: str) -> list[Copy]:
    """Copies that fill ``full`` (the whole tensor ``item``) from its stored shards (``what``: the checkpoint,
    as :func:`shard_entry` names it)."""
    out = []
    for s in item.shards:
        out.append(Copy(shard_entry(item, s, entries, what), (0,) * len(s.sizes), s.sizes, narrow(full, s.offsets, s.sizes)))
    return out


def shard_entry(item: TensorItem, shard: Shard, entries: dict[str, TensorEntry], what: str) -> TensorEntry:
    """The manifest entry holding ``shard`` of ``item``: one of the shard's shape and the item's dtype,
    else a :class:`StoreFormatError` naming ``what`` (the checkpoint: ``manifest ID``, ``checkpoint REF``)
    (a region read from an entry of another shape is wrong data)."""
    e = entries.get(shard.entry)
    if e is None or e.shape != shard.sizes or e.dtype != item.dtype:
        raise StoreFormatError(f"{what}: tensor {item.fqn}: shard {shard.entry!r} is missing or does not match its entry")
    return e


def _selected(m: Manifest, include: list[str] | None, what: str) -> list[TensorItem]:
    # (each error names ``what``, the checkpoint: it said "manifest: ..." of whichever a pull or load read)
    layout = decode_layout(m.extra, what)
    items = [t for t in layout.tensors.values() if name_selected(t.fqn, include)]
    if include and not items:
        raise TensorMismatchError(f"no tensor matches {' '.join(include)}", hint="see the names with `ckpt show --json` (extra.dcp.items)")
    check_entries(m, items, what)
    return items


def check_entries(m: Manifest, items: Iterable[TensorItem], what: str) -> None:
    """Every shard of ``items`` against its entry of ``m`` (:func:`shard_entry`), before anything is
    allocated for them: a layout's size is checked only against its shards, and a forged one of
    terabytes would be allocated (or preallocated as a pulled file) before its entries told it apart."""
    entries = {t.name: t for t in m.tensors}
    for t in items:
        for sh in t.shards:
            shard_entry(t, sh, entries, what)


def is_dcp(m: Manifest) -> bool:
    return m.source == DCP_SOURCE


def load_dcp(store: Store, m: Manifest, include: list[str] | None, progress: Progress | None, what: str) -> dict[str, Any]:
    """Every tensor of a distributed checkpoint, whole (consolidated from its shards), on the CPU.
    ``what``: the checkpoint, as errors name it (``checkpoint REF``)."""
    import torch

    entries = {t.name: t for t in m.tensors}
    out: dict[str, torch.Tensor] = {}
    copies: list[Copy] = []
    items = _selected(m, include, what)
    for item in items:
        full = torch.empty(item.size, dtype=to_torch(item.dtype))
        out[item.fqn] = full
        copies += shard_copies(item, full, entries, what)
    with reporting(progress, "load", sum(t.nbytes for t in items)) as p:
        run_copies(store, m, copies, p)
    return out


def fill_dcp(store: Store, m: Manifest, pair: Callable[[Iterable[str]], dict[str, Any]],
             progress: Progress | None, what: str) -> None:
    """Decode a distributed checkpoint's whole tensors, in place, into the tensors (any device) that
    ``pair`` gives by the stored names each loads from, given the names the checkpoint holds
    (:func:`~ckpt.store.load.pair_names`, which refuses a mismatch)."""
    items = {t.fqn: t for t in _selected(m, None, what)}
    live = pair(items)
    entries = {t.name: t for t in m.tensors}
    copies: list[Copy] = []
    for name in sorted(set(live) & set(items)):
        item, dst = items[name], live[name].detach()
        if tuple(dst.shape) != item.size or dst.dtype != to_torch(item.dtype):
            raise TensorMismatchError(f"{name}: checkpoint {item.dtype}{list(item.size)} vs target {dst.dtype}{list(dst.shape)}")
        copies += shard_copies(item, dst, entries, what)
    with reporting(progress, "load", sum(items[n].nbytes for n in set(live) & set(items))) as p:
        run_copies(store, m, copies, p)


def pull_dcp(store: Store, m: Manifest, dest: str, include: list[str] | None, overwrite: bool, progress: Progress | None,
             what: str) -> str:
    """Write a distributed checkpoint as one consolidated safetensors file; returns its path.

    Tensors are assembled in memory a batch (about :data:`BATCH_BYTES`) at a time and
    written at their offsets; the file appears only when complete. The destination
    follows :mod:`ckpt.store.destination`'s rule, as every pull does; a target named like a
    torch file gets a torch file of the whole tensors and (without ``include``) the non-tensor
    values, each under its flat DCP name (see :func:`ckpt.store.pull.pull`)."""
    import torch

    from ckpt.format.safetensors_header import build_header
    from ckpt.store.destination import OutputFile, file_target, is_torch_name, write_files, write_torch
    from ckpt.store.limits import check_disk

    items = _selected(m, include, what)
    target = file_target(store, dest, "model.safetensors", overwrite)
    if is_torch_name(target):  # non-tensor state (a step, a scheduler) too, under its flat key, as DCP saved it
        values = {} if include else decode_layout(m.extra, what).values
        write_torch(target, load_dcp(store, m, include, progress, what), values, overwrite)
        return target
    meta = m.files[0].metadata if m.files else None
    head, order = build_header([(t.fqn, t.dtype, t.size, t.nbytes) for t in items], meta)
    entries = {t.name: t for t in m.tensors}
    total = len(head) + sum(t.nbytes for t in items)
    check_disk(total, target)  # (refused before the disk fills, as every pull is)

    def fill(tmps: list[str]) -> None:
        with OutputFile(tmps[0], total) as out, ReadPool() as pool, \
                reporting(progress, "pull", sum(t.nbytes for t in items)) as p:
            out.write_at(head, 0)
            pos = len(head)
            batch: list[tuple[int, torch.Tensor]] = []
            copies: list[Copy] = []

            def flush() -> None:
                run_copies(store, m, copies, p, pool=pool)  # (the file's batches share its bundles)
                for at, full in batch:
                    out.write_at(byte_view(full), at)
                batch.clear()
                copies.clear()

            size = 0
            for i in order:
                item = items[i]
                full = torch.empty(item.size, dtype=to_torch(item.dtype))
                batch.append((pos, full))
                copies.extend(shard_copies(item, full, entries, what))
                pos += item.nbytes
                size += item.nbytes
                if size >= BATCH_BYTES:
                    flush()
                    size = 0
            flush()

    write_files([target], fill, overwrite)
    return target
