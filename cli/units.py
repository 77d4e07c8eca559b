"""Sizes and times as people read them: one spelling for the command line (cli/render.py) and the web
view's pages (cli/web/), which import nothing else of the CLI's output (no console, no terminal)."""

from __future__ import annotations

import time


def human_bytes(n: float | None) -> str:
    """``n`` bytes in binary units, one decimal past bytes; ``-`` for None (not known).

    >>> human_bytes(512), human_bytes(1536), human_bytes(None)
    ('512 B', '1.5 KiB', '-')
    """
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def when(ts: float | None) -> str:
    """A time (seconds since the epoch) in local time, to the second; ``-`` for None (not known)."""
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
