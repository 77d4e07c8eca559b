"""A restore's refill: what a rank's local tier keeps of a restore from peers, once it has returned.

Beside training (the manager's save thread), a rank's tier keeps what its restore read from
elsewhere (:func:`refill`), so that a replaced machine's tier names the step again and a later
failure finds a local copy: the chunks a peer transfer decoded straight into the tensors, copied
from there and hashed again (:func:`~ckpt.snapshot.peer_targets.keep_decoded`); those it left in
memory (the tier was full) verified and staged; any other chunk the rank read that its tier still
lacks (a delta's base, a chunk of a CUDA tensor, read from the durable store and decoded into no
target) copied from the nearest farther tier holding it, verified (:func:`keep_copies`); and every
copy the load found damaged in the tier written over by a verified one. Only then, if the tier
holds every chunk the rank read, the manifest and the step's ref. Nothing enters a tier's
``chunks/`` unverified: a later save reuses a chunk there on its presence alone.

One process with a local tier has no peers: after its restore, :func:`mend` alone replaces the damaged
copies its load found (the refill's last step).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ckpt.snapshot.peer_group import Staging
from ckpt.snapshot.peer_targets import keep_decoded
from ckpt.snapshot.tiers import MISSES, Tiers, caught, describe, expected
from ckpt_store.storage.chunk_lists import recorded_chains

if TYPE_CHECKING:
    from ckpt.snapshot.local_tier import LocalTier
    from ckpt.store.store import Store

log = logging.getLogger(__name__)


def refill(tier: LocalTier, step: int, mid: str, tiers: Tiers) -> tuple[bool, str | None]:
    """Keep in ``tier`` (this rank's) what a restore of ``step`` (manifest ``mid``) read from elsewhere
    and replace what it found damaged there (see the module's docstring). Not collective. Returns
    (whether the tier names the step; False where a target changed before the refill read it: the
    next save writes the state anew), and why the tier failed to keep them, or None. On every exit
    (a changed target, a full tier) each damaged copy is replaced, or removed with the steps naming it."""
    decoded, tiers.decoded = tiers.decoded, {}  # (its views keep the targets' memory alive until this returns)
    # (a damaged copy a peer's verified one was written over during the restore is whole again)
    damaged, tiers.damaged = tiers.damaged - tiers.from_peers, set()
    todo = set(damaged)  # those not written over yet
    try:
        kept, why = _keep(tier, step, mid, tiers, decoded, todo)
    except Exception as e:  # noqa: BLE001 - a full tier, say: the restore itself succeeded
        kept, why = False, caught(log, "refill", e)
    if todo:  # (a save must not reuse a damaged copy, and a step a tier names has each chunk whole)
        mended = mend(tier, tiers, mid, todo)
        return False, "; ".join(m for m in (mended, why) if m) or None
    return kept, why


def _keep(tier: LocalTier, step: int, mid: str, tiers: Tiers, decoded: dict[str, memoryview],
          damaged: set[str]) -> tuple[bool, str | None]:
    """:func:`refill`'s work; ``damaged`` (the tier's damaged copies) emptied once each is written over or removed."""
    peer = dict(tiers.stores)["peer"]
    local = tier.store
    fetched = {info.id for info in peer.objects.list("chunks")}
    if not fetched and not tiers.from_peers and not decoded and not damaged:
        return True, None
    if not keep_decoded(local, decoded):
        tier.prune()  # (what it wrote is named by no step: the tier's bounds count none of it)
        return False, None
    missing = fetched - local.objects.has_many("chunks", fetched)
    staging = Staging(local)
    for cid in sorted(missing):  # one at a time: no second copy of them all
        staging.add({cid: memoryview(peer.objects.get("chunks", cid))})
    staging.commit()
    lacking = tiers.needed - local.objects.has_many("chunks", tiers.needed)
    if lacking or damaged:
        forgot = mend(tier, tiers, mid, set(damaged), lacking)
        damaged.clear()  # (each written over, whole with its base written over, or removed)
        if forgot is not None:
            return False, forgot
        lacking = tiers.needed - local.objects.has_many("chunks", tiers.needed)
    if lacking:  # (each chunk in the tier is verified: written so, or checked as it arrived)
        tier.prune()
        return False, f"{len(lacking)} of the chunks this rank read not in its tier (first {min(lacking)[:12]})"
    if not local.objects.has("manifests", mid):
        local.objects.put_manifest(_manifest_bytes(tiers, mid))
        local.objects.backend.flush()
    local.refs_db.set(tier.ref(step), mid)
    if step >= max(tier.steps(), default=step):
        local.refs_db.set(f"{tier.run}/latest", mid, alias=True)
    local.objects.backend.flush()
    tier.prune()
    return True, None


def _copy_back(tier: LocalTier, tiers: Tiers, mid: str, ids: set[str], damaged: set[str]) -> set[str]:
    """:func:`keep_copies` of ``ids`` into ``tier`` from the farther tiers (``damaged``: written over);
    those none gave."""
    farther = [store for name, store in tiers.stores if name != "local"]
    try:
        named = recorded_chains(_manifest_bytes(tiers, mid))
    except MISSES:  # (a failed restore's manifest, unreadable: the chunks are copied whole, deltas too)
        named = {}
    return keep_copies(tier.store, farther, ids, replace=damaged, named=named)


def keep_copies(local: Store, sources: list[Store], ids: set[str], *, replace: set[str],
                named: Mapping[str, frozenset[str]]) -> set[str]:
    """Copy the chunks ``ids`` into ``local`` (a rank's tier) from the first of ``sources`` (farther
    tiers, nearest first) that holds each intact: as stored there, each decoded and re-hashed before
    it is written (:func:`~ckpt.store.copy.copy_chunks`, with ``named``: the snapshot's recorded
    chains). ``replace``: those ``local`` holds damaged, written over. Returns those of ``ids`` no
    source gave."""
    from ckpt.store.copy import copy_chunks

    todo = set(ids)
    for src in sources:
        held = src.objects.has_many("chunks", todo)
        if not held:
            continue
        try:
            copy_chunks(src, local, held, named=named, replace=held & replace)
        except MISSES as e:  # one of them damaged or gone there: each alone, the others kept
            log.info("refill: chunks not copied at once (%s); one at a time", describe(e))
            held = _one_by_one(src, local, held, replace, named)
        todo -= held
    return todo


def _one_by_one(src: Store, local: Store, ids: set[str], replace: set[str], named: Mapping[str, frozenset[str]]) -> set[str]:
    """:func:`keep_copies` from one source, chunk by chunk: those copied."""
    from ckpt.store.copy import copy_chunks

    done = set()
    for cid in sorted(ids):
        try:
            copy_chunks(src, local, {cid}, named=named, replace={cid} & replace)
            done.add(cid)
        except MISSES as e:
            log.info("refill: chunk %s not copied (%s)", cid[:12], describe(e))
    return done


def mend(tier: LocalTier, tiers: Tiers, mid: str, damaged: set[str], lacking: set[str] | frozenset[str] = frozenset()) -> str | None:
    """After a restore of ``mid`` read the tier's ``damaged`` copies elsewhere (:attr:`Tiers.damaged`): write verified
    copies over them from the farther tiers (and copy the ``lacking`` ones there too), check them again, and remove
    those still damaged with every step naming them (all, where the copy fails): a later save reuses a chunk the tier
    holds on its presence alone. What to tell the user (what was removed), or None. The refill's last step, and
    after a restore of one process with a local tier the whole of it (``CheckpointManager`` runs it in the save thread)."""
    try:
        damaged = _copy_back(tier, tiers, mid, lacking | damaged, damaged) & damaged
    except Exception as e:  # noqa: BLE001 - a full tier, say: none is known whole
        why = caught(log, "refill: chunks not copied back to the tier", e)
        if expected(e):  # (a bug was logged just now, with its traceback)
            log.warning("refill: chunks not copied back to the tier (%s)", why)
        if lacking:  # (what it lacked may be what filled it: the damaged alone again, which take no more room)
            return mend(tier, tiers, mid, damaged)
    damaged = _still_damaged(tier, damaged)
    return _forget(tier, damaged) if damaged else None


def names_a_chunk_lost(error: BaseException) -> bool:
    """Whether ``error`` names a chunk damaged or missing (what :func:`forget_unpersistable` deals with)."""
    from ckpt.errors import CorruptObjectError, ObjectNotFoundError

    return isinstance(error, (CorruptObjectError, ObjectNotFoundError)) and error.kind == "chunk"


def forget_unpersistable(tier: LocalTier, error: BaseException, chunks: Iterable[str]) -> str | None:
    """After a persist of the tier's ``chunks`` failed with ``error``: where it names a chunk of the tier damaged or
    gone, those of ``chunks`` (and it) that the tier holds damaged or lacks, checked again, go with every step naming
    them (:func:`_forget`), so that the next save writes them anew: it would reuse them on their presence, and the
    persist would fail at every save after, the durable store never seeing another snapshot. What to tell the user,
    or None (another failure, or the tier holds them all whole)."""
    if not names_a_chunk_lost(error):
        return None
    try:
        damaged = _still_damaged(tier, {error.object_id, *chunks})  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - the tier's medium failing: the next persist finds it again
        return f"damaged chunks not looked for ({caught(log, 'local tier', e)})"
    return _forget(tier, damaged) if damaged else None


def _still_damaged(tier: LocalTier, ids: set[str]) -> set[str]:
    """Those of ``ids`` that the tier still holds damaged (or not at all), checked again: the tier records a delta read
    over a damaged base as damaged with its base (the error names the base; whether the delta is whole is known once
    the base is), so a delta whole over its base written over is kept, not removed with every step naming it."""
    from ckpt.store.copy import chunk_checker

    check = chunk_checker(tier.store, tier.store)
    out = set()
    for cid in ids:
        try:
            check(cid, tier.store.objects.get("chunks", cid))
        except MISSES:
            out.add(cid)
    return out


def _forget(tier: LocalTier, damaged: set[str]) -> str:
    """Remove from ``tier`` the damaged copies no farther tier could replace, and every step that names one
    (:meth:`~ckpt.snapshot.local_tier.LocalTier.forget`); what to tell the user."""
    first = min(damaged)[:12]
    try:
        steps = tier.forget(damaged)
    except Exception as e:  # noqa: BLE001 - the tier's medium failing: a later load finds them damaged again
        return f"{len(damaged)} damaged chunk(s) could not be replaced nor removed (first {first}: {caught(log, 'refill', e)})"
    return f"{len(damaged)} damaged chunk(s) could not be replaced and were removed (first {first}), and the steps naming them: {steps}"


def _manifest_bytes(tiers: Tiers, mid: str) -> bytes:
    """The stored bytes of manifest ``mid`` from the nearest tier holding it intact."""
    last: Exception | None = None
    for _, store in tiers.stores:
        try:
            return store.objects.get_manifest(mid)
        except MISSES as e:
            last = e
    assert last is not None
    raise last
