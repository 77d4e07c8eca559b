"""The response deadlines of remote reads (storage/backends/watchdog.py), on real sockets."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from ckpt_store.storage.backends import watchdog


def _switches(tid: int) -> int:
    """Context switches of thread ``tid`` of this process so far (each wake-up is one)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        return sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_later_deadline_does_not_wake_the_watchdog_but_an_earlier_one_fires_in_time():
    """Every GET registers a deadline: woken for each one, the watchdog thread took the GIL from the
    reading threads once per chunk. It is woken only for a deadline earlier than all it waits on."""
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        first = watchdog.watch(pairs[0][0], 300.0)
        thread = watchdog._WATCHDOG._thread
        assert thread is not None and thread.native_id is not None
        time.sleep(0.2)  # it waits on the earliest deadline
        before = _switches(thread.native_id)
        later = []
        for i in range(50):  # responses one after another, as a pull's GETs come
            later.append(watchdog.watch(pairs[1][0], 600.0 + i))
            time.sleep(0.005)
            later[-1].cancel()
        time.sleep(0.2)
        assert _switches(thread.native_id) - before < 10  # not one per deadline (50 before)
        soon = watchdog.watch(pairs[2][0], 0.3)  # earlier than all: the thread must wake for it
        pairs[2][0].settimeout(30)
        t0 = time.monotonic()
        assert pairs[2][0].recv(1) == b""  # shut down at its deadline
        assert soon.fired and time.monotonic() - t0 < 20
        first.cancel()
        assert not first.fired and not any(d.fired for d in later)
    finally:
        for a, b in pairs:
            a.close()
            b.close()
