"""Leases: how writers and gc keep off each other on stores that cannot touch an object.

On a local store a writer touches every object it is about to name, and gc's delete
cannot miss a touch (docs/format.md, "Garbage collection"). An object store (S3) has no
touch: a push that reuses a chunk stored long ago (its ref since removed) could check
that the chunk is there, while a gc that read the refs before the push's ref landed
deletes it, and the push would publish a ref that cannot load. So there, each side
writes a small object under ``locks/`` before it looks for the other's:

* gc writes ``locks/gc-<token>.json`` and keeps it fresh while it plans and deletes;
  before it lists the objects and reads the refs, it reads every fresh writer lease and
  keeps alive what they name.
* A writer about to name objects (a push's commit, a copy) writes
  ``locks/write-<token>.json`` naming them, then lists ``locks/``: while a gc lock of
  that listing is still there and fresh (that gc may have read the leases before this one
  was written), it waits; a gc that starts later reads this lease. Then it checks its
  objects are present, writes manifest and ref, and drops its lease.

Each side writes before it looks, so at least one of them sees the other. A lock is
*fresh* while it was written less than :data:`STALE_S` before the newest write of the
looker's own lock, both times as the server stamped them in one listing (no clocks are
compared). Each side rewrites its lock every :data:`REFRESH_S`, and stops (gc) or
refuses to move a ref (writer) once its last rewrite is :data:`STALE_S` / 2 old by its
own clock: the other side may take it for the lock of a process that died.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ckpt_store.storage.backends.base import Entry
from ckpt_store.storage.errors import InvalidNameError, StorageIOError, StoreFormatError
from ckpt_store.storage.objects import ObjectStore, check_id

log = logging.getLogger(__name__)

LOCKS = "locks"
STALE_S = 120.0  # a lock not rewritten for this long is a dead process's
REFRESH_S = 15.0
POLL_S = 1.0  # how often a writer waiting for a gc looks again
MAX_LEASE_BYTES = 64 << 20  # a lease names ~70 bytes per object: a million objects


@dataclass
class Lock:
    """One side's lock under ``locks/``, rewritten by a thread while it is held."""

    objects: ObjectStore
    kind: str  # "gc" or "write"
    body: dict[str, object] = field(default_factory=dict)
    path: str = ""
    _written: float = 0.0  # monotonic time at which the last successful write began
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.path = f"{LOCKS}/{self.kind}-{uuid.uuid4().hex}.json"
        self.body = {"kind": self.kind, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                     **self.body}
        self._data = json.dumps(self.body, sort_keys=True).encode()

    def _write(self) -> None:
        began = time.monotonic()
        self.objects.backend.write(self.path, self._data)
        self._written = began

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self._write()
            except Exception as e:  # noqa: BLE001 - fresh() turns false and the holder stops
                log.warning("could not refresh %s: %s", self.path, e)

    def __enter__(self) -> Lock:
        self._write()
        self._thread = threading.Thread(target=self._refresh, name=f"ckpt-{self.kind}-lock", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.objects.backend.delete(self.path)
        except Exception as e:  # noqa: BLE001 - a lock left behind goes stale and is removed by a later gc
            log.warning("could not remove %s: %s", self.path, e)

    def fresh(self) -> bool:
        """True while the other side still takes this lock for a live process's."""
        return time.monotonic() - self._written < STALE_S / 2

    def others(self) -> tuple[list[Entry], list[Entry]]:
        """The other fresh locks under ``locks/`` and the stale ones, by one listing."""
        entries = [e for e in self.objects.backend.list(LOCKS) if e.path.endswith(".json")]
        own = [e.mtime for e in entries if e.path == self.path]
        if not own:
            raise StorageIOError(f"{self.path} vanished from the store while it was held (removed by hand?)")
        fresh, stale = [], []
        for e in entries:
            if e.path != self.path:
                (fresh if own[0] - e.mtime < STALE_S else stale).append(e)
        return fresh, stale


def _kind(e: Entry) -> str:
    return e.path.rsplit("/", 1)[-1].split("-", 1)[0]


@contextmanager
def gc_lock(objects: ObjectStore) -> Iterator[Lock | None]:
    """Held by a gc that deletes, from before its listing to its last delete (None where
    the backend touches objects: there the delete protocol needs no lock)."""
    if objects.backend.touches:
        yield None
        return
    with Lock(objects, "gc") as lock:
        yield lock


def leased(lock: Lock) -> set[str]:
    """The objects fresh writer leases name, for the gc holding ``lock`` to keep alive.
    Stale locks (of processes that died) are removed. A lease that cannot be read stops
    the gc: what it protects is unknown."""
    fresh, stale = lock.others()
    for e in stale:
        lock.objects.backend.delete(e.path)
    keep: set[str] = set()
    for e in fresh:
        if _kind(e) != "write":
            continue
        try:
            if e.size > MAX_LEASE_BYTES:
                raise ValueError(f"{e.size} bytes")
            body = json.loads(lock.objects.backend.read(e.path))
            for key in ("chunks", "manifests"):
                keep.update(check_id(oid) for oid in body[key])
        except FileNotFoundError:
            continue  # its writer is done: its ref landed before this gc reads the refs
        except (ValueError, KeyError, TypeError, InvalidNameError) as err:
            raise StoreFormatError(f"{e.path}: a writer's lease that cannot be read ({err}); gc deletes nothing "
                                   "while it is fresh (remove it if no push or copy is running)") from None
    return keep


@contextmanager
def writer_lease(objects: ObjectStore, chunks: Iterable[str], manifests: Iterable[str]) -> Iterator[Lock | None]:
    """Held by a writer from before it checks that ``chunks`` and ``manifests`` are present
    until its ref has moved; waits first for any gc running elsewhere to finish (None where
    the backend touches objects instead)."""
    if objects.backend.touches:
        yield None
        return
    with Lock(objects, "write", {"chunks": sorted(set(chunks)), "manifests": sorted(set(manifests))}) as lease:
        # Only a gc whose lock was there when this lease was first listed may have read the leases
        # before it: one that comes later reads this lease (so a gc run after gc cannot starve writers).
        before = {e.path for e in lease.others()[0] if _kind(e) == "gc"}
        warned = False
        while before:
            if not warned:
                log.warning("waiting for a gc running on this store elsewhere to finish (%s)", sorted(before)[0])
                warned = True
            time.sleep(POLL_S)
            before &= {e.path for e in lease.others()[0]}
        yield lease


def check_fresh(lock: Lock | None, what: str) -> None:
    """Raise where ``lock`` may already be taken for a dead process's (this one was paused
    or its refreshes failed): what it protects may be gone."""
    if lock is not None and not lock.fresh():
        raise StorageIOError(f"{what}: its lock on the store was not refreshed for {STALE_S / 2:.0f} s "
                             "(the process was paused, or the store did not answer); run it again")
