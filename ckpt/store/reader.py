"""A lazy reader: names, dtypes and shapes from the manifest; tensor data only on request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckpt.errors import TensorMismatchError
from ckpt.format.manifest import Manifest, TensorEntry
from ckpt.store.limits import check_memory
from ckpt.store.load import check_unique, empty_tensor
from ckpt.transfer.pipeline import get_chunks, into_tasks

if TYPE_CHECKING:
    import torch

    from ckpt.store.store import Store


class CheckpointReader:
    """Read single tensors of a stored checkpoint without fetching the others.

    >>> reader = store.reader("minilm/base")          # doctest: +SKIP
    >>> reader.keys()[:1]                             # doctest: +SKIP
    ['embeddings.LayerNorm.bias']
    >>> reader.get_tensor("embeddings.LayerNorm.bias").shape   # doctest: +SKIP
    torch.Size([384])
    """

    def __init__(self, store: Store, manifest_id: str, manifest: Manifest) -> None:
        self.store = store
        self.id = manifest_id
        self.manifest = manifest
        self._by_name = {t.name: t for t in manifest.tensors}
        # names held by two files of a directory checkpoint (a diffusers folder's unet/ and vae/):
        # either one, picked silently, would hide the other
        self._twice = {t.name for t in manifest.tensors if self._by_name[t.name] is not t}

    def keys(self) -> list[str]:
        return [t.name for t in self.manifest.tensors]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def info(self, name: str) -> TensorEntry:
        if name in self._twice:
            check_unique([t for t in self.manifest.tensors if t.name == name],
                         hint="pull it with `ckpt pull` to a directory, where each file keeps its own")
        try:
            return self._by_name[name]
        except KeyError:
            raise TensorMismatchError(f"no tensor {name!r} in checkpoint {self.id[:12]}") from None

    def metadata(self) -> dict[str, str] | None:
        """The safetensors ``__metadata__`` of the (first) weights file."""
        return next((f.metadata for f in self.manifest.files if f.kind == "safetensors" and f.metadata), None)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.info(name)
        check_memory([entry], f"tensor {name!r}")
        out = empty_tensor(entry)
        get_chunks(self.store.objects, into_tasks(self.manifest.chunk_size, [(entry, out)]), self.store.settings)
        return out

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
