"""The metadata index: refs and per-checkpoint summaries in a few objects.

Without it, choosing a base, ``ls``, ``du`` and ``gc`` read one ref entry and one
manifest per ref: thousands of requests in a large S3 store. The index keeps what they
need below ``index/`` (docs/format.md, "Metadata index"):

* ``index/<gen>.log`` -- one ref update, written (exclusive create) right after its ref
  entry, with a summary of the manifest it names when the writer has it;
* ``index/<gen>-<hash>.snap`` -- everything known up to log ``gen``: every ref entry down to
  its ref's floor, below which nothing is kept alive (seq, target, time, writer, alias, and the
  entry file's size and mtime; a removed ref only counted, :meth:`IndexState.snap_body`), and a
  small summary of every manifest they keep alive (for ``ls`` and base choice);
* ``index/<gen>-<hash>.chunks`` -- the chunk ids every such manifest needs (by the same
  rule as gc, :func:`~ckpt_store.storage.gc.referenced_chunks`) and the caller's detail
  about them (for ``du`` and ``gc``); written before the snapshot that names it;
* ``index/<gen>-<hash>.recent`` -- the :data:`~ckpt_store.storage.index_state.RECENT` most recently updated live refs of
  the snapshot and their summaries: all base choice reads, so a push costs the same
  however many refs there are.

Reading costs one listing of ``index/``, one or two GETs and the logs since the last
snapshot (at most about :data:`COMPACT_AFTER`, :data:`COMPACT_AFTER_REMOTE` on S3); a
writer that finds that many folds them into a new snapshot.

The index is a cache, **never trusted over refs and manifests**:

* A reader that must be exact (``ls``, ``du``, ``gc``) lists ``refs/`` (one request per
  1000 entries on S3) and uses an index record only for an entry file the listing shows
  with the recorded size and time; any other entry is read, and entries the listing does
  not show are dropped. Ref entries are never modified (exclusive create), so a record
  that matches the listing holds what the file holds. A manifest is immutable and named
  by its hash, so a summary of it never goes stale. Anything the index lacks is read from
  the manifests; a reader that had to read much writes a new snapshot (self-healing).
* Base choice may use the index without that listing: a stale index can only make a
  worse base choice, never a wrong checkpoint, because the base manifest is read and
  verified, and ``commit`` checks every chunk the new manifest names.
* Damage is detected: every record is sealed (storage/records.py) and each snapshot
  names the BLAKE3 hash of its body; a damaged or missing snapshot means a rebuild from
  the refs and manifests, a damaged log is skipped (its update is found by the listing).
* Stores whose exclusive creates are not exact (S3 without conditional writes) get no
  index: there a ref entry can be replaced, and only reading it tells which write won.

storage/index_files.py reads and writes the objects; storage/index_state.py holds what they say.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckpt_store.storage.chunk_lists import referenced_chunks
from ckpt_store.storage.errors import (
    CkptError,
    CorruptObjectError,
    ObjectNotFoundError,
    StorageIOError,
    StoreFormatError,
    UnusableManifestError,
)
from ckpt_store.storage.gc import gc_roots
from ckpt_store.storage.index_files import IndexFiles
from ckpt_store.storage.index_state import IndexState, RefRec
from ckpt_store.storage.objects import ObjectStore, Temporaries
from ckpt_store.storage.records import MAX_RECORD_BYTES
from ckpt_store.storage.refs import Known, RefEntry, Refs, history_floor, reread_while_gone

log = logging.getLogger(__name__)

# A writer that finds this many logs after the newest snapshot writes a new snapshot.
# Locally a log costs a reader a small file read and a snapshot a rewrite of the whole
# index; on S3 each log is a GET, which costs about what a LIST does: fold them sooner.
COMPACT_AFTER = 32
COMPACT_AFTER_REMOTE = 8
# An exact reader writes a new snapshot when it had to read at least this many entries
# or manifests the index lacked.
HEAL_AFTER = 8

# What the layer above knows about a manifest: (small info for ls and base choice,
# tensor signature or None, detail aligned with the chunk list). JSON values only.
Summarizer = Callable[[bytes, list[str], str], tuple[dict[str, Any], Any, Any]]  # (manifest, its chunks, what it is)


class StoreIndex:
    """The index of one store. ``summarize`` (from the layer that knows manifests) turns a
    manifest into what ``ls``, ``du`` and base choice need; see the module docstring."""

    def __init__(self, objects: ObjectStore, refs: Refs, summarize: Summarizer | None = None) -> None:
        self.objects = objects
        self.backend = objects.backend
        self.refs = refs
        self.summarize = summarize
        self._noted: OrderedDict[str, bytes] = OrderedDict()  # manifests about to be referenced
        self._lock = threading.Lock()
        self.files = IndexFiles(self.backend)
        self.compact_after = COMPACT_AFTER if self.backend.concurrency <= 1 else COMPACT_AFTER_REMOTE

    # -- reading -----------------------------------------------------------------
    def load(self, *, chunks: bool = False, recent: bool = False, logs: bool = True) -> IndexState | None:
        """The index as stored (:meth:`IndexFiles.load`), or None when it has no usable snapshot."""
        return self.files.load(chunks=chunks, recent=recent, logs=logs)

    def load_and_temporaries(self, *, chunks: bool = False) -> tuple[IndexState | None, Temporaries]:
        """:meth:`load`, and the leftovers of interrupted writes below index/ that the listing it read from
        passed, as :meth:`ObjectStore.list_temporaries` gives them (gc's, without listing index/ again)."""
        return self.files.load_and_temporaries(chunks=chunks)

    def newest_seq(self, name: str) -> int | None:
        """The newest entry number of ref ``name`` the index's newest snapshot records (a listing of
        index/ and two reads: its header and recent part, which holds the refs updated most recently),
        or None: where :class:`Refs` starts listing a long history. A hint only, a few updates old (the
        logs after the snapshot are not read): what the listing shows from there decides."""
        try:
            st = self.load(recent=True, logs=False)
        except Exception as e:  # noqa: BLE001 - a cache: the ref's history is listed whole instead
            log.debug("no hint from the metadata index for %s: %s", name, e)
            return None
        recs = st.refs.get(name) if st is not None else None
        return max(recs) if recs else None

    def recorded(self) -> Known | None:
        """For a reader that lists ``refs/`` itself (:meth:`Refs.scan_histories`: a training run's page), the
        entries the index records as they are stored (:meth:`IndexState.recorded`: only of a file the listing
        shows as recorded; the others are read), or None where there is no index to read. One load, no chunk
        lists: a run of 1,500 snapshots is 1,500 entry files not read."""
        try:
            st = self.load()
        except Exception as e:  # noqa: BLE001 - a cache: every entry is read instead
            log.debug("no ref records from the metadata index: %s", e)
            return None
        return st.recorded if st is not None else None

    def rebuild(self) -> IndexState:
        """An empty state, to be filled from the refs (:meth:`view`) and manifests (:meth:`ensure`)."""
        return IndexState(chunks={}, damaged=True, max_gen=self.files.max_gen or 0)

    def view(self, *, exact: bool, history: bool = False, chunks: bool = False) -> IndexState:
        """The index, brought up to date with ``refs/`` when ``exact``.

        ``exact``: every ref entry listed under ``refs/`` is represented, from the index
        where the file is the one recorded, else read (``history``: every entry back to the newest
        removal the index records, else only each ref's newest). Not ``exact`` (base choice): the index as stored, rebuilt from
        the refs only when missing or damaged. Where refs/ is listed (always when ``exact``), the
        state's ``temporaries`` are those of that listing.
        """
        return self.settle(self.load(chunks=chunks, recent=not exact), exact=exact, history=history)

    def settle(self, st: IndexState | None, *, exact: bool, history: bool = False) -> IndexState:
        """:meth:`view` of ``st``, what :meth:`load` gave (``chunks`` as wanted; ``recent`` where not
        ``exact``): a caller that loads while it waits on another request (gc, listing objects first)
        brings it up to date with ``refs/`` after. The refs are listed here, after the listing of
        ``index/`` in that load: a log it found names an entry written before (write order), which
        the listing of refs therefore shows."""
        asked = history
        if st is None:
            st = self.rebuild()
            # A snapshot to write needs every entry (none is written over a newer index), as does a caller
            # asking for history (gc --dry-run: with each ref's newest entry only, it listed NAME@1... as freed)
            exact, history = True, asked or not self.files.newer
        if exact:
            self._reconcile(st, history, asked)
        return st

    def _reconcile(self, st: IndexState, history: bool, asked: bool = True) -> None:
        """``asked``: the caller needs every entry (else older ones are read only for a snapshot to
        write, and one that cannot be read leaves the view unwritten instead of failing the caller).
        ``st.temporaries``: the leftovers of interrupted writes below ``refs/``, from the same
        listing. An entry deleted after the listing (a run's local tier cutting a ref's history as it
        prunes, read by ``ckpt serve --local-tier``) is no damage: the refs are listed again (a few times)."""
        reread_while_gone(lambda last: self._reconcile_once(st, history, asked))

    def _reconcile_once(self, st: IndexState, history: bool, asked: bool) -> None:
        listing, st.temporaries = self.refs.listing_and_temporaries()
        # The refs the index has no record of are the removed ones its snapshot counted where their newest
        # entries, as listed, add up to its count and sum; else (a ref made by an older ckpt, or by hand) each is
        # read as any other entry the index lacks, and the next snapshot counts the removed ones anew.
        # A removed ref pushed again since the snapshot has records now: its old removal, counted, is taken out.
        newest_of = {n: max(files) for n, files in listing.items()}
        unknown = [(n, newest_of[n], listing[n][newest_of[n]]) for n in listing if not st.refs.get(n)]
        again = [(n, s, listing[n].get(s)) for n, s in st.begun_again.items() if n in listing]
        st.begun_again = {}
        settled = all(e is not None for _, _, e in unknown) and st.settles([(n, s, e.size) for n, s, e in unknown])  # type: ignore[union-attr]
        if not settled and again and all(e is not None for *_, e in unknown + again):
            removed = [(n, s, e.size) for n, s, e in again]  # type: ignore[union-attr]
            if st.settles([(n, s, e.size) for n, s, e in unknown] + removed):  # type: ignore[union-attr]
                st.unsettle(removed)
                settled = True
        if not settled:
            st.settled = (0, 0)
        refs: dict[str, dict[int, RefRec]] = {}
        floors: dict[str, int] = {}
        for name, files in listing.items():
            have = st.refs.get(name, {})
            if not have and settled:
                continue  # removed: counted by the snapshot
            newest = newest_of[name]
            # The newest removal the index records, or its floor, where the listing shows that file: what is
            # older keeps nothing alive (gc_roots stops at a removal), and a snapshot keeps no record of it.
            gone = removal = history_floor((s, r.target) for s, r in have.items()
                                           if files.get(s) is not None and r.matches(files[s]))  # type: ignore[arg-type]
            if (f := st.floors.get(name)) is not None and f in have and files.get(f) is not None \
                    and have[f].matches(files[f]):  # type: ignore[arg-type]
                gone, floors[name] = max(gone, f), f
            out: dict[int, RefRec] = {}
            for seq, listed in files.items():
                if seq < gone and (listed is not None or seq < removal):
                    # Damage the listing shows below a floor (an entry deleted, or a folder there) is read, as
                    # without the index: what it named is unknown, and only a removal above makes that moot.
                    continue
                rec = have.get(seq)
                if rec is not None and listed is not None and rec.mtime is None and rec.matches(listed):
                    rec = RefRec(rec.seq, rec.target, rec.time, rec.writer, rec.alias, rec.size, listed.mtime)
                if rec is None or listed is None or not rec.matches(listed):  # None: not a file, damage
                    if not history and seq != newest:
                        continue  # older entries are read when someone needs them (gc)
                    try:
                        entry = self.refs.read_entry(name, seq, is_file=listed is not None)
                    except StoreFormatError:
                        if asked or seq == newest:
                            raise
                        st.partial = True  # a snapshot must hold every entry: this view is never written
                        continue
                    if listed is None:  # written after the listing missed it (Refs.read_entry): no size to record
                        out[seq] = RefRec.of(entry, -1, None)
                        st.partial = True  # so this view is never written as a snapshot
                        continue
                    rec = RefRec.of(entry, listed.size, listed.mtime)
                    st.read += 1
                out[seq] = rec
            refs[name] = out
        st.refs, st.floors = refs, floors

    def ensure(self, st: IndexState, mids: Iterable[str], *, chunks: bool = False, strict: bool = True) -> set[str]:
        """Fill in the summaries (and chunk lists) of ``mids`` the index lacks, from the manifests.

        ``strict``: raises what reading a manifest raises (absent, damaged), as the
        commands do without the index; else such manifests are left out and returned.
        """
        if st.chunks is None and chunks:
            st.chunks = dict(st.log_chunks)
        todo = [m for m in dict.fromkeys(mids) if m not in st.info or (chunks and m not in st.chunks)]  # type: ignore[operator]
        failed: set[str] = set()

        def read(mid: str) -> bytes | None:
            try:
                return self.objects.get_manifest(mid)
            except (ObjectNotFoundError, StoreFormatError, CorruptObjectError):
                if strict:
                    raise
                failed.add(mid)
                return None

        if len(todo) <= 1 or self.backend.concurrency <= 1:
            blobs = [read(m) for m in todo]
        else:
            with ThreadPoolExecutor(min(self.backend.concurrency, len(todo)), thread_name_prefix="ckpt-index") as pool:
                blobs = list(pool.map(read, todo))
        for mid, data in zip(todo, blobs, strict=True):
            if data is None:
                continue
            try:
                self._add(st, mid, data)
            except StoreFormatError as e:
                if strict:  # (its bytes were checked against its id: they are what its writer wrote)
                    raise UnusableManifestError(mid, e.message.removeprefix(f"manifest {mid}: ")) from None
                failed.add(mid)
                continue
            st.read += 1
        return failed

    def _summary(self, data: bytes, what: str = "manifest") -> tuple[dict[str, Any], Any, list[str], Any]:
        chunks = sorted(referenced_chunks(data, what))
        if self.summarize is None:
            return {}, None, chunks, None
        info, sig, detail = self.summarize(data, chunks, what)
        return info, sig, chunks, detail

    def _add(self, st: IndexState, mid: str, data: bytes) -> None:
        info, sig, chunks, detail = self._summary(data, f"manifest {mid}")
        st.add_manifest(mid, info, sig, chunks, detail)

    def heal(self, st: IndexState) -> None:
        """Write ``st`` as a new snapshot if it is worth it (it had to read much, or is missing
        or damaged, or many logs were read) and was not written already, or read more since. Best
        effort: a failure only leaves the index stale."""
        if st.partial or self.files.newer:
            return  # the recent refs only (a writer's compaction or an exact reader brings the index up to
            # date), or a newer ckpt's index (a snapshot of this version would delete it: IndexFiles.write_snapshot)
        if st.healed_at == st.read:
            return  # written already (or failed to be), and nothing read since
        if not (st.damaged or st.read >= HEAL_AFTER or st.logs_read >= self.compact_after or st.snap_gen < 0):
            return
        if not st.refs and st.snap_gen < 0:
            return  # nothing to keep yet (an empty store)
        try:
            if st.chunks is None:  # the snapshot's chunk lists and those of the logs read (neither read again)
                st.chunks = {}
                if st.snap_head is not None:
                    try:
                        st.chunks.update(self.files.chunk_lists(*st.snap_head))
                    except StoreFormatError as e:  # read from the manifests instead (ensure, below)
                        log.warning("ignoring the metadata index's chunk lists: %s", e)
                st.chunks.update(st.log_chunks)
            self._unsettle_begun_again(st)
            keep = self.kept(st)
            missing = [m for m in st.info if m not in st.chunks and m in keep]
            if missing:
                self.ensure(st, missing, chunks=True)
            if st.snap_gen < 0:  # rebuilt from the refs: it holds only what its caller read (live targets), and
                # each later snapshot carries that on; gc --dry-run, which writes nothing, read every earlier
                # version's manifest each time. Read once here; one gone (gc --no-history) is left out.
                self.ensure(st, [m for m in keep if m not in st.info], chunks=True, strict=False)
            self.write_snapshot(st, keep)
        except Exception as e:  # noqa: BLE001 - the index is a cache: never fail the command over it
            log.info("could not update the metadata index: %s", e)  # a read-only user, say: not their problem
        st.healed_at = st.read  # (with what it read for the snapshot)

    def _unsettle_begun_again(self, st: IndexState) -> None:
        """(A state not brought up to date with refs/, whose listing would tell) takes out of ``settled`` the
        removal before each ref begun again since its snapshot, read (one request each, for the few refs
        removed and pushed again): else the snapshot written counted such a ref twice, and readers, finding
        the count wrong, read every removed ref's newest entry until an exact reader wrote a snapshot."""
        removed = []
        for name, seq in st.begun_again.items():
            path = self.refs.entry_path(name, seq)
            try:
                data = self.backend.read(path, MAX_RECORD_BYTES)
                if RefEntry.from_json(data, path).target is None:
                    removed.append((name, seq, len(data)))
            except StorageIOError as e:
                if e.retryable:
                    raise  # (a server's passing failure: the heal gives up and the next write tries again)
                continue  # a folder or a FIFO in its place
            except (OSError, CkptError):
                continue  # not a removal the snapshot could count (gone, damaged)
        st.begun_again = {}
        if removed and st.settled[0] >= len(removed):
            st.unsettle(removed)

    # -- writing -----------------------------------------------------------------
    def kept(self, st: IndexState) -> set[str]:
        """The manifests a snapshot of ``st`` summarises: those its refs keep alive by gc's rule
        (:func:`~ckpt_store.storage.gc.gc_roots`, with history), which holds every checkpoint a reader
        of the index asks about (``ls``, ``du``, base choice and the web view: live targets; ``gc
        --dry-run``: its roots). Not those of removed refs or that an alias named before (a training
        run's removed steps): kept, each save's compaction rewrote all of them. One asked for again
        is read from its manifest, as any summary the index lacks."""
        return {r.target for r in gc_roots(self.refs, histories=st.entries()).roots}

    def write_snapshot(self, st: IndexState, keep: set[str] | None = None) -> str:
        """Write ``st`` as a new snapshot (:meth:`IndexFiles.write_snapshot`). ``keep``: :meth:`kept` of
        ``st``, where the caller has it (gc's roots over every ref's history: not walked twice)."""
        return self.files.write_snapshot(st, self.kept(st) if keep is None else keep)


    def note(self, mid: str, manifest: bytes) -> None:
        """``manifest`` (id ``mid``) is about to be referenced: its summary goes into the log."""
        with self._lock:
            self._noted[mid] = manifest
            while len(self._noted) > 8:
                self._noted.popitem(last=False)

    def record(self, entry: RefEntry, size: int) -> None:
        """Append ``entry`` (just created, ``size`` bytes) to the log. Best effort: on failure the
        index is only stale, which exact readers detect."""
        try:
            self._record(entry, size)
        except Exception as e:  # noqa: BLE001 - the ref landed; the index is a cache
            log.warning("could not record %s#%d in the metadata index: %s", entry.name, entry.seq, e)

    def _record(self, entry: RefEntry, size: int) -> None:
        mtime: float | None = None
        path = self.refs.entry_path(entry.name, entry.seq)
        if self.backend.local_path(path) is not None:  # the entry file's time as listings show it: one stat
            try:
                mtime = self.backend.mtime(path) or None
            except FileNotFoundError:
                pass
        # Elsewhere it would cost a request (a HEAD): the entry's own time stands in for it
        # until an exact reader has listed the file (RefRec.matches).
        rec: dict[str, Any] = {"ref": {"name": entry.name, "rec": RefRec.of(entry, size, mtime).to_obj()}, "manifest": None}
        data = self._noted.get(entry.target) if entry.target else None
        if data is not None:
            info, sig, chunks, detail = self._summary(data)
            rec["manifest"] = {"id": entry.target, "info": info, "sig": sig, "chunks": chunks, "detail": detail}
        pending = self.files.append_log(rec, f"{entry.name}#{entry.seq}")
        if pending is not None and pending >= self.compact_after:
            st = self.load(chunks=True)
            if st is None:  # no snapshot yet (no exact reader ran: a training run's own store): the first one is
                # built from the refs and manifests, once, as `ckpt ls` would; else the logs grew with every update
                # and each update listed them all
                st = self.view(exact=True, chunks=True)
            self.heal(st)
