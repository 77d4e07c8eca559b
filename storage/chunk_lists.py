"""Which parts of a manifest name chunks: the format's one rule (docs/format.md).

A manifest names chunks only inside the entries of its ``files``, ``tensors`` and
``bundles`` sections (the last: copies of small chunks for remote readers; optional),
under the keys ``chunks`` (the chunk of each piece, in order) and ``delta_bases`` (for
each chunk, the chain of bases it is a delta against, nearest first). Everything else in a
manifest is user JSON (metadata, non-tensor state, lineage) and may hold a key named
``chunks`` without naming any chunk.

gc (what is live), commit (what must be present before a manifest lands), copy (what
a checkpoint depends on, bases first) and the DCP format (which keys user state may
not use) all read the rule from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckpt_store.storage.errors import InvalidNameError, LaterFormatError, StoreFormatError
from ckpt_store.storage.objects import check_id
from ckpt_store.storage.records import strict_loads

# The manifest format and the versions whose chunks are named as below (ckpt/format/manifest.py writes them; a test
# holds the two lists equal). A manifest of another version may name chunks elsewhere: a reader never guesses them
# (gc would delete what it needs), it refuses the manifest, as the manifest's own reader does.
MANIFEST_FORMAT = "ckpt-manifest"
MANIFEST_VERSIONS = (1, 2, 3, 4, 5, 6)
# Keys in a manifest entry whose values are lists of chunk ids (or lists of them).
CHUNK_LIST_KEYS = frozenset({"chunks", "delta_bases"})
# The top-level lists of a manifest whose entries hold those keys.
ENTRY_SECTIONS = ("files", "tensors", "bundles")


def parse_manifest(manifest: bytes) -> dict[str, Any]:
    """A manifest's JSON object, or :class:`StoreFormatError` saying why it is not one."""
    try:
        obj = strict_loads(manifest)
    except (ValueError, RecursionError) as e:
        raise StoreFormatError(f"manifest is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise StoreFormatError("manifest is not a JSON object")
    return obj


def chunk_nodes(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every object inside the entry sections that may hold chunk lists, outermost first."""
    stack: list[Any] = [obj.get(section, []) for section in reversed(ENTRY_SECTIONS)]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(v for k, v in reversed(node.items()) if k not in CHUNK_LIST_KEYS)
        elif isinstance(node, list):
            stack.extend(reversed(node))


def referenced_chunks(manifest: bytes, what: str = "manifest") -> set[str]:
    """Every chunk id a manifest (``what``, in an error) names (its chunks and every base of their delta chains)."""
    out: set[str] = set()

    def collect(ids: list[Any]) -> None:  # ids, or lists of ids (delta chains)
        for x in ids:
            if isinstance(x, list):
                collect(x)
            elif x is not None:
                try:
                    out.add(check_id(x))
                except InvalidNameError as e:  # (what the manifest names: damage of it, not a name a user typed)
                    raise StoreFormatError(f"{what}: {e.message}") from None

    obj = parse_manifest(manifest)
    if obj.get("format") != MANIFEST_FORMAT:
        raise StoreFormatError(f"{what} is not a {MANIFEST_FORMAT} record (format={obj.get('format')!r:.40})")
    if type(obj.get("version")) is not int or obj["version"] not in MANIFEST_VERSIONS:  # (true is no version: not 1)
        raise LaterFormatError(f"{what} has {MANIFEST_FORMAT} version {obj.get('version')!r:.40}; this ckpt reads versions "
                               f"{', '.join(map(str, MANIFEST_VERSIONS))}")
    for node in chunk_nodes(obj):
        for k in CHUNK_LIST_KEYS:
            if isinstance(node.get(k), list):
                collect(node[k])
    return out


def recorded_chains(manifest: bytes) -> dict[str, frozenset[str]]:
    """For each chunk a manifest names, the chunks its records say decoding it needs: the union of
    the chains recorded beside it (``delta_bases[i]`` of ``chunks[i]``), and for a base the rest of
    each chain it lies in. A blob at a store whose chain is within this set is one the record stands
    for: gc keeps its bases as long as the manifest lives, and so does one copying the record (a push
    naming the chunk as its base's manifest records it)."""
    out: dict[str, set[str]] = {}
    for node in chunk_nodes(parse_manifest(manifest)):
        chunks, chains = node.get("chunks"), node.get("delta_bases")
        if not isinstance(chunks, list):
            continue
        paired = chains if isinstance(chains, list) and len(chains) == len(chunks) else [[] for _ in chunks]
        for cid, chain in zip(chunks, paired):
            if not isinstance(cid, str):
                continue
            ids = [x for x in (chain if isinstance(chain, list) else []) if isinstance(x, str)]
            out.setdefault(cid, set()).update(ids)
            for i, x in enumerate(ids):
                out.setdefault(x, set()).update(ids[i + 1:])
    return {c: frozenset(v) for c, v in out.items()}


def chunk_depths(manifest: bytes) -> dict[str, int]:
    """How many delta bases lie below each chunk a manifest names (0: stored whole).

    ``delta_bases[i]`` is the chain of ``chunks[i]`` in the same entry, nearest base
    first. Chunks without a chain get 0.
    """
    depth: dict[str, int] = {}
    for node in chunk_nodes(parse_manifest(manifest)):
        chunks, chains = node.get("chunks"), node.get("delta_bases")
        if isinstance(chunks, list) and isinstance(chains, list) and len(chains) == len(chunks):
            for cid, chain in zip(chunks, chains):
                if isinstance(cid, str) and isinstance(chain, list):
                    ids = [cid, *chain]
                    for i, x in enumerate(ids):
                        if isinstance(x, str):
                            depth[x] = max(depth.get(x, 0), len(ids) - 1 - i)
    return depth


__all__ = ["CHUNK_LIST_KEYS", "ENTRY_SECTIONS", "chunk_depths", "chunk_nodes", "parse_manifest", "recorded_chains", "referenced_chunks"]
