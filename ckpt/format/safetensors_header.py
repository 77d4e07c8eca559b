"""Reading and writing safetensors headers, validated before any tensor byte is touched.

Layout: u64 little-endian header length N, N bytes of UTF-8 JSON (padded with
spaces), then the data section, where every tensor's ``data_offsets`` are
relative to the start of the data section and together cover it exactly.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from ckpt.errors import CkptError, InvalidSourceError
from ckpt.format.dtypes import itemsize
from ckpt.format.entries import MAX_HEADER, FileEntry
from ckpt.format.manifest import Manifest
from ckpt.format.names import check_tensor_name
from ckpt_store.storage.errors import InvalidNameError, StoreFormatError

MAX_ELEMENTS = (1 << 63) - 1  # torch counts elements in an int64


@dataclass(frozen=True)
class TensorSpan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset in the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    head: bytes  # the first 8 + N bytes of the file, verbatim
    tensors: tuple[TensorSpan, ...]  # in data-section order
    metadata: dict[str, str] | None

    @property
    def head_size(self) -> int:
        return len(self.head)

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_header(head_prefix: bytes, read_rest: object, file_size: int, source: str) -> Header:
    """Parse and validate a safetensors header.

    ``head_prefix`` is the file's first 8 bytes; ``read_rest(n)`` returns the
    next ``n`` bytes. Every tensor must have a known or well-formed dtype, a
    shape that matches its byte length, and the spans must tile the data
    section with no gap, overlap or trailing bytes.
    """
    if len(head_prefix) < 8:
        raise InvalidSourceError(source, "file is too short to be safetensors (no header length)")
    (n,) = struct.unpack("<Q", head_prefix[:8])
    if n > MAX_HEADER:
        raise InvalidSourceError(source, f"header claims {n} bytes (limit {MAX_HEADER}); not a safetensors file?")
    if 8 + n > file_size:
        raise InvalidSourceError(source, f"truncated: header claims {n} bytes but the file has {file_size - 8}")
    raw = read_rest(n)  # type: ignore[operator]
    if len(raw) != n:
        raise InvalidSourceError(source, "truncated header")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidSourceError(source, f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidSourceError(source, "header is not a JSON object")
    meta = obj.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise InvalidSourceError(source, "__metadata__ must map strings to strings")
    spans = []
    for name, info in obj.items():
        check_tensor_name(name)
        if not isinstance(info, dict):
            raise InvalidSourceError(source, f"tensor {name!r}: entry is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or not dtype.isascii() or not dtype or len(dtype) > 32:
            raise InvalidSourceError(source, f"tensor {name!r}: bad dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise InvalidSourceError(source, f"tensor {name!r}: bad shape {shape!r}")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in offs)
            and 0 <= offs[0] <= offs[1]
        ):
            raise InvalidSourceError(source, f"tensor {name!r}: bad data_offsets {offs!r}")
        count = 1
        for d in shape:  # as safetensors checks it: a running product past 64 bits (even one ending in 0) is refused
            count *= d
            if count > MAX_ELEMENTS:
                raise InvalidSourceError(source, f"tensor {name!r}: shape {shape} overflows 64 bits; no reader can load it")
        size = itemsize(dtype)
        if size is not None and math.prod(shape) * size != offs[1] - offs[0]:
            raise InvalidSourceError(
                source, f"tensor {name!r}: shape {shape} of {dtype} needs {math.prod(shape) * size} bytes, "
                f"data_offsets give {offs[1] - offs[0]}"
            )
        spans.append(TensorSpan(name, dtype, tuple(shape), offs[0], offs[1]))
    spans.sort(key=lambda s: (s.begin, s.end))
    pos = 0
    for s in spans:
        if s.begin != pos:
            raise InvalidSourceError(source, f"tensor {s.name!r} data does not start where the previous ends (gap or overlap)")
        pos = s.end
    if 8 + n + pos != file_size:
        what = "truncated" if 8 + n + pos > file_size else "has trailing bytes"
        raise InvalidSourceError(source, f"{what}: tensors need {8 + n + pos} bytes, the file has {file_size}")
    return Header(bytes(head_prefix[:8]) + bytes(raw), tuple(spans), meta)


def check_not_reserved(name: str, hint: str = "rename the tensor; a checkpoint that holds one pulls as a .pt file") -> None:
    """A tensor named ``__metadata__`` (the header's metadata) is an :class:`InvalidNameError`: a
    safetensors file holding it would not load (it would overwrite the metadata, or be read as it)."""
    if name == "__metadata__":
        raise InvalidNameError("tensor name '__metadata__' is reserved by safetensors for metadata", hint=hint)


def build_header(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for tensors ``(name, dtype, shape, nbytes)``.

    Tensors are laid out the way safetensors does it (larger elements first,
    then by name), so the result loads with any safetensors reader. Returns the
    header and the order (indices into ``tensors``) of the data section. A tensor named
    ``__metadata__`` (the header's metadata) is an :class:`InvalidNameError`: its file would not load.
    """
    for t in tensors:
        check_not_reserved(t[0])
    order = sorted(range(len(tensors)), key=lambda i: (-(itemsize(tensors[i][1]) or 1), tensors[i][0]))
    obj: dict[str, object] = {}
    if metadata:
        obj["__metadata__"] = metadata
    pos = 0
    for i in order:
        name, dtype, shape, nbytes = tensors[i]
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    js = json.dumps(obj, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, order


def check_layout(head: bytes, m: Manifest, f: FileEntry, what: str) -> None:
    """Refuse checkpoint file ``f`` of ``m`` when its stored header (``head``, its bytes) does not
    describe the tensors the manifest places after it, each by name, dtype, shape and offset.

    A pull writes the header as stored and the manifest's tensors after it, while a load, a
    diff or a merge reads the manifest's tensors by name: a manifest whose header disagrees
    (one no ckpt writes) would make the file pulled hold other tensors than the ones loaded.
    Raises :class:`StoreFormatError` naming ``what``.
    """
    try:
        h = parse_header(head[:8], lambda n: head[8 : 8 + n], f.size, f.path)
    except CkptError as e:
        raise StoreFormatError(f"{what}: the stored header of {f.path} is not a safetensors header ({e})") from None
    spans = {s.name: s for s in h.tensors}
    pos, named = 0, 0
    for t in m.tensors:
        if t.file != f.path:
            continue
        s = spans.get(t.name)
        if h.head_size != f.head_size or s is None or (s.dtype, s.shape, s.begin, s.end) != (t.dtype, t.shape, pos, pos + t.nbytes):
            raise StoreFormatError(f"{what}: the stored header of {f.path} does not place tensor {t.name} where the manifest does",
                                   hint="a pull would write other tensors than a load reads: the manifest is damaged")
        pos += t.nbytes
        named += 1
    if named != len(spans):
        raise StoreFormatError(f"{what}: the stored header of {f.path} names tensors the manifest does not")
