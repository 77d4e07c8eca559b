"""Refs: human names for checkpoints, each with an append-only history.

A ref ``llama-ft/legal`` is the directory ``refs/llama-ft/legal/`` holding one
immutable entry per update, ``0000000001.ref``, ``0000000002.ref``... The entry
with the highest number is the ref's current value; a ``target`` of null marks
the ref as removed. Entries are created with an exclusive create, so two writers
can never both write entry N: the loser re-reads and takes N+1. No update and no
history entry is ever lost, and nothing is modified in place.

The entries' record and name rules are in :mod:`~ckpt_store.storage.ref_entry`, the listing of the
folder in :mod:`~ckpt_store.storage.ref_listing`; both are exported from here too.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping

from ckpt_store.storage.backends.base import Entry
from ckpt_store.storage.errors import (
    InvalidNameError,
    RefConflictError,
    RefNotFoundError,
    StorageIOError,
    StoreFormatError,
)
from ckpt_store.storage.objects import Temporaries
from ckpt_store.storage.records import MAX_RECORD_BYTES
from ckpt_store.storage.ref_entry import (
    GONE_TRIES,
    MAX_NAME,
    MAX_SEQ,
    REF_FORMAT,
    REF_VERSION,
    RefEntry,
    RefEntryGoneError,
    RefJournal,
    history_floor,
    reread_listed,
    reread_while_gone,
    validate_ref_name,
)
from ckpt_store.storage.ref_listing import RefsFolder, gaps

__all__ = ["GONE_TRIES", "MAX_NAME", "MAX_SEQ", "REF_FORMAT", "REF_VERSION", "RefEntry", "RefEntryGoneError",
           "RefJournal", "RefsFolder", "Refs", "history_floor", "reread_listed", "reread_while_gone",
           "validate_ref_name"]

# What a reader knows of a listed entry file (name, seq, as listed): the entry it holds, or None (it is read).
Known = Callable[[str, int, Entry], RefEntry | None]


class Refs(RefsFolder):
    """Read and update refs below ``refs/`` of a store."""

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
                raise self._gap(name, seq, seq)
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

    def _gap(self, name: str, first: int, last: int) -> StoreFormatError:
        """The damage of entries ``first`` to ``last`` of ``name`` missing, with entries before and after them."""
        if first == last:
            return StoreFormatError(f"ref entry {self._entry_path(name, first)} is missing, with entries of {name} before and "
                                    f"after it: what {name} named then is unknown, and so is which version {name}@N names "
                                    "beyond it", hint="put the entry file back from a backup of the store, or move the "
                                    "entries older than it out of the store folder too (gc then frees what only they named)")
        return StoreFormatError(f"ref entries {self._entry_path(name, first)} to {last:010d}.ref ({last - first + 1} of them) "
                                f"are missing, with entries of {name} before and after them: what {name} named then is "
                                f"unknown, and so is which version {name}@N names beyond them",
                                hint="put the entry files back from a backup of the store, or move the entries older than "
                                "them out of the store folder too (gc then frees what only they named)")

    def history(self, name: str) -> list[RefEntry]:
        """Every entry of ``name``, newest first (empty if the ref never existed)."""
        validate_ref_name(name)
        entries, bad = self._readable(name, self._entry_seqs(name))
        if bad is not None:
            raise bad[0]
        return entries

    def log(self, name: str) -> tuple[list[RefEntry], dict[int, StoreFormatError]]:
        """Like :meth:`history`, but an entry that cannot be read is reported, not raised: every
        readable entry of ``name``, newest first, and the error of each other one by seq. Entries missing
        between others (deleted by hand) are one error for each run of them, by its newest, naming them all."""
        validate_ref_name(name)

        def attempt(last: bool) -> tuple[list[RefEntry], dict[int, StoreFormatError]]:
            entries: list[RefEntry] = []
            damaged: dict[int, StoreFormatError] = {}
            listed = self._entry_seqs(name)
            for s, f in sorted(listed.items(), reverse=True):
                try:
                    entries.append(self._read(name, s, f is not None))
                except StoreFormatError as err:
                    if isinstance(err, RefEntryGoneError) and not last:
                        raise  # deleted since listed (see _newest_entry): not damage, the history is listed again
                    damaged[s] = err
            # The listing names only the newest number missing (the other readers stop there): the log, each run.
            for first, end in gaps(listed):
                if listed.get(end + 1, True) is None and self._missing(self._entry_path(name, end + 1)):
                    end += 1  # the run's newest, as listed
                damaged[end] = self._gap(name, first, end)
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
                # Listed from this object's last entry (the hint _newest starts at): on S3 one request, as many as
                # the guess's two HEADs below; on a local store one directory read. It sees what the guess cannot:
                # a gap of two or more entries above it (deleted by hand), which the guess would fill, never current.
                seq = (self._newest(name) or (0, True))[0] + 1
            else:
                # Where a listing is dear (another fsspec filesystem lists the ref's whole history): one past this
                # object's last, where that entry is there and the one above the guess is not (two lookups).
                # Entries are numbered with no gap and each writer creates one past the newest it sees, so if the
                # guess is free (the create is exclusive) nothing newer exists. Both checked: the ref may have been
                # removed from the folder and begun again since, or an entry above the guess deleted (a gap: the
                # update would fill it, below the newest, never current). Else one past the newest as listed (see
                # _newest). A gap of two or more is not seen here: only a listing would.
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
                # Durable before any caller acts on it: a removal that a power loss undid after a gc freed the
                # ref's data would bring back a ref to nothing (a push's commit flushes here too, as it did after)
                self.backend.flush()
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

    def listing_and_temporaries(self, prefix: str = "") -> tuple[dict[str, dict[int, Entry | None]], Temporaries]:
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

    def scan_histories(self, prefix: str = "", listing: Mapping[str, Mapping[int, Entry | None]] | None = None,
                       known: Known | None = None) -> tuple[dict[str, list[RefEntry]], dict[str, tuple[StoreFormatError, str]]]:
        """Like :meth:`all_entries`, but an entry that cannot be read is reported, not raised.

        Returns (histories, damaged): each ref's entries newest first, down to (not
        including) its newest damaged entry, if any; and for each ref with a damaged
        entry, (the error, the entry's path). Entries older than a damaged one are left
        out: whether the damaged entry was a removal cannot be known, so neither can
        what they count for. ``listing``: the refs as :meth:`listing` of ``prefix`` gave them, where the
        caller listed them already. ``known``: ``known(name, seq, listed)`` is the entry a file listed so
        holds where the caller knows it (the metadata index's record of that file,
        :meth:`~ckpt_store.storage.index.StoreIndex.recorded`), else None: the file is read.
        """
        out: dict[str, list[RefEntry]] = {}
        damaged: dict[str, tuple[StoreFormatError, str]] = {}
        for n, seqs in sorted((self.listing(prefix) if listing is None else listing).items()):
            out[n], bad = self._readable(n, seqs, known)
            if bad is not None:
                damaged[n] = bad
        return out, damaged

    def readable_history(self, name: str) -> tuple[list[RefEntry], StoreFormatError | None]:
        """:meth:`history` down to (not including) the newest entry that cannot be read, and the
        error of that entry (None when every entry is readable)."""
        validate_ref_name(name)
        entries, bad = self._readable(name, self._entry_seqs(name))
        return entries, bad[0] if bad is not None else None

    def _readable(self, name: str, seqs: Mapping[int, Entry | None], known: Known | None = None
                  ) -> tuple[list[RefEntry], tuple[StoreFormatError, str] | None]:
        def attempt(listed: Mapping[int, Entry | None], last: bool) -> tuple[list[RefEntry], tuple[StoreFormatError, str] | None]:
            entries: list[RefEntry] = []
            for s, f in sorted(listed.items(), reverse=True):
                if f is not None and known is not None and (entry := known(name, s, f)) is not None:
                    entries.append(entry)
                    continue
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
