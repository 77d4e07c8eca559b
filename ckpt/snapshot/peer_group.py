"""The ranks of a group and their local tiers: where each rank's replicas are (:func:`replica_ranks`),
the group's collectives (:class:`PeerGroup`: gather; :meth:`PeerGroup.exchange` sends chunks of
each rank's tier to others in rounds through two reused buffers per peer), and what a rank receives,
verified and staged until the whole transfer has arrived (:class:`Staging`). What the tiers do with
it, saving and restoring, is :class:`~ckpt.snapshot.peers.Peers`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ckpt.snapshot.tiers import MISSES, caught, describe
from ckpt_store.storage.errors import CorruptObjectError, ObjectNotFoundError, StorageIOError

if TYPE_CHECKING:
    from ckpt.snapshot.local_tier import LocalTier
    from ckpt.store.store import Store

log = logging.getLogger(__name__)


def replica_ranks(rank: int, world: int, k: int, *, stride: int = 1, nodes: Sequence[Any] | None = None) -> list[int]:
    """The ``k`` ranks that keep copies of ``rank``'s chunks.

    With ``nodes`` (the node of each rank), the next ranks round the ring that sit on
    other nodes than ``rank`` (and than each other, while there are enough nodes), so a
    lost machine never takes a rank and its replicas; else ``rank + stride``,
    ``rank + 2 * stride``, ... (modulo ``world``).

    >>> replica_ranks(0, 8, 2, stride=4)
    [4, 1]
    >>> replica_ranks(1, 4, 1, nodes=["a", "a", "b", "b"])
    [2]
    """
    if k <= 0 or world <= 1:
        return []
    out: list[int] = []
    if nodes is not None:
        used = {nodes[rank]}
        ring = [(rank + i) % world for i in range(1, world)]
        for r in ring:  # other nodes, one replica per node first
            if len(out) < k and nodes[r] not in used:
                out.append(r)
                used.add(nodes[r])
        for r in ring:
            if len(out) < k and r not in out and nodes[r] != nodes[rank]:
                out.append(r)
        return out
    r = rank
    for _ in range(world):
        r = (r + stride) % world
        if r == rank or r in out:
            r = (r + 1) % world
        if r != rank and r not in out:
            out.append(r)
        if len(out) == min(k, world - 1):
            break
    return out


class PeerGroup:
    """The ranks of one group and their local tiers, and the collectives between them."""

    def __init__(self, local: LocalTier, group: Any, replicas: int, *, stride: int = 1, nodes: Sequence[Any] | None = None) -> None:
        import torch.distributed as dist

        self.local = local
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group)  # group rank -> global rank (p2p takes global ranks)
        self.replicas = {r: replica_ranks(r, self.world, replicas, stride=stride, nodes=nodes) for r in range(self.world)}
        self.tier_full = False  # this rank's tier ran out of space in the current save (publish, replicate)

    # -- collectives --------------------------------------------------------------------
    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def exchange(self, sends: dict[int, list[str]], sink: Callable[[dict[str, memoryview]], None],
                 round_bytes: int = 0) -> int:
        """Send the chunks ``sends[dst]`` of this rank's tier to group rank ``dst``, and hand what the
        others send this rank to ``sink``; returns the stored bytes sent.

        Transfers go in rounds of up to ``round_bytes`` (default :data:`ROUND_BYTES`; the same on
        every rank) per pair of ranks, through two reused send and two reused receive buffers per
        peer: each blob is read from the tier file straight into a send buffer while the other is
        on the wire, and each round received is handed to ``sink`` as views into its buffer, valid
        only during the call. So a transfer of any size holds a few rounds in memory. ``sink``
        must not raise (the peers go on sending): it records what it could not keep."""
        import torch.distributed as dist

        objects = self.local.store.objects
        sized: dict[int, list[tuple[str, int]]] = {}
        for dst, cids in sends.items():
            for cid in cids:
                try:
                    sized.setdefault(dst, []).append((cid, objects.backend.size(objects.path("chunks", cid))))
                except OSError:
                    continue  # it went meanwhile: that rank reads it from another tier
        plan = self.gather(sized)
        limit = round_bytes or ROUND_BYTES
        outgoing = {dst: _rounds(items, limit) for dst, items in sorted(sized.items())}
        incoming = {src: _rounds(wanted[self.rank], limit) for src, wanted in enumerate(plan)
                    if src != self.rank and wanted.get(self.rank)}
        # Two slots per peer and direction: round i uses slot i % 2.
        send_slots = {dst: _slots(rounds) for dst, rounds in outgoing.items()}
        recv_slots = {src: _slots(rounds) for src, rounds in incoming.items()}
        sending: dict[int, Any] = {}
        receiving: dict[int, Any] = {}
        last = max([len(r) for r in outgoing.values()] + [len(r) for r in incoming.values()], default=0)
        for i in range(last + 1):
            # Post round i (its receives first: a peer's send completes only once it is received),
            # then finish round i - 1. Every rank posts round i before it waits on round i - 1,
            # so no two ranks wait on each other; slot i % 2 was freed by round i - 2.
            posted_recv, posted_send = {}, {}
            for src, rounds in incoming.items():
                if i < len(rounds):
                    buf = recv_slots[src][i % 2][: _size(rounds[i])]
                    posted_recv[src] = dist.irecv(buf, self.ranks[src], group=self.group)
            for dst, rounds in outgoing.items():
                if i < len(rounds):
                    buf = send_slots[dst][i % 2]
                    out, pos = memoryview(buf.numpy()), 0
                    for cid, n in rounds[i]:
                        self._read_into(cid, out[pos : pos + n])
                        pos += n
                    posted_send[dst] = dist.isend(buf[:pos], self.ranks[dst], group=self.group)
            for op in sending.values():
                op.wait()
            for src, op in receiving.items():
                op.wait()
                rounds = incoming[src]
                sink(_views(recv_slots[src][(i - 1) % 2][: _size(rounds[i - 1])], rounds[i - 1]))
            sending, receiving = posted_send, posted_recv
        return sum(n for items in sized.values() for _, n in items)

    def _read_into(self, cid: str, out: memoryview) -> None:
        """Blob ``cid`` of this tier into ``out`` (its size, as listed). A blob that went or changed
        meanwhile is sent as zeros: the receiver verifies every chunk and drops it."""
        objects = self.local.store.objects
        try:
            if objects.backend.read_into(objects.path("chunks", cid), 0, out) == len(out):
                return
        except (OSError, StorageIOError):  # gone, or not a file (a folder or FIFO there): zeros, dropped there
            pass
        out[:] = bytes(len(out))


class Staging:
    """Chunks a rank receives from peers (replicas; a restore's refill): each verified as it arrives and written beside
    its final name (``Backend.stage``), all named by :meth:`commit` once the whole transfer has
    arrived, or none (:meth:`drop`). So a transfer of any size holds a few rounds in memory, and one
    cut short (a peer killed) leaves nothing in the tier. A delta whose base is not in the tier yet
    (it may come in the same transfer) is held in memory and checked again at the commit, once the
    others are in place: a delta is checked, and named, only with its bases in the tier, for a load
    decodes a delta with bases from the tier that holds it. A damaged chunk is dropped (the tier then
    lacks it)."""

    def __init__(self, store: Store) -> None:
        from ckpt.store.copy import chunk_checker

        self.objects = store.objects
        self.check = chunk_checker(store, store)
        self.ready: list[Callable[[bool], None]] = []
        self.waiting: dict[str, bytes] = {}  # deltas whose base is not in the tier yet
        self.error: Exception | None = None  # the first failure to write (a full tier): raised by the commit
        self.rejected: set[str] = set()  # chunks dropped as damaged

    def add(self, blobs: dict[str, memoryview]) -> None:
        for cid, blob in blobs.items():
            if self.error is not None:
                return  # the rounds still arrive (the peers are sending them), unkept
            try:
                self.check(cid, blob)
            except MISSES as e:
                if lacks_base(cid, e):
                    self.waiting[cid] = bytes(blob)  # the round's buffer is reused
                    continue
                dropped(cid, describe(e))
                self.rejected.add(cid)
                continue
            except Exception as e:  # noqa: BLE001 - never raised into the exchange: the commit raises it
                self.error = e
                return
            try:
                self.ready.append(self.objects.backend.stage(self.objects.path("chunks", cid), blob))
            except Exception as e:  # noqa: BLE001 - a full tier, say
                self.error = e

    def commit(self, unsettled: str | None = None) -> None:
        """Name every verified chunk, then the waiting deltas whose base is now in place; raise the
        first write failure (what was named stays: each of those chunks is whole and verified).
        A waiting delta whose base is in no tier is dropped, or where the caller keeps it elsewhere
        (``unsettled``: where, for the log; a restore keeps it in memory), left to it."""
        try:
            for done in self.ready:
                done(True)
            self.ready = []
            while self.waiting:
                kept = {}
                for cid, blob in self.waiting.items():
                    try:
                        self.check(cid, blob)
                    except MISSES as e:
                        if lacks_base(cid, e):
                            continue
                        dropped(cid, describe(e))
                        self.rejected.add(cid)
                        kept[cid] = b""
                        continue
                    self.objects.put("chunks", cid, blob)
                    kept[cid] = blob
                if not kept:
                    break
                self.waiting = {c: b for c, b in self.waiting.items() if c not in kept}
            for cid in self.waiting:
                if unsettled is None:
                    dropped(cid, "its base is in no tier")
                else:
                    log.info("chunk %s from a peer not written to the tier: its base is in no tier (%s)", cid[:12], unsettled)
            self.waiting = {}
        finally:
            self.drop()
        self.objects.backend.flush()
        if self.error is not None:
            raise self.error

    def drop(self) -> None:
        """Remove what is staged and not yet named."""
        for done in self.ready:
            try:
                done(False)
            except Exception as e:  # noqa: BLE001 - a leftover temporary is removed by the tier's next gc
                log.debug("staged chunk not removed: %s", caught(log, "peer transfer", e))
        self.ready, self.waiting = [], {}


def lacks_base(cid: str, error: Exception) -> bool:
    """Whether checking chunk ``cid`` against the bases in a tier raised ``error`` for want of a
    usable base there (not there, or damaged there: the error names another blob), not because
    ``cid`` itself is bad: such a delta waits for its base (from a peer, or beside it in memory)
    instead of being dropped; only an error that names the delta itself drops it."""
    if isinstance(error, ObjectNotFoundError):
        return True
    return isinstance(error, CorruptObjectError) and error.object_id != cid


def dropped(cid: str, why: str) -> None:
    log.warning("chunk %s from a peer dropped: %s", cid[:12], why)


# Bytes per round of a peer transfer, per pair of ranks (a blob larger than this goes alone).
ROUND_BYTES = 32 << 20


def _rounds(items: list[tuple[str, int]], limit: int) -> list[list[tuple[str, int]]]:
    """``items`` (blob id, size) cut into consecutive rounds of at most ``limit`` bytes (or one blob)."""
    out: list[list[tuple[str, int]]] = []
    total = 0
    for item in items:
        if not out or total + item[1] > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += item[1]
    return out


def _size(round_: list[tuple[str, int]]) -> int:
    return sum(n for _, n in round_)


def _slots(rounds: list[list[tuple[str, int]]]) -> list[Any]:
    """The (at most two) buffers a peer's rounds go through: slot k holds rounds k, k + 2, ..."""
    return [_empty(max(_size(r) for r in rounds[k::2])) for k in range(min(2, len(rounds)))]


def _empty(n: int) -> Any:
    import torch

    return torch.empty(max(n, 1), dtype=torch.uint8)


def _views(buf: Any, round_: list[tuple[str, int]]) -> dict[str, memoryview]:
    """The blobs of one received round, as views into ``buf`` (which they keep alive)."""
    raw, pos, out = memoryview(buf.numpy()), 0, {}
    for cid, n in round_:
        out[cid] = raw[pos : pos + n]
        pos += n
    return out
