"""Housekeeping over a whole store: verify, du (usage) and gc."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckpt.codecs.ids import CODEC_NAMES
from ckpt.format.manifest import Manifest
from ckpt.progress import Progress, reporting
from ckpt.store.catalog import Usage, live_manifests, live_usage, usage_of_manifest
from ckpt_store.storage.chunk_lists import referenced_chunks
from ckpt_store.storage.config import read_config
from ckpt_store.storage.errors import CkptError, ObjectNotFoundError
from ckpt_store.storage.gc import Doomed, execute_gc, gc_roots, plan_gc, read_root
from ckpt_store.storage.leases import gc_lock
from ckpt_store.storage.objects import Inventory, ObjectStore

if TYPE_CHECKING:
    from ckpt.store.store import Store


@dataclass
class VerifyReport:
    refs_checked: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)  # one line per damaged object
    # ref (or NAME@N for an earlier version) -> its problems
    damaged_refs: dict[str, list[str]] = field(default_factory=dict)
    # Objects found missing or damaged: (kind, id) -> decoded length (chunks; 0 for manifests).
    damaged_objects: dict[tuple[str, str], int] = field(default_factory=dict)
    versions_checked: int = 0  # earlier versions (NAME@1...) checked besides the refs' current ones
    # Earlier versions whose manifest is gone (freed by `gc --no-history`): gc keeps nothing of
    # theirs, so this is not damage; listed so that a loss is not invisible either.
    freed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(store: Store, names: list[str] | None = None, progress: Progress | None = None) -> VerifyReport:
    """Check every object reachable from ``names``: present, decodable, re-hashing to its id, as the
    store holds it (a remote store's local chunk cache is not read).

    Without ``names``: everything ``gc`` keeps alive (:func:`~ckpt_store.storage.gc.gc_roots`),
    i.e. every live ref and its earlier versions (``NAME@1``...), each damaged one named
    by the label commands accept. ``names`` are refs, ``NAME@N`` or id prefixes.
    """
    # (here, not above: du and gc, which import this module, decode no chunk and need neither numpy nor the codecs)
    from ckpt.store.load import check_headers
    from ckpt.transfer.pipeline import fetch_chunk, run_parallel

    report = VerifyReport()
    try:
        read_config(store.backend)
    except CkptError as e:
        report.problems.append(f"store config: {e}")
    # Names that do not resolve are the caller's mistake, not damage: raise before checking.
    labels: dict[str, list[str]] = defaultdict(list)  # manifest id -> labels that need it
    current: set[str] = set()
    if names is None:
        found = gc_roots(store.refs_db, keep_history=True)
        for n, (err, _) in found.damaged.items():  # a damaged ref entry: what it names is unknown
            report.problems.append(str(err))
            report.damaged_refs.setdefault(n, []).append(str(err))
        report.refs_checked = len(set(found.refs) | set(found.damaged))
        report.versions_checked = sum(1 for r in found.roots if r.version > 0)
        for root in found.roots:
            labels[root.target].append(root.label)
            if root.version == 0:
                current.add(root.target)
    else:
        for n in names:
            labels[store.resolve(n)].append(n)
        current = set(labels)
        report.refs_checked = len(names)
    # (chunk id, its length as a manifest gives it) -> labels that need it: one chunk normally, and
    # one per length where manifests disagree (all but one are wrong: a pull of theirs would fail)
    users: dict[tuple[str, int], set[str]] = defaultdict(set)
    parsed: dict[str, Manifest] = {}
    # chunk id -> what each manifest naming it keeps alive (those sets themselves, shared: intersecting
    # them per chunk made a set per shared chunk, quadratic in the size of checkpoints sharing chunks)
    allowed: dict[str, list[frozenset[str]]] = {}
    def damaged_manifest(target: str, who: list[str], e: CkptError) -> None:
        report.problems.append(str(e))
        for name in who:
            report.damaged_refs.setdefault(name, []).append(str(e))
        report.damaged_objects[("manifest", getattr(e, "object_id", target))] = 0

    vanished: list[tuple[str, list[str], CkptError]] = []  # current manifests missing: perhaps freed meanwhile
    for target, who in labels.items():
        try:
            data = read_root(store.objects, target, current=target in current)
            if data is None:
                report.freed.extend(who)
                continue
            m = Manifest.from_json(data, f"manifest {target}")
        except ObjectNotFoundError as e:
            if names is None:
                vanished.append((target, who, e))
            else:
                damaged_manifest(target, who, e)
            continue
        except CkptError as e:
            damaged_manifest(target, who, e)
            continue
        try:
            kept = frozenset(referenced_chunks(data, f"manifest {target}"))  # what gc keeps for it: delta bases in there
        except CkptError as e:  # (what gc cannot read: it stops there, as it says)
            damaged_manifest(target, who, e)
            continue
        parsed[target] = m
        for claim in m.chunk_lengths().items():
            users[claim].update(who)
        for cid in kept:
            allowed.setdefault(cid, []).append(kept)

    # A ref removed and its checkpoint collected (rm, then gc elsewhere) since the refs were read: no damage.
    gone = _freed_meanwhile(store, {t for t, _, _ in vanished}) if vanished else set()
    for target, who, e in vanished:
        if target not in gone:
            damaged_manifest(target, who, e)

    # The store itself is checked: a remote store's local chunk cache would answer for chunks
    # that are gone from, or damaged in, the store (a hit never reaches it).
    objects = ObjectStore(store.backend, None, store.objects.max_chunk_blob)
    heads = {c for m in parsed.values() if m.source != "dcp" for f in m.files if f.kind == "safetensors" for c in f.chunks}
    known: dict[str, bytes] = {}  # header chunks, kept for the layout check below (small: a few KB each)

    def check(claim: tuple[str, int]) -> tuple[str, str] | None:
        cid, n = claim
        try:
            data, chain = fetch_chunk(objects, cid, n, store.settings)
        except ObjectNotFoundError as e:  # (perhaps freed meanwhile: see below)
            missing.add(claim)
            return str(e), getattr(e, "object_id", cid)
        except CkptError as e:  # the damaged object may be a base in cid's delta chain
            return str(e), getattr(e, "object_id", cid)
        if cid in heads:
            known[cid] = bytes(data)
        unnamed = [b for b in chain if any(b not in k for k in allowed[cid])]
        if unnamed:  # readable now; not once a gc, keeping what the manifests name, has deleted that base
            return (f"chunk {cid} is stored as a delta against {unnamed[0][:12]}, which a checkpoint naming it does not "
                    "name: a gc would delete that base (`ckpt verify --repair-from` a store holding the chunk writes "
                    "it whole)"), cid
        return None

    claims = sorted(users)
    missing: set[tuple[str, int]] = set()
    workers = max(store.settings.workers, store.backend.concurrency)  # remote stores: requests in flight
    with reporting(progress, "verify", sum(n for _, n in claims)) as bar:
        results = run_parallel(check, claims, workers, bar, lambda c: c[1])
    if names is None and missing:
        # A gc --no-history run meanwhile deletes a version's manifest, then its chunks: one whose
        # manifest was read above and whose chunks went since is freed, not damaged.
        gone = _freed_meanwhile(store, {t for t, who in labels.items() if t in parsed
                                        and any(users[c] & set(who) for c in missing)})
        for t in gone:
            del parsed[t]
            if t not in current:  # (one current as verify began, since moved on and freed, is no earlier version of it)
                report.freed.extend(labels[t])
        freed = {label for t in gone for label in labels[t]}
        results = [None if claim in missing and users[claim] <= freed else problem
                   for claim, problem in zip(claims, results, strict=True)]
    for (cid, n), problem in zip(claims, results, strict=True):
        report.chunks_checked += 1
        report.bytes_checked += n
        if problem:
            text, bad = problem
            report.problems.append(text)
            report.damaged_objects[("chunk", bad)] = n  # a base has its dependents' length
            for name in sorted(users[(cid, n)]):
                report.damaged_refs.setdefault(name, []).append(text)
    # Each file's stored header must place the tensors where the manifest does (what a pull
    # writes is what a load reads); where a header chunk is damaged, that was named above.
    bad = {cid for kind, cid in report.damaged_objects if kind == "chunk"}
    for target, m in parsed.items():
        if any(c in bad for f in m.files for c in f.chunks):
            continue
        try:
            check_headers(store, m, f"manifest {target}", known)
        except CkptError as e:
            report.problems.append(str(e))
            report.damaged_objects[("manifest", target)] = 0
            for name in labels[target]:
                report.damaged_refs.setdefault(name, []).append(str(e))
    return report


def _freed_meanwhile(store: Store, targets: set[str]) -> set[str]:
    """Of ``targets`` (manifests this verify read), those freed since: gone from the store, and
    no ref's current checkpoint now (a missing current manifest is damage)."""
    gone = {t for t in targets if not store.objects.has("manifests", t)}
    if not gone:
        return set()
    return gone - {r.target for r in gc_roots(store.refs_db, keep_history=False).roots}


@dataclass
class RepairReport:
    repaired: list[tuple[str, str]] = field(default_factory=list)  # (kind, id) put back from the source
    unavailable: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, id, why) not repairable
    after: VerifyReport = field(default_factory=VerifyReport)  # verify once repair is done


def repair(store: Store, source: Store, names: list[str] | None = None, progress: Progress | None = None) -> RepairReport:
    """Put back damaged or missing objects of ``store`` from ``source``, verified; then verify again.

    Only content-addressed objects can be repaired: a manifest is copied as stored
    (its id is the hash of its bytes), a chunk is decoded and verified in ``source``
    and written here self-contained (no delta base), so that the repair adds no
    dependency on anything else. The damaged file is replaced atomically. Damaged ref
    entries and store configs cannot come from another store (their content is this
    store's own) and are listed in ``unavailable`` via the final verify.
    """
    from ckpt.codecs.chunk import encode_chunk
    from ckpt.transfer.pipeline import fetch_chunk

    out = RepairReport()
    tried: set[tuple[str, str]] = set()
    report = verify(store, names, progress)
    # A repaired manifest exposes chunks never checked before: go round until nothing new.
    while True:
        todo = {k: n for k, n in report.damaged_objects.items() if k not in tried}
        if not todo:
            break
        for (kind, oid), length in sorted(todo.items()):
            tried.add((kind, oid))
            try:
                if kind == "manifest":
                    blob = source.objects.get_manifest(oid)
                else:
                    data, _ = fetch_chunk(source.objects, oid, length, source.settings)
                    blob = encode_chunk(data, elem=1, level=store.settings.zstd_level, min_saving=store.settings.min_saving).blob
                # What cannot be written here (a folder in its place) is listed, and the rest repaired.
                store.backend.write(store.objects.path(f"{kind}s", oid), blob)
            except CkptError as e:
                out.unavailable.append((kind, oid, str(e)))
                continue
            out.repaired.append((kind, oid))
        store.backend.flush()
        report = verify(store, names, progress)
    # Put back, and still damaged: the source held the same (verified) object, so the damage is in
    # what the checkpoint says (a manifest whose content is invalid), which no copy repairs.
    still = [k for k in out.repaired if k in report.damaged_objects]
    out.repaired = [k for k in out.repaired if k not in report.damaged_objects]
    out.unavailable += [(kind, oid, "the source's copy is damaged the same way: the checkpoint itself is, and no copy "
                         "repairs it (see the problems verify names)") for kind, oid in still]
    out.after = report
    return out


@dataclass(frozen=True)
class RefUsage:
    name: str
    id: str
    logical: int  # bytes of the files as pushed
    unique: int  # decoded bytes of its distinct chunks
    stored: int  # bytes its distinct chunks occupy in the store
    exclusive: int  # stored bytes of chunks no other live ref uses (what removing it frees)


@dataclass(frozen=True)
class StoreUsage:
    refs: list[RefUsage]
    logical: int  # sum over live refs
    unique: int  # decoded bytes of distinct chunks reachable from live refs
    stored: int  # bytes of every object in the store (chunks + manifests)
    stored_chunks: int
    objects: int
    by_codec: dict[str, tuple[int, int]] = field(default_factory=dict)  # codec -> (decoded, stored) bytes
    # Refs left out because their entry or checkpoint cannot be read: name -> the error.
    damaged: dict[str, str] = field(default_factory=dict)

    @property
    def dedup_saved(self) -> int:
        return self.logical - self.unique

    @property
    def compression_saved(self) -> int:
        return self.unique - self.stored_chunks


def _usages(store: Store, listing: Future[Inventory]) -> tuple[list[tuple[str, str, Usage]], dict[str, str]]:
    """(ref, checkpoint id, usage) of every readable live ref, and the damaged ones with their error:
    from the metadata index when it is whole, else read ref by ref. ``listing``: the store's listing
    of its objects (:meth:`ObjectStore.inventory`), made meanwhile."""
    if store.index is not None:
        # Where a listing names only objects (S3), its manifests answer which the store holds; elsewhere
        # a name listed may be a folder or a FIFO in a manifest's place, and each is checked.
        present = ((lambda: {o.id for o in listing.result()[0]["manifests"]}) if store.backend.lists_only_objects
                   else None)
        try:
            return live_usage(store, present), {}
        except CkptError:
            # The listing's failure first, as it is (du cannot go on without it, and reads nothing more),
            # whichever came first; else a damaged ref or manifest: read them one by one, setting them aside.
            listing.result()
    rows, damaged = live_manifests(store)
    return [(name, entry.target or "", usage_of_manifest(m)) for name, entry, m in rows], damaged


def du(store: Store) -> StoreUsage:
    """Logical vs stored bytes per live ref and for the whole store.

    A ref whose entry or manifest cannot be read is left out of the figures and
    named in ``damaged``. A listing of the store's objects that fails raises its error.
    """
    if store.backend.concurrency <= 1:  # (a local disk: a thread beside the reads only contends with them, ~10%)
        inventory: Future[Inventory] = Future()
        inventory.set_result(store.objects.inventory())
        usages, damaged = _usages(store, inventory)
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-du") as pool:
            # Every object is listed while the index and refs are read: on S3 the largest part of du's
            # requests, which waited on them before.
            inventory = pool.submit(store.objects.inventory)
            usages, damaged = _usages(store, inventory)
    listed, _ = inventory.result()
    chunk_sizes = {o.id: o.size for o in listed["chunks"]}
    manifest_bytes = sum(o.size for o in listed["manifests"])
    per_ref = []
    all_chunks: dict[str, int] = {}
    users: dict[str, int] = defaultdict(int)
    for name, mid, u in usages:
        lengths = u.lengths
        all_chunks.update(lengths)
        for c in lengths:
            users[c] += 1
        per_ref.append((name, mid, u, lengths))
    refs = [
        RefUsage(
            name, mid, u.logical, sum(lengths.values()),
            sum(chunk_sizes.get(c, 0) for c in lengths),
            sum(chunk_sizes.get(c, 0) for c in lengths if users[c] == 1),
        )
        for name, mid, u, lengths in per_ref
    ]
    logical = sum(r.logical for r in refs)
    stored_chunks = sum(chunk_sizes.get(c, 0) for c in all_chunks)
    codec_of: dict[str, str] = {}
    for _, _, u, _ in per_ref:
        for cid, codec in u.codecs:
            codec_of[cid] = CODEC_NAMES.get(codec, "?")
    by_codec: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for cid, n in all_chunks.items():
        acc = by_codec[codec_of.get(cid, "file data")]
        acc[0] += n
        acc[1] += chunk_sizes.get(cid, 0)
    return StoreUsage(
        refs=refs,
        logical=logical,
        unique=sum(all_chunks.values()),
        stored=sum(chunk_sizes.values()) + manifest_bytes,
        stored_chunks=stored_chunks,
        objects=len(chunk_sizes),
        by_codec={k: (v[0], v[1]) for k, v in sorted(by_codec.items())},
        damaged=damaged,
    )


@dataclass(frozen=True)
class GcReport:
    dry_run: bool
    deleted: list[Doomed]
    planned: int
    bytes: int
    young: int
    live_manifests: int
    live_chunks: int
    recovered: int = 0  # objects a killed gc had condemned, put back


def gc(store: Store, *, grace_s: float, dry_run: bool = False, keep_history: bool = True) -> GcReport:
    # A dry run previews from the metadata index (a few requests however large the store). What
    # deletes reads the refs and manifests themselves: the index is never trusted over them, and
    # a wrong one (a bug's, or a forged log: it is sealed, not signed) would free live data.
    if dry_run:
        plan = plan_gc(store.objects, store.refs_db, grace_s=grace_s, keep_history=keep_history, recover=False,
                       index=store.index)
        deleted = plan.delete
    else:
        from ckpt.snapshot.local_lock import keeping_off

        # (not a local tier a manager holds, but through its own store: it collects the tier without grace)
        with keeping_off(store), gc_lock(store.objects) as lock:  # writers elsewhere wait, or name what they reuse (S3)
            plan = plan_gc(store.objects, store.refs_db, grace_s=grace_s, keep_history=keep_history, lock=lock)
            deleted = list(execute_gc(store.objects, plan, lock=lock))
    return GcReport(dry_run, deleted, len(plan.delete), sum(d.size for d in deleted), plan.young, plan.live_manifests,
                    plan.live_chunks, plan.recovered)
