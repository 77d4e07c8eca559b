"""A store and its verbs: push (sources, base choice), pull and load, the lazy reader,
verify/du/gc/repair, and copying between stores. :class:`Store` is the entry point."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt._lazy import lazy_exports

if TYPE_CHECKING:
    from ckpt.store.reader import CheckpointReader
    from ckpt.store.store import Store

__all__ = ["CheckpointReader", "Store"]
__getattr__ = lazy_exports(__name__, {"Store": "ckpt.store.store", "CheckpointReader": "ckpt.store.reader"}, globals())
