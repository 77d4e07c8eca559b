"""The local read-through chunk cache (storage/cache.py): hits, misses, damaged entries, a full cache."""

from __future__ import annotations

import os
import time

from ckpt_store.storage.cache import TRAILER, ChunkBlobCache, clear, usage

A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_hit_and_miss(tmp_path):
    c = ChunkBlobCache(str(tmp_path), "store1", 1 << 20)
    assert c.get(A) is None and c.misses == 1
    c.put(A, (b"head-", memoryview(b"payload")))
    assert c.get(A) == b"head-payload" and c.hits == 1
    # Another store's entries are its own: a delta blob only decodes against its own store's bases.
    assert ChunkBlobCache(str(tmp_path), "store2", 1 << 20).get(A) is None
    u = usage(str(tmp_path))
    assert u.entries == 1 and u.bytes == len(b"head-payload") + TRAILER and list(u.stores) == ["store1"]


def test_damaged_entry_is_dropped_never_served(tmp_path):
    c = ChunkBlobCache(str(tmp_path), "s", 1 << 20)
    c.put(A, (b"x" * 1000,))
    path = tmp_path / "s" / A[:2] / A
    raw = bytearray(path.read_bytes())
    raw[500] ^= 1  # one bit flipped on disk
    path.write_bytes(bytes(raw))
    assert c.get(A) is None and c.dropped == 1 and not path.exists()
    c.put(B, (b"y" * 1000,))
    pb = tmp_path / "s" / B[:2] / B
    pb.write_bytes(pb.read_bytes()[:10])  # truncated (a crash mid-write would leave only a temporary)
    assert c.get(B) is None and not pb.exists()
    (tmp_path / "s" / C[:2]).mkdir(exist_ok=True)
    (tmp_path / "s" / C[:2] / C).write_bytes(b"")  # empty
    assert c.get(C) is None


def test_full_cache_evicts_least_recently_used(tmp_path):
    limit = 10_000
    c = ChunkBlobCache(str(tmp_path), "s", limit)
    ids = [f"{i:064x}" for i in range(6)]
    for i, oid in enumerate(ids):
        c.put(oid, (bytes([i]) * 3000,))
        p = tmp_path / "s" / oid[:2] / oid
        if p.exists():
            os.utime(p, (time.time() - 100 + i, time.time() - 100 + i))  # distinct ages
        if i == 1:
            assert c.get(ids[0]) is not None  # ids[0] used again: newest
            os.utime(tmp_path / "s" / ids[0][:2] / ids[0], (time.time(), time.time()))
    u = usage(str(tmp_path))
    assert u.bytes <= limit
    assert c.get(ids[-1]) == bytes([5]) * 3000  # the newest entry stays
    assert c.get(ids[0]) is not None  # used recently: kept over older ones
    assert c.get(ids[1]) is None  # the least recently used went first


def test_clear(tmp_path):
    c = ChunkBlobCache(str(tmp_path), "s", 1 << 20)
    c.put(A, (b"1",))
    assert clear(str(tmp_path)).entries == 1
    assert usage(str(tmp_path)).entries == 0 and c.get(A) is None


def test_a_cache_filled_by_many_threads_at_once_ends_within_its_limit(tmp_path):
    """16 threads put 20 KiB entries into a 1 MiB cache at once (a pull's transfer threads): entries
    put while another thread evicts are counted, so the cache never ends over its limit."""
    import random
    import threading

    limit = 1 << 20
    cache = ChunkBlobCache(str(tmp_path), "s", limit)
    rng = random.Random(0)
    blobs = [rng.randbytes(20 << 10) for _ in range(16 * 40)]
    start = threading.Barrier(16)

    def fill(k: int) -> None:
        start.wait()
        for i in range(k, len(blobs), 16):
            cache.put(f"{i:064x}", (blobs[i],))

    threads = [threading.Thread(target=fill, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    u = usage(str(tmp_path))
    assert 0 < u.bytes <= limit and u.entries >= limit * 0.5 // (20 << 10)  # full, not emptied
