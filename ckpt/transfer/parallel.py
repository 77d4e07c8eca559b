"""Running many items on a thread pool (:func:`run_parallel`), consecutive small ones handed to a
thread together (:data:`BATCH_BYTES`): how push, pull, diff and verify spread their chunks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from ckpt.progress import Progress

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int, progress: Progress, weight: Callable[[T], int],
                 batch: int = 0) -> list[R]:
    """``[fn(x) for x in items]`` on a thread pool; the first error cancels the rest and is raised.

    ``batch``: consecutive items are handed to a thread together while their weights add
    up to at most this (an item heavier than that goes alone), so that many small items
    (a model's biases and norms, a chunk each) do not each pay for a hand-off between
    threads (about 80 us each here: a tenth of the time of loading a MiniLM fine-tune).
    """
    if not items:
        return []
    lock = threading.Lock()
    weights = [weight(x) for x in items]
    groups: list[range] = []
    start, total = 0, 0
    for i, w in enumerate(weights):
        if i > start and total + w > batch:
            groups.append(range(start, i))
            start, total = i, 0
        total += w
    groups.append(range(start, len(items)))

    def run(group: range) -> list[R]:
        out = []
        for i in group:
            out.append(fn(items[i]))
            with lock:
                progress.advance(weights[i])
        return out

    if len(groups) == 1 and sum(weights) <= BATCH_BYTES:
        # Little work for one thread: run here. A pool per call started and joined a thread each time
        # (a diff of 10,000 small tensors calls this three times per tensor: most of its time). (Not
        # more work: the chunk-sized buffers of thread_buffer would stay with the calling thread.)
        return run(groups[0])
    with ThreadPoolExecutor(max_workers=min(workers, len(groups)), thread_name_prefix="ckpt") as pool:
        try:
            futures: list[Future[list[R]]] = [pool.submit(run, g) for g in groups]
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            return [r for f in futures for r in f.result()]
        finally:
            # The first error, or Ctrl-C (SIGTERM) in this thread, starts no further group: the
            # running ones end, the rest are dropped (leaving the ``with`` alone ran every one).
            pool.shutdown(wait=True, cancel_futures=True)


# Items handed to a worker thread at once by push and pull: up to this many bytes of
# consecutive small chunks (a 4 MiB chunk goes alone).
BATCH_BYTES = 1 << 20
