"""A lazy reader: names, dtypes and shapes from the manifest; tensor data only on request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckpt.dcp.consolidate import shard_entry
from ckpt.dcp.format import DCP_SOURCE, TensorItem
from ckpt.errors import TensorMismatchError
from ckpt.format.dtypes import to_torch
from ckpt.format.entries import TensorEntry
from ckpt.format.manifest import Manifest
from ckpt.store.limits import check_memory
from ckpt.store.load import check_headers, check_unique, empty_tensor, fill
from ckpt.transfer.pipeline import GetTask, ReadPool, get_chunks

if TYPE_CHECKING:
    import torch

    from ckpt.progress import Progress
    from ckpt.store.store import Store


class CheckpointReader:
    """Read single tensors of a stored checkpoint without fetching the others.

    A distributed (DCP) checkpoint lists and reads its tensors whole, each assembled from the
    shards the ranks saved (as ``Store.load`` gives them), not the shards themselves.

    >>> reader = store.reader("minilm/base")          # doctest: +SKIP
    >>> reader.keys()[:1]                             # doctest: +SKIP
    ['embeddings.LayerNorm.bias']
    >>> reader.get_tensor("embeddings.LayerNorm.bias").shape   # doctest: +SKIP
    torch.Size([384])

    From a remote store (S3, ``memory://``) the reads of all its calls share one pool of reading
    threads, started at the first read and ended by :meth:`close` (a ``with`` block) or when the
    reader is garbage-collected.
    """

    def __init__(self, store: Store, manifest_id: str, manifest: Manifest) -> None:
        self.store = store
        self.id = manifest_id
        self.manifest = manifest
        self._by_name = {t.name: t for t in manifest.tensors}
        # names held by two files of a directory checkpoint (a diffusers folder's unet/ and vae/):
        # either one, picked silently, would hide the other
        self._twice = {t.name for t in manifest.tensors if self._by_name[t.name] is not t}
        self._items: dict[str, TensorItem] | None = None  # a distributed checkpoint's whole tensors
        if manifest.source == DCP_SOURCE:
            from ckpt.dcp.format import decode_layout

            self._items = decode_layout(manifest.extra, f"checkpoint {manifest_id[:12]}").tensors
        # One pool for the reader's life: a pool per get_tensor started (and joined) a thread per
        # reader of the store on every call (300 lazy reads from S3: 300 pools).
        self.pool = ReadPool()
        self._checked: set[str] = set()  # files whose stored header was checked (once each, not per tensor)

    def keys(self) -> list[str]:
        if self._items is not None:
            return list(self._items)
        return [t.name for t in self.manifest.tensors]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, name: object) -> bool:
        return name in (self._items if self._items is not None else self._by_name)

    def __len__(self) -> int:
        return len(self._items if self._items is not None else self._by_name)

    def info(self, name: str) -> TensorEntry:
        """The manifest entry of tensor ``name``. A tensor of a distributed checkpoint stored as
        several shards has none: :class:`TensorMismatchError` (``get_tensor`` reads it whole)."""
        if self._items is not None:
            item = self._items.get(name)
            if item is None:
                raise TensorMismatchError(f"no tensor {name!r} in checkpoint {self.id[:12]}")
            if [sh.sizes for sh in item.shards] != [item.size]:
                raise TensorMismatchError(f"tensor {name!r} of distributed checkpoint {self.id[:12]} is stored as "
                                          f"{len(item.shards)} shards, not one entry", hint="read it whole with get_tensor")
            return shard_entry(item, item.shards[0], self._by_name, f"checkpoint {self.id[:12]}")
        if name in self._twice:
            check_unique([t for t in self.manifest.tensors if t.name == name],
                         hint="pull it with `ckpt pull` to a directory, where each file keeps its own")
        try:
            entry = self._by_name[name]
        except KeyError:
            raise TensorMismatchError(f"no tensor {name!r} in checkpoint {self.id[:12]}") from None
        self.check_headers({entry.file})
        return entry

    def check_headers(self, files: set[str] | None = None) -> None:
        """Check the stored headers of the checkpoint's files (those of paths ``files``, all without) against
        its manifest, each once for the reader's life (:func:`~ckpt.store.load.check_headers`): an entry
        :meth:`info` gives, and what a diff or a merge reads, is the tensor its file's stored header says.
        Raises :class:`StoreFormatError` naming the tensor where they disagree."""
        if self._items is not None:
            return  # (a distributed checkpoint's shards are checked against their entries as they are read)
        todo = {f.path for f in self.manifest.files if files is None or f.path in files} - self._checked
        if todo:
            check_headers(self.store, self.manifest, f"checkpoint {self.id[:12]}", files=todo)
            self._checked |= todo

    def metadata(self) -> dict[str, str] | None:
        """The safetensors ``__metadata__`` of the (first) weights file."""
        return next((f.metadata for f in self.manifest.files if f.kind == "safetensors" and f.metadata), None)

    def get_tensor(self, name: str) -> torch.Tensor:
        if self._items is not None and name in self._items:
            return self._whole(self._items[name])
        entry = self.info(name)
        check_memory([entry], f"tensor {name!r}")
        out = empty_tensor(entry)
        fill(self.store, self.manifest, [(entry, out)], get=self.fetch, checked=self._checked)  # (info checked its header)
        return out

    def fetch(self, tasks: list[GetTask], progress: Progress | None = None) -> None:
        """Fetch chunks of this checkpoint into ``tasks`` (see :func:`~ckpt.transfer.pipeline.get_chunks`),
        through this reader's pool of reading threads; from S3, small chunks from the checkpoint's
        bundles, each fetched once for the reader's life (its pool keeps it)."""
        get_chunks(self.store.objects, tasks, self.store.settings, progress, manifest=self.manifest, pool=self.pool)

    def _whole(self, item: TensorItem) -> torch.Tensor:
        """A distributed checkpoint's tensor, assembled from its shards (each checked against its entry)."""
        import torch

        from ckpt.dcp.consolidate import run_copies, shard_copies

        entries = [shard_entry(item, sh, self._by_name, f"checkpoint {self.id[:12]}") for sh in item.shards]  # before anything is allocated
        check_memory(entries, f"tensor {item.fqn!r}")
        out = torch.empty(item.size, dtype=to_torch(item.dtype))
        run_copies(self.store, self.manifest, shard_copies(item, out, self._by_name, f"checkpoint {self.id[:12]}"), get=self.fetch)
        return out

    def close(self) -> None:
        """End the reader's reading threads (a later read starts them again)."""
        self.pool.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
