"""Combining checkpoints: :func:`merge` (tensor by tensor, combine.py) with a registry of
named methods (methods.py), and :func:`remix` (average the best-scoring fine-tunes, remixing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt._lazy import lazy_exports

if TYPE_CHECKING:
    from ckpt.merging.combine import merge
    from ckpt.merging.remixing import remix

__all__ = ["merge", "remix"]
__getattr__ = lazy_exports(__name__, {"merge": "ckpt.merging.combine", "remix": "ckpt.merging.remixing"}, globals())
