"""What the metadata index says, in memory (:class:`IndexState`: a record of each ref entry, a summary
of each manifest, the chunk lists), and the bodies of the objects a snapshot is written as; reading and
writing those objects is storage/index.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import blake3

from ckpt_store.storage.backends.base import Entry
from ckpt_store.storage.errors import InvalidNameError, StoreFormatError
from ckpt_store.storage.objects import Temporaries, check_id
from ckpt_store.storage.records import canonical_json, finite_time, require
from ckpt_store.storage.refs import RefEntry, history_floor

# The part of a snapshot base choice reads: the live refs updated most recently (base
# choice ranks at most 200 of them, ckpt/store/base.py), so that a push reads a bounded
# amount however many refs the store holds. More than 200, so that removals logged since
# the snapshot cannot push one of the 200 newest out of it.
RECENT = 256


@dataclass(frozen=True)
class RefRec:
    """The index's copy of one ref entry, with the size and mtime its file was listed with."""

    seq: int
    target: str | None
    time: float
    writer: str
    alias: bool
    size: int
    mtime: float | None  # as listed; None when recorded by the writer (then ``time`` is compared)

    def entry(self, name: str) -> RefEntry:
        return RefEntry(name, self.seq, self.target, self.time, self.writer, self.alias)

    def matches(self, listed: Entry) -> bool:
        """Whether ``listed`` is the file this record was made from (else it is read again)."""
        if listed.size != self.size:
            return False
        if self.mtime is not None:
            # Local stores list nanosecond times; S3 lists whole (or milli-) seconds, and
            # its HEAD (what a writer records) whole seconds.
            fine = listed.mtime % 1 and self.mtime % 1
            return abs(listed.mtime - self.mtime) < (1e-3 if fine else 1.0)
        # Recorded without the file's time: the server's time is a moment after the entry's own.
        return -1.5 <= listed.mtime - self.time <= 5.0

    def to_obj(self) -> list[Any]:
        return [self.seq, self.target, self.time, self.writer, self.alias, self.size, self.mtime]

    @classmethod
    def from_obj(cls, o: Any, what: str) -> RefRec:
        if not isinstance(o, list) or len(o) != 7:
            raise StoreFormatError(f"{what}: bad ref record")
        seq, target, t, writer, alias, size, mtime = o
        if not (isinstance(seq, int) and isinstance(writer, str) and isinstance(size, int) and isinstance(alias, bool)
                and isinstance(t, (int, float)) and (target is None or isinstance(target, str))
                and (mtime is None or isinstance(mtime, (int, float)))):
            raise StoreFormatError(f"{what}: bad ref record")
        if target is not None:  # as a ref entry's (a target that is not an id made every push fail: base choice read it)
            try:
                check_id(target)
            except InvalidNameError:
                raise StoreFormatError(f"{what}: bad ref record (target {target[:80]!r} is not an object id)") from None
        return cls(seq, target, finite_time(t, what), writer, alias, size, None if mtime is None else finite_time(mtime, what))

    @classmethod
    def of(cls, entry: RefEntry, size: int, mtime: float | None) -> RefRec:
        return cls(entry.seq, entry.target, entry.time, entry.writer, entry.alias, size, mtime)


# The keys of the removed refs a snapshot counts (settled_key, 256 bits each) are summed modulo this.
SETTLED_SUM_MOD = 1 << 256


def settled_key(name: str, seq: int, size: int) -> int:
    """What a snapshot counts of a removed ref it keeps no record of: its newest entry (a removal), by
    number and file size. A reader adds those of the refs its listing shows and the index does not, and
    leaves them out unread only where count and sum are the snapshot's. The size tells a removal from
    any other entry of that ref and number (a target is 64 hex digits, a removal's null; an alias adds
    a field): no time is needed, which a writer on S3 does not know (RefRec.matches)."""
    return int.from_bytes(blake3.blake3(canonical_json([name, seq, size])).digest(), "big")


@dataclass
class IndexState:
    """What the index says: ref records by name and seq, manifest summaries, chunk lists."""

    gen: int = 0  # everything up to this log generation is included
    refs: dict[str, dict[int, RefRec]] = field(default_factory=dict)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)  # manifest id -> summary
    sigs: dict[str, Any] = field(default_factory=dict)  # signature key -> signature
    chunks: dict[str, list[Any]] | None = None  # manifest id -> [chunk ids, detail]; None: not loaded
    # (chunks not loaded) the chunk lists the logs read carried, kept for a snapshot written from this
    # state (heal): it then reads the snapshot's chunk lists only, not every log again
    log_chunks: dict[str, list[Any]] = field(default_factory=dict)
    # (chunks not loaded) the header of the snapshot read and its path: where heal reads its chunk lists
    snap_head: tuple[dict[str, Any], str] | None = None
    max_gen: int = 0  # highest generation seen in the listing of index/
    snap_gen: int = -1  # generation of the snapshot read (-1: none)
    logs_read: int = 0
    damaged: bool = False  # a record was unreadable: a fresh snapshot is due
    read: int = 0  # entries and manifests read because the index lacked them
    partial: bool = False  # only the recently updated refs (a base choice view): never written back
    # ``read`` when :meth:`StoreIndex.heal` last wrote (or tried to write) this state as a snapshot, else -1:
    # written again only for what was read since (ls heals its view, then reads the summaries it lacks)
    healed_at: int = -1
    # (a view brought up to date with refs/) the leftovers of interrupted writes below refs/ its listing
    # passed, as :meth:`Refs.listing_and_temporaries` gives them: gc's, without listing refs/ again
    temporaries: Temporaries = field(default_factory=list)
    # Per ref, an entry whose record is kept and below which no entry keeps anything alive (all aliases,
    # or behind a removal): the snapshot keeps no record below it (see :meth:`floor`).
    floors: dict[str, int] = field(default_factory=dict)
    # The removed refs a snapshot keeps no record of: (how many, the sum of their keys, :func:`settled_key`).
    settled: tuple[int, int] = (0, 0)
    # Refs the snapshot read has no record of, first recorded by a log past their entry 1: by name, the entry
    # before that one, which may be a removal ``settled`` counts (a removed ref pushed again; see :meth:`unsettle`)
    begun_again: dict[str, int] = field(default_factory=dict)

    # -- changes ---------------------------------------------------------------
    def add_manifest(self, mid: str, info: dict[str, Any], sig: Any, chunks: list[str], detail: Any) -> None:
        info = dict(info)
        info.pop("sig", None)  # only ever the key of ``sig``: a log's own "sig" (a list, say) made readers crash
        if sig is not None:
            key = blake3.blake3(canonical_json(sig)).hexdigest()[:16]
            # Shared by a family of fine-tunes (one object), but only where what a snapshot or log gave
            # under this key is this signature: a crafted one under it made base choice crash.
            if self.sigs.get(key) != sig:
                self.sigs[key] = sig
            info["sig"] = key
        self.info[mid] = info
        (self.chunks if self.chunks is not None else self.log_chunks)[mid] = [chunks, detail]

    def apply_log(self, obj: dict[str, Any], what: str) -> None:
        ref = obj.get("ref")
        if not isinstance(ref, dict):
            raise StoreFormatError(f"{what}: no ref")
        name = require(ref, "name", str, what)
        rec = RefRec.from_obj(require(ref, "rec", list, what), what)
        if name not in self.refs and rec.seq > 1 and self.snap_gen >= 0:
            self.begun_again[name] = rec.seq - 1
        self.refs.setdefault(name, {})[rec.seq] = rec
        m = obj.get("manifest")
        if isinstance(m, dict):
            mid = require(m, "id", str, what)
            chunks = require(m, "chunks", list, what)
            self.add_manifest(mid, require(m, "info", dict, what), m.get("sig"), chunks, m.get("detail"))

    def settles(self, removed: list[tuple[str, int, int]]) -> bool:
        """Whether ``removed`` ((name, seq, file size) of refs' newest entries) are what ``settled`` counts."""
        return self.settled == (len(removed), sum(settled_key(*r) for r in removed) % SETTLED_SUM_MOD)

    def unsettle(self, removed: list[tuple[str, int, int]]) -> None:
        """Take ``removed`` ((name, seq, file size) of removals ``settled`` counts) out of it: their refs
        have records now (pushed again), and a snapshot counts their newest removal anew."""
        count, total = self.settled
        self.settled = (count - len(removed), (total - sum(settled_key(*r) for r in removed)) % SETTLED_SUM_MOD)

    # -- queries ---------------------------------------------------------------
    def entries(self) -> dict[str, list[RefEntry]]:
        """Every ref with its entries newest first, in name order (like :meth:`Refs.all_entries`)."""
        return {n: [recs[s].entry(n) for s in sorted(recs, reverse=True)] for n, recs in sorted(self.refs.items()) if recs}

    def live(self) -> dict[str, RefEntry]:
        """Current entry of every ref that exists (like :meth:`Refs.live`)."""
        out = {}
        for n, recs in sorted(self.refs.items()):
            if recs:
                rec = recs[max(recs)]
                if rec.target is not None:
                    out[n] = rec.entry(n)
        return out

    def recorded(self, name: str, seq: int, listed: Entry) -> RefEntry | None:
        """Entry ``seq`` of ``name``, where the index records the file ``listed`` (the rule of exact readers,
        :meth:`RefRec.matches`: entries are never modified, so such a record holds what the file holds);
        else None, for the caller to read the file."""
        rec = self.refs.get(name, {}).get(seq)
        return rec.entry(name) if rec is not None and rec.matches(listed) else None

    def signature(self, mid: str) -> Any:
        key = self.info.get(mid, {}).get("sig")
        return self.sigs.get(key) if key is not None else None

    # -- encoding --------------------------------------------------------------
    def floor(self, name: str) -> int:
        """The oldest entry of ``name`` a snapshot keeps a record of: what is below it keeps nothing alive and
        is in no reader's answer (``ckpt log`` reads refs/), and :meth:`StoreIndex._reconcile` does not read
        it while the listing shows that entry as recorded. From the newest removal (gc_roots stops there),
        the entry 1 or the floor read, up over every alias and removal but the newest entry (an alias's
        earlier targets keep nothing alive, gc_roots): a run's RUN/latest keeps its current record only.
        -1: every record is kept (the entries below them are not known)."""
        recs = self.refs[name]
        base = max(history_floor((s, r.target) for s, r in recs.items()), 1 if 1 in recs else -1,
                   f if (f := self.floors.get(name, -1)) in recs else -1)
        if base < 0:
            return -1
        while base + 1 in recs and (recs[base].alias or recs[base].target is None):
            base += 1
        return base

    def snap_body(self, keep: set[str]) -> bytes:
        """``keep``: the manifests whose summaries it holds (:meth:`StoreIndex.kept`). Of each ref, the
        records from its :meth:`floor` up, the floor named in ``floors`` where it is no removal; a removed
        ref whose removal's file size is known is left out whole, counted in ``settled`` (its key
        added to the sum): kept, a run's removed steps and each save's RUN/latest made every compaction
        rewrite a record per save the run ever made."""
        refs, floors = {}, {}
        count, total = self.settled
        for n, recs in self.refs.items():
            if not recs:
                continue
            floor = self.floor(n)
            newest = recs[max(recs)]
            if floor == newest.seq and newest.target is None and newest.size >= 0:
                count, total = count + 1, (total + settled_key(n, newest.seq, newest.size)) % SETTLED_SUM_MOD
                continue
            refs[n] = [recs[s].to_obj() for s in sorted(recs) if s >= floor]
            if floor > 1 and recs[floor].target is not None:  # (a removal is one by itself; none below 1)
                floors[n] = floor
        info = {m: i for m, i in self.info.items() if m in keep}
        used = {i.get("sig") for i in info.values()}
        return canonical_json({"refs": refs, "floors": floors, "settled": [count, f"{total:064x}"], "info": info,
                               "sigs": {k: v for k, v in self.sigs.items() if k in used}})

    def recent_body(self) -> bytes:
        live = sorted(self.live().values(), key=lambda e: e.time, reverse=True)[:RECENT]
        refs = {e.name: [self.refs[e.name][e.seq].to_obj()] for e in live}
        info = {e.target: self.info[e.target] for e in live if e.target in self.info}
        used = {i.get("sig") for i in info.values()}
        return canonical_json({"refs": refs, "info": info, "sigs": {k: v for k, v in self.sigs.items() if k in used}})

    def chunks_body(self, keep: set[str]) -> bytes:
        assert self.chunks is not None
        return canonical_json({m: v for m, v in self.chunks.items() if m in self.info and m in keep})

