"""The parallel part of push and pull: hash, encode and write chunks; fetch, decode, verify.

Hashing (blake3), zstd and file I/O release the GIL, so a thread pool of
``Settings.workers`` threads uses every core. Each task reads its own bytes
when it runs, so memory in flight stays at about ``workers`` chunks.

The parts, each in a module of its own, all named here as before: the thread pool
(parallel.py), the decoded-base cache (base_cache.py), one chunk read, decoded through
its delta chain and verified (fetch.py), the write side (writing.py: ``put_chunks``) and
the read side (reading.py: ``get_chunks``, bundles, ``ReadPool``).
"""

from __future__ import annotations

from ckpt.transfer.base_cache import ChunkCache, base_cache
from ckpt.transfer.fetch import MAX_CHAIN, BlobBuffers, fetch_base, fetch_chunk, stored_chain
from ckpt.transfer.parallel import BATCH_BYTES, run_parallel
from ckpt.transfer.reading import (
    BUNDLE_CHUNK_MAX,
    BUNDLE_SHARE,
    BundleBases,
    GetStats,
    GetTask,
    ReadPool,
    get_chunks,
    into_tasks,
    readable_bundles,
    sink_tasks,
    spans,
)
from ckpt.transfer.writing import PutResult, PutTask, Recorded, put_chunks, put_tasks, rewrite_whole

__all__ = [
    "BATCH_BYTES", "BUNDLE_CHUNK_MAX", "BUNDLE_SHARE", "MAX_CHAIN", "BlobBuffers", "BundleBases", "ChunkCache", "GetStats",
    "GetTask", "PutResult", "PutTask", "ReadPool", "Recorded", "base_cache", "fetch_base", "fetch_chunk", "get_chunks", "into_tasks",
    "put_chunks", "put_tasks", "readable_bundles", "rewrite_whole", "run_parallel", "sink_tasks", "spans", "stored_chain",
]
