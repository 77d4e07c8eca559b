"""Writing a destination's files all or nothing (the rules are :mod:`ckpt.store.destination`'s): each
file under a temporary name beside its target, locked by the process writing it, then all renamed into
place together (a file replaced is kept under a backup name until every rename is done, so that a
failure part way puts each back); what killed pulls left is swept, and what a process ending at once
leaves is removed (:func:`abandon`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from ckpt.errors import DestinationError, DestinationExistsError
from ckpt.store.placing import (
    clear_left,
    folders_locked,
    is_temp_name,
    journal_folder,
    remove_quietly,
    rename_new,
    replace_all,
    temp_name,
)
from ckpt_store.storage.backends.local import fsync_folder

log = logging.getLogger(__name__)


# This process's temporaries in destinations (files and folders not yet renamed into place or
# removed), and how many renames into place are under way: what a process ending at once
# removes (:func:`abandon`), and when it must not end.
_pending: set[str] = set()
_placing = 0
# A temporary is locked (flock) by the process writing it, from its creation until it is renamed
# into place or removed: one no process holds was left by a pull that was killed, and the next
# pull to the same name removes it (:func:`sweep_left`). Path -> a descriptor holding the lock.
_locks: dict[str, int] = {}
_locks_guard = threading.Lock()
# A temporary younger than this is never swept: it may be between its creation and its lock. Its
# age is judged by the clock that stamps the folder's files (a file server's: :func:`_folder_now`).
_SWEEP_MIN_AGE_S = 10.0


def _lock_temp(path: str, fd: int) -> None:
    """Hold ``fd``'s file (a temporary just created, or its folder) locked until :func:`_unlock_temps`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (new: nobody else holds it)
    except OSError:
        return  # a filesystem without locks: nothing there is ever swept either
    with _locks_guard:
        _locks[path] = os.dup(fd)  # the lock lives as long as any descriptor of the file stays open


def _unlock_temps(paths: Sequence[str]) -> None:
    with _locks_guard:
        fds = [_locks.pop(p) for p in paths if p in _locks]
    for fd in fds:
        os.close(fd)


def sweep_left(final: str) -> None:
    """Remove what killed pulls left beside ``final``: temporaries of its name (files, or a
    directory checkpoint's folder) that no live process holds locked. A pull removes its own on
    any failure it lives through; a SIGKILL, a crash or a power cut leaves them, as large as
    the file had grown, under a hidden name no later pull would otherwise touch. Only names
    :func:`temp_name` makes for ``final`` are considered; links, other kinds of file, and
    anything locked or younger than a few seconds are left alone."""
    d = os.path.dirname(final)
    try:
        names = [n for n in os.listdir(d or ".") if is_temp_name(n, final)]
    except OSError:
        return  # (no such folder yet, say: nothing left there)
    now: float | None = None  # by the folder's clock, read at the first temporary found
    for n in names:
        path = os.path.join(d, n)
        with _locks_guard:
            if path in _locks:
                continue  # this process's own
        try:
            mode = os.lstat(path).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                continue  # a link, a FIFO, a device: never opened
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue  # gone meanwhile, unreadable, a link swapped in since (ELOOP): not ours to remove
        try:
            st = os.fstat(fd)
            folder = stat.S_ISDIR(st.st_mode)
            if not (folder or stat.S_ISREG(st.st_mode)):
                continue
            now = _folder_now(final) if now is None else now
            if now - st.st_mtime < _SWEEP_MIN_AGE_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a pull under way holds it
            try:
                if folder:
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError as e:
                log.warning("could not remove %s, left by an interrupted pull: %s", path, e.strerror or e)
                continue
            log.warning("removed %s, left by an interrupted pull (%s)", path,
                        "a folder" if folder else f"{st.st_size:,} bytes")
        finally:
            os.close(fd)


def _folder_now(final: str) -> float:
    """Now by the clock that stamps files in ``final``'s folder: the mtime of a temporary made there
    and removed at once. On NFS that is the file server's clock, which stamps other clients' files;
    against this machine's, a clock ahead would see another pull's temporary a moment old as older
    than :data:`_SWEEP_MIN_AGE_S`, before that pull locked it. This machine's clock if none can be
    made (then nothing can be written there either)."""
    probe = temp_name(final)  # (a name a later sweep removes, if this process dies before it does)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _fsync_made(made: list[str]) -> None:
    """Make durable the names of the folders a pull made on the way to its destination (each a name in its parent),
    before any file takes its name there."""
    for d in sorted({os.path.dirname(m) for m in made}):
        fsync_folder(d)


def _makedirs(d: str, made: list[str]) -> None:
    """``os.makedirs`` that records each directory it creates (deepest last), to undo on failure."""
    if not d or os.path.isdir(d):
        return
    _makedirs(os.path.dirname(d), made)
    try:
        os.mkdir(d)
    except FileExistsError:
        if not os.path.isdir(d):
            raise
        return
    made.append(d)


def write_files(targets: Sequence[str], fill: Callable[[list[str]], None], overwrite: bool = True,
                check: Callable[[], object] | None = None) -> None:
    """Write ``targets`` all or nothing: ``fill`` writes (and fsyncs) each file under the
    temporary name given for it; then every temporary is renamed over its target. Without
    ``overwrite`` a temporary takes its target's name only if nothing is there (another
    program may have made a file there since the checks): else :class:`DestinationExistsError`.
    ``check`` (the destination's rule, checked again) runs with the folders locked, before any
    rename: another pull may have placed its files there since the rule was first checked.

    On any failure (an error, a corrupt chunk, Ctrl-C) the temporaries and the
    directories made for them are removed and the targets are as they were. A target
    that is a symbolic link is replaced by the file; the link's target is untouched.
    """
    made: list[str] = []
    tmps = [temp_name(t) for t in targets]
    _pending.update(tmps)
    try:
        try:
            for t in targets:
                _makedirs(os.path.dirname(t), made)
                sweep_left(t)
            fill(tmps)
            _fsync_made(made)
            _place(tmps, targets, overwrite, check)
        except OSError as e:
            raise DestinationError(f"cannot write {e.filename or targets[0]}: {e.strerror or e}",
                                   hint="check the destination's permissions and free space") from None
    except BaseException:
        for tmp in tmps:
            remove_quietly(tmp)
        for d in reversed(made):
            try:
                os.rmdir(d)  # only if still empty: never anything that is not ours
            except OSError:
                pass
        raise
    finally:
        _pending.difference_update(tmps)
        _unlock_temps(tmps)


def _place(tmps: Sequence[str], targets: Sequence[str], overwrite: bool, check: Callable[[], object] | None) -> None:
    """Rename complete temporaries over their targets with every folder they go in locked: one pull
    places files in a folder at a time, ``check`` sees the destination as the renames will find it,
    and what pulls killed while placing files there left is dealt with (:func:`clear_left`)."""
    folders = sorted({os.path.dirname(t) or "." for t in targets} | {journal_folder(targets)})
    with folders_locked(folders), _placing_files():
        if check is not None:
            try:
                check()
            except DestinationExistsError as e:  # (it was not, when first checked)
                raise DestinationExistsError(f"{e.message}: made so while this pull ran", hint=e.hint) from None
        clear_left(folders, overwrite)
        replace_all(tmps, targets, overwrite)
    for d in sorted({os.path.dirname(t) for t in targets}):
        fsync_folder(d)


@contextlib.contextmanager
def _placing_files() -> Iterator[None]:
    """Renames into place (and their undoing) under way: :func:`abandon` waits them out."""
    global _placing
    _placing += 1
    try:
        yield
    finally:
        _placing -= 1


def abandon() -> bool:
    """Remove this process's temporary files and folders in destinations, for a process that is
    about to end at once (a second Ctrl-C while the first is still waiting for transfers in flight:
    ``cli/interrupts.py``); its worker threads may be writing them still, and end with it. Returns False,
    removing nothing, while files are being renamed into place or back: that takes moments, and a
    process ending in the middle of it could leave some targets new and others moved aside."""
    if _placing:
        return False
    for path in list(_pending):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)  # our own temporary folder (write_dir)
        else:
            remove_quietly(path)
    return True


def write_dir(dest: str, targets: Sequence[str], fill: Callable[[list[str]], None], overwrite: bool = True,
              check: Callable[[], object] | None = None) -> None:
    """Write a directory checkpoint's files. A new ``dest`` is built beside it and renamed
    into place (it appears only when complete); an existing one is written into with
    :func:`write_files` (``check`` as there). A folder made at ``dest`` while this pull ran
    (another pull's, every rank of a job pulling at its start; or a user's ``mkdir``) is written
    into so too, as if it had been there at the check: with ``overwrite``, or if it is empty
    (``check`` says); never replaced. Something else made there ends the pull with
    :class:`DestinationExistsError`."""
    if os.path.isdir(dest):
        sweep_left(dest)  # (a folder a killed pull built beside it: one made at dest meanwhile kept it from its rename)
        write_files(targets, fill, overwrite, check)
        return
    tmp_dir = temp_name(dest)
    inner = [os.path.join(tmp_dir, os.path.relpath(t, dest)) for t in targets]
    made: list[str] = []
    _pending.add(tmp_dir)
    try:
        try:
            _makedirs(os.path.dirname(os.path.abspath(dest)), made)
            sweep_left(dest)
            os.mkdir(tmp_dir)
            fd = os.open(tmp_dir, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            try:
                _lock_temp(tmp_dir, fd)
            finally:
                os.close(fd)
            for t in inner:
                os.makedirs(os.path.dirname(t), exist_ok=True)
            fill(inner)
            for here, _, _ in os.walk(tmp_dir):  # every name in the new folder durable before it takes its name
                fsync_folder(here)
            _fsync_made(made)
            with _placing_files():
                try:
                    _rename_dir_new(tmp_dir, dest)
                except FileExistsError:
                    if check is None or not os.path.isdir(dest) or os.path.islink(dest):
                        raise DestinationExistsError(f"{dest} exists (made while this pull ran)",
                                                     hint="pull again: it is then checked as any destination is") from None
                    # Into the folder made meanwhile, as into one found at the check: the rule checked again
                    # before anything is made or moved in it (a link in it leads elsewhere), then the complete
                    # files move beside their targets as temporaries and are placed as any are (the rule checked
                    # a last time with the folders locked: a link made in between is refused there).
                    try:
                        check()
                    except DestinationExistsError as e:
                        raise DestinationExistsError(f"{e.message}: made so while this pull ran", hint=e.hint) from None
                    write_files(targets, lambda tmps: _move_all(inner, tmps), overwrite, check)
                    shutil.rmtree(tmp_dir)  # (its folders, emptied)
                _pending.discard(tmp_dir)  # (it is dest now, or gone)
            fsync_folder(os.path.dirname(os.path.abspath(dest)))
        except OSError as e:
            raise DestinationError(f"cannot write {e.filename or dest}: {e.strerror or e}",
                                   hint="check the destination's permissions and free space") from None
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # our own temporary directory, nothing else
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass
        raise
    finally:
        _pending.discard(tmp_dir)
        _unlock_temps([tmp_dir, *inner])


def _rename_dir_new(built: str, dest: str) -> None:
    """Rename folder ``built`` to ``dest`` if nothing has that name, else :class:`FileExistsError`.
    Where renameat2's RENAME_NOREPLACE is refused (NFS, some FUSE filesystems) rename(2) does it,
    and it replaces an empty folder made at ``dest`` after the look just before it: that gap (moments)
    stays there. (A folder not empty, or anything else, it never replaces.)"""
    if rename_new(built, dest):
        return
    if os.path.lexists(dest):
        raise FileExistsError(errno.EEXIST, "exists", dest)
    try:
        os.rename(built, dest)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise FileExistsError(errno.EEXIST, "exists", dest) from None
        raise


def _move_all(srcs: Sequence[str], dsts: Sequence[str]) -> None:
    for src, dst in zip(srcs, dsts):
        os.rename(src, dst)  # (to a temporary's new name: nothing there)


def create_new(path: str) -> int:
    """Open a new file for writing (a temporary of :func:`write_files`, locked as this process's until
    it is renamed into place or removed); an error if anything (file, link, FIFO) is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _lock_temp(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd
