"""Garbage collection as a plan, then an execution (a dry run prints the plan).

Live objects: every manifest a live ref points at (with ``keep_history``, also
every earlier target of a live ref) and every chunk such a manifest names.
Anything else is deleted only if it is older than the grace period: a push in
progress writes its chunks first and touches the chunks it reuses, so its
objects are young until its ref lands (docs/format.md, "Garbage collection").
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt_store.storage.errors import StoreFormatError
from ckpt_store.storage.objects import ObjectStore, check_id
from ckpt_store.storage.refs import Refs

if TYPE_CHECKING:
    from ckpt_store.storage.index import StoreIndex

# Keys in a manifest whose values are lists of chunk ids (docs/format.md).
CHUNK_LIST_KEYS = frozenset({"chunks", "delta_bases"})
# The top-level lists of a manifest whose entries hold those keys.
ENTRY_SECTIONS = ("files", "tensors")


def referenced_chunks(manifest: bytes) -> set[str]:
    """Every chunk id a manifest names, found by the format's one rule, without knowing tensors."""
    out: set[str] = set()

    def collect(ids: list[Any]) -> None:  # ids, or lists of ids (delta chains)
        for x in ids:
            if isinstance(x, list):
                collect(x)
            elif x is not None:
                out.add(check_id(x))

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in CHUNK_LIST_KEYS and isinstance(v, list):
                    collect(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    try:
        obj = json.loads(manifest)
    except (ValueError, RecursionError) as e:
        raise StoreFormatError(f"manifest is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise StoreFormatError("manifest is not a JSON object")
    # Only the entries of "files" and "tensors": user JSON (metadata, non-tensor state,
    # lineage) may hold a key named "chunks" without naming any chunk.
    for section in ENTRY_SECTIONS:
        walk(obj.get(section, []))
    return out


@dataclass(frozen=True)
class Doomed:
    kind: str  # "chunks", "manifests" or "temp"
    name: str  # object id, or path for temporaries
    size: int


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


def plan_gc(objects: ObjectStore, refs: Refs, *, grace_s: float, keep_history: bool = True, recover: bool = True,
            index: StoreIndex | None = None) -> GcPlan:
    """What ``gc`` would delete now. Reads refs and manifests; deletes nothing.

    Roots are the targets of live refs and, with ``keep_history``, their earlier
    targets back to the ref's last removal (a name removed and pushed again does not
    revive what it held before).

    Objects are listed *before* refs are read, so an object written after the
    listing is not in the plan at all, and one listed before a concurrent ref
    update is protected by its age (see module docstring). The age limit is fixed
    at the listing: however long the plan and its execution take, nothing modified
    within ``grace_s`` before the listing is deleted.
    """
    # Objects a killed gc left condemned go back first (not in a dry run, which writes nothing).
    recovered = objects.backend.recover_condemned("objects") if recover else 0
    now = time.time()
    cutoff = now - grace_s
    listed = {k: list(objects.list(k)) for k in ("manifests", "chunks")}
    temps = list(objects.list_temporaries(("objects", "refs")))

    view = index.view(exact=True, history=True, chunks=True) if index is not None else None
    roots: set[str] = set()
    for entries in (view.entries() if view is not None else refs.all_entries()).values():
        if entries[0].target is None:
            continue  # removed ref: its history keeps nothing alive
        for e in entries if keep_history and not entries[0].alias else entries[:1]:
            if e.target is None:
                break  # a removal: what the ref held before it is history of a removed ref
            roots.add(e.target)

    live_chunks: set[str] = set()
    if index is not None and view is not None:
        listed_m = {i.id for i in listed["manifests"]}
        for mid in sorted(roots - listed_m):  # written since the listing, or missing: see that it is there
            objects.get_manifest(mid)
        index.ensure(view, roots, chunks=True)  # a live manifest the index lacks is read (and must be readable)
        assert view.chunks is not None
        for mid in roots:
            live_chunks.update(view.chunks[mid][0])
        if recover:  # not in a dry run, which writes nothing
            index.heal(view)
    for mid in roots if index is None else ():
        # A live manifest that cannot be read stops the plan: nothing is deleted.
        live_chunks |= referenced_chunks(objects.get_manifest(mid))

    plan = GcPlan(live_manifests=len(roots), live_chunks=len(live_chunks), cutoff=cutoff, recovered=recovered)
    for kind, live in (("manifests", roots), ("chunks", live_chunks)):
        for info in listed[kind]:
            if info.id in live:
                continue
            if info.mtime >= cutoff:
                plan.young += 1
            else:
                plan.delete.append(Doomed(kind, info.id, info.size))
    for path, mtime in temps:
        if mtime < cutoff:
            plan.delete.append(Doomed("temp", path, 0))
    return plan


def execute_gc(objects: ObjectStore, plan: GcPlan, *, grace_s: float | None = None) -> Iterator[Doomed]:
    """Delete what ``plan`` names, unless an object was touched since the plan's cutoff.

    Yields each object actually deleted. An object reused by a concurrent push
    (touched, so modified after ``plan.cutoff``) is kept; on a local store the
    check and the delete cannot miss a touch landing between them
    (``Backend.delete_if_stale``). ``grace_s`` is accepted for compatibility; the
    plan's cutoff rules.
    """
    backend = objects.backend
    for d in plan.delete:
        path = d.name if d.kind == "temp" else objects.path(d.kind, d.name)
        if backend.delete_if_stale(path, plan.cutoff):
            yield d
