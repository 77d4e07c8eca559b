"""The local read-through chunk cache (storage/cache.py): hits, misses, damaged entries, what it writes
and deletes. Keeping it within its limit: test_cache_evict.py."""

from __future__ import annotations

import os
import time

import pytest

from ckpt_store.storage.backends.base import TEMPORARY
from ckpt_store.storage.cache import TRAILER, ChunkBlobCache, clear, usage

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


def test_clear(tmp_path):
    c = ChunkBlobCache(str(tmp_path), S, 1 << 20)
    c.put(A, (b"1",))
    assert clear(str(tmp_path)).entries == 1
    assert usage(str(tmp_path)).entries == 0 and c.get(A) is None


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
    entry); through a linked store dir a put still made its fan-out folder there (``elsewhere/cc``).
    Now neither deletes nor writes through a link; the reads are misses and the files and folders
    stay as they were, and none is added."""
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
    tree = sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*"))

    def place(head, size):
        return memoryview(bytearray(size - len(head)))

    assert c.get(A) is None and c.read_split(B, 8, place) is None
    c.drop(A)
    c.put(C, (b"c" * 100,))
    c.put(B, (b"b" * 100,), replace=True)
    c.put(D, (b"d" * 100,))
    assert hollow.is_dir() and sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*")) == tree
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
