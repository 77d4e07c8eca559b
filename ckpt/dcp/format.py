"""DCP's checkpoint metadata as JSON, never pickle (the layout ``ckpt.dcp`` stores).

``torch.distributed.checkpoint`` pickles its :class:`Metadata`; a ckpt manifest
records the same facts as canonical JSON under ``extra["dcp"]`` instead::

    {"format": "ckpt-dcp", "version": 1, "dcp_version": "1.0.0",
     "items": {"model.w": {"kind": "tensor", "dtype": "F32", "size": [8, 4], "requires_grad": false,
                           "shards": [{"offsets": [0, 0], "sizes": [4, 4], "entry": "model.w[0:4,0:4]"},
                                      {"offsets": [4, 0], "sizes": [4, 4], "entry": "model.w[4:8,0:4]"}]},
               "step": {"kind": "value", "value": 100}},
     "planner_data": {"model.w": ["model", "w"], "step": ["step"]}}

Every shard a rank saved is a tensor entry of the manifest (``entry`` is its
name there). Non-tensor items are stored as tagged JSON values (tuples, dicts
with non-string keys, non-finite floats and bytes are tagged so they round-trip);
anything else is refused when saving, so nothing is ever unpickled on load.
Only what this module writes is accepted when loading. No key here is named
``chunks`` or ``delta_bases``, the names gc reads as chunk lists (docs/format.md).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.errors import CkptError
from ckpt.format import tagged_json
from ckpt.format.dtypes import DTYPES, itemsize
from ckpt.format.names import check_tensor_name
from ckpt.format.safetensors_header import MAX_ELEMENTS
from ckpt_store.storage.chunk_lists import CHUNK_LIST_KEYS
from ckpt_store.storage.errors import InvalidNameError, StoreFormatError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

DCP_SOURCE = "dcp"  # Manifest.source of a distributed checkpoint
DCP_FORMAT = "ckpt-dcp"
DCP_VERSION = 1
# Version 2: as 1, where a value uses a tag added later (tagged_json.LATER_TAGS: a torch.dtype, a set...), which a
# version-1 reader would hand out as the dict {"__dtype__": ...}: it refuses version 2 instead.
DCP_TORCH_VERSION = 2


class UnsupportedStateError(CkptError):
    """A value in a distributed state dict that ckpt cannot store without pickle."""


@dataclass(frozen=True)
class Shard:
    """One saved piece of a tensor: its place in the full tensor and its manifest entry."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    entry: str


@dataclass(frozen=True)
class TensorItem:
    fqn: str
    dtype: str  # safetensors name (ckpt.format.dtypes)
    size: tuple[int, ...]
    shards: tuple[Shard, ...]
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * (itemsize(self.dtype) or 1)


@dataclass(frozen=True)
class DcpLayout:
    """The decoded ``extra["dcp"]`` record of a manifest."""

    tensors: dict[str, TensorItem]
    values: dict[str, Any]  # fqn -> decoded Python value
    planner_data: dict[str, tuple[str | int, ...]] | None
    dcp_version: str | None


def shard_name(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], size: tuple[int, ...]) -> str:
    """Manifest name of a shard: ``fqn`` for a whole tensor, else ``fqn[a:b,c:d]``."""
    if tuple(sizes) == tuple(size):
        return fqn
    return f"{fqn}[{','.join(f'{o}:{o + s}' for o, s in zip(offsets, sizes))}]"


# -- values ----------------------------------------------------------------------------
def encode_value(x: Any, where: str) -> Any:
    """A Python value as tagged JSON (:mod:`ckpt.format.tagged_json`), or
    :class:`UnsupportedStateError` naming where in ``where`` it is. Keys that name chunks
    in a manifest entry are reserved, so user state can never pose as a chunk list."""

    def unsupported(path: str, what: str) -> Exception:
        return UnsupportedStateError(
            f"{path} is {what}: ckpt stores non-tensor state as JSON, never pickle",
            hint="store tensors, or plain values (numbers, strings, lists, dicts, tuples, bytes); "
            "give objects state_dict()/load_state_dict() returning such values",
        )

    return tagged_json.encode(x, where, unsupported=unsupported, reserved=CHUNK_LIST_KEYS)


def decode_value(x: Any, what: str, *, later: bool = True) -> Any:
    """Inverse of :func:`encode_value`; a :class:`StoreFormatError` for anything it would not write.
    ``later``: the record is of a version with the tags added after version 1 (``DCP_TORCH_VERSION``)."""
    return tagged_json.decode(x, what, later=later)


# -- metadata --------------------------------------------------------------------------
def encode_metadata(md: Metadata, entries: dict[tuple[str, tuple[int, ...]], str], values: dict[str, Any]) -> dict[str, Any]:
    """``extra["dcp"]`` for DCP metadata ``md``.

    ``entries`` maps (fqn, shard offsets) to the manifest entry written for that
    shard; ``values`` maps each non-tensor fqn to its tagged JSON value.
    Raises :class:`UnsupportedStateError` for anything this layout cannot hold.
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorStorageMetadata,
    )

    from ckpt.format.dtypes import from_torch

    items: dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        check_tensor_name(fqn, "state dict key")
        if isinstance(sm, TensorStorageMetadata):
            p = sm.properties
            if p.layout != torch.strided:
                raise UnsupportedStateError(f"{fqn}: tensors of layout {p.layout} are not supported (strided only)")
            shards = []
            for c in sm.chunks:
                key = (fqn, tuple(int(o) for o in c.offsets))
                if key not in entries:
                    raise CkptError(f"{fqn}: no rank wrote the shard at offsets {list(key[1])}",
                                    hint="the save plan and the written data disagree; please report this")
                shards.append({"offsets": list(key[1]), "sizes": [int(s) for s in c.sizes], "entry": entries[key]})
            items[fqn] = {"kind": "tensor", "dtype": from_torch(p.dtype), "size": [int(s) for s in sm.size],
                          "requires_grad": bool(p.requires_grad), "shards": shards}
        elif isinstance(sm, BytesStorageMetadata):
            if fqn not in values:
                raise CkptError(f"{fqn}: no rank wrote this value", hint="please report this")
            items[fqn] = {"kind": "value", "value": values[fqn]}
        else:
            raise UnsupportedStateError(f"{fqn}: DCP storage type {type(sm).__name__} is not supported")
    pd = md.planner_data
    planner: dict[str, list[str | int]] | None = None
    if pd is not None:
        if not isinstance(pd, dict) or not all(
            isinstance(k, str) and isinstance(v, (tuple, list))
            and all(isinstance(e, (str, int)) and not isinstance(e, bool) for e in v) for k, v in pd.items()
        ):
            raise UnsupportedStateError("this planner's planner_data is not supported (only key paths of str/int)",
                                        hint="use DefaultSavePlanner, or a planner whose planner_data is None")
        planner = {k: list(v) for k, v in pd.items()}
    tagged = any(tagged_json.uses_tags(it["value"], tagged_json.LATER_TAGS) for it in items.values() if it["kind"] == "value")
    return {"format": DCP_FORMAT, "version": DCP_TORCH_VERSION if tagged else DCP_VERSION, "dcp_version": md.version, "items": items,
            "planner_data": planner}


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in x):
        raise StoreFormatError(f"{what}: bad integer list {str(x)[:80]}")
    return tuple(x)


# Corners of one shard the cover check counts: 2 ** (dimensions along which the shard ends inside the
# tensor), 2 or 4 for a mesh's layouts. A bound per shard keeps the check's cost in proportion to the
# manifest's size (a budget per tensor let a few forged shards of many dimensions cost a second each).
MAX_CORNERS = 256


def _covers_once(shards: list[Shard], size: tuple[int, ...]) -> bool | None:
    """Whether ``shards`` (boxes inside a tensor of ``size``) cover each of its elements exactly once;
    None if a shard has more than :data:`MAX_CORNERS` corners to count.

    Exact, and linear in the shards: the number of shards over each element (a function on the
    tensor's elements) is the tensor's indicator function exactly when their differences along every
    dimension (``g(x) - g(x - 1)``, undone by a prefix sum) are. A shard's difference is a signed
    point at each corner made of its starts and those of its ends that fall inside the tensor; the
    tensor's own is one point, its origin. So a row- or column-sharded tensor costs two points a shard,
    however its shards line up."""
    if not all(size):
        return True  # an empty tensor: nothing to cover (and every shard inside it is empty)
    boxes = [(s.offsets, s.sizes) for s in shards if all(s.sizes)]  # empty shards hold nothing
    if any(1 << sum(o + z < n for o, z, n in zip(off, sz, size)) > MAX_CORNERS for off, sz in boxes):
        return None
    count: dict[tuple[int, ...], int] = {(0,) * len(size): -1}
    for off, sz in boxes:
        choices = [((o, 1), (o + z, -1)) if o + z < n else ((o, 1),) for o, z, n in zip(off, sz, size)]
        for corner in itertools.product(*choices):
            key = tuple(c for c, _ in corner)
            count[key] = count.get(key, 0) + math.prod(sign for _, sign in corner)
    return not any(count.values())


def decode_layout(extra: dict[str, Any], what: str) -> DcpLayout:
    """Parse and validate ``extra["dcp"]`` of a manifest (no torch needed)."""
    try:
        return _decode_layout(extra, what)
    except InvalidNameError as e:  # a key the record holds, not one a user typed: the manifest is damaged, named
        raise StoreFormatError(f"{what}: {e.message}") from None


def _decode_layout(extra: dict[str, Any], what: str) -> DcpLayout:
    o = extra.get("dcp")
    if not isinstance(o, dict) or o.get("format") != DCP_FORMAT:
        raise StoreFormatError(f"{what} is not a distributed (DCP) checkpoint")
    if type(o.get("version")) is not int or o["version"] not in (DCP_VERSION, DCP_TORCH_VERSION):  # (true is no 1)
        raise StoreFormatError(f"{what}: ckpt-dcp version {o.get('version')!r}; this ckpt reads versions {DCP_VERSION}, "
                               f"{DCP_TORCH_VERSION}",
                               hint="upgrade ckpt to read it")
    items = o.get("items")
    if not isinstance(items, dict):
        raise StoreFormatError(f"{what}: ckpt-dcp record lacks items")
    tensors: dict[str, TensorItem] = {}
    values: dict[str, Any] = {}
    for fqn, it in items.items():
        check_tensor_name(fqn, "state dict key")
        w = f"{what}: item {fqn!r}"
        if not isinstance(it, dict) or it.get("kind") not in ("tensor", "value"):
            raise StoreFormatError(f"{w} is neither a tensor nor a value")
        if it["kind"] == "value":
            values[fqn] = decode_value(it.get("value"), w, later=o["version"] == DCP_TORCH_VERSION)
            continue
        dtype, size, shards = it.get("dtype"), _ints(it.get("size"), w), it.get("shards")
        # (a dtype of another JSON type, a list say, is no key of DTYPES: asked as one, a TypeError went up to the user)
        if not isinstance(dtype, str) or dtype not in DTYPES or not isinstance(shards, list) \
                or not isinstance(it.get("requires_grad", False), bool):
            raise StoreFormatError(f"{w}: bad dtype, shards or requires_grad")
        if math.prod(d for d in size if d) > MAX_ELEMENTS:  # torch's strides and storage size are int64
            raise StoreFormatError(f"{w}: size {list(size)} overflows 64 bits; no reader can load it")
        out = []
        for s in shards:
            if not isinstance(s, dict) or not isinstance(s.get("entry"), str):
                raise StoreFormatError(f"{w}: bad shard")
            off, sz = _ints(s.get("offsets"), w), _ints(s.get("sizes"), w)
            if len(off) != len(size) or len(sz) != len(size) or any(a + b > d for a, b, d in zip(off, sz, size)):
                raise StoreFormatError(f"{w}: shard {list(off)}+{list(sz)} lies outside the tensor {list(size)}")
            out.append(Shard(off, sz, check_tensor_name(s["entry"])))
        # The shards must cover the tensor exactly once: two copies of one region would leave another
        # region unwritten (uninitialised memory, pulled and loaded without a word).
        covered = _covers_once(out, size)
        if covered is None:
            raise StoreFormatError(f"{w}: a shard ends inside it along more than {MAX_CORNERS.bit_length() - 1} dimensions: "
                                   "too many to check that the shards cover it exactly once")
        if not covered:
            raise StoreFormatError(f"{w}: its shards do not cover the tensor exactly once")
        tensors[fqn] = TensorItem(fqn, dtype, size, tuple(out), it.get("requires_grad", False))
    pd = o.get("planner_data")
    planner = None
    if pd is not None:
        if not isinstance(pd, dict) or not all(
            isinstance(v, list) and all(isinstance(e, (str, int)) and not isinstance(e, bool) for e in v) for v in pd.values()
        ):
            raise StoreFormatError(f"{what}: bad planner_data")
        planner = {k: tuple(v) for k, v in pd.items()}
    ver = o.get("dcp_version")
    return DcpLayout(tensors, values, planner, ver if isinstance(ver, str) else None)


def to_metadata(layout: DcpLayout, manifest_id: str) -> Metadata:
    """DCP :class:`Metadata` for a stored layout. ``storage_data`` maps each
    ``MetadataIndex`` to the shard's entry name (tensors) or ``None`` (values)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckpt.format.dtypes import to_torch

    sdm: dict[str, Any] = {}
    storage: dict[Any, str | None] = {}
    for fqn, t in layout.tensors.items():
        props = TensorProperties(dtype=to_torch(t.dtype), requires_grad=t.requires_grad)
        chunks = [ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes)) for s in t.shards]
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(t.size), chunks=chunks)
        for s in t.shards:
            storage[MetadataIndex(fqn, s.offsets)] = s.entry
    for fqn in layout.values:
        sdm[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = None
    planner = dict(layout.planner_data) if layout.planner_data is not None else None
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=manifest_id), version=layout.dcp_version)
