"""Snapshot tiers: where a restore reads a snapshot from, nearest first (the local tier, peers'
tiers, the durable store).

The local tier is an ordinary ckpt store (``docs/format.md``, "The local tier";
:class:`~ckpt.snapshot.local_tier.LocalTier`): same format, same chunk ids as the durable
store. So persisting a snapshot copies only the chunks the durable store lacks, as stored
(never re-encoded), and a restore takes each chunk from the nearest tier that holds it with
a correct hash, falling through to the next on a miss or a bad hash (:class:`Tiers`).
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckpt.errors import first_line
from ckpt.progress import NullProgress, Progress
from ckpt.transfer.pipeline import BATCH_BYTES, GetTask, fetch_chunk, get_chunks, run_parallel
from ckpt_store.storage.errors import CorruptObjectError, ObjectNotFoundError, StorageIOError

if TYPE_CHECKING:
    import torch

    from ckpt.format.entries import TensorEntry
    from ckpt.format.manifest import Manifest
    from ckpt.store.store import Store

log = logging.getLogger(__name__)

TIERS = ("local", "peer", "store")  # nearest first: the keys of CheckpointManager.last_restore
# What makes a tier fall through to the next for one chunk or manifest (never wrong data):
# not there, damaged, or its medium failing.
MISSES = (ObjectNotFoundError, CorruptObjectError, StorageIOError, OSError)
# What the collectives and the rendezvous store of a checkpoint group raise where a peer died, hung or closed
# its sockets (gloo's errors, torch's DistBackendError and DistStoreError among them, are RuntimeErrors): the
# medium's failures where a site runs collectives, not bugs there (``also`` of :func:`caught` at those sites).
COLLECTIVE_FAILURES: tuple[type[BaseException], ...] = (RuntimeError,)


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
    # chunks this restore fetched from peers into the local tier (each verified before it was written):
    # served from there, counted as "peer"
    from_peers: set[str] = field(default_factory=set)
    # target regions a peer transfer already decoded a chunk into, verified (Peers.fetch's ``into``):
    # (chunk id, address, length); a load skips the tasks that would write the same bytes there
    filled: set[tuple[str, int, int]] = field(default_factory=set)
    # those chunks by id, each with one region holding it: not written to the local tier during the
    # transfer; the refill after the restore writes them from there (peer_targets.keep_decoded)
    decoded: dict[str, memoryview] = field(default_factory=dict, repr=False)
    # every target region the load decodes a chunk into (the dry run's, as ``filled``): a chunk the
    # durable store serves into one is noted in ``decoded`` too, so the refill keeps it as well
    targets: set[tuple[str, int, int]] = field(default_factory=set, repr=False)
    # the chunks this rank's load reads and the delta bases recorded for them (a peer restore's dry run):
    # the refill names the step in the local tier only if it holds them all (Peers.refill)
    needed: set[str] = field(default_factory=set, repr=False)
    # chunks the local tier served damaged (read from a farther tier instead), and the bases their errors
    # named: the refill writes verified copies over them (ckpt.snapshot.peer_refill)
    damaged: set[str] = field(default_factory=set, repr=False)

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
        remaining = self._skip_filled(tasks, progress) if self.filled else tasks
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

    def _skip_filled(self, tasks: list[GetTask], progress: Progress) -> list[GetTask]:
        """The tasks left once those whose chunk a peer transfer decoded into their target (verified
        there) are counted as the peers'."""
        left, done = [], []
        for t in tasks:
            (done if t.into is not None and (t.id, address(t.into), t.length) in self.filled else left).append(t)
        self.served["peer"] += sum(t.length for t in done)
        progress.advance(sum(t.length for t in done))
        return left

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
                bad = isinstance(e, CorruptObjectError)
                if bad:
                    log.warning("%s tier: chunk %s is damaged (%s); reading it from the next tier", name, t.id[:12], e)
                with lock:
                    missed.append(t)
                    if bad and name == "local":  # (the error names the blob that failed: this chunk's, or a base's)
                        self.damaged.update({t.id, e.object_id} if e.kind == "chunk" else {t.id})

        run_parallel(one, tasks, store.settings.workers, NullProgress(), lambda t: t.length, batch=BATCH_BYTES)
        lost = {id(t) for t in missed}
        self._credit(name, [t for t in tasks if id(t) not in lost])
        progress.advance(sum(t.length for t in tasks) - sum(t.length for t in missed))
        order = {id(t): i for i, t in enumerate(tasks)}
        return sorted(missed, key=lambda t: order[id(t)])

    def _credit(self, name: str, served: list[GetTask]) -> None:
        """Count what ``name`` served; what the local tier served of the chunks fetched from peers, as the peers'.
        Note what the durable store served into the targets of a peer restore (``targets``), for the refill."""
        if name == "local" and self.from_peers:
            fetched = [t for t in served if t.id in self.from_peers]
            peer_bytes = sum(t.length for t in fetched)
            self.served["peer"] += peer_bytes
            self.served[name] += sum(t.length for t in served) - peer_bytes
        else:
            self.served[name] += sum(t.length for t in served)
        if name == "store" and self.targets:
            for t in served:
                if t.into is not None and t.length and (t.id, address(t.into), t.length) in self.targets:
                    self.decoded.setdefault(t.id, t.into)

    def fill(self, mid: str, pairs: list[tuple[TensorEntry, torch.Tensor]]) -> None:
        """Decode snapshot ``mid``'s entries into ``pairs``' tensors (:func:`ckpt.store.load.fill`, whose
        refusals name the snapshot), each chunk from the nearest tier that serves it."""
        from ckpt.store.load import fill

        m = self.get_manifest(mid)
        fill(self.nearest, m, pairs, get=lambda tasks, progress: self.get(tasks, progress, m), what=f"snapshot {mid[:12]}")


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


def address(view: memoryview) -> int:
    """Where a writable, non-empty buffer's first byte lies in memory."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e)}"[:300]


def caught(logger: logging.Logger, where: str, e: BaseException,
           also: tuple[type[BaseException], ...] = (), trace: Sequence[traceback.FrameSummary] | None = None) -> str:
    """:func:`describe` of ``e``, caught where a failure must never fail a training step (a refill beside it),
    or turned into one of ours: one of ours (:class:`CkptError`), the medium's (``OSError``) or one of the types
    ``also`` names (the site's medium's: :data:`COLLECTIVE_FAILURES` where it runs collectives) is said in that
    one line; any other type is a bug, logged at WARNING with its traceback too (the record's ``unexpected``
    set: the tests fail on it). ``trace``: where ``e`` was raised, for an error that lost its traceback on the way (a
    rank's failure DCP gathered, pickled: :func:`~ckpt.snapshot.distributed_restore.first_failure`)."""
    if not expected(e, also):
        frames = "".join(traceback.format_list(trace)) if trace and e.__traceback__ is None else ""
        logger.warning("%s: unexpected %s%s", where, describe(e), f"\n(raised at)\n{frames.rstrip()}" if frames else "",
                       exc_info=e, extra={"unexpected": True})
    return describe(e)


def expected(e: BaseException, also: tuple[type[BaseException], ...] = ()) -> bool:
    """Whether ``e`` is a failure a tier meets (ours, :class:`CkptError`, the medium's, ``OSError``, or one of
    ``also``), not a bug; nor is what is no ``Exception`` (a KeyboardInterrupt a rank met in a DCP save, which DCP
    gathers as that rank's failure)."""
    from ckpt_store.storage.errors import CkptError

    return isinstance(e, (CkptError, OSError, *also)) or not isinstance(e, Exception)


__all__ = ["MISSES", "TIERS", "Tiers"]
