"""Pure, vectorised, lossless transforms of a chunk against its base chunk.

Both work on the raw bit patterns, viewed as little-endian integers of the
element size, so they are exact for every value: NaN payloads, -0.0, inf and
subnormals included. ``undo_*(apply_*(new, base), base) == new`` always.

* XOR: bits that did not change become 0.
* SUB: floats' bit patterns are mapped to integers that order like the floats
  (negative values have their magnitude bits flipped), subtracted with wraparound,
  and zigzag-encoded, so a tiny change of value becomes a small integer whose high
  bytes are 0 — which the byte-plane codec then stores in almost no space.
"""

from __future__ import annotations

import numpy as np

_INT = {2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}
_UINT = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def supports(elem: int) -> bool:
    return elem in _INT


def _ints(buf: bytes | memoryview, elem: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=_INT[elem])


def _ordered(x: np.ndarray, elem: int) -> np.ndarray:
    """Bit pattern -> integer ordered like the float (an involution: applying it twice is identity)."""
    bits = elem * 8
    mask = np.array((1 << (bits - 1)) - 1, dtype=x.dtype)
    return x ^ ((x >> (bits - 1)) & mask)


def apply_xor(new: bytes | memoryview, base: bytes | memoryview, elem: int) -> np.ndarray:
    return np.bitwise_xor(_ints(new, elem), _ints(base, elem))


def undo_xor(delta: bytes | memoryview, base: bytes | memoryview, elem: int) -> np.ndarray:
    return np.bitwise_xor(_ints(delta, elem), _ints(base, elem))


def apply_sub(new: bytes | memoryview, base: bytes | memoryview, elem: int) -> np.ndarray:
    bits = elem * 8
    with np.errstate(over="ignore"):
        d = _ordered(_ints(new, elem), elem) - _ordered(_ints(base, elem), elem)  # wraps, on purpose
        return ((d << 1) ^ (d >> (bits - 1))).view(_UINT[elem])  # zigzag: small |d| -> small value


def undo_sub(delta: bytes | memoryview, base: bytes | memoryview, elem: int) -> np.ndarray:
    z = np.frombuffer(delta, dtype=_UINT[elem])
    with np.errstate(over="ignore"):
        d = ((z >> 1) ^ (np.zeros(1, dtype=_UINT[elem]) - (z & 1))).view(_INT[elem])
        return _ordered(_ordered(_ints(base, elem), elem) + d, elem)
