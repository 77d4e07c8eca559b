"""Push: a source (file, directory, state dict) becomes chunks, a manifest and a ref."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckpt.errors import InvalidSourceError
from ckpt.format.dtypes import itemsize
from ckpt.format.entries import BundleEntry, FileEntry, TensorEntry
from ckpt.format.manifest import Manifest
from ckpt.format.structure import STRUCTURE
from ckpt.format.tagged_json import uses_tags
from ckpt.progress import Progress, reporting
from ckpt.settings import Settings
from ckpt.store.base import choose_base, pair_tensors
from ckpt.store.destination import inside, store_root
from ckpt.store.source_files import show
from ckpt.store.sources import MemBytes, SourceIn, open_source
from ckpt.transfer.pipeline import (
    BUNDLE_CHUNK_MAX,
    BUNDLE_SHARE,
    BundleBases,
    PutResult,
    PutTask,
    ReadPool,
    Recorded,
    put_chunks,
    put_tasks,
    rewrite_whole,
)
from ckpt_store.storage.commit import commit
from ckpt_store.storage.errors import ChunksVanishedError
from ckpt_store.storage.objects import check_manifest_size, object_id
from ckpt_store.storage.records import canonical_json
from ckpt_store.storage.refs import validate_ref_name

if TYPE_CHECKING:
    from ckpt.store.store import Store

log = logging.getLogger(__name__)


class PushResult(str):
    """What a push did. It *is* the checkpoint id (a ``str``, so ``cid = store.push(...)``
    works as it always did), and carries how much the push had to write.

    >>> r = PushResult("ab" * 32, chunks=3, new_chunks=1, logical_bytes=300, written_bytes=40)
    >>> r == "ab" * 32, r.id == r, r.new_chunks, r.as_dict()["written_bytes"]
    (True, True, 1, 40)
    """

    chunks: int
    new_chunks: int
    logical_bytes: int
    written_bytes: int  # stored bytes of new chunks (compressed); dedup hits cost nothing
    manifest: Manifest | None  # what was committed

    def __new__(cls, id: str, chunks: int, new_chunks: int, logical_bytes: int, written_bytes: int,
                manifest: Manifest | None = None) -> PushResult:
        self = super().__new__(cls, id)
        self.chunks, self.new_chunks = chunks, new_chunks
        self.logical_bytes, self.written_bytes, self.manifest = logical_bytes, written_bytes, manifest
        return self

    @property
    def id(self) -> str:
        """The checkpoint id as a plain ``str``."""
        return str.__str__(self)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "chunks": self.chunks, "new_chunks": self.new_chunks,
                "logical_bytes": self.logical_bytes, "written_bytes": self.written_bytes}

    def __repr__(self) -> str:
        return (f"PushResult(id={self.id!r}, chunks={self.chunks}, new_chunks={self.new_chunks}, "
                f"logical_bytes={self.logical_bytes}, written_bytes={self.written_bytes})")


def push(
    store: Store,
    source: object,
    name: str | None,
    *,
    message: str | None = None,
    metadata: dict[str, Any] | None = None,
    base: str | None = None,
    delta: bool = True,
    progress: Progress | None = None,
) -> PushResult:
    if name is not None:
        validate_ref_name(name)  # before any I/O
    if metadata is not None:
        canonical_json(metadata)  # must be JSON; raises TypeError/ValueError early
    _check_not_the_store(store, source)
    src = open_source(source)
    try:
        keys = [(t.name, t.dtype, t.nbytes) for f in src.files for t in f.tensors]
        base_id, parent = choose_base(store, name, keys, base) if delta else (None, None)
        return push_source(store, src, name, message=message, metadata=metadata, base_id=base_id,
                           lineage={"parent": parent, "base": base_id, "merge": None}, progress=progress)
    finally:
        src.close()


def _check_not_the_store(store: Store, source: object) -> None:
    """Refuse a path inside the store pushed to, or a folder that holds it: the push would store
    the store's own files, which it touches as it writes (so the push fails, every time, as
    'changed while it was being pushed', leaving what it wrote for gc)."""
    if not isinstance(source, (str, os.PathLike)):
        return
    root = store_root(store)
    if root is None:
        return
    try:
        path = os.path.realpath(os.fspath(source))
    except (OSError, ValueError):
        return  # open_source says what is wrong with the path
    if inside(path, root):
        raise InvalidSourceError(show(os.fsdecode(os.fspath(source))), f"is inside the store at {show(root)}, which is being pushed to",
                                 hint="push model files from outside the store")
    if inside(root, path):
        raise InvalidSourceError(show(os.fsdecode(os.fspath(source))), f"holds the store at {show(root)}, which is being pushed to",
                                 hint="keep the store outside the folder you push (set CKPT_STORE or --store), or push a subfolder")


BUNDLE_MIN = 8  # chunks in a bundle, at least


def small_chunks(settings: Settings, tasks: list[PutTask], results: list[PutResult]) -> dict[str, PutTask]:
    """The chunks of a push that a bundle may hold, by id (each once): those of at most
    ``BUNDLE_CHUNK_MAX`` bytes and a quarter of a chunk."""
    small = min(BUNDLE_CHUNK_MAX, settings.chunk_size // 4)
    return {r.id: task for task, r in zip(tasks, results, strict=True) if task.length <= small}


def bundle_small(store: Store, picked: Mapping[str, PutTask],
                 total: int) -> tuple[tuple[BundleEntry, ...], list[PutTask], list[PutResult]]:
    """Copies of the chunks ``picked`` (:func:`small_chunks` of a push of ``total`` bytes),
    concatenated and stored as chunks of their own, for readers of this remote store (see
    :class:`BundleEntry`); returns the bundle and what storing it did. None where it would hold
    fewer than ``BUNDLE_MIN`` chunks (a request or two saved is not worth a write on every push) or
    over a quarter of the bytes pushed (a model of small tensors only is not stored twice).
    Also returns the tasks that stored it (to write a chunk of it again, :func:`push_source`).
    Each copy is read from the source again and checked against the id its chunk was stored
    under: a source that changed meanwhile leaves that chunk out."""
    if len(picked) < BUNDLE_MIN or BUNDLE_SHARE * sum(t.length for t in picked.values()) > total:
        return (), [], []
    members: list[tuple[str, int, int]] = []
    parts: list[bytes | memoryview] = []
    pos = 0
    for cid, task in picked.items():
        data = task.read()
        if len(data) != task.length or object_id(data) != cid:
            continue
        members.append((cid, pos, task.length))
        parts.append(data)
        pos += task.length
    if len(members) < BUNDLE_MIN:
        return (), [], []
    blob = b"".join(parts)
    bundle_tasks = put_tasks(MemBytes(memoryview(blob)).read, 0, len(blob), store.settings.chunk_size, 1)
    stored = put_chunks(store.objects, bundle_tasks, store.settings)
    return chained((BundleEntry(len(blob), tuple(r.id for r in stored), tuple(members)),), stored), bundle_tasks, stored


def _manifest(src: SourceIn, spans: list[tuple[int, int]], results: list[PutResult], reuse: Mapping[str, TensorEntry],
              fields: dict[str, Any]) -> Manifest:
    """The manifest of ``src`` whose chunks ``results`` stored (``spans``: each file's, then each
    tensor's range of them)."""
    groups = iter([results[a:b] for a, b in spans])
    files, tensors = [], []
    for f in src.files:
        rs = next(groups)
        files.append(
            FileEntry(f.path, f.kind, f.size, tuple(r.id for r in rs), len(f.head) if f.kind == "safetensors" else 0,
                      f.metadata if f.kind == "safetensors" else None, chains_of(r.bases for r in rs))
        )
        for t in f.tensors:
            rs = next(groups)
            if t.src is None:
                tensors.append(replace(reuse[t.name], file=f.path))
                continue
            tensors.append(TensorEntry(t.name, t.dtype, t.shape, t.nbytes, tuple(r.id for r in rs), f.path,
                                       codecs=tuple(r.codec for r in rs), delta_bases=chains_of(r.bases for r in rs)))
    # A bundle's chains as ``results`` have them: bundle_small's, unless a commit attempt stored a chunk of
    # it again, whole (_commit: its delta base vanished), which only ``results`` tells.
    return Manifest(files=tuple(files), tensors=tuple(tensors), **{**fields, "bundles": chained(fields.get("bundles", ()), results)})


def chained(bundles: Iterable[BundleEntry], results: Iterable[PutResult]) -> tuple[BundleEntry, ...]:
    """``bundles`` with the delta chains of their chunks as storing them did (``results``, by chunk id)."""
    chain = {r.id: r.bases for r in results}
    return tuple(replace(b, delta_bases=chains_of(chain.get(c, ()) for c in b.chunks)) for b in bundles)


def chains_of(chains: Iterable[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
    """The delta chains an entry records for its chunks (each chunk's, from what storing it did): one
    per chunk, or none where each is stored whole. gc keeps every base named (docs/format.md)."""
    out = tuple(chains)
    return out if any(out) else ()


def _commit(store: Store, src: SourceIn | None, manifest_of: Callable[[list[PutResult]], Manifest], tasks: list[PutTask],
            results: list[PutResult], name: str | None, aliases: tuple[str, ...]) -> tuple[str, Manifest, list[PutResult]]:
    """Commit the manifest of ``results`` (what storing ``tasks`` did); returns its id, it and the
    results it names. With ``src`` (still open, on a store that cannot touch: S3), a chunk a gc took
    after the push found it present is written again from it under the commit's lease; a delta
    whose base went with it (another writer's bytes, beyond this push) is stored whole and the
    manifest made again without that chain (docs/format.md, "Garbage collection")."""
    by_id = {r.id: t for t, r in zip(tasks, results, strict=True)}
    restored: dict[str, PutResult] = {}  # what restore wrote again (whole)

    def restore(missing: list[str]) -> None:
        assert src is not None
        restored.update(rewrite_whole(store.objects, {cid: by_id[cid] for cid in missing if cid in by_id}, store.settings))
        src.check_unchanged()  # what was read again is what the manifest names

    for attempt in range(3):
        manifest = manifest_of(results)
        try:
            # Aliases (RUN/latest) first: a process killed between the two ref writes then leaves
            # latest naming the newest durable snapshot, only its step ref missing, rather than
            # latest lagging one snapshot behind (found by tests/test_crash_more.py).
            mid, _ = commit(store.objects, store.refs_db, manifest.to_json(), name, aliases,
                            restore=None if src is None else restore)
            return mid, manifest, results
        except ChunksVanishedError as e:
            gone = set(e.ids)
            redo = {r.id: by_id[r.id] for r in results if gone & set(r.bases)}
            if src is None or not redo or attempt == 2:
                raise
            log.info("%d delta bases vanished while pushing (a concurrent gc?): storing %d chunks whole",
                     len(gone), len(redo))
            rewritten = {cid: restored[cid] for cid in redo if cid in restored}  # stored whole already
            rewritten |= rewrite_whole(store.objects, {c: t for c, t in redo.items() if c not in restored}, store.settings)
            src.check_unchanged()
            results = [rewritten.get(r.id, r) for r in results]
    raise AssertionError("unreachable")


def push_source(
    store: Store,
    src: SourceIn,
    name: str | None,
    *,
    message: str | None = None,
    metadata: dict[str, Any] | None = None,
    base_id: str | None = None,
    lineage: dict[str, Any] | None = None,
    reuse: Mapping[str, TensorEntry] | None = None,
    aliases: tuple[str, ...] = (),
    progress: Progress | None = None,
    bundles: bool | None = None,
    pool: ReadPool | None = None,
    keep_bases: bool = True,
    base_manifest: Manifest | None = None,
) -> PushResult:
    """Write ``src`` as a checkpoint: chunks (deltas against ``base_id`` where smaller),
    manifest, then ref ``name``, then the ``aliases`` (refs like ``RUN/latest``).

    Tensors whose source is None take their entry from ``reuse`` unchanged: the
    caller knows their chunks are stored (the snapshot path, for tensors that did not
    change since the previous snapshot).

    ``bundles``: whether the manifest carries a bundle of the small chunks (:func:`bundle_small`);
    None: where the store is remote. True for a store whose checkpoints are copied to a remote
    one as they are (a snapshot tier persisted to S3): a copy keeps the manifest's bytes.

    ``pool``: the reading threads of the operation that pushes (a merge's): delta bases that the
    bundles of ``base_id`` hold are read from them, each bundle fetched once (or kept by the pool).
    Without one, a push whose base has bundles reads them through a pool of its own, closed before
    it returns. ``keep_bases=False``: the decoded-base cache keeps none of the delta bases fetched
    (a merge's push, the last to ask for them: see :func:`~ckpt.transfer.pipeline.put_chunks`).
    ``base_manifest``: the manifest of ``base_id`` where the caller holds it parsed (a merge holds
    its inputs'), not read and parsed again (a model of 100,000 tiny tensors: ~55 MiB).
    """
    from ckpt.snapshot.local_lock import keeping_off

    # (not into a local tier a manager holds, through any store but its own: it collects the tier without grace)
    with keeping_off(store):
        # What the manifest will hold beside its tensors, measured before a chunk is written: past what
        # readers accept, the commit would refuse it after the upload, leaving every chunk for gc.
        check_manifest_size(len(canonical_json([src.extra, metadata or {}, message])),
                            "the JSON of the checkpoint's non-tensor values, metadata and message")
        settings = store.settings
        cs = settings.chunk_size
        reuse = reuse or {}
        base_m = base_manifest if base_manifest is not None or not base_id else store.manifest(base_id)
        # Chunks pair with the base's by position only when both were cut the same way.
        paired = pair_tensors(base_m if base_m is not None and base_m.chunk_size == cs else None)
        # One flat task list over every file, so the pool stays busy across file boundaries.
        tasks: list[PutTask] = []
        spans: list[tuple[int, int]] = []  # per file, then per tensor: its range of tasks
        for f in src.files:
            start = len(tasks)
            if f.kind == "safetensors":
                tasks += put_tasks(MemBytes(memoryview(f.head)).read, 0, len(f.head), cs, 1)
            else:
                assert f.src is not None
                tasks += put_tasks(f.src.read, 0, f.size, cs, 1)
            spans.append((start, len(tasks)))
            for t in f.tensors:
                start = len(tasks)
                if t.src is not None:
                    size = itemsize(t.dtype)
                    match = paired.get((t.name, t.dtype, t.nbytes))
                    tasks += put_tasks(t.src.read, t.offset, t.nbytes, cs, size if size in (1, 2, 4, 8) else 1,
                                    match.chunks if match is not None else (), match.chains() if match is not None else ())
                spans.append((start, len(tasks)))
        # A push of its own (push --base, a ref's next version, a snapshot) reads the base's bundles through
        # a pool of its own, as a merge's push does through the merge's: its small delta bases cost a
        # request or two, not a GET each (100 small tensors: 100 GETs, one after another).
        has = base_m is not None and bool(base_m.bundles)
        own = ReadPool() if has and pool is None and store.objects.backend.streams else None
        reads = pool if pool is not None else own
        with reporting(progress, "push", sum(t.length for t in tasks)) as p, own if own is not None else nullcontext():
            bundled = BundleBases(store.objects, base_m, settings, reads) if has and reads is not None else None  # type: ignore[arg-type]
            # Chunks the base holds are named with the chains its manifest records, not a header read each.
            results = put_chunks(store.objects, tasks, settings, p, bundled, keep_bases, Recorded.of(store.objects, base_id, base_m))
        if bundles is None:
            bundles = store.objects.backend.streams
        bundle, bundle_tasks, bundled = bundle_small(store, small_chunks(settings, tasks, results),
                                                     sum(t.length for t in tasks)) if bundles else ((), [], [])
        src.check_unchanged()  # every byte is read: from one version of each file, or no checkpoint
        # On a store that cannot touch, a chunk found present may vanish (a gc) before the commit's
        # lease: the source stays open until then, to write such chunks again (storage/commit.py);
        # not a leased file, whose writer would wait as long as the commit does (for a gc, say).
        held = not (store.objects.backend.touches or src.holds_writers)
        if not held:
            src.close()  # and let go of the files: a writer waiting on a leased .pt goes on (sources.py)

        fields: dict[str, Any] = dict(source=src.kind, chunk_size=cs, created=time.time(), message=message, metadata=dict(metadata or {}),
                      extra=src.extra,
                      # a pushed .pt's values and structure (docs/format.md)
                      extra_tagged=src.kind == "state-dict" and (uses_tags(src.extra) or STRUCTURE in src.extra),
                      lineage=lineage or {"parent": None, "base": base_id, "merge": None}, bundles=bundle)
        results = results + bundled
        try:
            mid, manifest, results = _commit(store, src if held else None, lambda rs: _manifest(src, spans, rs, reuse, fields),
                                             tasks + bundle_tasks, results, name, aliases)
        finally:
            src.close()
        return PushResult(
            id=mid,
            chunks=len(results),
            new_chunks=sum(1 for r in results if r.stored),
            logical_bytes=manifest.logical_bytes,
            written_bytes=sum(r.stored for r in results),
            manifest=manifest,
        )
