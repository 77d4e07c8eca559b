"""storage/backends/s3_listing.py: a long listing of ``objects/`` split into parts listed at once,
equal to the listing of one page after another (on each server in S3_TEST_SERVERS)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("botocore")

from ckpt_store.storage.backends.base import CONDEMNED, TEMPORARY  # noqa: E402
from ckpt_store.storage.backends.s3 import S3Backend  # noqa: E402
from ckpt_store.storage.errors import StorageIOError  # noqa: E402
from ckpt_store.storage.objects import KINDS, ObjectStore, object_id  # noqa: E402
from ckpt_store.storage.retry import RetryPolicy  # noqa: E402

FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05)
STEMS = tuple(f"{k}/" for k in KINDS)


def _objects(n: int) -> list[str]:
    paths = []
    for i in range(n):
        oid = object_id(str(i).encode())
        paths.append(ObjectStore.path(KINDS[i % 2], oid))
    return paths


# Keys a store's own writes never make, in every gap between the runs a split lists by prefix: before
# the first, between 9 and a, between the kinds, past the last, and names a run's prefix is a part of.
# (Not a file at a folder's name, objects/chunks: SeaweedFS's own listing, page after page, loses keys below it.)
STRAYS = ["objects/!first", "objects/chunks/ 0", "objects/chunks/0", "objects/chunks/9z/x",
          "objects/chunks/:/x", "objects/chunks/A0/x", "objects/chunks/`", "objects/chunks/g0/x",
          "objects/chunks/zz/" + "0" * 64, "objects/chunks~", "objects/k", "objects/manifests/9",
          "objects/manifests/_", "objects/manifests/ff/x", "objects/manifests/g", "objects/zzz/last"]


@pytest.fixture
def listed(s3_server):
    """A backend over a store holding objects of both kinds, leftovers of writes, condemned ones, and strays."""
    b = S3Backend(f"s3://{s3_server.new_bucket()}/store", s3_server.options(), retry=FAST)
    paths = _objects(40)
    paths += [f"{paths[0].rpartition('/')[0]}/{TEMPORARY}1", f"{paths[1].rpartition('/')[0]}/{TEMPORARY}2"]
    paths += STRAYS
    folder, _, name = paths[2].rpartition("/")
    paths.append(f"{folder}/{CONDEMNED}0123abcd-{name}")  # what a killed gc left condemned
    for i, p in enumerate(paths):
        b.write(p, b"x" * (i % 7 + 1))
    return b


def _pages(b: S3Backend) -> list[tuple[str, str]]:
    asked: list[tuple[str, str]] = []
    lock = threading.Lock()
    real = b._list_page

    def page(prefix: str, token: str | None, delimiter: str, start_after: str = "", max_keys: int = 0) -> object:
        with lock:
            asked.append((prefix, start_after))
        return real(prefix, token, delimiter, start_after, max_keys)

    b._list_page = page  # type: ignore[method-assign]
    return asked


def test_a_split_listing_is_the_listing_page_after_page(listed):
    """Wherever the first page ends (inside a run, between runs, past all of them), the parts listed at
    once give every key once, in order, with its size and time, as list() does page after page."""
    b = listed
    b.page_keys = 1000
    serial = [(e.path, e.size, e.mtime) for e in b.list("objects")]
    assert len(serial) == 40 + 3 + len(STRAYS)
    for page_keys in (1, 2, 3, 5, 8, 13, 21, 30, 45, 58, 59, 60, 100):
        b.page_keys = page_keys
        asked = _pages(b)
        split = [(e.path, e.size, e.mtime) for e in b.list_split("objects", STEMS)]
        del b._list_page
        assert split == serial, page_keys
        if page_keys >= len(serial):
            assert len(asked) == 1  # a store listed in one page: one request, as before
        elif page_keys <= 13:
            assert len({p for p, _ in asked}) > 10  # the runs past the first page, each by its prefix


def test_a_small_store_is_listed_in_one_request(s3_server):
    b = S3Backend(f"s3://{s3_server.new_bucket()}/store", s3_server.options(), retry=FAST)
    for p in _objects(6):
        b.write(p, b"x")
    asked = _pages(b)
    assert len(list(b.list_split("objects", STEMS))) == 6
    assert len(asked) == 1


def test_a_failed_part_fails_the_listing(s3_main, proxy):
    """A part the server does not answer (503 SlowDown past the retries) raises: never a listing without
    its keys, which a gc would read as objects nothing names."""
    b = S3Backend(f"s3://{s3_main.new_bucket()}/store", s3_main.options(endpoint=proxy.endpoint), retry=FAST)
    for p in _objects(30):
        b.write(p, b"x")
    b.page_keys = 4
    listing = b.list_split("objects", STEMS)
    first = [next(listing) for _ in range(4)]  # the first page, listed as list() lists it
    assert [e.path for e in first] == [e.path for e in b.list("objects")][:4]
    proxy.busy, proxy.busy_method = 1000, b"GET"  # every LIST from here on
    with pytest.raises(StorageIOError):
        list(listing)
