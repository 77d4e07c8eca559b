"""Refs: human names for checkpoints, each with an append-only history.

A ref ``llama-ft/legal`` is the directory ``refs/llama-ft/legal/`` holding one
immutable entry per update, ``0000000001.ref``, ``0000000002.ref``... The entry
with the highest number is the ref's current value; a ``target`` of null marks
the ref as removed. Entries are created with an exclusive create, so two writers
can never both write entry N: the loser re-reads and takes N+1. No update and no
history entry is ever lost, and nothing is modified in place.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ckpt_store.storage.backends.base import TEMPORARY, Backend, Entry
from ckpt_store.storage.errors import (
    InvalidNameError,
    RefConflictError,
    RefNotFoundError,
    StorageIOError,
    StoreFormatError,
)
from ckpt_store.storage.records import MAX_RECORD_BYTES, decode_record, finite_time, require, sealed_json

REF_FORMAT = "ckpt-ref"
REF_VERSION = 2  # 2: sealed with a checksum (storage/records.py); 1 is still read
MAX_NAME = 255
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
_ENTRY = re.compile(r"^([0-9]{10})\.ref\Z")
MAX_SEQ = 10**10 - 1  # entries are named by 10 digits


def validate_ref_name(name: str) -> str:
    """Return ``name`` if it is a valid ref name, else raise :class:`InvalidNameError`.

    Valid: ``/``-separated segments of letters, digits, ``.``, ``_`` and ``-``,
    not starting with ``.`` or ``-``, at most 255 characters. This rules out
    ``..``, absolute paths, control characters and NUL bytes.
    """
    if not isinstance(name, str) or not name:
        raise InvalidNameError("a ref name must be a non-empty string")
    if len(name) > MAX_NAME:
        raise InvalidNameError(f"ref name is {len(name)} characters long; the limit is {MAX_NAME}")
    for seg in name.split("/"):
        if not _SEGMENT.match(seg) or _ENTRY.match(seg):
            raise InvalidNameError(
                f"invalid ref name {name!r}",
                hint="use segments of letters, digits, '.', '_' and '-' separated by '/', e.g. run7/step-400",
            )
    return name


@dataclass(frozen=True)
class RefEntry:
    """One update of a ref. ``target`` is a manifest id, or None when the ref was removed."""

    name: str
    seq: int
    target: str | None
    time: float
    writer: str
    # An alias (like RUN/latest) names whatever another ref names; its earlier
    # targets are not kept alive by gc (docs/format.md).
    alias: bool = False

    def to_json(self) -> bytes:
        obj: dict[str, object] = {
            "format": REF_FORMAT,
            "version": REF_VERSION,
            "name": self.name,
            "seq": self.seq,
            "target": self.target,
            "time": self.time,
            "writer": self.writer,
        }
        if self.alias:
            obj["alias"] = True
        return sealed_json(obj)

    @classmethod
    def from_json(cls, data: bytes, what: str) -> RefEntry:
        obj = decode_record(data, REF_FORMAT, (1, REF_VERSION), what, sealed_since=2)
        target = obj.get("target")
        if target is not None and (not isinstance(target, str) or not re.fullmatch(r"[0-9a-f]{64}", target)):
            raise StoreFormatError(f"{what} has an invalid target")
        return cls(
            name=require(obj, "name", str, what),
            seq=require(obj, "seq", int, what),
            target=target,
            time=finite_time(require(obj, "time", (int, float), what), f"{what}: time"),
            writer=require(obj, "writer", str, what),
            alias=obj.get("alias") is True,
        )


class RefJournal(Protocol):
    """What refs tell the metadata index (storage/index.py)."""

    def note(self, mid: str, manifest: bytes) -> None: ...

    def record(self, entry: RefEntry, size: int) -> None: ...

    def newest_seq(self, name: str) -> int | None: ...


class RefEntryGoneError(StoreFormatError):
    """A ref entry listed, then deleted before it was read: not damage (a run's local tier cuts its
    refs' histories as it prunes, :meth:`Refs.cut_history`); the ref is to be listed again."""


def history_floor(entries: Iterable[tuple[int, str | None]]) -> int:
    """The number of a ref's newest removal among ``entries`` (its (seq, target) pairs; target None:
    a removal), or -1 where there is none. A ref's history ends there: what is older keeps nothing
    alive (gc's rule, :func:`~ckpt_store.storage.gc.gc_roots`; a name removed and pushed again does
    not revive what it held before), so the metadata index neither keeps nor reads it."""
    return max((s for s, target in entries if target is None), default=-1)


T = TypeVar("T")
L = TypeVar("L")
# How many times a reader lists a ref (or the refs) again when an entry it listed was deleted before it
# read it (RefEntryGoneError): a run's local tier pruning meanwhile moves on in a few steps.
GONE_TRIES = 8


def reread_while_gone(attempt: Callable[[bool], T]) -> T:
    """``attempt(last)``, again while it raises :class:`RefEntryGoneError` (an entry deleted since it was
    listed: ``attempt`` lists again), :data:`GONE_TRIES` times at most. ``last``: whether this is the last
    try, where the attempt reports the entry as damaged instead, or the error stands."""
    for tries_left in range(GONE_TRIES - 1, -1, -1):
        try:
            return attempt(tries_left == 0)
        except RefEntryGoneError:
            if tries_left == 0:
                raise
    raise AssertionError("unreachable")


def reread_listed(listed: L, relist: Callable[[], L], attempt: Callable[[L, bool], T]) -> T:
    """:func:`reread_while_gone` where the caller listed already: ``attempt(listed, last)`` first, then
    ``attempt(relist(), last)`` on each try again."""
    first = [listed]
    return reread_while_gone(lambda last: attempt(first.pop() if first else relist(), last))


class Refs:
    """Read and update refs below ``refs/`` of a store."""

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

    def _listed(self, folder: str) -> tuple[dict[str, dict[int, Entry | None]], list[tuple[str, float, int]]]:
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
        temporaries: list[tuple[str, float, int]] = []
        if folder != "refs" and self._link_above(folder) is not None:
            return {folder[len("refs/"):]: {0: None}}, temporaries
        self._check_refs_folder()

        def add(path: str, entry: Entry | None) -> None:
            parts = path.split("/")
            for i in range(2, len(parts)):  # no segment of a ref name is named like an entry
                m = _ENTRY.match(parts[i])
                if m:
                    by_name["/".join(parts[1:i])][int(m.group(1))] = entry if i == len(parts) - 1 else None
                    return

        def linked(path: str) -> bool:
            if any(_ENTRY.match(p) for p in path.split("/")[2:]) or self._link(path) is None:
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
        or None when it has none. Read in time that does not grow with the ref's history (a run's
        RUN/latest gains an entry per save): the listing starts at a hint (the newest entry this object
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
            if m := _ENTRY.match(child):
                found[int(m.group(1))] = found.get(int(m.group(1)), True) and is_file

    def _missing(self, path: str) -> bool:
        """Whether nothing at all is at ``path`` (not even a folder: an object store's prefix holding objects)."""
        local = self.backend.local_path(path)
        if local is not None:
            return not os.path.lexists(local)
        return next(iter(self.backend.list(path)), None) is None

    def _read(self, name: str, seq: int, is_file: bool = True) -> RefEntry:
        path = self._entry_path(name, seq)
        try:  # a folder of a store from elsewhere: a name no command accepts (m@1) is not a ref
            validate_ref_name(name)
        except InvalidNameError:
            raise StoreFormatError(f"ref entry {path} is under refs/{name}/, which is not a valid ref name",
                                   hint="no command can name that ref: rename or remove that folder") from None
        if not is_file and (link := self._link_above(f"refs/{name}")) is not None:
            raise StoreFormatError(f"{link} in the store folder is a symbolic link (to {self._link(link)!r}): ckpt does "
                                   "not follow it, so what the refs there name is unknown",
                                   hint=f"replace {link} by the folder it leads to, or remove the link: gc then frees what "
                                   "only its refs named")
        # Listed as no file, yet one now: an entry a listing missed while a concurrent update wrote the
        # next (a directory is listed in several reads as it changes), read as any other.
        if not is_file and not self.backend.exists(path):
            if self._missing(path):
                raise StoreFormatError(f"ref entry {path} is missing, with entries of {name} before and after it: what "
                                       f"{name} named then is unknown, and so is which version {name}@N names beyond it",
                                       hint="put the entry file back from a backup of the store, or move the entries "
                                       "older than it out of the store folder too (gc then frees what only they named)")
            raise StoreFormatError(f"ref entry {path} is not a file (a folder is there): what {name} named then "
                                   "is unknown", hint=f"put the entry file back from a backup of the store, or remove the folder "
                                   f"(then {name} names what it named before)")
        try:
            data = self.backend.read(path, MAX_RECORD_BYTES)
        except FileNotFoundError:  # listed, yet nothing to read: a symbolic link to nothing, say
            if self._missing(path):  # (not even a link): deleted since it was listed
                raise RefEntryGoneError(f"ref entry {path} was deleted after it was listed (its history cut meanwhile: "
                                 "a run's local tier pruning?)", hint="read it again") from None
            raise StoreFormatError(f"ref entry {path} is listed but cannot be read: nothing is there (a symbolic "
                                   "link to nothing?)", hint="put the entry file back from a backup of the store, "
                                   "or remove it") from None
        except StorageIOError as e:  # a FIFO or device in its place, or a file no one may read: damage to
            if e.retryable:  # report beside the other refs (what may pass on a retry is not)
                raise
            raise StoreFormatError(e.message, hint=e.hint) from None
        entry = RefEntry.from_json(data, f"ref entry {path}")
        if entry.name != name or entry.seq != seq:
            raise StoreFormatError(f"ref entry {path} names {entry.name}#{entry.seq}")
        return entry

    def history(self, name: str) -> list[RefEntry]:
        """Every entry of ``name``, newest first (empty if the ref never existed)."""
        validate_ref_name(name)
        entries, bad = self._readable(name, self._entry_seqs(name))
        if bad is not None:
            raise bad[0]
        return entries

    def log(self, name: str) -> tuple[list[RefEntry], dict[int, StoreFormatError]]:
        """Like :meth:`history`, but an entry that cannot be read is reported, not raised: every
        readable entry of ``name``, newest first, and the error of each other one by seq."""
        validate_ref_name(name)

        def attempt(last: bool) -> tuple[list[RefEntry], dict[int, StoreFormatError]]:
            entries: list[RefEntry] = []
            damaged: dict[int, StoreFormatError] = {}
            for s, f in sorted(self._entry_seqs(name).items(), reverse=True):
                try:
                    entries.append(self._read(name, s, f is not None))
                except StoreFormatError as err:
                    if isinstance(err, RefEntryGoneError) and not last:
                        raise  # deleted since listed (see _newest_entry): not damage, the history is listed again
                    damaged[s] = err
            return entries, damaged
        return reread_while_gone(attempt)

    def current(self, name: str) -> RefEntry | None:
        """The newest entry of ``name``, or None when it never existed or was removed."""
        validate_ref_name(name)
        entry = self._newest_entry(name, self._newest(name))
        return entry if entry is not None and entry.target is not None else None

    def _newest_entry(self, name: str, newest: tuple[int, bool] | None) -> RefEntry | None:
        """The entry ``newest`` of ``name`` (its seq, whether listed as a file), or None where None. One
        deleted since it was listed is not damage: a run's local tier cuts its refs' histories as it
        prunes (:meth:`cut_history`), so a newer entry took its place, or the ref went whole; it is
        listed again."""
        return reread_listed(newest, lambda: self._newest(name),
                             lambda found, last: self._read(name, *found) if found is not None else None)

    def _append(self, name: str, target: str | None, alias: bool = False, attempts: int = 50,
                expect: str | None = None) -> RefEntry:
        """Write entry ``target`` one past the newest of ``name``. A removal (``target`` None) is written
        only past a live entry (naming ``expect``, where given), read in the same step: two removals
        racing, one refuses; a push landing meanwhile is not removed unseen."""
        validate_ref_name(name)
        writer = uuid.uuid4().hex
        for attempt in range(attempts):
            if target is None:
                last = self._newest_entry(name, self._newest(name))
                live = last.target if last is not None else None
                if last is None or live is None:
                    raise RefNotFoundError(f"no ref named {name!r}")  # (never, or removed: by another remover meanwhile)
                if expect is not None and live != expect:
                    raise RefConflictError(f"ref {name} names {live[:12]} now, not {expect[:12]}: not removed",
                                           hint="another process moved it meanwhile")
                seq = last.seq + 1
            elif self.backend.lists_from_a_name:
                # An object store lists from this object's last entry (the hint _newest starts at) in one
                # request, as many as the two HEADs of the guess below, and sees what they cannot: a gap of
                # two or more entries above it (deleted by hand), which the guess would fill, never current.
                seq = (self._newest(name) or (0, True))[0] + 1
            else:
                # One past this object's last stands where that entry is there and the one above the guess is not
                # (two stats, so that RUN/latest is not listed each update on a local or memory store): entries are
                # numbered with no gap and each writer creates one past the newest it sees, so if the guess is free
                # (the create is exclusive) nothing newer exists. Both checked: the ref may have been removed from
                # the folder and begun again since, or an entry above the guess deleted (a gap: the update would
                # fill it, below the newest, never current). Else one past the newest as listed (see _newest).
                # A gap of two or more is not seen here: only a listing would, of the whole folder on a local store.
                guess = self._next.pop(name, None) if attempt == 0 else None
                seq = guess if guess is not None and self.backend.exists(self._entry_path(name, guess - 1)) \
                    and not self.backend.exists(self._entry_path(name, guess + 1)) else \
                    (self._newest(name) or (0, True))[0] + 1
            if seq > MAX_SEQ:  # an 11-digit entry name would be written, and never read: the update lost
                raise StoreFormatError(f"ref {name} has an entry numbered {seq - 1}, the last there can be: it cannot be "
                                       "updated", hint="a damaged or crafted entry? `ckpt log` shows it; use another name")
            entry = RefEntry(name, seq, target, time.time(), writer, alias)
            data = entry.to_json()
            if self.backend.create_exclusive(self._entry_path(name, seq), data):
                if len(self._next) >= 1024:  # a run's step-N refs are each updated once: keep few
                    self._next.clear()
                self._next[name] = seq + 1
                if self.index is not None:
                    self.index.record(entry, len(data))  # after the entry: a crash leaves the index stale, never ahead
                return entry
            time.sleep(min(0.001 * 2**attempt, 0.1))  # another writer took seq: re-read
        raise RefConflictError(f"could not update ref {name}: other writers kept updating it", hint="retry")

    def set(self, name: str, target: str, *, alias: bool = False) -> RefEntry:
        """Point ``name`` at manifest ``target`` (a new history entry).

        With ``alias``, gc keeps only the current target alive, not earlier ones.
        """
        return self._append(name, target, alias)

    def remove(self, name: str, *, expect: str | None = None) -> RefEntry:
        """Mark ``name`` as removed; its history stays readable with ``ckpt log``. Raises
        :class:`RefNotFoundError` where it has no live entry, also where another remover got there first,
        and with ``expect`` (a checkpoint id), :class:`RefConflictError` where it names another now."""
        return self._append(name, None, expect=expect)

    def cut_history(self, name: str) -> None:
        """Delete the entries of ``name`` older than its newest, and the newest too (then its folder)
        where it marks the ref removed: only for a private store whose past no one reads, a run's
        local tier (docs/format.md), whose saves and restarts would otherwise list a folder per step
        ever saved there. Oldest first: a crash between deletes leaves a history cut short that
        names what the ref named (never a gap, never an older version)."""
        validate_ref_name(name)
        listed = self._entry_seqs(name)
        seqs = sorted(listed)
        if not seqs:
            return
        newest = self._read(name, seqs[-1], listed[seqs[-1]] is not None)
        self._next.pop(name, None)
        self._seen.pop(name, None)
        for seq in seqs[:-1] if newest.target is not None else seqs:
            self.backend.delete(self._entry_path(name, seq))
        local = self.backend.local_path(f"refs/{name}")
        if newest.target is None and local is not None:
            try:
                os.rmdir(local)
            except OSError:
                pass  # not empty (a ref below it, or an entry written since): listed as before

    def listing(self, prefix: str = "") -> dict[str, dict[int, Entry | None]]:
        """Every entry file below ``refs/`` (under ``prefix``, a ref name's leading segments)
        by ref name and seq, as listed (nothing is read); None where what is there is not a file
        (:meth:`read_entry` with ``is_file`` False raises the damage)."""
        return self.listing_and_temporaries(prefix)[0]

    def listing_and_temporaries(self, prefix: str = "") -> tuple[dict[str, dict[int, Entry | None]], list[tuple[str, float, int]]]:
        """:meth:`listing`, and the leftovers of interrupted writes it passed, as (path, mtime, size), as
        :meth:`ObjectStore.list_temporaries` gives them (gc's, without listing refs/ again)."""
        if prefix:
            validate_ref_name(prefix.rstrip("/"))
        return self._listed(f"refs/{prefix.rstrip('/')}" if prefix else "refs")

    def entry_path(self, name: str, seq: int) -> str:
        return self._entry_path(name, seq)

    def read_entry(self, name: str, seq: int, is_file: bool = True) -> RefEntry:
        """Entry ``seq`` of ``name`` (raises StoreFormatError when damaged, absent or, ``is_file``
        False, not a file)."""
        return self._read(name, seq, is_file)

    def all_entries(self, prefix: str = "") -> dict[str, list[RefEntry]]:
        """Every ref ever written (under ``prefix``), with its history newest first."""
        by_name = self.listing(prefix)
        return {n: [self._read(n, s, f is not None) for s, f in sorted(seqs.items(), reverse=True)]
                for n, seqs in sorted(by_name.items())}

    def scan_histories(self, prefix: str = "", listing: Mapping[str, Mapping[int, Entry | None]] | None = None
                       ) -> tuple[dict[str, list[RefEntry]], dict[str, tuple[StoreFormatError, str]]]:
        """Like :meth:`all_entries`, but an entry that cannot be read is reported, not raised.

        Returns (histories, damaged): each ref's entries newest first, down to (not
        including) its newest damaged entry, if any; and for each ref with a damaged
        entry, (the error, the entry's path). Entries older than a damaged one are left
        out: whether the damaged entry was a removal cannot be known, so neither can
        what they count for. ``listing``: the refs as :meth:`listing` of ``prefix`` gave them, where the
        caller listed them already.
        """
        out: dict[str, list[RefEntry]] = {}
        damaged: dict[str, tuple[StoreFormatError, str]] = {}
        for n, seqs in sorted((self.listing(prefix) if listing is None else listing).items()):
            out[n], bad = self._readable(n, seqs)
            if bad is not None:
                damaged[n] = bad
        return out, damaged

    def readable_history(self, name: str) -> tuple[list[RefEntry], StoreFormatError | None]:
        """:meth:`history` down to (not including) the newest entry that cannot be read, and the
        error of that entry (None when every entry is readable)."""
        validate_ref_name(name)
        entries, bad = self._readable(name, self._entry_seqs(name))
        return entries, bad[0] if bad is not None else None

    def _readable(self, name: str, seqs: Mapping[int, Entry | None]) -> tuple[list[RefEntry], tuple[StoreFormatError, str] | None]:
        def attempt(listed: Mapping[int, Entry | None], last: bool) -> tuple[list[RefEntry], tuple[StoreFormatError, str] | None]:
            entries: list[RefEntry] = []
            for s, f in sorted(listed.items(), reverse=True):
                try:
                    entries.append(self._read(name, s, f is not None))
                except StoreFormatError as err:
                    if isinstance(err, RefEntryGoneError) and not last:
                        raise  # deleted since listed (see _newest_entry): the history is listed again
                    return entries, (err, self._entry_path(name, s))
            return entries, None
        return reread_listed(seqs, lambda: self._entry_seqs(name), attempt)

    def live(self) -> dict[str, RefEntry]:
        """Current entry of every ref that exists now (not removed). A damaged entry raises."""
        out, damaged = self.scan()
        if damaged:
            err, _ = next(iter(damaged.values()))
            raise err
        return out

    def scan(self, prefix: str = "") -> tuple[dict[str, RefEntry], dict[str, tuple[StoreFormatError, str]]]:
        """Like :meth:`live`, but a ref whose newest entry cannot be read is reported, not raised.

        Returns (live refs, damaged refs: name -> (the error, the entry's path)), under ``prefix``
        (a ref name's leading segments) when given.
        """
        out: dict[str, RefEntry] = {}
        damaged: dict[str, tuple[StoreFormatError, str]] = {}
        for n, seqs in sorted(self.listing(prefix).items()):
            s = max(seqs)
            try:
                entry = self._newest_entry(n, (s, seqs[s] is not None))
            except StoreFormatError as err:
                damaged[n] = (err, self._entry_path(n, s))
                continue
            if entry is not None and entry.target is not None:
                out[n] = entry
        return out, damaged
