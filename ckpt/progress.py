"""Progress reporting (see storage/progress.py, where it lives so that storage/ can report too).

Long API calls take ``progress``: a :class:`Progress` object, None (silent), or True for
:class:`TerminalProgress`, a bar on stderr when it is a terminal.
"""

from __future__ import annotations

from typing import Any

from ckpt_store.storage.progress import NullProgress, Progress, reporting

__all__ = ["NullProgress", "Progress", "TerminalProgress", "as_progress", "reporting"]


class TerminalProgress:
    """A rich progress bar (bytes, speed, time left) on ``console`` (default: stderr);
    silent when that is not a terminal, or when ``enabled`` is False. The description is
    printed as text, never read as markup."""

    def __init__(self, console: Any = None, enabled: bool | None = None) -> None:
        self._console = console
        self._enabled = enabled
        self._bar: Any = None
        self._task: Any = None

    def start(self, description: str, total: int) -> None:
        from rich.console import Console

        console = self._console if self._console is not None else Console(stderr=True)
        if not (console.is_terminal if self._enabled is None else self._enabled):
            return
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(binary_units=True),
                        TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True)
        self._bar.start()
        self._task = self._bar.add_task(description, total=total)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def as_progress(progress: Progress | bool | None) -> Progress | None:
    """``True`` -> a :class:`TerminalProgress`; a Progress or None as given."""
    if progress is True:
        return TerminalProgress()
    return progress or None
