"""The chunk cache's files on disk (see storage/cache.py): where the cache is, which files its layout
names (its store dirs, fan-out dirs, entries and temporaries, never another program's files), what
they hold, and clearing them.

>>> import tempfile
>>> usage(tempfile.mkdtemp()).entries
0
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ckpt_store.storage.backends.base import TEMPORARY
from ckpt_store.storage.cache_tally import TALLY, CacheTally

# Names of what this cache writes: store dirs, their fan-out dirs, entries, temporaries.
_STORE_DIR = re.compile(r"[0-9a-f]{32}")
_FAN_OUT = re.compile(r"[0-9a-f]{2}")
_ENTRY = re.compile(r"[0-9a-f]{64}")
_TEMP = re.compile(re.escape(TEMPORARY) + r"[0-9a-f]{32}")


def store_dir_name(store_id: str) -> str:
    """The directory below the cache root of a store's entries: its id where that is 32 hex digits
    (what :func:`storage.config.init_config` writes), else a hash of it, so that no id a remote
    store's config holds (``../x``, ``/home``) names a path outside the cache.

    >>> store_dir_name("0123456789abcdef" * 2) == "0123456789abcdef" * 2
    True
    >>> len(store_dir_name("../../home")), "/" in store_dir_name("../../home")
    (32, False)
    """
    if _STORE_DIR.fullmatch(store_id):
        return store_id
    return hashlib.blake2b(store_id.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def own_files(root: str) -> Iterator[tuple[str, str, os.stat_result, bool]]:
    """(store dir, path, stat, whether a temporary) of each regular file below ``root`` that this
    cache's layout names: ``<store dir>/<xx>/<64 hex digits starting xx>`` or its temporaries
    there. Links are not followed; anything else (other programs' files) is not listed."""

    def dirs(path: str, pattern: re.Pattern[str]) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(path) as it:
                return [e for e in it if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        except OSError:
            return []

    for sdir in dirs(root, _STORE_DIR):
        for fan in dirs(sdir.path, _FAN_OUT):
            try:
                with os.scandir(fan.path) as it:
                    found = list(it)
            except OSError:
                continue
            for e in found:
                temp = _TEMP.fullmatch(e.name) is not None
                if not temp and not (_ENTRY.fullmatch(e.name) and e.name.startswith(fan.name)):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield sdir.name, e.path, st, temp


class Entry(NamedTuple):
    """An entry as a walk of the cache found it (sorting puts the least recently used first)."""

    mtime_ns: int  # its modification time: refreshed by every hit
    size: int
    path: str
    ino: int  # (a replacing put renames a new file into its place)


def entries_sweeping(root: str) -> list[Entry]:
    """Every entry in the cache at ``root``; temporaries older than an hour (left by a process killed
    while it wrote them) are deleted."""
    files = []
    now = time.time()
    for _, p, st, temp in own_files(root):
        if not temp:
            files.append(Entry(st.st_mtime_ns, st.st_size, p, st.st_ino))
        elif now - st.st_mtime > 3600:
            remove(p)
    return files


def in_own_folders(path: str) -> bool:
    """Whether the fan-out dir holding the entry at ``path``, and the store dir holding that, are
    directories, not links: through a link (a hostile or mistaken cache folder) the cache would delete
    and write another's files."""
    for d in (os.path.dirname(os.path.dirname(path)), os.path.dirname(path)):
        try:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                return False
        except OSError:
            return False
    return True


def default_cache_dir() -> str:
    """``$CKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpt`` (``~/.cache/ckpt``)."""
    env = os.environ.get("CKPT_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckpt")


@dataclass(frozen=True)
class CacheUsage:
    """What a cache directory holds: entries and bytes on disk, per store id and in all."""

    root: str
    entries: int
    bytes: int
    stores: dict[str, tuple[int, int]]  # store id -> (entries, bytes)


def remove(path: str) -> bool:
    """Delete the file at ``path``; whether it was deleted (another process may have been first)."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def usage(root: str) -> CacheUsage:
    """Entries and bytes in the cache at ``root`` (nothing if it does not exist): its own files only."""
    return _tally(root, list(own_files(root)))


def _tally(root: str, files: list[tuple[str, str, os.stat_result, bool]]) -> CacheUsage:
    stores: dict[str, tuple[int, int]] = {}
    for sid, _, st, temp in files:
        if not temp:
            n, b = stores.get(sid, (0, 0))
            stores[sid] = (n + 1, b + st.st_size)
    stores = dict(sorted(stores.items()))
    return CacheUsage(root, sum(n for n, _ in stores.values()), sum(b for _, b in stores.values()), stores)


def clear(root: str) -> CacheUsage:
    """Delete every entry (and temporary) of the cache at ``root``, and its directories left
    empty; returns what it held. Other files there, and the directories holding them, stay."""
    tally = CacheTally(root) if os.path.isfile(os.path.join(root, TALLY)) else None
    start = tally.before_walk() if tally is not None else None
    files = list(own_files(root))
    before = _tally(root, files)
    emptied: set[str] = set()
    kept = before.bytes  # (what another process deleted first stays counted until its walk)
    for _, p, st, temp in files:
        if remove(p) and not temp:
            kept -= st.st_size
        emptied.add(os.path.dirname(p))
    for d in sorted(emptied | {os.path.dirname(d) for d in emptied}, key=len, reverse=True):
        try:
            os.rmdir(d)  # only if empty
        except OSError:
            pass
    if tally is not None and start is not None:
        tally.walked(kept, start)  # (what other processes put meanwhile stays counted)
    return before


