"""The one error root of ckpt and the storage-level errors.

``CkptError`` lives here, at the bottom of the dependency graph, so that every
layer (``storage`` -> ``ckpt`` -> ``cli``) raises subclasses of one class and
only ``cli/`` turns them into exit codes and one-line messages.
"""

from __future__ import annotations

import errno as _errno


class CkptError(Exception):
    """Root of every error ckpt raises on purpose.

    ``hint`` says what the user can do about it; ``retryable`` says whether the
    same call may succeed if simply repeated (a network blip, a busy ref).
    """

    retryable: bool = False

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from its attributes, not by calling __init__ again (whose arguments differ in
        # subclasses): an error pickled to another rank (DCP's failures) arrives as itself, not
        # as a TypeError from unpickling it.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[CkptError], args: tuple[object, ...], state: dict[str, object]) -> CkptError:
    e = cls.__new__(cls, *args)
    e.args = args
    e.__dict__.update(state)
    return e


class StoreNotFoundError(CkptError):
    """No ckpt store exists at the given URL."""

    def __init__(self, url: str) -> None:
        super().__init__(f"no ckpt store at {url}", hint="create one with `ckpt init`")
        self.url = url


class StoreFormatError(CkptError):
    """The store's config is missing, unreadable, or of a version this ckpt cannot read."""


class LaterFormatError(StoreFormatError):
    """A manifest of a format version this ckpt does not know (a later ckpt's): what it names is not guessed at (gc
    would free the chunks it keeps under keys this ckpt has never seen); upgrading ckpt reads it."""

    def __init__(self, message: str, object_id: str | None = None) -> None:
        super().__init__(message, hint="upgrade ckpt to read it")
        self.kind = "manifest"
        self.object_id = object_id


class UnusableManifestError(StoreFormatError):
    """A manifest whose bytes match its id but that names what cannot be (a chunk id, file path or tensor name no
    name can be): its writer's damage, which no other store's copy repairs (any copy has the same bytes)."""

    def __init__(self, object_id: str, detail: str) -> None:
        super().__init__(f"manifest {object_id} names what cannot be: {detail}",
                         hint="`ckpt rm` the refs that name it (`ckpt verify` lists them); its bytes are as written")
        self.kind = "manifest"
        self.object_id = object_id


class RecordTooLargeError(CkptError):
    """A record (a manifest) larger than any reader accepts (``MAX_RECORD_BYTES``): refused before it
    is written, since no checkpoint it named could ever be read back."""


class StoreLocationError(CkptError):
    """A store URL that cannot hold a store: empty, a file, or a directory inside another store."""


class InvalidNameError(CkptError):
    """A ref name, tensor name or path component that could escape or confuse the store."""


class ObjectNotFoundError(CkptError):
    """An object a checkpoint needs is missing from the store."""

    def __init__(self, kind: str, object_id: str, *, hint: str | None = None) -> None:
        super().__init__(
            f"{kind} {object_id} is missing from the store",
            hint=hint or "run `ckpt verify` to see which refs are affected",
        )
        self.kind = kind
        self.object_id = object_id


class ChunksVanishedError(ObjectNotFoundError):
    """Chunks a push found in the store were gone when its commit came to name them (a concurrent
    gc, on a store that cannot touch objects); ``ids``: all of them. Pushing again is safe."""

    def __init__(self, ids: list[str]) -> None:
        super().__init__("chunk", ids[0], hint="it vanished while pushing (a concurrent gc?); push again")
        self.ids = ids


class CorruptObjectError(CkptError):
    """An object's bytes do not match its id or cannot be decoded."""

    def __init__(self, kind: str, object_id: str, detail: str) -> None:
        super().__init__(
            f"{kind} {object_id} is corrupt: {detail}",
            hint="run `ckpt verify` to see which refs are affected",
        )
        self.kind = kind
        self.object_id = object_id
        self.detail = detail


class RefNotFoundError(CkptError):
    """A ref name, ``name@N`` or id prefix that resolves to nothing."""


class AmbiguousRefError(CkptError):
    """A checkpoint id prefix that matches more than one checkpoint."""


class RefConflictError(CkptError):
    """Another writer kept winning the race to update a ref."""

    retryable = True


DISK_FULL = (_errno.ENOSPC, _errno.EDQUOT)  # errnos that say the medium is full


class StorageIOError(CkptError):
    """The backend failed to read or write; ``retryable`` tells whether to try again, ``errno``
    (where an OS error caused it) what failed. Both travel with the error when it is pickled
    (to another rank of a process group, say), unlike its ``__cause__``."""

    def __init__(self, message: str, *, retryable: bool = False, hint: str | None = None, errno: int | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retryable = retryable
        self.errno = errno


class MissingDependencyError(CkptError):
    """An optional feature needs a package that is not installed; the hint says which extra to install."""
