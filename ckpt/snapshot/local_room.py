"""The local tier's room accounting (ckpt/snapshot/local_tier.py): which chunks each snapshot of the tier
names, what dropping the first n of some snapshots frees, and, where a save's tensor bytes cannot say what it
adds (a compressing tier, a group's rank), an estimate from what the snapshots hold. Manifests are read once
each, kept by id (a manifest never changes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ckpt.errors import CkptError
from ckpt_store.storage.chunk_lists import referenced_chunks

if TYPE_CHECKING:
    from ckpt.store.store import Store


class TierChunks:
    """The chunks of the snapshots of a local tier's ``store``, ``ref(step)`` naming each."""

    def __init__(self, store: Store, ref: Callable[[int], str]) -> None:
        self.store = store
        self.ref = ref
        self._named: dict[str, frozenset[str]] = {}  # manifest id -> the chunks it names (chunks)
        self._entries: dict[str, tuple[frozenset[str], int]] = {}  # manifest id -> its entries' chunks, tensor bytes (own)

    def held_estimate(self, chunks: dict[int, frozenset[str]], mids: dict[int, str], needed: int | None,
                       whole: int | None) -> tuple[int, int]:
        """:meth:`LocalTier.make_room`'s ``needed`` and ``whole`` where the tensors' bytes cannot say what a save adds, from what
        the snapshots of ``chunks`` (manifests ``mids``) hold here, each sized by the chunks its own entries name
        (:meth:`own`; one cut short by ENOSPC holds nothing): a group's rank (``needed`` None), the most any of them
        holds, for both (it knows no raw bytes of its next save: DCP plans its shards as it writes, so a state grown
        since its snapshots is not counted, and its saves may keep running out of space); a compressing tier (``needed`` and ``whole`` the raw bounds), at least that and
        the raw bounds times the most any of them stores per byte of its tensors (a state grown since: AdamW's moments
        after a snapshot of step 0), at most the raw bounds. (It asked for :meth:`LocalTier.bound`'s no tensor bytes, dropped
        none, and every later save ran out of space again; with the most held alone, so did a state grown since.
        Sized by every chunk it needs, a snapshot of a delta chain held its bases too: past the raw bound, which then
        dropped every snapshot, the one the save continues from too.)"""
        import math

        own = {s: self.own(mid, chunks[s]) for s, mid in mids.items()}
        sizes = self.store.stored_sizes(frozenset().union(*(ids for ids, _ in own.values())))
        held = {s: sum(sizes.get(c, 0) for c in ids) for s, (ids, _) in own.items()}
        most = max(held.values(), default=0)
        if needed is None:
            return most, most
        ratio = max((held[s] / n for s, (_, n) in own.items() if n), default=1.0)

        def estimate(raw: int) -> int:
            return min(raw, max(most, math.ceil(raw * ratio)))

        return estimate(needed), estimate(needed if whole is None else whole)

    def own(self, mid: str, named: frozenset[str]) -> tuple[frozenset[str], int]:
        """The chunks the entries of manifest ``mid`` name themselves (not the bases of their deltas: a later snapshot's
        own) and its tensors' bytes; kept by id, read only where :meth:`LocalTier.make_room` estimates. A manifest the full parse
        refuses counts ``named`` (every chunk it needs) and no tensor bytes."""
        if mid not in self._entries:
            from ckpt.format.manifest import Manifest

            try:
                m = Manifest.from_json(self.store.objects.get_manifest(mid), f"manifest {mid}")
            except CkptError:
                return named, 0
            self._entries[mid] = (frozenset(c for e in (*m.files, *m.tensors, *m.bundles) for c in e.chunks),
                                  sum(t.nbytes for t in m.tensors))
        return self._entries[mid]

    def rooms(self, steps: list[int], chunks: dict[int, frozenset[str]], free: int) -> list[int]:
        """The room with the first n of ``steps`` dropped, for n = 0..len(steps): ``free`` bytes and what they free.
        ``chunks``: every step's chunks (a chunk that a step kept names too is not freed). One size query per chunk
        (asked of the chunks any of ``steps`` may free, once), not one per chunk and prefix."""
        at = {s: i for i, s in enumerate(steps)}
        last: dict[str, int] = {}  # chunk -> the index in ``steps`` of the last one naming it (it goes with that one)
        never: set[str] = set()  # named by a step not in ``steps``: never freed
        for s, ids in chunks.items():
            i = at.get(s)
            for c in ids:
                if i is None:
                    never.add(c)
                elif last.get(c, -1) < i:
                    last[c] = i
        sizes = self.store.stored_sizes(set(last) - never)
        gains = [0] * (len(steps) + 1)
        for c, i in last.items():
            gains[i + 1] += sizes.get(c, 0)
        rooms, room = [], free
        for g in gains:
            room += g
            rooms.append(room)
        return rooms

    def chunk_map(self, steps: list[int]) -> tuple[dict[int, frozenset[str]], dict[int, str]]:
        """Each of ``steps``' chunks (:meth:`chunks`), and the manifest id of each whose ref resolves; the manifests
        of snapshots gone since are forgotten."""
        chunks, mids = {}, {}
        for s in steps:
            mid, chunks[s] = self.chunks(s)
            if mid is not None:
                mids[s] = mid
        held = set(mids.values())
        self._named = {m: c for m, c in self._named.items() if m in held}
        self._entries = {m: e for m, e in self._entries.items() if m in held}
        return chunks, mids

    def chunks(self, step: int) -> tuple[str | None, frozenset[str]]:
        """The manifest id of the snapshot of ``step`` (None where its ref cannot be read) and the chunk ids it names,
        the bases of its delta chains too (none where it cannot be read). Kept by manifest id (a manifest never
        changes): a save's room reads only the manifests new since."""
        try:
            mid = self.store.resolve(self.ref(step))
        except CkptError:
            return None, frozenset()
        if mid not in self._named:
            try:
                self._named[mid] = frozenset(referenced_chunks(self.store.objects.get_manifest(mid)))
            except CkptError:
                return mid, frozenset()
        return mid, self._named[mid]


__all__ = ["TierChunks"]
