"""Everything push accepts, turned into one shape: files made of byte ranges.

* a ``.safetensors`` file (its header is kept verbatim, so pull restores it byte for byte);
* a Hugging Face style directory: every ``*.safetensors`` shard plus every other
  file (config.json, tokenizer files, ``model.safetensors.index.json``...);
* a ``.pt``/``.pth``/``.bin`` state dict, read only with ``torch.load(weights_only=True)``;
* an in-memory ``dict[str, torch.Tensor]`` (any dtype, 0-d, empty, non-contiguous).

Nothing here reads tensor data: it only says where each chunk's bytes are.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckpt.format.dtypes import byte_view, from_torch
from ckpt.errors import InvalidSourceError, UnsafeInputError
from ckpt.format.manifest import check_file_path, check_tensor_name
from ckpt.format.safetensors_header import build_header, parse_header

INDEX_NAME = "model.safetensors.index.json"
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class ByteSource(Protocol):
    def read(self, offset: int, length: int) -> bytes | memoryview: ...


class FileBytes:
    """A file read with ``pread`` from any number of threads at once."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise InvalidSourceError(self.path, "file shrank while it was being pushed")
        return data

    def close(self) -> None:
        os.close(self.fd)


class MemBytes:
    def __init__(self, view: memoryview, keepalive: object = None) -> None:
        self.view = view
        self._keepalive = keepalive

    def read(self, offset: int, length: int) -> memoryview:
        return self.view[offset : offset + length]


@dataclass
class TensorIn:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    src: ByteSource | None  # None: the pusher already has this tensor's chunks
    offset: int


@dataclass
class FileIn:
    path: str
    kind: str  # "safetensors" | "blob"
    size: int
    head: bytes = b""  # safetensors: length prefix + header, verbatim
    src: ByteSource | None = None  # blob files
    tensors: list[TensorIn] = field(default_factory=list)
    metadata: dict[str, str] | None = None


@dataclass
class SourceIn:
    kind: str
    files: list[FileIn]
    extra: dict[str, Any] = field(default_factory=dict)
    _open: list[FileBytes] = field(default_factory=list)

    def close(self) -> None:
        for f in self._open:
            f.close()


def open_source(source: object, *, metadata: dict[str, str] | None = None) -> SourceIn:
    """Describe ``source`` (a path or a mapping of tensors) as files of byte ranges."""
    if isinstance(source, Mapping):
        return from_tensors(source, "tensors", {}, metadata)
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidSourceError(repr(source)[:80], "push takes a file, a directory or a dict of tensors")
    path = os.fspath(source)
    if os.path.isdir(path):
        return _from_hf_dir(path)
    if not os.path.exists(path):
        raise InvalidSourceError(path, "no such file or directory")
    if path.endswith(STATE_DICT_SUFFIXES) and not _looks_like_safetensors(path):
        return _from_state_dict_file(path, metadata)
    src = SourceIn("safetensors", [])
    src.files.append(_safetensors_file(path, os.path.basename(path) if path.endswith(".safetensors") else "model.safetensors", src))
    return src


def _looks_like_safetensors(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _safetensors_file(path: str, rel: str, src: SourceIn) -> FileIn:
    fb = FileBytes(path)
    src._open.append(fb)
    size = os.fstat(fb.fd).st_size
    first = os.pread(fb.fd, 8, 0)
    header = parse_header(first, lambda n: os.pread(fb.fd, n, 8), size, path)
    base = header.head_size
    tensors = [TensorIn(t.name, t.dtype, t.shape, t.nbytes, fb, base + t.begin) for t in header.tensors]
    return FileIn(check_file_path(rel), "safetensors", size, header.head, None, tensors, header.metadata)


def _from_hf_dir(root: str) -> SourceIn:
    src = SourceIn("hf-dir", [])
    try:
        paths = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if d not in (".git", ".cache", "__pycache__"))
            for fn in sorted(filenames):
                full = os.path.join(dirpath, fn)
                paths.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
        if not any(rel.endswith(".safetensors") for rel, _ in paths):
            raise InvalidSourceError(root, "directory holds no .safetensors files", hint="push a .pt/.bin file directly")
        for rel, full in paths:
            if rel.endswith(".safetensors"):
                src.files.append(_safetensors_file(full, rel, src))
            else:
                fb = FileBytes(full)
                src._open.append(fb)
                src.files.append(FileIn(check_file_path(rel), "blob", os.fstat(fb.fd).st_size, src=fb))
        _check_index(root, src)
    except BaseException:
        src.close()
        raise
    return src


def _check_index(root: str, src: SourceIn) -> None:
    """A sharded checkpoint's index must agree with its shards (clear error otherwise)."""
    idx = [f for f in src.files if f.path == INDEX_NAME]
    if not idx:
        return
    where = os.path.join(root, INDEX_NAME)
    try:
        with open(where, "rb") as fh:
            obj = json.loads(fh.read())
        weight_map = obj["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise InvalidSourceError(where, "not a valid safetensors index (needs a weight_map object)") from None
    shards = {f.path: {t.name for t in f.tensors} for f in src.files if f.kind == "safetensors"}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard not in shards:
            raise InvalidSourceError(where, f"tensor {name!r} maps to missing shard {shard!r}")
        if name not in shards[shard]:
            raise InvalidSourceError(where, f"tensor {name!r} is not in shard {shard}")


def _refused(path: str, e: Exception) -> UnsafeInputError:
    lines = str(e).strip().splitlines()
    why = next((ln.strip() for ln in lines if ln.strip().startswith("WeightsUnpickler error")), lines[0] if lines else "")
    return UnsafeInputError(
        path,
        f"refused: this file can only be loaded by running code stored in it ({why[:160]})",
        hint="ckpt reads .pt files only with torch.load(weights_only=True); if you trust the file, "
        "re-save its tensors with safetensors and push that",
    )


def _torch_load(path: str, mmap: bool) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():  # torch warns about pickle protocols on its way to refusing
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def _from_state_dict_file(path: str, metadata: dict[str, str] | None) -> SourceIn:
    obj: Any = None
    for mmap in (True, False):  # the legacy (non-zip) format cannot be memory-mapped
        try:
            obj = _torch_load(path, mmap)
            break
        except pickle.UnpicklingError as e:
            raise _refused(path, e) from None
        except RuntimeError as e:
            if mmap and "mmap" in str(e):
                continue
            raise InvalidSourceError(path, f"not a readable torch file: {str(e).strip().splitlines()[0][:200]}") from None
        except (EOFError, OSError, ValueError) as e:
            raise InvalidSourceError(path, f"not a readable torch file: {str(e)[:200]}") from None
    if not isinstance(obj, Mapping):
        raise InvalidSourceError(path, f"holds a {type(obj).__name__}, not a state dict")
    tensors: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    _flatten(obj, "", tensors, extra, path)
    return from_tensors(tensors, "state-dict", extra, metadata)


def _flatten(obj: Mapping[Any, Any], prefix: str, tensors: dict[str, Any], extra: dict[str, Any], path: str) -> None:
    import torch

    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            tensors[key] = v
        elif isinstance(v, Mapping):
            _flatten(v, key + ".", tensors, extra, path)
        else:
            try:
                json.dumps(v, allow_nan=False)
            except (TypeError, ValueError):
                raise InvalidSourceError(path, f"entry {key!r} is a {type(v).__name__}, neither a tensor nor JSON") from None
            extra[key] = v


def from_tensors(tensors: Mapping[str, Any], kind: str, extra: dict[str, Any], metadata: dict[str, str] | None,
                  known: Mapping[str, tuple[str, tuple[int, ...], int]] | None = None,
                  sources: Mapping[str, ByteSource] | None = None) -> SourceIn:
    """One safetensors file of ``tensors``. Names in ``known`` (dtype, shape, nbytes) are
    laid out in the file too but carry no data: the caller already has their chunks.
    ``sources``: where the bytes of some tensors are read from instead of their memory."""
    import torch

    specs = []
    views: dict[str, tuple[memoryview, Any]] = {}
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidSourceError("state dict", f"key {name!r} is not a string")
        check_tensor_name(name)
        if not isinstance(t, torch.Tensor):
            raise InvalidSourceError("state dict", f"{name!r} is a {type(t).__name__}, not a tensor")
        dtype = from_torch(t.dtype)
        dense = t.detach().cpu().contiguous()
        view = byte_view(dense)
        specs.append((name, dtype, tuple(t.shape), len(view)))
        views[name] = (view, dense)
    for name, (dtype, shape, nbytes) in (known or {}).items():
        specs.append((check_tensor_name(name), dtype, shape, nbytes))
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidSourceError("metadata", "safetensors metadata must map strings to strings")
    head, order = build_header(specs, metadata)
    file = FileIn("model.safetensors", "safetensors", len(head), head, None, [], metadata)
    for i in order:
        name, dtype, shape, nbytes = specs[i]
        if sources is not None and name in sources:
            src: ByteSource | None = sources[name]
        else:
            src = MemBytes(*views[name]) if name in views else None
        file.tensors.append(TensorIn(name, dtype, shape, nbytes, src, 0))
        file.size += nbytes
    return SourceIn(kind, [file], extra)
