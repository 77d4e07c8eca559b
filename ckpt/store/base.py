"""Choosing the checkpoint a push is delta-encoded against, from manifests alone.

In order: the base the caller names; else the ref's previous version (a new
snapshot of a run, a new version of a fine-tune); else the stored checkpoint
whose tensors (name, dtype, size) overlap the new one's the most by bytes,
preferring on ties one that is not itself a delta, then the oldest.
No tensor data is read to decide.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckpt.errors import CkptError, StoreFormatError
from ckpt.format.entries import TensorEntry
from ckpt.format.manifest import Manifest
from ckpt.store.catalog import well_formed

if TYPE_CHECKING:
    from ckpt.store.store import Store

# Candidates considered by overlap: the most recently updated refs.
MAX_CANDIDATES = 200


def _key(name: str, dtype: str, nbytes: int) -> tuple[str, str, int]:
    return (name, dtype, nbytes)


def overlap(tensors: Iterable[tuple[str, str, int]], m: Manifest) -> int:
    """Bytes of ``tensors`` that have a same-named tensor of the same dtype and size in ``m``."""
    theirs = {_key(t.name, t.dtype, t.nbytes) for t in m.tensors}
    return sum(k[2] for k in tensors if k in theirs)


def choose_base(store: Store, name: str | None, tensors: list[tuple[str, str, int]], explicit: str | None) -> tuple[str | None, str | None]:
    """(base manifest id or None, parent manifest id or None) for a push of ``tensors`` to ``name``."""
    parent = None
    if name is not None:
        current = store.refs_db.current(name)
        parent = current.target if current else None
    if explicit is not None:
        return store.resolve(explicit), parent
    if not tensors:
        return None, parent
    if parent is not None and overlap(tensors, store.manifest(parent)) > 0:
        return parent, parent
    # Ties (a family of fine-tunes shares every tensor name) go to a checkpoint that is
    # not itself a delta - the base the others derive from - and then to the oldest:
    # a delta against a sibling fine-tune carries both fine-tunes' changes.
    ranked = []
    # Overlap per signature object: from the index, a family of fine-tunes shares one.
    # The value keeps the object alive, so that its id cannot be reused by another.
    overlaps: dict[int, tuple[object, int]] = {}
    for target, sig, base, created in _candidates(store):
        if id(sig) in overlaps:
            got = overlaps[id(sig)][1]
        else:
            theirs = {_key(n, d, b) for n, d, b in sig}
            got = sum(k[2] for k in tensors if k in theirs)
            overlaps[id(sig)] = (sig, got)
        if got > 0:
            ranked.append(((got, base is None, -created), target))
    ranked.sort(key=lambda r: r[0], reverse=True)  # stable: among equal keys the first found wins, as before
    for _, target in ranked:
        # A stale index may name a checkpoint gc has removed since: take the next.
        if store.index is None or store.objects.has("manifests", target):
            return target, parent
    return None, parent


def _candidates(store: Store) -> Iterable[tuple[str, list[tuple[str, str, int]], str | None, float]]:
    """(manifest id, tensor signature, lineage base, created) of the targets of the most
    recently updated live refs, newest first: from the metadata index when the store keeps
    one (a stale index only makes a worse choice, never a wrong checkpoint: the base is
    read and verified, and commit checks every chunk), else from the manifests."""
    index = store.index
    st = None
    if index is not None:
        try:
            st = index.view(exact=False)
        except StoreFormatError:  # a damaged ref entry, met rebuilding the index: read the refs below
            pass
    if st is None:
        # A damaged ref or checkpoint is no candidate: it must not fail every push to the store.
        live = sorted(store.refs_db.scan()[0].values(), key=lambda e: e.time, reverse=True)[:MAX_CANDIDATES]
        for target in dict.fromkeys(e.target for e in live if e.target is not None):
            try:
                m = store.manifest(target)
            except CkptError:
                continue
            yield target, [(t.name, t.dtype, t.nbytes) for t in m.tensors], m.lineage.get("base"), m.created
        return
    live = sorted(st.live().values(), key=lambda e: e.time, reverse=True)[:MAX_CANDIDATES]
    targets = list(dict.fromkeys(e.target for e in live if e.target is not None))
    gone = index.ensure(st, well_formed(st, targets), strict=False)  # a stale index may name what gc removed since
    index.heal(st)
    for target in targets:
        if target not in gone:
            info = st.info[target]
            yield target, st.signature(target) or [], info["base"], info["created"]


def pair_tensors(base: Manifest | None) -> dict[tuple[str, str, int], TensorEntry]:
    """Base tensors by (name, dtype, nbytes): chunk i of a new tensor pairs with chunk i of its match."""
    if base is None or base.chunk_size <= 0:
        return {}
    return {_key(t.name, t.dtype, t.nbytes): t for t in base.tensors}
