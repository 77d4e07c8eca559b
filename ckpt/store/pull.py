"""Pull: a checkpoint becomes files again (byte-identical), or tensors in memory.

Files are written under a temporary name and renamed into place, so a failed
or interrupted pull never leaves a partial destination; where a pull may write at
all is :mod:`ckpt.store.destination`'s rule.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ckpt.store.destination import dir_targets, file_target, write_dir, write_files
from ckpt.format.dtypes import byte_view, to_torch
from ckpt.errors import ResourceLimitError, TensorMismatchError
from ckpt.format.manifest import FileEntry, Manifest, TensorEntry, split_lengths
from ckpt.transfer.pipeline import GetTask, get_chunks
from ckpt.progress import NullProgress, Progress
from ckpt.format.safetensors_header import build_header
from ckpt.store.sources import STATE_DICT_SUFFIXES

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
    """Write each (entry, path) in parallel; tasks of all files share one pool.

    Each path is a fresh temporary name (see :mod:`ckpt.store.destination`): it is created
    exclusively, so nothing that was already there is ever written through.
    """
    fds = []
    try:
        _check_disk(files)
        tasks: list[GetTask] = []
        for f, path in files:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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


def is_torch_name(path: str) -> bool:
    """Whether ``path`` is named like a torch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``)."""
    return path.lower().endswith(STATE_DICT_SUFFIXES)


def pull(store: Store, ref: str, dest: str | os.PathLike[str], *, overwrite: bool = False, include: list[str] | None = None, progress: Progress | None = None) -> str:
    """Write checkpoint ``ref`` to ``dest``; returns the path written. See :meth:`Store.pull`.

    Where and how it writes (never inside a store, only the checkpoint's own files,
    each atomically) is :mod:`ckpt.store.destination`'s rule. A one-file target named like a
    torch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``) gets what the name promises: a
    file ``torch.load(weights_only=True)`` reads, holding a flat dict of the tensors
    (bit-identical, keys as stored: a nested state dict's keys joined with ``.``) and,
    for a checkpoint pushed from a ``.pt`` file, its non-tensor values under their
    flat keys. Raises :class:`DestinationError` / :class:`DestinationExistsError`
    before anything is written.
    """
    m = store.manifest(ref)
    progress = progress or NullProgress()
    dest = os.fspath(dest)
    if m.source == "dcp":  # a distributed checkpoint: its shards consolidated into one file
        from ckpt.dcp.consolidate import pull_dcp

        return pull_dcp(store, m, dest, include, overwrite, progress)
    if include:
        return _pull_selected(store, m, dest, include, overwrite, progress)
    if m.source != "hf-dir" and len(m.files) == 1:
        target = file_target(store, dest, os.path.basename(m.files[0].path), overwrite)
        if is_torch_name(target):
            write_torch(target, load_manifest(store, m, None, progress, f"checkpoint {ref}"), _values(m))
        else:
            write_files([target], lambda tmps: _write_files(store, m, [(m.files[0], tmps[0])], progress))
        return target
    root, targets = dir_targets(store, dest, [f.path for f in m.files], overwrite)
    write_dir(root, targets, lambda paths: _write_files(store, m, list(zip(m.files, paths)), progress))
    return root


def _values(m: Manifest) -> dict[str, Any]:
    """The non-tensor values of a checkpoint pushed from a ``.pt`` file (flat keys), else none."""
    return dict(m.extra) if m.source == "state-dict" and isinstance(m.extra, dict) else {}


def write_torch(target: str, tensors: dict[str, torch.Tensor], values: dict[str, Any]) -> None:
    """Write ``tensors`` and JSON ``values`` as one flat dict to torch file ``target``, atomically.

    Everything in it (tensors and JSON types) loads with ``torch.load(weights_only=True)``.
    """
    import torch

    clash = sorted(set(tensors) & set(values))
    if clash:
        raise TensorMismatchError(f"{clash[0]!r} names both a tensor and a value of this checkpoint",
                                  hint="pull it as .safetensors (tensors only)")
    obj: dict[str, Any] = {**tensors, **values}

    def fill(tmps: list[str]) -> None:
        fd = os.open(tmps[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    write_files([target], fill)


def select(m: Manifest, include: list[str] | None) -> list[TensorEntry]:
    if not include:
        return list(m.tensors)
    return [t for t in m.tensors if any(fnmatch.fnmatchcase(t.name, p) for p in include)]


def check_unique(entries: Iterable[TensorEntry], hint: str) -> None:
    """Refuse tensors of the same name (from two files of a directory checkpoint): one file
    or dict cannot hold both, and picking one silently would lose the other."""
    seen: dict[str, TensorEntry] = {}
    for t in entries:
        if t.name in seen:
            raise TensorMismatchError(f"tensor {t.name!r} appears in two files of this checkpoint "
                                      f"({seen[t.name].file} and {t.file})", hint=hint)
        seen[t.name] = t


def _pull_selected(store: Store, m: Manifest, dest: str, include: list[str], overwrite: bool, progress: Progress) -> str:
    """Only the tensors matching ``include``, as one new safetensors (or torch) file."""
    tensors = select(m, include)
    if not tensors:
        raise TensorMismatchError(f"no tensor matches {' '.join(include)}", hint="see the names with `ckpt show`")
    check_unique(tensors, "pull without --include: each file is written as it was pushed")
    target = file_target(store, dest, "model.safetensors", overwrite)
    if is_torch_name(target):
        write_torch(target, load_manifest(store, m, include, progress, "the selected tensors"), {})
        return target
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

    entry = FileEntry("selected.safetensors", "safetensors", size, (), len(head), meta)
    write_files([target], lambda tmps: _write_files(store, m, [(entry, tmps[0])], progress, tasks))
    return target


def _into_tasks(m: Manifest, pairs: list[tuple[TensorEntry, torch.Tensor]]) -> list[GetTask]:
    """Tasks that decode each entry's chunks straight into its destination's memory."""
    tasks: list[GetTask] = []
    for entry, dst in pairs:
        view = byte_view(dst)
        tasks += [GetTask(cid, n, into=view[pos : pos + n]) for cid, n, pos in _spans(entry.chunks, entry.nbytes, m.chunk_size)]
    return tasks


def load(store: Store, ref: str, *, include: list[str] | None = None, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    return load_manifest(store, store.manifest(ref), include, progress, f"checkpoint {ref}")


def load_manifest(store: Store, m: Manifest, include: list[str] | None, progress: Progress | None, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``m`` (or those matching ``include``) as CPU tensors, by name."""
    if m.source == "dcp":  # a distributed checkpoint: whole tensors, consolidated from its shards
        from ckpt.dcp.consolidate import load_dcp

        return load_dcp(store, m, include, progress)
    out: dict[str, torch.Tensor] = {}
    pairs = []
    chosen = list(select(m, include))
    check_unique(chosen, "use `ckpt pull`")
    check_memory(chosen, what)
    for t in chosen:
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
