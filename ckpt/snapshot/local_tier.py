"""A run's local tier: its snapshots in a node-local ckpt store (host memory, or local NVMe) beside
the durable one, bounded by count and bytes, held by one manager at a time and claimed for one
run of one durable store (``docs/format.md``, "The local tier").

>>> import tempfile, torch, ckpt
>>> tier = LocalTier(tempfile.mkdtemp(), "run", keep=1)
>>> _ = tier.store.push({"w": torch.ones(4)}, "run/step-1")
>>> _ = tier.store.push({"w": torch.zeros(4)}, "run/step-2")
>>> tier.prune(), tier.steps()
([1], [2])
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt.errors import CkptError
from ckpt.snapshot.local_claim import TIER_MARKER, apart, claim
from ckpt.snapshot.local_lock import hold, let_go, own
from ckpt.snapshot.local_paths import default_local_path
from ckpt.snapshot.local_room import TierChunks
from ckpt.snapshot.steps import run_steps
from ckpt.snapshot.tiers import describe
from ckpt.store.destination import check_dir_destination

if TYPE_CHECKING:
    from ckpt.settings import Settings
    from ckpt.store.store import Store

log = logging.getLogger(__name__)


PAGE = 4096  # what a stored object may take beyond its bytes: its header, the medium's rounding


@dataclass(frozen=True)
class LocalTierUsage:
    """What the local tier holds now: its snapshots' steps and the bytes it occupies
    (stored objects and manifests; in /dev/shm that is host memory)."""

    path: str
    steps: list[int]
    bytes: int


class LocalTier:
    """A run's snapshots in a node-local store, bounded by count (``keep``) and bytes (``max_bytes``).

    :meth:`prune` removes the oldest snapshots beyond either bound (the newest always
    stays, and so do ``pinned`` steps, e.g. one being persisted) and frees their data at
    once: nothing else writes into this store while the manager prunes it. (Pins hold
    against the bounds, not against :meth:`forget`: a step naming a damaged chunk goes.)

    Chunks are written raw unless ``compress`` (then with ``settings``, as the durable store
    writes them); persisting compresses raw ones on the way (``copy_refs(..., recode=True)``).
    """

    def __init__(self, path: str | os.PathLike[str], run: str, *, keep: int = 2, max_bytes: int | None = None,
                 settings: Settings | None = None, compress: bool = False, durable: Store | None = None,
                 reset_foreign: bool = False) -> None:
        from dataclasses import replace

        from ckpt.settings import Settings
        from ckpt.store.store import Store

        if not compress:  # raw: nothing is worth compressing (ckpt.codecs.chunk.encode_chunk)
            settings = replace(settings or Settings.from_env(), min_saving=1.0)

        # Normalised once, as the local backend opens it (``~`` expanded): every check, the lock and the store see one folder.
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.run = run
        self.keep = keep
        self.max_bytes = max_bytes
        if durable is not None:
            apart(self.path, durable)
        # (before its folders are made there, as names none of that store's; the tier itself is a store)
        check_dir_destination(self.path, None, "a local tier", allow_self=True)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:  # a file where the folder should be, say (FileExistsError, NotADirectoryError)
            from ckpt.snapshot.run import SnapshotError

            raise SnapshotError(f"local tier {self.path} cannot be made a folder ({describe(e)})",
                                hint="give local=PATH a folder of its own (or a path where one can be made)") from e
        fd = hold(self.path)  # before anything here is read or changed: one manager per tier
        self._release = weakref.finalize(self, let_go, fd, os.getpid())  # (not a forked child's: its fd may be another)
        try:
            marker = None
            if durable is not None:
                marker = claim(self.path, run, durable, reset_foreign)
        except BaseException:
            self._release()
            raise
        self.compress = compress
        self.store = Store.init(self.path, settings=settings)
        own(fd, self.store)  # (its writes into the tier pass; another store's, of this process too, are refused)
        if marker is not None:
            self.store.backend.write(TIER_MARKER, marker)
        self.pinned: set[int] = set()
        self._lock = threading.Lock()  # prune vs. the steps a persist pins
        self.room = TierChunks(self.store, self.ref)  # what each snapshot names and frees (the room's accounting)
        self._estimated: set[int] | None = None  # the steps the last estimated make_room left (None: none was)

    def close(self) -> None:
        """Let go of the tier (another manager may then take it)."""
        self._release()

    def ref(self, step: int) -> str:
        return f"{self.run}/step-{step}"

    def steps(self) -> list[int]:
        """Steps of the snapshots in this tier, oldest first."""
        return sorted(run_steps(self.store, self.run)[0])

    def usage(self) -> LocalTierUsage:
        return LocalTierUsage(self.path, self.steps(), self.store.du().stored)

    def prune(self) -> list[int]:
        """Apply the bounds; the steps removed."""
        with self._lock:
            steps = self.steps()
            removed = []
            while len(steps) > self.keep and (s := self._drop(steps)) is not None:
                removed.append(s)
            self._collect()
            while self.max_bytes is not None and self.store.du().stored > self.max_bytes and (s := self._drop(steps)) is not None:
                removed.append(s)
                self._collect()
            return sorted(removed)

    def _drop(self, steps: list[int]) -> int | None:
        """Remove the oldest unpinned step but the newest from ``steps`` (and the tier)."""
        for s in steps[:-1]:
            if s not in self.pinned:
                steps.remove(s)
                self.store.remove(self.ref(s))
                return s
        return None

    def _collect(self) -> None:
        # The tier's past is read by no one: each ref's older entries and a removed step's folder go
        # (docs/format.md, "The local tier"), so that its steps, gc and a restart's choice list the
        # snapshots kept, not a folder and an entry per step ever saved.
        refs = self.store.refs_db
        for name in refs.listing(self.run):
            try:
                refs.cut_history(name)
            except CkptError:
                pass  # damaged, or no ref name (m@1): left as it is, to the gc below (which reports it)
        # grace 0: this process is the tier's only writer, and it is not writing now
        self.store.gc(grace_s=0.0, keep_history=False)

    def bound(self, sizes: Iterable[int], bundles: bool | None = False, raw: bool = False) -> int:
        """At most what a snapshot of tensors of ``sizes`` bytes (those it writes) adds to the tier: their bytes, a
        page per chunk (its header, the medium's rounding), a copy of each one's small chunk where snapshots carry
        bundles (one per tensor at most: its others are full chunks), and 64 KiB and 1 KiB per tensor for the
        manifest and refs. An upper bound: chunks the tier holds already (unchanged, found by hash) add nothing. A tier
        that compresses (and deltas) counts no tensor bytes unless ``raw``: raw bytes would be far over (an 8 MB tensor
        changed in one element stores as 1.4 KiB) and refuse saves that fit; its write finds out where they do not
        (and :meth:`make_room` then takes the raw bound as a cap)."""
        chunk = self.store.settings.chunk_size
        sizes = [0 if self.compress and not raw else n for n in sizes]
        total = sum(n + PAGE * -(-n // chunk) + 1024 for n in sizes) + (64 << 10)
        if bundles:
            from ckpt.transfer.reading import BUNDLE_CHUNK_MAX

            small = sum(min(n, BUNDLE_CHUNK_MAX, chunk // 4) for n in sizes)
            total += small + PAGE * -(-small // chunk)
        return total

    def fit(self, step: int, sizes: Iterable[int], bundles: bool | None = False, reused: str | None = None) -> list[int]:
        """Before the save of ``step`` writes tensors of ``sizes`` bytes here (those not known to be unchanged; none
        where version counters cannot tell (a frozen base is found unchanged by hash) or the tier compresses
        (:meth:`bound`), so that a save that fits is not refused but where a changed tensor stores as its bytes): make
        its room first, so that the bounds hold while it is written, not only after. Drops the unpinned snapshots after
        ``step`` first (a run gone back: they go anyway once it lands, :meth:`drop_after`), then the oldest before ``step`` that the bounds would
        drop once it lands (those beyond ``keep`` with it; while what the tier holds and what it adds (:meth:`bound`)
        exceed ``max_bytes``), and the fewest that the medium's free space (``os.statvfs``) needs to hold it; never
        the newest before ``step`` (the snapshot a restart takes until this one is complete, the one it continues
        from), the snapshot ``reused`` (the id of the one whose chunks the save reuses, its previous: a run gone back
        continues from it while later steps may be pinned) nor a pinned one. Where not even all of them would make the room on the medium, raises (ENOSPC) with
        nothing dropped or written: it no longer filled the medium (a shared /dev/shm other tenants use) up to its
        end, then freed what it had written. The steps removed."""
        from ckpt_store.storage.errors import StorageIOError

        needed = self.bound(sizes, bundles)
        free = free_bytes(self.path)
        with self._lock:
            steps = self.steps()
            # Once it lands the tier holds the steps before it, it, and pinned later steps (the later others go: drop_after).
            held = sum(1 for s in steps if s < step or (s > step and s in self.pinned)) + 1
            candidates = self._candidates(steps, step, reused)
            later = sum(1 for s in candidates if s > step)
            n = min(max(held - self.keep, 0), len(candidates) - later)
            n = later + n if n else 0
            if needed > free or self.max_bytes is not None:
                chunks = self.room.chunk_map(steps)[0]
                freed = [room - free for room in self.room.rooms(candidates, chunks, free)]
                if needed > free:
                    fits = [k for k, f in enumerate(freed) if free + f >= needed]
                    if not fits:
                        raise StorageIOError(f"local tier {self.path}: the disk is full for this snapshot: it adds up "
                                             f"to {needed} bytes, {free} are free ({free + freed[-1]} with every snapshot "
                                             "it may drop dropped); nothing written", errno=errno.ENOSPC,
                                             hint="give the tier more room (or local_keep, local_max_bytes less)")
                    n = max(n, fits[0])
                if self.max_bytes is not None:
                    stored = self.store.du().stored
                    n = max(n, next((k for k, f in enumerate(freed) if stored - f + needed <= self.max_bytes),
                                    len(candidates)))
            removed = candidates[:n]
            if removed:
                try:
                    self._remove(removed)
                except CkptError as e:  # (a damaged ref folder the gc refuses, say): the prune after the save warns of it
                    log.warning("local tier %s: could not free steps %s before a save (%s)", self.path, removed, describe(e))
            return removed

    def _candidates(self, steps: list[int], step: int, reused: str | None) -> list[int]:
        """What a save of ``step`` may drop of ``steps`` before it writes, in the order it drops them: unpinned later steps
        first (a timeline the run left: they go anyway once it lands, :meth:`drop_after`), then the oldest; never the
        newest before ``step`` (the one a restart takes until the save is complete, the one it continues from), the
        snapshot ``reused`` (the id of the one whose chunks it reuses) nor a pinned one."""
        later = [s for s in steps if s > step and s not in self.pinned and not self._names(s, reused)]
        older = [s for s in steps if s < step]
        return later + [s for s in older[:-1] if s not in self.pinned and not self._names(s, reused)]

    def make_room(self, step: int, needed: int | None, whole: int | None = None, since: str | None = None) -> list[int]:
        """After the last save found the medium full (ENOSPC, or :meth:`fit` refused it), before the save of ``step``:
        drop the fewest unpinned snapshots for the medium's free space (``os.statvfs``) and what they free to hold what
        the save adds. First :meth:`_candidates` (a timeline the run left, then the oldest), then the others: one of
        ``step`` or later (it goes once the save lands), the newest before ``step``, and last the one it continues from
        (``since``: the id of the last snapshot written or restored). While that one is held, the save adds ``needed``
        bytes (its tensors known to change since); once it goes, ``whole`` (all of them), so that a tier with room for
        one snapshot holds the newest instead of refusing every save, and never drops it for too little room.
        ``needed`` None (a group's rank), or a tier that compresses (``needed`` and ``whole`` the raw bounds,
        :meth:`bound` with ``raw``): estimated from what the snapshots here hold (:meth:`TierChunks.held_estimate`), or the raw
        bounds where the last estimate was short (no snapshot landed since it). Where dropping every
        one would not make the room (another tenant of a shared /dev/shm holds it), nothing is dropped: the save fails
        again with its warning and the tier keeps its newest snapshot. The steps removed."""
        with self._lock:
            steps = self.steps()
            first = self._candidates(steps, step, since)
            rest = sorted((s for s in steps if s not in first and s not in self.pinned),
                          key=lambda s: (self._names(s, since), s < step, s))  # (one of its step goes once it lands)
            order = first + rest
            if not order:
                return []
            chunks, mids = self.room.chunk_map(steps)
            if needed is None or self.compress:
                # An estimate again, unless the last one was short: no snapshot landed since it (the save after it failed
                # too), and the raw bounds are known: those then. (The estimate takes a delta's own chunks at a delta's
                # rate; the save after a failure writes every tensor whole: a compressing tier of deltas made room for
                # a delta at every step and failed every save.)
                short = self._estimated is not None and set(steps) <= self._estimated and needed is not None
                if not short:
                    needed, whole = self.room.held_estimate(chunks, mids, needed, whole)
            whole = needed if whole is None else max(whole, needed)
            mine = [s for s in steps if self._names(s, since)]  # (held: what the save does not change is there)
            at = (order.index(mine[0]) if mine[0] in order else len(order)) if mine else -1  # dropping order[:k]: k > at drops it
            free = free_bytes(self.path)
            rooms = self.room.rooms(order, chunks, free)
            n = next((k for k, room in enumerate(rooms) if room >= (needed if k <= at else whole)), None)
            if n is None:
                log.warning("local tier %s: %d bytes free, and %d with every snapshot but pinned ones dropped; the "
                            "next snapshot needs about %d: none dropped", self.path, free, rooms[-1], whole)
                return []
            if needed is None or self.compress:
                self._estimated = set(steps) - set(order[:n])  # (what it left: a step new at the next call landed)
            return self._remove(order[:n])

    def _remove(self, removed: list[int]) -> list[int]:
        """Remove the snapshots of steps ``removed`` (and RUN/latest where it names one) and free their data."""
        targets = {self.store.resolve(self.ref(s)) for s in removed}
        for s in removed:
            self.store.remove(self.ref(s))
        latest = f"{self.run}/latest"
        try:
            if self.store.resolve(latest) in targets:
                self.store.remove(latest)  # it would keep the dropped newest alive
        except CkptError:
            pass  # no alias here
        if removed:
            self._collect()
        return removed

    def _names(self, step: int, mid: str | None) -> bool:
        """Whether the snapshot of ``step`` is checkpoint ``mid``."""
        try:
            return mid is not None and self.store.resolve(self.ref(step)) == mid
        except CkptError:
            return False

    def drop_after(self, step: int) -> list[int]:
        """Remove the snapshots of steps after ``step`` but pinned ones (their data goes with the next
        :meth:`prune`): a save of ``step`` made after them begins a new timeline (the run went back to
        an earlier snapshot), and as the newest steps they would be restored, and kept, before it."""
        with self._lock:
            later = [s for s in self.steps() if s > step and s not in self.pinned]
            for s in later:
                self.store.remove(self.ref(s))
            return later

    def forget(self, chunks: set[str]) -> list[int]:
        """Remove the copies of ``chunks`` (damaged ones no other tier could replace) and the snapshot of every
        step that names one (as a chunk or a delta's base: it lacks it now), RUN/latest too where it names one
        of those; the steps removed. A pinned step too: a pin holds a step against the bounds while a persist
        copies it, but one naming such a chunk can be assembled from no tier, and its persist, which verifies
        each chunk it sends, cannot succeed: it fails with its warning, publishes nothing, and the next save
        persists again (its pin stays the persist's to lift)."""
        with self._lock:
            steps = [s for s, named in self.room.chunk_map(self.steps())[0].items() if named & chunks]
            try:
                self._remove(steps)  # (first: a step is never named without its chunks)
            finally:
                # Whatever the removal did (its gc failing, say): a damaged copy left in chunks/ would be reused by a
                # save, which dedups on presence; deleting one is always safe. (A missing one is no error.)
                failed: BaseException | None = None
                for cid in sorted(chunks):
                    try:
                        self.store.objects.delete("chunks", cid)
                    except (CkptError, OSError) as e:
                        failed = failed or e
                if failed is not None:
                    raise failed
            return steps

    def drop(self, step: int) -> None:
        """Remove one snapshot (a failed save's leftovers go with the next prune)."""
        try:
            self.store.remove(self.ref(step))
        except CkptError:
            pass


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still write to the medium holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


__all__ = ["LocalTier", "LocalTierUsage", "default_local_path"]
