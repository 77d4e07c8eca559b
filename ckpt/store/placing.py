"""Renaming a pull's complete files into place (:mod:`ckpt.store.atomic_files` writes them): all or
none, one pull at a time in a folder, and journaled, so that what a pull killed part way through its
renames left (some files new, some old, the old kept under backup names) is known to the next pull.

The journal is a small JSON file, ``.ckpt-placing-XXXXXXXX`` in the folder the targets share,
locked (flock) by the pull writing it, made before its first rename and removed after its last
backup. One found there that no process holds locked was left by a pull that died placing its files:
it lists each target with its backup (``.NAME.ckpt-old-XXXXXXXX``) and temporary. Only files the
journal lists *and* named as this module names them for that target are ever removed, so a journal
made by hand cannot remove a user's file.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence

from ckpt.errors import DestinationError, DestinationExistsError

log = logging.getLogger(__name__)

TMP_TAG = ".ckpt-tmp-"
OLD_TAG = ".ckpt-old-"
_JOURNAL = re.compile(r"\.ckpt-placing-[0-9a-f]{8}")
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


def journal_folder(targets: Sequence[str]) -> str:
    """The folder every target lies in or below: where a placement's journal goes."""
    return os.path.commonpath([os.path.abspath(os.path.dirname(t) or ".") for t in targets])


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


# renameat2(2) with RENAME_NOREPLACE (Linux 3.15, glibc 2.28): a rename that fails with EEXIST where
# anything has the new name. rename(2) replaces a file there, and an empty directory too.
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
# What says "not here" rather than "no": a filesystem without the flag (NFS, some FUSE filesystems:
# EINVAL), a kernel without the call (ENOSYS), a sandbox refusing it (EPERM; a real EPERM fails the
# fallback again, and that error is the one reported).
_NOREPLACE_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM})


def _libc_renameat2() -> Callable[..., int] | None:
    """glibc's renameat2, or None (another libc, another system)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def rename_new(src: str, dst: str) -> bool:
    """Rename ``src`` to ``dst`` only if nothing has that name, in one step: True once done.

    Raises :class:`FileExistsError` when something is there (a file, a link, a directory, empty or
    not: rename(2) would replace an empty one, or a file), and :class:`OSError` for other refusals.
    False, nothing done, where this system cannot rename so (another libc, a kernel or filesystem
    without ``RENAME_NOREPLACE``): then the caller's fallback has a gap, said where it is used."""
    old, new = os.fsencode(src), os.fsencode(dst)
    if b"\0" in old or b"\0" in new:  # (C would end the path there: another file's name)
        raise ValueError("embedded null byte")
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, old, _AT_FDCWD, new, _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NOREPLACE_UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), src, None, dst)  # (FileExistsError for EEXIST)


def _take_new(tmp: str, target: str) -> bool:
    """Give ``tmp``'s file the name ``target`` only if nothing has that name: True once done (the
    temporary's name gone). Raises :class:`DestinationExistsError` when something took the name
    first. False where neither a rename that never replaces (:func:`rename_new`) nor a hard link
    can be made there (some FUSE filesystems): the caller's plain rename then replaces a file
    made at that name since the checks, the one gap left."""
    try:
        if rename_new(tmp, target):
            return True
        os.link(tmp, target, follow_symlinks=False)
    except FileExistsError:
        raise DestinationExistsError(f"{target} exists (made while this pull ran)", hint="pass --force to replace it") from None
    except OSError:
        return False  # (an error that is not about the name: the rename says it again)
    remove_quietly(tmp)
    return True


def replace_all(tmps: Sequence[str], targets: Sequence[str], overwrite: bool = True) -> None:
    """Rename each temporary over its target, all or none: a file (or link) at a target is first
    kept under a backup name beside it (a hard link: the target stays in place meanwhile; a
    rename where links are refused), so that a failure part way puts every target back as it
    was, and the backups go once all are in place. A journal lists them meanwhile (see above).
    Without ``overwrite`` a temporary takes its target's name only if nothing has it (:func:`_take_new`)."""
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
    # A single new file is placed by one rename: nothing to journal.
    journal = _begin(tmps, targets, olds) if len(targets) > 1 or olds[0] is not None else None
    # (target, where its old file is kept or None, the temporary's inode): what a failure undoes is
    # decided by what is on disk, so that a signal landing between two steps is undone too.
    done: list[tuple[str, str | None, int]] = []
    try:
        for tmp, t, old in zip(tmps, targets, olds):
            done.append((t, old, os.lstat(tmp).st_ino))
            if not overwrite and _take_new(tmp, t):
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
        if journal is not None and not unrestored:
            _end(journal)
        if unrestored and isinstance(e, OSError):
            raise DestinationError(f"cannot write {e.filename or targets[0]}: {e.strerror or e}; and could not put "
                                   f"back {', '.join(unrestored)}", hint="check the destination's permissions") from None
        raise
    for old in olds:
        if old is not None:
            remove_quietly(old)
    if journal is not None:
        _end(journal)


def _begin(tmps: Sequence[str], targets: Sequence[str], olds: Sequence[str | None]) -> tuple[str, int]:
    """Write (flushed, fsynced) and lock the journal of a placement about to start: (its path, its descriptor)."""
    folder = journal_folder(targets)
    rel = [os.path.relpath(os.path.abspath(t), folder) for t in targets]
    files = [{"target": r, "old": os.path.basename(o) if o else None,
              "temp": os.path.basename(tmp) if os.path.dirname(os.path.abspath(tmp)) == os.path.dirname(os.path.abspath(t)) else None}
             for r, t, o, tmp in zip(rel, targets, olds, tmps)]
    path = os.path.join(folder, f".ckpt-placing-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (new: nobody else holds it)
        os.write(fd, json.dumps({"ckpt": "placing", "version": 1, "files": files}, sort_keys=True).encode())
        os.fsync(fd)
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)  # the journal is on disk before any rename it describes
        finally:
            os.close(dfd)
    except BaseException:
        os.close(fd)
        remove_quietly(path)
        raise
    return path, fd


def _end(journal: tuple[str, int]) -> None:
    path, fd = journal
    remove_quietly(path)
    os.close(fd)


def _left_journals(folder: str) -> Iterator[tuple[str, list[dict[str, str | None]]]]:
    """Journals in ``folder`` no live process holds: (path, the files each lists, their names checked)."""
    try:
        names = [n for n in os.listdir(folder) if _JOURNAL.fullmatch(n)]
    except OSError:
        return
    for n in sorted(names):
        path = os.path.join(folder, n)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue  # gone meanwhile, or a link: not a journal of ours
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue  # a FIFO, a device, a folder: not a journal, whatever its name
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live pull's (or a filesystem without locks: nothing can be known)
            try:
                files = json.loads(os.read(fd, 1 << 24))["files"]
            except (OSError, ValueError, KeyError, TypeError):
                files = []
            yield path, [f for f in files if isinstance(f, dict) and _sound(f)]
        finally:
            os.close(fd)


def _sound(f: dict[str, str | None]) -> bool:
    """Whether a journal's entry names a target inside its folder, and a backup and temporary as
    :func:`temp_name` names them for it (anything else is never touched)."""
    target = f.get("target")
    if not isinstance(target, str) or os.path.isabs(target) or ".." in target.split(os.sep):
        return False
    return all(f.get(k) is None or (isinstance(f.get(k), str) and is_temp_name(str(f.get(k)), target, tag))
               for k, tag in (("old", OLD_TAG), ("temp", TMP_TAG)))


def clear_left(folders: Sequence[str], overwrite: bool) -> None:
    """Deal with what pulls killed while placing files in ``folders`` left (called with the folders
    locked): say what happened and, with ``overwrite`` (the pull replaces what is there), remove the
    backups and temporaries their journals list, then the journals; without, leave them, and say
    that a pull with --force removes them."""
    for folder in sorted(set(folders)):
        for path, files in _left_journals(folder):
            found = []
            for f in files:
                d = os.path.dirname(os.path.join(folder, str(f["target"])))
                found += [os.path.join(d, str(f[k])) for k in ("old", "temp") if f.get(k) and os.path.isfile(os.path.join(d, str(f[k])))]
            what = (f"a pull killed while putting {len(files)} files in place in {folder} left some of them new, "
                    f"the rest as they were")
            if not overwrite:
                log.warning("%s (%d old copies and temporaries kept beside them, and %s); a pull with --force "
                            "into it replaces them all and removes these", what, len(found), os.path.basename(path))
                continue
            for p in found:
                remove_quietly(p)
            remove_quietly(path)
            log.warning("%s; removed its %d old copies and temporaries (%s)", what, len(found),
                        ", ".join(os.path.basename(p) for p in found[:3]) + (" ..." if len(found) > 3 else ""))


def left_note(folder: str) -> str:
    """A few words on a killed pull's leftovers in ``folder`` (for a refusal's message), or ''."""
    if not any(True for _ in _left_journals(folder)):
        return ""
    return "; a pull killed while putting its files in place left it part new, part old, the old kept under hidden names"
