"""What names a checkpoint in a store, and the refs' histories: :class:`StoreNames`, the part of
:class:`~ckpt.store.store.Store` that resolves a ref, ``name@N`` or an id prefix to a checkpoint id,
reads its manifest, lists and removes refs, and says which names were meant when one names nothing."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckpt._deprecation import deprecated
from ckpt.errors import AmbiguousRefError, CkptError, ObjectNotFoundError, RefNotFoundError
from ckpt.format.manifest import Manifest
from ckpt_store.storage.errors import InvalidNameError
from ckpt_store.storage.objects import ObjectStore
from ckpt_store.storage.refs import MAX_SEQ, RefEntry, Refs, validate_ref_name

if TYPE_CHECKING:
    from ckpt.store.catalog import RefListing
    from ckpt_store.storage.index import StoreIndex

_HISTORY = re.compile(r"^(.*)@([0-9]+)\Z")
_HEX = re.compile(r"^[0-9a-f]{4,64}\Z")
_FULL_ID = re.compile(r"^[0-9a-f]{64}\Z")


def _nameable(name: str) -> bool:
    """Whether a ref folder's name is one a command can name (a damaged store's may not be)."""
    try:
        validate_ref_name(name)
    except InvalidNameError:
        return False
    return True



class StoreNames:
    """Names and refs of a :class:`~ckpt.store.store.Store` (which derives from this); the attributes
    it reads are the store's."""

    objects: ObjectStore
    refs_db: Refs
    index: StoreIndex | None

    # -- names ---------------------------------------------------------------
    def resolve(self, ref: str) -> str:
        """The checkpoint id ``ref`` names: a ref, ``name@N``, or an id prefix.

        ``name@N`` is the N-th newest version ``name`` pointed at (removals do not count),
        as ``ckpt log`` labels them: ``name@0`` is the current version, or, once the ref
        is removed, the last one it had. A full 64-digit id of a checkpoint in the store names
        that checkpoint even where a ref is named so (reach the ref as ``name@0``); a shorter
        id prefix yields to a ref of that name. An earlier version that ``gc`` has freed (every
        version of a removed ref; earlier versions with ``--no-history``) raises
        :class:`RefNotFoundError` saying so.
        """
        if not isinstance(ref, str) or not ref:
            raise RefNotFoundError("empty ref")
        m = _HISTORY.match(ref)
        if m:
            name, digits = m.group(1), m.group(2).lstrip("0") or "0"
            # A ref has at most MAX_SEQ versions; a longer number names none (and int() refuses 4,300 digits).
            back = int(digits) if len(digits) <= len(str(MAX_SEQ)) else MAX_SEQ + 1
            # Versions newer than a damaged entry are known; what lies beyond it is not.
            history, damaged = self.refs_db.readable_history(name)
            versions = [e for e in history if e.target is not None]
            if back >= len(versions):
                if damaged is not None:
                    raise damaged
                plural = "" if len(versions) == 1 else "s"
                raise RefNotFoundError(f"{name} has {len(versions)} version{plural}; {ref} does not exist", hint=f"see `ckpt log {name}`")
            entry = versions[back]
            target: str = entry.target  # type: ignore[assignment]
            if (history[0].target is None or back > 0) and not self.objects.has("manifests", target):
                # Not the current version: gc may have freed it on purpose (gc_roots says which
                # versions it keeps). A current version whose manifest is missing is damage,
                # which `ckpt verify` reports.
                if history[0].target is None:
                    why = f"{name} was removed"
                elif any(e.target is None for e in history[:history.index(entry)]):
                    why = f"{name} was removed, then pushed again"
                elif entry.alias:
                    why = f"{ref} was set as an alias (like RUN/latest): gc keeps only the current version of an alias"
                else:
                    why = "gc --no-history frees earlier versions"
                raise RefNotFoundError(f"{ref} (checkpoint {target[:12]}) is no longer in the store: `ckpt gc` freed it ({why})")
            return target
        if _FULL_ID.match(ref) and self.objects.has("manifests", ref):
            # A full id names its checkpoint, as in `manifest`, even where a ref is named so (the
            # ref is still NAME@0): each command must take the same checkpoint for one name.
            return ref
        try:
            entry = self.refs_db.current(ref)
        except InvalidNameError:
            entry = None
            if not _HEX.match(ref):
                raise
        if entry is not None:
            return entry.target  # type: ignore[return-value]
        if _HEX.match(ref):  # a removed ref named with hex digits yields to an id prefix, if one matches
            found = self.objects.find_manifests(ref)
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                raise AmbiguousRefError(f"{ref} matches {len(found)} checkpoints", hint="give more digits")
        if self.refs_db.history(ref):
            raise RefNotFoundError(f"ref {ref} was removed", hint=f"its last version is {ref}@0; history: `ckpt log {ref}`")
        raise RefNotFoundError(f"no ref or checkpoint named {ref!r}", hint=self._near_names(ref))

    def _near_names(self, ref: str) -> str:
        """The hint for a name that names nothing: the live refs below it (``minilm`` for
        ``minilm/base``), else those spelled most like it (a typo), then where to look. One
        listing of ``refs/`` and the newest entries of the refs offered (a removed one is not),
        on this error path only."""
        def live(name: str) -> bool:
            try:
                return self.refs_db.current(name) is not None
            except (CkptError, OSError):
                return False

        try:
            names = sorted(n for n in self.refs_db.listing() if n != ref and _nameable(n))
        except (CkptError, OSError):  # the error being raised is the one worth seeing
            names = []
        below = [n for n in names if n.startswith(ref.rstrip("/") + "/")]
        if below:
            try:
                below = sorted(self.refs_db.scan(ref.rstrip("/"))[0])
            except (CkptError, OSError):
                below = []
        if below:
            more = f" and {len(below) - 3} more" if len(below) > 3 else ""
            return f"refs below it: {', '.join(repr(n) for n in below[:3])}{more}; see `ckpt ls`"
        close = [n for n in difflib.get_close_matches(ref, names, n=6, cutoff=0.75) if live(n)][:3]
        return ("did you mean " + " or ".join(repr(n) for n in close) + "? " if close else "") + "see `ckpt ls`"

    def manifest(self, ref: str) -> Manifest:
        """The manifest of ``ref``: a checkpoint id (read directly, one request), or
        anything :meth:`resolve` accepts. Verified against its id."""
        missing: ObjectNotFoundError | None = None
        if isinstance(ref, str) and _FULL_ID.match(ref):
            try:
                return Manifest.from_json(self.objects.get_manifest(ref), f"manifest {ref}")
            except ObjectNotFoundError as e:
                missing = e  # unless a ref is named with these 64 hex digits
        try:
            mid = self.resolve(ref)
        except RefNotFoundError:
            if missing is not None:
                raise missing from None
            raise
        return Manifest.from_json(self.objects.get_manifest(mid), f"manifest {mid}")

    def get_manifest(self, manifest_id: str) -> Manifest:
        """Deprecated: :meth:`manifest` takes a checkpoint id as well as a ref."""
        deprecated("Store.get_manifest(id)", "Store.manifest(id)")
        return self.manifest(manifest_id)

    def refs(self) -> dict[str, RefEntry]:
        """Every live ref and its current entry, by name."""
        from ckpt.store.catalog import live_refs

        return live_refs(self)

    def ls(self) -> RefListing:
        """Every live ref with a summary of its checkpoint (size, tensors, message), by name,
        and the refs that cannot be read (``damaged``, with the error) instead of raising.

        Reads the store's metadata index, checked against the listing of refs, instead of
        every manifest (storage/index.py).

        >>> import torch, ckpt
        >>> store = ckpt.Store.init("memory://doctest-ls")
        >>> _ = store.push({"w": torch.zeros(4)}, "demo/a", message="first")
        >>> [(r.name, r.logical_bytes, r.tensors, r.message) for r in store.ls().refs]
        [('demo/a', 80, 1, 'first')]
        """
        from ckpt.store.catalog import list_refs

        return list_refs(self)

    def log(self, name: str) -> list[RefEntry]:
        """History of ``name``, newest first (removals included, with ``target`` None)."""
        history = self.refs_db.history(name)
        if not history:
            raise RefNotFoundError(f"no ref named {name!r}", hint=self._near_names(name))
        return history

    def readable_log(self, name: str) -> tuple[list[RefEntry], dict[int, str]]:
        """:meth:`log`, going on past entries that cannot be read: the readable entries, newest
        first, and the error of each damaged one by its number (``seq``). Versions older than a
        damaged entry have no ``NAME@N`` (whether it was a removal is unknown); their ids name them.
        """
        history, damaged = self.refs_db.log(name)
        if not history and not damaged:
            raise RefNotFoundError(f"no ref named {name!r}", hint=self._near_names(name))
        return history, {s: str(e) for s, e in damaged.items()}

    def ref_history(self, prefix: str = "") -> dict[str, list[RefEntry]]:
        """Every ref ever written whose name starts with the segments ``prefix`` (all refs when
        empty), removed ones included, each with its history newest first (as :meth:`log`).

        >>> import torch
        >>> import ckpt
        >>> s = ckpt.Store.init("memory://ref-history-doctest")
        >>> _ = s.push({"w": torch.ones(2)}, "run/step-1"); _ = s.remove("run/step-1")
        >>> [(n, [e.target is None for e in h]) for n, h in s.ref_history("run").items()]
        [('run/step-1', [True, False])]
        """
        return self.refs_db.all_entries(prefix)

    def readable_ref_history(self, prefix: str = "", *, only: Callable[[str], bool] | None = None,
                             newest: Callable[[str], bool] | None = None) -> tuple[dict[str, list[RefEntry]], dict[str, str]]:
        """:meth:`ref_history`, going on past entries that cannot be read: each ref's entries down to
        (not including) its newest damaged one, and the error of that one by ref name. ``only``: the
        refs wanted, by name (a run's steps, not its ``latest`` and the thousand entries of its history).
        ``newest``: refs of which the newest entry alone is wanted (a run's ``latest``: what it names now).

        An entry the metadata index records is taken from it where the listing of ``refs/`` shows its file
        as recorded (the index's rule for exact readers: a file changed since is read), not read: a run
        of 1,500 snapshots is one load of the index, not 1,500 entry files."""
        known = self.index.recorded() if self.index is not None else None  # (loaded before refs/ is listed)
        listing = self.refs_db.listing(prefix)
        if only is not None:
            listing = {n: seqs for n, seqs in listing.items() if only(n)}
        if newest is not None:
            listing = {n: dict([max(seqs.items())]) if seqs and newest(n) else seqs for n, seqs in listing.items()}
        histories, damaged = self.refs_db.scan_histories(prefix, listing, known)
        return histories, {n: str(err) for n, (err, _) in damaged.items()}

    def remove(self, name: str, *, expect: str | None = None) -> RefEntry:
        """Remove ref ``name`` (its data is freed by a later ``gc``). With ``expect`` (a checkpoint id),
        only while it names that checkpoint: :class:`RefConflictError` where another process moved it."""
        from ckpt.snapshot.local_lock import keeping_off

        validate_ref_name(name)
        try:
            with keeping_off(self):  # (not in a local tier a manager holds and collects, but through its own store)
                return self.refs_db.remove(name, expect=expect)  # checks the ref is live as it writes the removal
        except RefNotFoundError as e:
            raise RefNotFoundError(e.message, hint=self._near_names(name)) from None

