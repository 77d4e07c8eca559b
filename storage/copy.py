"""Copying checkpoints between stores: only what the destination lacks, in dependency order.

Bytes only: a chunk blob is copied as stored (compressed, delta-coded), never re-encoded.
What a manifest depends on is found by the format's reachability rule
(:func:`storage.chunk_lists.referenced_chunks`: its chunks and every base of their delta chains).
The order keeps the destination consistent at every instant, as a push does:

1. chunks -- bases before the chunks that are deltas against them;
2. manifests -- only once every chunk they name is at the destination;
3. refs -- only once their manifest is.

Every object is verified before it is written: a manifest must hash to its id, and a
chunk is decoded and re-hashed by ``check_chunk`` (the codecs live in ``ckpt/``; this
module only moves bytes). An object already at the destination is not sent, so a copy
that was interrupted sends, when run again, only what is still missing. A manifest already
there proves nothing about its chunks (it may be unreferenced, half collected by a gc): before
any ref moves, every chunk of every manifest copied is checked and touched, as a push's
commit does, and one a concurrent gc took is sent again or, gone after that, an error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from ckpt_store.storage.backends.base import Data, data_size
from ckpt_store.storage.chunk_lists import chunk_depths, referenced_chunks
from ckpt_store.storage.commit import missing_chunks
from ckpt_store.storage.errors import CkptError, CorruptObjectError, InvalidNameError, ObjectNotFoundError
from ckpt_store.storage.leases import check_fresh, writer_lease
from ckpt_store.storage.objects import ObjectStore, object_id
from ckpt_store.storage.progress import NullProgress, Progress, reporting
from ckpt_store.storage.refs import Refs, validate_ref_name

log = logging.getLogger(__name__)

ChunkCheck = Callable[[str, bytes], "str | None"]
"""``check(chunk_id, blob)``: decode and re-hash the blob, raising ``CorruptObjectError`` if it
is not chunk ``chunk_id``; return the id of the base chunk its decoding needs (a delta), or None."""

ChunkTaken = Callable[[str], bool]
"""``taken(chunk_id)``: another writer (a push, another copy) stored the chunk at the destination
while this copy was sending it; whether the blob it stored must be replaced -- a delta against
a chunk the copied manifests do not name, which a gc there would not keep for them. What
replaces it is ``recode``'s (which must then write the chunk whole)."""

ChunkRecode = Callable[[str, bytes], Data]
"""``recode(chunk_id, blob)``: what to write at the destination for a blob already checked --
the same chunk (same id, same decoded bytes), stored another way (a raw blob compressed, say), or
``blob`` itself. It may not make a delta: the destination would lack the base's record."""


@dataclass
class CopyReport:
    """What a copy did. ``bytes_sent`` counts stored (compressed) bytes of the objects sent."""

    chunks_sent: int = 0
    manifests_sent: int = 0
    refs_set: int = 0
    bytes_sent: int = 0
    chunks_present: int = 0  # needed, already at the destination: not sent
    manifests_present: int = 0
    refs: dict[str, str] = field(default_factory=dict)  # destination ref -> checkpoint id it now names

    @property
    def objects_sent(self) -> int:
        return self.chunks_sent + self.manifests_sent + self.refs_set


@dataclass(frozen=True)
class CopyItem:
    """One checkpoint to copy, and the ref to point at it at the destination (None: objects only)."""

    manifest: str
    name: str | None = None
    alias: bool = False


@contextmanager
def reading_source(src: ObjectStore) -> Iterator[None]:
    """An error of the source store's raised inside (a ref it lacks, an object missing or damaged
    there) says that it is the source's: "missing from the store", read by someone whose ``--store``
    is the destination (``ckpt copy REF --from URL``), sent them to check the wrong one."""
    try:
        yield
    except InvalidNameError:
        raise  # the name as given, not the store
    except CkptError as e:
        if not getattr(e, "in_source", False):
            e.in_source = True  # type: ignore[attr-defined]
            e.message = f"source store {src.backend.url}: {e.message}"
            if e.hint is not None and "the source" not in e.hint:
                e.hint = e.hint.replace("run `ckpt verify`", "run `ckpt verify` on the source store").replace(
                    "see `ckpt ls`", "see `ckpt ls` there")
        raise


class _Sender:
    """Moves objects src -> dst on a bounded pool, verifying each, counting into one report."""

    def __init__(self, src: ObjectStore, dst: ObjectStore, check_chunk: ChunkCheck, concurrency: int,
                 report: CopyReport, progress: Progress, weights: Mapping[str, int],
                 recode: ChunkRecode | None = None, resend: Iterable[str] = (), taken: ChunkTaken | None = None) -> None:
        self.src, self.dst, self.check_chunk, self.recode = src, dst, check_chunk, recode
        self.concurrency = max(1, concurrency)
        self.report, self.progress, self.weights = report, progress, weights
        self.lock = threading.Lock()
        self.resend = frozenset(resend)  # replace the blob there: written over it
        # A chunk not there when the copy looked is created as a push creates one: a writer storing it
        # meanwhile in another encoding (against other bases) is not overwritten where creates are
        # exclusive, or its manifest would name a delta chain its blob no longer decodes with.
        self.taken = taken if dst.creates_chunks_exclusively else None

    def _send_chunk(self, cid: str) -> str | None:
        with reading_source(self.src):  # (the blob is the source's: so is what its check finds wrong)
            blob = self.src.get("chunks", cid)
            try:
                base = self.check_chunk(cid, blob)
            except (CorruptObjectError, ObjectNotFoundError) as e:
                blob = self._stored(cid, blob, e)
                base = self.check_chunk(cid, blob)
        out = self._recoded(cid, blob)
        path = self.dst.path("chunks", cid)
        if self.taken is None or cid in self.resend:
            self.dst.backend.write(path, out)
        elif not self.dst.backend.create_exclusive(path, out):
            if not self.taken(cid):  # theirs serves the copied checkpoints: its chain is there and named
                with self.lock:
                    self.report.chunks_present += 1
                self.progress.advance(self.weights.get(cid, 0))
                return None
            out = self._recoded(cid, blob)  # (now written whole)
            self.dst.backend.write(path, out)
        with self.lock:
            self.report.chunks_sent += 1
            self.report.bytes_sent += data_size(out)
        self.progress.advance(self.weights.get(cid, 0))
        return base

    def _recoded(self, cid: str, blob: bytes) -> Data:
        """``blob`` as the destination gets it (:attr:`recode`). Writing a delta whole reads its chain from the
        source: what is missing or damaged there is the source's (it said "missing from the store", and sent
        the user of ``ckpt --store MINE copy --from THEIRS`` to verify MINE)."""
        if self.recode is None:
            return blob
        with reading_source(self.src):
            return self.recode(cid, blob)

    def _stored(self, cid: str, blob: bytes, e: CkptError) -> bytes:
        """The source's own blob of chunk ``cid``, where ``blob``, read through the local chunk cache, failed its
        check with ``e``: the cache keeps one blob of a chunk for all the stores of one store id (a bucket synced
        from another, then written to), and another's may be a delta against a base this one lacks (a pull reads
        past it too: ckpt/transfer/fetch.py, cache_at_fault). Raises ``e`` where the store holds that blob: the
        damage is the store's."""
        if self.src.cache is None:
            raise e
        own = self.src.get("chunks", cid, cached=False)
        if own == blob:
            raise e
        self.src.cache.drop(cid)
        return own

    def chunks(self, ids: Iterable[str], depth: Mapping[str, int], known: set[str]) -> None:
        """Send chunks ``ids`` in waves of increasing delta depth (bases first). A base named by a
        blob header that is neither ``known`` (at the destination or being sent) nor present
        is sent in a later wave, before any manifest."""
        depth = dict(depth)
        pending = sorted(set(ids), key=lambda c: (depth.get(c, 0), c))
        known = set(known) | set(pending)
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="ckpt-copy") as pool:
            while pending:
                level = depth.get(pending[0], 0)
                wave = [c for c in pending if depth.get(c, 0) == level]
                pending = [c for c in pending if depth.get(c, 0) != level]
                bases = {b for b in pool.map(self._send_chunk, wave) if b is not None}
                unknown = sorted(bases - known)
                if unknown:  # the manifest's chains did not list them: send them next
                    missing = set(unknown) - self.dst.has_many("chunks", unknown)
                    known |= set(unknown)
                    depth.update({b: level for b in missing})
                    pending = sorted(missing) + pending
        self.dst.backend.flush()

    def manifests(self, blobs: Mapping[str, bytes]) -> None:
        for mid, data in sorted(blobs.items()):
            if object_id(data) != mid:
                raise CorruptObjectError("manifest", mid, "content does not match its id")
            self.dst.backend.write(self.dst.path("manifests", mid), data)
            self.report.manifests_sent += 1
            self.report.bytes_sent += len(data)
        self.dst.backend.flush()


def copy_checkpoints(
    src: ObjectStore,
    dst: ObjectStore,
    dst_refs: Refs,
    items: Iterable[CopyItem],
    *,
    check_chunk: ChunkCheck,
    concurrency: int = 8,
    progress: Progress | None = None,
    weights: Mapping[str, int] | None = None,
    recode: ChunkRecode | None = None,
    resend: Iterable[str] = (),
    taken: ChunkTaken | None = None,
) -> CopyReport:
    """Copy checkpoints with everything they need, then point refs at them, at ``dst``.

    Only objects the destination lacks travel; a ref already naming the checkpoint is
    left as it is (no new history entry), so running a copy again is cheap and changes
    nothing. ``weights`` (decoded bytes per chunk id) drives ``progress``; ``recode`` (optional)
    says how each chunk sent is stored at ``dst``; ``resend``: chunks ``dst`` holds that are sent
    all the same, replacing its blob (the same chunk, stored another way: a delta there against a
    chunk these checkpoints do not name, say); ``taken``: see :data:`ChunkTaken` (None: another
    writer's blob of a chunk sent meanwhile is overwritten, as where creates are not exclusive).
    """
    items = list(items)
    for it in items:
        if it.name is not None:
            validate_ref_name(it.name)
    report = CopyReport()
    progress = progress or NullProgress()
    weights = weights or {}
    mids = sorted({it.manifest for it in items})
    present_m = {m for m in _present(dst, "manifests", mids) if _intact_manifest(dst, m)}
    report.manifests_present = len(present_m)
    needed: set[str] = set()
    depth: dict[str, int] = {}
    with reading_source(src):
        manifests = {m: src.get_manifest(m) for m in mids}  # verified against their ids
        for data in manifests.values():
            needed |= referenced_chunks(data)
            for cid, d in chunk_depths(data).items():
                depth[cid] = max(depth.get(cid, 0), d)
    blobs = {m: data for m, data in manifests.items() if m not in present_m}
    resend = set(resend) & needed
    present_c = _present(dst, "chunks", needed) - resend
    report.chunks_present = len(present_c)
    missing = needed - present_c
    with reporting(progress, "copy", sum(weights.get(c, 0) for c in missing)) as p:
        sender = _Sender(src, dst, check_chunk, concurrency, report, p, weights, recode, resend, taken)
        sender.chunks(missing, depth, present_c)
        sender.manifests(blobs)
    # As a push's commit: every chunk is there and touched, and so is every manifest, before a ref
    # names them (a gc that took one since the checks above would leave a ref that cannot load).
    with writer_lease(dst, needed, mids) as lease:  # a gc elsewhere keeps off them
        gone = missing_chunks(dst, needed)
        gone_m = [m for m in mids if not dst.refresh("manifests", m)]
        if (gone or gone_m) and not dst.backend.touches:
            # Where nothing can be touched, a gc may have taken what the copy found present before
            # its lease: sent again under it, where no gc deletes them (storage/leases.py).
            log.info("%d objects vanished while copying (a concurrent gc?): sending them again", len(gone) + len(gone_m))
            sender.progress = NullProgress()
            sender.chunks(gone, depth, needed - set(gone))
            sender.manifests({m: manifests[m] for m in gone_m})
            gone = missing_chunks(dst, gone)
            gone_m = [m for m in gone_m if not dst.refresh("manifests", m)]
        if gone or gone_m:
            kind, oid = ("chunk", gone[0]) if gone else ("manifest", gone_m[0])
            raise ObjectNotFoundError(kind, oid, hint="it vanished while copying (a concurrent gc?); copy again")
        for it in items:
            if it.name is None:
                continue
            current = dst_refs.current(it.name)
            if current is None or current.target != it.manifest:
                # The source does not decide how the destination keeps a ref's history: a ref there
                # stays what it is (an alias's earlier targets are not kept alive by gc).
                check_fresh(lease, "copy")
                dst_refs.set(it.name, it.manifest, alias=it.alias if current is None else current.alias)
                report.refs_set += 1
            report.refs[it.name] = it.manifest
    dst.backend.flush()
    log.info("copied %d chunks, %d manifests, %d refs (%d bytes)", report.chunks_sent, report.manifests_sent,
             report.refs_set, report.bytes_sent)
    return report


def _present(dst: ObjectStore, kind: str, ids: Iterable[str]) -> set[str]:
    """The objects of ``ids`` at ``dst``, touched where the backend can (a concurrent gc then keeps
    off them; one it took between the listing and the touch counts as absent, and is sent)."""
    found = dst.has_many(kind, ids)
    if dst.backend.touches:
        found = {oid for oid in found if dst.refresh(kind, oid)}
    return found


def _intact_manifest(dst: ObjectStore, mid: str) -> bool:
    """Whether the manifest ``dst`` holds as ``mid`` hashes to it (a small read). One that does not
    (damaged there) is sent again, replacing it, else the ref the copy sets there could not load."""
    try:
        dst.get_manifest(mid)
    except (CorruptObjectError, ObjectNotFoundError) as e:
        log.warning("at the destination, %s: sending it again", e)
        return False
    return True


def copy_chunks(src: ObjectStore, dst: ObjectStore, ids: Iterable[str], *, check_chunk: ChunkCheck,
                concurrency: int = 8, recode: ChunkRecode | None = None, resend: Iterable[str] = (),
                taken: ChunkTaken | None = None) -> CopyReport:
    """Copy the chunks ``ids`` (and the bases their blobs name) that ``dst`` lacks, verified, as stored;
    ``resend``: chunks ``dst`` holds that are sent all the same; ``taken``: as for :func:`copy_checkpoints`.

    For a writer about to commit a manifest at ``dst`` that names chunks it knows are in
    ``src`` (a snapshot reusing chunks of a snapshot in another tier): call this first,
    then commit, and the write order holds at ``dst``.
    """
    ids = set(ids)
    report = CopyReport()
    present = _present(dst, "chunks", ids) - set(resend)
    report.chunks_present = len(present)
    _Sender(src, dst, check_chunk, concurrency, report, NullProgress(), {}, recode, resend, taken).chunks(ids - present, {}, present)
    return report


__all__ = ["ChunkCheck", "ChunkRecode", "ChunkTaken", "CopyItem", "CopyReport", "copy_checkpoints", "copy_chunks", "reading_source"]
