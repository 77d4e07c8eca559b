"""The documents the faces report: one builder each, shared by the command line
(``--json`` and the text views) and the web view (``/api/...``), so both say the same.

Each takes what it needs already read (manifests through a getter, so that the web view
can serve them from its cache); none reads a store itself.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ckpt.errors import CkptError, ObjectNotFoundError

if TYPE_CHECKING:
    from ckpt.format.entries import TensorEntry
    from ckpt.format.manifest import Manifest

# "bytes" is the old spelling of logical_bytes, kept in ls, show and gc for scripts (README).


def ls_rows(listing: Any) -> list[dict[str, Any]]:
    """The rows of ``ckpt ls --json`` from a :class:`~ckpt.store.maintenance.RefListing`,
    by name: one per live ref, and ``{"ref", "error"}`` for a ref that cannot be read."""
    rows = [{"ref": r.name, "id": r.id, "time": r.time, "logical_bytes": r.logical_bytes, "bytes": r.logical_bytes,
             "tensors": r.tensors, "message": r.message, "source": r.source} for r in listing.refs]
    rows += [{"ref": name, "error": why} for name, why in listing.damaged.items()]
    return sorted(rows, key=lambda r: r["ref"])


def log_rows(entries: Iterable[Any], manifest: Callable[[str], Manifest],
             damaged: Mapping[int, str] | None = None, offset: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of ``ckpt log NAME --json``, newest first; ``version`` N is what ``NAME@N`` names.
    ``offset``, ``limit``: only rows ``offset .. offset+limit`` (the rows of the whole log there, their
    versions counted over every newer entry), reading the manifests of those alone.

    A row with ``"error"`` is damage: an entry that cannot be read (``damaged``: its seq -> the
    error; its other fields null), or a checkpoint that cannot be read (the current one of a live
    ref also when missing: only an earlier one can have been freed by ``ckpt gc``). Versions
    older than a damaged entry have ``version`` null: whether that entry was a removal is unknown.
    """
    bad = dict(damaged or {})
    merged: list[tuple[int, Any]] = sorted([(e.seq, e) for e in entries] + [(s, None) for s in bad],
                                           key=lambda x: x[0], reverse=True)
    live = bool(merged) and merged[0][1] is not None and merged[0][1].target is not None
    rows: list[dict[str, Any]] = []
    version: int | None = 0
    end = len(merged) if limit is None else offset + limit
    for i, (seq, e) in enumerate(merged[:end]):
        if e is None:
            if i >= offset:
                rows.append({"seq": seq, "version": None, "id": None, "time": None, "message": None, "removed": None,
                             "error": bad[seq]})
            version = None
            continue
        if i >= offset:  # (before the window only the version counts: the rows in it need theirs)
            msg, error = None, None
            if e.target is not None:
                try:
                    msg = manifest(e.target).message
                except ObjectNotFoundError as err:
                    if live and version == 0:
                        error = str(err)
                    else:  # a collected manifest still has a history line
                        msg = "(no longer in the store: freed by `ckpt gc`)"
                except CkptError as err:
                    error = str(err)
                if error is not None:
                    msg = "(damaged: `ckpt verify` names it; `ckpt verify --repair-from URL` puts it back from a store holding it)"
            row = {"seq": e.seq, "version": None if e.target is None else version, "id": e.target,
                   "time": e.time, "message": msg, "removed": e.target is None}
            if error is not None:
                row["error"] = error
            rows.append(row)
        if e.target is not None and version is not None:
            version += 1
    return rows


def show_doc(mid: str, m: Manifest, sizes: Mapping[str, int]) -> dict[str, Any]:
    """The document of ``ckpt show REF --json``. ``sizes``: stored bytes of the chunks the
    checkpoint reads (its own and their delta bases); chunks absent from it are missing."""
    from ckpt.codecs.ids import CODEC_NAMES
    from ckpt.dcp.format import DCP_SOURCE, decode_layout

    needed = m.chunk_lengths()

    def row(name: str, dtype: str, shape: Iterable[int], nbytes: int, parts: list[TensorEntry]) -> dict[str, Any]:
        return {"name": name, "dtype": dtype, "shape": list(shape), "logical_bytes": nbytes, "bytes": nbytes,
                "file": parts[0].file if parts else None, "stored_bytes": sum(sizes.get(c, 0) for t in parts for c in t.chunks),
                "chunks": sum(len(t.chunks) for t in parts),
                "codecs": sorted({CODEC_NAMES.get(c, str(c)) for t in parts for c in t.codecs}),
                "delta_depth": max((len(c) for t in parts for c in t.delta_bases), default=0)}

    if m.source == DCP_SOURCE:  # a distributed checkpoint: its tensors whole, each over the shards the ranks saved
        entries = {t.name: t for t in m.tensors}
        tensors = [{**row(i.fqn, i.dtype, i.size, i.nbytes, [entries[s.entry] for s in i.shards if s.entry in entries]),
                    "shards": len(i.shards)} for i in decode_layout(m.extra, f"checkpoint {mid[:12]}").tensors.values()]
    else:
        tensors = [row(t.name, t.dtype, t.shape, t.nbytes, [t]) for t in m.tensors]
    files = [{"path": f.path, "kind": f.kind, "logical_bytes": f.size, "bytes": f.size,
              "stored_bytes": sum(sizes.get(c, 0) for c in f.chunks), "metadata": f.metadata} for f in m.files]
    return {"id": mid, "source": m.source, "created": m.created, "message": m.message, "metadata": m.metadata,
            "lineage": m.lineage, "extra": m.extra, "chunk_size": m.chunk_size, "files": files, "tensors": tensors,
            "logical_bytes": m.logical_bytes, "bytes": m.logical_bytes,
            "stored_bytes": sum(sizes[c] for c in needed if c in sizes),
            "missing_chunks": sum(1 for c in needed if c not in sizes)}


def du_doc(u: Any) -> dict[str, Any]:
    """The document of ``ckpt du --json`` from a :class:`~ckpt.store.maintenance.StoreUsage`."""
    return {
        "refs": [{"ref": r.name, "id": r.id, "logical_bytes": r.logical, "unique_bytes": r.unique,
                  "stored_bytes": r.stored, "exclusive_bytes": r.exclusive} for r in u.refs],
        "logical_bytes": u.logical, "unique_bytes": u.unique, "stored_bytes": u.stored,
        "dedup_saved_bytes": u.dedup_saved, "compression_saved_bytes": u.compression_saved, "chunks": u.objects,
        "codecs": {k: {"decoded_bytes": d, "stored_bytes": st} for k, (d, st) in u.by_codec.items()},
        "damaged": u.damaged,
    }


_LONE = re.compile("[\ud800-\udfff]")  # in a str from Python: a surrogate that pairs with nothing


def _name_bytes(text: str) -> bytes:
    """The bytes a string that is not valid Unicode stands for: UTF-8, with each U+DC80..U+DCFF (a
    byte that was not UTF-8, as Python decodes file names and arguments) as that byte, and any other
    lone surrogate (a \\udXXX escape in a file's JSON header) in its three-byte form."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return b"".join(c.encode("utf-8", "surrogateescape" if 0xDC80 <= ord(c) <= 0xDCFF else "surrogatepass")
                        for c in text)


def strict_json(doc: Any) -> Any:
    r"""``doc`` (a ``--json`` or ``/api/`` document) with every string valid Unicode, as strict JSON
    parsers (jq, Go, serde) require: in a name that is not (a file, tensor or folder name from a
    hostile file, a path given in bytes that are not UTF-8) each lone surrogate becomes U+FFFD, and,
    as an object's member ``KEY``, the exact bytes go beside it as ``KEY_b64`` (base64). Object keys
    and array items keep only the replaced text (README, "--json").

    >>> strict_json({"name": "w\udcff"}) == {"name": "w\ufffd", "name_b64": "d/8="}
    True
    """
    if isinstance(doc, str):
        return _LONE.sub("\ufffd", doc)
    if isinstance(doc, (list, tuple)):
        return [strict_json(x) for x in doc]
    if not isinstance(doc, dict):
        return doc
    out: dict[Any, Any] = {}
    for key, value in doc.items():
        key = strict_json(key)
        out[key] = strict_json(value)
        if isinstance(value, str) and _LONE.search(value) and f"{key}_b64" not in doc:
            out[f"{key}_b64"] = base64.b64encode(_name_bytes(value)).decode("ascii")
    return out
