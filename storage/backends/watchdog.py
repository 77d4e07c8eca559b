"""Deadlines for whole responses: a socket whose response is not read in time is shut down.

A read timeout bounds each ``recv``, not a response: a server that sends a few bytes
every second never trips it, and would hold a GET (and the pull waiting on it) for days.
:func:`watch` registers a socket with one shared thread that shuts it down when its
time is up; the blocked read then returns short or fails, and the caller reports a
timeout (which is retried like any other).
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

# A response that arrives slower than this, once the client's read timeout has passed, is a
# server that stalls: botocore's read timeout is per read, and a server sending a byte now
# and then would hold a GET (and a pull) for days. It times out and is retried.
MIN_RATE = 64 * 1024  # bytes per second


def allowed(patience: float, size: int) -> float:
    """Seconds a response of ``size`` bytes may take: the read timeout, then :data:`MIN_RATE`."""
    return patience + size / MIN_RATE


@dataclass(eq=False)
class Deadline:
    """One response's deadline: :meth:`cancel` once it is read; ``fired`` says whether its socket
    was shut down first (then whatever the read got failed because of it)."""

    when: float
    sock: socket.socket | None
    fired: bool = False
    done: bool = False

    def cancel(self) -> None:
        with _WATCHDOG.cond:
            self.done = True  # the watchdog skips it (removed from its heap lazily)


class _Watchdog:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, d: Deadline) -> None:
        with self.cond:
            heapq.heappush(self._heap, (d.when, next(self._ids), d))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-response-deadlines", daemon=True)
                self._thread.start()
            # Woken only for a deadline that is now the earliest: the thread already waits until
            # the earliest one, which comes no later than this. Woken for every response (a GET
            # per chunk), it took the GIL from the reading threads each time (240 GETs of a pull
            # from SeaweedFS on 16 threads: 2,200 context switches of the process, 1,560 like this).
            if self._heap[0][2] is d:
                self.cond.notify()

    def _run(self) -> None:
        with self.cond:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)  # read before its time
                if not self._heap:
                    self.cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                _, _, d = heapq.heappop(self._heap)
                d.fired = True
                try:
                    d.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
                except OSError:
                    pass


_WATCHDOG = _Watchdog()


def watch(sock: socket.socket | None, seconds: float) -> Deadline:
    """Shut ``sock`` down unless the returned deadline is cancelled within ``seconds`` (nothing
    to watch where the socket is not known)."""
    d = Deadline(time.monotonic() + seconds, sock, done=sock is None)
    if sock is not None:
        _WATCHDOG.add(d)
    return d


def socket_of(response: Any) -> socket.socket | None:
    """The socket under an http.client response (None where it cannot be found)."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    return sock if isinstance(sock, socket.socket) else None
