"""What the chunk codecs work in: this thread's zstd contexts and reusable scratch buffers,
uninitialised buffers, blobs kept in pieces (:data:`Parts`), and the blob buffers one read
leaves to the next (:class:`SpareBuffers`).

zstandard contexts must not be shared between threads, and fresh memory costs page faults, so
each thread keeps its own (released with the thread)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import zstandard

Parts = tuple[bytes | memoryview, ...]  # a blob or payload in pieces, written without joining

_local = threading.local()


def compressor(level: int, size: int = 0) -> zstandard.ZstdCompressor:
    """This thread's compressor at ``level`` for inputs of about ``size`` bytes. zstandard
    compressors must not be shared between threads, so one per thread, level and size
    class: samples (small) and whole planes (large) alternate, and a context that
    changes size class re-derives and resets its tables; two contexts encode the
    fp32 family 1-3% faster on two threads, to the same bytes."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    key = (level, size >= 1 << 18)
    c = cache.get(key)
    if c is None:
        c = cache[key] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def empty_buffer(n: int) -> memoryview:
    """``n`` writable bytes, not zeroed: for a buffer that is written whole before it is read.
    ``bytearray(n)`` zeroes its bytes holding the GIL, which faults fresh pages in there too:
    a cold pull of MiniLM from S3 spent ~30 ms of its ~330 holding the GIL in it, while 16
    threads waited to read responses (py-spy --gil). Here the first write faults the pages in,
    in a socket read or a decoder that has released the GIL."""
    return memoryview(np.empty(n, dtype=np.uint8))


def thread_buffer(n: int, name: str = "split") -> memoryview:
    """Per-thread buffer ``name`` of at least ``n`` bytes, reused across chunks (fresh memory
    costs page faults); released with the thread. What it holds is valid until the same
    thread asks for ``name`` again."""
    bufs = getattr(_local, "scratch", None)
    if bufs is None:
        bufs = _local.scratch = {}
    buf = bufs.get(name)
    if buf is None or len(buf) < n:
        buf = bufs[name] = empty_buffer(n)
    return buf[:n]


# How long the buffers a read leaves wait for the next read of the process (:class:`SpareBuffers`).
SPARE_IDLE_S = 1.0


class SpareBuffers:
    """Blob buffers left by the reads of a process (``get_chunks``' :class:`BlobBuffers`), kept for the
    next read until :data:`SPARE_IDLE_S` have passed since a read last left any, then released.

    Each read wrote its blobs into buffers of its own, released when it returned: the next read's
    buffers were fresh memory again, each page faulted in and zeroed by the kernel (a MiniLM pull
    from SeaweedFS took 18 fresh 4 MiB buffers, ~75 MB, for 51 GETs). A process often reads again
    soon after (a load after a pull, a reader's next tensor, an evaluation's next model): the buffers
    the last read left serve it. At most as many are kept as the read that left them kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[int, list[memoryview]] = {}  # by buffer size
        self._left = 0.0  # when a read last left buffers (time.monotonic)
        self._timer: threading.Timer | None = None  # releases them once idle

    def take(self, size: int) -> list[memoryview]:
        """For a read starting: the buffers of ``size`` bytes kept (none if another read took them)."""
        with self._lock:
            return self._kept.pop(size, [])

    def leave(self, size: int, bufs: list[memoryview], keep: int) -> None:
        """For a read that ended: its unused buffers ``bufs`` of ``size`` bytes, kept (at most ``keep``
        of that size) for the next read."""
        with self._lock:
            kept = self._kept.setdefault(size, [])
            kept += bufs[: max(0, keep - len(kept))]
            self._left = time.monotonic()
            if self._timer is None:
                self._arm(SPARE_IDLE_S)

    def _arm(self, seconds: float) -> None:
        timer = self._timer = threading.Timer(seconds, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        with self._lock:
            idle = time.monotonic() - self._left
            if idle < SPARE_IDLE_S:
                self._arm(SPARE_IDLE_S - idle)  # (one timer a period, not one per read)
            else:
                self._kept.clear()
                self._timer = None

    def kept(self) -> int:
        """How many buffers are kept now."""
        with self._lock:
            return sum(len(v) for v in self._kept.values())

    def _forget(self) -> None:
        """In a forked child: no timer thread there to release them, so none are kept."""
        self._lock = threading.Lock()
        self._kept = {}
        self._timer = None


SPARES = SpareBuffers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=SPARES._forget)
