"""Opening what push reads from disk: regular files only, never blocking, never
following a link out of a pushed folder.

* Only regular files are read. FIFOs, sockets and devices are refused: checked with
  ``stat`` before opening (opening some devices has effects), opened ``O_NONBLOCK``
  and checked again with ``fstat``, so one swapped in meanwhile cannot hang the push.
* In a folder, symbolic links to regular files inside the folder are followed and
  stored as a copy of the target's bytes under the link's name. Links that lead
  outside, broken links, link loops, links to directories (which could make the walk
  see the same files again, forever) and anything not a regular file are refused, all
  named in one error. Nothing is skipped: a skipped file would be data silently missing
  from the checkpoint.
* Every file of a folder is opened relative to the folder, one component at a time,
  with ``O_NOFOLLOW`` at each step, so a file or directory replaced by a link after the
  walk looked at it is refused rather than followed. The folder itself may be given as
  a link: that is the caller's explicit choice.
"""

from __future__ import annotations

import errno
import os
import stat

from ckpt.errors import InvalidSourceError
from ckpt.format.names import check_file_path

SKIPPED_DIRS = (".git", ".cache", "__pycache__")

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO (or a device) that was swapped in after the stat still returns at once.
_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | CLOEXEC


def show(text: str) -> str:
    """``text`` safe to print on one line: unprintable characters (escape sequences,
    newlines, lone surrogates) are written as Python escapes."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return what
    return "a special file"


def _not_regular(shown: str, mode: int) -> InvalidSourceError:
    return InvalidSourceError(shown, f"is {_kind(mode)}, not a regular file", hint="push reads only regular files")


def os_error(shown: str, e: OSError | ValueError) -> InvalidSourceError:
    if isinstance(e, ValueError):  # a NUL in the path
        return InvalidSourceError(shown, "not a valid path")
    if e.errno in (errno.EACCES, errno.EPERM):
        return InvalidSourceError(shown, "permission denied", hint="make it readable by this user, or remove it")
    if e.errno == errno.ENOENT:
        return InvalidSourceError(shown, "no such file or directory")
    if e.errno == errno.ELOOP:
        return InvalidSourceError(shown, "a symbolic link loop (or a link where none may be)")
    return InvalidSourceError(shown, show((e.strerror or type(e).__name__).lower()))


def _regular_fd(fd: int, shown: str) -> int:
    """``fd`` if it is a regular file (it is what was opened, whatever was stat'ed before); else closed and refused."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(shown, st.st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (links followed: the
    caller named it). Anything else is refused without being opened for long, or read."""
    shown = show(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # before opening: opening some devices has effects
            raise _not_regular(shown, st.st_mode)
        fd = os.open(path, _READ)
    except (OSError, ValueError) as e:
        raise os_error(shown, e) from None
    return _regular_fd(fd, shown)


def changed_error(shown: str) -> InvalidSourceError:
    return InvalidSourceError(shown, "changed while it was being pushed: a link now stands where a file or directory was",
                              hint="push again once nothing is changing the folder")


def _open_dirs_under(root_fd: int, parts: list[str], root: str) -> int:
    """The directory ``root/parts...``, opened relative to ``root_fd`` without following links."""
    fd = root_fd
    try:
        for part in parts:
            nxt = os.open(part, _DIR, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = nxt
    except OSError as e:
        if fd != root_fd:
            os.close(fd)
        shown = show("/".join([root.rstrip("/"), *parts]))
        # ELOOP (EMLINK on BSDs): a link; ENOTDIR: no longer a directory.
        raise (changed_error(shown) if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR) else os_error(shown, e)) from None
    return fd


def open_under(root_fd: int, parts: list[str], root: str) -> int:
    """Open the regular file ``root/parts[0]/.../parts[-1]`` one component at a time,
    relative to the open directory ``root_fd``, never following a link (``O_NOFOLLOW``
    at each step). The walk has already seen each component as a plain directory or file:
    a link found now was swapped in since, and is refused rather than followed."""
    shown = show("/".join([root.rstrip("/"), *parts]))
    dfd = _open_dirs_under(root_fd, parts[:-1], root)
    try:
        fd = os.open(parts[-1], _READ | _NOFOLLOW, dir_fd=dfd)
    except OSError as e:
        raise (changed_error(shown) if e.errno in (errno.ELOOP, errno.EMLINK) else os_error(shown, e)) from None
    finally:
        if dfd != root_fd:
            os.close(dfd)
    return _regular_fd(fd, shown)


def _link_target(root_real: str, rel: str) -> tuple[list[str], str]:
    """The in-folder file the link ``rel`` leads to (as path parts), or why it is refused."""
    full = os.path.join(root_real, *rel.split("/"))
    try:
        target = os.path.realpath(full, strict=True)
        st = os.stat(target)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return [], "a symbolic link loop"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return [], "a broken symbolic link"
        return [], f"a symbolic link that cannot be followed: {show((e.strerror or '').lower())}"
    if target != root_real and os.path.commonpath([root_real, target]) != root_real:
        return [], f"a symbolic link leading outside the folder, to {show(target)}"
    if stat.S_ISDIR(st.st_mode):
        return [], "a symbolic link to a directory"
    if not stat.S_ISREG(st.st_mode):
        return [], f"a symbolic link to {_kind(st.st_mode)}"
    return os.path.relpath(target, root_real).split(os.sep), ""


def walk_folder(root: str, root_fd: int, root_real: str) -> list[tuple[str, list[str]]]:
    """Every file of the folder push stores, as (its name in the checkpoint, the in-folder
    path of its bytes), in ``os.walk`` order (a directory's files by name, then its
    subdirectories). Raises one error naming every entry that is refused."""
    files: list[tuple[str, list[str]]] = []
    refused: list[str] = []
    hf_cache = False  # links into a Hugging Face cache's blobs/: worth a specific hint
    stack = [""]
    while stack:  # not recursive: a hostile folder may nest deeper than Python's stack
        rel_dir = stack.pop()
        dfd = _open_dirs_under(root_fd, rel_dir.split("/") if rel_dir else [], root)
        try:
            with os.scandir(dfd) as it:
                entries = sorted((e.name, e.stat(follow_symlinks=False).st_mode) for e in it)
        except OSError as e:
            raise os_error(show(f"{root.rstrip('/')}/{rel_dir}"), e) from None
        finally:
            if dfd != root_fd:
                os.close(dfd)
        subdirs = []
        for name, mode in entries:
            rel = check_file_path(f"{rel_dir}/{name}" if rel_dir else name)  # also bounds the depth
            if name in SKIPPED_DIRS and (stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                continue  # neither pushed nor looked into
            if stat.S_ISDIR(mode):
                subdirs.append(rel)
            elif stat.S_ISREG(mode):
                files.append((rel, rel.split("/")))
            elif stat.S_ISLNK(mode):
                parts, why = _link_target(root_real, rel)
                if why:
                    refused.append(f"{show(rel)} ({why})")
                    hf_cache = hf_cache or "/blobs/" in why
                else:
                    files.append((rel, parts))
            else:
                refused.append(f"{show(rel)} ({_kind(mode)})")
        stack.extend(reversed(subdirs))
    if refused:
        n = len(refused)
        listed = "; ".join(refused[:10]) + (f"; and {n - 10} more" if n > 10 else "")
        raise InvalidSourceError(
            show(root), f"refused {n} {'entry that is' if n == 1 else 'entries that are'} not a regular file or a link "
            f"to one inside the folder: {listed}",
            hint="links are followed only to files inside the folder; remove these, or replace them with copies you trust"
            + ("; a Hugging Face cache snapshot links into its blobs/: download with --local-dir, or push a `cp -rL` copy"
               if hf_cache else ""),
        )
    return files
