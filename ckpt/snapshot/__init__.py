"""Training-loop snapshots: :class:`CheckpointManager` (asynchronous, incremental saves and
in-place restores), the state it understands (:class:`RNGState`, :class:`Stateful`), the
overlapped copy and the distributed path through torch.distributed.checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt._lazy import lazy_exports

if TYPE_CHECKING:
    from ckpt.snapshot.local_tier import LocalTierUsage
    from ckpt.snapshot.manager import CheckpointManager, PersistStats, SaveStats
    from ckpt.snapshot.retention import KeepBest
    from ckpt.snapshot.run import ResumeWarning, SnapshotError, TierWarning
    from ckpt.snapshot.state import PerRank, RNGState, Stateful

__all__ = ["CheckpointManager", "KeepBest", "LocalTierUsage", "PerRank", "PersistStats", "RNGState", "ResumeWarning", "SaveStats", "SnapshotError",
           "Stateful", "TierWarning"]
__getattr__ = lazy_exports(__name__, {"CheckpointManager": "ckpt.snapshot.manager", "SaveStats": "ckpt.snapshot.manager",
                                      "KeepBest": "ckpt.snapshot.retention", "SnapshotError": "ckpt.snapshot.run", "ResumeWarning": "ckpt.snapshot.run",
                                      "TierWarning": "ckpt.snapshot.run", "PersistStats": "ckpt.snapshot.manager",
                                      "LocalTierUsage": "ckpt.snapshot.local_tier",
                                      "PerRank": "ckpt.snapshot.state", "RNGState": "ckpt.snapshot.state",
                                      "Stateful": "ckpt.snapshot.state"}, globals())
