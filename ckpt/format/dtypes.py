"""The dtypes safetensors names, their element sizes, and their torch counterparts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# safetensors dtype name -> (element size in bytes, torch attribute name)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "C64": (8, "complex64"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U64": (8, "uint64"),
    "U32": (4, "uint32"),
    "U16": (2, "uint16"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
}


def itemsize(dtype: str) -> int | None:
    """Bytes per element, or None for a dtype this ckpt does not know (stored as opaque bytes)."""
    entry = DTYPES.get(dtype)
    return entry[0] if entry else None


def to_torch(dtype: str) -> torch.dtype:
    import torch

    from ckpt.errors import InvalidSourceError

    entry = DTYPES.get(dtype)
    if entry is None or not hasattr(torch, entry[1]):
        raise InvalidSourceError(dtype, "this dtype has no torch equivalent here", hint="pull it as safetensors")
    return getattr(torch, entry[1])


def from_torch(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    for st, (_, tname) in DTYPES.items():
        if tname == name:
            return st
    from ckpt.errors import InvalidSourceError

    raise InvalidSourceError(str(dtype), "ckpt cannot store tensors of this dtype")


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    import torch

    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element sliced out of a row (w[:, 0]): contiguous, yet view() refuses its stride
        flat = flat.as_strided((1,), (1,))
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(raw.numpy()).cast("B")


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as integers of the same width (flat, no copy): equal patterns
    mean equal bytes, so NaN == NaN and -0.0 != 0.0, unlike comparing values."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    flat = t.reshape(-1)
    return flat.view(ints[flat.element_size()]) if flat.numel() else flat.view(torch.uint8)


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(bit_pattern(a.contiguous()).equal(bit_pattern(b.contiguous())))
