"""The local read-through chunk cache (storage/cache.py): hits, misses, damaged entries, a full cache."""

from __future__ import annotations

import os
import time

import pytest

from ckpt_store.storage.backends.base import TEMPORARY
from ckpt_store.storage.cache import TRAILER, ChunkBlobCache, clear, usage
from ckpt_store.storage.cache_tally import TALLY

A, B, C = "a" * 64, "b" * 64, "c" * 64
# store ids as a store's config holds them (32 hex digits): the name of their directory in the cache
S, S1, S2 = "5" * 32, "1" * 32, "2" * 32


def test_hit_and_miss(tmp_path):
    c = ChunkBlobCache(str(tmp_path), S1, 1 << 20)
    assert c.get(A) is None and c.misses == 1
    c.put(A, (b"head-", memoryview(b"payload")))
    assert c.get(A) == b"head-payload" and c.hits == 1
    # Another store's entries are its own: a delta blob only decodes against its own store's bases.
    assert ChunkBlobCache(str(tmp_path), S2, 1 << 20).get(A) is None
    u = usage(str(tmp_path))
    assert u.entries == 1 and u.bytes == len(b"head-payload") + TRAILER and list(u.stores) == [S1]


def test_damaged_entry_is_dropped_never_served(tmp_path):
    c = ChunkBlobCache(str(tmp_path), S, 1 << 20)
    c.put(A, (b"x" * 1000,))
    path = tmp_path / S / A[:2] / A
    raw = bytearray(path.read_bytes())
    raw[500] ^= 1  # one bit flipped on disk
    path.write_bytes(bytes(raw))
    assert c.get(A) is None and c.dropped == 1 and not path.exists()
    c.put(B, (b"y" * 1000,))
    pb = tmp_path / S / B[:2] / B
    pb.write_bytes(pb.read_bytes()[:10])  # truncated (a crash mid-write would leave only a temporary)
    assert c.get(B) is None and not pb.exists()
    (tmp_path / S / C[:2]).mkdir(exist_ok=True)
    (tmp_path / S / C[:2] / C).write_bytes(b"")  # empty
    assert c.get(C) is None


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


def test_clear(tmp_path):
    c = ChunkBlobCache(str(tmp_path), S, 1 << 20)
    c.put(A, (b"1",))
    assert clear(str(tmp_path)).entries == 1
    assert usage(str(tmp_path)).entries == 0 and c.get(A) is None


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


def test_entries_that_this_cache_did_not_write_are_dropped_never_followed(tmp_path):
    """A link, a FIFO (whose open would block) or an entry larger than any chunk blob in the
    cache's place: neither read nor followed, and dropped, by both readers."""
    import threading

    c = ChunkBlobCache(str(tmp_path / "cache"), S, 1 << 20, max_entry=4096)
    c.put(A, (b"a" * 100,))
    d = tmp_path / "cache" / S
    elsewhere = tmp_path / "precious.bin"
    elsewhere.write_bytes((d / A[:2] / A).read_bytes())  # a well-formed entry, outside the cache
    for oid in (B, C):
        (d / oid[:2]).mkdir(exist_ok=True)
    (d / B[:2] / B).symlink_to(elsewhere)
    os.mkfifo(d / C[:2] / C)
    big = "d" * 64
    c.put(big, (b"z" * 5000,))  # past max_entry: written by an older setting, say

    def place(head, size):
        return memoryview(bytearray(size - len(head)))

    for read in (lambda oid: c.get(oid), lambda oid: c.read_split(oid, 16, place)):
        got = []
        t = threading.Thread(target=lambda: got.extend([read(B), read(C), read(big)]), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "a read blocked on the FIFO"
        assert got == [None, None, None]
        assert not (d / B[:2] / B).is_symlink() and not (d / C[:2] / C).exists() and not (d / big[:2] / big).exists()
        assert elsewhere.read_bytes()[:100] == b"a" * 100  # the link's target is untouched
        (d / B[:2] / B).symlink_to(elsewhere)
        os.mkfifo(d / C[:2] / C)
        c.put(big, (b"z" * 5000,))
    assert c.get(A) == b"a" * 100  # a real entry still serves


def _precious(root):
    """Files another program keeps in a directory the cache is pointed at, older than any entry:
    at its root, in a folder, in a folder named like a store's, and beside entries."""
    old = time.time() - 86400
    files = {root / "notes.txt": b"notes", root / "project" / "data" / "train.bin": os.urandom(300_000),
             root / ("e" * 32) / "keep.txt": b"looks like a store dir", root / S / "ab" / "not-an-entry": b"x" * 5000,
             root / S / "ab" / ("b" * 64): b"an entry name in the wrong fan-out dir"}
    for p, data in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, (old, old))
    return files


def test_eviction_usage_and_clear_touch_only_what_the_cache_wrote(tmp_path):
    """CKPT_CACHE_DIR pointed at a folder that holds other files (~/.cache, a scratch dir): eviction,
    `ckpt cache` and `ckpt cache clear` see only the cache's own entries; every other file stays."""
    files = _precious(tmp_path)
    c = ChunkBlobCache(str(tmp_path), S, 20_000)
    for i in range(12):
        c.put(f"{i:064x}", (bytes([i]) * 3000,))  # 36 KB into a 20 KB cache: evicts
    u = usage(str(tmp_path))
    assert 0 < u.bytes <= 20_000 and list(u.stores) == [S]
    assert u.entries == sum(1 for i in range(12) if c.has(f"{i:064x}"))
    assert all(p.read_bytes() == data for p, data in files.items())
    assert clear(str(tmp_path)).entries == u.entries and usage(str(tmp_path)).entries == 0
    assert all(p.read_bytes() == data for p, data in files.items())
    assert not (tmp_path / S / "00").exists()  # its own folders, emptied, go


def test_a_store_id_is_never_a_path(tmp_path):
    """A remote store's config is outside data: an id like ``../x`` or ``/abs`` names a folder
    inside the cache, never one outside it."""
    root = tmp_path / "cache"
    for sid in ("../outside", str(tmp_path / "abs"), "..", "a/b"):
        c = ChunkBlobCache(str(root), sid, 1 << 20)
        c.put(A, (b"blob",))
        assert c.get(A) == b"blob"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert usage(str(root)).entries == 4


def test_a_cache_that_cannot_take_entries_says_so_once(tmp_path, caplog):
    """A cache folder that refuses writes (read-only, full, not a folder) fails every put, and a
    load puts every chunk it fetches: one warning, not one per chunk."""
    import logging

    (tmp_path / "not-a-folder").write_text("a file where the cache's folder should be")
    c = ChunkBlobCache(str(tmp_path / "not-a-folder"), S1, 1 << 20)
    with caplog.at_level(logging.DEBUG, logger="ckpt_store.storage.cache"):
        for oid in (A, B, C):
            c.put(oid, (b"blob",))
    assert c.get(A) is None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "cannot cache chunk" in warned[0].getMessage()
    assert sum("cannot cache chunk" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.parametrize("linked", ["store dir", "fan-out dir"])
def test_a_folder_of_the_cache_that_is_a_link_leads_nowhere_outside_it(tmp_path, linked):
    """A cache folder whose store dir (or fan-out dir) is a link to a folder elsewhere, holding files
    named like entries (another store's chunks, say): a read found such a file "damaged" (no
    trailer) and deleted it, and a put wrote entries there (and removed an empty folder named like an
    entry). Now neither deletes nor writes through a link; the reads are misses and the files and
    folders stay as they were."""
    root, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    precious = {A: os.urandom(3000), B: b"not a cache entry at all"}
    for oid, data in precious.items():
        target = elsewhere / (oid[:2] if linked == "store dir" else "") / oid
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    D = "d" * 64
    hollow = elsewhere / (D[:2] if linked == "store dir" else "") / D
    hollow.mkdir(parents=True)
    (root / S).parent.mkdir(parents=True)
    if linked == "store dir":
        (root / S).symlink_to(elsewhere)
    else:
        (root / S).mkdir()
        for oid in (*precious, D):
            (root / S / oid[:2]).symlink_to(elsewhere)
    c = ChunkBlobCache(str(root), S, 1 << 20)

    def place(head, size):
        return memoryview(bytearray(size - len(head)))

    assert c.get(A) is None and c.read_split(B, 8, place) is None
    c.drop(A)
    c.put(C, (b"c" * 100,))
    c.put(B, (b"b" * 100,), replace=True)
    c.put(D, (b"d" * 100,))
    assert hollow.is_dir()
    files = {str(p.relative_to(elsewhere)): p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    assert files == {str(p.relative_to(elsewhere)): d for p, d in
                     ((elsewhere / (o[:2] if linked == "store dir" else "") / o, d) for o, d in precious.items())}
    assert c.get(C) == (None if linked == "store dir" else b"c" * 100)  # its own fan-out dir holds C
    assert clear(str(root)).entries == (linked == "fan-out dir") and all(p.exists() for p in elsewhere.rglob("*"))


def test_an_entry_larger_than_the_limit_is_not_cached_and_evicts_nothing(tmp_path):
    """A chunk blob larger than the whole cache (``cache_mb`` below the chunk size): not written. (It was
    written, then eviction deleted it, and every other entry with it, at every such put.)"""
    c = ChunkBlobCache(str(tmp_path), S, 100_000)
    small = [f"{i:064x}" for i in range(4)]
    for oid in small:
        c.put(oid, (bytes(10_000),))
    c.put(A, (b"x" * 60_000, b"y" * 60_000))
    c.put(B, (bytes(100_000 - TRAILER),), replace=True)  # exactly the limit: over the 90% eviction keeps
    assert not c.has(A) and not c.has(B) and all(c.get(oid) == bytes(10_000) for oid in small)
    assert usage(str(tmp_path)).entries == 4 and not any(p.name.startswith(TEMPORARY) for p in tmp_path.rglob("*"))
    c.put(C, (bytes(80_000),))  # fits: older entries make room
    assert c.get(C) == bytes(80_000) and usage(str(tmp_path)).bytes <= 100_000


def test_a_clear_in_another_process_meanwhile_costs_no_entry_and_no_warning(tmp_path, monkeypatch, caplog):
    """`ckpt cache clear` (another process) removes the folders it empties while a pull reads and puts
    entries (tests/ckpt/transfer/test_s3_transfer.py runs them as processes): a folder gone between
    making it and writing there is made again, and an entry gone when opened is a miss, not damage,
    whatever another process put there by the time it is looked at. (The put failed with a warning,
    and the read deleted the sound entry just put as 'damaged'.)"""
    import logging

    root = tmp_path / "cache"
    c = ChunkBlobCache(str(root), S, 1 << 20)
    c.put("a" * 63 + "0", (b"old",))  # in A's folder: the clear deletes it and removes the folders
    real_check = ChunkBlobCache._in_own_dirs
    cleared = []

    def clear_first(self, path):  # the other process's clear, after this one made the folders
        if not cleared:
            cleared.append(clear(str(root)))
        return real_check(self, path)

    monkeypatch.setattr(ChunkBlobCache, "_in_own_dirs", clear_first)
    with caplog.at_level(logging.DEBUG, logger="ckpt_store.storage.cache"):
        c.put(A, (b"a" * 100,))
        assert cleared[0].entries == 1 and c.get(A) == b"a" * 100
        monkeypatch.setattr(ChunkBlobCache, "_in_own_dirs", real_check)

        real_open = ChunkBlobCache._open

        def put_meanwhile(self, path):  # B is not there when opened; another process puts it then
            try:
                return real_open(self, path)
            except FileNotFoundError:
                ChunkBlobCache(str(root), S, 1 << 20).put(B, (b"b" * 100,))
                raise

        monkeypatch.setattr(ChunkBlobCache, "_open", put_meanwhile)
        assert c.get(B) is None and c.misses == 1 and c.dropped == 0
        monkeypatch.setattr(ChunkBlobCache, "_open", real_open)
    assert c.get(B) == b"b" * 100  # the other process's entry stays
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


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


def test_what_a_killed_writer_left_goes_once_an_hour_old_though_the_cache_is_never_full(tmp_path):
    """A process SIGKILLed while it writes an entry leaves its temporary: not an entry, not counted,
    and swept by eviction only, so in a cache that never fills (20 GiB by default) they stayed for
    good. The count a put makes sweeps those an hour old and leaves a younger one (another process
    may be writing it); the killed writer's finished entries serve."""
    import signal
    import subprocess
    import sys

    # The writer puts three entries, then stops inside the fourth's write (its temporary made) and
    # says so: killed there, not wherever a timer happens to find it.
    writer = (f"import time, types\nfrom ckpt_store.storage import cache\n"
              f"c = cache.ChunkBlobCache({str(tmp_path)!r}, {S!r}, 1 << 34)\n"
              f"for i in range(3):\n    c.put(f'{{i:064x}}', (bytes([i]) * 5000,))\n"
              f"def stalled():\n    def update(part):\n        print('writing', flush=True)\n        time.sleep(60)\n"
              f"    return types.SimpleNamespace(update=update)\n"
              f"cache.blake3 = types.SimpleNamespace(blake3=stalled)\nc.put('9' * 64, (b'x' * 5000,))\n")
    p = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "writing\n"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    temps = list(tmp_path.rglob(".tmp-*"))
    assert len(temps) == 1 and usage(str(tmp_path)).bytes == 3 * (5000 + TRAILER)
    fresh = temps[0].parent / f".tmp-{'2' * 32}"
    fresh.write_bytes(b"being written")
    old = time.time() - 7200
    os.utime(temps[0], (old, old))
    c = ChunkBlobCache(str(tmp_path), S, 1 << 40)
    c.put(B, (b"b" * 100,))  # this process's first put counts the cache
    assert not temps[0].exists() and fresh.exists()
    assert [c.get(f"{i:064x}") for i in range(3)] == [bytes([i]) * 5000 for i in range(3)]


def test_a_folder_or_a_link_in_an_entrys_place_does_not_keep_the_chunk_out(tmp_path, caplog):
    """An empty folder where an entry belongs (or a link, to a file elsewhere or to nothing): a put
    writes the entry in its place (the link's target untouched); a folder that holds files is not
    the cache's to delete, and stays. (Any of them kept the chunk out of the cache for good: the put
    saw something there and returned.)"""
    import logging

    root = tmp_path / "cache"
    c = ChunkBlobCache(str(root), S, 1 << 20)
    elsewhere = tmp_path / "precious.txt"
    elsewhere.write_bytes(b"precious")
    d = root / S
    for oid in (A, B, C, "d" * 64):
        (d / oid[:2]).mkdir(parents=True, exist_ok=True)
    (d / A[:2] / A).mkdir()
    (d / B[:2] / B).symlink_to(elsewhere)
    (d / C[:2] / C).symlink_to(tmp_path / "nothing")
    (d / "dd" / ("d" * 64)).mkdir()
    (d / "dd" / ("d" * 64) / "theirs.txt").write_bytes(b"theirs")
    with caplog.at_level(logging.WARNING, logger="ckpt_store.storage.cache"):
        for oid in (A, B, C, "d" * 64):
            c.put(oid, (oid[:1].encode() * 100,))
    assert [c.get(oid) for oid in (A, B, C)] == [b"a" * 100, b"b" * 100, b"c" * 100]
    assert elsewhere.read_bytes() == b"precious" and not (tmp_path / "nothing").exists()
    assert (d / "dd" / ("d" * 64) / "theirs.txt").read_bytes() == b"theirs" and not caplog.records


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
    assert clear(str(tmp_path)).bytes == u.bytes and tally.add(0) == counted - u.bytes


@pytest.mark.parametrize("replace", [False, True])
def test_a_put_looks_at_its_entry_once(tmp_path, monkeypatch, caplog, replace):
    """Each put lstat()s its entry's path once (a put with ``replace`` just before its rename, one without
    only to find an entry there), and still writes its entry over an empty folder or a link in its place,
    leaving a folder that holds files alone, without a warning. (Every put looked twice.)"""
    import logging

    root = tmp_path / "cache"
    c = ChunkBlobCache(str(root), S, 1 << 20)
    c.put("f" * 64, (b"first",))  # (the first put counts the cache)
    looked: list[str] = []
    real = os.lstat

    def lstat(path, *a, **kw):
        if os.path.basename(path) in (A, B, C, "d" * 64):
            looked.append(os.path.basename(path))
        return real(path, *a, **kw)

    d = root / S
    for oid in (B, C, "d" * 64):
        (d / oid[:2]).mkdir(parents=True, exist_ok=True)
    (d / B[:2] / B).mkdir()
    (d / C[:2] / C).symlink_to(tmp_path / "nothing")
    (d / "dd" / ("d" * 64)).mkdir()
    (d / "dd" / ("d" * 64) / "theirs.txt").write_bytes(b"theirs")
    monkeypatch.setattr(os, "lstat", lstat)
    with caplog.at_level(logging.WARNING, logger="ckpt_store.storage.cache"):
        for oid in (A, A, B, C, "d" * 64):
            c.put(oid, (oid[:1].encode() * 100,), replace=replace)
    monkeypatch.setattr(os, "lstat", real)
    assert looked == [A, A, B, C, "d" * 64]
    assert [c.get(oid) for oid in (A, B, C)] == [b"a" * 100, b"b" * 100, b"c" * 100] and not c.has("d" * 64)
    assert (d / "dd" / ("d" * 64) / "theirs.txt").read_bytes() == b"theirs" and not caplog.records
    assert c._eviction.tally.add(0) == usage(str(root)).bytes == 5 + 3 * 100 + 4 * TRAILER
