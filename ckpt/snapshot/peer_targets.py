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
keep) is still read back from the tier by the load: written there unchecked as it arrives, the
load checks it (:func:`check_unchecked` checks, after the restore, those it did not read). A delta
whose base was decoded only into a target gets that base beside it (:func:`keep_bases`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ckpt.snapshot.peer_group import dropped
from ckpt.snapshot.tiers import MISSES, Tiers, address, describe
from ckpt_store.storage.errors import ObjectNotFoundError

if TYPE_CHECKING:
    from ckpt.store.store import Store


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


def decode_into_targets(cid: str, blob: memoryview, views: list[memoryview], tiers: Tiers, max_length: int) -> bool | None:
    """Decode chunk ``cid`` from a peer into the target regions ``views``, verified against its id,
    and note them filled (and the chunk ``decoded``, for the refill): True. A bad blob is left to the
    caller (False); so is a delta (its base may not be here yet), not decoded (None)."""
    from ckpt.codecs.chunk import decode_chunk, parse_header

    try:
        if parse_header(blob, cid).base is not None:
            return None
        first = views[0]
        decode_chunk(blob, cid, len(first), max_length=max_length, out=first)
    except Exception:  # noqa: BLE001 - a bad blob (MISSES) or anything else: this runs in the exchange's sink,
        return False  # which must not raise (the other ranks would wait out their timeout); the load reads it and
        # says what is wrong. (The target may hold garbage: not marked filled, the load overwrites it.)
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


def keep_bases(store: Store, ids: Iterable[str], decoded: dict[str, memoryview]) -> None:
    """Give ``store`` the bases of its delta chunks ``ids`` that a peer transfer decoded only into the
    targets (``decoded``, :attr:`Tiers.decoded`): copied from there and hashed again (:func:`keep_decoded`).
    A load decodes a delta with bases from the store that holds it: a frozen tensor's chunk (decoded into
    its target) that is also the base of another tensor's delta (the same bytes at the step before,
    ``delta_vs_previous``) would otherwise be found nowhere, and the step not restored."""
    from ckpt.codecs.chunk import MAX_HEADER, parse_header

    objects, want = store.objects, {}
    for cid in ids:
        try:
            base = parse_header(objects.backend.read_range(objects.path("chunks", cid), 0, MAX_HEADER), cid).base
        except MISSES:
            continue  # (missing or damaged: the load finds it so)
        if base in decoded:
            want[base] = decoded[base]
    if want:
        keep_decoded(store, want)  # (False, a target changed: not during a restore; the load then says what is missing)


KEEP_BATCH = 64  # chunks per put_chunks call of keep_decoded: a changed target stops the refill within one batch


def check_unchecked(local: Store, peer: Store, ids: set[str]) -> None:
    """Check the chunks a peer transfer wrote to ``local`` unchecked that the load did not serve from
    there (:attr:`Tiers.unchecked`): a damaged one is deleted (the load read that chunk elsewhere)."""
    from ckpt.store.copy import chunk_checker

    check = chunk_checker(peer, local)
    for cid in sorted(ids):
        try:
            check(cid, local.objects.get("chunks", cid))
        except ObjectNotFoundError:
            continue  # (gone, or its base is: the tier's gc takes what no step names)
        except MISSES as e:
            dropped(cid, describe(e))
            local.objects.delete("chunks", cid)


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
