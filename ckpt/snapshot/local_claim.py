"""Whose a local tier is (``docs/format.md``, "The local tier"): ``ckpt-local-tier.json`` at its root names the
durable store's id and the run; :func:`claim` checks it when a manager takes the tier, and :func:`apart` keeps a
tier out of the durable store."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import warnings
from typing import TYPE_CHECKING

from ckpt.errors import CkptError
from ckpt.snapshot.local_lock import TIER_MARKER
from ckpt.snapshot.steps import step_of

if TYPE_CHECKING:
    from ckpt.store.store import Store

log = logging.getLogger(__name__)



def apart(path: str, durable: Store) -> None:
    """Refuse ``path`` as a tier where it is the durable store, or in or around it (checked
    before the tier's folder is made)."""
    from ckpt.snapshot.run import SnapshotError
    from ckpt.store.destination import inside, store_root

    real = os.path.realpath(path)
    droot = store_root(durable)
    if droot is not None:
        if inside(real, droot) or inside(droot, real):
            raise SnapshotError(f"local={path} is the durable store {droot}, or lies in or around it",
                                hint="give the local tier a path of its own (it prunes and collects what it holds)")


def claim(path: str, run: str, durable: Store, reset_foreign: bool) -> bytes | None:
    """Check that ``path`` may be the local tier of ``run`` of ``durable`` (whose snapshots the tier
    prunes and collects without grace); returns the marker to write once the tier's store exists
    (None: it is there already).

    Refused (beside what :func:`apart` refuses): a ckpt store that is not a local tier (its
    history would be collected), and the tier of another store or run (it would be resumed from).
    With ``reset_foreign`` (the default path, keyed by the store's id, its URL and the run: another
    store's tier is there only by a collision of the key) it is emptied instead, with a warning; but not
    where the marker is damaged: that folder is almost surely this run's own tier (refused, with the path).
    Only the marker's two fields are compared (a later ckpt's marker may hold more).
    A store with no marker is taken where it holds nothing, and at the default path where its every ref is
    a snapshot of ``run`` (a tier kept before tiers had markers); elsewhere such a store may as well be
    another store of the run (an earlier experiment's durable store, say): refused, it would be resumed
    and pruned."""
    from ckpt.snapshot.run import SnapshotError
    from ckpt_store.storage.config import CONFIG_PATH

    want = {"run": run, "store_id": durable.config.store_id}
    marker = json.dumps(want, sort_keys=True).encode()
    have = read_marker(path)
    if marks(have, durable.config.store_id, run):
        return None
    if have is None and not os.path.lexists(os.path.join(path, CONFIG_PATH)):
        return marker  # a new tier
    if have is None:
        held = _unmarked(path, run)
        if held == "nothing" or held == "snapshots" and reset_foreign:
            return marker
        if held == "snapshots":
            raise SnapshotError(f"local={path} is a ckpt store with no {TIER_MARKER}, of snapshots of run {run!r}: "
                                "another store of this run (an earlier experiment's, say), which the tier would resume "
                                "and prune", hint="give the local tier a path of its own (if that folder is this run's "
                                                  "tier kept by a ckpt before tiers were marked, remove it)")
        raise SnapshotError(f"local={path} is a ckpt store that is not a local tier; a tier prunes and collects "
                            "what it holds", hint="give the local tier a path of its own")
    whose = _whose(have, want, durable)
    if not reset_foreign or not readable(have):
        raise SnapshotError(f"local={path} is {whose}",
                            hint="give this run's local tier a folder of its own (local=ANOTHER_PATH); or, where that "
                                 "tier's snapshots are not needed (those it persisted are in its durable store), remove "
                                 f"it first: rm -r {shlex.quote(path)}")
    message = f"local tier {path} was {whose}: emptied for run {run!r} of {durable.url}"
    log.warning("%s", message)
    from ckpt.snapshot.run import TierWarning

    warnings.warn(message, TierWarning, stacklevel=4)
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
    return marker


def read_marker(path: str | os.PathLike[str]) -> object:
    """The marker of the tier at ``path`` as read: None where there is none, ``{}`` where it is damaged."""
    try:
        with open(os.path.join(path, TIER_MARKER), "rb") as f:
            have = json.loads(f.read(4096))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):  # (``[[[[...``: json's parser recurses per level)
        return {}  # damaged: someone's, not known to be this run's
    return {} if have is None else have  # (a marker reading ``null`` is there: damaged, not missing)


def marks(have: object, store_id: str, run: str) -> bool:
    """Whether marker ``have`` names the tier of ``run`` of the store ``store_id`` (its two fields only: a
    marker with more is still this run's)."""
    return readable(have) and have["store_id"] == store_id and have["run"] == run  # type: ignore[index]


def readable(have: object) -> bool:
    """Whether a marker ``have`` (read from the tier) names a run and a store id."""
    return isinstance(have, dict) and isinstance(have.get("run"), str) and isinstance(have.get("store_id"), str)


def _whose(have: object, want: dict[str, str], durable: Store) -> str:
    """Whose tier a marker ``have`` (read from the tier) names, against ``want`` (this manager's)."""
    if not readable(have):
        return f"a local tier whose {TIER_MARKER} is damaged (whose tier it is cannot be told)"
    theirs = f"the local tier of run {have['run']!r:.100}"
    if have["store_id"] == want["store_id"]:
        return f"{theirs} of this store, not of run {want['run']!r}"
    return f"{theirs} of another store (id {have['store_id']:.12}), not of {durable.url} (id {want['store_id']:.12})"


def _unmarked(path: str, run: str) -> str:
    """What the store at ``path``, which has no marker, holds: "nothing" (no ref, no object: one made by a
    manager killed before it wrote the marker), "snapshots" (refs, if any, that are all snapshots of ``run``:
    a tier kept before tiers had markers, or another store of this run, a durable one say, which only the
    default path's folder tells apart), else "other"."""
    from ckpt.store.store import Store

    try:
        store = Store.open(path)
        refs = store.refs()
        if not refs and all(next(store.objects.list(kind), None) is None for kind in ("manifests", "chunks")):
            return "nothing"
    except CkptError:
        return "other"
    return "snapshots" if all(r == f"{run}/latest" or step_of(run, r) is not None for r in refs) else "other"


__all__ = ["TIER_MARKER", "apart", "claim", "marks", "read_marker", "readable"]
