"""Progress reporting (see storage/progress.py, where it lives so that storage/ can report too)."""

from __future__ import annotations

from ckpt_store.storage.progress import NullProgress, Progress, reporting

__all__ = ["NullProgress", "Progress", "reporting"]
