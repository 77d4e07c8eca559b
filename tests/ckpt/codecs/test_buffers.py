"""The blob buffers one read leaves to the next (ckpt/codecs/buffers.py: SpareBuffers)."""

from __future__ import annotations

import os
import time

import numpy as np

from ckpt.codecs import buffers
from ckpt.codecs.buffers import SpareBuffers, empty_buffer


def _bufs(n: int, size: int) -> list[memoryview]:
    return [empty_buffer(size) for _ in range(n)]


def test_a_read_gets_the_buffers_the_last_one_left_at_most_as_many_as_it_kept():
    spares = SpareBuffers()
    left = _bufs(5, 4096)
    spares.leave(4096, left, keep=3)
    assert spares.kept() == 3
    assert spares.take(1024) == []  # another size: none
    got = spares.take(4096)
    assert [b.obj for b in got] == [b.obj for b in left[:3]]  # the same memory again
    assert spares.take(4096) == []  # taken once: a read under way has them, no other
    spares.leave(4096, got, keep=3)
    spares.leave(4096, _bufs(2, 4096), keep=3)  # a second read ending: within the bound still
    assert spares.kept() == 3


def test_buffers_left_are_released_once_no_read_left_any_for_the_idle_time(monkeypatch):
    monkeypatch.setattr(buffers, "SPARE_IDLE_S", 0.2)
    spares = SpareBuffers()
    spares.leave(4096, _bufs(2, 4096), keep=4)
    time.sleep(0.12)
    spares.leave(4096, _bufs(1, 4096), keep=4)  # a later read: the time counts from it
    time.sleep(0.12)
    assert spares.kept() == 3
    deadline = time.monotonic() + 5
    while spares.kept() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert spares.kept() == 0
    spares.leave(4096, _bufs(1, 4096), keep=4)  # kept again after a release, and released again
    assert spares.kept() == 1
    deadline = time.monotonic() + 5
    while spares.kept() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert spares.kept() == 0


def test_the_buffers_are_plain_uninitialised_numpy_memory():
    spares = SpareBuffers()
    spares.leave(64, _bufs(1, 64), keep=1)
    (b,) = spares.take(64)
    assert isinstance(b.obj, np.ndarray) and len(b) == 64 and not b.readonly


def test_a_forked_child_keeps_none_of_its_parents_buffers(monkeypatch):
    """A child (a DataLoader worker, say) has no thread to release buffers kept: it keeps none."""
    monkeypatch.setattr(buffers, "SPARE_IDLE_S", 60.0)
    buffers.SPARES.leave(4096, _bufs(2, 4096), keep=2)
    assert buffers.SPARES.kept() >= 2
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 if it kept none
        os._exit(0 if buffers.SPARES.kept() == 0 and buffers.SPARES.take(4096) == [] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert buffers.SPARES.take(4096)  # the parent still has them
