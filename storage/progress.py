"""Progress reporting through a callback object, independent of any UI (cli/ renders it)."""

from __future__ import annotations

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
