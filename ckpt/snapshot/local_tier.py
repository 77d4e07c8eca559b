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

import fcntl
import gc
import json
import logging
import os
import shlex
import shutil
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt.errors import CkptError
from ckpt.snapshot.local_paths import default_local_path
from ckpt.snapshot.steps import run_steps, step_of
from ckpt.snapshot.tiers import describe
from ckpt.store.destination import check_dir_destination

if TYPE_CHECKING:
    from ckpt.settings import Settings
    from ckpt.store.store import Store

log = logging.getLogger(__name__)


TIER_MARKER = "ckpt-local-tier.json"  # {"store_id": the durable store's, "run": ...}: whose tier this is


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
    once: nothing else writes into this store while the manager prunes it.

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
            _apart(self.path, durable)
        # (before its folders are made there, as names none of that store's; the tier itself is a store)
        check_dir_destination(self.path, None, "a local tier", allow_self=True)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:  # a file where the folder should be, say (FileExistsError, NotADirectoryError)
            from ckpt.snapshot.run import SnapshotError

            raise SnapshotError(f"local tier {self.path} cannot be made a folder ({describe(e)})",
                                hint="give local=PATH a folder of its own (or a path where one can be made)") from e
        fd = _hold(self.path)  # before anything here is read or changed: one manager per tier
        self._release = weakref.finalize(self, _let_go, fd)
        try:
            marker = None
            if durable is not None:
                marker = _claim(self.path, run, durable, reset_foreign)
        except BaseException:
            self._release()
            raise
        self.compress = compress
        self.store = Store.init(self.path, settings=settings)
        if marker is not None:
            self.store.backend.write(TIER_MARKER, marker)
        self.pinned: set[int] = set()
        self._lock = threading.Lock()  # prune vs. the steps a persist pins

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

    def make_room(self, needed: int | None) -> list[int]:
        """After a save found the medium full (ENOSPC): drop the oldest unpinned snapshots, the newest
        last, only as far as the medium's free space (``os.statvfs``) and what they free together hold
        ``needed`` bytes (None: as much as the largest snapshot holds here). Where dropping every one of
        them would not make that room (another tenant of a shared /dev/shm holds it), nothing is
        dropped: the save fails again with its warning and the tier keeps its newest snapshot. The
        steps removed."""
        with self._lock:
            steps = [s for s in self.steps() if s not in self.pinned]
            if not steps:
                return []
            chunks = {s: self._chunks(s) for s in self.steps()}
            if needed is None:  # (a group's rank: the most any snapshot holds here, one cut short by ENOSPC aside)
                needed = max(sum(self.store.stored_sizes(c).values()) for c in chunks.values())
            free = free_bytes(self.path)
            for n in range(len(steps) + 1):
                kept = set().union(*(c for s, c in chunks.items() if s not in steps[:n]))
                gone = set().union(*(chunks[s] for s in steps[:n])) - kept
                if free + sum(self.store.stored_sizes(gone).values()) >= needed:
                    break
            else:
                log.warning("local tier %s: %d bytes free, and %d with every snapshot but pinned ones dropped; the "
                            "next snapshot needs about %d: none dropped", self.path, free,
                            free + sum(self.store.stored_sizes(gone).values()), needed)
                return []
            removed = steps[:n]
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

    def _chunks(self, step: int) -> set[str]:
        """The chunk ids the snapshot of ``step`` names (none where it cannot be read)."""
        try:
            m = self.store.manifest(self.ref(step))
        except CkptError:
            return set()
        return {c for t in m.tensors for c in t.chunks}

    def drop_after(self, step: int) -> list[int]:
        """Remove the snapshots of steps after ``step`` but pinned ones (their data goes with the next
        :meth:`prune`): a save of ``step`` made after them begins a new timeline (the run went back to
        an earlier snapshot), and as the newest steps they would be restored, and kept, before it."""
        with self._lock:
            later = [s for s in self.steps() if s > step and s not in self.pinned]
            for s in later:
                self.store.remove(self.ref(s))
            return later

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


LOCK_WAIT_S = 30.0  # how long a manager waits for a tier another process holds (one exiting, say)
# The tier folders (device, inode) this process holds, so that a second manager of this process on one
# of them is refused at once: its holder cannot let go while this process waits for it.
_HELD: set[tuple[int, int]] = set()
_HELD_LOCK = threading.Lock()


def _hold(path: str) -> int:
    """An exclusive ``flock`` on the tier's folder, held while its manager lives (the descriptor;
    :func:`_let_go` releases it).

    Two managers on one tier would prune and collect each other's snapshots: a tier is
    collected with no grace period because its manager is its only writer. A holder in
    this process that is no longer referenced (a notebook cell run again) is collected
    first, or once the save it had in flight is done; any holder is waited for up to
    :data:`LOCK_WAIT_S` (a restarted job whose old process is still exiting), then refused,
    saying whether it is of this process. (Refusing one of this process at once refused that
    notebook's second manager while the first one's save was still running.)"""
    from ckpt.snapshot.run import SnapshotError

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    deadline = time.monotonic() + LOCK_WAIT_S
    collected, warned = 0.0, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with _HELD_LOCK:
                _HELD.add(key)
            return fd
        except BlockingIOError:
            pass
        except OSError:
            os.close(fd)
            raise
        if time.monotonic() - collected >= 1.0:
            # An unreferenced earlier manager of this process lets go as it is freed: at once, or once
            # the save it had in flight (which holds it) is done.
            gc.collect()
            collected = time.monotonic()
            continue
        if time.monotonic() >= deadline:
            os.close(fd)
            with _HELD_LOCK:
                ours = key in _HELD
            where = "of this process" if ours else "(in this process or another)"
            raise SnapshotError(f"local tier {path} is in use by another CheckpointManager {where} and was not let go "
                                f"within {LOCK_WAIT_S:g} s",
                                hint="close the other manager first (mgr.close(), or `with CheckpointManager(...)`; "
                                     "one dropped with a save in flight lets go once that save is done), or give "
                                     "this one a local=PATH of its own")
        if not warned:
            log.warning("waiting for local tier %s: another CheckpointManager holds it", path)
            warned = True
        time.sleep(0.1)


def _let_go(fd: int) -> None:
    """Release a tier :func:`_hold` took (forgotten as this process's first: no other manager here can
    have taken it before the descriptor closes)."""
    st = os.fstat(fd)
    with _HELD_LOCK:
        _HELD.discard((st.st_dev, st.st_ino))
    os.close(fd)


def _apart(path: str, durable: Store) -> None:
    """Refuse ``path`` as a tier where it is the durable store, or in or around it (checked
    before the tier's folder is made)."""
    from ckpt.snapshot.run import SnapshotError
    from ckpt.store.destination import inside, store_root

    real = os.path.realpath(path)
    droot = store_root(durable)
    if droot is not None:
        if inside(real, droot) or inside(droot, real):
            raise SnapshotError(f"local={path} is the durable store {droot}, or lies in or around it",
                                hint="give the local tier a path of its own (it prunes and collects what it holds)")


def _claim(path: str, run: str, durable: Store, reset_foreign: bool) -> bytes | None:
    """Check that ``path`` may be the local tier of ``run`` of ``durable`` (whose snapshots the tier
    prunes and collects without grace); returns the marker to write once the tier's store exists
    (None: it is there already).

    Refused (beside what :func:`_apart` refuses): a ckpt store that is not a local tier (its
    history would be collected), and the tier of another store or run (it would be resumed from).
    With ``reset_foreign`` (the default path, keyed by the store's id, its URL and the run: another
    store's tier is there only by a collision of the key) it is emptied instead, with a warning.
    A store with no marker is taken where it holds nothing, and at the default path where its every ref is
    a snapshot of ``run`` (a tier kept before tiers had markers); elsewhere such a store may as well be
    another store of the run (an earlier experiment's durable store, say): refused, it would be resumed
    and pruned."""
    from ckpt.snapshot.run import SnapshotError
    from ckpt_store.storage.config import CONFIG_PATH

    want = {"run": run, "store_id": durable.config.store_id}
    marker = json.dumps(want, sort_keys=True).encode()
    try:
        with open(os.path.join(path, TIER_MARKER), "rb") as f:
            have = json.loads(f.read(4096))
    except FileNotFoundError:
        have = None
    except (OSError, ValueError):
        have = {}  # damaged: someone's, not known to be this run's
    if have == want:
        return None
    if have is None and not os.path.lexists(os.path.join(path, CONFIG_PATH)):
        return marker  # a new tier
    if have is None:
        held = _unmarked(path, run)
        if held == "nothing" or held == "snapshots" and reset_foreign:
            return marker
        if held == "snapshots":
            raise SnapshotError(f"local={path} is a ckpt store with no {TIER_MARKER}, of snapshots of run {run!r}: "
                                "another store of this run (an earlier experiment's, say), which the tier would resume "
                                "and prune", hint="give the local tier a path of its own (if that folder is this run's "
                                                  "tier kept by a ckpt before tiers were marked, remove it)")
        raise SnapshotError(f"local={path} is a ckpt store that is not a local tier; a tier prunes and collects "
                            "what it holds", hint="give the local tier a path of its own")
    whose = _whose(have, want, durable)
    if not reset_foreign:
        raise SnapshotError(f"local={path} is {whose}",
                            hint="give this run's local tier a folder of its own (local=ANOTHER_PATH); or, where that "
                                 "tier's snapshots are not needed (those it persisted are in its durable store), remove "
                                 f"it first: rm -r {shlex.quote(path)}")
    message = f"local tier {path} was {whose}: emptied for run {run!r} of {durable.url}"
    log.warning("%s", message)
    from ckpt.snapshot.run import TierWarning

    warnings.warn(message, TierWarning, stacklevel=4)
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
    return marker


def _whose(have: object, want: dict[str, str], durable: Store) -> str:
    """Whose tier a marker ``have`` (read from the tier) names, against ``want`` (this manager's)."""
    if not isinstance(have, dict) or not isinstance(have.get("run"), str) or not isinstance(have.get("store_id"), str):
        return f"a local tier whose {TIER_MARKER} is damaged (whose tier it is cannot be told)"
    theirs = f"the local tier of run {have['run']!r:.100}"
    if have["store_id"] == want["store_id"]:
        return f"{theirs} of this store, not of run {want['run']!r}"
    return f"{theirs} of another store (id {have['store_id']:.12}), not of {durable.url} (id {want['store_id']:.12})"


def _unmarked(path: str, run: str) -> str:
    """What the store at ``path``, which has no marker, holds: "nothing" (no ref, no object: one made by a
    manager killed before it wrote the marker), "snapshots" (refs, if any, that are all snapshots of ``run``:
    a tier kept before tiers had markers, or another store of this run, a durable one say, which only the
    default path's folder tells apart), else "other"."""
    from ckpt.store.store import Store

    try:
        store = Store.open(path)
        refs = store.refs()
        if not refs and all(next(store.objects.list(kind), None) is None for kind in ("manifests", "chunks")):
            return "nothing"
    except CkptError:
        return "other"
    return "snapshots" if all(r == f"{run}/latest" or step_of(run, r) is not None for r in refs) else "other"


__all__ = ["LocalTier", "LocalTierUsage", "default_local_path"]
