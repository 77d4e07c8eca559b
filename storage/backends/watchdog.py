"""Deadlines for whole responses: a socket whose response is not read in time is shut down.

A read timeout bounds each ``recv``, not a response: a server that sends a few bytes
every second never trips it, and would hold a GET (and the pull waiting on it) for days.
:func:`deadline` registers a socket with one shared thread that shuts it down when its
time is up; the blocked read then returns short or fails, and the caller reports a
timeout (which is retried like any other).
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# A response that arrives slower than this, once the client's read timeout has passed, is a
# server that stalls: botocore's read timeout is per read, and a server sending a byte now
# and then would hold a GET (and a pull) for days. It times out and is retried.
MIN_RATE = 64 * 1024  # bytes per second


def allowed(patience: float, size: int) -> float:
    """Seconds a response of ``size`` bytes may take: the read timeout, then :data:`MIN_RATE`."""
    return patience + size / MIN_RATE


class _Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket, list[bool]]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, when: float, sock: socket.socket) -> tuple[int, list[bool]]:
        fired = [False]
        with self._cond:
            n = next(self._ids)
            heapq.heappush(self._heap, (when, n, sock, fired))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-response-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
        return n, fired

    def cancel(self, entry: tuple[int, list[bool]]) -> None:
        with self._cond:
            entry[1].append(True)  # marks it done: the thread skips it (removed lazily)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and len(self._heap[0][3]) > 1:
                    heapq.heappop(self._heap)  # done before its time
                if not self._heap:
                    self._cond.wait()
                    continue
                when, _, sock, fired = self._heap[0]
                wait = when - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                fired[0] = True
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


_WATCHDOG = _Watchdog()


@contextmanager
def deadline(sock: socket.socket | None, seconds: float) -> Iterator[list[bool]]:
    """Shut ``sock`` down unless the block ends within ``seconds``. Yields a list whose first
    item turns True if it was (then whatever the block read failed because of it)."""
    if sock is None:
        yield [False]
        return
    entry = _WATCHDOG.add(time.monotonic() + seconds, sock)
    try:
        yield entry[1]
    finally:
        _WATCHDOG.cancel(entry)


def socket_of(response: Any) -> socket.socket | None:
    """The socket under an http.client response (None where it cannot be found)."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    return sock if isinstance(sock, socket.socket) else None
