"""What ``ls``, ``du`` and base choice need to know of a checkpoint, kept in the store's
metadata index (storage/index.py) so that they need not read every manifest.

:func:`summarize` is the one place that turns a manifest into that summary; the commands
use the same summary whether it came from the index or from the manifest just read, so
their results are the same with and without the index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.errors import CkptError
from ckpt.format.manifest import Manifest
from ckpt.snapshot.run import SNAPSHOT_SOURCE, is_snapshot
from ckpt_store.storage.backends.base import creates_are_exclusive
from ckpt_store.storage.index import IndexState, StoreIndex
from ckpt_store.storage.refs import RefEntry

if TYPE_CHECKING:
    from ckpt.store.store import Store


def summarize(manifest: bytes, chunks: list[str], what: str = "manifest") -> tuple[dict[str, Any], Any, Any]:
    """(info, tensor signature, detail) of a manifest whose chunk ids (gc's rule, sorted) are ``chunks``.

    info: what ``ls`` shows and base choice ranks by; signature: (name, dtype, nbytes) of
    every tensor; detail: per chunk its decoded length, and the codec each tensor chunk
    was stored with, in tensor order (what ``du`` adds up); the chunks the checkpoint's
    files name and whether it is a snapshot (what the web view's overview adds up).
    """
    m = Manifest.from_json(manifest, what)
    return _info(m), _signature(m), _detail(m, chunks)


def _info(m: Manifest) -> dict[str, Any]:
    return {"bytes": m.logical_bytes, "tensors": len(m.tensors), "message": m.message, "source": m.source,
            "created": m.created, "base": m.lineage.get("base")}


def _signature(m: Manifest) -> list[list[Any]]:
    return [[t.name, t.dtype, t.nbytes] for t in m.tensors]


def _detail(m: Manifest, chunks: list[str]) -> dict[str, Any]:
    lengths = m.chunk_lengths()
    pos = {c: i for i, c in enumerate(chunks)}
    return {"lengths": [lengths.get(c, 0) for c in chunks],
            "codecs": [[pos[cid], codec] for t in m.tensors for cid, codec in zip(t.chunks, t.codecs) if cid in pos],
            "files": sorted({pos[cid] for f in m.files for cid in f.chunks if cid in pos}), "snapshot": is_snapshot(m)}


@dataclass(frozen=True)
class Usage:
    """What ``du`` needs of one checkpoint."""

    logical: int
    lengths: dict[str, int]  # chunk id -> decoded length (delta bases included)
    codecs: list[tuple[str, int]]  # (chunk id, codec) of every tensor chunk, in tensor order


def usage_of_manifest(m: Manifest) -> Usage:
    return Usage(m.logical_bytes, m.chunk_lengths(),
                 [(cid, codec) for t in m.tensors for cid, codec in zip(t.chunks, t.codecs)])


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _well_formed(st: IndexState, mid: str, sigs: dict[Any, bool]) -> bool:
    """Whether the index's summary of ``mid`` (and its chunk list, where loaded) has the shape
    :func:`summarize` gives it. ``sigs``: whether each signature (by its key) is, as found so far."""
    info = st.info.get(mid)
    if not (isinstance(info, dict) and _count(info.get("bytes")) and _count(info.get("tensors"))
            and isinstance(info.get("message"), (str, type(None))) and isinstance(info.get("source"), str)
            and isinstance(info.get("created"), (int, float)) and not isinstance(info.get("created"), bool)
            and "base" in info and isinstance(info["base"], (str, type(None)))):
        return False
    key = info.get("sig")  # (a str or absent: IndexState checks, and signature() goes by it alone)
    ok = sigs.get(key)
    if ok is None:  # one check per signature, however many checkpoints share it (a base's fine-tunes)
        sig = st.signature(mid)
        ok = sigs[key] = sig is None or (isinstance(sig, list) and all(
            isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) and isinstance(x[1], str) and _count(x[2]) for x in sig))
    if not ok:
        return False
    if st.chunks is None or mid not in st.chunks:
        return True
    entry = st.chunks[mid]
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and isinstance(entry[1], dict)
            and all(isinstance(c, str) for c in entry[0])):
        return False
    n = len(entry[0])
    lengths, codecs = entry[1].get("lengths"), entry[1].get("codecs")
    files, snapshot = entry[1].get("files", []), entry[1].get("snapshot", False)  # (absent from older summaries)
    return (isinstance(lengths, list) and len(lengths) == n and all(_count(x) for x in lengths) and isinstance(codecs, list)
            and all(isinstance(c, list) and len(c) == 2 and _count(c[0]) and c[0] < n and _count(c[1]) for c in codecs)
            and isinstance(files, list) and all(_count(i) and i < n for i in files) and isinstance(snapshot, bool))


def well_formed(st: IndexState, mids: list[str]) -> list[str]:
    """``mids``, after dropping from ``st`` the summaries of theirs that are not well formed, so that
    :meth:`StoreIndex.ensure` reads those manifests again: the index is a cache, and a store folder
    from elsewhere may hold a crafted one (sealed and hashed, as any writer can)."""
    sigs: dict[Any, bool] = {}
    for mid in mids:
        if mid in st.info and not _well_formed(st, mid, sigs):
            del st.info[mid]
            if st.chunks is not None:
                st.chunks.pop(mid, None)
            st.damaged = True  # the next exact reader writes a sound snapshot
    return mids


def stored(store: Store, st: IndexState, mids: list[str], present: set[str] | None = None) -> list[str]:
    """``mids``, after dropping from ``st`` the summaries of those the store does not hold, so that
    :meth:`StoreIndex.ensure` fails on them as the commands do without the index: a summary outlives
    its manifest where the manifest was deleted, or the store copied without it. One batch of
    existence checks (a stat each locally; on S3 a listing where that is cheaper).

    ``present``: manifest ids the caller found stored just before, instead of those checks: what
    :meth:`ObjectStore.has_many` found of the ids it asked about (``ls``'s, while it listed refs), or
    a listing's manifests where a listing names only objects (``du``'s on S3). A summary of any
    other (one written since, or not asked about) is dropped, and its manifest read."""
    known = [m for m in dict.fromkeys(mids) if m in st.info]
    if present is None:
        present = store.objects.has_many("manifests", known)
    for mid in known:
        if mid not in present:
            del st.info[mid]
            if st.chunks is not None:
                st.chunks.pop(mid, None)
    return mids


def usage_from_index(st: IndexState, mid: str) -> Usage:
    assert st.chunks is not None
    chunks, detail = st.chunks[mid]
    return Usage(st.info[mid]["bytes"], dict(zip(chunks, detail["lengths"], strict=True)),
                 [(chunks[i], codec) for i, codec in detail["codecs"]])


@dataclass(frozen=True)
class Overview:
    """What the web view's overview shows of one checkpoint, besides what ``ls`` does."""

    own: set[str]  # chunk ids the checkpoint names itself (its files' and tensors'; not their delta bases)
    mix: dict[int, int]  # codec -> decoded tensor bytes stored with it (as found at push time)
    snapshot: bool  # a snapshot manager's (:func:`ckpt.snapshot.run.is_snapshot`)


class IndexOnce:
    """The metadata index with its chunk lists as :func:`overviews` reads it, loaded at most once per store for
    the calls that share this (one web page's): a long run's lineage asked a page of steps at a time past the web
    view's cache, and each call loaded the whole index again (1,500 steps: 16 loads). What a load holds is held for
    those calls, not one: the chunk lists of every checkpoint, as each load held them."""

    def __init__(self) -> None:
        self._loaded: list[tuple[Store, IndexState | None]] = []

    def load(self, store: Store) -> IndexState | None:
        for s, st in self._loaded:
            if s is store:
                return st
        st = store.index.load(chunks=True) if store.index is not None else None
        self._loaded.append((store, st))
        return st


def overviews(store: Store, mids: list[str], checked: set[str] | None, index: IndexOnce | None = None) -> dict[str, Overview]:
    """The :class:`Overview` of those of checkpoints ``mids`` whose summary the metadata index holds
    (one read of its chunk lists, not a manifest parsed each: a 10,000-tensor manifest takes ~0.3 s);
    the others (an index off or unsafe, summaries written before these fields, a manifest missing
    or damaged) are left out, for the caller to read from their manifests and name the damage. A
    summary is a manifest's by id, so any snapshot of the index holding one is as good as the
    newest; the manifest's bytes are still checked against its id (a hash, not a parse), once for
    the ids the caller keeps in ``checked`` (those found sound are added). ``checked`` None: only
    that each manifest is stored, in one batch of checks as ``ls`` makes them (:func:`stored`; on S3
    a listing where that is cheaper), not a read each (a run's thousands of snapshots). ``index``: the load
    to share with other calls (:class:`IndexOnce`; default a load for this call alone). A summary it lacks
    or drops (not stored, not well formed) is dropped from that load for the calls after too."""
    st = (index or IndexOnce()).load(store)
    if st is None or st.chunks is None:
        return {}
    out = {}
    known = well_formed(st, [m for m in dict.fromkeys(mids) if m in st.info and m in st.chunks])
    for mid in stored(store, st, known) if checked is None else known:
        if mid not in st.chunks:
            continue  # not well formed, or not stored: dropped
        chunks, detail = st.chunks[mid]
        if "files" not in detail or "snapshot" not in detail:
            continue
        if checked is not None and mid not in checked:
            try:
                store.objects.get_manifest(mid)
            except CkptError:
                continue
            checked.add(mid)
        mix: dict[int, int] = {}
        for i, codec in detail["codecs"]:
            mix[codec] = mix.get(codec, 0) + detail["lengths"][i]
        out[mid] = Overview({chunks[i] for i, _ in detail["codecs"]} | {chunks[i] for i in detail["files"]}, mix,
                            detail["snapshot"])
    return out


def own_chunks(m: Manifest) -> set[str]:
    """Chunk ids a checkpoint names itself (its files' and tensors'; not their delta bases)."""
    return {c for f in m.files for c in f.chunks} | {c for t in m.tensors for c in t.chunks}


def codec_bytes(m: Manifest) -> dict[int, int]:
    """Decoded tensor bytes per codec the chunks were stored with, as found at push time."""
    mix: dict[int, int] = {}
    for t in m.tensors:
        n = len(t.chunks)
        for i, codec in enumerate(t.codecs):
            mix[codec] = mix.get(codec, 0) + (m.chunk_size if i < n - 1 else t.nbytes - m.chunk_size * (n - 1))
    return mix


def overview_of_manifest(m: Manifest) -> Overview:
    """The :class:`Overview` of a checkpoint from its manifest: what :func:`overviews` gives from the index."""
    return Overview(own_chunks(m), codec_bytes(m), is_snapshot(m))


def snapshot_kinds(store: Store, mids: Iterable[str], st: IndexState | None = None) -> dict[str, tuple[bool, float]]:
    """Whether each of checkpoints ``mids`` is a snapshot (:func:`~ckpt.snapshot.run.is_snapshot`), and when it
    was made (``Manifest.created``), from their summaries in the metadata index, as ``ls`` reads them: the few
    reads of the index, not a manifest each (a run's thousands of steps); a summary it lacks is read from its
    manifest once and kept there. The source tells, but for a process group's ("dcp", as a pushed DCP
    checkpoint's), where the detail of its chunk list does. Those it cannot tell (no index, a manifest that
    cannot be read) are left out, for the caller to decide from their manifests or leave be. ``st``: the view of
    the index the caller listed the refs from (:func:`viewed_live_refs`), not loaded again."""
    from ckpt.dcp.format import DCP_SOURCE

    wanted = list(dict.fromkeys(mids))
    if store.index is None or not wanted:
        return {}
    out: dict[str, tuple[bool, float]] = {}
    try:
        st = st if st is not None else store.index.view(exact=True)
        store.index.ensure(st, well_formed(st, wanted), strict=False)
        group = [m for m in wanted if m in st.info and st.info[m]["source"] == DCP_SOURCE]
        out = {m: (st.info[m]["source"] == SNAPSHOT_SOURCE, st.info[m]["created"])
               for m in wanted if m in st.info and m not in group}
        if group:
            store.index.ensure(st, group, chunks=True, strict=False)
            assert st.chunks is not None
            for mid in well_formed(st, group):
                if mid in st.chunks and isinstance(st.chunks[mid][1].get("snapshot"), bool):
                    out[mid] = (st.chunks[mid][1]["snapshot"], st.info[mid]["created"])
        store.index.heal(st)  # (a view the caller healed: again only for what was read here)
    except CkptError:  # a damaged ref or index: the manifests tell
        pass
    return out


def open_index(store: Store) -> StoreIndex | None:
    """The store's metadata index, or None where it is off (``CKPT_INDEX=0``) or unsafe."""
    if not store.settings.index or not creates_are_exclusive(store.backend):
        return None
    return StoreIndex(store.objects, store.refs_db, summarize)


def live_refs(store: Store) -> dict[str, RefEntry]:
    """Every live ref and its current entry (the index checked against the listing of ``refs/``)."""
    return viewed_live_refs(store)[0]


def viewed_live_refs(store: Store) -> tuple[dict[str, RefEntry], IndexState | None]:
    """:func:`live_refs`, and the view of the index they were told by (None: no index), which
    :func:`snapshot_kinds` takes: a run's steps and which are snapshots, from one listing and load."""
    if store.index is None:
        return store.refs_db.live(), None
    st = store.index.view(exact=True)
    store.index.heal(st)
    return st.live(), st


def live_usage(store: Store, present: Callable[[], set[str]] | None = None) -> list[tuple[str, str, Usage]]:
    """(ref, checkpoint id, usage) of every live ref, by name: what ``du`` adds up. ``present``: gives
    what :func:`stored` takes, once the refs are read (``du`` lists the objects meanwhile)."""
    if store.index is None:
        return [(n, e.target, usage_of_manifest(store.manifest(e.target)))
                for n, e in store.refs_db.live().items() if e.target is not None]
    st = store.index.view(exact=True, chunks=True)
    live = st.live()
    targets = [e.target for e in live.values() if e.target is not None]
    store.index.ensure(st, stored(store, st, well_formed(st, targets), present() if present is not None else None), chunks=True)
    store.index.heal(st)
    return [(n, e.target, usage_from_index(st, e.target)) for n, e in live.items() if e.target is not None]


@dataclass(frozen=True)
class RefSummary:
    """One line of ``ckpt ls``: a live ref and what its checkpoint's manifest says."""

    name: str
    id: str
    time: float
    logical_bytes: int
    tensors: int
    message: str | None
    source: str


@dataclass(frozen=True)
class RefListing:
    refs: list[RefSummary]
    damaged: dict[str, str]  # refs whose entry or manifest cannot be read -> the error


def live_manifests(store: Store) -> tuple[list[tuple[str, RefEntry, Manifest]], dict[str, str]]:
    """Every live ref with its manifest; a damaged ref entry or manifest is set aside, not raised."""
    live, bad = store.refs_db.scan()
    damaged = {n: str(err) for n, (err, _) in bad.items()}
    out = []
    for name, entry in live.items():
        assert entry.target is not None
        try:
            out.append((name, entry, store.manifest(entry.target)))
        except CkptError as e:  # one damaged checkpoint must not hide every other ref
            damaged[name] = str(e)
    return out, dict(sorted(damaged.items()))


def list_refs(store: Store) -> RefListing:
    """Every live ref, by name, with its checkpoint's size and message: from the metadata
    index (checked against the listing of refs) when it is whole, else from the manifests.

    A ref whose entry or manifest cannot be read is listed in ``damaged`` with its
    error instead of stopping the listing (``ckpt verify`` says more).
    """
    if store.index is not None:
        try:
            loaded = store.index.load()
            with ThreadPoolExecutor(1, thread_name_prefix="ckpt-ls") as pool:
                # The manifests the index names are checked to exist while refs/ is listed (on S3 a listing
                # of objects/manifests: they waited on each other); one the refs name besides is read.
                known = [e.target for e in loaded.live().values() if e.target is not None] if loaded is not None else []
                present = pool.submit(store.objects.has_many, "manifests", known)
                st = store.index.settle(loaded, exact=True)
            live = st.live()
            targets = [e.target for e in live.values() if e.target is not None]
            store.index.ensure(st, stored(store, st, well_formed(st, targets), present=present.result()))
            store.index.heal(st)
            return RefListing([RefSummary(n, e.target or "", e.time, st.info[e.target]["bytes"], st.info[e.target]["tensors"],
                                          st.info[e.target]["message"], st.info[e.target]["source"])
                               for n, e in sorted(live.items())], {})
        except CkptError:
            pass  # a damaged ref or manifest: read them one by one, setting the damaged ones aside
    rows, damaged = live_manifests(store)
    return RefListing([RefSummary(n, e.target or "", e.time, m.logical_bytes, len(m.tensors), m.message, m.source)
                       for n, e, m in rows], damaged)
