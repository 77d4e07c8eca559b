"""Errors raised by ckpt. All derive from :class:`CkptError` (defined in storage/). :func:`first_line`: how
one from below (torch, DCP, the OS) is said within one of ours."""

from __future__ import annotations

from ckpt_store.storage.errors import (
    AmbiguousRefError,
    CkptError,
    CorruptObjectError,
    InvalidNameError,
    MissingDependencyError,
    ObjectNotFoundError,
    RecordTooLargeError,
    RefConflictError,
    RefNotFoundError,
    StorageIOError,
    StoreFormatError,
    StoreLocationError,
    StoreNotFoundError,
    UnusableManifestError,
)


def first_line(e: BaseException, default: str = "") -> str:
    """The first line of ``e``'s message, ``default`` where it has none: how an error from below (torch,
    DCP, a file) is said within one of ours, whose own words and hint come first.

    >>> first_line(ValueError("bad header\\n  at byte 8")), first_line(KeyError(), "KeyError")
    ('bad header', 'KeyError')
    """
    return (str(e).strip().splitlines() or [default])[0]


class InvalidSourceError(CkptError):
    """A file or object given to push cannot be read as a checkpoint (truncated, malformed...)."""

    def __init__(self, source: str, detail: str, *, hint: str | None = None) -> None:
        super().__init__(f"{source}: {detail}", hint=hint)
        self.source = source
        self.detail = detail


class UnsafeInputError(InvalidSourceError):
    """A ``.pt``/``.bin`` file that only loads by running pickled code; ckpt never does."""


class DestinationError(CkptError):
    """Pull (or another writer of files: a plot, resume_dir, a local tier) cannot write where asked: the
    destination is in (or holds) a store or the system's folders, something that is not the checkpoint's
    is in the way, or the destination cannot be written."""


class DestinationExistsError(DestinationError):
    """Pull would overwrite something that exists."""


class TensorMismatchError(CkptError):
    """A checkpoint's tensors do not fit the model or state dict they are loaded into."""


class ConfigError(CkptError, ValueError):
    """A setting that does not parse or is out of range: a ``CKPT_*`` environment variable
    (named in the message) or a keyword given to :meth:`ckpt.Settings.from_env`."""


class InvalidMergeError(CkptError):
    """A merge (or remix) that cannot run as asked: unknown method, bad parameter value,
    wrong number of inputs, or inputs whose tensors do not line up. Raised before any
    tensor data is read."""


__all__ = [
    "AmbiguousRefError",
    "CkptError",
    "ConfigError",
    "CorruptObjectError",
    "DestinationError",
    "DestinationExistsError",
    "InvalidMergeError",
    "InvalidNameError",
    "InvalidSourceError",
    "MissingDependencyError",
    "ObjectNotFoundError",
    "ReaderClosedError",
    "RecordTooLargeError",
    "RefConflictError",
    "RefNotFoundError",
    "ResourceLimitError",
    "StorageIOError",
    "StoreFormatError",
    "UnusableManifestError",
    "StoreLocationError",
    "StoreNotFoundError",
    "TensorMismatchError",
    "UnsafeInputError",
]


class ResourceLimitError(CkptError):
    """A checkpoint needs more memory or disk than there is: refused before allocating any of it."""


class ReaderClosedError(CkptError):
    """A read through a :class:`~ckpt.CheckpointReader` (or an operation's pool of reading threads)
    that was closed by another thread while the read was under way: the read did not finish, and what
    it was reading into is incomplete. A later read starts the reader's threads again."""
