"""ckpt: a content-addressed store for PyTorch checkpoints and fine-tunes.

>>> import ckpt
>>> store = ckpt.Store.init("memory://ckpt-init-doctest")
>>> sorted(store.refs())
[]

The public API is :class:`Store` (open/init, push, pull, load, load_into, reader,
verify, du, gc), :class:`CheckpointManager` (training-loop snapshots) with
:class:`RNGState` and the :class:`Stateful` protocol, :class:`Settings`, the
verbs :func:`load`, :func:`load_into`, :func:`diff`, :func:`merge` and :func:`remix`, and the errors in :mod:`ckpt.errors`.
The subpackages say where everything lives (docs/architecture.md): ``ckpt.store``
(push, pull, load, verify, copy), ``ckpt.snapshot`` (training loops), ``ckpt.dcp``
(torch.distributed.checkpoint), ``ckpt.diffing``, ``ckpt.merging``, ``ckpt.codecs``,
``ckpt.format`` (what is stored) and ``ckpt.transfer`` (moving chunks in parallel).
Importing ckpt is cheap: torch and the rest load when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt._lazy import lazy_exports

__version__ = "0.1.0"

__all__ = ["CheckpointManager", "CheckpointReader", "CkptError", "KeepBest", "PerRank", "RNGState", "ResumeWarning", "Settings", "Stateful", "Store", "TierWarning",
           "__version__", "diff", "load", "load_into", "merge", "remix"]

if TYPE_CHECKING:
    from ckpt.diffing.compare import diff
    from ckpt.errors import CkptError
    from ckpt.merging.combine import merge
    from ckpt.merging.remixing import remix
    from ckpt.settings import Settings
    from ckpt.snapshot.manager import CheckpointManager
    from ckpt.snapshot.retention import KeepBest
    from ckpt.snapshot.run import ResumeWarning, TierWarning
    from ckpt.snapshot.state import PerRank, RNGState, Stateful
    from ckpt.store.reader import CheckpointReader
    from ckpt.store.store import Store, load, load_into

_LAZY = {
    "Store": "ckpt.store.store",
    "load": "ckpt.store.store",
    "load_into": "ckpt.store.store",
    "Settings": "ckpt.settings",
    "CheckpointReader": "ckpt.store.reader",
    "CkptError": "ckpt.errors",
    "CheckpointManager": "ckpt.snapshot.manager",
    "RNGState": "ckpt.snapshot.state",
    "PerRank": "ckpt.snapshot.state",
    "KeepBest": "ckpt.snapshot.retention",
    "Stateful": "ckpt.snapshot.state",
    "TierWarning": "ckpt.snapshot.run",
    "ResumeWarning": "ckpt.snapshot.run",
    "diff": "ckpt.diffing.compare",
    "merge": "ckpt.merging.combine",
    "remix": "ckpt.merging.remixing",
}


__getattr__ = lazy_exports(__name__, _LAZY, globals())
