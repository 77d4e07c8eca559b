"""The objects below ``index/`` of a store (docs/format.md, "Metadata index"): their names, the
sealed encoding of a snapshot and its parts, reading the newest snapshot and the logs after it into an
:class:`~ckpt_store.storage.index_state.IndexState`, writing a snapshot and deleting what it supersedes,
and appending a log. What the index means, and when it is read or written, is storage/index.py's."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3

from ckpt_store.storage.backends.base import TEMPORARY, Backend
from ckpt_store.storage.errors import StorageIOError, StoreFormatError
from ckpt_store.storage.index_state import IndexState, RefRec
from ckpt_store.storage.objects import Temporaries
from ckpt_store.storage.records import MAX_RECORD_BYTES, decode_record, require, sealed_json, strict_loads

log = logging.getLogger(__name__)

SNAP_FORMAT = "ckpt-index"
LOG_FORMAT = "ckpt-index-log"
CHUNKS_FORMAT = "ckpt-index-chunks"
INDEX_VERSION = 1
PREFIX = "index"
# Logs are deleted only this many generations behind the newest snapshot, so that a
# writer whose listing was old still collides with an existing log name instead of
# re-creating a deleted one below the snapshot (where readers would not look).
PRUNE_LAG = 64

RECENT_FORMAT = "ckpt-index-recent"
_HEAD_BYTES = 4096  # a snapshot's header line fits in this
MAX_INDEX_BYTES = 4 << 30  # an index object larger than this is read as damaged (the index is then rebuilt)

MAX_GEN = 10**10 - 1  # index objects are named by 10 digits
_LOG = re.compile(r"^([0-9]{10})\.log\Z")
_SNAP = re.compile(r"^([0-9]{10})-([0-9a-f]{16})\.snap\Z")
_CHUNKS = re.compile(r"^([0-9]{10})-([0-9a-f]{16})\.(?:chunks|recent)\Z")


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


# A listing of index/: snapshots (generation, mtime, path), logs by generation, the top generation, temporaries.
Listing = tuple[list[tuple[int, float, str]], dict[int, str], int, Temporaries]


class _Restart(Exception):
    """An index object vanished while it was read (a concurrent compaction): read again."""


class IndexFiles:
    """The objects below ``index/`` of the store ``backend`` holds."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.max_gen: int | None = None  # newest generation this process knows of
        self.bad: set[str] = set()  # damaged snapshots seen: deleted by the next snapshot
        self.newer = False  # the newest snapshot is of a newer index version: write no snapshot over it

    def listing(self) -> Listing:
        """One listing of ``index/``: its snapshots (generation, mtime, path; oldest first), its logs by
        generation, the highest generation, and the leftovers of interrupted writes it passed (path,
        mtime, size), which are this listing's: a value, never state another thread's listing replaces."""
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
        return snaps, logs, top, temporaries

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
        return self.load_and_temporaries(chunks=chunks, recent=recent, logs=logs)[0]

    def load_and_temporaries(self, *, chunks: bool = False, recent: bool = False, logs: bool = True
                             ) -> tuple[IndexState | None, Temporaries]:
        """:meth:`load`, and the leftovers of interrupted writes below ``index/`` that the listing it
        read from passed (gc's, without listing index/ again)."""
        for _ in range(4):
            listed = self.listing()
            try:
                return self._load(listed, chunks, recent and not chunks, logs), listed[3]
            except _Restart:
                continue
        return None, listed[3]

    def chunk_lists(self, head: dict[str, Any], path: str) -> dict[str, list[Any]]:
        """The chunk lists of the snapshot at ``path`` (whose header is ``head``): the part it names."""
        cpath = _part(head, "chunks", path)
        ch, cbody = _unblob(self._get(cpath), CHUNKS_FORMAT, f"index chunk lists {cpath}")
        if ch.get("body") != head.get("chunks_hash") or not isinstance(cbody, dict):
            raise StoreFormatError(f"index chunk lists {cpath} are not the ones {path} names")
        return cbody

    def _load(self, listed: Listing, chunks: bool, recent: bool, with_logs: bool = True) -> IndexState | None:
        snaps, logs, top, _ = listed
        self.max_gen = top
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
                st.chunks = self.chunk_lists(head, path)
            else:
                st.snap_head = (head, path)
        except StoreFormatError as e:
            log.warning("ignoring the metadata index: %s", e)
            if self._of_newer_version(path):
                self.newer = True  # not damaged: a newer ckpt's, which this one must not replace or delete
            else:
                self.bad.add(path)
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

    def write_snapshot(self, st: IndexState, keep: set[str]) -> str:
        """Write ``st`` as the snapshot of generation ``st.max_gen``, summarising the manifests ``keep``:
        chunk lists first, then the snapshot that names them; then delete what it supersedes (and the
        damaged snapshots read)."""
        assert st.chunks is not None
        gen = max(st.max_gen, st.gen)
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
        for bad in self.bad - {path}:
            self.backend.delete(bad)
        self.bad.clear()
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

    def append_log(self, rec: dict[str, Any], what: str) -> int | None:
        """Write ``rec`` (a ref update, what :meth:`IndexState.apply_log` reads) as the log of the next free
        generation; the number of logs after the newest snapshot then, or None where none was written."""
        snaps, logs, gen, _ = self.listing()  # listed each time: a long-lived writer's memory of it is stale
        for _ in range(20):
            gen += 1
            if gen > MAX_GEN:  # an 11-digit name would be written, never listed, and never pruned
                log.warning("metadata index: not recording %s: index/ holds generation %d, the last there can be "
                            "(a damaged or crafted index object?); delete the store's index/ folder to rebuild it",
                            what, MAX_GEN)
                return None
            body = sealed_json({"format": LOG_FORMAT, "version": INDEX_VERSION, "gen": gen, **rec})
            if self.backend.create_exclusive_cache(f"{PREFIX}/{gen:010d}.log", body):
                logs[gen] = ""
                break
            snaps, logs, top, _ = self.listing()  # another writer took gen: look again
            gen = max(gen, top)
        else:
            log.warning("metadata index: gave up appending %s (busy)", what)
            return None
        newest = snaps[-1][0] if snaps else -1
        return sum(1 for g in logs if g > newest)
