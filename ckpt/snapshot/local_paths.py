"""Where a run's local tier lives unless given (``docs/format.md``, "The local tier"): below a per-user folder
in /dev/shm (or ``$CKPT_LOCAL_DIR``), which must be this user's own, at a path keyed by the durable store (its id
and its URL) and the run; a process group's ranks each in a folder below it."""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path


def default_local_path(store_id: str, store_url: str, run: str, rank: int | None = None) -> Path:
    """Where a run's local tier lives unless given: under ``$CKPT_LOCAL_DIR`` if set, else
    /dev/shm (host memory, survives a crash of the training process but not of the machine),
    else the temp directory; keyed by the durable store and the run so that a restarted
    process finds it again.

    The store is its id (``ckpt-store.json``) and its URL. The URL alone named one tier for
    two stores at s3://BUCKET/PREFIX on two endpoints (or any other storage option that picks
    the server): the second manager emptied the first one's tier as another store's, and a
    store made anew where the real one was not mounted yet emptied the real one's. The id
    alone would name one tier for a store and its copy (``cp -r``, a synced bucket), whose
    runs part ways: one would resume the other's snapshots."""
    env = os.environ.get("CKPT_LOCAL_DIR")
    if env:
        root = Path(env)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        root = Path("/dev/shm")
    else:
        root = Path(tempfile.gettempdir())
    key = hashlib.blake2b(f"{store_id}\0{store_url}\0{run}".encode(), digest_size=6).hexdigest()
    user = os.getuid() if hasattr(os, "getuid") else 0
    path = root / f"ckpt-local-{user}" / key
    return path / f"rank-{rank}" if rank is not None else path


def adopt_old_key(path: Path, store_id: str, store_url: str, run: str, rank: int | None = None) -> bool:
    """Move the tier this run kept at the old default key (a hash of the store's URL and the run alone, before
    the store's id was in it: never found again, it held its memory in /dev/shm until removed) to ``path``,
    its key now (:func:`default_local_path`); a process group's ranks' folders move with their key's folder.
    Only where the old key's folder exists, the new one does not, and every tier there is marked as this store's
    (by id) of ``run``; under the lock a manager holds on a tier (``flock`` on its folder), taken without
    waiting: a tier held is left as it is. Whether it moved."""
    import fcntl

    from ckpt.snapshot.local_claim import marks, read_marker
    from ckpt.store.placing import rename_new

    key = path if rank is None else path.parent
    old = key.parent / hashlib.blake2b(f"{store_url}\0{run}".encode(), digest_size=6).hexdigest()
    if os.path.lexists(key) or os.path.islink(old) or not os.path.isdir(old):
        return False
    tiers = [old] if rank is None else [old / n for n in sorted(os.listdir(old)) if n.startswith("rank-")]
    fds: list[int] = []
    try:
        for tier in tiers:
            if not marks(read_marker(tier), store_id, run):
                return False
            fds.append(os.open(tier, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)))
            fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not tiers or os.path.lexists(key):
            return False
        # Never over a folder made at the key since the look above (FileExistsError: another rank's or process's
        # tier, which may hold it open and locked already): rename(2) replaces an empty folder, and its holder then
        # wrote into a folder no longer at that path (its snapshots lost from view).
        if not rename_new(os.fspath(old), os.fspath(key)):
            os.rename(old, key)  # (no RENAME_NOREPLACE here, NFS or FUSE say: that gap, moments wide, stays)
    except (OSError, ValueError, RecursionError):  # held (BlockingIOError), unmarked or damaged, or a race lost
        return False
    finally:
        for fd in fds:
            os.close(fd)
    return True


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


def check_default_layout(path: Path, rank: int | None) -> None:
    """Refuse the default path of a run's tier where the other layout holds it: a process group's ranks keep
    theirs in ``KEY/rank-R``, one process its tier in ``KEY`` itself (a store cannot hold another), so the
    same run of the same store cannot have both on one node (a job run with torchrun, then alone)."""
    from ckpt.snapshot.run import SnapshotError
    from ckpt_store.storage.config import CONFIG_PATH

    key = path if rank is None else path.parent
    if rank is not None and os.path.lexists(key / CONFIG_PATH):
        found = f"{key} holds the local tier of this run kept by a single process"
    elif rank is None and not os.path.lexists(key / CONFIG_PATH) and any(
            n.startswith("rank-") for n in (os.listdir(key) if os.path.isdir(key) else ())):
        found = f"{key} holds the local tiers of this run's ranks, kept by a process group"
    else:
        return
    raise SnapshotError(f"the default local tier of this run cannot be kept: {found}",
                        hint="pass local=PATH (a folder of its own) or local=False; or remove that folder once "
                             "its snapshots are not needed (those persisted are in the durable store)")


__all__ = ["adopt_old_key", "check_default_layout", "default_local_path", "private_root"]
