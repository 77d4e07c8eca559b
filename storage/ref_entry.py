"""A ref's entries: the names refs may take, the record of one update (:class:`RefEntry`), and reading
again an entry deleted since it was listed. :mod:`ckpt_store.storage.refs` reads and writes them."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ckpt_store.storage.errors import InvalidNameError, StoreFormatError
from ckpt_store.storage.records import decode_record, finite_time, require, sealed_json

REF_FORMAT = "ckpt-ref"
REF_VERSION = 2  # 2: sealed with a checksum (storage/records.py); 1 is still read
MAX_NAME = 255
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
ENTRY_NAME = re.compile(r"^([0-9]{10})\.ref\Z")
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
        if not _SEGMENT.match(seg) or ENTRY_NAME.match(seg):
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

