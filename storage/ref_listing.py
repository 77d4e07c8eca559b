"""How refs are listed: the entries below ``refs/`` by name and number, as listed (nothing read), the
damage a listing shows (a folder or a symbolic link where an entry or a ref should be, a gap), and a
ref's newest entry found without listing its whole history. :class:`~ckpt_store.storage.refs.Refs`
derives from :class:`RefsFolder` and reads what it lists."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable

from ckpt_store.storage.backends.base import TEMPORARY, Backend, Entry
from ckpt_store.storage.errors import StoreFormatError
from ckpt_store.storage.objects import Temporaries
from ckpt_store.storage.ref_entry import ENTRY_NAME, RefJournal


def gaps(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """The runs of numbers missing between the lowest and the highest of ``seqs`` (a ref's entries), each as
    (its first, its last), newest first: ``gaps([1, 2, 5, 9])`` is ``[(6, 8), (3, 4)]``."""
    out: list[tuple[int, int]] = []
    above = None
    for s in sorted(set(seqs), reverse=True):
        if above is not None and above - s > 1:
            out.append((s + 1, above - 1))
        above = s
    return out


class RefsFolder:
    """Lists the refs below ``refs/`` of a store (:class:`~ckpt_store.storage.refs.Refs` reads them)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # The store's metadata index (storage/index.py), told of every update after it lands.
        self.index: RefJournal | None = None
        # One past the entry number each ref's last update from here took: tried first by the next update,
        # and where the listing for its newest entry starts (see _newest), so that a long-lived ref
        # (RUN/latest) is not listed whole each update.
        self._next: dict[str, int] = {}
        # The newest entry number of each ref this object read: where a listing for the newest entry starts.
        self._seen: dict[str, int] = {}

    @staticmethod
    def _entry_path(name: str, seq: int) -> str:
        return f"refs/{name}/{seq:010d}.ref"

    def _entry_seqs(self, name: str) -> dict[int, Entry | None]:
        return self._listed(f"refs/{name}")[0].get(name, {})  # direct children only: "a/b" entries are not "a"'s

    def _link(self, folder: str) -> str | None:
        """The target of ``folder`` (a path below ``refs/``) when it is a symbolic link to a folder or
        to nothing (a folder on a disk not mounted, say), else None."""
        local = self.backend.local_path(folder)
        if local is None or not os.path.islink(local) or not (os.path.isdir(local) or not os.path.exists(local)):
            return None
        return os.readlink(local)

    def _link_above(self, folder: str) -> str | None:
        """The first folder from ``refs/`` down to ``folder`` (itself included, ``refs`` not) that is
        a symbolic link, else None."""
        parts = folder.split("/")
        return next((f for i in range(2, len(parts) + 1) if self._link(f := "/".join(parts[:i])) is not None), None)

    def _listed(self, folder: str) -> tuple[dict[str, dict[int, Entry | None]], Temporaries]:
        """Every entry below ``folder`` by ref name and seq, as listed (nothing is read), and the leftovers
        of interrupted writes the listing passed (see :meth:`listing_and_temporaries`); None for
        something named like an entry that is not a file (a folder, empty or not, or an object
        store's prefix holding objects): damage, which must not be skipped, or the ref would
        silently name its previous version.

        A folder below ``refs/`` that is a symbolic link (or a link to nothing) is not entered (a
        listing of the whole store does not enter it, and it may lead anywhere): it is damage to
        the ref of its name (listed as its entry 0, not a file), as to every ref asked for through it. Its refs would
        otherwise resolve while ``ls`` and gc did not see them, and a gc would free a checkpoint
        a user can still name.

        Entries are numbered with no gap (nothing deletes one): the newest number missing between
        a ref's oldest and newest entries is listed as None too. A deleted entry file must not
        renumber ``NAME@N`` below it (whether it was a version or a removal is unknown), nor let gc
        free what it named. (Entries missing below the oldest renumber nothing: a history cut short.)"""
        by_name: dict[str, dict[int, Entry | None]] = defaultdict(dict)
        temporaries: Temporaries = []
        if folder != "refs" and self._link_above(folder) is not None:
            return {folder[len("refs/"):]: {0: None}}, temporaries
        self._check_refs_folder()

        def add(path: str, entry: Entry | None) -> None:
            parts = path.split("/")
            for i in range(2, len(parts)):  # no segment of a ref name is named like an entry
                m = ENTRY_NAME.match(parts[i])
                if m:
                    by_name["/".join(parts[1:i])][int(m.group(1))] = entry if i == len(parts) - 1 else None
                    return

        def linked(path: str) -> bool:
            if any(ENTRY_NAME.match(p) for p in path.split("/")[2:]) or self._link(path) is None:
                return False
            by_name[path[len("refs/"):]] = {0: None}
            return True

        files, folders = self.backend.tree(folder)
        for e in files:  # a link (to a folder, or to nothing) is listed as a file
            if e.path.rpartition("/")[2].startswith(TEMPORARY):
                temporaries.append((e.path, e.mtime, e.size))
            if not linked(e.path):
                add(e.path, e)
        for path in folders:
            if not linked(path):
                add(path, None)
        for seqs in by_name.values():
            gap = max(seqs) - 1
            while gap in seqs:
                gap -= 1
            if gap > min(seqs):
                seqs[gap] = None
        return dict(by_name), temporaries

    def _check_refs_folder(self) -> None:
        local = self.backend.local_path("refs")
        if local is not None and os.path.lexists(local) and not os.path.isdir(local):
            # A file, a FIFO or a link to nothing (an unmounted disk) lists as no ref at all: every
            # checkpoint would look unreferenced, and a gc would delete them all.
            raise StoreFormatError(f"{local}, the store's refs folder, is not a folder: its refs cannot be listed",
                                   hint="put the refs folder back from a backup of the store, or mount the disk the link leads to")

    def _newest(self, name: str) -> tuple[int, bool] | None:
        """The newest entry of ``name`` as :meth:`_listed` lists it: (its seq, whether a file is there),
        or None when it has none. Read in requests that do not grow with the ref's history (a run's
        RUN/latest gains an entry per save; a local store reads the folder, one directory read, about
        1 ms at 1,000 entries): the listing starts at a hint (the newest entry this object
        wrote or read, else, past the first page, the metadata index's), and the whole history is
        listed only where nothing is found from there (the ref was removed from the folder and begun
        again, say). Nothing below a listed entry can be newer, so the answer is the full listing's."""
        folder = f"refs/{name}"
        if self._link_above(folder) is not None:
            return 0, False  # damage to the ref, which _read raises
        self._check_refs_folder()
        hint = max(self._next.get(name, 1) - 1, self._seen.get(name, 0))
        found = self._entries_from(name, hint) if hint > 0 else {}
        if not found:
            hinted = False
            for page, more in self.backend.children(folder):
                self._add_entries(found, page)
                if more and not hinted and self.index is not None:  # a long history: start from the index's word
                    hinted = True
                    if (at := self.index.newest_seq(name)) and (past := self._entries_from(name, at)):
                        found = past
                        break
            self._drop_empty(name, found)
        if not found:
            return None
        newest = max(found)
        if len(self._seen) >= 1024:
            self._seen.clear()
        self._seen[name] = newest
        return newest, found[newest]

    def _entries_from(self, name: str, seq: int) -> dict[int, bool]:
        """The entries of ``name`` numbered ``seq`` or more, as listed (seq: whether a file is there)."""
        found: dict[int, bool] = {}
        for page, _ in self.backend.children(f"refs/{name}", f"{seq:010d}"):
            self._add_entries(found, page)
        return self._drop_empty(name, found)

    def _drop_empty(self, name: str, found: dict[int, bool]) -> dict[int, bool]:
        """``found`` less its newest names that hold nothing: an object store may list an empty folder
        (SeaweedFS keeps one where objects below a name were deleted) that its listing of objects,
        as :meth:`_listed` reads it, does not show."""
        while found and not found[newest := max(found)] and self._missing(self._entry_path(name, newest)):
            del found[newest]
        return found

    @staticmethod
    def _add_entries(found: dict[int, bool], page: list[tuple[str, bool]]) -> None:
        for child, is_file in page:
            if m := ENTRY_NAME.match(child):
                found[int(m.group(1))] = found.get(int(m.group(1)), True) and is_file

    def _missing(self, path: str) -> bool:
        """Whether nothing at all is at ``path`` (not even a folder: an object store's prefix holding objects)."""
        local = self.backend.local_path(path)
        if local is not None:
            return not os.path.lexists(local)
        return next(iter(self.backend.list(path)), None) is None

