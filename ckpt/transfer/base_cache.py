"""The decoded-base cache: delta bases kept decoded by chunk id within a byte budget
(``Settings.base_cache_mb``), one per open store, kept only for a chunk asked for twice."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from ckpt.settings import Settings
from ckpt_store.storage.objects import ObjectStore


class ChunkCache:
    """Decoded, verified chunks by id within a byte budget, least recently used first out.

    A chunk is kept only when a second chunk asks for it: a base wanted by one delta
    (the base of a merge's output, or a snapshot's chunk under the next snapshot's,
    asked again only when a chain is walked from further up) costs no memory; one that
    several deltas need (the base of a family) is decoded at most twice. Keeping chunks
    that are never asked for again is not free: in the GPT run, whose chains asked for
    every chunk twice from the same delta, it made loading 20-25% slower (fresh memory,
    and a larger working set in the caches).
    """

    def __init__(self, budget: int, remember: int = 1 << 16) -> None:
        self.budget = budget
        self.size = 0
        self.hits = 0  # lookups answered (tests read it)
        self._items: OrderedDict[str, tuple[bytes | bytearray | memoryview, tuple[str, ...]]] = OrderedDict()
        self._seen: OrderedDict[str, str] = OrderedDict()  # ids asked for by one chunk (its id), not kept
        self._remember = remember
        self._lock = threading.Lock()

    def get(self, cid: str) -> tuple[bytes | bytearray | memoryview, tuple[str, ...]] | None:
        with self._lock:
            item = self._items.get(cid)
            if item is None:
                return None
            self._items.move_to_end(cid)
            self.hits += 1
            return item

    def __contains__(self, cid: str) -> bool:
        with self._lock:
            return cid in self._items

    def ask(self, cid: str, by: str = "") -> bool:
        """Record that chunk ``by`` wants ``cid`` (not in the cache); True when another chunk
        asked for it before: then the caller decodes it into memory of its own and
        :meth:`put` s it."""
        with self._lock:
            first = self._seen.get(cid)
            if first is not None and first != by:
                del self._seen[cid]
                return True
            self._seen[cid] = by
            if len(self._seen) > self._remember:
                self._seen.popitem(last=False)
            return False

    def put(self, cid: str, item: tuple[bytes | bytearray | memoryview, int]) -> None:
        """Keep ``item`` (its bytes must stay as they are), oldest out past the budget."""
        n = len(item[0])
        with self._lock:
            if cid in self._items or n > self.budget:
                return
            self._items[cid] = item
            self.size += n
            while self.size > self.budget:
                _, (old, _) = self._items.popitem(last=False)
                self.size -= len(old)

    def offer(self, cid: str, item: tuple[bytes | bytearray | memoryview, int], by: str = "") -> None:
        """Keep ``item`` if another chunk asked for ``cid`` before ``by``; otherwise remember the ask."""
        if self.ask(cid, by):
            self.put(cid, item)


_caches: weakref.WeakKeyDictionary[ObjectStore, ChunkCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def base_cache(objects: ObjectStore, settings: Settings) -> ChunkCache | None:
    """The decoded-base cache of this open store (``settings.base_cache_mb``; None when 0)."""
    if settings.base_cache_mb <= 0:
        return None
    with _caches_lock:
        cache = _caches.get(objects)
        if cache is None:
            cache = _caches[objects] = ChunkCache(settings.base_cache_mb << 20)
        return cache
