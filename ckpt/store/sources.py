"""Everything push accepts, turned into one shape: files made of byte ranges.

* a ``.safetensors`` file (its header is kept verbatim, so pull restores it byte for byte);
* a Hugging Face style directory: every ``*.safetensors`` shard plus every other
  file (config.json, tokenizer files, ``model.safetensors.index.json``...);
* a ``.pt``/``.pth``/``.bin`` state dict, read only with ``torch.load(weights_only=True)``;
* an in-memory ``dict[str, torch.Tensor]`` (any dtype, 0-d, empty, non-contiguous).

Nothing here reads tensor data: it only says where each chunk's bytes are.

Every input is treated as hostile. What is not understood is refused with one
:class:`~ckpt.errors.InvalidSourceError` line that says what to do; nothing is skipped
(a skipped file would be data silently missing from the checkpoint), followed out of a
folder, or waited on:

* only regular files are read; FIFOs, sockets and devices are refused, and cannot hang
  a push even if swapped in after the check (:mod:`ckpt.store.source_files`);
* in a folder, links to files inside it are stored as copies of their target under the
  link's name; links leading outside, broken links, loops and links to directories are
  refused, all named in one message (:mod:`ckpt.store.source_files`);
* a ``.pt``'s nested entries are named by joining keys with ``.`` (int keys in decimal);
  two entries with the same name, or other key types, are refused (:mod:`ckpt.store.source_tensors`);
* sparse, meta, quantized and nested tensors and wrapper subclasses (DTensor) are refused
  with a hint saying how to convert them (:mod:`ckpt.store.source_tensors`).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import (
    InvalidSourceError,
    ResourceLimitError,
    UnsafeInputError,
    first_line,
)
from ckpt.format.names import check_file_path, check_tensor_name
from ckpt.format.safetensors_header import build_header, check_not_reserved, parse_header
from ckpt.store.source_bytes import ByteSource, FileBytes, MemBytes
from ckpt.store.source_files import (
    CLOEXEC,
    changed_error,
    open_regular,
    open_under,
    os_error,
    show,
    walk_folder,
)
from ckpt.store.source_tensors import flatten_state_dict, physical_memory, plain_bytes
from ckpt.store.source_zip import check_stored_entries

INDEX_NAME = "model.safetensors.index.json"
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
MAX_INDEX = 64 * 1024 * 1024  # real indexes are a few hundred KiB; the file is read whole
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
    # in-memory tensors read in place, and their version counters when the push began
    _versions: dict[str, tuple[Any, int]] = field(default_factory=dict)

    def close(self) -> None:
        for f in self._open:
            f.close()

    @property
    def holds_writers(self) -> bool:
        """Whether a process opening one of the files for writing waits while this source is open
        (a memory-mapped ``.pt`` is read under a lease, :meth:`FileBytes.lease`)."""
        return any(f.leased for f in self._open)

    def check_unchanged(self) -> None:
        """:meth:`FileBytes.check_unchanged` for every file this source reads; and refuse an
        in-memory tensor written in place meanwhile (another thread training): its chunks
        would be a tensor that never existed, part before and part after the write."""
        for f in self._open:
            f.check_unchanged()
        for name, (t, version) in self._versions.items():
            if t._version != version:
                raise InvalidSourceError(repr(name), "was modified while it was being pushed",
                                         hint="push a copy (t.clone()) or push when nothing writes it")


def stat_source(path: str) -> os.stat_result:
    """The status of ``path``, a file or folder to push (links followed: the path itself is the user's
    explicit choice); :class:`InvalidSourceError` saying what is wrong where it cannot be read."""
    try:
        return os.stat(path)
    except (OSError, ValueError) as e:
        raise os_error(show(path), e) from None


def open_source(source: object, *, metadata: dict[str, str] | None = None) -> SourceIn:
    """Describe ``source`` (a path or a mapping of tensors) as files of byte ranges.

    Raises :class:`InvalidSourceError` (with a hint) for anything it will not read: see
    the module docstring for what is refused and why."""
    if isinstance(source, Mapping):
        import torch

        if all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in source.items()):
            return from_tensors(source, "tensors", {}, metadata)
        # A nested state dict ({"model": ..., "optim": ...}), one with plain values or int keys: flattened
        # and kept as a pushed .pt file's would be, its tensors still the caller's (not private).
        tensors, extra = flatten_state_dict(source, "state dict")
        return from_tensors(tensors, "state-dict", extra, metadata)
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidSourceError(repr(source)[:80], "push takes a file, a directory or a dict of tensors")
    path = os.fsdecode(os.fspath(source))
    st = stat_source(path)
    if stat.S_ISDIR(st.st_mode):
        return _from_hf_dir(path)
    fb = FileBytes(show(path), open_regular(path))
    try:
        if path.endswith(STATE_DICT_SUFFIXES) and not _looks_like_safetensors(fb):
            return _from_state_dict_file(fb, metadata)
        src = SourceIn("safetensors", [], _open=[fb])
        src.files.append(_safetensors_file(fb, os.path.basename(path) if path.endswith(".safetensors") else "model.safetensors"))
        return src
    except BaseException:
        fb.close()
        raise


def _from_hf_dir(root: str) -> SourceIn:
    src = SourceIn("hf-dir", [])
    shown = show(root)
    try:
        root_fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC)  # the root may be a link
    except (OSError, ValueError) as e:
        raise os_error(shown, e) from None
    try:
        root_real = os.path.realpath(root)
        st = os.stat(root_real)
        if (st.st_dev, st.st_ino) != (os.fstat(root_fd).st_dev, os.fstat(root_fd).st_ino):
            raise changed_error(shown)  # links are judged against root_real: it must be the folder opened
        paths = walk_folder(root, root_fd, root_real)
        if not any(rel.endswith(".safetensors") for rel, _ in paths):
            pickled = [rel for rel, _ in paths if rel.endswith(STATE_DICT_SUFFIXES)]
            if not pickled:
                raise InvalidSourceError(shown, "directory holds no .safetensors files", hint="push a .pt/.bin file directly")
            # a model saved with safe_serialization=False (pytorch_model-0000N-of-0000M.bin and its
            # index): pushing each shard alone would scatter one model over many refs, without its config
            listed = ", ".join(show(r) for r in pickled[:3]) + (f" and {len(pickled) - 3} more" if len(pickled) > 3 else "")
            raise InvalidSourceError(
                shown, f"directory holds no .safetensors files; its weights are torch pickle files ({listed})",
                hint="a folder is pushed with its weights as safetensors: convert it (transformers: "
                "AutoModel.from_pretrained(DIR).save_pretrained(OUT), which writes safetensors) and push OUT"
                + ("; a single .pt/.bin file can also be pushed on its own" if len(pickled) == 1 else ""))
        for rel, parts in paths:
            fb = FileBytes(show(f"{root.rstrip('/')}/{rel}"), open_under(root_fd, parts, root))
            src._open.append(fb)
            if rel.endswith(".safetensors"):
                src.files.append(_safetensors_file(fb, rel))
            else:
                src.files.append(FileIn(rel, "blob", os.fstat(fb.fd).st_size, src=fb))
        _check_index(root, src)
    except BaseException:
        src.close()
        raise
    finally:
        os.close(root_fd)
    return src


def _looks_like_safetensors(fb: FileBytes) -> bool:
    head = os.pread(fb.fd, 9, 0)
    return len(head) == 9 and head[8:9] == b"{"


def _safetensors_file(fb: FileBytes, rel: str) -> FileIn:
    size = os.fstat(fb.fd).st_size
    first = os.pread(fb.fd, 8, 0)
    header = parse_header(first, lambda n: os.pread(fb.fd, n, 8), size, fb.path)
    base = header.head_size
    tensors = [TensorIn(t.name, t.dtype, t.shape, t.nbytes, fb, base + t.begin) for t in header.tensors]
    return FileIn(check_file_path(rel), "safetensors", size, header.head, None, tensors, header.metadata)


def _check_index(root: str, src: SourceIn) -> None:
    """A sharded checkpoint's index must agree with its shards (clear error otherwise)."""
    idx = [f for f in src.files if f.path == INDEX_NAME]
    if not idx:
        return
    where = show(os.path.join(root, INDEX_NAME))
    if idx[0].size > MAX_INDEX or idx[0].src is None:
        raise InvalidSourceError(where, f"{idx[0].size:,} bytes is too big for a safetensors index")
    try:  # read through the descriptor already checked, not by path again
        obj = json.loads(bytes(idx[0].src.read(0, idx[0].size)))
        weight_map = obj["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise InvalidSourceError(where, "not a valid safetensors index (needs a weight_map object)") from None
    shards = {f.path: {t.name for t in f.tensors} for f in src.files if f.kind == "safetensors"}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard not in shards:
            raise InvalidSourceError(where, f"tensor {show(repr(name))} maps to missing shard {show(repr(shard))[:200]}")
        if name not in shards[shard]:
            raise InvalidSourceError(where, f"tensor {show(repr(name))} is not in shard {show(shard)}")


_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _refused(path: str, e: Exception) -> UnsafeInputError:
    why = next((ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("WeightsUnpickler error")), first_line(e))
    found = _GLOBAL.search(why)
    if found:  # the usual case, said whole: which object it would have to build
        what = found.group(1)
        why = f"it holds a pickled {what}"
        if what.startswith("torch.nn.modules."):
            why += ", a whole module (torch.save(model)): save model.state_dict() instead"
    folder = os.path.dirname(path) or "."
    try:  # a Trainer checkpoint-N's training_args.bin, rng_state.pth...: pushed with their folder, kept as bytes
        in_model_folder = any(n.endswith(".safetensors") for n in os.listdir(folder))
    except (OSError, ValueError):
        in_model_folder = False
    return UnsafeInputError(
        path,
        f"refused: this file can only be loaded by running code stored in it ({show(why[:160])})",
        hint="ckpt reads .pt files only with torch.load(weights_only=True); if you trust the file, "
        "re-save its tensors with safetensors and push that"
        + (f"; or push its whole folder ({show(folder)}), where files other than weights are stored as bytes, "
           "never loaded" if in_model_folder else ""),
    )


def _torch_load(f: Any, mmap: bool) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():  # torch warns about pickle protocols on its way to refusing
        warnings.simplefilter("ignore")
        return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)


def _load(fb: FileBytes) -> Any:
    """``torch.load`` of the file already opened and checked as ``fb``, not of its path
    again (which could have become a FIFO since): through /proc where there is one, so
    it can be memory-mapped. Mapped only under a read lease (:meth:`FileBytes.lease`), or
    where it is too big to read into a quarter of memory: a mapped file truncated
    meanwhile would kill the process."""
    check_stored_entries(fb.fd, fb.path)
    proc = f"/proc/self/fd/{fb.fd}"
    if not os.path.exists(proc):
        with os.fdopen(os.dup(fb.fd), "rb") as f:
            return _torch_load(f, False)
    if fb.lease() or os.fstat(fb.fd).st_size > (physical_memory() or 0) // 4:
        try:
            return _torch_load(proc, True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # the legacy (non-zip) format cannot be memory-mapped
                raise
    return _torch_load(proc, False)


# How torch.save(..., _use_new_zipfile_serialization=False) begins: its magic number, pickled.
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


def _from_state_dict_file(fb: FileBytes, metadata: dict[str, str] | None) -> SourceIn:
    path = fb.path
    legacy = os.pread(fb.fd, len(_LEGACY_MAGIC), 0) == _LEGACY_MAGIC
    try:
        try:
            try:
                obj = _load(fb)
            except Exception:
                fb.check_unchanged()  # bytes that changed while torch read them fail in any way: say that
                raise
            fb.check_unchanged()
        except BaseException:
            fb.close()  # (torch holds its own mapping; fb stays open only to see the file change)
            raise
    except InvalidSourceError:
        raise
    except pickle.UnpicklingError as e:
        raise _refused(path, e) from None
    except MemoryError:
        raise ResourceLimitError(f"{path}: not enough memory to load it") from None
    except Exception as e:  # any failure to parse hostile bytes is "unreadable", never a traceback
        raise InvalidSourceError(path, f"not a readable torch file: {show(first_line(e, type(e).__name__)[:200])}", hint=(
            "it is in torch's legacy format (_use_new_zipfile_serialization=False), which torch cannot read back "
            "for every dtype (float8, uint16...): save the tensors again with the default torch.save, or with "
            "safetensors, and push that") if legacy else None) from None
    if not isinstance(obj, Mapping):
        raise InvalidSourceError(path, f"holds a {type(obj).__name__}, not a state dict")
    try:
        tensors, extra = flatten_state_dict(obj, path)
        src = from_tensors(tensors, "state-dict", extra, metadata, private=True)  # torch.load's: no one else's
    except BaseException:
        fb.close()
        raise
    for t in src.files[0].tensors:
        if isinstance(t.src, MemBytes):
            t.src.guard = fb.check_lease  # every read of the mapping first asks whether a writer waits
    src._open.append(fb)
    return src

def _check_safetensors_name(name: str) -> str:
    check_tensor_name(name)
    check_not_reserved(name, hint="rename the tensor")
    return name


def from_tensors(tensors: Mapping[str, Any], kind: str, extra: dict[str, Any], metadata: dict[str, str] | None,
                  known: Mapping[str, tuple[str, tuple[int, ...], int]] | None = None,
                  sources: Mapping[str, ByteSource] | None = None, private: bool = False) -> SourceIn:
    """One safetensors file of ``tensors``. Names in ``known`` (dtype, shape, nbytes) are
    laid out in the file too but carry no data: the caller already has their chunks.
    ``sources``: where the bytes of some tensors are read from instead of their memory.
    ``private``: no one else holds the tensors (a loaded .pt's, a snapshot's staging copies): their
    bytes are handed on read-only and not watched for writes."""
    specs = []
    views: dict[str, tuple[memoryview, Any]] = {}
    versions: dict[str, tuple[Any, int]] = {}  # a caller's tensors, which another thread may write
    budget = [physical_memory() or 1 << 62]
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidSourceError("state dict", f"key {show(repr(name))[:80]} is not a string")
        _check_safetensors_name(name)
        if not private:
            try:  # before its bytes are read, or copied (a non-contiguous view's copy can be torn too)
                versions[name] = (t, t._version)
            except (RuntimeError, AttributeError):  # an inference-mode tensor has no version counter
                pass
        dtype, shape, view, dense = plain_bytes(name, t, budget)
        specs.append((name, dtype, shape, len(view)))
        # private bytes (a loaded .pt, a snapshot's staging copies) are handed on read-only: the
        # pipeline copies only writable memory, which another thread may be writing
        views[name] = (view.toreadonly() if private else view, dense)
    for name, (dtype, shape, nbytes) in (known or {}).items():
        if name in views:
            raise InvalidSourceError(repr(name), "given both as a tensor and as one already stored")
        specs.append((_check_safetensors_name(name), dtype, shape, nbytes))
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
    return SourceIn(kind, [file], extra, _versions=versions)
