"""What changed between two checkpoints, tensor by tensor (:func:`diff`), read from refs or
local files (sides.py), and the layer x module heatmap (plot.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt._lazy import lazy_exports

if TYPE_CHECKING:
    from ckpt.diffing.compare import DiffReport, TensorDiff, diff

__all__ = ["DiffReport", "TensorDiff", "diff"]
__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "ckpt.diffing.compare"), globals())
