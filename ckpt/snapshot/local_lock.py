"""One manager per local tier: an exclusive ``flock`` on the tier's folder, held from before its marker is read
until the manager lets go (``docs/format.md``, "The local tier"). Two managers on one tier would prune and
collect each other's snapshots: a tier is collected with no grace period because its manager is its only writer."""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

TIER_MARKER = "ckpt-local-tier.json"  # {"store_id": the durable store's, "run": ...}: whose tier this is (local_claim)
LOCK_WAIT_S = 30.0  # how long a manager waits for a tier another process holds (one exiting, say)
# The tier folders (device, inode) this process holds, so that a second manager of this process on one
# of them is refused at once: its holder cannot let go while this process waits for it.
_HELD: set[tuple[int, int]] = set()
# The descriptors holding them. A child forked while one is held (a DataLoader's workers, a multiprocessing
# pool) shares its open file and with it the lock, which then outlived close() and the holder's death while the
# child lived: the next manager of that tier waited and was refused. A child closes its copies as it starts.
_FDS: set[int] = set()
_SHARED: set[int] = set()  # the descriptors of the shared locks writers other than the manager hold (keeping_off)
# The store through which the manager holding each of those tiers writes into it (:func:`own`): only its writes pass
# keeping_off. Any other store of this process on that folder (``ckpt.Store.open(PATH)``, a merge into it) is refused
# as another process's is: "this process holds the tier" let it through, and a push beside the manager's saves had its
# manifest collected (the tier's gc keeps no grace) under a ref it then wrote; a gc deleted a save's objects.
_OWN: dict[tuple[int, int], weakref.ref[object]] = {}
# Descriptors opened and not yet holding their lock (hold() waits up to LOCK_WAIT_S for it): a child forked meanwhile
# would keep the lock the parent takes next. Opened and registered under _HELD_LOCK, which a fork waits for.
_PENDING: set[int] = set()
# Reentrant: a manager freed by a collection that an allocation under it set off (a reference cycle) lets go of its
# tier in its finalizer, on this thread (a plain lock hung there, and every fork after it).
_HELD_LOCK = threading.RLock()


def _forked() -> None:
    """In a child just forked: close its copies of the tier locks' descriptors (the parent's lock stays), with a
    lock of its own (the parent's was held across the fork, :func:`os.register_at_fork`'s ``before``)."""
    global _HELD_LOCK
    for fd in _FDS | _SHARED | _PENDING:
        try:
            os.close(fd)
        except OSError:
            pass
    _FDS.clear()
    _SHARED.clear()
    _PENDING.clear()
    _HELD.clear()
    _OWN.clear()
    _HELD_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):  # (a fork waits for a descriptor being opened and registered)
    os.register_at_fork(before=lambda: _HELD_LOCK.acquire(), after_in_parent=lambda: _HELD_LOCK.release(),
                        after_in_child=_forked)


def _open_dir(path: str, into: set[int], flags: int = 0) -> int:
    """``path`` opened (a folder, not inherited by programs run; with ``flags`` too), registered in ``into`` as one
    step: no fork falls between."""
    with _HELD_LOCK:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0) | flags)
        into.add(fd)
        return fd


def _close(fd: int, within: set[int]) -> None:
    """Close ``fd`` where this process still registers it in ``within`` (a forked child closed its copies)."""
    with _HELD_LOCK:
        if fd in within:
            within.discard(fd)
            os.close(fd)


def hold(path: str) -> int:
    """An exclusive ``flock`` on the tier's folder, held while its manager lives (the descriptor;
    :func:`let_go` releases it).

    Two managers on one tier would prune and collect each other's snapshots: a tier is
    collected with no grace period because its manager is its only writer. A holder in
    this process that is no longer referenced (a notebook cell run again) is collected
    first, or once the save it had in flight is done; any holder is waited for up to
    :data:`LOCK_WAIT_S` (a restarted job whose old process is still exiting), then refused,
    saying whether it is of this process. (Refusing one of this process at once refused that
    notebook's second manager while the first one's save was still running.)"""
    from ckpt.snapshot.run import SnapshotError

    deadline = time.monotonic() + LOCK_WAIT_S
    collected, warned = 0.0, False
    fd = None
    while True:
        if fd is None:
            try:
                fd = _open_dir(path, _PENDING)
            except FileNotFoundError as e:  # removed (`ckpt tiers rm`) since its folder was made: made again
                try:
                    if time.monotonic() >= deadline:
                        raise e
                    os.makedirs(path, exist_ok=True)
                except OSError as again:
                    raise _cannot_lock(path, again) from None
                continue
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _names(path, key):
                # Removed while this waited (`ckpt tiers rm` held it): the lock is on a folder no longer at the
                # path, and the manager would write into a new one made there, unlocked, beside another manager.
                _close(fd, _PENDING)
                fd = None
                if time.monotonic() >= deadline:  # (never spins: a folder that keeps changing under it is refused)
                    raise SnapshotError(f"local tier {path} was replaced while it was being locked, and again within "
                                        f"{LOCK_WAIT_S:g} s", hint="give the local tier a folder nothing else removes")
                continue
            with _HELD_LOCK:
                _PENDING.discard(fd)
                _HELD.add(key)
                _FDS.add(fd)
            return fd
        except BlockingIOError:
            pass
        except OSError as e:  # (not "held": this filesystem cannot lock, an NFS mount without its lock service, say)
            _close(fd, _PENDING)
            raise _cannot_lock(path, e) from None
        if time.monotonic() - collected >= 1.0:
            # An unreferenced earlier manager of this process lets go as it is freed: at once, or once
            # the save it had in flight (which holds it) is done.
            gc.collect()
            collected = time.monotonic()
            continue
        if time.monotonic() >= deadline:
            _close(fd, _PENDING)
            with _HELD_LOCK:
                ours = key in _HELD
            # (a write by another hand holds it shared meanwhile: keeping_off)
            where = "of this process" if ours else "(in this process or another; or a push, copy or gc writing into it)"
            raise SnapshotError(f"local tier {path} is in use by another CheckpointManager {where} and was not let go "
                                f"within {LOCK_WAIT_S:g} s",
                                hint="close the other manager first (mgr.close(), or `with CheckpointManager(...)`; "
                                     "one dropped with a save in flight lets go once that save is done), or give "
                                     "this one a local=PATH of its own")
        if not warned:
            log.warning("waiting for local tier %s: another CheckpointManager holds it", path)
            warned = True
        time.sleep(0.1)


# What flock says on a filesystem that has no locks (an NFS mount without its lock service, some FUSE mounts).
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


def _cannot_lock(path: str, e: OSError) -> Exception:
    """The one-line error for a tier folder whose ``flock`` failed with ``e`` (not because another holds it): the raw
    OSError reached the user as a traceback. Without the lock, one manager per tier cannot be made sure of."""
    from ckpt.snapshot.run import SnapshotError
    from ckpt.snapshot.tiers import describe

    if e.errno in NO_LOCKS:
        return SnapshotError(f"local tier {path} cannot be locked: its filesystem has no flock ({describe(e)})",
                             hint="give the local tier a folder on a local disk or tmpfs (local=PATH, under /dev/shm "
                                  "say): two managers on one tier would delete each other's snapshots, and only the "
                                  "lock keeps them apart")
    return SnapshotError(f"local tier {path} cannot be locked ({describe(e)})",
                         hint="give the local tier a folder on a local disk or tmpfs (local=PATH)")


def _names(path: str, key: tuple[int, int]) -> bool:
    """Whether ``path`` names the folder ``key`` (device, inode) now."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == key


def held(path: str) -> bool | None:
    """Whether a manager (or a write :func:`keeping_off` lets in) holds the tier folder ``path`` now: a shared
    ``flock`` taken without waiting is refused (True), or taken and let go at once (False); None where it cannot
    be told (no such folder, a link, which is never followed, or a filesystem without ``flock``)."""
    try:
        fd = _open_dir(path, _SHARED, os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        _close(fd, _SHARED)


@contextmanager
def taken(path: str) -> Iterator[None]:
    """Hold the tier folder ``path`` as a manager would (an exclusive ``flock``), without waiting, while the block
    runs (`ckpt tiers rm` removes it meanwhile: a manager starting then waits, and takes the folder made anew, never
    the half-removed one). Raises :class:`SnapshotError` where another holds it, or it cannot be locked; ``path``
    must be a folder, not a link (never followed)."""
    from ckpt.snapshot.run import SnapshotError

    try:
        fd = _open_dir(path, _PENDING, os.O_NOFOLLOW)
    except OSError as e:  # (gone meanwhile, a link put there, no permission)
        from ckpt.snapshot.tiers import describe

        raise SnapshotError(f"local tier {path} cannot be opened ({describe(e)}): nothing removed",
                            hint="`ckpt tiers` lists the local tiers") from None
    try:
        st = os.fstat(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SnapshotError(f"local tier {path} is in use by a CheckpointManager (or a push, copy or gc writing "
                                "into it): nothing removed", hint="close that manager first (its job ends, or "
                                "mgr.close()); `ckpt tiers` shows which tiers are held") from None
        except OSError as e:
            raise _cannot_lock(path, e) from None
        if not _names(path, (st.st_dev, st.st_ino)):  # (replaced since it was opened)
            raise SnapshotError(f"local tier {path} changed while it was being locked: nothing removed",
                                hint="run the command again")
        yield
    finally:
        _close(fd, _PENDING)


def let_go(fd: int, pid: int | None = None) -> None:
    """Release a tier :func:`hold` took in process ``pid`` (forgotten as this process's first: no other manager here
    can have taken it before the descriptor closes). Nothing in a forked child, whose copy was closed as it started:
    the number may name a lock of its own by then (a manager it made: a finalizer of the parent's manager, inherited,
    closed that one's lock, and a third process took the tier beside it)."""
    if pid is not None and pid != os.getpid():
        return
    with _HELD_LOCK:
        if fd not in _FDS:
            return
        _FDS.discard(fd)
        st = os.fstat(fd)
        _HELD.discard((st.st_dev, st.st_ino))
        _OWN.pop((st.st_dev, st.st_ino), None)
        os.close(fd)


def own(fd: int, store: object) -> None:
    """Name ``store`` the one through which the manager holding its tier (``fd``, from :func:`hold`) writes into it:
    its writes (saves, prunes, the tier's gc) pass :func:`keeping_off`, and no other store's do."""
    st = os.fstat(fd)
    with _HELD_LOCK:
        if fd in _FDS:
            _OWN[(st.st_dev, st.st_ino)] = weakref.ref(store)


@contextmanager
def keeping_off(store: object) -> Iterator[None]:
    """Around a write into ``store`` by anything but the manager of its tier (a push, a copy to it, a gc, a repair, a
    DCP save): where it is a local tier (its folder holds :data:`TIER_MARKER`) that a manager holds, refuse; else
    hold a shared ``flock`` on its folder while the write runs, so that a manager waits for it.
    A tier is collected with no grace period because its manager is its only writer: a `ckpt push` into one in use
    exited 0 with its ref naming a manifest the manager's gc had deleted meanwhile (and that gc then freed nothing,
    the ref unreadable). The manager writes into its own tier through its store (:func:`own`); any other store, of
    this process too, is refused while it holds the tier. Any writer may write where the filesystem has no
    ``flock``."""
    from ckpt.snapshot.run import SnapshotError

    local = store.backend.local_path(".")  # type: ignore[attr-defined]
    root = os.path.normpath(local) if local is not None else None
    fd = None
    if root is not None and os.path.lexists(os.path.join(root, TIER_MARKER)):
        try:
            fd = _open_dir(root, _SHARED)
            st = os.fstat(fd)
            with _HELD_LOCK:
                holder = _OWN.get((st.st_dev, st.st_ino))
            if holder is not None and holder() is store:
                raise OSError  # (its manager's own write; a lock of another open file of this process would conflict)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            _close(fd, _SHARED)  # type: ignore[arg-type]
            raise SnapshotError(f"{root} is a local tier a CheckpointManager holds: it collects the tier with no grace "
                                "period, so what is written there meanwhile (or collected) would be lost",
                                hint="write to another store (the tier's persisted snapshots are in its durable "
                                     "store), or once that manager has closed") from None
        except OSError:  # gone (the write finds out), this process's tier, or no flock here (nothing can be told)
            if fd is not None:
                _close(fd, _SHARED)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            _close(fd, _SHARED)  # (not in a forked child, which closed its copy)


__all__ = ["LOCK_WAIT_S", "TIER_MARKER", "held", "hold", "keeping_off", "let_go", "own", "taken"]
