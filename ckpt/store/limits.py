"""What a checkpoint may claim of this machine: checked before anything is allocated or written.

A manifest is data read from a store: a tensor of 2**38 elements that references one
real chunk 65536 times is a valid description of a terabyte, so what it claims must be
bounded, not only each chunk's decoded size.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from ckpt.errors import ResourceLimitError
from ckpt.format.entries import TensorEntry


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(entries: Iterable[TensorEntry], what: str) -> None:
    """Refuse tensors that together claim more than this machine's memory."""
    need = sum(t.nbytes for t in entries)
    have = physical_memory()
    if have is not None and need > have:
        raise ResourceLimitError(f"{what} needs {need:,} bytes of memory; this machine has {have:,}",
                                 hint="load a subset with include=[...] or `ckpt pull` it to disk")


def check_disk(need: int, path: str) -> None:
    """Refuse writing ``need`` bytes at ``path`` (whose directory may not exist yet) when its disk has less free."""
    where = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if need > free:
        raise ResourceLimitError(f"pulling needs {need:,} bytes; {where} has {free:,} free", hint="free space or pull elsewhere")
