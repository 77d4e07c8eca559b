"""What the web view shows, as JSON-ready documents built from ckpt's public API.

The documents of ``/api/refs`` (rows of ``ckpt ls --json``), ``/api/checkpoint/REF``
(``ckpt show --json`` plus the ref's ``log``), ``/api/diff`` (``ckpt diff --json``) and the
overview's usage (``ckpt du --json``) hold the same fields and numbers as the command line;
tests compare them. Manifests, and what the overview and the lineage take of them (catalog.Overview, by
the store it was read from too), are cached by id (an id is the hash of the manifest's bytes, so a cached one is never stale); refs are listed again on every request, the chunk listing
and the usage after a few seconds, so pages follow pushes made meanwhile.

One rule for a checkpoint's overview, whatever the number asked (:meth:`StoreView.overviews`): the metadata index's
summary of a stored manifest is trusted, as ``ckpt ls`` trusts it (a run's 1,500 snapshots are not 1,500 GETs on S3),
and a manifest the view has found damaged (a read of it failed its check: the overview page checks every listed
ref's bytes once, a run page reads its rows') has no overview: the lineage and the runs leave it out.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import ckpt
from ckpt.codecs.ids import CODEC_NAMES
from ckpt.errors import CkptError, CorruptObjectError, StoreFormatError
from ckpt.format.manifest import Manifest
from ckpt.snapshot.steps import step_ref
from ckpt.store import catalog
from ckpt.store.catalog import Overview, overview_of_manifest
from ckpt_store.cli import results

MAX_PAGE = 1000  # the most rows one request returns, whatever it asks for
CACHE_TENSORS = 1_000_000  # tensors the view's caches hold (a parsed manifest: ~600 bytes a tensor)
# Diffs computed at one time, whatever the number of requests: each reads both checkpoints in batches
# (~90 MB of memory a diff for two 96 MiB checkpoints), and requests run in a pool of 40 threads.
DIFFS_AT_ONCE = 2
DIFF_WAIT_S = 10.0  # how long a diff waits for one of those before the request is answered 503 (DiffsBusyError)
# Overviews missing from the view's cache read from their manifests, not the metadata index, up to this many: a
# load of the index reads its chunk lists of every checkpoint (a run's new snapshot since the last page: one read)
FEW_MANIFESTS = 4
HISTORY_PAGE = 100  # rows of a history (a ref's log, a run's snapshots) a request returns unless it asks: one manifest read each
T = TypeVar("T")


def page(rows: list[T], offset: int, limit: int) -> tuple[list[T], dict[str, Any]]:
    """Rows ``offset .. offset+limit`` and the paging record every list document carries."""
    offset = max(0, offset)
    limit = max(1, min(limit, MAX_PAGE))
    chunk = rows[offset : offset + limit]
    nxt = offset + limit if offset + limit < len(rows) else None
    return chunk, {"total": len(rows), "offset": offset, "limit": limit, "next_offset": nxt}


def named_mix(mix: dict[int, int]) -> dict[str, int]:
    """Decoded tensor bytes per codec (:attr:`catalog.Overview.mix`), by the codecs' names."""
    out: dict[str, int] = {}
    for codec, n in mix.items():
        name = CODEC_NAMES.get(codec, "?")
        out[name] = out.get(name, 0) + n
    return dict(sorted(out.items()))


def stored_bytes(chunks: Iterable[str], sizes: dict[str, int]) -> int:
    return sum(sizes.get(c, 0) for c in chunks)


def snapshot_metrics(extra: dict[str, Any]) -> dict[str, Any]:
    """The metrics a snapshot manifest's ``extra`` records: ``{}`` where its ``snapshot`` or their
    ``metrics`` are not JSON objects (a manifest's ``extra`` is any JSON)."""
    snap = extra.get("snapshot") if isinstance(extra.get("snapshot"), dict) else {}
    return snap.get("metrics") if isinstance(snap.get("metrics"), dict) else {}


class DiffsBusyError(CkptError):
    """:data:`DIFFS_AT_ONCE` diffs were being computed for :data:`DIFF_WAIT_S` seconds: ask again (a 503)."""

    retryable = True


class StoreView:
    """Read-only access to one store for the pages and the API, with the caches described above."""

    def __init__(self, store: ckpt.Store, local: ckpt.Store | None = None, ttl_s: float = 5.0, cache_manifests: int = 4096,
                 cache_diffs: int = 16, cache_tensors: int = CACHE_TENSORS) -> None:
        self.store = store
        self.local = local  # a training run's local tier, shown on run pages beside this (durable) store
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        # Those cached from another store (the local tier) alone: the view's store's copy was not read, and may be
        # damaged (a run page read the local tier's; the lineage then drew the step verified, a damaged newest drawn)
        self._elsewhere: set[str] = set()
        self._max_manifests = cache_manifests
        self._diffs: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._max_diffs = cache_diffs
        self._making: dict[tuple[Any, ...], Future[Any]] = {}  # what :meth:`_once` is making, by key
        self._diff_slots = threading.BoundedSemaphore(DIFFS_AT_ONCE)
        # Both caches hold at most ``cache_tensors`` tensors (entries of the manifests, rows of the diffs)
        # besides the newest item: counted in items alone, 4096 manifests of a mixture-of-experts model
        # (90,000 tensors, ~50 MB parsed) were hundreds of GB.
        self._max_tensors = cache_tensors
        self._manifest_tensors = 0
        self._diff_tensors = 0
        # Overviews by the store they were read from and id, as manifests: bounded by their chunk ids as those by their
        # tensors (~150 bytes an id), and in number by 16x the manifests' count (an overview without its chunk ids is
        # ~300 bytes, a manifest more). By store: one read from the local tier's copy (a run page's) was drawn for the
        # store's same id, whose manifest the store had lost (a fresh view leaves that step out)
        self._overviews: OrderedDict[tuple[str, str], Overview] = OrderedDict()
        self._overview_chunks = 0
        self._timed: dict[str, tuple[float, Any]] = {}
        self._checked: set[str] = set()  # manifests whose bytes were found to match their ids (the overview's)
        self._damaged: dict[str, str] = {}  # manifests of the view's store found damaged when read, with the error
        self._damage_found = 0  # damaged manifests found so far: a summary made across a new finding is not kept

    # -- caches ---------------------------------------------------------------------
    def manifest(self, mid: str, store: ckpt.Store | None = None, check: bool = False) -> Manifest:
        """Manifest ``mid`` (from ``store``, default the view's): cached by id, which names its bytes in any store;
        one cached from another store is read from the view's when asked of it (its copy there is what is drawn).
        ``check``: ``store``'s copy is read again where cached, and checked against its id (not parsed), for a page
        that says that store holds it now (a warm run page drew a step "durable" from the cache after its manifest
        was deleted or damaged in the store); one of the view's store that fails leaves the cache; it raises."""
        here = store is None or store is self.store
        with self._lock:
            m = self._manifests.get(mid)
            if m is not None and not (here and mid in self._elsewhere):
                self._manifests.move_to_end(mid)
                if not check:
                    return m
            else:
                m = None
        try:
            if m is not None:
                (store or self.store).objects.get_manifest(mid)
                return m
            m = (store or self.store).manifest(mid)
        except CkptError as e:
            if m is not None and here and not e.retryable:  # (a read that may pass next time is no damage)
                self._forget(mid)
            if here and isinstance(e, (CorruptObjectError, StoreFormatError)):  # (another tier's copy may be sound)
                with self._lock:
                    if len(self._damaged) > CACHE_TENSORS // 10:  # ids and errors, ~300 bytes each: bounded
                        self._damaged.clear()
                    if mid not in self._damaged:
                        # The whole-store summaries made before (the lineage drew it as sound) are made again:
                        # the lineage showed a step the run page had just found damaged for up to ttl_s.
                        self._timed.clear()
                        self._damage_found += 1
                    self._damaged[mid] = str(e)
            raise
        with self._lock:
            if mid not in self._manifests:
                self._manifests[mid] = m
                self._manifest_tensors += len(m.tensors)
                if not here:
                    self._elsewhere.add(mid)
            elif here:
                self._elsewhere.discard(mid)
            while len(self._manifests) > 1 and (len(self._manifests) > self._max_manifests
                                                or self._manifest_tensors > self._max_tensors):
                gone, old = self._manifests.popitem(last=False)
                self._manifest_tensors -= len(old.tensors)
                self._elsewhere.discard(gone)
        return m

    def _forget(self, mid: str) -> None:
        """Drop manifest ``mid`` of the view's store, and its overview, from the caches: its copy no longer reads."""
        with self._lock:
            old = self._manifests.pop(mid, None)
            if old is not None:
                self._manifest_tensors -= len(old.tensors)
            self._elsewhere.discard(mid)
            self._checked.discard(mid)
            o = self._overviews.pop((self.store.url, mid), None)
            if o is not None:
                self._overview_chunks -= len(o.own)
            self._timed.clear()  # the whole-store summaries drew it: made again (as for damage found)
            self._damage_found += 1

    def verified(self, mid: str) -> bool:
        """Whether the view has read manifest ``mid`` from its store and found it to match its id (cached, or checked
        by the overview page): else what a page shows of it may be the metadata index's summary alone (unverified);
        a copy read from another store (a run's local tier) does not tell of the view's."""
        with self._lock:
            return (mid in self._manifests and mid not in self._elsewhere) or mid in self._checked

    def overviews(self, mids: Iterable[str], store: ckpt.Store | None = None, few: int = FEW_MANIFESTS,
                  index: catalog.IndexOnce | None = None) -> dict[str, Overview]:
        """The :class:`~ckpt.store.catalog.Overview` of each of checkpoints ``mids`` (of ``store``, default the
        view's) that is stored and not found damaged (the rule of the module's doc), cached by id as manifests
        are, and by the store read (another store's is not this one's): those not cached from the metadata index
        where more than ``few``, one load of it and one batch of existence checks (a run's 1,500 snapshots: 1,500
        manifests read and parsed took 3-11 s), the others from their manifests, or the index's summary where a
        manifest does not read (so that how many were asked does not decide what is trusted); one neither gives is
        left out, as is one the view has found damaged. ``index``: the load of the index shared by one page's calls
        (a long run's steps asked a page at a time past the cache were a load each); default one for this call."""
        wanted = list(dict.fromkeys(mids))
        st = store or self.store
        with self._lock:
            out = {mid: self._overviews[(st.url, mid)] for mid in wanted if (st.url, mid) in self._overviews}
            for mid in out:
                self._overviews.move_to_end((st.url, mid))
        missing = [mid for mid in wanted if mid not in out]
        index = index or catalog.IndexOnce()
        made = catalog.overviews(st, missing, None, index) if len(missing) > few else {}
        unread = []
        for mid in missing:
            if mid not in made:
                try:
                    made[mid] = overview_of_manifest(self.manifest(mid, store))
                except CkptError:
                    if mid not in self._damaged:  # (found damaged just now: the index's summary would be dropped)
                        unread.append(mid)
        if unread and len(missing) <= few:
            made.update(catalog.overviews(st, unread, None, index))
        with self._lock:
            for mid, o in made.items():
                if (st.url, mid) not in self._overviews:
                    self._overviews[(st.url, mid)] = o
                    self._overview_chunks += len(o.own)
            while len(self._overviews) > 1 and (len(self._overviews) > 16 * self._max_manifests
                                                or self._overview_chunks > self._max_tensors):
                self._overview_chunks -= len(self._overviews.popitem(last=False)[1].own)
            damaged = self._damaged if st is self.store else {}
            return {mid: o for mid in wanted if (o := out.get(mid) or made.get(mid)) is not None and mid not in damaged}

    def fresh(self, key: str, make: Callable[[], T]) -> T:
        """``make()``, reused for ``ttl_s`` seconds under ``key`` (listings and whole-store summaries), or until the
        view finds a manifest damaged."""

        def lookup() -> T | None:
            hit = self._timed.get(key)
            return hit[1] if hit is not None and time.monotonic() - hit[0] < self.ttl_s else None

        def made() -> T:
            with self._lock:
                found = self._damage_found
            value = make()
            with self._lock:
                if self._damage_found == found:  # (else it may draw what was found damaged meanwhile)
                    self._timed[key] = (time.monotonic(), value)
            return value

        return self._once(("fresh", key), lookup, made)

    def _once(self, key: tuple[Any, ...], lookup: Callable[[], T | None], make: Callable[[], T]) -> T:
        """``lookup()`` (called under the lock; None: not there), else ``make()``, made once for requests arriving
        together: those asking for a ``key`` being made take its outcome, value or error. (A burst of page loads
        listed the store, or computed the same diff, once each: on S3 a listing is a request per ref. Waiters
        that made it again in turn after a failure answered six requests for a failing diff at 0.5, 1.0 ... 3.0 s.)
        A failure is not kept: the next request tries again."""
        with self._lock:
            hit = lookup()
            if hit is not None:
                return hit
            fut = self._making.get(key)
            mine = fut is None
            if mine:
                fut = self._making[key] = Future()
        if not mine:
            return fut.result()
        try:
            value = make()
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self._lock:
                self._making.pop(key)
        fut.set_result(value)
        return value

    def chunk_sizes(self) -> dict[str, int]:
        return self.fresh("chunk_sizes", self.store.chunk_sizes)

    def manifest_ids(self) -> set[str]:
        """The ids of the store's manifests, listed now (for a whole-store summary, itself reused for ``ttl_s``)."""
        return self.store.manifest_ids()

    def refs(self) -> dict[str, Any]:
        """The live refs (name -> entry), listed again after ``ttl_s``: on S3 a listing is a request per ref.
        Refs whose current entry cannot be read are left out (``damaged()`` names them)."""

        def make() -> dict[str, Any]:
            try:
                return self.store.refs()
            except CkptError:  # one damaged ref entry made every page fail: read them one by one, as `ckpt ls` does
                return self.store.refs_db.scan()[0]

        return self.fresh("refs", make)

    @property
    def url(self) -> str:
        return self.store.url

    # -- documents ----------------------------------------------------------------------
    def ls(self) -> list[dict[str, Any]]:
        """The rows of ``ckpt ls --json`` (readable refs; damaged ones are in ``damaged()``)."""
        return [r for r in self._listing() if "error" not in r]

    def ls_json(self) -> list[dict[str, Any]]:
        """Every row of ``ckpt ls --json``: the readable refs and ``{"ref", "error"}`` for each damaged one."""
        return self._listing()

    def damaged(self) -> dict[str, str]:
        """Refs that cannot be read, with the error (as ``ckpt ls`` names them)."""
        return {r["ref"]: r["error"] for r in self._listing() if "error" in r}

    def _listing(self) -> list[dict[str, Any]]:
        return self.fresh("ls", lambda: results.ls_rows(self.store.ls()))

    def overview_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """ls rows with what the overview adds: stored bytes, codec mix, version number; a row whose manifest
        does not match its id names the damage."""
        sizes = self.chunk_sizes()
        refs = self.refs()
        # From the metadata index where it summarizes the checkpoint: parsing every listed manifest took
        # ~0.3 s per 10,000 tensors. The same numbers as from the manifest (catalog.summarize). Not through
        # self.overviews, which trusts a stored manifest's summary: this page names each listed ref's damage, so
        # it checks each manifest's bytes against its id (a hash, not a parse), once per id (self._checked), in
        # the same load of the index; one that fails is read below, and self.manifest records the damage that
        # self.overviews then leaves out (the one rule of the module's doc; the check is where it is found).
        with self._lock:
            checked = set(self._checked)
        indexed = catalog.overviews(self.store, [r["id"] for r in rows], checked)
        with self._lock:
            if len(self._checked) > CACHE_TENSORS // 10:  # ids, ~100 bytes each: bounded
                self._checked.clear()
            self._checked |= checked
        out = []
        for r in rows:
            entry = refs.get(r["ref"])
            row = {**r, "stored_bytes": None, "codecs": {}, "update_no": entry.seq if entry is not None else None, "run": None,
                   "damaged": None}
            o = indexed.get(r["id"])
            if o is None:
                try:  # listed from the metadata index, a ref's manifest may yet be damaged: the row says so
                    o = overview_of_manifest(self.manifest(r["id"]))
                except CkptError as e:
                    out.append({**row, "damaged": str(e)})
                    continue
            out.append({**row, "stored_bytes": stored_bytes(o.own, sizes), "codecs": named_mix(o.mix),
                        "run": (step_ref(r["ref"]) or (None,))[0] if o.snapshot else None})
        return out

    def show(self, ref: str) -> dict[str, Any]:
        """The document of ``ckpt show REF --json``: stored bytes count the checkpoint's own
        chunks and the delta bases they need (sizes from the cached listing of the store). The store's copy of
        the manifest is read for each request (checked against its id): a warm view showed a checkpoint whose
        manifest had since been deleted or damaged as whole, for as long as it ran."""
        mid = self.store.resolve(ref)
        m = self.manifest(mid, check=True)
        needed = m.chunk_lengths()
        listing = self.chunk_sizes()
        sizes = {c: listing[c] for c in needed if c in listing}
        late = [c for c in needed if c not in listing]
        if late:  # written since the listing was cached, or missing: ask for those alone
            sizes.update(self.store.stored_sizes(late))
        return results.show_doc(mid, m, sizes)

    def log(self, name: str, offset: int = 0, limit: int = HISTORY_PAGE) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Rows ``offset .. offset+limit`` of ``ckpt log NAME --json`` (those rows of it, as it has them) and the
        paging record: a ref saved to thousands of times (a run's ``latest``) has as many entries, and
        each row reads its manifest (a request on S3), so a page reads only its own."""
        entries, damaged = self.store.readable_log(name)
        window, pg = page(range(len(entries) + len(damaged)), offset, limit)
        # The store's copy of each row's manifest is read (checked against its id), as the run page reads its rows':
        # a warm view drew a version whose manifest was freed by gc (or damaged) since from its cache, where
        # `ckpt log` says so. io_workers at a time (a page holds up to MAX_PAGE rows, each a GET on S3).
        merged = sorted([(e.seq, e.target) for e in entries] + [(seq, None) for seq in damaged], reverse=True)
        shown = list(dict.fromkeys(t for _, t in merged[pg["offset"]:pg["offset"] + len(window)] if t is not None))
        read = self._read_checked(shown)

        def manifest(mid: str) -> Manifest:
            got = read.get(mid)
            if isinstance(got, CkptError):
                raise got
            return got if got is not None else self.manifest(mid)

        return results.log_rows(entries, manifest, damaged, pg["offset"], len(window)), pg

    def _read_checked(self, mids: list[str]) -> dict[str, Manifest | CkptError]:
        """Each of manifests ``mids`` read from the store's copy and checked (:meth:`manifest` with ``check``), or the
        error of it, ``io_workers`` at a time; a read that may pass next time raises (the page answers 503)."""

        def one(mid: str) -> Manifest | CkptError:
            try:
                return self.manifest(mid, check=True)
            except CkptError as e:
                if e.retryable:
                    raise
                return e

        if len(mids) <= 1:
            return {mid: one(mid) for mid in mids}
        with ThreadPoolExecutor(min(len(mids), self.store.settings.io_workers)) as pool:
            return dict(zip(mids, pool.map(one, mids)))

    def is_ref_name(self, ref: str) -> bool:
        """Whether ``ref`` is a ref's name (so it has a log), not NAME@N or an id prefix."""
        return ref in self.refs()

    def du(self) -> dict[str, Any]:
        """The document of ``ckpt du --json``."""

        def make() -> dict[str, Any]:
            return results.du_doc(self.store.du())

        return self.fresh("du", make)

    def diff(self, a: str, b: str, estimate: bool = True) -> Any:
        """``ckpt.diff`` of two refs of the store (never local files), cached by checkpoint ids: every spelling
        of a pair (names, versions, id prefixes) is one diff, computed once however many requests ask for it
        at the same time (they wait for it), and at most :data:`DIFFS_AT_ONCE` diffs are computed at a time."""
        key = (self.store.resolve(a), self.store.resolve(b), estimate)
        # A ref whose manifest is gone resolves (its entry names the id) but the diff, of ids, answered 404
        # "no ref or checkpoint named ID": a damaged store taken for a request's mistake. The damage is the error,
        # on every request (a warm view answered the diff it had cached after a side's manifest was deleted).
        for mid in key[:2]:
            self.manifest(mid, check=True)

        def made() -> Any:
            # Requests past DIFFS_AT_ONCE wait a while, not for ever: each holds one of the server's request threads.
            if not self._diff_slots.acquire(timeout=DIFF_WAIT_S):
                raise DiffsBusyError(f"{DIFFS_AT_ONCE} diffs are being computed", hint="ask again in a while")
            try:  # the ids resolved: a ref moved since (run/latest at a save) must not put its diff under this key
                report = ckpt.diff(key[0], key[1], store=self.store, estimate_delta=estimate, refs_only=True)
            finally:
                self._diff_slots.release()
            report = dataclasses.replace(report, a=a, b=b)  # named as asked: the same spelling gets the cached report
            with self._lock:
                self._diffs[key] = report
                self._diff_tensors += len(report.tensors)
                while len(self._diffs) > 1 and (len(self._diffs) > self._max_diffs or self._diff_tensors > self._max_tensors):
                    self._diff_tensors -= len(self._diffs.popitem(last=False)[1].tensors)
            return report

        hit = self._once(("diff", key), lambda: self._diffs.get(key), made)
        return hit if (hit.a, hit.b) == (a, b) else dataclasses.replace(hit, a=a, b=b)
