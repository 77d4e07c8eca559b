"""Pull: a checkpoint becomes files again (byte-identical), or tensors in memory.

Files are written under a temporary name and renamed into place, so a failed
or interrupted pull never leaves a partial destination.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ckpt.format.dtypes import byte_view, to_torch
from ckpt.errors import DestinationExistsError, ResourceLimitError, TensorMismatchError
from ckpt.format.manifest import FileEntry, Manifest, TensorEntry, split_lengths
from ckpt.transfer.pipeline import GetTask, get_chunks
from ckpt.progress import NullProgress, Progress
from ckpt.format.safetensors_header import build_header

if TYPE_CHECKING:
    import torch

    from ckpt.store.store import Store


def _spans(chunks: Iterable[str], nbytes: int, chunk_size: int, base: int = 0) -> Iterator[tuple[str, int, int]]:
    """(chunk id, length, offset) of each chunk of ``nbytes`` bytes starting at ``base``."""
    pos = base
    for cid, n in zip(chunks, split_lengths(nbytes, chunk_size)):
        yield cid, n, pos
        pos += n


def _chunk_tasks(chunks: Iterable[str], nbytes: int, chunk_size: int, sink_at: Callable[[int], Callable[[bytes], None]], base: int = 0) -> list[GetTask]:
    return [GetTask(cid, n, sink_at(pos)) for cid, n, pos in _spans(chunks, nbytes, chunk_size, base)]


def _file_tasks(m: Manifest, f: FileEntry, fd: int) -> list[GetTask]:
    def at(off: int) -> Callable[[bytes], None]:
        return lambda data: _pwrite_all(fd, data, off)

    if f.kind == "blob":
        return _chunk_tasks(f.chunks, f.size, m.chunk_size, at)
    tasks = _chunk_tasks(f.chunks, f.head_size, m.chunk_size, at)
    pos = f.head_size
    for t in m.tensors:
        if t.file == f.path:
            tasks += _chunk_tasks(t.chunks, t.nbytes, m.chunk_size, at, pos)
            pos += t.nbytes
    return tasks


def _pwrite_all(fd: int, data: bytes | memoryview, off: int) -> None:
    view = memoryview(data)
    start, length = off, len(view)
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n
    _start_writeback(fd, start, length)


def _sync_file_range() -> object:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return fn
    except (OSError, AttributeError):
        return None


_SFR = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, off: int, length: int) -> None:
    """Start writing this range to disk now (Linux), so the final fsync has little left.

    Measured by benchmarks/push_pull.py: without it the kernel starts writeback only
    after ~2 GB are dirty and a 1 GB pull waited on one long fsync (499 -> 787 MB/s).
    """
    if _SFR is not None and length:
        _SFR(fd, off, length, _SYNC_FILE_RANGE_WRITE)  # type: ignore[operator]


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(entries: Iterable[TensorEntry], what: str) -> None:
    """Refuse, before allocating, tensors that together claim more than this machine's memory.

    A manifest is data read from a store: a tensor of 2**38 elements that references
    one real chunk 65536 times is a valid description of a terabyte, so the claim
    itself must be bounded, not only each chunk's decoded size.
    """
    need = sum(t.nbytes for t in entries)
    have = _physical_memory()
    if have is not None and need > have:
        raise ResourceLimitError(f"{what} needs {need:,} bytes of memory; this machine has {have:,}",
                                 hint="load a subset with include=[...] or `ckpt pull` it to disk")


def empty_tensor(entry: TensorEntry, **kwargs: Any) -> Any:
    """``torch.empty`` for ``entry``; an allocation failure is a :class:`ResourceLimitError`."""
    import torch

    try:
        return torch.empty(entry.shape, dtype=to_torch(entry.dtype), **kwargs)
    except RuntimeError as e:  # torch reports an out-of-memory allocation this way
        raise ResourceLimitError(f"cannot allocate tensor {entry.name!r} ({entry.nbytes:,} bytes): {str(e)[:200]}") from None


def _check_disk(files: list[tuple[FileEntry, str]]) -> None:
    need = sum(f.size for f, _ in files)
    if not files:
        return
    where = os.path.dirname(os.path.abspath(files[0][1]))
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)  # the file's directory may not exist yet
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if need > free:
        raise ResourceLimitError(f"pulling needs {need:,} bytes; {where} has {free:,} free", hint="free space or pull elsewhere")


def _write_files(store: Store, m: Manifest, files: list[tuple[FileEntry, str]], progress: Progress, extra_tasks: Callable[[int], list[GetTask]] | None = None) -> None:
    """Write each (entry, path) in parallel; tasks of all files share one pool."""
    fds = []
    try:
        _check_disk(files)
        tasks: list[GetTask] = []
        for f, path in files:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            os.ftruncate(fd, f.size)
            tasks += extra_tasks(fd) if extra_tasks else _file_tasks(m, f, fd)
        progress.start("pull", sum(t.length for t in tasks))
        get_chunks(store.objects, tasks, store.settings, progress)
        progress.finish()
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)


def pull(store: Store, ref: str, dest: str | os.PathLike[str], *, overwrite: bool = False, include: list[str] | None = None, progress: Progress | None = None) -> str:
    m = store.manifest(ref)
    progress = progress or NullProgress()
    dest = os.fspath(dest)
    if m.source == "dcp":  # a distributed checkpoint: its shards consolidated into one file
        from ckpt.dcp.consolidate import pull_dcp

        return pull_dcp(store, m, dest, include, overwrite, progress)
    single = m.source != "hf-dir" and len(m.files) == 1
    if include:
        return _pull_selected(store, m, dest, include, overwrite, progress)
    if single:
        target = os.path.join(dest, os.path.basename(m.files[0].path)) if os.path.isdir(dest) else dest
        if os.path.exists(target) and not overwrite:
            raise DestinationExistsError(f"{target} exists", hint="pass --force to replace it")
        tmp = f"{target}.ckpt-tmp-{uuid.uuid4().hex[:8]}"
        try:
            _write_files(store, m, [(m.files[0], tmp)], progress)
            os.replace(tmp, target)
            _fsync_dir(target)
        finally:
            _remove(tmp)
        return target
    # A directory checkpoint: build it beside the destination, then swap it in.
    dest = dest.rstrip("/") or "/"
    if os.path.exists(dest) and not (os.path.isdir(dest) and not os.listdir(dest)) and not overwrite:
        raise DestinationExistsError(f"{dest} exists and is not empty", hint="pass --force to replace it")
    tmp = f"{dest}.ckpt-tmp-{uuid.uuid4().hex[:8]}"
    old = f"{dest}.ckpt-old-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(tmp)
        _write_files(store, m, [(f, os.path.join(tmp, *f.path.split("/"))) for f in m.files], progress)
        if os.path.lexists(dest):
            os.rename(dest, old)
        os.rename(tmp, dest)
        _fsync_dir(dest)
    finally:
        _remove(tmp)
        _remove(old)
    return dest


def _fsync_dir(path: str) -> None:
    """Make a rename into ``path``'s directory durable."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def select(m: Manifest, include: list[str] | None) -> list[TensorEntry]:
    if not include:
        return list(m.tensors)
    return [t for t in m.tensors if any(fnmatch.fnmatchcase(t.name, p) for p in include)]


def _pull_selected(store: Store, m: Manifest, dest: str, include: list[str], overwrite: bool, progress: Progress) -> str:
    """Only the tensors matching ``include``, as one new safetensors file."""
    tensors = select(m, include)
    if not tensors:
        raise TensorMismatchError(f"no tensor matches {' '.join(include)}", hint="see the names with `ckpt show`")
    target = os.path.join(dest, "model.safetensors") if os.path.isdir(dest) else dest
    if os.path.exists(target) and not overwrite:
        raise DestinationExistsError(f"{target} exists", hint="pass --force to replace it")
    meta = next((f.metadata for f in m.files if f.kind == "safetensors" and f.metadata), None)
    head, order = build_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], meta)
    size = len(head) + sum(t.nbytes for t in tensors)

    def tasks(fd: int) -> list[GetTask]:
        _pwrite_all(fd, head, 0)
        out: list[GetTask] = []
        pos = len(head)
        for i in order:
            t = tensors[i]
            out += _chunk_tasks(t.chunks, t.nbytes, m.chunk_size, lambda off: lambda d: _pwrite_all(fd, d, off), pos)
            pos += t.nbytes
        return out

    tmp = f"{target}.ckpt-tmp-{uuid.uuid4().hex[:8]}"
    try:
        _write_files(store, m, [(FileEntry("selected.safetensors", "safetensors", size, (), len(head), meta), tmp)], progress, tasks)
        os.replace(tmp, target)
        _fsync_dir(target)
    finally:
        _remove(tmp)
    return target


def _into_tasks(m: Manifest, pairs: list[tuple[TensorEntry, torch.Tensor]]) -> list[GetTask]:
    """Tasks that decode each entry's chunks straight into its destination's memory."""
    tasks: list[GetTask] = []
    for entry, dst in pairs:
        view = byte_view(dst)
        tasks += [GetTask(cid, n, into=view[pos : pos + n]) for cid, n, pos in _spans(entry.chunks, entry.nbytes, m.chunk_size)]
    return tasks


def load(store: Store, ref: str, *, include: list[str] | None = None, progress: Progress | None = None) -> dict[str, torch.Tensor]:

    m = store.manifest(ref)
    if m.source == "dcp":  # a distributed checkpoint: whole tensors, consolidated from its shards
        from ckpt.dcp.consolidate import load_dcp

        return load_dcp(store, m, include, progress)
    out: dict[str, torch.Tensor] = {}
    pairs = []
    chosen = list(select(m, include))
    check_memory(chosen, f"checkpoint {ref}")
    for t in chosen:
        if t.name in out:
            raise TensorMismatchError(f"tensor {t.name!r} appears in two files of this checkpoint", hint="use `ckpt pull`")
        dst = empty_tensor(t)
        out[t.name] = dst
        pairs.append((t, dst))
    tasks = _into_tasks(m, pairs)
    progress = progress or NullProgress()
    progress.start("load", sum(t.length for t in tasks))
    get_chunks(store.objects, tasks, store.settings, progress)
    progress.finish()
    return out


def load_into(store: Store, ref: str, target: Any, *, strict: bool = True, progress: Progress | None = None) -> None:
    """Decode straight into ``target``'s tensors (an ``nn.Module`` or a dict of tensors)."""
    import torch

    m = store.manifest(ref)
    live: dict[str, torch.Tensor] = dict(target.state_dict()) if isinstance(target, torch.nn.Module) else dict(target)
    if m.source == "dcp":  # a distributed checkpoint: whole tensors assembled from its shards
        from ckpt.dcp.consolidate import fill_dcp

        return fill_dcp(store, m, live, strict, progress)
    by_name = {t.name: t for t in m.tensors}
    missing = sorted(set(live) - set(by_name))
    unexpected = sorted(set(by_name) - set(live))
    if strict and (missing or unexpected):
        raise TensorMismatchError(
            f"checkpoint and target differ: missing in checkpoint {missing[:10]}, not in target {unexpected[:10]}"
            + (" ..." if len(missing) > 10 or len(unexpected) > 10 else ""),
            hint="pass strict=False to load the common tensors",
        )
    fill(store, m, [(by_name[n], dst) for n, dst in live.items() if n in by_name], progress)


def fill(store: Store, m: Manifest, pairs: list[tuple[TensorEntry, torch.Tensor]], progress: Progress | None = None) -> None:
    """Decode each entry's chunks into its destination tensor, in place, all in one parallel pass.

    Contiguous CPU tensors receive the bytes directly; others (CUDA, strided) get them
    through one host buffer (pinned for CUDA) and a single copy. A shape or dtype
    mismatch is an error naming every offending tensor, raised before any write.
    """
    import torch

    bad = [f"{e.name}: checkpoint {e.dtype}{list(e.shape)} vs target {d.dtype}{list(d.shape)}"
           for e, d in pairs if tuple(d.shape) != e.shape or d.dtype != to_torch(e.dtype)]
    if bad:
        raise TensorMismatchError("shape or dtype mismatch: " + "; ".join(bad[:10]) + (" ..." if len(bad) > 10 else ""))
    direct = []
    staged = []
    for entry, dst in pairs:
        dst = dst.detach()
        if dst.device.type == "cpu" and dst.is_contiguous():
            direct.append((entry, dst))
        else:  # decode on the host, then one copy to where the tensor lives
            tmp = torch.empty(entry.shape, dtype=dst.dtype, pin_memory=dst.device.type == "cuda")
            direct.append((entry, tmp))
            staged.append((dst, tmp))
    tasks = _into_tasks(m, direct)
    progress = progress or NullProgress()
    progress.start("load", sum(t.length for t in tasks))
    get_chunks(store.objects, tasks, store.settings, progress)
    progress.finish()
    with torch.no_grad():
        for dst, tmp in staged:
            dst.copy_(tmp, non_blocking=tmp.is_pinned())
    if any(d.device.type == "cuda" for d, _ in staged):
        torch.cuda.synchronize()
