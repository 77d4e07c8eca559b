"""Progress reporting (see storage/progress.py, where it lives so that storage/ can report too).

Long API calls take ``progress``: a :class:`Progress` object, None (silent), or True for
:class:`TerminalProgress`, a bar on stderr when it is a terminal.
"""

from __future__ import annotations

import sys
from typing import Any

from ckpt_store.storage.progress import NullProgress, Progress, reporting

__all__ = ["NullProgress", "Progress", "TerminalProgress", "as_progress", "reporting"]


class TerminalProgress:
    """A rich progress bar on stderr (bytes, speed, time left); silent when stderr is not a terminal."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._task: Any = None

    def start(self, description: str, total: int) -> None:
        if not sys.stderr.isatty():
            return
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                        TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
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
