"""What the chunk codecs work in: this thread's zstd contexts and reusable scratch buffers,
uninitialised buffers, and blobs kept in pieces (:data:`Parts`).

zstandard contexts must not be shared between threads, and fresh memory costs page faults, so
each thread keeps its own (released with the thread)."""

from __future__ import annotations

import threading

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
