"""The entries a manifest (ckpt/format/manifest.py) lists, each a frozen record with its own checks: a
tensor (its dtype, shape and chunks, with their codecs and delta chains), a file as it was pushed, and a
bundle of small chunks; and how a byte length is cut into chunks (the rule every chunk list follows)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckpt.format.dtypes import itemsize
from ckpt.format.names import check_file_path, check_tensor_name
from ckpt_store.storage.errors import StoreFormatError
from ckpt_store.storage.objects import check_id
from ckpt_store.storage.records import require

MAX_HEADER = 100 * 1024 * 1024  # the limit safetensors itself enforces on a file's JSON header


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[str, ...]
    file: str  # path of the safetensors file that holds it
    # Codec of each chunk's stored blob (codecs.CODEC_NAMES), as found at push time.
    codecs: tuple[int, ...] = ()
    # Per chunk, the delta chain its stored blob needs (nearest base first; empty
    # when it is stored whole). Bases have the length of the chunk they serve.
    delta_bases: tuple[tuple[str, ...], ...] = ()

    def to_obj(self) -> dict[str, Any]:
        o: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "chunks": list(self.chunks),
            "file": self.file,
        }
        if self.codecs:
            o["codecs"] = list(self.codecs)
        if any(self.delta_bases):
            o["delta_bases"] = [list(c) for c in self.delta_bases]
        return o

    @classmethod
    def from_obj(cls, o: Any, what: str) -> TensorEntry:
        if not isinstance(o, dict):
            raise StoreFormatError(f"{what}: tensor entry is not an object")
        shape = require(o, "shape", list, what)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise StoreFormatError(f"{what}: bad shape {shape!r}")
        t = cls(
            name=check_tensor_name(require(o, "name", str, what)),
            dtype=require(o, "dtype", str, what),
            shape=tuple(shape),
            nbytes=require(o, "nbytes", int, what),
            chunks=tuple(check_id(c) for c in require(o, "chunks", list, what)),
            file=require(o, "file", str, what),
            codecs=tuple(_ints(o.get("codecs", []), "codecs", what)),
            delta_bases=_chains(o.get("delta_bases", []), what),
        )
        size = itemsize(t.dtype)
        if t.nbytes < 0 or (size is not None and t.nbytes != math.prod(t.shape) * size):
            raise StoreFormatError(f"{what}: tensor {t.name} has {t.nbytes} bytes for shape {t.shape}")
        if t.delta_bases and len(t.delta_bases) != len(t.chunks):
            raise StoreFormatError(f"{what}: tensor {t.name} has delta_bases for {len(t.delta_bases)} of {len(t.chunks)} chunks")
        return t

    def chains(self) -> tuple[tuple[str, ...], ...]:
        """The delta chain of every chunk (empty tuples when none is a delta)."""
        return self.delta_bases or tuple(() for _ in self.chunks)


@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint. For ``safetensors`` files ``chunks`` hold the header only."""

    path: str
    kind: str  # "safetensors" | "blob"
    size: int
    chunks: tuple[str, ...]
    head_size: int = 0  # safetensors: 8 + header length
    metadata: dict[str, str] | None = None  # safetensors __metadata__
    # Per chunk, the delta chain of its stored blob, as tensors record it: a file's bytes may be a chunk
    # the store holds as a delta (a weight saved again as a raw file), whose bases gc must keep.
    delta_bases: tuple[tuple[str, ...], ...] = ()

    def to_obj(self) -> dict[str, Any]:
        o: dict[str, Any] = {"path": self.path, "kind": self.kind, "size": self.size, "chunks": list(self.chunks)}
        if self.kind == "safetensors":
            o["head_size"] = self.head_size
            o["metadata"] = self.metadata
        if any(self.delta_bases):
            o["delta_bases"] = [list(c) for c in self.delta_bases]
        return o

    @classmethod
    def from_obj(cls, o: Any, what: str) -> FileEntry:
        if not isinstance(o, dict):
            raise StoreFormatError(f"{what}: file entry is not an object")
        kind = require(o, "kind", str, what)
        if kind not in ("safetensors", "blob"):
            raise StoreFormatError(f"{what}: unknown file kind {kind!r}")
        meta = o.get("metadata")
        if meta is not None and not (
            isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
        ):
            raise StoreFormatError(f"{what}: bad safetensors metadata")
        size = require(o, "size", int, what)
        head_size = require(o, "head_size", int, what) if kind == "safetensors" else 0
        if size < 0 or not 0 <= head_size <= size:
            raise StoreFormatError(f"{what}: file of {size} bytes with a header of {head_size}")
        if head_size > 8 + MAX_HEADER:  # a reader holds the header whole: a forged size must not size its buffer
            raise StoreFormatError(f"{what}: a safetensors header of {head_size} bytes (limit {8 + MAX_HEADER})")
        chunks = tuple(check_id(c) for c in require(o, "chunks", list, what))
        return cls(
            path=check_file_path(require(o, "path", str, what)),
            kind=kind,
            size=size,
            chunks=chunks,
            head_size=head_size,
            metadata=meta,
            delta_bases=_chains_of(o, chunks, f"{what}: file"),
        )


@dataclass(frozen=True)
class BundleEntry:
    """Copies of a checkpoint's small chunks, concatenated and stored as chunks of their own,
    so that a reader of a remote store fetches them in a request or two instead of one each
    (all-MiniLM-L6-v2: 66 of its 117 chunks, its biases, norms and header, hold under 64 KiB:
    143 KB in all). Only an accelerator: every member is stored, and named by its tensor or
    file, as itself; a reader that cannot use a bundle (missing, damaged, a member that does
    not hash to its id) reads the members."""

    nbytes: int
    chunks: tuple[str, ...]  # the bundle's bytes, cut like a tensor's
    members: tuple[tuple[str, int, int], ...]  # (chunk id, offset, length) in the bundle's bytes
    delta_bases: tuple[tuple[str, ...], ...] = ()  # as FileEntry's: a chunk of it met stored as a delta

    def to_obj(self) -> dict[str, Any]:
        o = {"nbytes": self.nbytes, "chunks": list(self.chunks), "members": [list(m) for m in self.members]}
        if any(self.delta_bases):
            o["delta_bases"] = [list(c) for c in self.delta_bases]
        return o

    @classmethod
    def from_obj(cls, o: Any, chunk_size: int, what: str) -> BundleEntry:
        if not isinstance(o, dict):
            raise StoreFormatError(f"{what}: bundle entry is not an object")
        nbytes = require(o, "nbytes", int, what)
        chunks = tuple(check_id(c) for c in require(o, "chunks", list, what))
        if nbytes < 0 or len(chunks) != chunk_count(nbytes, chunk_size):
            raise StoreFormatError(f"{what}: a bundle has {len(chunks)} chunks for {nbytes} bytes")
        members = []
        for m in require(o, "members", list, what):
            if not (isinstance(m, list) and len(m) == 3 and isinstance(m[0], str)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in m[1:])):
                raise StoreFormatError(f"{what}: a bundle member is not [chunk id, offset, length]")
            cid, off, n = check_id(m[0]), m[1], m[2]
            if off < 0 or n <= 0 or off + n > nbytes:
                raise StoreFormatError(f"{what}: bundle member {cid[:12]} lies outside the bundle")
            members.append((cid, off, n))
        return cls(nbytes, chunks, tuple(members), _chains_of(o, chunks, f"{what}: bundle"))


def _ints(raw: Any, key: str, what: str) -> list[int]:
    if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raise StoreFormatError(f"{what}: {key} must be a list of integers")
    return raw


def _chains(raw: Any, what: str) -> tuple[tuple[str, ...], ...]:
    if not isinstance(raw, list) or not all(isinstance(c, list) for c in raw):
        raise StoreFormatError(f"{what}: delta_bases must be a list of lists of chunk ids")
    return tuple(tuple(check_id(x) for x in c) for c in raw)


def _chains_of(o: dict[str, Any], chunks: tuple[str, ...], what: str) -> tuple[tuple[str, ...], ...]:
    """The ``delta_bases`` of entry ``o`` (of ``chunks``): one chain per chunk, or none."""
    chains = _chains(o.get("delta_bases", []), what)
    if chains and len(chains) != len(chunks):
        raise StoreFormatError(f"{what} has delta_bases for {len(chains)} of {len(chunks)} chunks")
    return chains


def chunk_count(nbytes: int, chunk_size: int) -> int:
    return -(-nbytes // chunk_size)


def split_lengths(nbytes: int, chunk_size: int) -> list[int]:
    """Lengths of the chunks ``nbytes`` is split into (an empty tensor has none)."""
    full, rest = divmod(nbytes, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])
