"""One conformance suite for every backend: the primitives the store relies on."""

from __future__ import annotations

import errno
import os
import threading
import uuid

import pytest

from storage.backend import LocalBackend, _io_error, open_backend
from storage.errors import StorageIOError


@pytest.fixture(params=["local", "memory"])
def backend(request, tmp_path):
    if request.param == "local":
        return open_backend(str(tmp_path / "root"))
    return open_backend(f"memory://backend-{uuid.uuid4().hex}")


def test_write_read_roundtrip(backend):
    backend.write("a/b/c.bin", b"hello")
    assert backend.read("a/b/c.bin") == b"hello"
    assert backend.read_range("a/b/c.bin", 1, 3) == b"ell"
    assert backend.exists("a/b/c.bin")
    assert backend.size("a/b/c.bin") == 5


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


def test_delete_is_idempotent(backend):
    backend.write("z", b"1")
    backend.delete("z")
    backend.delete("z")
    assert not backend.exists("z")


def test_local_write_leaves_no_temporaries(tmp_path):
    b = LocalBackend(str(tmp_path))
    b.write("o/x", b"data")
    b.create_exclusive("o/y", b"data")
    b.create_exclusive("o/y", b"other")
    assert sorted(os.listdir(tmp_path / "o")) == ["x", "y"]


def test_local_exclusive_create_race_has_one_winner(tmp_path):
    b = LocalBackend(str(tmp_path), fsync=False)
    for round_ in range(20):
        wins = []
        barrier = threading.Barrier(8)

        def attempt(i: int, round_: int = round_) -> None:
            barrier.wait()
            if b.create_exclusive(f"race/{round_}", f"writer-{i}".encode()):
                wins.append(i)

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1
        assert b.read(f"race/{round_}") == f"writer-{wins[0]}".encode()


@pytest.mark.parametrize(
    "err, words, retryable",
    [(errno.ENOSPC, "disk is full", False), (errno.EROFS, "permission denied", False), (errno.EIO, "write", True)],
)
def test_os_errors_become_storage_errors(err, words, retryable):
    e = _io_error("write", "objects/x", OSError(err, os.strerror(err)))
    assert isinstance(e, StorageIOError) and words in str(e) and e.retryable is retryable
