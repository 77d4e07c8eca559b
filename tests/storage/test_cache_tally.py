"""The chunk cache's shared tally and eviction lock (storage/cache_tally.py), in a cache root that other
programs' files share, and what `clear` (storage/cache_files.py) leaves in it."""

from __future__ import annotations

import os
import struct

import ckpt_store.storage.cache_files as cache_files
from ckpt_store.storage.cache import TRAILER, ChunkBlobCache, clear, usage
from ckpt_store.storage.cache_tally import EVICTING, TALLY

S = "5" * 32


def test_files_in_the_cache_root_that_are_not_the_tally_are_never_written_and_puts_go_on(tmp_path):
    """A cache root shared with other files (CKPT_CACHE_DIR=~/.cache): a user's file named `tally`,
    and files or links by the tally's own name that are not a tally (another size, a link to a user's
    file, counts past what 64 bits hold), stay byte for byte; the cache walks instead of counting in
    them, and every put lands. (The tally was `<root>/tally`, opened read-write whatever it held: 16
    bytes of the user's file overwritten; a count near 2**63 there made put raise struct.error.)"""
    notes = b"my precious notes, not a cache file\n"
    mine = tmp_path / "mine.txt"
    mine.write_bytes(notes)
    cases = {
        "named tally": lambda root: (root / "tally").write_bytes(notes),
        "another size": lambda root: (root / TALLY).write_bytes(notes),
        "a link": lambda root: (root / TALLY).symlink_to(mine),
        "past 64 bits": lambda root: (root / TALLY).write_bytes(struct.pack("<qq", 2**63 - 1, 0)),
        "negative": lambda root: (root / TALLY).write_bytes(struct.pack("<qq", -5, 0)),
    }
    for name, make in cases.items():
        root = tmp_path / name.replace(" ", "-")
        root.mkdir()
        make(root)
        before = {p.name: p.read_bytes() for p in root.iterdir()}
        c = ChunkBlobCache(str(root), S, 1 << 20)
        for i in range(3):
            c.put(f"{i:064x}", (os.urandom(1000),))
        assert [c.get(f"{i:064x}") is not None for i in range(3)] == [True] * 3, name
        assert {p.name: p.read_bytes() for p in root.iterdir() if p.name in before} == before, name
        assert mine.read_bytes() == notes
        if name != "named tally":
            assert c._eviction.tally.add(0) is None, name  # (not ours: the cache walks, as without a tally)
        else:
            assert c._eviction.tally.add(0) == usage(str(root)).bytes == 3 * (1000 + TRAILER)
        clear(str(root))
        assert {p.name: p.read_bytes() for p in root.iterdir() if p.name in before} == before, name


def test_a_clear_while_another_process_puts_leaves_the_tally_at_what_is_there(tmp_path, monkeypatch):
    """`ckpt cache clear` while another process's pull starts and puts 300 KB: the tally holds what the
    cache holds after it. (clear took what it listed off the tally after the other process's walk had
    set it: 0 with 300,480 bytes there, so the cache could grow past its limit by that.)"""
    root, limit = str(tmp_path), 1_000_000
    a = ChunkBlobCache(root, S, limit)
    for i in range(40):
        a.put(f"a{i:063x}", (os.urandom(20_000),))
    b = ChunkBlobCache(root, S, limit)  # another process's cache
    real_remove, calls = cache_files.remove, []

    def remove(path):
        calls.append(path)
        if len(calls) == 20:  # halfway through the clear: b's first put walks the cache, then it puts
            for k in range(15):
                b.put(f"b{k:063x}", (os.urandom(20_000),))
        return real_remove(path)

    monkeypatch.setattr(cache_files, "remove", remove)
    clear(root)
    monkeypatch.setattr(cache_files, "remove", real_remove)
    held = usage(root).bytes
    assert held == 15 * (20_000 + TRAILER)
    assert a._eviction.tally.add(0) == held


def test_the_eviction_lock_is_one_process_at_a_time(tmp_path):
    """While one process evicts, another does not (it would cut the cache a second time)."""
    import subprocess
    import sys

    c = ChunkBlobCache(str(tmp_path), S, 1 << 20)
    with c._eviction.tally.evicting(wait=False) as mine:
        assert mine
        other = subprocess.run(
            [sys.executable, "-c", "from ckpt_store.storage.cache_tally import CacheTally\n"
             f"with CacheTally({str(tmp_path)!r}).evicting(wait=False) as got:\n    print(got)\n"],
            capture_output=True, text=True, check=True)
        assert other.stdout.strip() == "False"
    assert (tmp_path / EVICTING).stat().st_size == 0


def test_a_put_that_waits_for_another_process_eviction_waits_a_bounded_time(tmp_path):
    """A put that found the disk full waits for another process's eviction; that process stopped
    (SIGSTOP, a debugger) while holding the lock hung the put for good. It now waits EVICT_WAIT_S
    and then evicts beside it."""
    import subprocess
    import sys

    c = ChunkBlobCache(str(tmp_path), S, 1 << 20)
    with c._eviction.tally.evicting(wait=False) as mine:
        assert mine
        other = subprocess.run(
            [sys.executable, "-c", "import time\nimport ckpt_store.storage.cache_tally as t\nt.EVICT_WAIT_S = 0.5\n"
             f"c = t.CacheTally({str(tmp_path)!r})\nt0 = time.monotonic()\n"
             "with c.evicting(wait=True) as got:\n    print(got, time.monotonic() - t0)\n"],
            capture_output=True, text=True, timeout=60)
        got, waited = other.stdout.split()
        assert other.returncode == 0 and got == "True" and float(waited) >= 0.5, other.stderr


def test_threads_that_find_the_disk_full_at_once_evict_their_room_not_a_tenth_each_round(tmp_path, tmpfs):
    """The cache on a 4 MiB tmpfs filled to the brim; 16 threads put 8 KB each at once, while the first
    eviction walks (slowly, as a large cache does): the cache loses the rooms asked and a hundredth of
    what it holds, every entry lands. (Each further round took another tenth of what the cache held,
    for the largest room asked only: 16 x 8 KB evicted 803 KB, 6 times the room; then the first round
    still took a tenth: 296 KB for 132 KB.)"""
    import threading
    import time

    root = tmpfs(tmp_path / "cache", "4m")
    blob = 8192
    c = ChunkBlobCache(root, S, 1 << 40)
    for i in range(10_000):
        st = os.statvfs(root)
        if st.f_bavail * st.f_frsize < blob + TRAILER + 8192:
            break
        c.put(f"e{i:063x}", (os.urandom(blob),))
    held = usage(root).bytes
    real = c._eviction._entries
    c._eviction._entries = lambda: time.sleep(0.2) or real()  # (a walk of 50,000 entries takes 0.3-0.4 s)
    threads = [threading.Thread(target=c.put, args=(f"f{k:063x}", (os.urandom(blob),))) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c.has(f"f{k:063x}") for k in range(16))
    evicted = held + 16 * (blob + TRAILER) - usage(root).bytes
    assert evicted <= 16 * (blob + TRAILER) + max(held // 100, blob + TRAILER) + 2 * (blob + TRAILER), (held, evicted)


def test_a_process_past_the_limit_while_another_evicts_leaves_the_eviction_to_it(tmp_path):
    """Another process holds the eviction lock (its own open file, as a process has): this one, past the
    limit, puts every entry and evicts nothing; once the lock is free its next put evicts, to within the
    limit. (Every process that read the tally past the limit evicted a tenth of the cache at once:
    4 processes filling a 1 MB cache dipped to 44%, once 12%.)"""
    from ckpt_store.storage.cache_tally import CacheTally

    root, limit, blob = str(tmp_path), 1_000_000, 20_000
    c = ChunkBlobCache(root, S, limit)
    with CacheTally(root).evicting(wait=False) as held:
        assert held
        for i in range(60):  # 1.2 MB
            c.put(f"{i:064x}", (os.urandom(blob),))
        assert usage(root).entries == 60
    c.put("f" * 64, (os.urandom(blob),))
    assert 0.8 * limit < usage(root).bytes <= limit and c.has("f" * 64)


def test_a_replacing_put_whose_old_entry_went_meanwhile_leaves_the_tally_at_what_is_there(tmp_path, monkeypatch):
    """put(replace=True) (the chunk decoded in place of its stored blob) while another process drops
    the old entry: the tally holds what the cache holds. (It added the new size less the old one, which
    the other process had taken off already: low by the old entry.)"""
    root = str(tmp_path)
    c = ChunkBlobCache(root, S, 1 << 20)
    c.put("a" * 64, (os.urandom(30_000),))
    c.put("b" * 64, (os.urandom(10_000),))
    real_check, dropped = ChunkBlobCache._in_own_dirs, []

    def drop_first(self, path):  # another process's cache drops the old entry as this one writes
        if not dropped and path.endswith("b" * 64):
            dropped.append(path)
            ChunkBlobCache(root, S, 1 << 20).drop("b" * 64)
        return real_check(self, path)

    monkeypatch.setattr(ChunkBlobCache, "_in_own_dirs", drop_first)
    c.put("b" * 64, (os.urandom(20_000),), replace=True)
    assert dropped and c.get("b" * 64) is not None
    assert c._eviction.tally.add(0) == usage(root).bytes == 30_000 + 20_000 + 2 * TRAILER


def test_a_tally_that_could_not_be_made_is_tried_again_at_the_next_walk(tmp_path):
    """The tally's name is taken (a folder) at a process's first put, then freed: the process counts in
    the tally again from its next walk of the cache. (It walked instead for the rest of its life.)"""
    root, limit = tmp_path, 1_000_000
    (root / TALLY).mkdir()
    c = ChunkBlobCache(str(root), S, limit)
    c.put(f"{0:064x}", (os.urandom(20_000),))
    assert c._eviction.tally.add(0) is None
    (root / TALLY).rmdir()
    for i in range(1, 8):  # 140 KB: past a tenth of the room, where a process without a tally counts again
        c.put(f"{i:064x}", (os.urandom(20_000),))
    assert c._eviction.tally.add(0) == usage(str(root)).bytes == 8 * (20_000 + TRAILER)
