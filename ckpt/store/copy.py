"""Copying checkpoints between stores (local <-> S3, S3 <-> S3, local <-> local).

The byte moving is ``storage/copy.py``; this module adds what needs the codecs: each
chunk is decoded and re-hashed before it is written at the destination.

>>> import torch, ckpt
>>> a = ckpt.Store.init("memory://transfer-doctest-a")
>>> b = ckpt.Store.init("memory://transfer-doctest-b")
>>> cid = a.push({"w": torch.ones(4)}, "demo/x")
>>> r = copy_refs(a, b, ["demo/x"])
>>> r.refs == {"demo/x": cid} and r.chunks_sent > 0
True
>>> copy_refs(a, b, ["demo/x"]).objects_sent  # nothing left to send
0
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ckpt.codecs.chunk import MAX_HEADER, RAW, decode_chunk, encode_chunk, parse_header
from ckpt.progress import Progress
from ckpt.store.load import check_headers
from ckpt.transfer.pipeline import fetch_chunk, stored_chain
from ckpt_store.storage import copy as storage_copy
from ckpt_store.storage.backends.base import Data
from ckpt_store.storage.chunk_lists import recorded_chains
from ckpt_store.storage.copy import ChunkCheck, ChunkRecode, ChunkTaken, CopyItem, CopyReport, copy_checkpoints, reading_source
from ckpt_store.storage.errors import CkptError, InvalidNameError, RefNotFoundError, StoreFormatError
from ckpt_store.storage.objects import ObjectStore
from ckpt_store.storage.refs import validate_ref_name

if TYPE_CHECKING:
    from ckpt.store.store import Store

__all__ = ["CopyReport", "chunk_checker", "copy_chunks", "copy_refs", "parse_copy_spec", "raw_recoder"]

_SPEC = re.compile(r"^([^:]+)(?::([^:]+))?\Z")


def parse_copy_spec(spec: str) -> tuple[str, str | None]:
    """``REF`` or ``REF:NAME`` (ref names cannot contain ``:``) -> (source ref, destination name or None)."""
    m = _SPEC.match(spec)
    if not m:
        raise InvalidNameError(f"{spec!r} is not REF or REF:NAME")
    src, dest = m.group(1), m.group(2)
    if dest is not None:
        validate_ref_name(dest)
    return src, dest


def check_copy_specs(src: Store, specs: Iterable[str]) -> None:
    """Raise what :func:`copy_refs` raises for ``specs`` themselves (none, one not ``REF`` or
    ``REF:NAME``, a ref ``src`` lacks): checked before a destination is created, so that a copy
    that cannot start leaves no new store behind."""
    specs = list(specs)
    if not specs:
        raise RefNotFoundError("nothing to copy", hint="name at least one ref")
    for spec in specs:
        ref = parse_copy_spec(spec)[0]
        with reading_source(src.objects):
            src.resolve(ref)


def chunk_checker(src: Store, dst: Store, lengths: dict[str, int] | None = None) -> ChunkCheck:
    """Decode and re-hash a chunk blob before it is written to ``dst``; return its base id.
    ``lengths``: the decoded length of each chunk as the manifests copied give it (a chunk of
    another length would make the checkpoint fail to load at ``dst``).

    A delta needs its base's bytes: read from the destination first when that is a local
    store (it is there already, or was sent in an earlier wave), else from the source.
    """
    settings = dst.settings
    order: list[ObjectStore] = [dst.objects, src.objects] if dst.backend.concurrency == 1 else [src.objects, dst.objects]

    def base_bytes(bid: str, length: int) -> bytes | bytearray | memoryview:
        failed: dict[int, CkptError] = {}
        for objs in order:
            try:
                return fetch_chunk(objs, bid, length, settings)[0]
            except CkptError as e:  # missing or damaged there: try the other store
                failed[id(objs)] = e
        raise failed[id(src.objects)]  # the source's: it must hold what its chunks need

    def check(cid: str, blob: bytes) -> str | None:
        h = parse_header(blob, cid)
        if lengths is not None and lengths.get(cid, h.length) != h.length:
            raise _wrong_length(cid, lengths[cid], h.length)
        base = base_bytes(h.base, h.length) if h.base is not None else None
        decode_chunk(blob, cid, h.length, max_length=settings.max_chunk_size, base=base)
        return h.base

    return check


def _wrong_length(cid: str, claimed: int, held: int) -> StoreFormatError:
    return StoreFormatError(f"a checkpoint to copy gives chunk {cid[:12]} {claimed} bytes, but it holds {held}: its manifest "
                            "is damaged, and would not load at the destination", hint="run `ckpt verify` on the source")


def _check_present(dst: Store, lengths: dict[str, int | None], allowed: dict[str, frozenset[str]]) -> set[str]:
    """The chunks the destination holds that must be sent all the same, as the source stores them
    (each checked on the way, against the manifests' lengths too), replacing the blob there:
    one whose header there (a small read; a request on S3, as a push pays for a chunk it reuses)
    is damaged or gives another length than the manifests copied, and one stored there as a delta
    against a chunk those manifests do not name -- else a gc there, once the checkpoints naming
    that base are removed, deletes what the copied checkpoint cannot be read without."""
    ids = sorted(dst.objects.has_many("chunks", lengths))  # only those there (one listing per directory on S3)

    def look(cid: str) -> str | None:
        return cid if _stored_otherwise(dst, cid, lengths[cid], allowed[cid]) else None

    if dst.backend.concurrency <= 1 or len(ids) <= 1:
        found = [look(c) for c in ids]
    else:
        with ThreadPoolExecutor(min(dst.backend.concurrency, len(ids)), thread_name_prefix="ckpt-copy") as pool:
            found = list(pool.map(look, ids))
    return {c for c in found if c is not None}


def _stored_otherwise(dst: Store, cid: str, length: int | None, allowed: frozenset[str]) -> bool:
    """Whether chunk ``cid`` at the destination must be replaced for checkpoints that keep ``allowed``
    alive there (see :func:`_check_present`); False where it is not there (it is sent, and checked)."""
    try:
        head = dst.backend.read_range(dst.objects.path("chunks", cid), 0, MAX_HEADER)
    except FileNotFoundError:
        return False
    try:
        h = parse_header(head, cid)
        if length is not None and h.length != length:
            return True
        if h.base is None:
            return False
        _, below = stored_chain(dst.objects, h.base)  # the header of cid itself is read already
    except CkptError:  # damaged there, or a base missing or damaged there: send ours
        return True
    return not {h.base, *below} <= allowed


def _taken(dst: Store, lengths: dict[str, int | None], allowed: dict[str, frozenset[str]],
           replacing: set[str]) -> ChunkTaken:
    """What a copy does with a chunk another writer stored at ``dst`` while it was sending it: keeps
    theirs where it serves the copied checkpoints, else replaces it whole (``replacing`` is the set
    :func:`_whole_where_unnamed` writes whole)."""

    def taken(cid: str) -> bool:
        if not _stored_otherwise(dst, cid, lengths.get(cid), allowed.get(cid, frozenset())):
            return False
        replacing.add(cid)
        return True

    return taken


def _whole_where_unnamed(src: Store, dst: Store, allowed: dict[str, frozenset[str]], inner: ChunkRecode | None,
                         replacing: set[str]) -> ChunkRecode:
    """``inner`` (or the blob as it is), except that a delta is written whole where it is against a
    chunk the copied manifests do not name (a gc at the destination would not keep that base: see
    :func:`_check_present`) or replaces a blob there (``replacing``: the checkpoints there naming
    it keep other chunks alive than this delta would need)."""
    settings = dst.settings

    def recode(cid: str, blob: bytes) -> Data:
        h = parse_header(blob, cid)
        if h.base is not None and (cid in replacing or h.base not in allowed.get(cid, frozenset())):
            data, _ = fetch_chunk(src.objects, cid, h.length, src.settings)
            return encode_chunk(data, elem=h.elem, level=settings.zstd_level, min_saving=settings.min_saving).parts
        return blob if inner is None else inner(cid, blob)

    return recode


def raw_recoder(dst: Store) -> ChunkRecode:
    """Store a raw blob (a local tier written raw, say) as ``dst`` would have encoded it on a push
    (without a delta); any other blob as it is. Same chunk id: the id is the hash of the decoded
    bytes, which the blob's check has just verified."""
    settings = dst.settings

    def recode(cid: str, blob: bytes) -> Data:
        h = parse_header(blob, cid)
        if h.codec != RAW:
            return blob
        return encode_chunk(memoryview(blob)[h.size :], elem=h.elem, level=settings.zstd_level,
                            min_saving=settings.min_saving).parts

    return recode


def _items(src: Store, specs: Iterable[str]) -> tuple[list[CopyItem], dict[str, int], dict[str, frozenset[str]]]:
    """The items to copy, the decoded length of every chunk they need, and for each such chunk the
    bases a blob of it may need at the destination: those every manifest naming it records for it
    (``recorded_chains``), in common. Any chunk the manifest names would do for gc while it lives,
    but its record must stand for the blob too: a push into the destination names the chunk with its
    base's record, not a header read (ckpt/transfer/writing.py, ``Recorded``), and gc keeps what
    that push's manifest names."""
    items, weights = [], {}
    allowed: dict[str, frozenset[str]] = {}
    for spec in specs:
        ref, dest = parse_copy_spec(spec)
        mid = src.resolve(ref)
        entry = None
        try:
            entry = src.refs_db.current(ref)
        except InvalidNameError:
            pass  # an id prefix or NAME@N
        if dest is None and entry is not None and entry.target == mid:
            dest = ref  # a plain ref keeps its name
        items.append(CopyItem(mid, dest, alias=bool(entry and entry.alias and dest == ref)))
        m = src.manifest(mid)
        check_headers(src, m, f"checkpoint {ref}")  # what a pull writes at dst is what a load reads there
        for cid, n in m.chunk_lengths().items():
            if weights.setdefault(cid, n) != n:
                raise StoreFormatError(f"the checkpoints to copy give chunk {cid[:12]} two lengths ({weights[cid]} and {n} "
                                       f"bytes, the second in {ref}): one of them is damaged", hint="run `ckpt verify` on the source")
        for cid, kept in recorded_chains(src.objects.get_manifest(mid)).items():
            allowed[cid] = allowed[cid] & kept if cid in allowed else kept
    return items, weights, allowed


def copy_refs(src: Store, dst: Store, refs: Iterable[str], *, progress: Progress | None = None,
              recode: bool = False) -> CopyReport:
    """Copy checkpoints ``refs`` from ``src`` to ``dst`` and point the same refs at them there.

    Each item is ``REF`` (a ref keeps its name; ``NAME@N`` or an id prefix copies the
    checkpoint without a ref) or ``REF:NAME`` (the ref to set at the destination). Only
    objects ``dst`` lacks travel -- a fine-tune whose base is there costs about its delta --
    chunks first, then manifests, then refs, each verified before it is written. An
    interrupted copy, run again, sends only what is still missing. ``recode``: raw chunks are
    compressed on the way (:func:`raw_recoder`); otherwise every chunk travels as stored.
    """
    refs = list(refs)
    if not refs:
        raise RefNotFoundError("nothing to copy", hint="name at least one ref")
    with reading_source(src.objects):
        items, weights, allowed = _items(src, refs)
    from ckpt.snapshot.local_lock import keeping_off

    with keeping_off(dst):  # (not a local tier in use: its manager collects it without grace)
        resend = _check_present(dst, weights, allowed)
        replacing = set(resend)
        return copy_checkpoints(src.objects, dst.objects, dst.refs_db, items, check_chunk=chunk_checker(src, dst, weights),
                                concurrency=_concurrency(src, dst), progress=progress, weights=weights,
                                recode=_whole_where_unnamed(src, dst, allowed, raw_recoder(dst) if recode else None,
                                                            replacing),
                                resend=resend, taken=_taken(dst, weights, allowed, replacing))


def _concurrency(src: Store, dst: Store) -> int:
    return max(src.settings.workers, src.backend.concurrency, dst.backend.concurrency)


def copy_chunks(src: Store, dst: Store, ids: Iterable[str], *, recode: bool = False,
                named: Mapping[str, frozenset[str]] | None = None, replace: Iterable[str] = ()) -> CopyReport:
    """Copy the chunks ``ids`` that ``dst`` lacks from ``src``, as stored (``recode``: raw ones
    compressed, :func:`raw_recoder`), each decoded and re-hashed first; bases of delta chunks come
    along. Nothing else is written.

    ``named``: what the manifest about to be committed at ``dst`` records of each chunk
    (``recorded_chains`` of it). A chunk ``dst`` holds as a delta against a chunk outside that is
    sent again, whole, and so is one sent that is such a delta (:func:`_check_present`); without
    ``named``, every delta is. ``replace``: chunks of ``ids`` that ``dst`` holds damaged (a read there
    failed its hash): sent all the same, written over them (whole, if a delta)."""
    ids = set(ids)
    allowed = {c: (named or {}).get(c, frozenset()) for c in ids}
    lengths: dict[str, int | None] = dict.fromkeys(ids)
    resend = _check_present(dst, lengths, allowed) | (ids & set(replace))
    replacing = set(resend)
    return storage_copy.copy_chunks(src.objects, dst.objects, ids, check_chunk=chunk_checker(src, dst),
                                    concurrency=_concurrency(src, dst), resend=resend,
                                    recode=_whole_where_unnamed(src, dst, allowed, raw_recoder(dst) if recode else None, replacing),
                                    taken=_taken(dst, lengths, allowed, replacing))
