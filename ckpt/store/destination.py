"""Where a pull may write, and how: the one rule every pull path follows.

A destination may hold something precious, so a pull

* writes only the checkpoint's own files: each under a temporary name in its final
  directory, fsynced, then renamed over its final name (all renames happen after every
  file is complete, so a failed pull leaves the destination as it was, temporaries
  removed); a file replaced is first kept under a backup name, so that a rename failing
  part way (a file made immutable, another user's in a sticky directory) puts back every
  file already replaced; and one pull renames into a folder at a time (two ``--force`` pulls there at
  once leave the files of the last to rename whole, never some of each), the rule checked again as
  it does (two pulls without ``--force`` into one empty folder: the second refuses, as if it had
  come after; with ``--force`` into a folder another pull made meanwhile: it writes into it);
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
  holds locked: :func:`sweep_left`), and nothing else; says what a pull killed while renaming its
  files into place left (some files new, some old, backups of the old: :mod:`ckpt.store.placing`'s
  journal), and with ``overwrite`` removes the backups and temporaries that journal lists.

A directory checkpoint pulled to a new path is built beside it and renamed into place, so
the directory appears only when complete. Pulled into an existing directory, it needs that
directory empty, or ``overwrite``: then its files are written into it, beside whatever
else is there. Both hold for what appears at a path while a pull runs: a file of the
checkpoint's (without ``overwrite``) or a directory built takes its name only if nothing has
it (renameat2's RENAME_NOREPLACE, :func:`ckpt.store.placing.rename_new`: rename(2) would replace
a file or an empty folder made there a moment before. Where a filesystem lacks the flag, NFS and
some FUSE ones, a file takes its name by a hard link, which never replaces either, or where links
are refused too by rename(2); a folder by rename(2) just after a look: those gaps stay there); a
folder made at a new path meanwhile is written into as if it had been there at the check (so,
without ``overwrite``, only if it is empty then).

The checks are here; the all-or-nothing writing is :mod:`ckpt.store.atomic_files`, and the bytes of
each file :mod:`ckpt.store.output_files` (their public names import from here too, as before).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckpt.errors import DestinationError, DestinationExistsError, StoreFormatError
from ckpt.format.names import clashing_path
from ckpt.store.atomic_files import abandon, create_new, sweep_left, temp_name, write_dir, write_files
from ckpt.store.output_files import OutputFile, is_torch_name, write_torch
from ckpt.store.placing import is_temp_name, left_note
from ckpt.store.sources import STATE_DICT_SUFFIXES
from ckpt_store.storage.config import enclosing_store

if TYPE_CHECKING:
    from ckpt.store.store import Store

__all__ = ["OutputFile", "abandon", "check_dir_destination", "check_file_destination", "check_outside_stores",
           "check_outside_system", "create_new", "dir_targets", "file_target", "inside", "is_torch_name", "store_root", "sweep_left", "temp_name",
           "write_dir", "write_files", "write_torch"]


def store_root(store: Store) -> str | None:
    """The real path of a local store's folder (None for a remote store)."""
    root = store.backend.local_path(".")
    return os.path.realpath(root) if root is not None else None


def inside(path: str, root: str) -> bool:
    """Whether real path ``path`` is ``root`` or lies below it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# The system's own folders: a pull there (`ckpt pull m /dev/stdout --force`, as root) would replace
# the system's links and devices with a file, never write through them. /dev/shm is not theirs: a folder
# of files in memory, where users put models to load them fast (and ckpt a local tier).
_SYSTEM_FOLDERS = ("/dev", "/proc", "/sys")
_USERS_IN_SYSTEM = ("/dev/shm",)


def check_outside_system(path: str, what: str = "a pull") -> None:
    """Refuse ``path`` (a file or directory ``what`` writes) in the system's /dev (not /dev/shm), /proc or /sys."""
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    system = next((d for d in _SYSTEM_FOLDERS if inside(parent, d)), None)
    if any(inside(parent, d) for d in _USERS_IN_SYSTEM):
        system = None
    if system is not None:
        raise DestinationError(f"{path} is in {system}, the system's; {what} writes regular files of its own, "
                               "never there (not to a device or a stream either)", hint="give a path in a folder of yours")


def check_outside_stores(path: str, store: Store | None, what: str = "a pull", *, allow_self: bool = False) -> None:
    """Refuse ``path`` (a file or directory ``what`` writes) inside any local store, or inside
    ``store`` (the one the command opened); with ``allow_self``, ``path`` may be a store itself (a local
    tier's own), just not inside another. ``path`` is taken as the caller writes it (``~`` is a folder's
    name here: whoever expands it passes the path expanded)."""
    real = os.path.realpath(path)
    outer = enclosing_store(real)
    if outer is None and store is not None:
        root = store_root(store)
        if root is not None and inside(real, root):
            outer = root  # the store pulled from, even before its config is readable
    if outer is not None and not (allow_self and outer == real):
        raise DestinationError(f"{path} is inside the store at {outer}; {what} never writes there",
                               hint="give a path outside the store")


def check_file_destination(path: str, store: Store | None, what: str = "a pull") -> None:
    """Refuse a file that ``what`` writes at ``path`` in the system's folders or inside a local store."""
    check_outside_system(path, what)
    check_outside_stores(path, store, what)


def check_dir_destination(path: str, store: Store | None, what: str = "a pull", *, allow_self: bool = False) -> None:
    """Refuse a directory ``path`` that ``what`` writes files in (and below) in the system's folders or
    inside a local store (``allow_self``: see :func:`check_outside_stores`). Its files are what is checked
    against the system's folders, not its parent: a link into /dev is refused, /dev/shm itself is not."""
    check_outside_system(os.path.join(path, "x"), what)
    check_outside_stores(path, store, what, allow_self=allow_self)


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
    check_file_destination(target, store)
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
    # A manifest is data read from a store: each path must name one file, and no directory (Manifest.from_json refuses
    # one that does not; checked again here for any caller's paths).
    clash = clashing_path(paths)
    if clash is not None:
        raise StoreFormatError(f"this checkpoint lists {clash!r} twice, or as both a file and a directory")
    check_dir_destination(dest, store)  # (the files go in dest, and below: where their links are checked)
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
    # A file (not a link, not a folder) lies in a store exactly where its folder does: each folder is checked
    # once, not each of its files (a realpath and a walk up each: ~0.1 s for 1,500 files, and a pull checks twice).
    clear: set[str] = set()
    for rel, target in zip(paths, targets):
        parts = rel.split("/")
        for i in range(1, len(parts)):  # each parent directory the file needs, inside dest
            d = os.path.join(dest, *parts[:i])
            if os.path.islink(d):
                raise DestinationError(f"{d} is a symbolic link; a pull does not write through links",
                                       hint="remove the link or pull elsewhere")
            if os.path.lexists(d) and not os.path.isdir(d):
                raise DestinationError(f"{d} is a file where this checkpoint has a directory", hint="move it away or pull elsewhere")
        plain = not os.path.islink(target) and not os.path.isdir(target)
        if not plain or os.path.dirname(target) not in clear:
            check_outside_stores(target, store)  # a store somewhere below dest
            if plain:
                clear.add(os.path.dirname(target))
        _check_entry(target, True)
    if not overwrite:
        present = _placed(dest)
        if present:
            ours = {p.split("/")[0] for p in paths}
            clash = [p for p in present if p in ours] or present
            shown = ", ".join(clash[:3]) + (f" and {len(clash) - 3} more" if len(clash) > 3 else "")
            raise DestinationExistsError(
                f"{dest} exists and is not empty ({shown} {'is' if len(clash) == 1 else 'are'} in the way){left_note(dest)}",
                hint="pass --force to write the checkpoint's files into it, replacing only files of the same names")
    else:
        _check_no_stale_weights(dest, paths)
    return dest, targets


def _placed(d: str) -> list[str]:
    """What folder ``d`` holds besides pulls' temporaries (a folder of nothing else is as empty as they
    are): a pull into an empty folder is checked again with its own temporaries there, and maybe
    another's, whose files are not in place. A stale one of another name (a killed pull's) counts as
    empty too, and loses nothing: a pull without ``overwrite`` takes only names nothing holds (a rename
    or link that fails where one does, :func:`ckpt.store.placing.replace_all`) and sweeps only temporaries of
    its own names (:func:`sweep_left`); that one stays until a pull of its name sweeps it."""
    found = []
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return []  # (a folder of temporaries removed meanwhile)
    for e in entries:
        if is_temp_name(e.name):
            continue
        try:
            if e.is_dir(follow_symlinks=False) and os.listdir(e.path) and not _placed(e.path):
                continue
        except FileNotFoundError:
            continue
        found.append(e.name)
    return sorted(found)


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
