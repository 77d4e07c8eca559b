"""The local chunk cache of remote stores, as the CLI and users see it: where it is, what it
holds, and clearing it. The cache itself is ``storage/cache.py``; a remote store opened with
``Settings.cache`` on reads through it (:meth:`ckpt.Store.open`).

>>> import tempfile
>>> from ckpt.settings import Settings
>>> s = Settings.from_env(cache_dir=tempfile.mkdtemp())
>>> cache_usage(s).entries
0
"""

from __future__ import annotations

from ckpt.settings import Settings
from ckpt_store.storage.cache import CacheUsage, clear, default_cache_dir, usage

__all__ = ["CacheUsage", "cache_dir", "cache_usage", "clear_cache"]


def cache_dir(settings: Settings | None = None) -> str:
    """The cache directory: ``settings.cache_dir``, else ``$CKPT_CACHE_DIR``, else ``~/.cache/ckpt``."""
    settings = settings or Settings.from_env()
    return settings.cache_dir or default_cache_dir()


def cache_usage(settings: Settings | None = None) -> CacheUsage:
    """Entries and bytes in the cache, in all and per store id."""
    return usage(cache_dir(settings))


def clear_cache(settings: Settings | None = None) -> CacheUsage:
    """Delete every cached chunk; returns what the cache held."""
    return clear(cache_dir(settings))
