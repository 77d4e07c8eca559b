"""Output helpers for the CLI: sizes, times, JSON, tables and progress bars."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

# Wide when piped, so tables in logs and files do not wrap at 80 columns.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def ratio(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


class RichProgress:
    """ckpt's Progress protocol drawn as a rich bar on stderr; silent when stderr is not a terminal."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = err.is_terminal if enabled is None else enabled
        self._bar: Progress | None = None
        self._task: Any = None

    def start(self, description: str, total: int) -> None:
        if not self.enabled:
            return
        self._bar = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
