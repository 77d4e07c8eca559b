"""The two things ``ckpt diff`` compares: a stored checkpoint, read through the lazy
reader, or a local file, directory or dict of tensors, read as ``push`` reads it.

Both answer the same questions (a side whose folders share tensor names, a diffusers
pipeline, names each tensor FOLDER/NAME: see :func:`_keys`): tensor names with dtype, shape and size; the chunk
ids of a tensor when cut at a given chunk size (a stored checkpoint knows them from
its manifest, a local tensor is hashed piece by piece); and the tensor itself (one of
a dtype ckpt does not know, stored as opaque bytes, as its bytes: uint8, flat).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from ckpt.errors import TensorMismatchError
from ckpt.format.dtypes import byte_view, itemsize, to_torch
from ckpt.format.entries import split_lengths
from ckpt.format.names import folder_names
from ckpt_store.storage.objects import object_id

if TYPE_CHECKING:
    import torch

    from ckpt.store.reader import CheckpointReader
    from ckpt.store.sources import SourceIn, TensorIn
    from ckpt.store.store import Store


def _keys(names: Iterable[tuple[str, str]], label: str) -> list[str]:
    """The name diff pairs each tensor by, given (its name, its file): ``FOLDER/NAME`` where files in
    several folders share names (a diffusers pipeline, :func:`~ckpt.format.names.folder_names`),
    so that each model's tensors pair with the same model's. Refuses two tensors of one name left
    (two files of one folder): comparing either one silently would hide the other."""
    names = list(names)
    keys = folder_names(names)
    seen: dict[str, str] = {}
    for key, (_, file) in zip(keys, names):
        if key in seen:
            raise TensorMismatchError(
                f"{label}: tensor {key!r} appears in two files ({seen[key]} and {file}); diff pairs tensors by name",
                hint="diff the files one by one; `ckpt pull` a stored checkpoint to a directory first")
        seen[key] = file
    return keys


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class RefSide:
    """A stored checkpoint, read through the lazy reader."""

    def __init__(self, reader: CheckpointReader, label: str) -> None:
        self.reader = reader
        self.label = label
        self.id: str | None = reader.id
        self.chunk_size: int | None = reader.manifest.chunk_size
        tensors = reader.manifest.tensors
        self._entries = dict(zip(_keys(((t.name, t.file) for t in tensors), label), tensors))
        reader.check_headers()  # the dtypes and shapes compared are those its files' stored headers say
        self.meta = {k: TensorMeta(t.dtype, t.shape, t.nbytes) for k, t in self._entries.items()}

    def chunk_ids(self, name: str, chunk_size: int) -> tuple[str, ...] | None:
        return self._entries[name].chunks if chunk_size == self.chunk_size else None

    def all_chunk_ids(self, chunk_size: int) -> set[str]:
        return {c for t in self.reader.manifest.tensors for c in t.chunks} if chunk_size == self.chunk_size else set()

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor; one of a dtype ckpt does not know as its bytes (uint8, flat)."""
        return self.tensors([name])[name]

    def tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tensors ``names``, as :meth:`tensor` gives them, read in one pass of the read pipeline: small
        tensors one by one paid for a pass each, and from a remote store waited for one request each."""
        import torch

        from ckpt.store.limits import check_memory
        from ckpt.store.load import empty_tensor
        from ckpt.transfer.pipeline import into_tasks

        entries = [self._entries[n] for n in names]
        check_memory(entries, f"tensor {names[0]!r}" if len(names) == 1 else f"{len(names)} tensors")
        out = {n: empty_tensor(e) if itemsize(e.dtype) is not None else torch.empty(e.nbytes, dtype=torch.uint8)
               for n, e in zip(names, entries)}
        # through the reader's one pool of reading threads, kept for the whole diff (not one per batch)
        self.reader.fetch(into_tasks(self.reader.manifest.chunk_size, zip(entries, out.values())))
        return out

    def close(self) -> None:
        self.reader.close()


class DcpSide(RefSide):
    """A stored distributed (DCP) checkpoint: its tensors whole, assembled from their shards as
    ``Store.load`` gives them (its entries are the shards, named and cut by the saving ranks)."""

    def __init__(self, reader: CheckpointReader, label: str) -> None:
        from ckpt.dcp.consolidate import check_entries
        from ckpt.dcp.format import decode_layout

        self.reader = reader
        self.label = label
        self.id = reader.id
        self.chunk_size = reader.manifest.chunk_size
        self.items = decode_layout(reader.manifest.extra, f"checkpoint {label}").tensors
        # Every shard against its entry first: a shard naming no entry was a KeyError, and a layout
        # whose size its entries do not back (forged) was allocated whole before anything was read.
        check_entries(reader.manifest, self.items.values(), f"checkpoint {label}")
        self.entries = {t.name: t for t in reader.manifest.tensors}
        self.meta = {n: TensorMeta(t.dtype, t.size, t.nbytes) for n, t in self.items.items()}

    def chunk_ids(self, name: str, chunk_size: int) -> tuple[str, ...] | None:
        t = self.items[name]  # a tensor saved whole is one entry; one in shards has no chunk ids of its own
        whole = [s.sizes for s in t.shards] == [t.size]
        return self.entries[t.shards[0].entry].chunks if whole and chunk_size == self.chunk_size else None

    def tensor(self, name: str) -> torch.Tensor:
        import torch

        from ckpt.dcp.consolidate import run_copies, shard_copies

        t = self.items[name]
        full = torch.empty(t.size, dtype=to_torch(t.dtype))
        run_copies(self.reader.store, self.reader.manifest, shard_copies(t, full, self.entries, f"checkpoint {self.label}"), get=self.reader.fetch)
        return full

    def tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {n: self.tensor(n) for n in names}


class SourceSide:
    """A local file, directory or dict of tensors, as ``push`` would read it."""

    def __init__(self, src: SourceIn, label: str) -> None:
        self.src = src
        self.label = label
        self.id: str | None = None
        self.chunk_size: int | None = None
        try:
            keys = _keys(((t.name, f.path) for f in src.files for t in f.tensors), label)
        except BaseException:
            src.close()  # the caller never gets this side to close
            raise
        self._by_name: dict[str, TensorIn] = dict(zip(keys, (t for f in src.files for t in f.tensors)))
        self.meta = {k: TensorMeta(t.dtype, t.shape, t.nbytes) for k, t in self._by_name.items()}
        self._ids: dict[tuple[str, int], tuple[str, ...]] = {}

    def chunk_ids(self, name: str, chunk_size: int) -> tuple[str, ...] | None:
        key = (name, chunk_size)
        if key not in self._ids:
            t = self._by_name[name]
            assert t.src is not None
            ids, pos = [], t.offset
            for n in split_lengths(t.nbytes, chunk_size):  # hashed piece by piece: no copy of the tensor
                ids.append(object_id(t.src.read(pos, n)))
                pos += n
            self._ids[key] = tuple(ids)
        return self._ids[key]

    def all_chunk_ids(self, chunk_size: int) -> set[str]:
        """Every chunk id of this side cut at ``chunk_size``, as a stored side's manifest lists them:
        each tensor hashed once (and kept for :meth:`chunk_ids`). It was only those hashed so far,
        none when asked first, so that B's chunks held elsewhere in a local A counted as new bytes."""
        for name in self._by_name:
            self.chunk_ids(name, chunk_size)
        return {c for (_, cs), ids in self._ids.items() if cs == chunk_size for c in ids}

    def tensor(self, name: str) -> torch.Tensor:
        import torch

        t = self._by_name[name]
        assert t.src is not None
        # a dtype ckpt does not know: its bytes (uint8, flat), as RefSide gives them
        out = torch.empty(t.shape, dtype=to_torch(t.dtype)) if itemsize(t.dtype) is not None else torch.empty(t.nbytes, dtype=torch.uint8)
        view = byte_view(out)
        step = 64 << 20
        for pos in range(0, t.nbytes, step):
            n = min(step, t.nbytes - pos)
            view[pos : pos + n] = t.src.read(t.offset + pos, n)
        return out

    def tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {n: self.tensor(n) for n in names}

    def close(self) -> None:
        self.src.close()


_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def open_side(x: object, store: Store | None, refs_only: bool = False) -> tuple[Side, Store | None]:
    """``x`` as a side: a dict of tensors or an existing path (or one named like a weights
    file that is not a ref of the store) is read as ``push`` would read it; anything else is a ref
    of ``store`` (default: the default store, opened only when needed). With ``refs_only``, ``x``
    is always a ref (a string naming a file is never opened: for callers whose input is untrusted)."""
    from ckpt.store.sources import open_source

    named: str | None = None  # the checkpoint a ref named like a weights file resolved to
    if not refs_only:
        if isinstance(x, Mapping):
            return SourceSide(open_source(x), "<tensors>"), store
        if isinstance(x, str) and not os.path.exists(x) and x.endswith(_FILE_SUFFIXES):
            named, store = _is_ref(x, store)  # a ref pushed as `ckpt push best.ckpt run/best.ckpt`
            if named is None:
                return SourceSide(open_source(x), x), store  # a missing file: "no such file", not "no ref"
        elif isinstance(x, os.PathLike) or (isinstance(x, str) and os.path.exists(x)):
            return SourceSide(open_source(x), os.fspath(x)), store
    if not isinstance(x, str):
        from ckpt.errors import InvalidSourceError

        raise InvalidSourceError(repr(x)[:80], "only refs of the store are compared here" if refs_only
                                 else "diff takes refs, paths or dicts of tensors")
    if store is None:
        from ckpt.store.store import Store

        store = Store.open()
    reader = store.reader(named or x)  # (a ref resolved above is read as that checkpoint: one lookup)
    if reader.manifest.source == "dcp":  # (ckpt.dcp.format.DCP_SOURCE)
        return DcpSide(reader, x), store
    return RefSide(reader, x), store


def _is_ref(x: str, store: Store | None) -> tuple[str | None, Store | None]:
    """The checkpoint id ``x`` names in ``store`` (the default store, if it exists, when None), or None."""
    from ckpt.errors import CkptError

    try:
        if store is None:
            from ckpt.store.store import Store

            store = Store.open()
        return store.resolve(x), store
    except CkptError:
        return None, store


Side = Union[RefSide, DcpSide, SourceSide]
