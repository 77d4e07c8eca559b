"""Canonical JSON for every record the store keeps (configs, refs, manifests).

Records are serialised with sorted keys, no whitespace and ASCII escapes, so the
same record always has the same bytes, and therefore the same id. Every record
carries ``format`` and ``version``; :func:`decode_record` refuses any other.
"""

from __future__ import annotations

import json
from typing import Any

import blake3

from ckpt_store.storage.errors import StoreFormatError

# Records that are not content-addressed (refs, the store config) carry a checksum
# of their other fields, so that any damage to them is detected, not just damage that
# breaks the JSON. Manifests need none: their id is the hash of their bytes.
CHECK = "check"

# Records larger than this are refused before parsing (a manifest of a
# 100k-tensor model is a few tens of MB).
MAX_RECORD_BYTES = 256 * 1024 * 1024


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding of a JSON-able value used for ids and storage."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    x = float(text)
    if x in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is too large for a number here")
    return x


def strict_loads(data: bytes | str) -> Any:
    """``json.loads`` for what a store holds: what :func:`canonical_json` can write, and nothing
    else. NaN and Infinity (which Python's parser accepts) and numbers too large for a float are
    refused (ValueError), so a record read back can always be encoded, sealed and checked."""
    return json.loads(data, parse_constant=_no_constant, parse_float=_finite)


def _checksum(obj: dict[str, Any]) -> str:
    return blake3.blake3(canonical_json({k: v for k, v in obj.items() if k != CHECK})).hexdigest()[:32]


def sealed_json(obj: dict[str, Any]) -> bytes:
    """``obj`` as canonical JSON with a ``check`` field over all its other fields."""
    return canonical_json({**obj, CHECK: _checksum(obj)})


def decode_record(data: bytes, fmt: str, versions: tuple[int, ...], what: str, *, sealed_since: int | None = None) -> dict[str, Any]:
    """Parse ``data`` as a JSON object of ``format == fmt`` and a supported version.

    From version ``sealed_since`` on, the record must carry a ``check`` field that
    matches its other fields (:func:`sealed_json`). Raises :class:`StoreFormatError`
    naming ``what`` when the bytes are not such a record.
    """
    if len(data) > MAX_RECORD_BYTES:
        raise StoreFormatError(f"{what} is {len(data)} bytes, larger than any valid record")
    try:
        obj = strict_loads(data)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise StoreFormatError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise StoreFormatError(f"{what} is not a JSON object")
    if obj.get("format") != fmt:
        raise StoreFormatError(f"{what} is not a {fmt} record (format={obj.get('format')!r})")
    v = obj.get("version")
    if type(v) is not int or v not in versions:  # (true is no version, though Python takes it for 1)
        raise StoreFormatError(
            f"{what} has {fmt} version {v!r}; this ckpt reads versions {', '.join(map(str, versions))}",
            hint="upgrade ckpt to read it",
        )
    sealed = CHECK in obj or (sealed_since is not None and isinstance(v, int) and v >= sealed_since)
    if sealed and obj.get(CHECK) != _checksum(obj):
        raise StoreFormatError(f"{what} is damaged: its checksum does not match its content")
    return obj


def require(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], what: str) -> Any:
    """``obj[key]`` checked to be of ``typ``; a clear :class:`StoreFormatError` otherwise."""
    if key not in obj:
        raise StoreFormatError(f"{what} lacks field {key!r}")
    val = obj[key]
    if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
        raise StoreFormatError(f"{what} field {key!r} has the wrong type ({type(val).__name__})")
    return val


def finite_time(value: float, what: str) -> float:
    """A timestamp read from a store: a number a date can be made of (a JSON integer may be
    too large for a float)."""
    try:
        t = float(value)
    except OverflowError:
        raise StoreFormatError(f"{what} is not a time") from None
    if not -1e12 < t < 1e12:  # about 30,000 years either way of 1970
        raise StoreFormatError(f"{what} is not a time")
    return t
