"""Garbage collection as a plan, then an execution (a dry run prints the plan).

Live objects: every manifest a live ref points at (with ``keep_history``, also
every earlier target of a live ref) and every chunk such a manifest names.
:func:`gc_roots` is the one statement of that rule; ``verify`` checks exactly what
it names. Anything else is deleted only if it is older than the grace period: a push in
progress writes its chunks first and touches the chunks it reuses, so its
objects are young until its ref lands (docs/format.md, "Garbage collection").
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt_store.storage.backends.base import TEMPORARY, Backend, Upload
from ckpt_store.storage.chunk_lists import referenced_chunks
from ckpt_store.storage.config import CONFIG_PATH
from ckpt_store.storage.errors import (
    CkptError,
    InvalidNameError,
    LaterFormatError,
    ObjectNotFoundError,
    StorageIOError,
    StoreFormatError,
    UnusableManifestError,
)
from ckpt_store.storage.leases import Lock, check_fresh, leased
from ckpt_store.storage.objects import ObjectStore, Temporaries
from ckpt_store.storage.refs import RefEntry, Refs, history_floor


@dataclass(frozen=True)
class Root:
    """A manifest gc keeps alive: version ``version`` of ref ``ref`` (0: its current target)."""

    ref: str
    version: int
    target: str

    @property
    def label(self) -> str:
        """The name commands accept for it: ``ref`` or ``ref@N`` (see ``Store.resolve``)."""
        return self.ref if self.version == 0 else f"{self.ref}@{self.version}"


if TYPE_CHECKING:
    from ckpt_store.storage.index import StoreIndex
    from ckpt_store.storage.index_state import IndexState

log = logging.getLogger(__name__)

# How far the store's clock may read behind the time it stamps: S3 gives whole seconds.
CLOCK_RESOLUTION_S = 1.0
SKEW_WARNING_S = 2.0  # a clock ahead of the store's by more than this is reported


@dataclass
class Roots:
    roots: list[Root] = field(default_factory=list)
    # Refs with an entry that cannot be read: name -> (error, entry path). Their roots
    # are known only down to the damaged entry.
    damaged: dict[str, tuple[StoreFormatError, str]] = field(default_factory=dict)
    # Refs of ``damaged`` whose damaged entry is older than a removal read above it: the history gc
    # counts ends at the removal, so what the damaged entry named keeps nothing alive either way.
    settled: set[str] = field(default_factory=set)
    # The leftovers of interrupted writes below ``refs/`` the listing of refs passed (path, mtime, size),
    # where the refs were listed here (no ``histories`` given).
    temporaries: Temporaries = field(default_factory=list)

    @property
    def refs(self) -> list[str]:
        """The live refs the roots belong to, in order."""
        return list(dict.fromkeys(r.ref for r in self.roots if r.version == 0))


def gc_roots(refs: Refs, *, keep_history: bool = True, histories: dict[str, list[RefEntry]] | None = None) -> Roots:
    """What gc keeps alive: the current target of every live ref and, with ``keep_history``,
    its earlier targets back to its last removal (a name removed and pushed again does
    not revive what it held before). An alias (``RUN/latest``) keeps only its current
    target. Removed refs keep nothing. Versions are numbered as ``NAME@N`` counts them. The
    rule goes by entry: a ref whose newest entry is an alias but whose older ones are not (an
    alias copied over a ref of the same name) keeps those older targets.

    A history version whose manifest is no longer in the store was freed by an earlier
    ``gc --no-history`` and keeps nothing alive (:func:`read_root`).

    ``histories`` (each ref's entries newest first, e.g. from the metadata index, checked
    against the listing of refs) replaces reading every ref entry. Else the leftovers of interrupted
    writes below ``refs/`` come with the roots, from the same listing (:meth:`Refs.listing_and_temporaries`).
    """
    damaged: dict[str, Any] = {}
    temporaries: Temporaries = []
    if histories is None:
        listed, temporaries = refs.listing_and_temporaries()
        histories, damaged = refs.scan_histories(listing=listed)
    floors = {n: history_floor((e.seq, e.target) for e in entries) for n, entries in histories.items()}
    out = Roots(damaged=damaged, settled={n for n in damaged if floors.get(n, -1) >= 0}, temporaries=temporaries)
    for name, entries in histories.items():
        if not entries or entries[0].target is None:
            continue  # removed (or its newest entry is damaged): its history keeps nothing alive
        for version, e in enumerate(entries if keep_history else entries[:1]):
            if e.seq <= floors[name]:
                break  # a removal: what the ref held before it is history of a removed ref
            if version == 0 or not e.alias:
                out.roots.append(Root(name, version, e.target))
    return out


def read_root(objects: ObjectStore, target: str, *, current: bool) -> bytes | None:
    """The manifest ``target`` of a root, verified; None when it is a history version only
    (``current`` False) and is gone from the store (freed by ``gc --no-history``).

    A current target that is missing, or any target whose bytes are damaged, raises:
    gc cannot know what such a manifest keeps alive, so it must not delete anything.
    """
    try:
        return objects.get_manifest(target)
    except ObjectNotFoundError:
        if current:
            raise
        return None


def _read_root_chunks(objects: ObjectStore, mid: str, data: bytes | None, current: set[str], found: Roots,
                      roots: set[str], live_chunks: set[str]) -> None:
    """Add root manifest ``mid`` (its bytes ``data`` where already read) to ``roots`` and the chunks it names
    to ``live_chunks``: how every plan reads a root it does not take from the index. A live manifest that
    cannot be read, or names what no chunk id can be, stops the plan: nothing is deleted."""
    try:
        data = data if data is not None else read_root(objects, mid, current=mid in current)
    except CkptError as e:
        raise _stopped_by(e, found) from None
    if data is None:
        return
    roots.add(mid)
    try:
        live_chunks |= referenced_chunks(data, f"manifest {mid}")
    except LaterFormatError as e:  # (a later ckpt's: what it keeps alive is not guessed)
        e.object_id = mid
        raise _stopped_by(e, found) from None
    except StoreFormatError as e:  # (intact bytes that name no chunk: its writer's damage, named here)
        raise _stopped_by(UnusableManifestError(mid, e.message.removeprefix(f"manifest {mid}: ").removeprefix("manifest: ")),
                          found) from None


def _newest_readable(refs: Refs, name: str) -> bool:
    try:
        refs.current(name)
        return True
    except (StoreFormatError, InvalidNameError):  # a folder no command can name (refs/m@1/): damage, not a typo
        return False


def _stopped_by_entry(err: StoreFormatError, *, older: bool) -> StoreFormatError:
    """``err``, raised reading a ref entry, saying that gc deleted nothing and how to go on
    (``older``: the entry is not its ref's newest, which ``gc --no-history`` does not need)."""
    err.message = f"gc deleted nothing: what a damaged ref entry keeps alive is unknown: {err.message}"
    if err.hint is None:  # no command rewrites an entry: it goes back, or out of the way (with the older ones: a gap is damage)
        err.hint = (f"put the entry file back from a backup of the store, or move it{' and the entries older than it' if older else ''} "
                    "out of the store folder (gc then frees what only they named)")
    if older:
        err.hint += "; or `ckpt gc --no-history` runs without it, freeing the earlier versions (NAME@1...) of every ref"
    return err


def _stopped_by(err: CkptError, found: Roots) -> CkptError:
    """``err``, raised reading a root manifest, naming the versions that need it and how to go on."""
    roots = [r for r in found.roots if r.target == getattr(err, "object_id", None)]
    if not roots or err.retryable:
        return err
    err.message = (f"gc deleted nothing: the checkpoint of {', '.join(r.label for r in roots)} cannot be read, so what "
                   f"it keeps alive is unknown: {err.message}")
    # (a manifest whose bytes match its id but name what cannot be: another store's copy is the same bytes)
    ways = (["upgrade ckpt to read it (a later ckpt wrote it)"] if isinstance(err, LaterFormatError) else
            [] if isinstance(err, UnusableManifestError) else ["`ckpt verify --repair-from URL` puts it back from a store that holds it"])
    ways += [f"`ckpt rm {r.ref}` gives up {r.ref} (and its earlier versions)" for r in roots if r.version == 0]
    if any(r.version > 0 for r in roots):
        ways.append("`ckpt gc --no-history` runs without it, freeing the earlier versions (NAME@1...) of every ref")
    err.hint = "; else ".join(ways)
    return err


@dataclass(frozen=True)
class Doomed:
    kind: str  # "chunks", "manifests", "temp" or "upload"
    name: str  # object id, or path for temporaries and uploads
    size: int
    upload: Upload | None = None  # (an upload begun and never completed: S3's multipart uploads)


@dataclass
class GcPlan:
    delete: list[Doomed] = field(default_factory=list)
    live_manifests: int = 0
    live_chunks: int = 0
    young: int = 0  # unreferenced but inside the grace period
    cutoff: float = 0.0  # only objects last modified before this may go (listing time - grace)
    recovered: int = 0  # objects a killed gc had condemned, put back first

    @property
    def bytes(self) -> int:
        return sum(d.size for d in self.delete)


def store_now(backend: Backend, *, write: bool = True) -> float:
    """Now, by the clock that stamps the store's objects (an S3 server's, an NFS server's), to
    within its resolution; never later than this machine's clock.

    Objects' ages are their server's times: judged by a clock that runs ahead of it (a machine
    without NTP), a chunk a push wrote a second ago would look older than the grace period. So
    gc writes a marker (a ``.tmp-`` name below ``objects/``, which a later gc sweeps if this one
    dies) and reads back the time the store gave it. Without ``write`` (a dry run, which writes
    nothing) the time is read from an answer of the store (:meth:`Backend.clock`: S3's ``Date``);
    a local folder gives none, and this machine's clock is taken (the store's, but on NFS). A clock
    that runs behind only keeps objects longer, and is taken as it is.
    """
    here = time.time()
    if write:
        marker = f"objects/{TEMPORARY}clock-{uuid.uuid4().hex}"
        backend.write(marker, b"")
        try:
            stamped = backend.mtime(marker)
        finally:
            backend.delete(marker)
    else:
        stamped = backend.clock(CONFIG_PATH)
    if not stamped:  # a backend that cannot tell: its objects' times are this machine's, or none
        return here
    if here - stamped > SKEW_WARNING_S:
        log.warning("this machine's clock is %.0f s ahead of the clock of the store at %s; gc judges ages by "
                    "the store's (set this machine's clock: NTP)", here - stamped, backend.url)
    return min(here, stamped + CLOCK_RESOLUTION_S)


def _read_roots(refs: Refs, index: StoreIndex | None,
                loading: Future[tuple[IndexState | None, Temporaries]] | None,
                keep_history: bool) -> tuple[IndexState | None, Roots, Temporaries]:
    """The roots (:func:`gc_roots`), the view of the index they came from (None: read from the refs),
    and the leftovers of interrupted writes below index/ that the index's load listed.

    With the metadata index, ref histories come from it (checked against the listing of refs); a
    damaged ref entry makes the refs themselves read, which name it. The listing of refs also gives
    their temporaries."""
    loaded, index_temps = loading.result() if loading is not None else (None, [])
    try:
        view = index.settle(loaded, exact=True, history=keep_history) if index is not None else None
    except StoreFormatError:
        view = None  # a damaged ref entry: the refs themselves are read, and name it (gc_roots)
    found = gc_roots(refs, keep_history=keep_history, histories=view.entries() if view is not None else None)
    return view, found, index_temps


def plan_gc(objects: ObjectStore, refs: Refs, *, grace_s: float, keep_history: bool = True, recover: bool = True,
            index: StoreIndex | None = None, lock: Lock | None = None) -> GcPlan:
    """What ``gc`` would delete now. Reads refs and manifests; deletes nothing.

    Roots are what :func:`gc_roots` names; a damaged ref entry, a missing current
    manifest or any damaged root manifest stops the plan (:func:`read_root`).

    Objects are listed *before* refs are read, so an object written after the
    listing is not in the plan at all, and one listed before a concurrent ref
    update is protected by its age (see module docstring). The age limit is fixed
    at the listing: however long the plan and its execution take, nothing modified
    within ``grace_s`` before the listing is deleted. That order protects only what is
    deleted: a dry run (``recover`` False) reads the refs while the objects are listed. Its
    plan is the one a gc makes of the store as it stands; under a concurrent push it is a
    preview only, as it was before (it reads no writer's lease either).

    ``lock`` (:func:`~ckpt_store.storage.leases.gc_lock`, on a store that cannot touch
    objects) is held by a gc that will delete: what writers' leases name is kept, read
    before the listing (storage/leases.py says why in that order).

    Ages are judged by the store's clock (:func:`store_now`; in a dry run, ``recover`` False, which
    writes nothing, as far as the store tells it without a write).
    """
    # Objects a killed gc left condemned go back first (not in a dry run, which writes nothing).
    recovered = objects.backend.recover_condemned("objects") if recover else 0
    leased_ids = leased(lock) if lock is not None else set()
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-gc") as pool:
        # The index is loaded while the store's clock is read and its objects listed (on S3 those
        # are requests one after another). A gc that deletes reads the refs only once every object
        # is listed; a dry run, which deletes nothing, reads them meanwhile too (on S3 a LIST page
        # per 1,000 ref entries, which waited on the objects' pages: docstring above).
        loading = pool.submit(index.load_and_temporaries, chunks=True) if index is not None else None
        # (not on a local disk, where a thread beside the listing only contends with it, as du finds)
        reading = None if recover or objects.backend.concurrency <= 1 else \
            pool.submit(_read_roots, refs, index, loading, keep_history)
        now = store_now(objects.backend, write=recover)
        cutoff = now - grace_s
        # A dry run puts nothing back, so it plans with what the real run's recovery will find.
        listed, temps = objects.inventory(as_recovered=not recover and objects.backend.recovers_condemned)
        view, found, index_temps = reading.result() if reading is not None else _read_roots(refs, index, loading, keep_history)
    # Those of index/ from the listing the index's load made, not a second one; those of refs/ from theirs.
    temps += [*(view.temporaries if view is not None else found.temporaries),
              *(index_temps if index is not None else objects.list_temporaries(("index",)))]
    # What a damaged ref entry keeps alive is unknown: delete nothing. Without history only each
    # ref's newest entry counts, and a damaged older one hides nothing; nor does one older than a
    # removal (the index's view, which a dry run reads, holds no entry behind a removal: it agrees).
    blocking = {n: d for n, d in found.damaged.items()
                if n not in found.settled and (keep_history or not _newest_readable(refs, n))}
    for n in sorted(found.settled if keep_history else ()):
        log.warning("%s; it is older than a removal of %s, so it keeps nothing alive (`ckpt verify` reports it)",
                    found.damaged[n][0].message, n)
    if blocking:
        name, (err, _) = next(iter(blocking.items()))
        raise _stopped_by_entry(err, older=keep_history and _newest_readable(refs, name))
    current = {r.target for r in found.roots if r.version == 0}
    roots: set[str] = set()
    live_chunks: set[str] = set()
    listed_m = {i.id for i in listed["manifests"]} if view is not None else set()
    # In a dry run, a manifest a killed gc left condemned is read where the real run's recovery
    # finds it (neither the index nor its own name may have it yet).
    condemned = {i.id: i.condemned for i in listed["manifests"] if i.condemned is not None}
    indexed: list[str] = []
    # A root manifest in the listing has its chunk list read from the index (a manifest's id is the
    # hash of its bytes: what it names never changes); any other is read and verified here.
    for mid in dict.fromkeys(r.target for r in found.roots):
        if mid in listed_m and mid not in condemned:
            indexed.append(mid)
            continue
        try:
            data = objects.get_manifest(mid, at=condemned[mid]) if mid in condemned else None
        except ObjectNotFoundError:  # put back meanwhile by a gc running now
            data = None
        _read_root_chunks(objects, mid, data, current, found, roots, live_chunks)
    if index is not None and view is not None:
        # A live manifest the index lacks is read. One it cannot summarize (a tensor name no name can be: the
        # summary parses the whole manifest) is read as the gc that deletes reads it, for its chunk ids only:
        # the dry run refused such a manifest, which a real gc reads past.
        try:
            failed = index.ensure(view, indexed, chunks=True, strict=False)
        except CkptError as e:
            raise _stopped_by(e, found) from None
        assert view.chunks is not None
        for mid in indexed:
            if mid in failed:
                _read_root_chunks(objects, mid, None, current, found, roots, live_chunks)
            else:
                roots.add(mid)
                live_chunks.update(view.chunks[mid][0])
        if recover:  # not in a dry run, which writes nothing
            index.heal(view)

    plan = GcPlan(live_manifests=len(roots), live_chunks=len(live_chunks), cutoff=cutoff, recovered=recovered)
    for kind, live in (("manifests", roots), ("chunks", live_chunks)):
        for info in listed[kind]:
            if info.id in live or info.id in leased_ids:
                continue
            if info.mtime >= cutoff:
                plan.young += 1
            else:
                plan.delete.append(Doomed(kind, info.id, info.size))
    for path, mtime, size in temps:
        if mtime < cutoff:
            plan.delete.append(Doomed("temp", path, size))
    # Uploads a writer began and never completed (killed in the middle of a large object): in no listing,
    # their parts stored (and billed) until aborted. Young ones may be a push's in flight: kept, as objects are.
    try:
        uploads, young_uploads = objects.backend.incomplete_uploads(cutoff)
    except StorageIOError as e:  # (a server without the listing, or a key not allowed it: they stay, as before)
        log.warning("unfinished uploads were not looked for: %s", e.message)
        uploads, young_uploads = [], 0
    plan.young += young_uploads
    plan.delete += [Doomed("upload", u.path, u.size, u) for u in uploads]
    return plan


def execute_gc(objects: ObjectStore, plan: GcPlan, *, grace_s: float | None = None, lock: Lock | None = None) -> Iterator[Doomed]:
    """Delete what ``plan`` names, unless an object was touched since the plan's cutoff.

    Yields each object actually deleted. An object reused by a concurrent push
    (touched, so modified after ``plan.cutoff``) is kept; on a local store the
    check and the delete cannot miss a touch landing between them
    (``Backend.delete_if_stale``). ``grace_s`` is accepted for compatibility; the
    plan's cutoff rules. With ``lock`` (the plan's), it stops with an error once the lock
    may have gone stale for writers (storage/leases.py).
    """
    backend = objects.backend
    for d in plan.delete:
        check_fresh(lock, "gc")
        if d.upload is not None:
            try:
                if backend.abort_upload(d.upload):
                    yield d
            except StorageIOError as e:  # (left for the next gc: it holds nothing a checkpoint needs)
                log.warning("an unfinished upload of %s was not aborted: %s", d.name, e.message)
            continue
        path = d.name if d.kind == "temp" else objects.path(d.kind, d.name)
        if backend.delete_if_stale(path, plan.cutoff):
            yield d
