"""A training run's documents in the web view: its snapshots by step (the run page and ``/api/run/NAME``) and
the runs of a store (the overview), built on :class:`~ckpt_store.cli.web.data.StoreView`'s caches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ckpt
from ckpt.errors import CkptError, ObjectNotFoundError, RefNotFoundError
from ckpt.format.manifest import Manifest
from ckpt.snapshot.run import is_snapshot, not_a_snapshot
from ckpt.snapshot.steps import left_behind, resolve_latest, run_steps, snapshot_step, step_of, step_ref
from ckpt.store import catalog
from ckpt.store.catalog import own_chunks
from ckpt_store.cli.web.data import HISTORY_PAGE, StoreView, page, snapshot_metrics, stored_bytes


def run_doc(view: StoreView, name: str, offset: int = 0, limit: int = HISTORY_PAGE) -> dict[str, Any]:
    """A training run: every snapshot ref ``NAME/step-N`` ever written, live or removed
    (by retention or ``ckpt rm``), with its metrics, what it added to the store, and the
    tiers holding it: this store ("durable") and, when the view has one, the run's local
    tier ("local", an ordinary store at another path: see the snapshot manager's tiers).
    ``snapshots`` holds rows ``offset .. offset+limit`` by step (``page``: the paging record,
    ``kept``: how many of all are live, ``metrics``: the names in those rows): a run saved
    thousands of times has as many snapshots, and a row's metrics and sizes are read from its
    manifest (a request on S3), so only those of the page's rows (and the one before) are read.
    A shown row's tiers are those whose copy of its manifest was read for this request and found whole
    (the store's first, a GET on S3; the local tier's, a file): a step whose durable copy is missing or
    damaged is drawn as held by the local tier alone (or damaged), the damage named."""
    tiers = [("durable", view.store)] + ([("local", view.local)] if view.local is not None else [])
    found: dict[int, dict[str, Any]] = {}
    sizes: dict[str, int] = {}
    latest = f"{name}/latest"
    named: tuple[list[Any] | None, str | None] = (None, None)
    for tier, store in reversed(tiers):  # the durable store's sizes win where both hold a chunk
        sizes.update(store.chunk_sizes() if store is not view.store else view.chunk_sizes())
        # one damaged step must not hide the run; its steps only (RUN/latest has an entry per save)
        # (and what RUN/latest names now, its newest entry alone: where a restore begins, _resume_choice)
        histories, damaged = store.readable_ref_history(name, only=lambda ref: step_of(name, ref) is not None or ref == latest,
                                                        newest=lambda ref: ref == latest)
        if store is view.store:
            named = (histories.get(latest), damaged.get(latest))
        steps = {ref: (step, entries) for ref, entries in histories.items()
                 if (step := step_of(name, ref)) is not None and (entries or ref in damaged)}
        pushed = _pushed(view, store, [e[0].target for _, e in steps.values() if e and e[0].target is not None])
        for ref, (step, entries) in steps.items():
            live = bool(entries) and entries[0].target is not None
            gone_at = entries[0].time if entries else None
            if live and entries[0].target in pushed:  # a user's checkpoint under the name: none of the run's steps
                entries = [e for e in entries if e.target not in pushed]
                if not any(e.target is not None for e in entries):
                    continue
                live = False  # a snapshot of the step it named before is shown removed, when it was pushed over
            target = next((e.target for e in entries if e.target is not None), None)
            row = found.setdefault(step, {"step": step, "ref": ref, "id": target, "live": False, "removed_at": None,
                                          "saved_at": None, "metrics": {}, "logical_bytes": None, "new_bytes": None,
                                          "latest": False, "tiers": [], "tier": "", "available": False, "damaged": None})
            if not entries:  # its newest entry cannot be read: whether it is kept is unknown
                row["damaged"] = row["damaged"] or f"{tier}: {damaged[ref]}"
                continue
            if live:
                row["live"] = True
                row["tiers"] = sorted({*row["tiers"], tier})  # "durable" sorts before "local"
                row["id"] = target
                row["_durable_ref"] = row.get("_durable_ref", False) or store is view.store  # (its manifest whole or not)
            elif not row["live"]:
                row["removed_at"] = gone_at
            if target is not None:  # where its manifest can be read: the durable store's first (_snapshot_chunks)
                row.setdefault("_sources", []).append((tier, target, store))
    if not found:
        raise RefNotFoundError(f"no training run named {name!r}", hint="runs are the refs RUN/step-N of a CheckpointManager")
    rows = [found[s] for s in sorted(found)]
    shown, pg = page(rows, offset, limit)
    start = pg["offset"]
    # What the page's first snapshot is new against: the readable one before it, looked for among as many
    # rows as a page holds (a run whose old snapshots were collected would have each one asked for, in vain);
    # not found there, it is unknown (None), unless that search went back to the run's first snapshot.
    previous: set[str] | None = set() if start <= pg["limit"] else None
    for r in reversed(rows[max(0, start - pg["limit"]):start]):
        chunks = _snapshot_chunks(view, r)
        if chunks is not None:
            previous = chunks
            break
    # The page's rows read io_workers at a time: each reads the store's copy of its manifest (a GET on S3; 100 one
    # after another made a warm page 0.5 s slower on a loopback S3 server), a window so that few rows' chunk sets
    # are held at once (a page may hold MAX_PAGE rows)
    width = view.store.settings.io_workers
    with ThreadPoolExecutor(width) as pool:
        for at in range(0, len(shown), width):
            window = shown[at:at + width]
            for r, chunks in zip(window, pool.map(lambda r: _snapshot_chunks(view, r), window)):
                if chunks is not None:
                    r["new_bytes"] = None if previous is None else stored_bytes(chunks - previous, sizes)
                    previous = chunks
    # "latest" is the snapshot restore_latest would restore (the newest step was marked, damaged or not: a user
    # resuming from it got an error, or a step other than the one drawn)
    chosen, why = _resume_choice(view, name, named, found, sizes)
    latest_row = found.get(chosen[0]) if chosen is not None else None
    if latest_row is not None and latest_row["id"] == chosen[1]:  # (a snapshot whose step a user pushed over: removed)
        latest_row["latest"] = True
    else:
        latest_row = None
    for r in rows:
        r.pop("_sources", None)
        r["removed_at"] = None if r["live"] else r["removed_at"]
        # (a live step no tier's copy of which was found whole is "damaged": its tiers are what was read, on a page)
        r["tier"] = " + ".join(r["tiers"]) if r["live"] and r["tiers"] else "damaged" if r["damaged"] else "removed"
        # a page of the store that shows it: a step the local tier alone holds has none (its page there is a 404)
        # A step the durable store names links to its page there, damaged or not (that page names the damage); "local
        # only" is a step whose ref only the local tier holds
        durable_ref, read_there = r.pop("_durable_ref", False), r.pop("_durable", False)
        r["url"] = (f"/checkpoint/{r['ref']}" if r["live"] and durable_ref else
                    f"/checkpoint/{r['id']}" if not r["live"] and read_there else None)
        r["local_only"] = r["live"] and not durable_ref and "local" in r["tiers"]
    keys = sorted({k for r in shown for k in r["metrics"]})
    return {"run": name, "latest": chosen[1] if chosen is not None else None, "latest_step": chosen[0] if chosen else None,
            "latest_url": _latest_url(view, chosen, latest_row),
            "latest_error": why, "metrics": keys, "snapshots": shown, "page": pg, "kept": sum(r["live"] for r in rows)}


def _latest_url(view: StoreView, chosen: tuple[int, str] | None, row: dict[str, Any] | None) -> str | None:
    """A page of the store showing the chosen latest snapshot: its row's where that has one, else its id's where the store
    holds its manifest (a row on another page, or a step ref removed since RUN/latest named it); None where only the
    local tier holds it."""
    if chosen is None:
        return None
    if row is not None and row["url"] is not None:
        return str(row["url"])
    return f"/checkpoint/{chosen[1]}" if view.store.objects.has_many("manifests", [chosen[1]]) else None


def _resume_choice(view: StoreView, name: str, named: tuple[list[Any] | None, str | None], found: dict[int, dict[str, Any]],
                   sizes: dict[str, int]) -> tuple[tuple[int, str] | None, str | None]:
    """(step, manifest id) of the snapshot the run's ``CheckpointManager.restore_latest`` would restore, None where
    it would fail or the run has none; and why it would fail. Its choice (ckpt/snapshot/restoring.py): the durable
    ``RUN/latest`` (``named``: its newest entry, from the metadata index, or the error of it; missing, the run's newest
    snapshot, as :func:`~ckpt.snapshot.steps.resolve_latest` takes it; unreadable, or no snapshot: the restore fails) and,
    with a local tier, the tier's steps not of a timeline the run left, newest first, one that no tier holds whole
    passed over for the next; the last one's failure is the restore's. Whole here: its manifest read from a tier (the
    local tier's first, as a restore reads) and checked against its id, every chunk it needs listed by a tier (or found
    since the cached listing); a chunk's bytes are not read (a snapshot's whole size: ``ckpt verify`` reads them).
    A candidate found not whole has its live row drawn damaged (no tier can restore it)."""
    candidates: dict[int, str] = {}
    durable: tuple[int, str, float] | None = None
    durable_read: Manifest | None = None  # (its manifest, read and checked: not read again for its chunks)
    entries, bad = named
    if bad is not None:  # (the manager's resolve of it raises)
        return None, f"{name}/latest: {bad}"
    mid = m = None
    try:
        mid = entries[0].target if entries and entries[0].target is not None else resolve_latest(view.store, name, lambda _: None)
        m = view.manifest(mid, check=True)
    except RefNotFoundError:
        pass
    except CkptError as e:
        if e.retryable:
            raise
        # the manager then reads the local tier's copy of that id, where RUN/latest names it (steps.latest_manifest)
        if view.local is not None and mid is not None and entries and entries[0].target == mid:
            try:
                m = view.manifest(mid, view.local, check=True)
            except CkptError as e2:
                if e2.retryable:
                    raise
        if m is None:  # (the manager's restore fails with the store's error: its row names that copy's damage)
            step = next((s for s, r in found.items() if mid is not None and r["id"] == mid), None)
            if step is None:
                return None, f"{name}/latest: {e}"
            found[step]["damaged"] = found[step]["damaged"] or f"durable: {e}"
            return None, f"step {step} ({name}/latest): {e}"
    if m is not None and mid is not None:
        if not is_snapshot(m):
            return None, f"{name}/latest: {not_a_snapshot(mid, m.source)}"
        step = snapshot_step(m)
        if step is not None:
            candidates[step] = mid
            durable, durable_read = (step, mid, m.created), m
    local = view.local
    if local is not None:
        for step, mid in run_steps(local, name)[0].items():
            try:
                if left_behind(step, mid, lambda mid=mid: view.manifest(mid, local).created, durable):
                    continue
            except CkptError as e:  # (unreadable: the manager passes it over too)
                if e.retryable:
                    raise
                continue
            candidates[step] = mid  # (the tier's own where both hold the step, as the manager's)
    why = None
    for step, mid in sorted(candidates.items(), reverse=True):
        damage = _not_whole(view, mid, sizes, durable_read if durable is not None and mid == durable[1] else None)
        if damage is None:
            return (step, mid), None
        why = f"step {step}: {damage}"
        row = found.get(step)
        if row is not None and row["live"]:
            row.update(tiers=[], damaged=row["damaged"] or damage)
    return None, why


def _not_whole(view: StoreView, mid: str, sizes: dict[str, int], read: Manifest | None = None) -> str | None:
    """Why snapshot ``mid`` cannot be restored from the view's tiers (:func:`_resume_choice`), None where it can;
    ``read``: its manifest, already read from a tier and checked against its id for this request (not read again)."""
    tiers = ([("local", view.local)] if view.local is not None else []) + [("durable", view.store)]
    errors = []
    m = read
    for tier, store in tiers if m is None else []:
        try:
            m = view.manifest(mid, store, check=True)
            break
        except CkptError as e:
            if e.retryable:
                raise
            errors.append(f"{tier}: {e}")
    if m is None:
        return "; ".join(errors)
    try:
        # what a restore reads: tensors' and files' chunks and their delta bases, not bundles (copies, an accelerator)
        needed = set(m.chunk_lengths()) - {c for b in m.bundles for c in b.chunks}
    except CkptError as e:
        return str(e)
    missing = sorted(c for c in needed if c not in sizes)
    for _, store in tiers:  # written since the listing was cached, or missing: ask for those alone, once per tier
        if missing:
            held = store.stored_sizes(missing)
            missing = [c for c in missing if c not in held]
    if missing:
        return (f"chunk {missing[0]} is missing from {'every tier' if len(tiers) > 1 else 'the store'} "
                f"({len(missing)} of its {len(needed)} chunks; run `ckpt verify`)")
    return None


def _pushed(view: StoreView, store: ckpt.Store, mids: list[str]) -> set[str]:
    """Those of ``mids`` (live in ``store``) that are no snapshots (:func:`~ckpt.snapshot.run.is_snapshot`):
    a user's checkpoint pushed under a run's name. From their overviews (:meth:`StoreView.overviews`: the
    metadata index where many are not cached, the manifests of a few, as the steps saved since the last page;
    a load of the index reads every checkpoint's chunk lists, 0.04-0.3 s where that manifest takes 0.006 s),
    cached by id for the next page; one that cannot be read is not known to be pushed (its row names the damage)."""
    known = view.overviews(mids, store)
    return {mid for mid in mids if mid in known and not known[mid].snapshot}


def _snapshot_chunks(view: StoreView, row: dict[str, Any]) -> set[str] | None:
    """Fill a :meth:`run` row from its manifest (metrics, time saved, sizes), read and checked against its id;
    its own chunks, None where it cannot be read: removed and collected (the history line is all there is), or
    damaged, which the row names (``damaged``; a kept step's manifest missing is damage too). Each tier
    holding the step has its copy read (the durable store's first, which fills the row): one that does not
    read is dropped from the row's ``tiers`` (the local tier's copy answered first, and a step whose durable
    copy was gone was drawn as held by both: a user freeing a node took it for safe)."""
    why = None
    unheld = None  # the damage of a copy no tier holds the step by (a removed step's): named where no copy read
    chunks = None
    # the copies of the tiers holding the step first (the durable store's first of those): a copy the store no longer
    # holds the step by (removed by retention, not yet collected) that is damaged does not make a kept step damaged
    for tier, target, store in sorted(row.get("_sources", ()), key=lambda s: (not (row["live"] and s[0] in row["tiers"]),
                                                                              s[2] is not view.store)):
        held = row["live"] and tier in row["tiers"]
        if chunks is not None and not held:
            continue  # (read, where the row is filled from, only to tell that this tier's copy is whole)
        try:
            mf = view.manifest(target, store, check=held)  # (a tier holds it: its copy read now, not the cache's)
        except CkptError as e:
            if e.retryable:  # the store not answering now is no damage: the page answers so (503), as a checkpoint's
                raise
            if held:  # a kept step's manifest missing or damaged in a tier that holds it: that copy is not safe
                row["tiers"] = [t for t in row["tiers"] if t != tier]
                why = why or f"{tier}: {e}"
            elif not isinstance(e, ObjectNotFoundError):  # (a removed step's, collected: no damage)
                unheld = unheld or f"{tier}: {e}"
            continue
        if chunks is None:
            row.update(saved_at=mf.created, metrics=snapshot_metrics(mf.extra), logical_bytes=mf.logical_bytes,
                       available=True, _durable=store is view.store)
            chunks = own_chunks(mf)
    row["damaged"] = row["damaged"] or why or (unheld if chunks is None else None)
    return chunks


def run_names(view: StoreView) -> list[str]:
    """Names of the training runs among the live refs (RUN/step-N of snapshot manifests), told by the
    checkpoints' overviews (:meth:`StoreView.overviews`: the metadata index, not a manifest each), one
    ref of each run first (a run's newest step), the others of the runs that one did not tell. A snapshot the
    view found damaged (:mod:`~ckpt_store.cli.web.data`'s rule) tells no run; the other runs are listed."""
    candidates: dict[str, list[tuple[int, str]]] = {}
    for name, entry in view.refs().items():
        if m := step_ref(name):
            candidates.setdefault(m[0], []).append((m[1], entry.target))
    found: set[str] = set()
    index = catalog.IndexOnce()  # one load of the index for both rounds, where either asks it
    for round_ in (lambda c: [max(c)], lambda c: sorted(c)[:-1]):
        asked = {run: [mid for _, mid in round_(c)] for run, c in candidates.items() if run not in found}
        known = view.overviews((mid for mids in asked.values() for mid in mids), index=index)
        found |= {run for run, mids in asked.items() if any(mid in known and known[mid].snapshot for mid in mids)}
    return sorted(found)
