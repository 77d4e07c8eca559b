"""Keeping the chunk cache within its limit or a full disk (storage/cache_evict.py): least recently used
first, processes and threads that share it, how often it walks the cache, what the oldest entries a
walk keeps may delete later, how much a full disk takes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ckpt_store.storage.cache import TRAILER, ChunkBlobCache, clear, usage
from ckpt_store.storage.cache_tally import TALLY

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


def test_full_cache_evicts_least_recently_used(tmp_path):
    limit = 10_000
    c = ChunkBlobCache(str(tmp_path), S, limit)
    ids = [f"{i:064x}" for i in range(6)]
    for i, oid in enumerate(ids):
        c.put(oid, (bytes([i]) * 3000,))
        p = tmp_path / S / oid[:2] / oid
        if p.exists():
            os.utime(p, (time.time() - 100 + i, time.time() - 100 + i))  # distinct ages
        if i == 1:
            assert c.get(ids[0]) is not None  # ids[0] used again: newest
            os.utime(tmp_path / S / ids[0][:2] / ids[0], (time.time(), time.time()))
    u = usage(str(tmp_path))
    assert u.bytes <= limit
    assert c.get(ids[-1]) == bytes([5]) * 3000  # the newest entry stays
    assert c.get(ids[0]) is not None  # used recently: kept over older ones
    assert c.get(ids[1]) is None  # the least recently used went first


def test_a_cache_filled_by_many_threads_at_once_ends_within_its_limit(tmp_path):
    """16 threads put 20 KiB entries into a 1 MiB cache at once (a pull's transfer threads): entries
    put while another thread evicts are counted, so the cache never ends over its limit."""
    import random
    import threading

    limit = 1 << 20
    cache = ChunkBlobCache(str(tmp_path), S, limit)
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


# Processes that share a cache count it through its tally (storage/cache_tally.py), or where that
# cannot be used (here a folder in its place) by walking it again as they put.
TALLIES = ["shared", "unusable"]


def _tally(tmp_path, tally):
    if tally == "unusable":
        (tmp_path / TALLY).mkdir()


@pytest.mark.parametrize("tally", TALLIES)
def test_two_processes_filling_one_cache_keep_it_within_its_limit(tmp_path, tally):
    """Two pulls at once through one cache (each process's store has a ChunkBlobCache of its own, as
    these two are), each putting less than the limit: together they stay within it. (Each counted
    the cache once, at its first put, then only its own entries: 150% of the limit, and N
    processes N times it.)"""
    _tally(tmp_path, tally)
    limit = 1_000_000
    a, b = (ChunkBlobCache(str(tmp_path), S, limit) for _ in range(2))
    a.put("a" * 64, (os.urandom(50_000),))
    b.put("b" * 64, (os.urandom(50_000),))  # both have counted the cache: two entries
    for i in range(1, 15):
        a.put(f"a{i:063x}", (os.urandom(50_000),))  # 750 KB from each, 1.5 MB in all
    for i in range(1, 15):
        b.put(f"b{i:063x}", (os.urandom(50_000),))
    assert usage(str(tmp_path)).bytes <= limit


@pytest.mark.parametrize("tally", TALLIES)
def test_processes_sharing_a_nearly_full_cache_count_it_more_often_as_it_fills(tmp_path, tally):
    """8 pulls at once through one cache 88% full (a ChunkBlobCache each, as 8 processes have), putting
    in turn: together they go at most a hundredth of the limit each past it. With the shared tally
    each put knows the cache's size; without it, each counts the cache again after a tenth of the room
    it saw free. (Each counted again only after putting a tenth of the limit: 159%, nothing evicted.)"""
    _tally(tmp_path, tally)
    limit, blob = 2_000_000, 20_000
    fill = ChunkBlobCache(str(tmp_path), S, limit)
    for i in range(int(limit * 0.88) // (blob + TRAILER)):
        fill.put(f"f{i:063x}", (os.urandom(blob),))
    caches = [ChunkBlobCache(str(tmp_path), S, limit) for _ in range(8)]
    peak = 0
    for r in range(40):  # 6.4 MB in all, more than three times the limit
        for k, c in enumerate(caches):
            c.put(f"{k:02x}{r:062x}", (os.urandom(blob),))
            peak = max(peak, usage(str(tmp_path)).bytes)
    assert limit * 0.9 < peak <= limit * (1 + len(caches) / 100)
    assert (fill._eviction.tally.add(0) is None) == (tally == "unusable")


def test_threads_putting_into_a_cache_not_yet_counted_count_it_once_and_nothing_put_meanwhile_is_lost(tmp_path):
    """16 threads' first puts into a cache not yet counted (a pull's transfer threads): one thread
    counts the cache root, the others' bytes go on top of its count. (Each walked the whole root, 16
    walks, and each set the size to what its walk found, losing bytes put meanwhile.)"""
    import threading

    c = ChunkBlobCache(str(tmp_path), S, 1 << 30)
    real, walks, gate = c._eviction._entries, [], threading.Event()

    def walk():
        found = real()
        walks.append(len(found))
        gate.wait(timeout=5)  # the others put meanwhile (or walk too)
        return found

    c._eviction._entries = walk
    start = threading.Barrier(16)

    def put(k: int) -> None:
        start.wait()
        c.put(f"{k:064x}", (os.urandom(1000 + k),))

    threads = [threading.Thread(target=put, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 3
    while sum(t.is_alive() for t in threads) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join()
    assert len(walks) == 1
    assert c._eviction.size >= usage(str(tmp_path)).bytes  # (some counted twice: found by the walk, and put meanwhile)


def test_a_full_disk_makes_room_least_recently_used_first_and_a_read_meanwhile_gets_its_bytes(tmp_path, tmpfs, caplog):
    """The cache on a 1 MiB tmpfs, its limit far above that: a put that finds the disk full deletes the
    least recently used entries and writes again, so every entry put is there, the newest kept. Another
    process that opened the oldest entry before it went reads it whole and sound (an open file keeps
    its bytes). (Once the disk was full, every put failed with a warning: the cache stopped caching,
    holding entries it could drop.)"""
    import logging
    import subprocess
    import sys

    root = tmpfs(tmp_path / "cache", "1m")
    c = ChunkBlobCache(root, S, 1 << 30)
    blobs = [os.urandom(60_000) for _ in range(40)]  # 2.4 MB in all
    ids = [f"{i:064x}" for i in range(len(blobs))]
    for oid, blob in zip(ids[:8], blobs[:8]):
        c.put(oid, (blob,))
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys, blake3\n"
         f"f = open({os.path.join(root, S, ids[0][:2], ids[0])!r}, 'rb')\nprint('open', flush=True)\nsys.stdin.readline()\n"
         "raw = f.read()\nprint(raw[:-32].hex() if blake3.blake3(raw[:-32]).digest() == raw[-32:] else 'damaged', flush=True)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "open\n"
        with caplog.at_level(logging.DEBUG, logger="ckpt_store.storage.cache"):
            missed = []
            for oid, blob in zip(ids[8:], blobs[8:]):
                c.put(oid, (blob,))
                if c.get(oid) != blob:
                    missed.append(oid)
        assert missed == []  # each written, the disk full or not
        assert not (tmp_path / "cache" / S / ids[0][:2] / ids[0]).exists()  # the oldest went
        out, _ = reader.communicate("read\n", timeout=30)
    finally:
        reader.kill()
        reader.wait()
    assert out.strip() == blobs[0].hex()
    assert not [r for r in caplog.records if "cannot cache" in r.getMessage()]
    kept = [oid for oid in ids if c.get(oid) is not None]
    assert kept == ids[-len(kept):] and len(kept) >= 10  # the newest, most of the disk's room


def test_a_process_putting_into_a_nearly_full_cache_walks_it_once_not_every_hundredth_of_the_limit(tmp_path):
    """Another process filled the cache to 95%; this one puts a tenth of the limit: it walks the cache
    at its first put only (its eviction takes the oldest entries that walk found), its puts and the
    other's counted by the shared tally. (It
    walked the cache again every hundredth of the limit it put, ten walks more: 0.3-0.4 s each at
    50,000 entries, about as long as a pull takes to fetch that hundredth.)"""
    limit, blob = 2_000_000, 2_000
    fill = ChunkBlobCache(str(tmp_path), S, limit)
    for i in range(int(limit * 0.95) // (blob + TRAILER)):
        fill.put(f"f{i:063x}", (os.urandom(blob),))
    c = ChunkBlobCache(str(tmp_path), S, limit)
    real, walks = c._eviction._entries, []
    c._eviction._entries = lambda: walks.append(1) or real()
    for i in range(limit // 10 // blob):
        c.put(f"c{i:063x}", (os.urandom(blob),))
    u = usage(str(tmp_path))
    assert len(walks) == 1 and u.bytes <= limit
    assert c._eviction.tally.add(0) == u.bytes  # (nobody killed meanwhile: the tally is exact)


def test_processes_putting_at_once_keep_the_cache_within_its_limit_and_a_clear_resets_the_tally(tmp_path):
    """Four processes fill one cache at once, each with more than its limit: it ends within it, and
    the tally they share holds what is there; `clear` takes what it deleted off the tally."""
    import subprocess
    import sys

    limit = 1_000_000
    put = (f"import os\nfrom ckpt_store.storage.cache import ChunkBlobCache\n"
           f"c = ChunkBlobCache({str(tmp_path)!r}, {S!r}, {limit})\n"
           f"for i in range(60):\n    c.put(f'{{os.getpid():08x}}{{i:056x}}', (os.urandom(20_000),))\n")
    procs = [subprocess.Popen([sys.executable, "-c", put]) for _ in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    u = usage(str(tmp_path))
    tally = ChunkBlobCache(str(tmp_path), S, limit)._eviction.tally
    counted = tally.add(0)
    # (one process evicts at a time, down to 90% less an entry; an entry put during a walk counts twice)
    assert limit * 0.8 < u.bytes <= limit and counted >= u.bytes, (u.bytes, counted)
    # (clear sets the tally from its walk: nothing left, nothing put meanwhile: 0, an entry counted twice or not)
    assert clear(str(tmp_path)).bytes == u.bytes and tally.add(0) == 0


def test_threads_that_find_a_full_disk_at_once_all_cache_their_entries(tmp_path, tmpfs, caplog):
    """16 threads (a pull's transfer threads) put 60 KB entries into a cache on a full 1 MiB tmpfs at once:
    each that finds the disk full makes room and writes again until it fits, so none is left uncached.
    (One write after one eviction round: a thread whose room another thread's write took meanwhile gave
    up with a warning, and its chunk, fetched, was not kept.)"""
    import logging
    import threading

    root = tmpfs(tmp_path / "cache", "1m")
    c = ChunkBlobCache(root, S, 1 << 30)
    for i in range(20):  # the disk full with older entries
        c.put(f"{i:064x}", (os.urandom(60_000),))
    blobs = {f"{1000 + k * 100 + j:064x}": os.urandom(60_000) for k in range(16) for j in range(6)}
    start = threading.Barrier(16)

    def put(k: int) -> None:
        start.wait()
        for j in range(6):
            oid = f"{1000 + k * 100 + j:064x}"
            c.put(oid, (blobs[oid],))

    with caplog.at_level(logging.DEBUG, logger="ckpt_store.storage.cache"):
        threads = [threading.Thread(target=put, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not [r.getMessage() for r in caplog.records if "cannot cache" in r.getMessage()]
    kept = [oid for oid in blobs if c.get(oid) is not None]
    assert kept and all(c.get(oid) == blobs[oid] for oid in kept)


def test_a_disk_full_of_what_the_cache_cannot_delete_fails_a_put_after_one_eviction_that_freed_nothing(tmp_path, tmpfs, caplog):
    """A 1 MiB tmpfs filled by another program's file, and one cache entry: a put that finds the disk full
    evicts that entry, writes again, finds it still full, evicts nothing more, and gives up with a warning
    (it does not write again while nothing is freed); the other program's file is untouched."""
    import logging

    root = tmpfs(tmp_path / "cache", "1m")
    c = ChunkBlobCache(root, S, 1 << 30)
    c.put("ab" * 32, (os.urandom(60_000),))
    other = os.path.join(root, "theirs.bin")
    with open(other, "wb", buffering=0) as f:  # the rest of the disk
        try:
            while True:
                f.write(os.urandom(4096))
        except OSError:
            pass
    before = os.path.getsize(other)
    writes = []
    write = c._write_retrying
    c._write_retrying = lambda *a: writes.append(1) or write(*a)
    with caplog.at_level(logging.DEBUG, logger="ckpt_store.storage.cache"):
        c.put("cd" * 32, (os.urandom(300_000),))
    assert [r.levelno for r in caplog.records if "cannot cache" in r.getMessage()] == [logging.WARNING]
    assert len(writes) == 2  # the first; one after the eviction that freed the old entry; none after one that freed nothing
    assert c.get("ab" * 32) is None and c.get("cd" * 32) is None
    assert os.path.getsize(other) == before
