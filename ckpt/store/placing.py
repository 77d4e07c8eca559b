"""Renaming a pull's complete files into place (:mod:`ckpt.store.atomic_files` writes them): all or
none, and one pull at a time in a folder."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import uuid
from collections.abc import Iterator, Sequence

from ckpt.errors import DestinationError, DestinationExistsError

TMP_TAG = ".ckpt-tmp-"
OLD_TAG = ".ckpt-old-"
_TAIL = "[0-9a-f]{8}"  # what temp_name adds after the tag


def temp_name(final: str, tag: str = TMP_TAG) -> str:
    """A temporary name in ``final``'s directory (so the rename into place is atomic).

    It starts with (at most the first 200 bytes of) ``final``'s own name, so that a file name
    as long as a filesystem allows (255 bytes) still leaves room for the rest."""
    d, base = os.path.split(final)
    return os.path.join(d, f".{os.fsdecode(os.fsencode(base)[:200])}{tag}{uuid.uuid4().hex[:8]}")


def is_temp_name(name: str, final: str | None = None, tag: str = TMP_TAG) -> bool:
    """Whether ``name`` (a file name) is one :func:`temp_name` makes with ``tag``: for ``final`` if given."""
    if final is None:
        return name.startswith(".") and re.fullmatch(rf".+{re.escape(tag)}{_TAIL}", name) is not None
    head = f".{os.fsdecode(os.fsencode(os.path.basename(final))[:200])}{tag}"
    return name.startswith(head) and re.fullmatch(_TAIL, name[len(head):]) is not None


def remove_quietly(path: str) -> None:
    """Remove a file of ours while cleaning up after a failure: an error here (a read-only
    filesystem, a parent that is not a directory) must neither hide the failure being
    reported nor stop the rest of the cleanup."""
    try:
        os.unlink(path)
    except OSError:
        pass


@contextlib.contextmanager
def folders_locked(folders: Sequence[str]) -> Iterator[None]:
    """Hold each of ``folders`` locked (``flock``, exclusive) while files are renamed into them. Two pulls
    with ``--force`` into one folder at once would otherwise interleave their renames and both succeed,
    leaving some files of each checkpoint: neither, and nothing said. Locked, the second waits for the
    first's renames (moments) and then replaces its files whole. Folders are locked in one order
    (device, inode), however they are spelled, so two pulls never wait on each other; one that cannot
    be opened or locked (a filesystem without locks) is placed in unlocked."""
    held: dict[tuple[int, int], int] = {}
    try:
        for d in set(folders):
            try:
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in held:
                os.close(fd)  # (one folder spelled twice: a second lock of it would wait on the first)
            else:
                held[(st.st_dev, st.st_ino)] = fd
        for _, fd in sorted(held.items()):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL):
                    raise
        yield
    finally:
        for fd in held.values():
            os.close(fd)  # (releases its lock)


def _link_new(tmp: str, target: str) -> bool:
    """Give ``tmp``'s file the name ``target`` only if nothing has that name: True once done (the
    temporary's name removed); False where the filesystem refuses links (then a rename does it).
    Raises :class:`DestinationExistsError` when something took the name first."""
    try:
        os.link(tmp, target, follow_symlinks=False)
    except FileExistsError:
        raise DestinationExistsError(f"{target} exists (made while this pull ran)", hint="pass --force to replace it") from None
    except OSError:
        return False
    remove_quietly(tmp)
    return True


def replace_all(tmps: Sequence[str], targets: Sequence[str], overwrite: bool = True) -> None:
    """Rename each temporary over its target, all or none: a file (or link) at a target is first
    kept under a backup name beside it (a hard link: the target stays in place meanwhile; a
    rename where links are refused), so that a failure part way puts every target back as it
    was, and the backups go once all are in place."""
    olds = []
    for t in targets:
        if not os.path.lexists(t):
            olds.append(None)
        elif os.path.isdir(t) and not os.path.islink(t):  # appeared since the checks: never moved
            raise IsADirectoryError(errno.EISDIR, "a directory is in the way", t)
        elif not overwrite:  # appeared since the checks
            raise DestinationExistsError(f"{t} exists (made while this pull ran)", hint="pass --force to replace it")
        else:
            olds.append(temp_name(t, OLD_TAG))
    # (target, where its old file is kept or None, the temporary's inode): what a failure undoes is
    # decided by what is on disk, so that a signal landing between two steps is undone too.
    done: list[tuple[str, str | None, int]] = []
    try:
        for tmp, t, old in zip(tmps, targets, olds):
            done.append((t, old, os.lstat(tmp).st_ino))
            if not overwrite and _link_new(tmp, t):
                continue
            if old is not None:
                try:
                    os.link(t, old, follow_symlinks=False)
                except OSError:
                    os.rename(t, old)
            os.replace(tmp, t)
    except BaseException as e:
        unrestored = []
        for t, old, ino in reversed(done):
            try:
                now = os.lstat(t).st_ino if os.path.lexists(t) else None
                if old is None:
                    if now == ino:
                        os.unlink(t)  # the new file where there was none
                elif os.path.lexists(old):
                    if now == os.lstat(old).st_ino:
                        os.unlink(old)  # t is the old file still; old is a link to it
                    else:
                        os.replace(old, t)  # the old file back in its place
            except OSError:
                unrestored.append(f"{t} (kept as {old})" if old else t)
        if unrestored and isinstance(e, OSError):
            raise DestinationError(f"cannot write {e.filename or targets[0]}: {e.strerror or e}; and could not put "
                                   f"back {', '.join(unrestored)}", hint="check the destination's permissions") from None
        raise
    for old in olds:
        if old is not None:
            remove_quietly(old)
