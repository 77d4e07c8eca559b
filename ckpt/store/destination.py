"""Where a pull may write, and how: the one rule every pull path follows.

A destination may hold something precious, so a pull

* writes only the checkpoint's own files: each under a temporary name in its final
  directory, fsynced, then renamed over its final name (all renames happen after every
  file is complete, so a failed pull leaves the destination as it was, temporaries
  removed); a file replaced is first kept under a backup name, so that a rename failing
  part way (a file made immutable, another user's in a sticky directory) puts back every
  file already replaced;
* never deletes or renames a directory, and never replaces something that is not a
  regular file or a symbolic link (a directory named like a checkpoint file is in the way);
* replaces a symbolic link found at a file's name with the file, and never writes
  through a link into somewhere else (a link among a file's parent directories inside
  the destination is refused);
* never writes inside a local store (the one pulled from or any other: symbolic links
  resolved), and never into a directory that holds the store pulled from;
* replaces an existing file of the checkpoint's only with ``overwrite`` (``--force``);
  files that are not the checkpoint's are left as they are;
* removes what a killed pull of the same name left (its temporaries, which no live process
  holds locked: :func:`sweep_left`), and nothing else.

A directory checkpoint pulled to a new path is built beside it and renamed into place, so
the directory appears only when complete. Pulled into an existing directory, it needs that
directory empty, or ``overwrite``: then its files are written into it, beside whatever
else is there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ckpt.errors import DestinationError, DestinationExistsError, StoreFormatError, TensorMismatchError
from ckpt.store.limits import check_disk
from ckpt.store.sources import STATE_DICT_SUFFIXES
from ckpt_store.storage.config import enclosing_store

if TYPE_CHECKING:
    import torch

    from ckpt.store.store import Store

log = logging.getLogger(__name__)

_TMP = ".ckpt-tmp-"
_TMP_TAIL = re.compile(r"[0-9a-f]{8}")  # what temp_name adds after the tag

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


def store_root(store: Store) -> str | None:
    """The real path of a local store's folder (None for a remote store)."""
    root = store.backend.local_path(".")
    return os.path.realpath(root) if root is not None else None


def inside(path: str, root: str) -> bool:
    """Whether real path ``path`` is ``root`` or lies below it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# The system's own folders: a pull there (`ckpt pull m /dev/stdout --force`, as root) would replace
# the system's links and devices with a file, never write through them.
_SYSTEM_FOLDERS = ("/dev", "/proc", "/sys")


def check_outside_system(path: str, what: str = "a pull") -> None:
    """Refuse ``path`` (a file or directory ``what`` writes) in the system's /dev, /proc or /sys."""
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    system = next((d for d in _SYSTEM_FOLDERS if inside(parent, d)), None)
    if system is not None:
        raise DestinationError(f"{path} is in {system}, the system's; {what} writes regular files of its own, "
                               "never there (not to a device or a stream either)", hint="give a path in a folder of yours")


def check_outside_stores(path: str, store: Store | None, what: str = "a pull") -> None:
    """Refuse ``path`` (a file or directory ``what`` writes) inside any local store, or inside
    ``store`` (the one the command opened)."""
    outer = enclosing_store(path)
    if outer is None and store is not None:
        root = store_root(store)
        if root is not None and inside(os.path.realpath(path), root):
            outer = root  # the store pulled from, even before its config is readable
    if outer is not None:
        raise DestinationError(f"{path} is inside the store at {outer}; {what} never writes there",
                               hint="give a path outside the store")


def _check_entry(path: str, overwrite: bool) -> None:
    """What may stand at a file's final name: nothing, or (with ``overwrite``) a file or a link."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        raise DestinationError(f"{path} is a directory; a pull replaces only files", hint="move it away or pull elsewhere")
    if not (os.path.islink(path) or os.path.isfile(path)):
        raise DestinationError(f"{path} is not a regular file; a pull replaces only files", hint="move it away or pull elsewhere")
    if not overwrite:
        raise DestinationExistsError(f"{path} exists", hint="pass --force to replace it")


def file_target(store: Store, dest: str, name: str, overwrite: bool) -> str:
    """The path a one-file pull writes: ``dest``, or ``dest/name`` when ``dest`` is a directory.

    Raises :class:`DestinationError` (or :class:`DestinationExistsError`) when that path
    lies in a store, is a directory, or exists without ``overwrite``.
    """
    if not dest:
        raise DestinationError("empty destination path", hint="give a file or directory to write")
    target = os.path.join(dest, name) if os.path.isdir(dest) else dest
    if target.endswith(os.sep) or os.path.basename(target) in ("", ".", ".."):
        raise DestinationError(f"{dest} is not a directory", hint="create it, or give a file name")
    check_outside_system(target)
    check_outside_stores(target, store)
    _check_entry(target, overwrite)
    return target


def dir_targets(store: Store, dest: str, paths: Sequence[str], overwrite: bool) -> tuple[str, list[str]]:
    """Where a directory checkpoint's files (``paths``, relative, ``/``-separated) go.

    Returns (the destination directory, the final path of each file). Raises
    :class:`DestinationError` when the destination is (in) a store or holds the store
    pulled from, is a file, or has something that is not a checkpoint file where one goes;
    :class:`DestinationExistsError` when it is not empty and ``overwrite`` is off.
    """
    if not dest:
        raise DestinationError("empty destination path", hint="give a directory to write")
    dest = os.path.normpath(dest)
    # A manifest is data read from a store: each path must name one file, and no directory.
    dirs = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
    seen: set[str] = set()
    for p in paths:
        if p in dirs or p in seen:
            raise StoreFormatError(f"this checkpoint lists {p!r} twice, or as both a file and a directory")
        seen.add(p)
    check_outside_system(os.path.join(dest, "x"))  # (the files go in dest, and below: where their links were checked)
    check_outside_stores(dest, store)
    root = store_root(store)
    if root is not None and inside(root, os.path.realpath(dest)):
        raise DestinationError(f"{dest} holds the store at {root}; a pull never writes around a store",
                               hint="pull to a directory that does not contain the store")
    if os.path.lexists(dest) and not os.path.isdir(dest):
        raise DestinationError(f"{dest} exists and is not a directory; this checkpoint is a directory of {len(paths)} files",
                               hint="pull to a new or existing directory")
    targets = [os.path.join(dest, *p.split("/")) for p in paths]
    if not os.path.isdir(dest):
        return dest, targets
    for rel, target in zip(paths, targets):
        parts = rel.split("/")
        for i in range(1, len(parts)):  # each parent directory the file needs, inside dest
            d = os.path.join(dest, *parts[:i])
            if os.path.islink(d):
                raise DestinationError(f"{d} is a symbolic link; a pull does not write through links",
                                       hint="remove the link or pull elsewhere")
            if os.path.lexists(d) and not os.path.isdir(d):
                raise DestinationError(f"{d} is a file where this checkpoint has a directory", hint="move it away or pull elsewhere")
        check_outside_stores(target, store)  # a store somewhere below dest
        _check_entry(target, True)
    if not overwrite:
        present = sorted(os.listdir(dest))
        if present:
            ours = {p.split("/")[0] for p in paths}
            clash = [p for p in present if p in ours] or present
            shown = ", ".join(clash[:3]) + (f" and {len(clash) - 3} more" if len(clash) > 3 else "")
            raise DestinationExistsError(
                f"{dest} exists and is not empty ({shown} {'is' if len(clash) == 1 else 'are'} in the way)",
                hint="pass --force to write the checkpoint's files into it, replacing only files of the same names")
    else:
        _check_no_stale_weights(dest, paths)
    return dest, targets


_WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin.index.json", *STATE_DICT_SUFFIXES)


def _check_no_stale_weights(dest: str, paths: Sequence[str]) -> None:
    """Refuse a --force pull beside weights files that are not the checkpoint's, in a folder where it
    writes weights: left in place (a pull removes nothing of the user's), a loader would read them with
    or instead of the new ones -- transformers prefers a ``model.safetensors`` to the shards and index
    of a sharded model pulled over it, and loads the old weights without a word."""
    mine: dict[str, set[str]] = {}
    for p in paths:
        folder, _, name = p.rpartition("/")
        mine.setdefault(folder, set()).add(name)
    for folder, names in sorted(mine.items()):
        if not any(n.endswith(_WEIGHTS) for n in names):
            continue
        d = os.path.join(dest, *folder.split("/")) if folder else dest
        try:
            present = os.listdir(d)
        except OSError:  # not there yet (made by the pull) or unreadable (the write will say)
            continue
        stale = sorted(n for n in present if n.endswith(_WEIGHTS) and n not in names and os.path.isfile(os.path.join(d, n)))
        if stale:
            shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
            raise DestinationError(
                f"{d} holds weights this checkpoint does not have ({shown}): beside its own, a loader would read "
                "them too or instead (transformers prefers model.safetensors to a sharded model's index)",
                hint="remove or move them, or pull into a new directory; --force replaces only the checkpoint's own files")


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
    d, base = os.path.split(final)
    prefix = f".{os.fsdecode(os.fsencode(base)[:200])}{_TMP}"
    try:
        names = [n for n in os.listdir(d or ".") if n.startswith(prefix) and _TMP_TAIL.fullmatch(n[len(prefix):])]
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


def temp_name(final: str, tag: str = _TMP) -> str:
    """A temporary name in ``final``'s directory (so the rename into place is atomic).

    It starts with (at most the first 200 bytes of) ``final``'s own name, so that a file name
    as long as a filesystem allows (255 bytes) still leaves room for the rest."""
    d, base = os.path.split(final)
    return os.path.join(d, f".{os.fsdecode(os.fsencode(base)[:200])}{tag}{uuid.uuid4().hex[:8]}")


def _fsync_dir(d: str) -> None:
    fd = os.open(d or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def write_files(targets: Sequence[str], fill: Callable[[list[str]], None], overwrite: bool = True) -> None:
    """Write ``targets`` all or nothing: ``fill`` writes (and fsyncs) each file under the
    temporary name given for it; then every temporary is renamed over its target. Without
    ``overwrite`` a temporary takes its target's name only if nothing is there (another
    program may have made a file there since the checks): else :class:`DestinationExistsError`.

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
            with _placing_files():
                _replace_all(tmps, targets, overwrite)
            for d in sorted({os.path.dirname(t) for t in targets}):
                _fsync_dir(d)
        except OSError as e:
            raise DestinationError(f"cannot write {e.filename or targets[0]}: {e.strerror or e}",
                                   hint="check the destination's permissions and free space") from None
    except BaseException:
        for tmp in tmps:
            _remove_quietly(tmp)
        for d in reversed(made):
            try:
                os.rmdir(d)  # only if still empty: never anything that is not ours
            except OSError:
                pass
        raise
    finally:
        _pending.difference_update(tmps)
        _unlock_temps(tmps)


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
    ``cli/main.py``); its worker threads may be writing them still, and end with it. Returns False,
    removing nothing, while files are being renamed into place or back: that takes moments, and a
    process ending in the middle of it could leave some targets new and others moved aside."""
    if _placing:
        return False
    for path in list(_pending):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)  # our own temporary folder (write_dir)
        else:
            _remove_quietly(path)
    return True


_OLD = ".ckpt-old-"


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
    _remove_quietly(tmp)
    return True


def _replace_all(tmps: Sequence[str], targets: Sequence[str], overwrite: bool = True) -> None:
    """Rename each temporary over its target, all or none: a file (or link) at a target is first
    kept under a backup name beside it (a hard link: the target stays in place meanwhile; a
    rename where links are refused), so that a failure part way puts every target back as it
    was, and the backups go once all are in place."""
    # (target, where its old file is kept or None, the temporary's inode): what a failure undoes is
    # decided by what is on disk, so that a signal landing between two steps is undone too.
    done: list[tuple[str, str | None, int]] = []
    try:
        for tmp, t in zip(tmps, targets):
            old = None
            if os.path.lexists(t):
                if os.path.isdir(t) and not os.path.islink(t):  # appeared since the checks: never moved
                    raise IsADirectoryError(errno.EISDIR, "a directory is in the way", t)
                if not overwrite:  # appeared since the checks
                    raise DestinationExistsError(f"{t} exists (made while this pull ran)", hint="pass --force to replace it")
                old = temp_name(t, _OLD)
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
    for _, old, _ in done:
        if old is not None:
            _remove_quietly(old)


def write_dir(dest: str, targets: Sequence[str], fill: Callable[[list[str]], None], overwrite: bool = True) -> None:
    """Write a directory checkpoint's files. A new ``dest`` is built beside it and renamed
    into place (it appears only when complete); an existing one is written into with
    :func:`write_files`."""
    if os.path.isdir(dest):
        write_files(targets, fill, overwrite)
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
            with _placing_files():
                try:
                    os.rename(tmp_dir, dest)  # fails (and nothing is lost) if dest appeared meanwhile, unless empty
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                        raise
                    raise DestinationExistsError(f"{dest} exists (made while this pull ran)",
                                                 hint="pull again: it is then checked as any destination is") from None
                _pending.discard(tmp_dir)  # (it is dest now)
            _fsync_dir(os.path.dirname(os.path.abspath(dest)))
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


class OutputFile:
    """A new file of ``size`` bytes at ``path`` (a temporary name from :func:`write_files`),
    written at offsets from any number of threads. Created exclusively: nothing already at
    ``path`` is ever written through. Leaving the ``with`` block fsyncs it (unless it failed);
    a large file is flushed in the background while it is written (:class:`_Flusher`)."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.fd = create_new(path)
        try:
            os.ftruncate(self.fd, size)
            self.flusher = _Flusher.for_file(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def write_at(self, data: bytes | memoryview, off: int) -> None:
        view = memoryview(data)
        start, length = off, len(view)
        while view:
            n = os.pwrite(self.fd, view, off)
            view, off = view[n:], off + n
        _start_writeback(self.fd, start, length)
        if self.flusher is not None:
            self.flusher.wrote(length)

    def sink_at(self, off: int) -> Callable[[bytes], None]:
        """A sink writing the bytes it receives at ``off``."""
        return lambda data: self.write_at(data, off)

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            _finish(self.fd, self.flusher, ok=exc_type is None)
        finally:
            os.close(self.fd)


# Bytes written between two background flushes of a pulled file.
FLUSH_EVERY = 16 << 20


class _Flusher:
    """Flushes a file being written to the disk in the background: an ``fdatasync`` each time
    another :data:`FLUSH_EVERY` bytes were written, on a thread of its own (the flush waits on
    the disk, not the CPU). The fsync that ends the file then has little left to wait for.

    ``sync_file_range`` (:func:`_start_writeback`) only starts writing to the disk: this
    VM's disk acknowledges that into a cache of its host's, and the final fsync waited ~0.07 s
    for every 91 MB however early the writeback had started (a tiny file's fsync: 0.3 ms).
    Flushed as it was written, the same file's final fsync took 0.003-0.02 s, and writing it
    took no longer (MiniLM pulls from SeaweedFS, three alternating runs: 0.02-0.08 s faster). The final fsync stays: it
    is what makes the file durable.

    A failed flush is kept and raised by the file's close, not left to the final fsync: Linux
    reports a writeback error once per open file, so after the flush has seen it the fsync
    would succeed over lost data.

    The thread starts with the first flush and ends once ``size`` bytes were written (the file
    is complete; its fsync is next): a pull of many files, opened together, has a thread only
    for those being written."""

    @classmethod
    def for_file(cls, fd: int, size: int) -> _Flusher | None:
        """A flusher for a file of ``size`` bytes, or None for one too small to need it."""
        return cls(fd, size) if size >= 2 * FLUSH_EVERY else None

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.left = size  # bytes still to be written
        self.unflushed = 0
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.closing = False
        self.error: OSError | None = None
        self.thread: threading.Thread | None = None

    def wrote(self, n: int) -> None:
        with self.lock:
            self.left -= n
            if self.left <= 0:
                self.closing = True  # complete: the thread ends (close() joins it)
            else:
                self.unflushed += n
                if self.unflushed < FLUSH_EVERY:
                    return
                self.unflushed = 0
                if self.thread is None and not self.closing:
                    self.thread = threading.Thread(target=self._run, name="ckpt-flush", daemon=True)
                    self.thread.start()
        self.wake.set()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            if self.closing:
                return
            try:
                os.fdatasync(self.fd)
            except OSError as e:
                self.error = e
                return

    def close(self, check: bool = True) -> None:
        """Stop (after a flush in progress); with ``check``, raise the error of a failed flush.
        The caller then fsyncs or drops the file and closes it."""
        with self.lock:
            self.closing = True
            thread = self.thread
        self.wake.set()
        if thread is not None:
            thread.join()
        if check and self.error is not None:
            raise self.error


def _finish(fd: int, flusher: _Flusher | None, ok: bool) -> None:
    """End writing a file: stop its flusher, and if the writing went well (``ok``) raise a failed
    flush's error or fsync the file."""
    if flusher is not None:
        flusher.close(check=ok)
    if ok:
        os.fsync(fd)


class _Flushing:
    """A binary file's ``write`` and ``flush``, telling ``flusher`` (if any) what is written, for
    writers that take a file object, such as ``torch.save``. It keeps the first write error:
    torch.save reports one as a RuntimeError that no longer says what failed (a full disk)."""

    def __init__(self, f: Any, flusher: _Flusher | None) -> None:
        self.f = f
        self.flusher = flusher
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        if self.flusher is not None:
            self.flusher.wrote(n)
        return n

    def flush(self) -> None:
        self.f.flush()


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


def _sync_file_range() -> object:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return fn
    except (OSError, AttributeError):
        return None


_SFR = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, off: int, length: int) -> None:
    """Start writing this range to disk now (Linux), so the final fsync has little left.

    Measured by benchmarks/push_pull.py: without it the kernel starts writeback only
    after ~2 GB are dirty and a 1 GB pull waited on one long fsync (499 -> 787 MB/s).
    """
    if _SFR is not None and length:
        _SFR(fd, off, length, _SYNC_FILE_RANGE_WRITE)  # type: ignore[operator]


def _remove_quietly(path: str) -> None:
    """Remove a file of ours while cleaning up after a failure: an error here (a read-only
    filesystem, a parent that is not a directory) must neither hide the failure being
    reported nor stop the rest of the cleanup."""
    try:
        os.unlink(path)
    except OSError:
        pass


def is_torch_name(path: str) -> bool:
    """Whether ``path`` is named like a torch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``)."""
    return path.lower().endswith(STATE_DICT_SUFFIXES)


def write_torch(target: str, tensors: dict[str, torch.Tensor], values: dict[str, Any], overwrite: bool = True,
                tree: Any = None) -> None:
    """Write ``tensors`` and JSON ``values`` as one flat dict to torch file ``target``, atomically;
    or, where ``tree`` is given (a pushed .pt's structure, holding ``tensors``), that object.

    Everything in it (tensors and JSON types) loads with ``torch.load(weights_only=True)``.
    """
    import torch

    clash = sorted(set(tensors) & set(values)) if tree is None else []
    if clash:
        raise TensorMismatchError(f"{clash[0]!r} names both a tensor and a value of this checkpoint",
                                  hint="pull it as .safetensors (tensors only)")
    obj: Any = {**tensors, **values} if tree is None else tree

    size = sum(t.nbytes for t in tensors.values())
    check_disk(size, target)

    def fill(tmps: list[str]) -> None:
        with os.fdopen(create_new(tmps[0]), "wb") as f:
            flusher = _Flusher.for_file(f.fileno(), size)
            out = _Flushing(f, flusher)
            try:
                try:
                    torch.save(obj, out)
                except RecursionError:  # (pickle recurses: a value an older push kept, some hundreds of lists deep)
                    raise DestinationError(f"cannot write {target}: the checkpoint holds values nested too deeply for a "
                                           "torch file", hint="pull it as .safetensors (its tensors only)") from None
                except RuntimeError:
                    if out.error is not None:
                        raise out.error from None  # what failed (ENOSPC, EIO): a DestinationError
                    raise
                f.flush()
            except BaseException:
                _finish(f.fileno(), flusher, ok=False)
                raise
            _finish(f.fileno(), flusher, ok=True)

    write_files([target], fill, overwrite)
