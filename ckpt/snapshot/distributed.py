"""``CheckpointManager`` across ranks: every rank calls the same ``save``/``restore_latest``.

With a process group, a snapshot is a DCP save through :class:`ckpt.dcp.Writer`
(each rank writes its own shards; the coordinator commits ``RUN/step-N`` and
``RUN/latest`` once all have finished) and a restore is a DCP load, resharded to
the current layout. Checkpoint collectives run on a gloo group of their own, with
its own timeout: an asynchronous save never interleaves with the training's
collectives, and a rank that dies makes the others fail with
:class:`~ckpt.snapshot.manager.SnapshotError` after ``timeout_s`` instead of hanging.

Tensors that are not DTensors are taken to be identical on every rank (DCP saves
one copy): per-rank state such as RNG streams must be keyed per rank.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException

if TYPE_CHECKING:
    from ckpt.snapshot.manager import CheckpointManager

_FAILURES = (Exception, CheckpointException)  # DCP's CheckpointException derives from BaseException


class DistributedSnapshots:
    """The distributed half of a :class:`~ckpt.snapshot.manager.CheckpointManager` (which owns retention and the pool)."""

    def __init__(self, mgr: CheckpointManager, process_group: Any, timeout_s: float) -> None:
        import torch.distributed as dist

        self.mgr = mgr
        self.rank = dist.get_rank(process_group)
        self.timeout_s = timeout_s
        # Every member calls this in the same order (it is part of constructing the manager).
        self.group = dist.new_group(dist.get_process_group_ranks(process_group), backend="gloo",
                                    timeout=timedelta(seconds=timeout_s), use_local_synchronization=True)
        self.last_id: str | None = None

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float] | None) -> None:
        import torch.distributed.checkpoint as dcp

        from ckpt.dcp.checkpoint import Writer
        from ckpt.snapshot.manager import SNAPSHOT_FORMAT

        mgr = self.mgr
        snapshot = {"format": SNAPSHOT_FORMAT, "run": mgr.run, "step": step, "metrics": dict(metrics or {}), "ranks": True}
        base = self.last_id if mgr.delta else None
        writer = Writer(mgr.store, mgr.ref(step), base=base, delta=base is not None, aliases=(f"{mgr.run}/latest",),
                        extra={"snapshot": snapshot})
        t0 = time.perf_counter()
        if mgr.async_save:
            fut = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            blocked = time.perf_counter() - t0
            mgr._inflight = mgr._pool.submit(self._finish, fut, step, writer, blocked, t0)
        else:
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            except _FAILURES as e:  # any failure of any rank: one clear error
                raise self._error(step, e) from e
            self._done(step, writer, snapshot["metrics"], time.perf_counter() - t0, t0)

    def _finish(self, fut: Future[Any], step: int, writer: Any, blocked: float, t0: float) -> None:
        try:
            fut.result()
        except _FAILURES as e:
            raise self._error(step, e) from e
        self._done(step, writer, writer.extra["snapshot"]["metrics"], blocked, t0)

    def _error(self, step: int, e: BaseException) -> Exception:
        from ckpt.snapshot.manager import SnapshotError

        where = ""
        if isinstance(e, CheckpointException) and e.failures:  # DCP gathered the ranks' own errors
            rank, (e, _) = next(iter(sorted(e.failures.items())))
            where = f"on rank {rank}, "
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return SnapshotError(
            f"rank {self.rank}: distributed save of {self.mgr.ref(step)} failed ({where}{type(e).__name__}: {first}); "
            f"{self.mgr.run}/latest still names the previous snapshot",
            hint=f"another rank failed, died or took longer than timeout_s={self.timeout_s:g}; see its log",
        )

    def _done(self, step: int, writer: Any, metrics: dict[str, float], blocked: float, t0: float) -> None:
        mgr = self.mgr
        self.last_id = mgr.store.resolve(mgr.ref(step)) if writer.last is None else writer.last.id
        mgr._metrics[step] = metrics
        mgr.last_save_stats = {"step": step, "blocked_s": blocked, "background_s": time.perf_counter() - t0 - blocked}
        if writer.last is not None:  # the coordinator alone prunes, so that ranks never race to remove a ref
            mgr.last_save_stats.update(written_bytes=writer.last.written_bytes, logical_bytes=writer.last.logical_bytes)
            mgr._retain()

    def restore(self, state: dict[str, Any], mid: str) -> int:
        import torch.distributed.checkpoint as dcp

        from ckpt.dcp.checkpoint import Reader
        from ckpt.snapshot.manager import SNAPSHOT_FORMAT, SnapshotError

        snap = self.mgr.store.get_manifest(mid).extra.get("snapshot")
        if not isinstance(snap, dict) or snap.get("format") != SNAPSHOT_FORMAT or not snap.get("ranks"):
            raise SnapshotError(f"checkpoint {mid[:12]} is not a distributed snapshot of this ckpt version",
                                hint="restore it with a CheckpointManager made without a process group")
        dcp.load(state, storage_reader=Reader(self.mgr.store, mid), process_group=self.group)
        self.last_id = mid
        return int(snap["step"])
