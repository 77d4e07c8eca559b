"""Every tunable in one place, each overridable by a ``CKPT_*`` environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

MiB = 1024 * 1024


def _default_workers() -> int:
    return max(2, os.cpu_count() or 2)


@dataclass(frozen=True)
class Settings:
    """Tunables. ``Settings.from_env()`` applies ``CKPT_CHUNK_SIZE``, ``CKPT_WORKERS``... overrides."""

    # 4 MiB, from benchmarks/results/push_pull.md (1 GB checkpoint, 2 cores): push
    # 257 / 512 / 645 MB/s and pull 634 / 686 / 657 MB/s at 1 / 4 / 16 MiB. 4 MiB
    # gets most of the throughput while a partly changed tensor still dedups and
    # delta-codes in small pieces, and it bounds memory in flight (a few chunks per worker).
    chunk_size: int = 4 * MiB
    workers: int = _default_workers()
    # Concurrent object writes and reads: each durable write waits on fsync and each
    # read from a cold cache on the disk, so more in flight than cores keeps the disk
    # busy while the cores encode or decode (each holds at most one chunk). Reads run
    # this far ahead of the decoding threads (`workers` of them): a local store is asked
    # to prefetch the next 2 x io_workers chunks, a remote one reads them on io_workers
    # threads (pipeline.get_chunks).
    io_workers: int = 8
    # zstd level for every stream. 1 and 3 gave the same ratio on weights here
    # (shared/notes/measurements.md) and 1 is ~1.6x faster.
    zstd_level: int = 1
    # Longest delta chain a writer creates; a chunk whose base is already this
    # deep is stored whole (a keyframe). Bounds the work of every read.
    max_delta_depth: int = 2  # benchmarks/results/delta_depth.md: 0.89 of depth 0's bytes, restore no slower; 4 saved 3% more at 2x the restore
    # Keep the compressed form only if it saves at least this fraction: a chunk
    # that compresses by 1% costs a decompression on every read for nothing.
    min_saving: float = 0.02
    fsync: bool = True
    # Decoded base chunks kept per open store (LRU), so that the chunks of one base are
    # decoded once, not once per fine-tune that deltas against them: loading or merging
    # a family, diffing two fine-tunes, pushing fine-tune after fine-tune. 0: off.
    base_cache_mb: int = 256
    # Largest decoded chunk a reader accepts (guards against decompression bombs).
    max_chunk_size: int = 256 * MiB
    # Remote stores (S3): requests in flight at once -- uploads, downloads, existence
    # checks, copies. Object stores are latency-bound, so this is well above the core
    # count; each request holds at most one chunk in memory.
    transfer_concurrency: int = 16
    # Remote stores: attempts per request after the first, on throttling, 5xx and
    # dropped connections, with exponential backoff from retry_delay seconds (full jitter).
    retries: int = 5
    retry_delay: float = 0.2
    # Remote stores: exclusive creates (ref entries) use If-None-Match. Turn off only for
    # a server that lacks it; then one writer per ref is required (docs/format.md).
    conditional_writes: bool = True
    # Keep the metadata index (storage/index.py): push, ls, du and gc then read a few
    # objects instead of every ref and manifest. Off: they read the refs and manifests.
    index: bool = True

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        s = cls()
        env: dict[str, object] = {}
        for f in fields(cls):
            raw = os.environ.get(f"CKPT_{f.name.upper()}")
            if raw is None:
                continue
            if f.type in ("bool", bool):
                env[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif f.type in ("float", float):
                env[f.name] = float(raw)
            else:
                env[f.name] = int(raw)
        s = replace(s, **env, **overrides)
        if not MiB // 16 <= s.chunk_size <= s.max_chunk_size:
            raise ValueError(f"chunk_size must be between 64 KiB and {s.max_chunk_size} bytes")
        if s.workers < 1 or s.io_workers < 1 or s.transfer_concurrency < 1:
            raise ValueError("workers, io_workers and transfer_concurrency must be at least 1")
        if s.retries < 0 or s.retry_delay < 0 or s.base_cache_mb < 0:
            raise ValueError("retries, retry_delay and base_cache_mb must not be negative")
        return s
