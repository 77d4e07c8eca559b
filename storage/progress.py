"""Progress reporting through a callback object, independent of any UI (cli/ renders it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Progress(Protocol):
    """Receives progress of one long operation, in bytes."""

    def start(self, description: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...

    def finish(self) -> None: ...


class NullProgress:
    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def finish(self) -> None:
        pass


@contextmanager
def reporting(progress: Progress | None, description: str, total: int) -> Iterator[Progress]:
    """``progress`` (or a :class:`NullProgress`) started for ``total`` bytes, and finished
    when the block ends, on error too: a progress bar never stays open."""
    p = progress if progress is not None else NullProgress()
    p.start(description, total)
    try:
        yield p
    finally:
        p.finish()
