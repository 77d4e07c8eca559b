"""Content-addressed objects: immutable blobs named by the BLAKE3 hash of their content.

Two kinds share the machinery: ``chunks`` (named by the hash of their *decoded*
bytes; the codec lives in ckpt/) and ``manifests`` (named by the hash of their
canonical JSON, verified here on every read and write).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import blake3

from ckpt_store.storage.backends.base import TEMPORARY, Backend, condemned_original, creates_are_exclusive
from ckpt_store.storage.cache import ChunkBlobCache
from ckpt_store.storage.errors import (
    CorruptObjectError,
    InvalidNameError,
    ObjectNotFoundError,
    RecordTooLargeError,
    StoreFormatError,
)
from ckpt_store.storage.records import MAX_RECORD_BYTES

KINDS = ("chunks", "manifests")
_ID = re.compile(r"^[0-9a-f]{64}\Z")


def check_manifest_size(nbytes: int, what: str) -> None:
    """:class:`RecordTooLargeError` where ``what`` (a manifest, or part of one) is ``nbytes`` bytes, past
    what :meth:`ObjectStore.get` reads of a manifest (``MAX_RECORD_BYTES``): no reader could open it."""
    if nbytes > MAX_RECORD_BYTES:
        raise RecordTooLargeError(f"{what} is {nbytes:,} bytes, more than the {MAX_RECORD_BYTES:,} a store's readers accept",
                                  hint="a checkpoint's non-tensor values are kept in its manifest: "
                                  "save large ones (a list of millions of numbers) as tensors")


def object_id(data: bytes | memoryview) -> str:
    """BLAKE3 of ``data`` as 64 lowercase hex digits: the name of every object."""
    return blake3.blake3(data).hexdigest()


def object_hasher() -> blake3.blake3:
    """:func:`object_id` of bytes handed over part by part: ``update(part)`` each in order, then
    ``hexdigest()`` (the id of them all, joined)."""
    return blake3.blake3()


def check_id(object_id_: str) -> str:
    if not isinstance(object_id_, str) or not _ID.match(object_id_):
        raise InvalidNameError(f"{object_id_!r} is not an object id (64 lowercase hex digits)")
    return object_id_


@dataclass(frozen=True)
class ObjectInfo:
    kind: str
    id: str
    size: int
    mtime: float
    # Where a killed gc left it condemned, if it is listed as the object recovery will put back
    # (inventory's ``as_recovered``): a dry run reads it from there (get_manifest's ``at``).
    condemned: str | None = None


# Leftovers of interrupted writes a listing passed, as (path, mtime, size): what gc deletes once old.
Temporaries = list[tuple[str, float, int]]
# What ObjectStore.inventory gives: every object by kind, and the temporaries the listing passed.
Inventory = tuple[dict[str, list[ObjectInfo]], Temporaries]


class ObjectStore:
    """``objects/<kind>/<id[:2]>/<id>`` below the store root."""

    def __init__(self, backend: Backend, cache: ChunkBlobCache | None = None, max_chunk_blob: int | None = None) -> None:
        self.backend = backend
        # Chunk blobs read from a remote store are kept here, and read from here first.
        self.cache = cache
        # The largest chunk blob a read accepts (a chunk's bytes at most, and a header): a larger
        # file is refused before it is read, not read into memory whatever its size.
        self.max_chunk_blob = max_chunk_blob

    @property
    def creates_chunks_exclusively(self) -> bool:
        """Whether a new chunk is created only if absent, so that a push or copy that finds another
        writer's blob keeps it and names its chain: on a local store (``link()``) and on S3
        (``If-None-Match``). A chunk found so is not made young where objects cannot be touched
        (S3): a gc may take it before the writer's commit, which then writes it again under its
        lease (storage/commit.py)."""
        return self.backend.touches or creates_are_exclusive(self.backend)

    @staticmethod
    def path(kind: str, oid: str) -> str:
        assert kind in KINDS, kind
        check_id(oid)
        return f"objects/{kind}/{oid[:2]}/{oid}"

    def has(self, kind: str, oid: str) -> bool:
        return self.backend.exists(self.path(kind, oid))

    def refresh(self, kind: str, oid: str) -> bool:
        """Touch an object a write is about to depend on; False if it is absent."""
        return self.backend.touch(self.path(kind, oid))

    def has_many(self, kind: str, oids: Iterable[str]) -> set[str]:
        """The ids among ``oids`` that are stored (batched on remote stores)."""
        by_path = {self.path(kind, o): o for o in oids}
        return {by_path[p] for p in self.backend.exists_many(by_path)}

    def written_times(self, kind: str, lookups: int, *, times: bool = True) -> Callable[[str], float | None]:
        """For a batch of about ``lookups`` questions: when object ``oid`` was written (the
        store's time, as :meth:`Backend.mtime` gives it; 0.0 where the backend cannot tell, or
        ``times`` is False: only whether it is stored, one request less where no listing answers),
        or None when it is not stored.

        On a remote store whose ``objects/<kind>`` lists in fewer requests than that many
        HEADs, one listing made now answers them all (an object added later by someone
        else is just written again; one deleted later is caught by ``commit``'s check).
        """
        listed = self.backend.list_times(f"objects/{kind}", lookups)
        if listed is None and not times:
            return lambda oid: 0.0 if self.has(kind, oid) else None
        if listed is None:
            return lambda oid: self.backend.written(self.path(kind, oid))
        names = {p.rsplit("/", 1)[-1]: t for p, t in listed.items()}
        return names.get

    def put(self, kind: str, oid: str, blob: bytes | memoryview) -> bool:
        """Store ``blob`` under ``oid`` unless it exists. Returns True when written.

        An existing object is touched instead, so that a concurrent ``gc`` sees
        it as in use (docs/format.md, "Garbage collection"). A manifest larger than :meth:`get`
        reads (``MAX_RECORD_BYTES``) is a :class:`RecordTooLargeError`: written, it would name a
        checkpoint no reader can open.
        """
        if kind == "manifests":
            check_manifest_size(len(blob), f"manifest {oid[:12]}")
        p = self.path(kind, oid)
        if self.backend.touch(p):
            return False
        self.backend.write(p, blob)
        return True

    def get(self, kind: str, oid: str, *, at: str | None = None, cached: bool = True) -> bytes:
        """Object ``oid``, from its own path or from ``at`` (:attr:`ObjectInfo.condemned`); ``cached=False``:
        the store's own, past the local chunk cache (which may hold another store's blob of a chunk)."""
        cache = self.cache if kind == "chunks" and at is None and cached else None
        if cache is not None:
            blob = cache.get(oid)
            if blob is not None:
                return blob
        try:
            blob = self.backend.read(at or self.path(kind, oid), self.max_chunk_blob if kind == "chunks" else MAX_RECORD_BYTES)
        except FileNotFoundError:
            raise self._missing(kind, oid) from None
        except StoreFormatError as e:  # larger than any such object
            raise CorruptObjectError(kind[:-1], oid, str(e)) from None
        if cache is not None:
            cache.put(oid, (blob,))
        return blob

    def _missing(self, kind: str, oid: str) -> ObjectNotFoundError:
        """The error for an absent object. One a gc stopped part way left condemned is not lost:
        the error says what puts it back (the next gc's first step), not to look for damage."""
        hint = None
        if self.backend.recovers_condemned:
            where = self.path(kind, oid).rpartition("/")[0]
            if any(condemned_original(e.path.rpartition("/")[2]) == oid for e in self.backend.list(where)):
                hint = "a gc stopped part way left it set aside; the next `ckpt gc` puts it back first"
        return ObjectNotFoundError(kind[:-1], oid, hint=hint)

    def size(self, kind: str, oid: str) -> int:
        try:
            return self.backend.size(self.path(kind, oid))
        except FileNotFoundError:
            raise ObjectNotFoundError(kind[:-1], oid) from None

    def delete(self, kind: str, oid: str) -> None:
        self.backend.delete(self.path(kind, oid))

    def list(self, kind: str) -> Iterator[ObjectInfo]:
        """Every stored object of ``kind`` (temporary files are left out)."""
        for e in self.backend.list(f"objects/{kind}"):
            name = e.path.rsplit("/", 1)[-1]
            if _ID.match(name):
                yield ObjectInfo(kind, name, e.size, e.mtime)

    def inventory(self, *, as_recovered: bool = False) -> Inventory:
        """One listing of ``objects/``: every stored object by kind, and the leftovers of
        interrupted writes there as (path, mtime, size) -- what :meth:`list` for each kind and
        :meth:`list_temporaries` give, in a single walk (a stat per object locally, a
        request per 1,000 objects on S3).

        ``as_recovered``: objects a killed gc condemned are listed as the objects
        :meth:`Backend.recover_condemned` would put back (one whose name is taken is dropped,
        as it would be), not as temporaries: what a gc's dry run plans with."""
        found: dict[str, dict[str, ObjectInfo]] = {k: {} for k in KINDS}
        back: list[ObjectInfo] = []
        temps: Temporaries = []
        for e in self.backend.list("objects"):
            parts = e.path.split("/")
            name = parts[-1]
            original = condemned_original(name) if as_recovered else None
            if original is not None:
                name = original
            elif name.startswith(TEMPORARY):
                temps.append((e.path, e.mtime, e.size))
                continue
            if len(parts) == 4 and parts[1] in found and _ID.match(name):
                info = ObjectInfo(parts[1], name, e.size, e.mtime, None if original is None else e.path)
                if original is None:
                    found[parts[1]][name] = info
                else:
                    back.append(info)
        for info in back:
            found[info.kind].setdefault(info.id, info)
        return {k: list(v.values()) for k, v in found.items()}, temps

    def list_temporaries(self, prefixes: tuple[str, ...] = ("objects",)) -> Iterator[tuple[str, float, int]]:
        """Leftovers of interrupted writes below ``prefixes``: (path, mtime, size)."""
        for prefix in prefixes:
            for e in self.backend.list(prefix):
                if e.path.rsplit("/", 1)[-1].startswith(TEMPORARY):
                    yield e.path, e.mtime, e.size

    # Manifests are verified here: their id is the hash of the bytes stored.
    def put_manifest(self, data: bytes) -> str:
        oid = object_id(data)
        self.put("manifests", oid, data)
        return oid

    def get_manifest(self, oid: str, *, at: str | None = None) -> bytes:
        data = self.get("manifests", oid, at=at)
        if object_id(data) != oid:
            raise CorruptObjectError("manifest", oid, "content does not match its id")
        return data

    def find_manifests(self, prefix: str) -> list[str]:
        """Manifest ids starting with ``prefix`` (at least 4 hex digits)."""
        prefix = prefix.lower()
        return sorted(
            e.path.rsplit("/", 1)[-1]
            for e in self.backend.list(f"objects/manifests/{prefix[:2]}")
            if e.path.rsplit("/", 1)[-1].startswith(prefix) and _ID.match(e.path.rsplit("/", 1)[-1])
        )
