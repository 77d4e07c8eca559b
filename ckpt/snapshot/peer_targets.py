"""A peer restore's chunks decoded straight into the tensors they belong to.

Where a rank's tier lacks the snapshot (a replaced machine), a dry run of the DCP load
(:class:`NeedsRecorder`) says which chunks the rank reads and where each is decoded: for a
whole-shard copy, a region of a target tensor. :meth:`~ckpt.snapshot.peers.Peers.fetch` then
verifies each chunk as it arrives from a peer and decodes it there
(:func:`decode_into_targets`), and the load skips those regions (``Tiers.filled``) instead of
reading the chunks back. Those chunks are not written to the tier during the transfer (that took
two thirds of a replaced rank's transfer time): once the restore has returned, the refill writes
them from the targets, hashed again (:func:`keep_decoded`), so that a next restart finds them there.
Only chunks the load copies whole into a CPU tensor's memory are decoded there: a delta, a chunk
of a CUDA tensor (staged) or of a resharded one (read into a buffer the dry run's plan does not
keep) is still read back from the tier by the load: verified as it arrives, then written there
(nothing enters a tier unverified). A delta whose base was decoded only into a target, or arrived
after it, goes there once the exchange is over, that base beside it (:func:`settle_deltas`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ckpt.snapshot.peer_group import Staging
from ckpt.snapshot.tiers import Tiers, address, caught

if TYPE_CHECKING:
    from ckpt.store.store import Store

log = logging.getLogger(__name__)


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


def decode_into_targets(cid: str, blob: memoryview, views: list[memoryview], tiers: Tiers, max_length: int) -> bool:
    """Decode chunk ``cid`` from a peer into the target regions ``views``, verified against its id,
    and note them filled (and the chunk ``decoded``, for the refill); whether it did. A delta (its base
    may not be here yet) or a bad blob is left to the caller (False)."""
    from ckpt.codecs.chunk import decode_chunk, parse_header
    from ckpt_store.storage.backends.local_reads import populate

    try:
        if parse_header(blob, cid).base is not None:
            return False
        first = views[0]
        # The target (a restore's fresh optimizer moments, memory never touched) faulted in one call, as a local
        # read does, not page by page in the copy (rank 1 of a 1.2 GB peer restore: 1.84 -> 1.56 CPU-s). Only
        # here: in decode_chunk itself it ran on every decode (a pull's fresh buffers: +0.28 CPU-s per GB, one rep)
        populate(first)
        decode_chunk(blob, cid, len(first), max_length=max_length, out=first)
    except Exception as e:  # noqa: BLE001 - a bad blob (CorruptObjectError): this runs in the exchange's sink, which
        # must not raise (the other ranks would wait out their timeout); the load reads it and says what is wrong, and
        # a bug here is logged with its traceback. (The target may hold garbage: not marked filled, the load overwrites it.)
        log.debug("chunk %s from a peer not decoded into its tensor: %s", cid[:12], caught(log, "peer restore", e))
        return False
    for v in views[1:]:
        v[:] = first
    tiers.filled.update((cid, address(v), len(v)) for v in views)
    tiers.decoded[cid] = first
    return True


def keep_decoded(store: Store, decoded: dict[str, memoryview]) -> bool:
    """Write into ``store`` (a rank's local tier) the chunks a peer restore decoded into the targets
    (``Tiers.decoded``), read from there once the restore has returned: training may be changing them
    meanwhile, so each is copied, hashed again and stored under the id of the bytes copied
    (:func:`~ckpt.transfer.pipeline.put_chunks`), never under one they no longer match. Returns whether
    every chunk is now in ``store``: False once a target no longer holds the chunk restored there
    (the rest are then not written)."""
    from ckpt.transfer.pipeline import PutTask, put_chunks

    todo = sorted(set(decoded) - store.objects.has_many("chunks", set(decoded)))
    for i in range(0, len(todo), KEEP_BATCH):
        ids = todo[i : i + KEEP_BATCH]
        tasks = [PutTask(lambda _at, _n, v=decoded[cid]: bytes(v), 0, len(decoded[cid])) for cid in ids]  # (one copy: hashed and written)
        got = put_chunks(store.objects, tasks, store.settings)
        if [r.id for r in got] != ids:
            return False  # (a blob stored under another id is named by its own bytes: unreferenced, gc takes it)
    store.objects.backend.flush()
    return True


KEEP_BATCH = 64  # chunks per put_chunks call of keep_decoded: a changed target stops the refill within one batch


def settle_deltas(local: Store, peer: Store, waiting: dict[str, str | None], tiers: Tiers) -> None:
    """After a peer transfer, put into ``local`` (a rank's tier) the deltas it held in memory
    (``peer``) because their base was not in the tier as they arrived (``waiting``: each one's base,
    as the transfer parsed it): first those bases the transfer decoded only into the targets
    (``tiers.decoded``: a frozen tensor's chunk that another tensor's delta is stored against),
    copied from there and hashed again (:func:`keep_decoded`); then each delta, checked again against
    its bases now in the tier (:class:`~ckpt.snapshot.peer_group.Staging`). A load decodes a delta
    with bases from the tier that holds it: one whose base is not in the tier (in no tier, or kept in
    memory because the tier was full) stays in memory, beside it where it is there (the load reads it
    from the next tier); so does each, with its bases beside it, if the tier is full now."""
    want = {b: tiers.decoded[b] for b in waiting.values() if b is not None and b in tiers.decoded}
    try:
        if want and not keep_decoded(local, want):
            return  # (a target changed: not during a restore; the load then says what is missing)
        staging = Staging(local)
        staging.add({cid: memoryview(peer.objects.get("chunks", cid)) for cid in sorted(waiting)})
        staging.commit(unsettled="kept in memory for this restore")
        for cid in staging.rejected:  # (the delta itself damaged: dropped, as the log says; the load reads it from the next tier)
            peer.objects.delete("chunks", cid)
    except Exception as e:  # noqa: BLE001 - a full tier, say: the deltas stay in memory, their bases beside them
        log.info("local tier: deltas fetched from peers kept in memory (%s)", caught(log, "peer restore", e))
        try:
            keep_decoded(peer, want)
        except Exception as e2:  # noqa: BLE001 - never out of a collective fetch: the load reads them elsewhere
            log.info("delta bases not kept in memory either (%s)", caught(log, "peer restore", e2))
        return
    settled = local.objects.has_many("chunks", set(waiting))
    tiers.from_peers.update(settled)
    for cid in settled:
        peer.objects.delete("chunks", cid)


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
