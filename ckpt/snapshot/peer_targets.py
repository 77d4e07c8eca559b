"""A peer restore's chunks decoded straight into the tensors they belong to.

Where a rank's tier lacks the snapshot (a replaced machine), a dry run of the DCP load
(:class:`NeedsRecorder`) says which chunks the rank reads and where each is decoded: for a
whole-shard copy, a region of a target tensor. :meth:`~ckpt.snapshot.peers.Peers.fetch` then
verifies each chunk as it arrives from a peer and decodes it there
(:func:`decode_into_targets`), and the load skips those regions (``Tiers.filled``) instead of
reading the chunks back from the tier they were also written to (which a next restart reads).
Only chunks the load copies whole into a CPU tensor's memory are decoded there: a delta, a chunk
of a CUDA tensor (staged) or of a resharded one (read into a buffer the dry run's plan does not
keep) is still read back from the tier by the load.
"""

from __future__ import annotations

from typing import Any

from ckpt.snapshot.tiers import Tiers, address


class NeedsRecorder(Tiers):
    """Tiers that record which chunks a load asks for instead of reading them (a dry run of a DCP load)."""

    def __init__(self, tiers: Tiers, targets: list[tuple[int, int]]) -> None:
        """``targets``: the memory of the tensors the load fills (:func:`target_ranges`)."""
        super().__init__(tiers.stores, manifests=tiers.manifests)
        self.asked: set[str] = set()
        # chunk id -> the regions of the targets the load decodes it into (not a temporary buffer
        # of the dry run's: that memory is gone, or another's, by the time the chunk arrives)
        self.into: dict[str, list[memoryview]] = {}
        self.targets = targets

    def get(self, tasks: list[Any], progress: Any) -> None:
        import bisect

        self.asked.update(t.id for t in tasks)
        for t in tasks:
            if t.into is None or not t.length:
                continue
            at = address(t.into)
            i = bisect.bisect_right(self.targets, (at, float("inf"))) - 1
            if i >= 0 and self.targets[i][0] <= at and at + t.length <= self.targets[i][1]:
                self.into.setdefault(t.id, []).append(t.into)


def decode_into_targets(cid: str, blob: memoryview, views: list[memoryview], tiers: Tiers, max_length: int) -> None:
    """Decode chunk ``cid`` from a peer into the target regions ``views``, verified against its id,
    and note them filled. A delta (its base may not be here yet) or a bad blob is left to the load,
    which reads it from the nearest tier holding it intact."""
    from ckpt.codecs.chunk import decode_chunk, parse_header

    try:
        if parse_header(blob, cid).base is not None:
            return
        first = views[0]
        decode_chunk(blob, cid, len(first), max_length=max_length, out=first)
    except Exception:  # noqa: BLE001 - a bad blob (MISSES) or anything else: this runs in the exchange's sink,
        return  # which must not raise (the other ranks would wait out their timeout); the load reads it and says
        # what is wrong. (The target may hold garbage: not marked filled, the load overwrites it.)
    for v in views[1:]:
        v[:] = first
    tiers.filled.update((cid, address(v), len(v)) for v in views)


def target_ranges(flat: dict[str, Any]) -> list[tuple[int, int]]:
    """The memory (start, end) of the CPU tensors a DCP load fills in place (a DTensor's local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    out = []
    for v in flat.values():
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor) and v.device.type == "cpu":
            st = v.untyped_storage()
            if st.nbytes():
                out.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
    return sorted(out)
