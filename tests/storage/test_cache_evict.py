"""Keeping the chunk cache within its limit (storage/cache_evict.py): how often it walks the cache, and
what the oldest entries a walk keeps may delete later."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ckpt_store.storage.cache import TRAILER, ChunkBlobCache, usage

S = "5" * 32


def _counting_walks(c: ChunkBlobCache) -> list[int]:
    real, walks = c._eviction._entries, []
    c._eviction._entries = lambda: walks.append(1) or real()
    return walks


def test_a_pull_into_a_full_cache_walks_it_once_a_quarter_of_the_limit_not_at_each_eviction(tmp_path):
    """Another process filled the cache to 95%; this one puts 40% of the limit (four evictions): it walks
    the cache at its first put and once more after a quarter of the limit (the count that corrects the
    tally), and evicts from the oldest entries those walks found, least recently used first. (Each
    eviction walked the whole cache: 0.3-0.4 s at 50,000 entries, 5 walks here.)"""
    root, limit, small, blob = str(tmp_path), 2_000_000, 2_000, 8_000
    fill = ChunkBlobCache(root, S, limit)
    old = time.time() - 10_000
    first = [f"f{i:063x}" for i in range(int(limit * 0.95) // (small + TRAILER))]
    for i, oid in enumerate(first):
        fill.put(oid, (os.urandom(small),))
        os.utime(os.path.join(root, S, oid[:2], oid), (old + i, old + i))  # distinct ages, oldest first
    c = ChunkBlobCache(root, S, limit)
    walks = _counting_walks(c)
    mine = [f"c{i:063x}" for i in range(int(limit * 0.4) // blob)]
    for oid in mine:
        c.put(oid, (os.urandom(blob),))
    u = usage(root)
    assert len(walks) == 2 and 0.85 * limit < u.bytes <= limit
    kept = [c.has(oid) for oid in first]
    assert kept == sorted(kept) and all(c.has(oid) for oid in mine)  # the oldest went, none younger first
    assert c._eviction.tally.add(0) == u.bytes


def test_entries_the_last_walk_listed_are_looked_at_again_before_they_are_deleted(tmp_path):
    """The oldest entries a walk found, deleted by a later eviction without a walk: one read since (a hit
    touches it) or replaced by another process stays, one deleted by hand meanwhile is passed over, and
    one another process holds open goes while that process still reads it whole; the oldest untouched
    ones go, no younger one."""
    root, limit, blob = str(tmp_path), 220_000, 10_000
    other = ChunkBlobCache(root, S, limit)
    ids = [f"e{i:063x}" for i in range(20)]
    old = time.time() - 10_000
    for i, oid in enumerate(ids):
        other.put(oid, (bytes([i]) * blob,))
        os.utime(os.path.join(root, S, oid[:2], oid), (old + i, old + i))
    c = ChunkBlobCache(root, S, limit)
    walks = _counting_walks(c)
    c.put("a" * 64, (os.urandom(blob),))  # its first put walks the cache: 21 entries, within the limit
    assert c.get(ids[0]) == bytes([0]) * blob  # used: the newest now
    os.unlink(os.path.join(root, S, ids[1][:2], ids[1]))  # deleted by hand
    other.put(ids[2], (b"decoded!" * 1250,), replace=True)  # by the other process
    path3 = os.path.join(root, S, ids[3][:2], ids[3])
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys, blake3\n"
         f"f = open({path3!r}, 'rb')\nprint('open', flush=True)\nsys.stdin.readline()\n"
         "raw = f.read()\nprint(raw[:-32].hex() if blake3.blake3(raw[:-32]).digest() == raw[-32:] else 'damaged', flush=True)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "open\n"
        c.put("b" * 64, (os.urandom(blob),))  # past the limit: evicts
        out, _ = reader.communicate("read\n", timeout=30)
    finally:
        reader.kill()
        reader.wait()
    assert len(walks) == 1  # (the eviction took the entries the first walk listed)
    assert out.strip() == (bytes([3]) * blob).hex()
    assert [i for i, oid in enumerate(ids) if c.has(oid)] == [0, 2] + list(range(6, 20))
    assert c.get(ids[2]) == b"decoded!" * 1250 and c.has("a" * 64) and c.has("b" * 64)
    assert usage(root).bytes <= limit


def _brim(c: ChunkBlobCache, root: str, blob: int) -> int:
    """Fill the disk holding ``root`` with entries of ``blob`` bytes to the brim; the bytes the cache holds."""
    for i in range(100_000):
        st = os.statvfs(root)
        if st.f_bavail * st.f_frsize < blob + TRAILER + 8192:
            break
        c.put(f"e{i:063x}", (os.urandom(blob),))
    return usage(root).bytes


def test_a_put_that_finds_the_disk_full_frees_its_room_and_a_hundredth_not_a_tenth(tmp_path, tmpfs):
    """A cache on a 4 MiB tmpfs filled to the brim (its limit far above): a put of 64 KB that finds the
    disk full frees its room plus a hundredth of what the cache holds (at least the room again), the
    least recently used first, and lands. (It took a tenth of the cache, and the room: 345 KB for
    64 KB from 2.8 MB.)"""
    root = tmpfs(tmp_path / "cache", "4m")
    blob, big = 8192, 64 << 10
    c = ChunkBlobCache(root, S, 1 << 40)
    held = _brim(c, root, blob)
    c.put("b" * 64, (os.urandom(big),))
    n = big + TRAILER
    evicted = held + n - usage(root).bytes
    assert c.has("b" * 64)
    assert n <= evicted <= n + max(held // 100, n) + blob + TRAILER, (held, evicted)
    assert not c.has(f"e{0:063x}") and c.has(f"e{held // (blob + TRAILER) - 1:063x}")  # the oldest went, the newest stayed
