"""A store in a local directory, through the OS directly: temp file + fsync + rename for
every write, exclusive create through ``link``. Faster and stricter than fsspec's local
filesystem."""

from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ckpt_store.storage.backends.base import (
    CONDEMNED,
    TEMPORARY,
    Backend,
    Data,
    Entry,
    condemned_original,
    io_error,
)
from ckpt_store.storage.backends.local_reads import LocalReads
from ckpt_store.storage.errors import StorageIOError


class LocalBackend(LocalReads, Backend):
    """A store in a local directory. ``fsync`` makes every write durable before it is visible."""

    touches = True
    recovers_condemned = True
    exact_creates = True  # link() of a written temp file
    lists_from_a_name = True  # (a read of the whole folder: about 1 ms at 1,000 entries, measured)

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        self.fsync = fsync
        self._made_dirs: set[str] = set()
        self._inside: set[str] = set()  # directories found to be real folders below the root (no link on the way)
        self._dirty_dirs: set[str] = set()  # directories with renames not yet fsynced
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None, fsync: bool,
                 remote: dict[str, Any] | None) -> LocalBackend:
        return cls(url[len("file://"):] if url.startswith("file://") else url, fsync=fsync)

    def _p(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    def local_path(self, path: str) -> str | None:
        return self._p(path)

    def root_exists(self) -> bool:
        return os.path.isdir(self.root)

    def _ensure_dir(self, d: str) -> None:
        if d in self._made_dirs:
            return
        self._check_inside(d)
        made, here = [], d  # the folders this call makes: each one's name is an entry of its parent
        while not os.path.isdir(here) and os.path.dirname(here) != here:
            made.append(here)
            here = os.path.dirname(here)
        os.makedirs(d, exist_ok=True)
        with self._lock:
            self._made_dirs.add(d)
            if self.fsync:
                # A new folder's name is durable only once its parent is fsynced, as a file's is once its
                # folder is: without it, a power loss could take a new ref's folder (or a chunks/ fan-out
                # folder, or the store's own) with every fsynced file inside, after the push said done.
                self._dirty_dirs.update(os.path.dirname(m) for m in made)

    def _check_inside(self, d: str) -> None:
        """Refuse to write or delete in directory ``d`` when a folder on its way down from the
        root is a symbolic link. A store folder from elsewhere may hold one (``index/`` leading to
        the user's home, say): ckpt writes and deletes only inside the store. Reads may follow
        one (what is read is verified); the root itself may be a link."""
        if d in self._inside:
            return
        here = self.root
        for part in os.path.relpath(d, self.root).split(os.sep):
            if part == os.curdir:
                continue
            here = os.path.join(here, part)
            try:
                mode = os.lstat(here).st_mode
            except FileNotFoundError:
                return  # created below as real folders
            except OSError as e:
                raise io_error("write in", os.path.relpath(d, self.root), e) from e
            if stat.S_ISLNK(mode):
                rel = os.path.relpath(here, self.root).replace(os.sep, "/")
                raise StorageIOError(f"{rel} in the store folder {self.root} is a symbolic link (to {os.readlink(here)!r}): "
                                     "ckpt writes and deletes only inside the store",
                                     hint=f"replace {rel} by the folder it leads to, or remove it")
        with self._lock:
            self._inside.add(d)

    def _write_temp(self, final: str, data: Data, sync: bool = True) -> str:
        d = os.path.dirname(final)
        self._ensure_dir(d)
        tmp = os.path.join(d, f"{TEMPORARY}{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # as open() does: the umask decides (a team store: 002)
        except FileNotFoundError:  # the folder was removed since this backend made it (a ref's, by another process)
            with self._lock:
                self._made_dirs.discard(d)
            self._ensure_dir(d)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            for part in data if isinstance(data, tuple) else (data,):
                view = memoryview(part).cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            if self.fsync and sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)
        return tmp


    def write(self, path: str, data: Data) -> None:
        final = self._p(path)
        try:
            tmp = self._write_temp(final, data)
        except OSError as e:
            raise io_error("write", path, e) from e
        try:
            os.replace(tmp, final)
        except OSError as e:
            _unlink_quiet(tmp)  # as stage does: a temporary that cannot take its name is not kept
            raise io_error("write", path, e) from e
        self._renamed(final)

    def stage(self, path: str, data: Data) -> Callable[[bool], None]:
        final = self._p(path)
        try:
            tmp = self._write_temp(final, data)
        except OSError as e:
            raise io_error("write", path, e) from e

        def done(keep: bool) -> None:
            if not keep:
                _unlink_quiet(tmp)
                return
            try:
                os.replace(tmp, final)
            except OSError as e:
                _unlink_quiet(tmp)
                raise io_error("write", path, e) from e
            self._renamed(final)

        return done

    def _renamed(self, final: str) -> None:
        if self.fsync:
            with self._lock:
                self._dirty_dirs.add(os.path.dirname(final))

    def _sync_dir(self, d: str) -> None:
        """fsync folder ``d`` now (where this store fsyncs), for an order a later flush cannot give. A folder this
        user may write but not read (a drop box above a new store: the parent of a folder a write made), or a
        filesystem that cannot fsync a folder, is passed over: its names are as durable as that system makes them."""
        if self.fsync:
            fsync_folder(d)

    def flush(self) -> None:
        """fsync every directory that gained a name since the last flush.

        A file's data is fsynced before its rename; the rename itself is durable only
        once its directory is. Batching this per commit costs one fsync per directory
        touched instead of one per object.
        """
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        for d in sorted(dirs):
            self._sync_dir(d)

    def create_exclusive(self, path: str, data: Data) -> bool:
        return self._create(path, data, sync=True)

    def create_exclusive_cache(self, path: str, data: bytes) -> bool:
        # Not fsynced: a crash may leave it empty or partial, which its reader detects (a cache).
        return self._create(path, data, sync=False)

    def _create(self, path: str, data: Data, sync: bool) -> bool:
        final = self._p(path)
        try:
            tmp = self._write_temp(final, data, sync)
        except OSError as e:
            raise io_error("write", path, e) from e
        try:
            os.link(tmp, final)  # atomic, fails if the name exists, never half-written
            self._renamed(final)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            raise io_error("write", path, e) from e
        finally:
            _unlink_quiet(tmp)

    def exists(self, path: str) -> bool:
        # A regular file only (a link to one may be read: _open_read): a folder or a FIFO in
        # place of an object cannot be read, so ls and du must not take the object as held.
        try:
            return stat.S_ISREG(os.stat(self._p(path)).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def size(self, path: str) -> int:
        return os.stat(self._p(path)).st_size

    def mtime(self, path: str) -> float:
        return os.stat(self._p(path)).st_mtime

    def list(self, prefix: str) -> Iterator[Entry]:
        return self._walk(prefix, None)

    def _walk(self, prefix: str, folders: list[str] | None) -> Iterator[Entry]:
        """:meth:`list`; where ``folders`` is given, what :meth:`folders` lists is added to it, from the same walk."""
        base = self._p(prefix) if prefix else self.root
        cut = len(os.path.join(self.root, ""))  # every path found starts with it: slicing beats relpath
        stack = [base]
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(d)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                        if folders is not None:
                            folders.append(e.path[cut:] if os.sep == "/" else e.path[cut:].replace(os.sep, "/"))
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted while we listed
                    rel = e.path[cut:] if os.sep == "/" else e.path[cut:].replace(os.sep, "/")
                    if folders is not None and e.is_symlink() and _is_dir(e):
                        folders.append(rel)  # a link to a folder: a folder too, as os.walk lists it (not entered)
                    yield Entry(rel, st.st_size, st.st_mtime)

    def tree(self, prefix: str) -> tuple[list[Entry], list[str]]:
        folders: list[str] = []
        return list(self._walk(prefix, folders)), folders

    def folders(self, prefix: str) -> Iterator[str]:
        cut = len(os.path.join(self.root, ""))
        for d, subdirs, _ in os.walk(self._p(prefix) if prefix else self.root):
            for s in subdirs:  # a symbolic link to a folder among them (os.walk does not enter it)
                rel = os.path.join(d, s)[cut:]
                yield rel if os.sep == "/" else rel.replace(os.sep, "/")

    def children(self, prefix: str, after: str = "") -> Iterator[tuple[list[tuple[str, bool]], bool]]:
        # One directory read, names only: no stat per name (a folder, or a link to one, is a folder, as
        # folders() lists it; anything else, a link to nothing included, is listed as a file, as by list()).
        try:
            with os.scandir(self._p(prefix) if prefix else self.root) as it:
                found = [(e.name, not e.is_dir()) for e in it if e.name > after]
        except (FileNotFoundError, NotADirectoryError):
            return
        yield sorted(found), False

    def delete(self, path: str) -> None:
        final = self._p(path)
        self._check_inside(os.path.dirname(final))
        _unlink_quiet(final)

    def touch(self, path: str) -> bool:
        p = self._p(path)
        try:
            os.utime(p)
            # utime resolves the name before it updates the inode: a gc may condemn and
            # unlink the object in between, and utime still succeeds on the unlinked
            # inode. Looking the name up again afterwards closes that window.
            os.stat(p)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise io_error("touch", path, e) from e

    def delete_if_stale(self, path: str, cutoff: float) -> bool:
        """Condemn, re-check, then delete or restore: a concurrent touch is never lost.

        The object is first renamed to a ``.tmp-gc-`` name in its directory. A writer
        that touches it after that finds it missing and writes it again; a touch that
        landed before the rename shows in the mtime read *after* it, and the object is
        linked back under its name (if a writer has not already put an identical copy
        there). The window in which the name is absent is a few system calls long;
        commit retries its presence check across it (storage/commit.py).
        """
        final = self._p(path)
        self._check_inside(os.path.dirname(final))
        try:
            if os.stat(final).st_mtime >= cutoff:
                return False  # touched since the plan: the cheap check first
        except FileNotFoundError:
            return False
        # The name keeps the object's name, so a gc killed mid-way can put it back
        # (recover_condemned) instead of losing an object a writer had just touched.
        condemned = os.path.join(os.path.dirname(final), f"{CONDEMNED}{uuid.uuid4().hex}-{os.path.basename(final)}")
        try:
            os.rename(final, condemned)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise io_error("delete", path, e) from e
        try:
            mtime = os.stat(condemned).st_mtime
        except FileNotFoundError:
            return False  # another gc's recovery put it back meanwhile (recover_condemned)
        # Anything raised before the decision below (Ctrl-C or SIGTERM unwinding, a failing link)
        # leaves the object condemned, as a gc killed here does, for the next one to put back:
        # it may have been touched, so unlinking it on the way out could lose a live object.
        if mtime >= cutoff:
            try:
                os.link(condemned, final)
            except FileExistsError:
                pass  # a writer put it back already: same name, same bytes
            # The name back on disk before the condemned one goes: the writer that touched the object
            # names it in a checkpoint it makes durable, and a power loss must not keep the unlink and
            # lose the link (nothing else fsyncs this folder: the writer wrote nothing in it).
            self._sync_dir(os.path.dirname(final))
            _unlink_quiet(condemned)
            return False
        _unlink_quiet(condemned)
        return True

    def recover_condemned(self, prefix: str) -> int:
        """Put back objects a killed gc left condemned below ``prefix``. Returns how many."""
        n = 0
        done: list[str] = []  # condemned names whose object has its name again
        for e in list(self.list(prefix)):
            head, _, name = e.path.rpartition("/")
            original = condemned_original(name)
            if original:
                src = self._p(e.path)
                self._check_inside(os.path.dirname(src))
                try:
                    os.link(src, self._p(f"{head}/{original}" if head else original))
                    n += 1
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    continue
                done.append(src)
        for d in sorted({os.path.dirname(p) for p in done}):
            self._sync_dir(d)  # the names back on disk before the condemned ones go (as delete_if_stale)
        for src in done:
            _unlink_quiet(src)
        return n


def fsync_folder(d: str) -> None:
    """Make durable the names in folder ``d`` (fsync of the folder). One gone meanwhile, one this user may write but
    not read (a drop box: the parent of a folder a write made), or a filesystem that cannot fsync a folder (EINVAL,
    EROFS), is passed over: its names are as durable as that system makes them. Other errors (EIO) are raised."""
    try:
        fd = os.open(d or ".", os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, PermissionError):
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EROFS):
            raise
    finally:
        os.close(fd)


def _is_dir(e: os.DirEntry[str]) -> bool:
    """``e.is_dir()`` (a link followed) as os.walk reads it: an error is not a folder."""
    try:
        return e.is_dir()
    except OSError:
        return False


def _unlink_quiet(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
