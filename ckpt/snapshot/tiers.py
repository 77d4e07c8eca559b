"""Snapshot tiers: a node-local store in host memory (or on local NVMe) beside the durable one.

The local tier is an ordinary ckpt store (``docs/format.md``, "The local tier"): same
format, same chunk ids as the durable store. So persisting a snapshot copies only the
chunks the durable store lacks, as stored (never re-encoded), and a restore takes each
chunk from the nearest tier that holds it with a correct hash, falling through to the
next on a miss or a bad hash (:class:`Tiers`).

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
import hashlib
import json
import logging
import math
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.errors import CkptError
from ckpt.progress import NullProgress, Progress
from ckpt.transfer.pipeline import BATCH_BYTES, GetTask, fetch_chunk, get_chunks, run_parallel
from ckpt_store.storage.errors import CorruptObjectError, ObjectNotFoundError, StorageIOError, StoreFormatError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

    from ckpt.format.entries import TensorEntry
    from ckpt.format.manifest import Manifest
    from ckpt.settings import Settings
    from ckpt.store.store import Store
    from ckpt_store.storage.index import IndexState
    from ckpt_store.storage.refs import RefEntry

log = logging.getLogger(__name__)

TIERS = ("local", "peer", "store")  # nearest first: the keys of CheckpointManager.last_restore
# What makes a tier fall through to the next for one chunk or manifest (never wrong data):
# not there, damaged, or its medium failing.
MISSES = (ObjectNotFoundError, CorruptObjectError, StorageIOError, OSError)


def default_local_path(store_url: str, run: str, rank: int | None = None) -> Path:
    """Where a run's local tier lives unless given: under ``$CKPT_LOCAL_DIR`` if set, else
    /dev/shm (host memory, survives a crash of the training process but not of the machine),
    else the temp directory; keyed by the durable store and the run so that a restarted
    process finds it again."""
    env = os.environ.get("CKPT_LOCAL_DIR")
    if env:
        root = Path(env)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        root = Path("/dev/shm")
    else:
        root = Path(tempfile.gettempdir())
    key = hashlib.blake2b(f"{store_url}\0{run}".encode(), digest_size=6).hexdigest()
    user = os.getuid() if hasattr(os, "getuid") else 0
    path = root / f"ckpt-local-{user}" / key
    return path / f"rank-{rank}" if rank is not None else path


def private_root(path: Path) -> None:
    """Make sure the per-user folder that holds the default local tiers (``ckpt-local-UID`` in a
    shared folder such as /dev/shm) is this user's own: created mode 0700, else a real folder
    (not a link) that this user owns and no one else may write. Another user could otherwise
    plant a snapshot there for this run to resume from."""
    from ckpt.snapshot.run import SnapshotError

    os.makedirs(path.parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise SnapshotError(f"{path} is not a folder of this user's; the local tier will not be kept (or read) "
                            "there", hint="pass local=PATH, or set CKPT_LOCAL_DIR")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # this user's (made before tiers checked, under a umask of 002, say): made private


def step_of(run: str, ref: str) -> int | None:
    """N for the ref ``RUN/step-N`` of ``run``, else None: N spelled as the manager names its step
    (``SnapshotRun.ref``), so ``RUN/step-007`` is none (the ref of step 7 is ``RUN/step-7``)."""
    prefix = f"{run}/step-"
    tail = ref[len(prefix):] if ref.startswith(prefix) else ""
    return int(tail) if tail.isascii() and tail.isdigit() and str(int(tail)) == tail else None


def step_ref(ref: str) -> tuple[str, int] | None:
    """(RUN, N) of a ref ``RUN/step-N`` named as the manager names its steps (:func:`step_of`), else None: for
    a reader that knows no run (the web view), the run is what comes before the last ``/step-``."""
    run, sep, _ = ref.rpartition("/step-")
    step = step_of(run, ref) if sep and run else None
    return None if step is None else (run, step)


def _viewed_refs_of(store: Store, run: str) -> tuple[dict[str, RefEntry], IndexState | None]:
    """The live refs of ``store`` and their entries, by name (from its index), or, where some ref there
    cannot be read, the live refs under ``run`` alone: a damaged ref of another run, or anyone's, must not
    stop this run's saves and retention (a damaged ref of the run is left out: kept, not pruned); and the
    view of the store's index that told them (None: none)."""
    from ckpt.store.catalog import viewed_live_refs

    try:
        return viewed_live_refs(store)
    except StoreFormatError:
        return store.refs_db.scan(run)[0], None


def run_steps(store: Store, run: str) -> tuple[dict[int, str], IndexState | None]:
    """The live refs ``RUN/step-N`` of ``run`` in ``store``, snapshots or not (step -> checkpoint id), and the view
    of the store's index that told them, for :func:`snapshot_test` (``view``): which of them are snapshots,
    without listing the refs and loading the index again."""
    found: dict[int, str] = {}
    refs, view = _viewed_refs_of(store, run)
    for name, entry in refs.items():
        step = step_of(run, name)
        if step is not None and entry.target is not None:
            found[step] = entry.target
    return found, view


def snapshot_test(store: Store, mids: Iterable[str], read: Callable[[str], Manifest] | None = None,
                  view: IndexState | None = None) -> Callable[[str], bool]:
    """Whether each of ``mids`` is a snapshot (not a checkpoint a user pushed under the run's name): told
    by its summary in the store's metadata index, else by its manifest (``read``: the caller's cached
    reader, else the store's), read when first asked about; one that cannot be read counts (restoring it
    names the damage). ``view``: the view of the index the caller listed the refs from (:func:`run_steps`)."""
    made = snapshot_times(store, mids, read, view)
    return lambda mid: made(mid) is not None


def snapshot_times(store: Store, mids: Iterable[str], read: Callable[[str], Manifest] | None = None,
                   view: IndexState | None = None) -> Callable[[str], float | None]:
    """As :func:`snapshot_test`, but when each snapshot was made (``Manifest.created``; infinity where its
    manifest cannot be read: the newest, so that a restore of it names the damage), None for no snapshot."""
    from ckpt.snapshot.run import is_snapshot
    from ckpt.store.catalog import snapshot_kinds

    kinds = snapshot_kinds(store, mids, view)
    manifest = read if read is not None else store.manifest

    def made(mid: str) -> float | None:
        if mid not in kinds:
            try:
                m = manifest(mid)
                kinds[mid] = (is_snapshot(m), m.created)
            except CkptError:
                kinds[mid] = (True, math.inf)
        snapshot, created = kinds[mid]
        return created if snapshot else None

    return made


def resolve_latest(store: Store, run: str, warn: Callable[[str], None], parsed: dict[str, Manifest] | None = None) -> str:
    """The checkpoint id ``RUN/latest`` names in ``store``; where it names none (a user's ``ckpt rm RUN/latest``,
    a crash between a save's first ``RUN/step-N`` and its ``RUN/latest``), the run's newest snapshot, with a
    :class:`TierWarning` through ``warn`` (a manager's, which says each thing once): a run must never
    start again from scratch while a snapshot of it exists. Raises RefNotFoundError where the run has neither.

    The newest is the ``RUN/step-N`` that is a snapshot (:func:`snapshot_test`) made last (``Manifest.created``;
    the higher step where two were made at the same time), which RUN/latest named when its save moved it
    (docs/format.md, "Snapshots"): after a run went back to an earlier snapshot and saved on, the steps of
    the timeline it left may be higher, but they are older. ``parsed``: where the manifests read to choose
    (without a metadata index, each step's) are put, by id, so that the caller reads the chosen one once.
    Its answer may be there already; :func:`latest_manifest` reads it from there or the store."""
    from ckpt.errors import RefNotFoundError

    latest = f"{run}/latest"
    try:
        return store.resolve(latest)
    except RefNotFoundError:
        found, view = run_steps(store, run)
        if not found:
            raise
    def read(mid: str) -> Manifest:
        m = store.manifest(mid)
        if parsed is not None:
            parsed[mid] = m
        return m

    made = snapshot_times(store, found.values(), read, view)
    times = {step: t for step, mid in found.items() if (t := made(mid)) is not None}
    if not times:
        raise RefNotFoundError(f"no snapshot of run {run!r} in {store.url}: {latest} is missing and no {run}/step-N is a snapshot")
    step = max(times, key=lambda s: (times[s], s))
    message = (f"{latest} is missing in {store.url}: the run's newest snapshot is taken for it, step {step} "
               f"({run}/step-{step}); the next save names its own snapshot {latest}")
    warn(message)
    return found[step]


def latest_manifest(store: Store, run: str, warn: Callable[[str], None], parsed: dict[str, Manifest]) -> tuple[str, Manifest]:
    """:func:`resolve_latest`, and the manifest it names, read once (kept in ``parsed`` too)."""
    mid = resolve_latest(store, run, warn, parsed)
    m = parsed.get(mid)
    if m is None:
        m = parsed[mid] = store.manifest(mid)
    return mid, m


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

        self.path = str(path)
        self.run = run
        self.keep = keep
        self.max_bytes = max_bytes
        if durable is not None:
            _apart(self.path, durable)
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

    def make_room(self) -> list[int]:
        """Remove every snapshot but the pinned ones, the newest too, and free their data: for a
        tier too small to take a new snapshot beside the newest (the new one is worth more).
        The steps removed."""
        with self._lock:
            removed = [s for s in self.steps() if s not in self.pinned]
            targets = {self.store.resolve(self.ref(s)) for s in removed}
            for s in removed:
                self.store.remove(self.ref(s))
            latest = f"{self.run}/latest"
            try:
                if self.store.resolve(latest) in targets:
                    self.store.remove(latest)  # it would keep the dropped newest alive
            except CkptError:
                pass  # no alias here
            self._collect()
            return removed

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
    With ``reset_foreign`` (the default path, keyed by the store's URL and the run: the store
    there was made anew) another store's tier is emptied instead, with a warning.
    A store with no marker whose every ref is a snapshot of ``run`` is taken as this run's tier
    (one kept before tiers had markers)."""
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
    if have is None and _only_snapshots_of(path, run):
        return marker
    if have is None:
        raise SnapshotError(f"local={path} is a ckpt store that is not a local tier; a tier prunes and collects "
                            "what it holds", hint="give the local tier a path of its own")
    if not reset_foreign:
        raise SnapshotError(f"local={path} is the local tier of another run or store ({have!r:.120})",
                            hint="give this run's local tier a path of its own, or remove that folder")
    message = f"local tier {path} held snapshots of another store or run: emptied for this one"
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


def _only_snapshots_of(path: str, run: str) -> bool:
    """Whether the store at ``path`` names nothing but snapshots of ``run`` (RUN/step-N, RUN/latest)."""
    from ckpt.store.store import Store

    try:
        refs = Store.open(path).refs()
    except CkptError:
        return False
    return all(r == f"{run}/latest" or step_of(run, r) is not None for r in refs)


@dataclass
class Tiers:
    """Stores to read one snapshot from, nearest first, each named by a :data:`TIERS` key.
    ``served`` adds up the decoded bytes each tier delivered."""

    stores: list[tuple[str, Store]]
    served: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    # lenient: a chunk no tier serves is recorded in ``unserved`` (its buffer left as it is)
    # instead of raising, so that ranks can fetch it from peers and read again
    lenient: bool = False
    unserved: set[str] = field(default_factory=set)
    # how many of the nearest stores chunks are read from (None: all); manifests come from any
    reach: int | None = None
    # (ranks of a group) every rank's own tier names the snapshot: each reads from it first
    every_rank_holds: bool = True
    # manifests parsed so far, by id (immutable: named by the hash of their bytes)
    manifests: dict[str, Manifest] = field(default_factory=dict, repr=False)
    # chunks this restore fetched from peers into the local tier: served from there, counted as "peer";
    # those of them served with a correct hash (the refill need not hash them again)
    from_peers: set[str] = field(default_factory=set)
    peer_verified: set[str] = field(default_factory=set)

    @property
    def nearest(self) -> Store:
        return self.stores[0][1]

    def get_manifest(self, mid: str) -> Manifest:
        """The manifest ``mid`` from the nearest tier holding it intact (parsed once per restore)."""
        if mid in self.manifests:
            return self.manifests[mid]
        last: Exception | None = None
        for _, store in self.stores:
            try:
                m = self.manifests[mid] = store.manifest(mid)
                return m
            except MISSES as e:
                last = e
        assert last is not None
        raise last

    def get(self, tasks: list[GetTask], progress: Progress, manifest: Manifest | None = None) -> None:
        """Fetch every task's chunk into its buffer: each from the nearest tier holding it with a
        correct hash. The last tier runs the full pipeline and raises what it cannot serve.
        ``manifest``: the snapshot read, whose bundles serve its small chunks from a remote tier."""
        remaining = tasks
        stores = self.stores if self.reach is None else self.stores[: self.reach]
        for i, (name, store) in enumerate(stores):
            if not remaining:
                break
            if i == len(stores) - 1 and not self.lenient:
                get_chunks(store.objects, remaining, store.settings, progress, manifest=manifest)
                self._credit(name, remaining)
                return
            remaining = self._try(name, store, remaining, progress, manifest)
        self.unserved.update(t.id for t in remaining)

    def _try(self, name: str, store: Store, tasks: list[GetTask], progress: Progress,
             manifest: Manifest | None = None) -> list[GetTask]:
        """Serve what ``store`` can; the tasks it could not. Those it holds go through the full read
        pipeline (read-ahead) first; only if one of them fails is each tried on its own."""
        present = store.objects.has_many("chunks", {t.id for t in tasks})
        held = [t for t in tasks if t.id in present]
        try:
            get_chunks(store.objects, held, store.settings, NullProgress(), manifest=manifest)
        except MISSES:
            return self._each(name, store, tasks, progress)
        self._credit(name, held)
        progress.advance(sum(t.length for t in held))
        return [t for t in tasks if t.id not in present]

    def _each(self, name: str, store: Store, tasks: list[GetTask], progress: Progress) -> list[GetTask]:
        """Serve what ``store`` can, chunk by chunk; the tasks it could not."""
        missed: list[GetTask] = []
        lock = threading.Lock()

        def one(t: GetTask) -> None:
            try:
                fetch_chunk(store.objects, t.id, t.length, store.settings, out=t.into)
            except MISSES as e:
                if isinstance(e, CorruptObjectError):
                    log.warning("%s tier: chunk %s is damaged (%s); reading it from the next tier", name, t.id[:12], e)
                with lock:
                    missed.append(t)

        run_parallel(one, tasks, store.settings.workers, NullProgress(), lambda t: t.length, batch=BATCH_BYTES)
        lost = {id(t) for t in missed}
        self._credit(name, [t for t in tasks if id(t) not in lost])
        progress.advance(sum(t.length for t in tasks) - sum(t.length for t in missed))
        order = {id(t): i for i, t in enumerate(tasks)}
        return sorted(missed, key=lambda t: order[id(t)])

    def _credit(self, name: str, served: list[GetTask]) -> None:
        """Count what ``name`` served; what the local tier served of the chunks fetched from peers, as the peers'."""
        if name == "local" and self.from_peers:
            fetched = [t for t in served if t.id in self.from_peers]
            self.peer_verified.update(t.id for t in fetched)  # every chunk served was hashed
            peer_bytes = sum(t.length for t in fetched)
            self.served["peer"] += peer_bytes
            self.served[name] += sum(t.length for t in served) - peer_bytes
        else:
            self.served[name] += sum(t.length for t in served)

    def fill(self, m: Manifest, pairs: list[tuple[TensorEntry, torch.Tensor]]) -> None:
        from ckpt.store.load import fill

        fill(self.nearest, m, pairs, get=lambda tasks, progress: self.get(tasks, progress, m))


def chunk_ids(m: Manifest) -> set[str]:
    return {c for t in m.tensors for c in t.chunks}


def snapshot_step(m: Manifest) -> int | None:
    """The step a snapshot's record holds: a non-negative int, else None (no snapshot, or a damaged
    record: a bool is no step, though Python counts True as the int 1). A checkpoint that a snapshot
    manager did not write (:func:`~ckpt.snapshot.run.is_snapshot`) has no step, whatever its ``extra``
    holds: a pushed ``.pt`` with an entry named ``snapshot`` is no snapshot."""
    from ckpt.snapshot.run import is_snapshot

    if not is_snapshot(m):
        return None
    snap = m.extra.get("snapshot")
    step = snap.get("step") if isinstance(snap, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def left_behind(step: int, mid: str, made: Callable[[], float], durable: tuple[int, str, float] | None) -> bool:
    """Whether a local tier's snapshot (``step``, manifest ``mid`` made at ``made()``) is of a timeline the
    run has left, ``durable`` being the durable RUN/latest's (step, id, time made): at or after its step,
    not it, and made before it (the run was taken back, or begun anew, where this tier was not). Along a
    timeline snapshots are made in step order, and persisting copies a manifest as it is, with its time.
    ``made`` is asked only when the rest leaves the answer open (it may read and parse a manifest)."""
    return durable is not None and step >= durable[0] and mid != durable[1] and made() < durable[2]


def left_behind_message(where: str, step: int, durable_step: int) -> str:
    """What a tier says of a snapshot :func:`left_behind` skips."""
    return (f"{where}: snapshot of step {step} predates the durable store's newest (step {durable_step}): "
            "it is of a timeline the run left, not restored")


def out_of_space(e: BaseException | None, rank: int | None = None) -> bool:
    """Whether ``e``, or an error it was raised from, says the medium is full (ENOSPC, EDQUOT).
    ``rank``: in a DCP ``CheckpointException`` met on the way, whether that rank's own failure
    says so (the ranks' failures arrive pickled, without their causes: their ``errno`` tells)."""
    from ckpt_store.storage.errors import DISK_FULL

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) in DISK_FULL:
            return True
        failures = getattr(e, "failures", None)
        if rank is not None and isinstance(failures, dict) and rank in failures:
            failed = failures[rank]
            return out_of_space(failed[0] if isinstance(failed, tuple) else failed)
        e = e.__cause__ or e.__context__
    return False


def describe(e: BaseException) -> str:
    return (f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0])[:300]


__all__ = ["MISSES", "TIERS", "LocalTier", "LocalTierUsage", "Tiers", "default_local_path"]

