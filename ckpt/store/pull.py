"""Pull: a checkpoint becomes files again, byte-identical to what was pushed.

Files are written under a temporary name and renamed into place, so a failed
or interrupted pull never leaves a partial destination; where a pull may write at
all is :mod:`ckpt.store.destination`'s rule.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from ckpt.errors import DestinationError, TensorMismatchError
from ckpt.format.entries import FileEntry
from ckpt.format.manifest import Manifest
from ckpt.format.safetensors_header import build_header, check_layout
from ckpt.progress import Progress, reporting
from ckpt.store.destination import (
    OutputFile,
    dir_targets,
    file_target,
    is_torch_name,
    write_dir,
    write_files,
    write_torch,
)
from ckpt.store.limits import check_disk
from ckpt.store.load import check_headers, check_unique, load_manifest, select
from ckpt.transfer.pipeline import GetTask, get_chunks, sink_tasks

if TYPE_CHECKING:

    from ckpt.store.store import Store


def _file_tasks(m: Manifest, f: FileEntry, out: OutputFile) -> list[GetTask]:
    """Tasks writing file ``f`` of ``m`` (its header or blob chunks, then its tensors) into ``out``."""
    if f.kind == "blob":
        return sink_tasks(f.chunks, f.size, m.chunk_size, out.sink_at)
    tasks = sink_tasks(f.chunks, f.head_size, m.chunk_size, out.sink_at)
    pos = f.head_size
    for t in m.tensors:
        if t.file == f.path:
            tasks += sink_tasks(t.chunks, t.nbytes, m.chunk_size, out.sink_at, pos)
            pos += t.nbytes
    return tasks


def _write_files(store: Store, m: Manifest, files: list[tuple[FileEntry, str]], progress: Progress | None,
                 tasks_for: Callable[[OutputFile], list[GetTask]] | None = None, what: str = "checkpoint") -> None:
    """Write each (entry, temporary path) in parallel; tasks of all files share one pool."""
    check_disk(sum(f.size for f, _ in files), files[0][1])
    with ExitStack() as stack:
        tasks: list[GetTask] = []
        for f, path in files:
            out = stack.enter_context(OutputFile(path, f.size))
            tasks += tasks_for(out) if tasks_for else _file_tasks(m, f, out)
        with reporting(progress, "pull", sum(t.length for t in tasks)) as p:
            get_chunks(store.objects, tasks, store.settings, p, manifest=m)
    if tasks_for is None and m.source != "dcp":
        # Before the files take their names: each stored header, as written, must place the tensors
        # where the manifest does, so that the file holds what a load of the checkpoint reads.
        for f, path in files:
            if f.kind == "safetensors":
                with open(path, "rb") as fh:
                    check_layout(fh.read(f.head_size), m, f, what)


def pull(store: Store, ref: str, dest: str | os.PathLike[str], *, overwrite: bool = False, include: list[str] | None = None, progress: Progress | None = None,
         label: str | None = None) -> str:
    """Write checkpoint ``ref`` to ``dest``; returns the path written. See :meth:`Store.pull`.

    Where and how it writes (never inside a store, only the checkpoint's own files,
    each atomically) is :mod:`ckpt.store.destination`'s rule. A one-file target named like a
    torch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``) gets what the name promises: a
    file ``torch.load(weights_only=True)`` reads. For a checkpoint pushed from a ``.pt`` file
    (or a nested dict) it holds what was pushed, as it was: its nested dicts, lists and tuples,
    keys and their order, and values, the tensors bit-identical (a Lightning checkpoint pulled
    is one ``Trainer.fit(ckpt_path=...)`` resumes from). Otherwise, and for a checkpoint pushed
    before ckpt kept that structure, it is a flat dict of the tensors (bit-identical, keys as
    stored: a nested state dict's keys joined with ``.``) and, for one pushed from a ``.pt``
    file or saved through DCP, its non-tensor values under their flat keys. A checkpoint of several files (a model directory) is not pulled
    to a ``dest`` named like one file unless that is an existing directory (``include=["*"]``
    writes its tensors as that file). Raises :class:`DestinationError` /
    :class:`DestinationExistsError` before anything is written.
    """
    m = store.manifest(ref)
    label = label or ref  # what messages call it: the ref a caller resolved to the id it gives as ``ref``
    dest = os.fspath(dest)
    if m.source == "dcp":  # a distributed checkpoint: its shards consolidated into one file
        from ckpt.dcp.consolidate import pull_dcp

        # (its layout is read only now: what it finds damaged names the ref and, where the caller resolved it, the id)
        what = f"checkpoint {label}" if label == ref else f"checkpoint {label}: manifest {ref}"
        return pull_dcp(store, m, dest, include, overwrite, progress, what)
    if include:
        return _pull_selected(store, m, dest, include, overwrite, progress)
    if m.source != "hf-dir" and len(m.files) == 1:
        target = file_target(store, dest, os.path.basename(m.files[0].path), overwrite)
        if is_torch_name(target):
            tensors = load_manifest(store, m, None, progress, f"checkpoint {label}")
            write_torch(target, tensors, _values(m), overwrite, m.structure(tensors, f"checkpoint {label}"))
        else:
            write_files([target], lambda tmps: _write_files(store, m, [(m.files[0], tmps[0])], progress, what=f"checkpoint {label}"),
                        overwrite)
        return target
    if not os.path.isdir(dest) and (is_torch_name(dest) or dest.lower().endswith(".safetensors")):
        # A folder's files would go into a new directory named like one file: not what was asked.
        raise DestinationError(f"{label} is a folder of {len(m.files)} files; {dest} is named like one file",
                               hint="pull it into a directory, or with --include '*' to write its tensors as that one file")
    paths = [f.path for f in m.files]
    root, targets = dir_targets(store, dest, paths, overwrite)
    write_dir(root, targets, lambda tmps: _write_files(store, m, list(zip(m.files, tmps)), progress, what=f"checkpoint {label}"),
              overwrite, check=lambda: dir_targets(store, root, paths, overwrite))
    return root


def _values(m: Manifest) -> dict[str, Any]:
    """The non-tensor values of a checkpoint pushed from a ``.pt`` file (flat keys), else none."""
    return m.extra_values() if m.source == "state-dict" else {}


def _pull_selected(store: Store, m: Manifest, dest: str, include: list[str], overwrite: bool, progress: Progress | None) -> str:
    """Only the tensors matching ``include``, as one new safetensors (or torch) file."""
    tensors = select(m, include)
    if not tensors:
        raise TensorMismatchError(f"no tensor matches {' '.join(include)}", hint="see the names with `ckpt show`")
    check_unique(tensors, "pull without --include: each file is written as it was pushed")
    target = file_target(store, dest, "model.safetensors", overwrite)
    if is_torch_name(target):
        write_torch(target, load_manifest(store, m, include, progress, "the selected tensors"), {}, overwrite)
        return target
    # A header of its own is written from the entries: they must be what their files' stored headers say.
    check_headers(store, m, "the selected tensors", files={t.file for t in tensors})
    meta = next((f.metadata for f in m.files if f.kind == "safetensors" and f.metadata), None)
    head, order = build_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], meta)
    size = len(head) + sum(t.nbytes for t in tensors)

    def tasks(out: OutputFile) -> list[GetTask]:
        out.write_at(head, 0)
        found: list[GetTask] = []
        pos = len(head)
        for i in order:
            t = tensors[i]
            found += sink_tasks(t.chunks, t.nbytes, m.chunk_size, out.sink_at, pos)
            pos += t.nbytes
        return found

    entry = FileEntry("selected.safetensors", "safetensors", size, (), len(head), meta)
    write_files([target], lambda tmps: _write_files(store, m, [(entry, tmps[0])], progress, tasks), overwrite)
    return target
