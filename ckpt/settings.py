"""Every tunable in one place, each overridable by a ``CKPT_*`` environment variable."""

from __future__ import annotations

import math
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
    # Remote stores: seconds a request may go without progress (an answer, body bytes), across
    # its retries: a server that accepts connections and never answers fails after this long,
    # not after retries x the read timeout; a slow transfer that moves on is never cut by it.
    request_deadline: float = 60.0
    # Remote stores: exclusive creates (ref entries) use If-None-Match. Turn off only for
    # a server that lacks it; then one writer per ref is required (docs/format.md).
    conditional_writes: bool = True
    # Remote stores (S3): GETs, HEADs, chunk PUTs and LISTs after the first of each are signed and
    # sent without botocore's per-request machinery (storage/backends/s3_direct.py). Off:
    # every request through botocore (for a server that misbehaves with them; benchmarks).
    s3_direct: bool = True
    # Remote stores: bytes of chunks fetched but not yet decoded, at most (with the
    # request window of transfer_concurrency x 2): bounds the memory of a pull or load.
    inflight_mb: int = 256
    # Remote stores: keep fetched chunk blobs in a local cache (storage/cache.py) at
    # cache_dir ("" = $CKPT_CACHE_DIR or ~/.cache/ckpt), at most cache_mb in all.
    cache: bool = True
    cache_dir: str = ""
    cache_mb: int = 20480
    # Keep the metadata index (storage/index.py): push, ls, du and gc then read a few
    # objects instead of every ref and manifest. Off: they read the refs and manifests.
    index: bool = True

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Defaults, then ``CKPT_<FIELD>`` environment variables, then ``overrides``.

        Raises :class:`ckpt.errors.ConfigError` (a ``ValueError`` too) naming the variable
        (or the keyword) whose value does not parse or is out of range: a typo in the
        environment is one line, never a traceback or a silently ignored setting.

        >>> Settings.from_env(workers=3).workers
        3
        """
        from ckpt.errors import ConfigError

        env: dict[str, object] = {}
        origin: dict[str, str] = {}
        for f in fields(cls):
            var = f"CKPT_{f.name.upper()}"
            raw = os.environ.get(var)
            if raw is None:
                continue
            origin[f.name] = var
            env[f.name] = _parse(var, raw, f.type)
        for name in overrides:
            origin[name] = name
        try:
            s = replace(cls(), **{**env, **overrides})
        except TypeError as e:  # an unknown keyword
            raise ConfigError(f"unknown setting: {e}") from None
        types = {f.name: f.type for f in fields(cls)}
        for name, (lo, hi) in _bounds(s).items():
            v, kind = getattr(s, name), types[name]
            ok = isinstance(v, int) if kind == "int" else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok or v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
                raise ConfigError(f"{origin.get(name, name)}={v!r}: {name} must be {_range_text(kind, lo, hi)}")
        return s


def _parse(var: str, raw: str, typ: object) -> object:
    """One environment value of a field of type ``typ``, or a ConfigError naming ``var``."""
    from ckpt.errors import ConfigError

    if typ in ("str", str):
        return raw
    text = raw.strip().lower()
    if typ in ("bool", bool):
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{var}={raw!r} is not a boolean", hint="use 1/0, true/false, yes/no or on/off")
    try:
        value: object = float(text) if typ in ("float", float) else int(text)
    except ValueError:
        what = "a number" if typ in ("float", float) else "a whole number"
        raise ConfigError(f"{var}={raw!r} is not {what}", hint=f"unset it or set e.g. {var}={_example(var)}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{var}={raw!r} is not a finite number")
    return value


def _example(var: str) -> str:
    default = getattr(Settings, var[len("CKPT_"):].lower())
    return str(default)


def _bounds(s: Settings) -> dict[str, tuple[float | None, float | None]]:
    """Allowed range of each numeric setting (inclusive; None: unbounded)."""
    return {
        "max_chunk_size": (MiB // 16, None),
        "chunk_size": (MiB // 16, s.max_chunk_size),
        "workers": (1, None),
        "io_workers": (1, None),
        "transfer_concurrency": (1, None),
        "zstd_level": (-(1 << 17), 22),  # zstd's own limits (negative levels are its fast modes)
        "max_delta_depth": (0, None),
        "min_saving": (0.0, 1.0),
        "base_cache_mb": (0, None),
        "retries": (0, None),
        "retry_delay": (0.0, None),
        "request_deadline": (0.1, None),
        "inflight_mb": (1, None),
        "cache_mb": (0, None),
    }


def _range_text(kind: str, lo: float | None, hi: float | None) -> str:
    noun = "a whole number" if kind == "int" else "a number"
    if lo is not None and hi is not None:
        return f"{noun} from {lo} to {hi}"
    return f"{noun} of at least {lo}" if lo is not None else f"{noun} of at most {hi}"
