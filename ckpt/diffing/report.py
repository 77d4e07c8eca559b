"""What a diff returns: one :class:`TensorDiff` per tensor and a :class:`DiffSummary`, in a
:class:`DiffReport` that sorts, selects and prints itself as JSON (made by :mod:`ckpt.diffing.compare`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("identical", "changed", "added", "removed", "shape_changed", "dtype_changed")
SORT_KEYS = ("order", "name", "status", "relative_change", "max_abs_diff", "changed_elements", "cosine", "delta_bytes")


@dataclass(frozen=True)
class TensorDiff:
    """One tensor's record. Statistics are None where they do not apply (added,
    removed or reshaped tensors) or are undefined (see :class:`TensorStats`)."""

    name: str
    status: str  # one of STATUSES
    dtype_a: str | None
    dtype_b: str | None
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    numel: int
    changed_elements: int | None
    relative_change: float | None
    max_abs_diff: float | None
    cosine: float | None
    delta_bytes: int | None  # estimated stored bytes of B's tensor as a delta against A's
    read: bool  # False: decided from the manifests (chunk ids) alone
    nonfinite_elements: int | None = None  # changed elements that are NaN or ±inf in A or B (None: not compared)

    @property
    def nonfinite(self) -> bool:
        """A NaN or inf is part of the change (a diverged fine-tune): such rows sort first."""
        return bool(self.nonfinite_elements) or any(
            v is not None and not math.isfinite(v) for v in (self.max_abs_diff, self.relative_change))

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values: NaN and inf become the strings "nan", "inf", "-inf"
        (JSON has no such numbers), and ``nonfinite`` flags the record."""
        d = {k: _json_number(v) for k, v in asdict(self).items()}
        d["shape_a"] = list(self.shape_a) if self.shape_a is not None else None
        d["shape_b"] = list(self.shape_b) if self.shape_b is not None else None
        d["nonfinite"] = self.nonfinite
        return d


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


@dataclass(frozen=True)
class DiffSummary:
    tensors: int
    identical: int
    identical_unread: int  # identical by chunk ids: no data read
    changed: int
    added: int
    removed: int
    shape_changed: int
    dtype_changed: int
    elements: int  # elements of the tensors compared element by element
    changed_elements: int
    bytes_a: int
    bytes_b: int
    relative_change: float | None  # ‖B−A‖/‖A‖ over every tensor compared element by element (NaN/inf as such)
    delta_bytes: int | None  # stored bytes of B pushed as a delta against A (estimate; None: not estimated)
    nonfinite: int = 0  # tensors whose change involves NaN or inf


@dataclass(frozen=True)
class DiffReport:
    """Per-tensor records (A's order, then tensors only B has) and a summary."""

    a: str
    b: str
    a_id: str | None
    b_id: str | None
    tensors: list[TensorDiff]
    summary: DiffSummary
    options: dict[str, Any] = field(default_factory=dict)

    def select(self, sort: str = "order", top: int | None = None) -> list[TensorDiff]:
        """Records sorted by ``sort`` (one of SORT_KEYS; largest change first, cosine
        smallest first, None last), the first ``top`` of them. By every statistic,
        records whose change involves NaN or inf come first (NaN before inf)."""
        if sort not in SORT_KEYS:
            raise ValueError(f"unknown sort key {sort!r}; one of {', '.join(SORT_KEYS)}")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise ValueError(f"top must be an int >= 1 (or None for every tensor), not {top!r}")
        rows = list(self.tensors)
        if sort == "name":
            rows.sort(key=lambda t: t.name)
        elif sort == "status":
            rows.sort(key=lambda t: STATUSES.index(t.status))
        elif sort != "order":
            sign = 1.0 if sort == "cosine" else -1.0

            def key(t: TensorDiff) -> tuple[int, float]:
                v = getattr(t, sort)
                if isinstance(v, float) and math.isnan(v):
                    return (0, 0.0)
                if t.nonfinite or (isinstance(v, float) and math.isinf(v)):
                    return (1, sign * v if isinstance(v, float) and math.isinf(v) else 0.0)
                return (2, sign * v) if v is not None else (3, 0.0)

            rows.sort(key=key)
        return rows if top is None else rows[:top]

    def to_json(self, sort: str = "order", top: int | None = None) -> dict[str, Any]:
        """``{"a", "b", "tensors": [...], "summary": {...}}``; the summary covers every
        tensor that passed include/exclude, ``tensors`` only the selected ones."""
        return {
            "a": {"ref": self.a, "id": self.a_id},
            "b": {"ref": self.b, "id": self.b_id},
            "tensors": [t.to_json() for t in self.select(sort, top)],
            "summary": {k: _json_number(v) for k, v in asdict(self.summary).items()},
            "options": self.options,
        }
