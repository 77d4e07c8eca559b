"""Training-loop snapshots: :class:`CheckpointManager` (asynchronous, incremental saves and
in-place restores), the state it understands (:class:`RNGState`, :class:`Stateful`), the
overlapped copy and the distributed path through torch.distributed.checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt._lazy import lazy_exports

if TYPE_CHECKING:
    from ckpt.snapshot.manager import CheckpointManager, SnapshotError
    from ckpt.snapshot.state import RNGState, Stateful

__all__ = ["CheckpointManager", "RNGState", "SnapshotError", "Stateful"]
__getattr__ = lazy_exports(__name__, {"CheckpointManager": "ckpt.snapshot.manager", "SnapshotError": "ckpt.snapshot.manager",
                                      "RNGState": "ckpt.snapshot.state", "Stateful": "ckpt.snapshot.state"}, globals())
