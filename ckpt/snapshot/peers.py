"""Local tiers across a process group: replication to peer ranks and restores from them.

Each rank's local tier (:class:`~ckpt.snapshot.local_tier.LocalTier`) receives the chunks of
its own shards from the DCP save, the snapshot's manifest (broadcast by the
coordinator) and the chunks of the ranks it is a replica of. So a rank's tier alone
is not a complete snapshot: a step can be *assembled* when the ranks' tiers together
hold every chunk its manifest names, or when the durable store holds it.

Replication (:meth:`Peers.replicate`): each rank sends the chunks it wrote that its
``K`` replica ranks (:func:`replica_ranks`) lack, point to point over the group (gloo);
a chunk several ranks wrote (a replicated parameter) goes once, from the lowest of them.
Every transfer (:meth:`Peers.exchange`) goes in rounds through two reused buffers per peer.

Restore (:meth:`Peers.choose`): the ranks gather what their tiers hold and agree on the
newest step they can assemble (else the durable store's newest). Where every rank's tier
names that step, each rank's DCP load reads from its own tier alone, and only if some rank
lacked chunks there (or found them damaged) are those fetched from a peer holding them
(:meth:`Peers.fetch`), into its own tier, for a second load. Where some
rank's tier lacks the step (a replaced machine), a dry run of the load plan says which
chunks each rank reads, and those its tier lacks are fetched before the load: each is verified
as it arrives and decoded straight into the tensor it belongs to, which the load then skips
(:mod:`ckpt.snapshot.peer_targets`); the others (and the delta bases the manifest records for
them) are verified and written to the tier, where the load reads them: nothing enters a tier
unverified. Every chunk is verified before its bytes count: a bad copy falls through to the
durable store.
After the restore, beside training, a rank keeps what it read from elsewhere in its own tier, and
replaces what it found damaged there (:meth:`Peers.refill`, :mod:`ckpt.snapshot.peer_refill`; the
chunks decoded into the tensors are written from there, hashed again): a replaced machine's tier
names the step again, unless training changed a tensor before the refill read it (then a
TierWarning: the tier holds the state again from the next save).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt.dcp.checkpoint import Writer
from ckpt.progress import NullProgress
from ckpt.snapshot.peer_group import PeerGroup, Staging, dropped, lacks_base
from ckpt.snapshot.peer_refill import refill
from ckpt.snapshot.peer_targets import decode_into_targets, settle_deltas
from ckpt.snapshot.steps import latest_manifest, left_behind, left_behind_message, snapshot_step
from ckpt.snapshot.tiers import MISSES, Tiers, caught, out_of_space
from ckpt.transfer.pipeline import BATCH_BYTES, run_parallel
from ckpt_store.storage.chunk_lists import recorded_chains, referenced_chunks
from ckpt_store.storage.errors import ObjectNotFoundError, RefNotFoundError

if TYPE_CHECKING:
    from ckpt.format.manifest import Manifest
    from ckpt.store.store import Store

log = logging.getLogger(__name__)


class TierWriter(Writer):
    """A DCP ``Writer`` into one rank's local tier: each rank writes its shards' chunks to its own
    tier; the coordinator writes the manifest there without the check that every chunk it names
    is in that store (they are spread over the ranks) and sets no ref: the manager publishes it."""

    published: tuple[str, bytes] | None = None

    def _base_manifest(self, store: Store, base: str) -> Manifest | None:
        """A base this rank's tier lacks (a refill removed damaged copies with the steps naming them, the base too,
        on this rank alone: the coordinator's tier kept it) is no base here: this rank's chunks are written whole."""
        try:
            return store.manifest(base)
        except ObjectNotFoundError:
            return None

    def _publish(self, store: Store, manifest: Manifest) -> str:
        data = manifest.to_json()
        mid = store.objects.put_manifest(data)
        self.published = (mid, data)
        return mid


class Peers(PeerGroup):
    """The ranks of one group and their local tiers; every method is collective over ``group``."""

    # -- saving -------------------------------------------------------------------------
    def publish(self, published: tuple[str, bytes] | None) -> tuple[str, bytes, str | None]:
        """Give every rank's tier the manifest the coordinator wrote (``published`` there): (id, bytes,
        why this rank's tier could not keep it, or None). A failing tier never leaves the collectives."""
        import torch.distributed as dist

        self.tier_full = False
        box = [published]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        assert box[0] is not None, "the coordinator published no manifest"
        mid, data = box[0]
        try:
            self.local.store.objects.put_manifest(data)
        except Exception as e:  # noqa: BLE001 - a full tier, say: the step is not recorded here
            self.tier_full = out_of_space(e)
            return mid, data, f"manifest not kept ({caught(log, 'local tier', e)})"
        return mid, data, None

    def replicate(self, step: int, mid: str, data_ids: set[str], *, record: bool = True) -> tuple[set[str], int, str | None]:
        """Send this rank's chunks of the snapshot to its replicas where they lack them; keep what
        others send; then (``record``: this tier holds the manifest) name the step in this tier.
        Returns (the chunks of the snapshot this rank held before, stored bytes it sent, why this
        rank's tier failed to keep what it received or to record the step, or None). A tier that
        fails (full, say) does so on its own: the collectives go on, and chunks received are stored
        one by one, verified, only once all have arrived, so a partial transfer is never kept."""
        store = self.local.store
        own = store.objects.has_many("chunks", data_ids)
        held = self.gather(sorted(own))
        held_sets = [set(h) for h in held]
        sends: dict[int, list[str]] = {}
        for dst in range(self.world):
            senders = [r for r in range(self.world) if dst in self.replicas[r]]
            if self.rank not in senders:
                continue
            for cid in sorted(own - held_sets[dst]):
                # a chunk several senders hold goes once, from the lowest of them
                if min(r for r in senders if cid in held_sets[r]) == self.rank:
                    sends.setdefault(dst, []).append(cid)
        staging = Staging(store)
        try:
            sent = self.exchange(sends, staging.add)
        except BaseException:
            staging.drop()  # a transfer cut short: nothing of it is named
            raise
        problems = []
        try:
            staging.commit()
        except Exception as e:  # noqa: BLE001 - this tier lacks some of them; a restore reads them elsewhere
            self.tier_full = self.tier_full or out_of_space(e)
            problems.append(f"chunks from peers not kept ({caught(log, 'replication', e)})")
        if record:
            try:
                store.refs_db.set(self.local.ref(step), mid)
                store.refs_db.set(f"{self.local.run}/latest", mid, alias=True)
                store.objects.backend.flush()
            except Exception as e:  # noqa: BLE001
                self.tier_full = self.tier_full or out_of_space(e)
                problems.append(f"step not recorded ({caught(log, 'local tier', e)})")
        return own, sent, "; ".join(problems) or None

    def persist(self, step: int, mid: str, data: bytes, own: set[str], durable: Store, latest: str,
                ref: str) -> tuple[str | None, bool]:
        """Every rank copies the chunks it wrote that ``durable`` lacks; then the coordinator commits the
        manifest and refs there. None, or why it failed (the same on every rank); and whether this rank's
        tier lost damaged chunks meanwhile, with the steps naming them (this one too)."""
        from ckpt.snapshot.peer_refill import forget_unpersistable
        from ckpt.store.copy import copy_chunks
        from ckpt_store.storage.commit import commit

        forgot = False
        try:
            copy_chunks(self.local.store, durable, own, recode=not self.local.compress, named=recorded_chains(data))
            problem = None
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            problem = f"rank {self.rank}: {caught(log, 'persist', e)}"
            removed = forget_unpersistable(self.local, e, own)  # (else every persist after fails the same way)
            if removed is not None:
                forgot = True
                problem += f"; its local tier's {removed}"
        verdicts = self.gather(problem)
        failed = next((v for v in verdicts if v is not None), None)
        if failed is None and self.rank == 0:
            try:
                commit(durable.objects, durable.refs_db, data, ref)
                durable.refs_db.set(latest, mid, alias=True)
                durable.objects.backend.flush()
            except Exception as e:  # noqa: BLE001
                failed = f"rank 0: {caught(log, 'persist', e)}"
        return self.gather(failed)[0], forgot

    # -- restoring ------------------------------------------------------------------------
    def inventory(self) -> dict[int, tuple[str, list[str]]]:
        """What this rank's tier holds: step -> (manifest id, the chunks of it present)."""
        store = self.local.store
        out = {}
        for step in self.local.steps():
            try:
                mid = store.resolve(self.local.ref(step))
                data = store.objects.get_manifest(mid)
            except MISSES + (RefNotFoundError,):
                continue
            out[step] = (mid, sorted(store.objects.has_many("chunks", referenced_chunks(data))))
        return out

    def choose(self, durable: Store, latest: str, warn: Callable[[str], None]) -> tuple[int, str, Tiers] | None:
        """Agree on the snapshot to restore and gather, for this rank, the chunks its tier lacks from
        peers. Returns (step, manifest id, the tiers to read it from), or None if there is none.
        ``warn``: how :func:`~ckpt.snapshot.steps.resolve_latest` warns of a missing RUN/latest."""

        # Rank 0 alone reads the durable store, and every rank chooses from what it read: ranks that
        # each read it could see it differently (one read failing, or lagging) and choose apart.
        view: Any = None
        if self.rank == 0:
            try:
                from ckpt.snapshot.run import is_snapshot

                # (RUN/latest missing: the newest step, warned; its durable copy unreadable: rank 0's tier's, warned)
                dmid, dm = latest_manifest(durable, self.local.run, warn, {}, copy=self.local.store)
                view = (dmid, snapshot_step(dm), dm.created, None if is_snapshot(dm) else dm.source)
            except RefNotFoundError:
                view = (None, None, None, None)
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                view = caught(log, "restore", e)
        inventory, made = self.inventory(), {}
        for step, (mid, _) in inventory.items():
            try:
                made[step] = self.local.store.manifest(mid).created
            except MISSES:
                pass  # (gone meanwhile: a restore finds it missing)
        gathered = self.gather((inventory, made, view))
        view = gathered[0][2]
        if isinstance(view, str):
            from ckpt.snapshot.run import SnapshotError

            raise SnapshotError(f"restore not done: rank 0 could not read {latest} in {durable.url} ({view})",
                                hint="restore again once the durable store answers; see rank 0's log")
        dmid, dstep, dmade, pushed = view
        if pushed is not None:  # refused on every rank, as without tiers: never passed over for an older step
            from ckpt.snapshot.run import not_a_snapshot

            raise not_a_snapshot(dmid, pushed)
        inventories = [inv for inv, _, _ in gathered]
        if dmid is not None and dstep is not None:  # steps of a timeline the run left are no candidates
            for r, (inv, made_r, _) in enumerate(gathered):
                for step, (mid, _) in list(inv.items()):
                    if step in made_r and left_behind(step, mid, lambda t=made_r[step]: t, (dstep, dmid, dmade)):
                        del inv[step]
                        if r == self.rank:
                            _left(self.local.path, step, dstep)
        steps: dict[int, str] = {}
        for inv in inventories:
            for step, (mid, _) in inv.items():
                steps.setdefault(step, mid)
        chosen: tuple[int, str] | None = None
        for step in sorted(steps, reverse=True):
            if dstep is not None and dstep >= step:
                break
            mid = steps[step]
            holders = [r for r, inv in enumerate(inventories) if step in inv and inv[step][0] == mid]
            have = set().union(*(inventories[r][step][1] for r in holders))
            need = self._needed_by_all(mid, holders)
            if need is not None and need <= have:
                chosen = (step, mid)
                break
        if chosen is None:
            if dmid is None or dstep is None:
                return None
            chosen = (dstep, dmid)
        step, mid = chosen
        tiers = self.tiers(durable)
        tiers.every_rank_holds = all(inv.get(step, ("",))[0] == mid for inv in inventories)  # the same on every rank
        self._share_manifest(mid, inventories, dict(tiers.stores)["peer"])
        return step, mid, tiers

    def tiers(self, durable: Store) -> Tiers:
        """This rank's tiers for one restore: its local tier (chunks fetched from peers are written
        there, and counted as the peers'), an empty in-memory one for those its tier cannot take
        (full, say), the durable store."""
        from ckpt.store.store import Store

        peer = Store.init(f"memory://ckpt-peer-{uuid.uuid4().hex}")
        return Tiers([("local", self.local.store), ("peer", peer), ("store", durable)])

    def _needed_by_all(self, mid: str, holders: list[int]) -> set[str] | None:
        """Every chunk manifest ``mid`` names (from the lowest holder, broadcast)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.rank == holders[0]:
            box[0] = sorted(referenced_chunks(self.local.store.objects.get_manifest(mid)))
        dist.broadcast_object_list(box, src=self.ranks[holders[0]], group=self.group)
        return set(box[0]) if box[0] is not None else None

    def _share_manifest(self, mid: str, inventories: list[dict[int, tuple[str, list[str]]]], peer: Store) -> None:
        """A rank whose tier lacks the manifest (a replaced machine) gets it from one that has it."""
        import torch.distributed as dist

        holders = [r for r, inv in enumerate(inventories) if any(m == mid for m, _ in inv.values())]
        if not holders or len(holders) == self.world:
            return
        box: list[Any] = [self.local.store.objects.get_manifest(mid) if self.rank == holders[0] else None]
        dist.broadcast_object_list(box, src=self.ranks[holders[0]], group=self.group)
        if self.rank not in holders:
            peer.objects.put_manifest(box[0])

    def refill(self, step: int, mid: str, tiers: Tiers) -> tuple[bool, str | None]:
        """Keep in this rank's tier what a restore of ``step`` read from elsewhere (from peers, the durable
        store) and replace what it found damaged there (:func:`~ckpt.snapshot.peer_refill.refill`), so that
        a replaced machine's tier names the step and a later failure finds a local copy. Runs after the
        restore returned, beside training. Not collective. Returns (whether the tier names the step), and
        why the tier failed to keep them, or None."""
        return refill(self.local, step, mid, tiers)

    def fetch(self, tiers: Tiers, needed: set[str], *, exclude_local: set[str],
              into: dict[str, list[memoryview]] | None = None) -> int:
        """Fill the ``peer`` tier with the chunks of ``needed`` this rank's tier lacks (or holds
        damaged: ``exclude_local``), from peers that hold them (nearest rank first). Collective:
        every rank calls it, with what it needs. Returns the bytes received.
        ``into``: where the load will decode each chunk (regions of the target tensors, from a dry
        run): a received chunk is decoded and verified there at once, and the load skips it
        (``Tiers.filled``) instead of reading it back from the tier."""
        local = self.local.store
        missing = sorted((needed - local.objects.has_many("chunks", needed)) | (needed & exclude_local))
        wants = self.gather(missing)
        mine = set(local.objects.has_many("chunks", set().union(*map(set, wants)))) if any(wants) else set()
        holds = self.gather(sorted(mine))
        hold_sets = [set(h) for h in holds]
        sends: dict[int, list[str]] = {}
        for dst, cids in enumerate(wants):
            for cid in cids:
                src = next((s for s in ((dst + i) % self.world for i in range(1, self.world)) if cid in hold_sets[s]), None)
                if src == self.rank:
                    sends.setdefault(dst, []).append(cid)
        # A chunk with a place in ``into`` is verified and decoded there at once, and not written to
        # the tier now: the load skips it (of a 1.2 GB state: 1.2 GB not read back and hashed again),
        # and the refill writes it from the targets once the restore has returned. Any other (a
        # delta; a chunk of a CUDA or resharded target) is verified before it is written to this
        # rank's tier, where the load reads it (and verifies it again: on CUDA every chunk is decoded
        # twice): nothing enters a tier's ``chunks/`` unverified, for a later save reuses a chunk
        # there on its presence alone. A bad one is dropped (the load reads it from the durable
        # store). A delta whose base is not here yet waits in memory (``waiting``: its base, as the
        # sink parsed it) and goes to the tier once the exchange is over (``settle_deltas``); what
        # the tier cannot take stays in memory for this restore (read from there verified, as any tier).
        from ckpt.codecs.chunk import parse_header
        from ckpt.store.copy import chunk_checker

        objects = local.objects
        peer = dict(tiers.stores)["peer"]
        check = chunk_checker(local, local)  # (a delta is kept in the tier only with its bases there: see settle_deltas)
        received = 0
        waiting: dict[str, str | None] = {}

        def one(item: tuple[str, memoryview]) -> None:
            cid, blob = item
            if into and cid in into and decode_into_targets(cid, blob, into[cid], tiers, local.settings.max_chunk_size):
                return
            try:
                check(cid, blob)
            except Exception as e:  # noqa: BLE001 - damaged (MISSES): the sink must not raise; a bug is logged with its traceback
                if lacks_base(cid, e):  # a delta whose base is not in the tier yet or damaged there (decoded only into a target, in memory)
                    peer.objects.put("chunks", cid, bytes(blob))  # the round's buffer is reused
                    waiting[cid] = parse_header(blob, cid).base
                else:
                    dropped(cid, caught(log, "peer restore", e))
                return
            try:
                objects.backend.write(objects.path("chunks", cid), blob)
                tiers.from_peers.add(cid)
            except Exception as e:  # noqa: BLE001 - a full tier: this restore keeps it in memory
                log.debug("chunk %s from a peer kept in memory: %s", cid[:12], caught(log, "peer restore", e))
                peer.objects.put("chunks", cid, bytes(blob))

        def keep(blobs: dict[str, memoryview]) -> None:
            # a round's chunks on the store's workers, as a load reads and hashes them
            nonlocal received
            run_parallel(one, list(blobs.items()), local.settings.workers, NullProgress(), lambda it: len(it[1]), batch=BATCH_BYTES)
            received += sum(len(b) for b in blobs.values())

        self.exchange(sends, keep)
        objects.backend.flush()
        if waiting:
            settle_deltas(local, peer, waiting, tiers)
        return received


def _left(path: str, step: int, dstep: int) -> None:
    """Warn that this rank's tier holds ``step`` of a timeline the run left (not restored)."""
    import warnings

    from ckpt.snapshot.run import TierWarning

    message = left_behind_message(f"local tier {path}", step, dstep)
    log.warning("%s", message)
    warnings.warn(message, TierWarning, stacklevel=2)

