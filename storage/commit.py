"""The write order that makes a crash harmless: chunks, then manifest, then ref.

The caller has written the chunks. :func:`commit` checks that every chunk the
manifest names is present (found by the same rule gc uses), writes the
manifest, and only then moves the ref. A crash before the ref lands leaves only
unreferenced objects, which ``gc`` removes after its grace period.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from ckpt_store.storage.chunk_lists import referenced_chunks
from ckpt_store.storage.errors import ChunksVanishedError
from ckpt_store.storage.leases import check_fresh, writer_lease
from ckpt_store.storage.objects import ObjectStore, object_id
from ckpt_store.storage.refs import RefEntry, Refs, validate_ref_name

log = logging.getLogger(__name__)


def _refresh(objects: ObjectStore, cid: str) -> bool:
    # A gc deleting a chunk that was touched concurrently renames it away and back
    # (LocalBackend.delete_if_stale): look again across that short window.
    for delay in (0.0, 0.01, 0.05, 0.2):
        if delay:
            time.sleep(delay)
        if objects.refresh("chunks", cid):
            return True
    return False


def missing_chunks(objects: ObjectStore, ids: Iterable[str]) -> list[str]:
    """The chunks of ``ids`` not in the store, the others touched (where the backend can): a
    concurrent gc sees every chunk about to be named as young from here until the ref lands
    (docs/format.md). What a push's commit and a copy check before their refs move."""
    needed = sorted(set(ids))
    if objects.backend.touches:
        return [cid for cid in needed if not _refresh(objects, cid)]
    present = objects.has_many("chunks", needed)  # batched: one listing per directory on S3
    return [cid for cid in needed if cid not in present]


def commit(objects: ObjectStore, refs: Refs, manifest: bytes, name: str | None,
           aliases: Sequence[str] = (), restore: Callable[[list[str]], None] | None = None) -> tuple[str, RefEntry | None]:
    """Publish ``manifest`` and point ``name`` at it, after the ``aliases`` (refs like
    ``RUN/latest``, moved first). Returns (manifest id, new ref entry of ``name``).

    Every ref moves while the writer's lease is held: on a store that cannot touch objects,
    a ref moved after it is dropped could name chunks a concurrent gc has just deleted.

    ``restore``: called under the lease with the chunks found missing, to write again those
    it can (each decodable on its own: the manifest is already fixed). On a store that
    cannot touch, a push that found a chunk present long before its lease (a chunk of a
    removed ref, say) may see a gc delete it meanwhile; written again under the lease, no
    gc deletes it (a gc that started earlier is done, one that starts later reads the
    lease). What is still missing then raises :class:`ChunksVanishedError`.
    """
    for n in (*aliases, *([name] if name is not None else [])):
        validate_ref_name(n)
    chunks = referenced_chunks(manifest)
    mid = object_id(manifest)
    with writer_lease(objects, chunks, [mid]) as lease:  # a gc elsewhere keeps off them
        missing = missing_chunks(objects, chunks)
        if missing and restore is not None:
            log.info("%d chunks vanished while pushing (a concurrent gc?): writing them again", len(missing))
            restore(missing)
            missing = missing_chunks(objects, missing)
        if missing:
            raise ChunksVanishedError(missing)
        objects.backend.flush()  # the chunks' names are durable before a manifest names them
        objects.put("manifests", mid, manifest)  # (put_manifest would hash it again)
        objects.backend.flush()
        if refs.index is not None:
            refs.index.note(mid, manifest)  # the ref's index record carries its summary (storage/index.py)
        check_fresh(lease, "push")
        for alias in aliases:
            refs.set(alias, mid, alias=True)
        entry = refs.set(name, mid) if name is not None else None
        objects.backend.flush()
    return mid, entry
