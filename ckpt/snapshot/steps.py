"""A run's snapshots in a store, by step: the refs ``RUN/step-N`` and ``RUN/latest`` a manager
names (``SnapshotRun.ref``), which of them are snapshots, when each was made, the newest, and
whether a tier's snapshot is of a timeline the run has left."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ckpt.errors import CkptError
from ckpt_store.storage.errors import StoreFormatError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ckpt.format.manifest import Manifest
    from ckpt.store.store import Store
    from ckpt_store.storage.index import IndexState
    from ckpt_store.storage.refs import RefEntry


def step_of(run: str, ref: str) -> int | None:
    """N for the ref ``RUN/step-N`` of ``run``, else None: N spelled as the manager names its step
    (``SnapshotRun.ref``), so ``RUN/step-007`` is none (the ref of step 7 is ``RUN/step-7``)."""
    prefix = f"{run}/step-"
    tail = ref[len(prefix):] if ref.startswith(prefix) else ""
    return int(tail) if tail.isascii() and tail.isdigit() and str(int(tail)) == tail else None


def step_ref(ref: str) -> tuple[str, int] | None:
    """(RUN, N) of a ref ``RUN/step-N`` named as the manager names its steps (:func:`step_of`), else None: for
    a reader that knows no run (the web view), the run is what comes before the last ``/step-``."""
    run, sep, _ = ref.rpartition("/step-")
    step = step_of(run, ref) if sep and run else None
    return None if step is None else (run, step)


def _viewed_refs_of(store: Store, run: str) -> tuple[dict[str, RefEntry], IndexState | None]:
    """The live refs of ``store`` and their entries, by name (from its index), or, where some ref there
    cannot be read, the live refs under ``run`` alone: a damaged ref of another run, or anyone's, must not
    stop this run's saves and retention (a damaged ref of the run is left out: kept, not pruned); and the
    view of the store's index that told them (None: none)."""
    from ckpt.store.catalog import viewed_live_refs

    try:
        return viewed_live_refs(store)
    except StoreFormatError:
        return store.refs_db.scan(run)[0], None


def run_steps(store: Store, run: str) -> tuple[dict[int, str], IndexState | None]:
    """The live refs ``RUN/step-N`` of ``run`` in ``store``, snapshots or not (step -> checkpoint id), and the view
    of the store's index that told them, for :func:`snapshot_test` (``view``): which of them are snapshots,
    without listing the refs and loading the index again."""
    found: dict[int, str] = {}
    refs, view = _viewed_refs_of(store, run)
    for name, entry in refs.items():
        step = step_of(run, name)
        if step is not None and entry.target is not None:
            found[step] = entry.target
    return found, view


def snapshot_test(store: Store, mids: Iterable[str], read: Callable[[str], Manifest] | None = None,
                  view: IndexState | None = None) -> Callable[[str], bool]:
    """Whether each of ``mids`` is a snapshot (not a checkpoint a user pushed under the run's name): told
    by its summary in the store's metadata index, else by its manifest (``read``: the caller's cached
    reader, else the store's), read when first asked about; one that cannot be read counts (restoring it
    names the damage). ``view``: the view of the index the caller listed the refs from (:func:`run_steps`)."""
    made = snapshot_times(store, mids, read, view)
    return lambda mid: made(mid) is not None


def snapshot_times(store: Store, mids: Iterable[str], read: Callable[[str], Manifest] | None = None,
                   view: IndexState | None = None) -> Callable[[str], float | None]:
    """As :func:`snapshot_test`, but when each snapshot was made (``Manifest.created``; infinity where its
    manifest cannot be read: the newest, so that a restore of it names the damage), None for no snapshot."""
    from ckpt.snapshot.run import is_snapshot
    from ckpt.store.catalog import snapshot_kinds

    kinds = snapshot_kinds(store, mids, view)
    manifest = read if read is not None else store.manifest

    def made(mid: str) -> float | None:
        if mid not in kinds:
            try:
                m = manifest(mid)
                kinds[mid] = (is_snapshot(m), m.created)
            except CkptError:
                kinds[mid] = (True, math.inf)
        snapshot, created = kinds[mid]
        return created if snapshot else None

    return made


def resolve_latest(store: Store, run: str, warn: Callable[[str], None], parsed: dict[str, Manifest] | None = None) -> str:
    """The checkpoint id ``RUN/latest`` names in ``store``; where it names none (a user's ``ckpt rm RUN/latest``,
    a crash between a save's first ``RUN/step-N`` and its ``RUN/latest``), the run's newest snapshot, with a
    :class:`TierWarning` through ``warn`` (a manager's, which says each thing once): a run must never
    start again from scratch while a snapshot of it exists. Raises RefNotFoundError where the run has neither.

    The newest is the ``RUN/step-N`` that is a snapshot (:func:`snapshot_test`) made last (``Manifest.created``;
    the higher step where two were made at the same time), which RUN/latest named when its save moved it
    (docs/format.md, "Snapshots"): after a run went back to an earlier snapshot and saved on, the steps of
    the timeline it left may be higher, but they are older. ``parsed``: where the manifests read to choose
    (without a metadata index, each step's) are put, by id, so that the caller reads the chosen one once.
    Its answer may be there already; :func:`latest_manifest` reads it from there or the store."""
    from ckpt.errors import RefNotFoundError

    try:
        return store.resolve(f"{run}/latest")
    except RefNotFoundError as e:
        return _newest_snapshot(store, run, warn, parsed, e)


def _newest_snapshot(store: Store, run: str, warn: Callable[[str], None], parsed: dict[str, Manifest] | None,
                     missing: CkptError) -> str:
    """:func:`resolve_latest` where ``RUN/latest`` names nothing (``missing``, raised where the run has no step either)."""
    from ckpt.errors import RefNotFoundError

    latest = f"{run}/latest"
    found, view = run_steps(store, run)
    if not found:
        raise missing

    def read(mid: str) -> Manifest:
        m = store.manifest(mid)
        if parsed is not None:
            parsed[mid] = m
        return m

    made = snapshot_times(store, found.values(), read, view)
    times = {step: t for step, mid in found.items() if (t := made(mid)) is not None}
    if not times:
        raise RefNotFoundError(f"no snapshot of run {run!r} in {store.url}: {latest} is missing and no {run}/step-N is a snapshot")
    step = max(times, key=lambda s: (times[s], s))
    message = (f"{latest} is missing in {store.url}: the run's newest snapshot is taken for it, step {step} "
               f"({run}/step-{step}); the next save names its own snapshot {latest}")
    warn(message)
    return found[step]


def latest_manifest(store: Store, run: str, warn: Callable[[str], None], parsed: dict[str, Manifest], *,
                    copy: Store | None = None) -> tuple[str, Manifest]:
    """:func:`resolve_latest`, and the manifest it names, read once (kept in ``parsed`` too). ``copy``: a local tier
    whose copy of that manifest is read where the store's is damaged, gone or not answering, with a warning through
    ``warn``: a manifest is named by its hash, so the tier's copy, checked against it, is the same one (a node holding
    every byte of the run's newest snapshot resumes it). Only where ``RUN/latest`` itself names it: where that ref is
    missing, an unreadable manifest is taken for the newest step so that the restore names its damage, and the tier
    may hold a step the run has moved past."""
    from ckpt.errors import RefNotFoundError
    from ckpt.snapshot.tiers import MISSES, describe

    try:
        mid, named = store.resolve(f"{run}/latest"), True
    except RefNotFoundError as e:
        mid, named = _newest_snapshot(store, run, warn, parsed, e), False
    m = parsed.get(mid)
    if m is None:
        try:
            m = parsed[mid] = store.manifest(mid)
        except MISSES as e:
            if copy is None or not named:
                raise
            try:
                m = parsed[mid] = copy.manifest(mid)
            except MISSES:
                raise e from None
            warn(f"durable store: the manifest of {run}/latest ({mid[:12]}) is unreadable ({describe(e)}); the local "
                 "tier's copy of it is read")
    return mid, m



def snapshot_step(m: Manifest) -> int | None:
    """The step a snapshot's record holds: a non-negative int, else None (no snapshot, or a damaged
    record: a bool is no step, though Python counts True as the int 1). A checkpoint that a snapshot
    manager did not write (:func:`~ckpt.snapshot.run.is_snapshot`) has no step, whatever its ``extra``
    holds: a pushed ``.pt`` with an entry named ``snapshot`` is no snapshot."""
    from ckpt.snapshot.run import is_snapshot

    if not is_snapshot(m):
        return None
    snap = m.extra.get("snapshot")
    step = snap.get("step") if isinstance(snap, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def left_behind(step: int, mid: str, made: Callable[[], float], durable: tuple[int, str, float] | None) -> bool:
    """Whether a local tier's snapshot (``step``, manifest ``mid`` made at ``made()``) is of a timeline the
    run has left, ``durable`` being the durable RUN/latest's (step, id, time made): at or after its step,
    not it, and made before it (the run was taken back, or begun anew, where this tier was not). Along a
    timeline snapshots are made in step order, and persisting copies a manifest as it is, with its time.
    ``made`` is asked only when the rest leaves the answer open (it may read and parse a manifest)."""
    return durable is not None and step >= durable[0] and mid != durable[1] and made() < durable[2]


def left_behind_message(where: str, step: int, durable_step: int) -> str:
    """What a tier says of a snapshot :func:`left_behind` skips."""
    return (f"{where}: snapshot of step {step} predates the durable store's newest (step {durable_step}): "
            "it is of a timeline the run left, not restored")
