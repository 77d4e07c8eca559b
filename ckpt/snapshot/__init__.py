"""Training-loop snapshots: :class:`CheckpointManager` (asynchronous, incremental saves and
in-place restores), the state it understands (:class:`RNGState`, :class:`Stateful`), the
overlapped copy and the distributed path through torch.distributed.checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt._lazy import lazy_exports

if TYPE_CHECKING:
    from ckpt.snapshot.manager import CheckpointManager, SaveStats
    from ckpt.snapshot.retention import KeepBest
    from ckpt.snapshot.run import SnapshotError
    from ckpt.snapshot.state import PerRank, RNGState, Stateful

__all__ = ["CheckpointManager", "KeepBest", "PerRank", "RNGState", "SaveStats", "SnapshotError", "Stateful"]
__getattr__ = lazy_exports(__name__, {"CheckpointManager": "ckpt.snapshot.manager", "SaveStats": "ckpt.snapshot.manager",
                                      "KeepBest": "ckpt.snapshot.retention", "SnapshotError": "ckpt.snapshot.run",
                                      "PerRank": "ckpt.snapshot.state", "RNGState": "ckpt.snapshot.state",
                                      "Stateful": "ckpt.snapshot.state"}, globals())
