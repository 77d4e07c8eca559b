"""The parallel part of push and pull: hash, encode and write chunks; fetch, decode, verify.

Hashing (blake3), zstd and file I/O release the GIL, so a thread pool of
``Settings.workers`` threads uses every core. Each task reads its own bytes
when it runs, so memory in flight stays at about ``workers`` chunks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

from ckpt.codecs import decode_chunk, encode_chunk
from ckpt.progress import NullProgress, Progress
from ckpt.settings import Settings
from storage.objects import ObjectStore, object_id

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int, progress: Progress, weight: Callable[[T], int]) -> list[R]:
    """``[fn(x) for x in items]`` on a thread pool; the first error cancels the rest and is raised."""
    if not items:
        return []
    lock = threading.Lock()

    def run(x: T) -> R:
        r = fn(x)
        with lock:
            progress.advance(weight(x))
        return r

    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="ckpt") as pool:
        futures: list[Future[R]] = [pool.submit(run, x) for x in items]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


@dataclass(frozen=True)
class PutTask:
    read: Callable[[], bytes | memoryview]
    length: int
    elem: int = 1


@dataclass(frozen=True)
class PutResult:
    id: str
    length: int
    stored: int  # bytes written now (0 when the chunk was already there)


def put_chunks(objects: ObjectStore, tasks: Sequence[PutTask], settings: Settings, progress: Progress | None = None) -> list[PutResult]:
    """Hash every chunk, and encode and write those the store lacks. Returns ids in task order."""

    def put(task: PutTask) -> PutResult:
        data = task.read()
        oid = object_id(data)
        path = objects.path("chunks", oid)
        if objects.backend.exists(path):
            objects.backend.touch(path)  # keeps a concurrent gc off it (docs/format.md)
            return PutResult(oid, task.length, 0)
        blob = encode_chunk(data, level=settings.zstd_level, min_saving=settings.min_saving, elem=task.elem)
        objects.backend.write(path, blob)
        return PutResult(oid, task.length, len(blob))

    return run_parallel(put, tasks, settings.workers, progress or NullProgress(), lambda t: t.length)


@dataclass(frozen=True)
class GetTask:
    id: str
    length: int
    sink: Callable[[bytes], None]  # receives the verified decoded bytes


def get_chunks(objects: ObjectStore, tasks: Iterable[GetTask], settings: Settings, progress: Progress | None = None) -> None:
    """Fetch, decode and verify chunks in parallel, handing each one's bytes to its sink."""

    def get(task: GetTask) -> None:
        blob = objects.get("chunks", task.id)
        task.sink(decode_chunk(blob, task.id, task.length, max_length=settings.max_chunk_size))

    run_parallel(get, list(tasks), settings.workers, progress or NullProgress(), lambda t: t.length)
