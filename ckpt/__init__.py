"""ckpt: a content-addressed store for PyTorch checkpoints and fine-tunes.

>>> import ckpt
>>> store = ckpt.Store.init("memory://ckpt-init-doctest")
>>> sorted(store.refs())
[]

The public API is :class:`Store` (open/init, push, pull, load, load_into, reader,
verify, du, gc), :class:`CheckpointManager` (training-loop snapshots) with
:class:`RNGState` and the :class:`Stateful` protocol, :class:`Settings`, the
verbs :func:`diff`, :func:`merge` and :func:`remix` (in ``ckpt.diffing``,
``ckpt.merging`` and ``ckpt.remixing``, so that the names stay functions), and the errors in :mod:`ckpt.errors`.
Importing ckpt is cheap: torch and the rest load when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["CheckpointManager", "CheckpointReader", "CkptError", "RNGState", "Settings", "Stateful", "Store", "__version__",
           "diff", "merge", "remix"]

if TYPE_CHECKING:
    from ckpt.diffing import diff
    from ckpt.errors import CkptError
    from ckpt.manager import CheckpointManager
    from ckpt.merging import merge
    from ckpt.reader import CheckpointReader
    from ckpt.remixing import remix
    from ckpt.settings import Settings
    from ckpt.state import RNGState, Stateful
    from ckpt.store import Store

_LAZY = {
    "Store": "ckpt.store",
    "Settings": "ckpt.settings",
    "CheckpointReader": "ckpt.reader",
    "CkptError": "ckpt.errors",
    "CheckpointManager": "ckpt.manager",
    "RNGState": "ckpt.state",
    "Stateful": "ckpt.state",
    "diff": "ckpt.diffing",
    "merge": "ckpt.merging",
    "remix": "ckpt.remixing",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
