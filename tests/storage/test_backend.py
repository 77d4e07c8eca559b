"""One conformance suite for every backend: the primitives the store relies on.

Runs on a local directory, ``memory://`` and every S3 server in S3_TEST_SERVERS
(moto by default; SeaweedFS, which checks signatures, in CI).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
import uuid

import pytest

from ckpt_store.storage.backends import open_backend
from ckpt_store.storage.backends.base import io_error
from ckpt_store.storage.backends.local import LocalBackend
from ckpt_store.storage.errors import StorageIOError


@pytest.fixture
def backend(store_url):
    return open_backend(store_url)


def test_write_read_roundtrip(backend):
    backend.write("a/b/c.bin", b"hello")
    assert backend.read("a/b/c.bin") == b"hello"
    assert backend.read_range("a/b/c.bin", 1, 3) == b"ell"
    assert backend.exists("a/b/c.bin")
    assert backend.size("a/b/c.bin") == 5


def test_staged_writes_are_named_only_when_kept(backend):
    """``stage``: nothing is at the path until the write is kept; a dropped one leaves nothing (locally,
    not even its temporary), and a kept one replaces what was there, whole."""
    backend.write("s/old.bin", b"old")
    keep, drop, over = (backend.stage("s/new.bin", (b"he", b"llo")), backend.stage("s/gone.bin", b"x"),
                        backend.stage("s/old.bin", b"newer"))
    assert not backend.exists("s/new.bin") and not backend.exists("s/gone.bin") and backend.read("s/old.bin") == b"old"
    keep(True)
    drop(False)
    over(True)
    assert backend.read("s/new.bin") == b"hello" and not backend.exists("s/gone.bin") and backend.read("s/old.bin") == b"newer"
    assert sorted(e.path for e in backend.list("s")) == ["s/new.bin", "s/old.bin"]


def test_missing_file_raises_file_not_found(backend):
    with pytest.raises(FileNotFoundError):
        backend.read("nope")
    assert not backend.exists("nope")


def test_create_exclusive_only_once(backend):
    assert backend.create_exclusive("x/ref", b"one")
    assert not backend.create_exclusive("x/ref", b"two")
    assert backend.read("x/ref") == b"one"


def test_list_is_recursive_and_relative(backend):
    for p in ("d/1", "d/e/2", "f/3"):
        backend.write(p, p.encode())
    assert sorted(e.path for e in backend.list("d")) == ["d/1", "d/e/2"]
    assert list(backend.list("absent")) == []
    sizes = {e.path: e.size for e in backend.list("d")}
    assert sizes["d/e/2"] == 5


def test_children_are_the_names_directly_below_from_a_name_on(backend):
    """``children``: what refs read to find a ref's newest entry without listing its whole history
    (storage/refs.py): names directly below, in order, a folder (an object store's prefix holding
    objects) as not a file, from after a given name, page by page on S3."""
    for p in ("d/01", "d/02", "d/03/x", "d/04", "d/05/y/z", "d/06", "dd/07", "d/08"):
        backend.write(p, b"x")
    if hasattr(backend, "page_keys"):
        backend.page_keys = 2
    pages = list(backend.children("d"))
    assert [n for page, _ in pages for n in page] == [("01", True), ("02", True), ("03", False), ("04", True),
                                                       ("05", False), ("06", True), ("08", True)]
    assert [more for _, more in pages] == [True] * (len(pages) - 1) + [False]
    assert [n for page, _ in backend.children("d", "04") for n, _ in page] == ["05", "06", "08"]
    assert [n for page, _ in backend.children("d", "041") for n, _ in page] == ["05", "06", "08"]
    assert [n for page, _ in backend.children("d", "08") for n in page] == []
    assert list(backend.children("absent")) in ([], [([], False)])


def test_delete_is_idempotent(backend):
    backend.write("z", b"1")
    backend.delete("z")
    backend.delete("z")
    assert not backend.exists("z")


def test_overwrite_replaces_whole(backend):
    backend.write("o/x", b"first version")
    backend.write("o/x", b"second")
    assert backend.read("o/x") == b"second"
    assert backend.read_range("o/x", 0, 100) == b"second"  # short read at the end


def test_empty_object(backend):
    backend.write("o/empty", b"")
    assert backend.read("o/empty") == b"" and backend.size("o/empty") == 0 and backend.exists("o/empty")


def test_exists_many(backend):
    present = [f"objects/ab/{i:02d}" for i in range(6)] + ["objects/cd/x", "refs/a/0000000001.ref"]
    for p in present:
        backend.write(p, b"1")
    asked = present + [f"objects/ab/{i:02d}" for i in range(6, 10)] + ["objects/ef/y", "nowhere/z"]
    assert backend.exists_many(asked) == set(present)
    assert backend.exists_many([]) == set()


def test_a_folder_or_a_fifo_is_not_an_object(backend):
    """``exists`` and ``exists_many`` (what ``ls`` and ``du`` ask of live manifests, in one batch)
    name only objects a read can read: a folder there, or a FIFO in a local store, is not one (a
    folder in place of a manifest was shown by ``ls`` as a whole ref)."""
    backend.write("f/x/inside", b"1")
    local = backend.local_path("f/fifo")
    if local is not None:
        os.mkfifo(local)
    assert not backend.exists("f/x") and not backend.exists("f/fifo") and backend.exists("f/x/inside")
    assert backend.exists_many(["f/x", "f/fifo", "f/x/inside"]) == {"f/x/inside"}


def test_mtime_is_recent(backend):
    import time

    backend.write("t/x", b"1")
    assert abs(backend.mtime("t/x") - time.time()) < 120
    assert abs(next(iter(backend.list("t"))).mtime - time.time()) < 120


def test_list_does_not_match_sibling_prefixes(backend):
    backend.write("refs/a/1", b"1")
    backend.write("refs/ab/2", b"2")
    assert [e.path for e in backend.list("refs/a")] == ["refs/a/1"]


def test_exclusive_create_race_has_one_winner(backend):
    for round_ in range(5):
        wins = []
        barrier = threading.Barrier(8)

        def attempt(i: int, round_: int = round_) -> None:
            barrier.wait()
            if backend.create_exclusive(f"race/{round_}", f"writer-{i}-{uuid.uuid4().hex}".encode()):
                wins.append(i)

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1
        assert backend.read(f"race/{round_}").startswith(f"writer-{wins[0]}-".encode())


def test_a_local_folder_removed_after_a_write_is_made_again(tmp_path):
    """A backend remembers the folders it made: one removed since (a ref's folder, by another process
    or by hand) made every later write there fail, "No such file or directory", retried in vain."""
    import shutil

    b = LocalBackend(str(tmp_path), fsync=False)
    b.write("refs/m/0000000001.ref", b"1")
    shutil.rmtree(tmp_path / "refs" / "m")
    assert b.create_exclusive("refs/m/0000000001.ref", b"2") and b.read("refs/m/0000000001.ref") == b"2"
    shutil.rmtree(tmp_path / "refs")
    b.write("refs/m/0000000002.ref", b"3")
    assert b.read("refs/m/0000000002.ref") == b"3" and sorted(os.listdir(tmp_path / "refs" / "m")) == ["0000000002.ref"]


def test_local_write_leaves_no_temporaries(tmp_path):
    b = LocalBackend(str(tmp_path))
    b.write("o/x", b"data")
    b.create_exclusive("o/y", b"data")
    b.create_exclusive("o/y", b"other")
    assert sorted(os.listdir(tmp_path / "o")) == ["x", "y"]



def test_a_local_write_that_cannot_take_its_name_leaves_no_temporary(tmp_path):
    """A write over a folder (`verify --repair-from` putting back a chunk where a folder stands)
    failed at the rename and left its full-size .tmp- file beside it, one per attempt, until a gc
    an hour later."""
    b = LocalBackend(str(tmp_path))
    (tmp_path / "o" / "x").mkdir(parents=True)
    with pytest.raises(StorageIOError, match="cannot write o/x"):
        b.write("o/x", b"data" * 1000)
    assert os.listdir(tmp_path / "o") == ["x"]

@pytest.mark.parametrize("start", [0, 5])
def test_read_into_hands_each_part_to_the_caller_as_it_is_filled(backend, start):
    """``read_into(..., each=)`` calls ``each`` with the parts of the buffer it fills, in order and
    together exactly the bytes read (a local store: block by block, so that a caller hashes each
    while it is in the CPU's caches); each part is the buffer's own memory, not a copy."""
    from ckpt_store.storage.backends.local_reads import READ_BLOCK

    data = os.urandom(2 * READ_BLOCK + 1000)
    backend.write("o/x", data)
    buf = bytearray(len(data) + 50)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    parts: list[tuple[int, bytes]] = []

    def each(part: memoryview) -> None:
        parts.append((ctypes.addressof(ctypes.c_char.from_buffer(part)) - base, bytes(part)))

    assert backend.read_into("o/x", start, memoryview(buf), each=each) == len(data)
    assert b"".join(p for _, p in parts) == data[start:] == bytes(buf[: len(data) - start])
    assert [at for at, _ in parts] == [sum(len(p) for _, p in parts[:i]) for i in range(len(parts))]  # in place, in order
    if isinstance(backend, LocalBackend):
        assert [len(p) for _, p in parts] == [READ_BLOCK, READ_BLOCK, 1000 - start]


def _resident_pages(area: mmap.mmap) -> int:
    """How many of ``area``'s pages are in memory (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * (len(area) // mmap.PAGESIZE))()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(area))
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(len(area)), vec) == 0
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_a_local_read_into_fresh_memory_faults_its_pages_in_first(tmp_path):
    """A read into memory never touched (a restore's fresh optimizer moments) took a page fault per
    4 KiB page inside the kernel's copy: its pages are faulted in by one madvise first (whole pages
    of the buffer only; a small or read-only buffer is left alone), and the read is exact."""
    from ckpt_store.storage.backends.local_reads import MADV_POPULATE_WRITE, POPULATE_MIN, _madvise, populate

    probe = mmap.mmap(-1, mmap.PAGESIZE)
    if _madvise()(ctypes.addressof(ctypes.c_char.from_buffer(probe)), mmap.PAGESIZE, MADV_POPULATE_WRITE) != 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (5.14+)")
    page, n = mmap.PAGESIZE, 64
    area = mmap.mmap(-1, n * page)
    assert _resident_pages(area) == 0
    populate(memoryview(area)[: POPULATE_MIN - 1])  # too small to pay
    populate(memoryview(bytes(n * page)))  # read-only: nothing to do
    assert _resident_pages(area) == 0
    populate(memoryview(area)[100 : 100 + (n - 2) * page])  # pages 1..n-2 whole; 0 and n-2 partly
    assert _resident_pages(area) == n - 3 and area[:] == bytes(n * page)

    data = os.urandom(n * page)
    b = LocalBackend(str(tmp_path), fsync=False)
    b.write("o/x", data)
    fresh = mmap.mmap(-1, n * page)
    assert b.read_into("o/x", 10, memoryview(fresh)[1000:]) == len(data)
    assert fresh[1000:] == data[10 : 10 + n * page - 1000] and fresh[:1000] == bytes(1000)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_a_local_read_into_memory_already_in_place_asks_no_fault_in(tmp_path, advised):
    """Memory already in place (a model's parameters, a peer transfer's reused send buffers) is not
    advised again: the advice took each page through the kernel's page lookup once more (~4 ms per
    32 MiB, 0.3 s of a 1.2 GB peer transfer). Memory partly in place still is; reads stay exact."""
    page, n = mmap.PAGESIZE, 64
    data = os.urandom(n * page)
    b = LocalBackend(str(tmp_path), fsync=False)
    b.write("o/x", data)
    area = mmap.mmap(-1, n * page)
    assert b.read_into("o/x", 0, memoryview(area)) == len(data) and area[:] == data
    assert advised == [n * page]  # fresh: faulted in first
    assert b.read_into("o/x", 0, memoryview(area)) == len(data) and area[:] == data
    assert advised == [n * page]  # in place: left alone
    part = mmap.mmap(-1, n * page)
    part[: 8 * page] = bytes(8 * page)  # the first 8 pages touched, the rest fresh
    assert b.read_into("o/x", 0, memoryview(part)) == len(data) and part[:] == data
    assert advised == [n * page, n * page]


@pytest.mark.parametrize(
    "err, words, retryable",
    [(errno.ENOSPC, "disk is full", False), (errno.EROFS, "permission denied", False), (errno.EIO, "write", True)],
)
def test_os_errors_become_storage_errors(err, words, retryable):
    e = io_error("write", "objects/x", OSError(err, os.strerror(err)))
    assert isinstance(e, StorageIOError) and words in str(e) and e.retryable is retryable


def test_schemes_come_from_one_registry_that_refuses_duplicates():
    from ckpt_store.storage.backends import BackendSpec, backend_class, register_backend, scheme_of
    from ckpt_store.storage.backends.fsspec_backend import FsspecBackend
    from ckpt_store.storage.errors import MissingDependencyError

    assert scheme_of("/a/b") == scheme_of("file:///a/b") == "file" and scheme_of("S3://b/p") == "s3"
    assert backend_class("file") is LocalBackend
    assert backend_class("memory") is FsspecBackend  # any other scheme: fsspec
    with pytest.raises(ValueError, match="already has a backend"):
        register_backend("s3", BackendSpec("somewhere", "Else"))
    register_backend("ckpt-test-missing", BackendSpec("ckpt_test_no_such_module", "B", extra="nothing"))
    with pytest.raises(MissingDependencyError) as e:
        open_backend("ckpt-test-missing://bucket/x")
    assert "pip install 'ckpt-store[nothing]'" in str(e.value)


def test_a_memory_store_lists_while_another_thread_writes_it():
    """fsspec's MemoryFileSystem.find copies its dict of every file, and a garbage collection during the copy can
    hand the GIL to a thread writing the store: the listing raised "dictionary changed size during iteration"
    (a push listing its locks while a gc deleted, in a test run). Forced here: a collection at every allocation
    yields to the writer (young ones only: a full collection of a whole test run's heap at every allocation made
    this test take 30 s). Its writes, deletes and listings take one lock now."""
    import gc
    import time

    backend = open_backend(f"memory://ckpt-test-{uuid.uuid4().hex}")
    for i in range(2000):  # (memory:// is one dict for the process: a long copy, as in a full test run)
        backend.write(f"other/{i}", b"")
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            backend.write(f"locks/x-{i}", b"x")
            backend.delete(f"locks/x-{i - 20}")
            i += 1

    def yield_in_collections(phase, info) -> None:
        if threading.current_thread() is threading.main_thread():
            time.sleep(0)

    writer = threading.Thread(target=write)
    old_threshold, old_interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(1, 1_000_000, 1_000_000)  # young collections only: a full one of a test run's heap takes long
    sys.setswitchinterval(1e-6)
    gc.callbacks.append(yield_in_collections)
    writer.start()
    try:
        for _ in range(50):
            assert all(e.path.startswith("locks/x-") for e in backend.list("locks"))
    finally:
        gc.callbacks.remove(yield_in_collections)
        gc.set_threshold(*old_threshold)
        sys.setswitchinterval(old_interval)
        stop.set()
        writer.join()


def test_a_filesystems_own_errors_are_storage_errors_and_its_bugs_stay_bugs(failing_fs):
    """fsspec's own filesystems fail with OSError; others raise error types of their own (gcsfs's HttpError, Azure's
    for adlfs, a user's filesystem's): those escaped the backend as they were, no error the layers above know (a
    persist beside training would log one as a bug, a command would end in a traceback). Each is a StorageIOError
    now, from the filesystem's error; a builtin type raised in the call (a TypeError: a bug) is left as it is."""
    from conftest import ServiceError

    backend = open_backend(f"ckpt-test-failing://store-{uuid.uuid4().hex}")
    backend.write("a/b", b"hello")
    calls = {"read": lambda: backend.read("a/b"), "read_range": lambda: backend.read_range("a/b", 0, 2),
             "write": lambda: backend.write("a/c", b"x"), "create_exclusive": lambda: backend.create_exclusive("a/d", b"x"),
             "exists": lambda: backend.exists("a/b"), "size": lambda: backend.size("a/b"),
             "mtime": lambda: backend.mtime("a/b"), "list": lambda: list(backend.list("a")),
             "delete": lambda: backend.delete("a/b"), "root_exists": backend.root_exists}
    failing_fs.raising = ServiceError("503 Service Unavailable\n<html>...</html>")
    for name, call in calls.items():
        with pytest.raises(StorageIOError, match=r"^cannot \w+ \S+: ServiceError: 503 Service Unavailable$") as e:
            call()
        assert isinstance(e.value.__cause__, ServiceError) and e.value.retryable, name
    failing_fs.raising = TypeError("a bug")
    for name, call in calls.items():
        with pytest.raises(TypeError, match="a bug"):
            call()
    failing_fs.raising = None
    assert backend.read("a/b") == b"hello" and [e.path for e in backend.list("a")] == ["a/b"]


def test_a_filesystems_passing_failure_reading_a_ref_is_not_damage(failing_fs):
    """A filesystem's own error (a 503 from its server) reading a ref entry was a StorageIOError that was not
    retryable, which the refs read as damage: a StoreFormatError, and gc advised moving the entry out of the store
    (then freeing what only it named). It is a failure that may pass: a retryable StorageIOError, the store's
    refs named as they are once it passes."""
    import torch

    from ckpt.errors import StoreFormatError
    from ckpt.store.store import Store
    from conftest import ServiceError

    url = f"ckpt-test-failing://store-{uuid.uuid4().hex}"
    Store.init(url).push({"w": torch.arange(10, dtype=torch.float32)}, "model/a")
    failing_fs.raising, failing_fs.only = ServiceError("503 Service Unavailable"), r"/refs/.*\.ref$"
    for call in (lambda: Store.open(url).load("model/a"), lambda: Store.open(url).gc(grace_s=0)):
        with pytest.raises(StorageIOError, match="ServiceError: 503") as e:
            call()
        assert not isinstance(e.value, StoreFormatError) and e.value.retryable
    failing_fs.raising = None
    assert torch.equal(Store.open(url).load("model/a")["w"], torch.arange(10, dtype=torch.float32))


def test_a_push_makes_durable_the_names_of_the_folders_it_made(tmp_path, monkeypatch):
    """A file is durable once it and its folder are fsynced; a folder made by the write is durable once its
    PARENT is. Only the folders holding files were fsynced: a power loss after a push into a new store (or
    under a new ref name, or a new chunks/ fan-out folder) could lose a whole folder of fsynced files. There
    is no power to cut here: every fsync is recorded (and done), and every folder of the store must have had
    its parent fsynced after the push made it."""
    import torch

    import ckpt

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name what is fsynced")
    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "new" / "store"
    store = ckpt.Store.init(str(root))
    store.push({"w": torch.arange(1000.0)}, "team/model/base")
    folders = [str(p) for p in root.rglob("*") if p.is_dir()] + [str(root), str(root.parent)]
    assert any(s.endswith("/refs/team") or "/refs/team/" in s for s in folders)
    missing = sorted(f for f in folders if os.path.dirname(f) not in synced)
    assert not missing, f"made but their parents never fsynced: {missing}"


def test_a_store_made_in_a_folder_this_user_may_write_but_not_read_takes_pushes(tmp_path, monkeypatch):
    """A drop box (mode 0333: write, no read) above a new store: the fsync of the folder that holds the store's new
    folder cannot open it, and the push failed with a PermissionError traceback where it had worked (review rev23o).
    Such a folder is passed over. (Opening it is refused here by the test: root reads any folder.)"""
    import torch
    from integration_util import opening_refused

    import ckpt
    import ckpt_store.storage.backends.local as local

    drop = tmp_path / "drop"
    drop.mkdir()
    monkeypatch.setattr(local.os, "open", opening_refused(drop))
    store = ckpt.Store.init(str(drop / "store"))
    store.push({"w": torch.arange(10.0)}, "m")
    assert torch.equal(ckpt.Store.open(str(drop / "store")).load("m")["w"], torch.arange(10.0))
