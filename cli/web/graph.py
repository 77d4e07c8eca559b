"""The lineage graph of a store: what each checkpoint was made from, and what it costs.

Nodes are checkpoints named by live refs (several refs naming one checkpoint make one
node), the earlier versions they were derived from, and training runs (every
``RUN/step-N`` snapshot of a run is one node). Edges come from each manifest's lineage:
``delta`` (the checkpoint it is stored as a delta of), ``parent`` (the ref's previous
version, when that is not the delta base), ``input`` and ``merge-base`` (a merge's inputs
and base, with its method). A run is joined to the checkpoint it shares the most chunks
with (``start``: a run that began from a stored model keeps that model's unchanged chunks).
An edge's ``cost_bytes`` is what the child adds to the store beside its parent: the stored
bytes of its chunks the parent does not have.

:func:`layout` places the nodes in columns by depth (a node sits right of everything it
was made from); a column taller than ``rows`` nodes wraps into several, so a base with
150 fine-tunes stays a block of readable boxes instead of a line 9,000 pixels long.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from ckpt.errors import CkptError
from ckpt.format.manifest import lineage_fields
from ckpt.snapshot.steps import step_ref
from ckpt.store.catalog import IndexOnce, own_chunks
from ckpt_store.cli.web.data import HISTORY_PAGE, StoreView, stored_bytes

RUN_PREFIX = "run:"
MAX_NODES = 2000  # checkpoints drawn at most; the rest are left out ("truncated")


def _add_edge(edges: dict[tuple[str, str], dict[str, Any]], src: str, dst: str, kind: str, **extra: Any) -> None:
    e = edges.setdefault((src, dst), {"source": src, "target": dst, "kinds": [], "cost_bytes": None, "method": None})
    if kind not in e["kinds"]:
        e["kinds"].append(kind)
    for k, v in extra.items():
        if v is not None:
            e[k] = v


def lineage(view: StoreView, max_nodes: int | None = None) -> dict[str, Any]:
    """``{"nodes": [...], "edges": [...], "truncated": bool}`` for the whole store (see the module doc).

    At most ``max_nodes`` nodes (default :data:`MAX_NODES`), checkpoints first, then runs by name; every edge
    joins two nodes of the document.
    """
    max_nodes = MAX_NODES if max_nodes is None else max_nodes
    sizes = view.chunk_sizes()
    refs = view.refs()
    # The store's manifests, listed for this document (one request per 1,000 on S3): a manifest the view has cached
    # that the listing lacks is read from the store again (deleted since: left out, as a fresh view leaves it out; a
    # warm view drew it whole until a page read it). Re-reading every node's instead cost 0.65-0.9 s a build for 200
    # nodes on a loopback S3 server (the listing: 0.03 s); a manifest damaged in place is found by a page reading it.
    listed = view.manifest_ids()

    def read(mid: str) -> Any:
        return view.manifest(mid, check=mid not in listed)

    runs: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    by_id: dict[str, list[str]] = defaultdict(list)
    aliases: set[str] = set()
    # Which RUN/step-N are snapshots, and their chunks, from their overviews (the metadata index): a run's
    # thousands of snapshots are not read one manifest each (1,500: 3-11 s); the other refs' manifests are. A
    # snapshot is drawn where the index summarizes it, unless the view found its manifest damaged (data.py's rule).
    steps = {name: step for name, entry in refs.items() if (step := step_ref(name))}
    # (whether each is a snapshot only: their chunk sets are the view's cache's, bounded, not pinned here); one load
    # of the index for the page, however many steps are asked again past the cache (_run_chunks)
    index = IndexOnce()
    snapshots = {mid for mid, o in view.overviews((refs[name].target for name in steps), index=index).items() if o.snapshot}
    for name, entry in refs.items():
        step = steps.get(name)
        if step and entry.target in snapshots:
            runs[step[0]].append((step[1], name, entry.target))
            continue
        try:
            read(entry.target)
        except CkptError:  # damaged: left out here, named by the overview (as `ckpt ls` names it)
            continue
        if entry.alias and name.endswith("/latest"):
            aliases.add(name)  # RUN/latest: shown as its run
        else:
            by_id[entry.target].append(name)
    # a RUN/latest alias of a run whose snapshots are all gone still names a checkpoint
    for name in aliases:
        if name[: -len("/latest")] not in runs:
            by_id[refs[name].target].append(name)

    manifests = {mid: view.manifest(mid) for mid in by_id}
    # earlier versions and bases that no live ref names any more, followed back to the roots
    todo = deque(manifests)
    while todo and len(manifests) < max_nodes:
        m = manifests[todo.popleft()]
        for mid in _sources(m):
            if mid not in manifests:
                try:
                    manifests[mid] = read(mid)
                except CkptError:  # collected by gc: the lineage names it, the store lacks it
                    continue
                todo.append(mid)
    truncated = len(manifests) + len(runs) > max_nodes
    # Refs alone may name more than max_nodes checkpoints: those beyond are left out, and so
    # are the edges from them (a page draws an edge between two boxes it has).
    manifests = dict(list(manifests.items())[:max_nodes])

    chunks = {mid: own_chunks(m) for mid, m in manifests.items()}
    nodes: list[dict[str, Any]] = []
    edges: dict[tuple[str, str], dict[str, Any]] = {}
    for mid, m in manifests.items():
        names = sorted(by_id.get(mid, []))
        lin = lineage_fields(m.lineage)
        merge = lin["merge"]
        base = lin["base"] if lin["base"] in manifests else None
        parent = lin["parent"] if lin["parent"] in manifests else None
        if merge is not None:
            kind = "remix" if isinstance(merge.get("remix"), dict) else "merge"
        elif not names:
            kind = "earlier"
        else:
            kind = "derived" if base or parent else "root"
        cost = stored_bytes(chunks[mid] - chunks[base], sizes) if base else stored_bytes(chunks[mid], sizes)
        nodes.append({"id": mid, "kind": kind, "refs": names, "label": names[0] if names else mid[:12],
                      "message": m.message, "created": m.created, "logical_bytes": m.logical_bytes,
                      "stored_bytes": stored_bytes(chunks[mid], sizes), "cost_bytes": cost,
                      "method": merge.get("method") if merge else None, "tensors": len(m.tensors),
                      "url": "/checkpoint/" + (names[0] if names else mid)})
        if base:
            _add_edge(edges, base, mid, "delta", cost_bytes=cost)
        if parent and parent != base:
            _add_edge(edges, parent, mid, "parent")
        if merge is not None:
            for inp in merge.get("inputs") or []:
                if inp in manifests:
                    _add_edge(edges, inp, mid, "input", method=merge.get("method"))
            if merge.get("base") in manifests:
                _add_edge(edges, merge["base"], mid, "merge-base", method=merge.get("method"))

    # Runs fill the nodes left: uncounted, a store of 5,000 runs drew 5,000 run nodes past the limit, each run
    # compared with every checkpoint drawn for the one it began from.
    for run, snaps in sorted(runs.items())[: max(0, max_nodes - len(manifests))]:
        snaps.sort()
        latest = None
        while snaps and latest is None:  # the newest snapshot whose manifest reads (read: one damaged is left out)
            try:
                latest = read(snaps[-1][2])
            except CkptError:
                snaps.pop()
        if latest is None:
            continue
        run_chunks = _run_chunks(view, [mid for _, _, mid in snaps], index)
        rid = RUN_PREFIX + run
        start, shared = None, 0
        for mid, c in chunks.items():  # the stored model the run began from, if it kept any of its chunks
            n = len(c & run_chunks)
            if n > shared:
                start, shared = mid, n
        stored = stored_bytes(run_chunks, sizes)
        cost = stored_bytes(run_chunks - chunks[start], sizes) if start else stored
        nodes.append({"id": rid, "kind": "run", "refs": [f"{run}/latest"] if f"{run}/latest" in refs else [],
                      "label": run, "message": None, "created": latest.created, "logical_bytes": latest.logical_bytes,
                      "stored_bytes": stored, "cost_bytes": cost, "method": None, "tensors": len(latest.tensors),
                      "url": "/run/" + run,
                      # unverified: drawn from the index's summary, its manifest not read by the view (data.py's rule)
                      "snapshots": [{"step": s, "ref": name, "id": mid, "url": "/checkpoint/" + name, "verified": view.verified(mid) and mid in listed}
                                    for s, name, mid in snaps]})
        if start:
            _add_edge(edges, start, rid, "start", cost_bytes=cost, shared_chunks=shared)
    return {"nodes": nodes, "edges": list(edges.values()), "truncated": truncated}


def _run_chunks(view: StoreView, mids: list[str], index: IndexOnce) -> set[str]:
    """The union of snapshots ``mids``' own chunks, built a page of steps at a time (:data:`HISTORY_PAGE`): a run's
    1,500 sets held at once were as many copies of the chunk ids its steps share (a frozen layer's, the optimizer
    steps'), past the view's cache bound. Cached overviews are reused; evicted ones are read by the view's rule
    (the page's one load of the index, ``index``, or a few manifests); one that no longer reads adds nothing."""
    union: set[str] = set()
    for at in range(0, len(mids), HISTORY_PAGE):
        for o in view.overviews(mids[at:at + HISTORY_PAGE], index=index).values():
            union |= o.own
    return union


def _sources(m: Any) -> list[str]:
    lin = lineage_fields(m.lineage)
    out = [lin["base"], lin["parent"]]
    if lin["merge"] is not None:
        out += lin["merge"]["inputs"] + [lin["merge"]["base"]]
    return [x for x in out if isinstance(x, str)]


# -- layout ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    x: float
    y: float
    w: float
    h: float


NODE_W, NODE_H = 210, 40
COL_GAP, ROW_GAP = 90, 14


def layout(nodes: list[dict[str, Any]], edges: list[dict[str, Any]], rows: int = 18) -> tuple[dict[str, Box], float, float]:
    """Boxes for ``nodes`` (by id) and the drawing's width and height.

    Depth = the longest path from a root; within a depth, nodes are ordered by the mean
    position of what they were made from (so fine-tunes sit near their base), then by
    time; at most ``rows`` nodes per column.
    """
    ids = [n["id"] for n in nodes]
    created = {n["id"]: n.get("created") or 0 for n in nodes}
    preds: dict[str, list[str]] = defaultdict(list)
    succs: dict[str, list[str]] = defaultdict(list)
    for e in edges:
        if e["source"] in created and e["target"] in created:
            preds[e["target"]].append(e["source"])
            succs[e["source"]].append(e["target"])
    # Kahn's order gives the longest-path depth; lineage is acyclic (an id hashes its parents' ids)
    indeg = {i: len(preds[i]) for i in ids}
    depth = dict.fromkeys(ids, 0)
    queue = deque(sorted((i for i in ids if indeg[i] == 0), key=lambda i: created[i]))
    seen = 0
    while queue:
        i = queue.popleft()
        seen += 1
        for j in succs[i]:
            depth[j] = max(depth[j], depth[i] + 1)
            indeg[j] -= 1
            if indeg[j] == 0:
                queue.append(j)
    by_depth: dict[int, list[str]] = defaultdict(list)
    for i in ids:
        by_depth[depth[i]].append(i)
    pos: dict[str, float] = {}
    boxes: dict[str, Box] = {}
    x = 20.0
    height = 0.0
    for d in sorted(by_depth):
        col = sorted(by_depth[d], key=lambda i: (sum(pos.get(p, 0) for p in preds[i]) / max(1, len(preds[i])), created[i], i))
        for k, i in enumerate(col):
            pos[i] = k
            c, r = divmod(k, rows)
            boxes[i] = Box(x + c * (NODE_W + COL_GAP / 2), 20 + r * (NODE_H + ROW_GAP), NODE_W, NODE_H)
            height = max(height, boxes[i].y + NODE_H + 20)
        x += -(-len(col) // rows) * (NODE_W + COL_GAP / 2) + COL_GAP / 2
    return boxes, x, max(height, 80.0)
