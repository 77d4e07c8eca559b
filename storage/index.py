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
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3

from ckpt_store.storage.backends.base import TEMPORARY
from ckpt_store.storage.chunk_lists import referenced_chunks
from ckpt_store.storage.errors import (
    CorruptObjectError,
    ObjectNotFoundError,
    StorageIOError,
    StoreFormatError,
)
from ckpt_store.storage.gc import gc_roots
from ckpt_store.storage.index_state import SETTLED_SUM_MOD, IndexState, RefRec, settled_key
from ckpt_store.storage.objects import ObjectStore
from ckpt_store.storage.records import (
    MAX_RECORD_BYTES,
    decode_record,
    require,
    sealed_json,
    strict_loads,
)
from ckpt_store.storage.refs import RefEntry, Refs, history_floor, reread_while_gone

log = logging.getLogger(__name__)

SNAP_FORMAT = "ckpt-index"
LOG_FORMAT = "ckpt-index-log"
CHUNKS_FORMAT = "ckpt-index-chunks"
INDEX_VERSION = 1
PREFIX = "index"
# A writer that finds this many logs after the newest snapshot writes a new snapshot.
# Locally a log costs a reader a small file read and a snapshot a rewrite of the whole
# index; on S3 each log is a GET, which costs about what a LIST does: fold them sooner.
COMPACT_AFTER = 32
COMPACT_AFTER_REMOTE = 8
# Logs are deleted only this many generations behind the newest snapshot, so that a
# writer whose listing was old still collides with an existing log name instead of
# re-creating a deleted one below the snapshot (where readers would not look).
PRUNE_LAG = 64
# An exact reader writes a new snapshot when it had to read at least this many entries
# or manifests the index lacked.
HEAL_AFTER = 8

RECENT_FORMAT = "ckpt-index-recent"
_HEAD_BYTES = 4096  # a snapshot's header line fits in this
MAX_INDEX_BYTES = 4 << 30  # an index object larger than this is read as damaged (the index is then rebuilt)

MAX_GEN = 10**10 - 1  # index objects are named by 10 digits
_LOG = re.compile(r"^([0-9]{10})\.log\Z")
_SNAP = re.compile(r"^([0-9]{10})-([0-9a-f]{16})\.snap\Z")
_CHUNKS = re.compile(r"^([0-9]{10})-([0-9a-f]{16})\.(?:chunks|recent)\Z")

# What the layer above knows about a manifest: (small info for ls and base choice,
# tensor signature or None, detail aligned with the chunk list). JSON values only.
Summarizer = Callable[[bytes, list[str]], tuple[dict[str, Any], Any, Any]]


def _blob(fmt: str, gen: int, body: bytes, **extra: Any) -> bytes:
    """A sealed header line naming the body's hash, then the body: the hash is checked on read
    without re-encoding the body (``check`` of a sealed record would need that)."""
    head = sealed_json({"format": fmt, "version": INDEX_VERSION, "gen": gen, "body": blake3.blake3(body).hexdigest(),
                        "length": len(body), **extra})
    return head + b"\n" + body


def _unblob(data: bytes, fmt: str, what: str) -> tuple[dict[str, Any], Any]:
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise StoreFormatError(f"{what} has no header line")
    h = decode_record(head, fmt, (INDEX_VERSION,), what, sealed_since=INDEX_VERSION)
    if h.get("length") != len(body) or h.get("body") != blake3.blake3(body).hexdigest():
        raise StoreFormatError(f"{what} is damaged: its body does not match its hash")
    try:
        return h, strict_loads(body)
    except (ValueError, RecursionError) as e:
        raise StoreFormatError(f"{what} is not valid JSON: {e}") from None


def _part(head: dict[str, Any], key: str, what: str) -> str:
    """The path of the part (``.chunks`` or ``.recent``) a snapshot's header names under ``key``:
    a name in ``index/``, never a path (``../../x`` made readers open files outside the store)."""
    name = require(head, key, str, what)
    if not _CHUNKS.match(name):
        raise StoreFormatError(f"{what} names {name[:80]!r} as its {key} part, which is not an index object name")
    return f"{PREFIX}/{name}"


class _Restart(Exception):
    """An index object vanished while it was read (a concurrent compaction): read again."""


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
        self._max_gen: int | None = None  # newest generation this process knows of
        self._bad: set[str] = set()  # damaged snapshots seen: deleted by the next snapshot
        self._newer = False  # the newest snapshot is of a newer index version: write no snapshot over it
        self.compact_after = COMPACT_AFTER if self.backend.concurrency <= 1 else COMPACT_AFTER_REMOTE
        # The leftovers of interrupted writes below index/ that its last listing passed, as
        # :meth:`ObjectStore.list_temporaries` gives them (gc's, without listing index/ again).
        self.temporaries: list[tuple[str, float, int]] = []

    # -- reading -----------------------------------------------------------------
    def _listing(self) -> tuple[list[tuple[int, float, str]], dict[int, str], int]:
        snaps, logs, top = [], {}, 0
        temporaries = []
        for e in self.backend.list(PREFIX):
            name = e.path[len(PREFIX) + 1:]
            if name.rsplit("/", 1)[-1].startswith(TEMPORARY):
                temporaries.append((e.path, e.mtime, e.size))
            elif m := _LOG.match(name):
                logs[int(m.group(1))] = e.path
                top = max(top, int(m.group(1)))
            elif m := _SNAP.match(name):
                snaps.append((int(m.group(1)), e.mtime, e.path))
                top = max(top, int(m.group(1)))
        snaps.sort()
        self.temporaries = temporaries
        return snaps, logs, top

    def _get(self, path: str, limit: int = MAX_INDEX_BYTES, *, head: bool = False) -> bytes:
        """The object at ``path`` (``head``: its first bytes, where a snapshot's header line is); b""
        (read as damaged: skipped, or rebuilt) where it cannot be an index object."""
        try:
            return self.backend.read_range(path, 0, _HEAD_BYTES) if head else self.backend.read(path, limit)
        except FileNotFoundError:
            raise _Restart(path) from None  # a concurrent compaction replaced it
        except (StoreFormatError, IsADirectoryError, StorageIOError) as e:
            # Larger than any index object, a folder, a FIFO or a device: the index is a cache, and
            # such a thing in index/ (a damaged or crafted store) must not fail the command.
            if isinstance(e, StorageIOError) and e.retryable:
                raise
            log.warning("%s", e)
            return b""

    def load(self, *, chunks: bool = False, recent: bool = False, logs: bool = True) -> IndexState | None:
        """The index as stored (snapshot + later logs), or None when it has no usable snapshot.

        ``recent``: only the refs updated most recently (:data:`~ckpt_store.storage.index_state.RECENT`), for base choice.
        ``logs``: False for the snapshot alone (what it says is then older still).
        """
        for _ in range(4):
            try:
                return self._load(chunks, recent and not chunks, logs)
            except _Restart:
                continue
        return None

    def _chunk_lists(self, head: dict[str, Any], path: str) -> dict[str, list[Any]]:
        """The chunk lists of the snapshot at ``path`` (whose header is ``head``): the part it names."""
        cpath = _part(head, "chunks", path)
        ch, cbody = _unblob(self._get(cpath), CHUNKS_FORMAT, f"index chunk lists {cpath}")
        if ch.get("body") != head.get("chunks_hash") or not isinstance(cbody, dict):
            raise StoreFormatError(f"index chunk lists {cpath} are not the ones {path} names")
        return cbody

    def _load(self, chunks: bool, recent: bool, with_logs: bool = True) -> IndexState | None:
        snaps, logs, top = self._listing()
        self._max_gen = top
        if not snaps:
            return None
        gen, _, path = snaps[-1]
        try:
            head = body = None
            if recent:  # the header only, then the recent part it names
                first = self._get(path, head=True).partition(b"\n")[0]
                h = decode_record(first, SNAP_FORMAT, (INDEX_VERSION,), f"index snapshot {path}", sealed_since=INDEX_VERSION)
                if isinstance(h.get("recent"), str):
                    rpath = _part(h, "recent", path)
                    rh, body = _unblob(self._get(rpath), RECENT_FORMAT, f"index part {rpath}")
                    if rh.get("body") != h.get("recent_hash"):
                        raise StoreFormatError(f"index part {rpath} is not the one {path} names")
                    head = h
            if head is None:
                head, body = _unblob(self._get(path), SNAP_FORMAT, f"index snapshot {path}")
                recent = False
            if head.get("gen") != gen or not isinstance(body, dict):
                raise StoreFormatError(f"index snapshot {path} is not the one its name says")
            st = IndexState(gen=gen, max_gen=top, snap_gen=gen, partial=recent)
            for n, recs in require(body, "refs", dict, path).items():
                if not isinstance(recs, list):
                    raise StoreFormatError(f"{path}: bad ref records")
                st.refs[n] = {r.seq: r for r in (RefRec.from_obj(o, path) for o in recs)}
            floors = body.get("floors", {})  # (absent from snapshots written before them: none)
            settled = body.get("settled", [0, f"{0:064x}"])
            if not (isinstance(floors, dict) and all(isinstance(f, int) and f in st.refs.get(n, {}) for n, f in floors.items())
                    and isinstance(settled, list) and len(settled) == 2 and isinstance(settled[0], int)
                    and isinstance(settled[1], str) and re.fullmatch(r"[0-9a-f]{64}", settled[1])):
                raise StoreFormatError(f"{path}: bad floors or settled refs")
            st.floors, st.settled = floors, (settled[0], int(settled[1], 16))
            st.info = require(body, "info", dict, path)
            st.sigs = require(body, "sigs", dict, path)
            # The shape this module gives a summary (add_manifest): what the layer above checks is its own.
            if not all(isinstance(i, dict) and isinstance(i.get("sig", ""), str) for i in st.info.values()):
                raise StoreFormatError(f"{path}: bad manifest summaries")
            if chunks:
                st.chunks = self._chunk_lists(head, path)
            else:
                st.snap_head = (head, path)
        except StoreFormatError as e:
            log.warning("ignoring the metadata index: %s", e)
            if self._of_newer_version(path):
                self._newer = True  # not damaged: a newer ckpt's, which this one must not replace or delete
            else:
                self._bad.add(path)
            return None
        newer = sorted(g for g in logs if g > gen) if with_logs else []
        for g, data in zip(newer, self._read_logs([logs[g] for g in newer]), strict=True):
            what = f"index log {logs[g]}"
            try:
                obj = decode_record(data, LOG_FORMAT, (INDEX_VERSION,), what, sealed_since=INDEX_VERSION)
                st.apply_log(obj, what)
            except StoreFormatError as e:
                log.warning("skipping a damaged index record: %s", e)
                st.damaged = True
            st.gen = g
        st.logs_read = len(newer)
        return st

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

    def _of_newer_version(self, path: str) -> bool:
        """Whether the snapshot at ``path`` says it is of a newer index version than this ckpt reads."""
        try:
            v = strict_loads(self.backend.read_range(path, 0, _HEAD_BYTES).partition(b"\n")[0]).get("version")
        except Exception:  # noqa: BLE001 - unreadable: damaged, not newer
            return False
        return isinstance(v, int) and v > INDEX_VERSION

    def _read_logs(self, paths: list[str]) -> Iterator[bytes]:
        """The logs at ``paths``, in order, no more than a pool's worth held at once: a store folder
        from elsewhere may hold any number of them, each as large as a record may be (a sparse file
        costs no disk). A log is one record: a larger one is read as damaged, never read whole."""
        def get(p: str) -> bytes:
            return self._get(p, MAX_RECORD_BYTES)

        if len(paths) <= 1 or self.backend.concurrency <= 1:
            yield from map(get, paths)
            return
        n = min(self.backend.concurrency, len(paths))
        with ThreadPoolExecutor(n, thread_name_prefix="ckpt-index") as pool:
            for i in range(0, len(paths), n):
                yield from pool.map(get, paths[i:i + n])

    def rebuild(self) -> IndexState:
        """An empty state, to be filled from the refs (:meth:`view`) and manifests (:meth:`ensure`)."""
        return IndexState(chunks={}, damaged=True, max_gen=self._max_gen or 0)

    def view(self, *, exact: bool, history: bool = False, chunks: bool = False,
             temporaries: list[tuple[str, float, int]] | None = None) -> IndexState:
        """The index, brought up to date with ``refs/`` when ``exact``.

        ``exact``: every ref entry listed under ``refs/`` is represented, from the index
        where the file is the one recorded, else read (``history``: every entry back to the newest
        removal the index records, else only each ref's newest). Not ``exact`` (base choice): the index as stored, rebuilt from
        the refs only when missing or damaged. ``temporaries``: as :meth:`Refs.listing` takes it
        (filled where refs/ is listed: always when ``exact``).
        """
        return self.settle(self.load(chunks=chunks, recent=not exact), exact=exact, history=history, temporaries=temporaries)

    def settle(self, st: IndexState | None, *, exact: bool, history: bool = False,
               temporaries: list[tuple[str, float, int]] | None = None) -> IndexState:
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
            exact, history = True, asked or not self._newer
        if exact:
            self._reconcile(st, history, asked, temporaries)
        return st

    def _reconcile(self, st: IndexState, history: bool, asked: bool = True,
                   temporaries: list[tuple[str, float, int]] | None = None) -> None:
        """``asked``: the caller needs every entry (else older ones are read only for a snapshot to
        write, and one that cannot be read leaves the view unwritten instead of failing the caller).
        ``temporaries``: filled with the leftovers of interrupted writes below ``refs/``, from the same
        listing. An entry deleted after the listing (a run's local tier cutting a ref's history as it
        prunes, read by ``ckpt serve --local-tier``) is no damage: the refs are listed again (a few times)."""
        def attempt(last: bool) -> None:
            if temporaries is not None:
                temporaries.clear()  # (each listing finds them anew)
            self._reconcile_once(st, history, asked, temporaries)
        reread_while_gone(attempt)

    def _reconcile_once(self, st: IndexState, history: bool, asked: bool,
                        temporaries: list[tuple[str, float, int]] | None) -> None:
        listing = self.refs.listing(temporaries=temporaries)
        # The refs the index has no record of are the removed ones its snapshot counted where their newest
        # entries, as listed, add up to its count and sum; else (a ref made by an older ckpt, or by hand) each is
        # read as any other entry the index lacks, and the next snapshot counts the removed ones anew.
        unknown = [(n, max(files), files[max(files)]) for n, files in listing.items() if not st.refs.get(n)]
        settled = st.settled[0] == len(unknown) and all(e is not None for _, _, e in unknown) and st.settled[1] == sum(
            settled_key(n, s, e.size) for n, s, e in unknown if e is not None) % SETTLED_SUM_MOD
        if not settled:
            st.settled = (0, 0)
        refs: dict[str, dict[int, RefRec]] = {}
        floors: dict[str, int] = {}
        for name, files in listing.items():
            have = st.refs.get(name, {})
            if not have and settled:
                continue  # removed: counted by the snapshot
            newest = max(files)
            # The newest removal the index records, or its floor, where the listing shows that file: what is
            # older keeps nothing alive (gc_roots stops at a removal), and a snapshot keeps no record of it.
            gone = history_floor((s, r.target) for s, r in have.items()
                                 if files.get(s) is not None and r.matches(files[s]))  # type: ignore[arg-type]
            if (f := st.floors.get(name)) is not None and f in have and files.get(f) is not None \
                    and have[f].matches(files[f]):  # type: ignore[arg-type]
                gone, floors[name] = max(gone, f), f
            out: dict[int, RefRec] = {}
            for seq, listed in files.items():
                if seq < gone:
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
            except StoreFormatError:
                if strict:
                    raise
                failed.add(mid)
                continue
            st.read += 1
        return failed

    def _summary(self, data: bytes) -> tuple[dict[str, Any], Any, list[str], Any]:
        chunks = sorted(referenced_chunks(data))
        if self.summarize is None:
            return {}, None, chunks, None
        info, sig, detail = self.summarize(data, chunks)
        return info, sig, chunks, detail

    def _add(self, st: IndexState, mid: str, data: bytes) -> None:
        info, sig, chunks, detail = self._summary(data)
        st.add_manifest(mid, info, sig, chunks, detail)

    def heal(self, st: IndexState) -> None:
        """Write ``st`` as a new snapshot if it is worth it (it had to read much, or is missing
        or damaged, or many logs were read). Best effort: a failure only leaves the index stale."""
        if st.partial or self._newer:
            return  # the recent refs only (a writer's compaction or an exact reader brings the index up to
            # date), or a newer ckpt's index (a snapshot of this version would delete it: _prune)
        if not (st.damaged or st.read >= HEAL_AFTER or st.logs_read >= self.compact_after or st.snap_gen < 0):
            return
        if not st.refs and st.snap_gen < 0:
            return  # nothing to keep yet (an empty store)
        try:
            if st.chunks is None:  # the snapshot's chunk lists and those of the logs read (neither read again)
                st.chunks = {}
                if st.snap_head is not None:
                    try:
                        st.chunks.update(self._chunk_lists(*st.snap_head))
                    except StoreFormatError as e:  # read from the manifests instead (ensure, below)
                        log.warning("ignoring the metadata index's chunk lists: %s", e)
                st.chunks.update(st.log_chunks)
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
        """Write ``st`` as the snapshot of generation ``st.max_gen``: chunk lists first, then
        the snapshot that names them; then delete what it supersedes. ``keep``: :meth:`kept` of
        ``st``, where the caller has it (gc's roots over every ref's history: not walked twice)."""
        assert st.chunks is not None
        gen = max(st.max_gen, st.gen)
        keep = self.kept(st) if keep is None else keep
        cbody = st.chunks_body(keep)
        chash = blake3.blake3(cbody).hexdigest()
        cname = f"{gen:010d}-{chash[:16]}.chunks"
        self.backend.write(f"{PREFIX}/{cname}", _blob(CHUNKS_FORMAT, gen, cbody))
        self.backend.flush()
        rbody = st.recent_body()
        rhash = blake3.blake3(rbody).hexdigest()
        rname = f"{gen:010d}-{rhash[:16]}.recent"
        self.backend.write(f"{PREFIX}/{rname}", _blob(RECENT_FORMAT, gen, rbody))
        self.backend.flush()
        body = st.snap_body(keep)
        blob = _blob(SNAP_FORMAT, gen, body, chunks=cname, chunks_hash=chash, recent=rname, recent_hash=rhash)
        path = f"{PREFIX}/{gen:010d}-{blake3.blake3(blob).hexdigest()[:16]}.snap"
        self.backend.write(path, blob)
        self.backend.flush()
        self._prune(gen, {path, f"{PREFIX}/{cname}", f"{PREFIX}/{rname}"})
        for bad in self._bad - {path}:
            self.backend.delete(bad)
        self._bad.clear()
        return path

    def _prune(self, gen: int, keep: set[str]) -> None:
        for e in list(self.backend.list(PREFIX)):
            name = e.path[len(PREFIX) + 1:]
            m = _LOG.match(name) or _SNAP.match(name) or _CHUNKS.match(name)
            if m is None or e.path in keep:
                continue
            g = int(m.group(1))
            if (_LOG.match(name) and g <= gen - PRUNE_LAG) or (not _LOG.match(name) and g < gen):
                self.backend.delete(e.path)

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
        snaps, logs, gen = self._listing()  # listed each time: a long-lived writer's memory of it is stale
        for _ in range(20):
            gen += 1
            if gen > MAX_GEN:  # an 11-digit name would be written, never listed, and never pruned
                log.warning("metadata index: not recording %s#%d: index/ holds generation %d, the last there can be "
                            "(a damaged or crafted index object?); delete the store's index/ folder to rebuild it",
                            entry.name, entry.seq, MAX_GEN)
                return
            body = sealed_json({"format": LOG_FORMAT, "version": INDEX_VERSION, "gen": gen, **rec})
            if self.backend.create_exclusive_cache(f"{PREFIX}/{gen:010d}.log", body):
                logs[gen] = ""
                break
            snaps, logs, top = self._listing()  # another writer took gen: look again
            gen = max(gen, top)
        else:
            log.warning("metadata index: gave up appending %s#%d (busy)", entry.name, entry.seq)
            return
        newest = snaps[-1][0] if snaps else -1
        if sum(1 for g in logs if g > newest) >= self.compact_after:
            st = self.load(chunks=True)
            if st is None:  # no snapshot yet (no exact reader ran: a training run's own store): the first one is
                # built from the refs and manifests, once, as `ckpt ls` would; else the logs grew with every update
                # and each update listed them all
                st = self.view(exact=True, chunks=True)
            self.heal(st)
