"""Running many items on a thread pool (:func:`run_parallel`), consecutive small ones handed to a
thread together (:data:`BATCH_BYTES`): how push, pull, diff and verify spread their chunks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ckpt.progress import Progress

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int, progress: Progress, weight: Callable[[T], int],
                 batch: int = 0, on_stop: Callable[[], None] | None = None) -> list[R]:
    """``[fn(x) for x in items]`` on a thread pool; the first error (or Ctrl-C) cancels the rest and is raised.

    ``batch``: consecutive items are handed to a thread together while their weights add
    up to at most this (an item heavier than that goes alone), so that many small items
    (a model's biases and norms, a chunk each) do not each pay for a hand-off between
    threads (about 80 us each here: a tenth of the time of loading a MiniLM fine-tune).
    ``on_stop``: called when the run stops early, before it waits for the items under way:
    to drop the work those items handed on (a push's queued writes: :func:`~ckpt.transfer.writing.put_chunks`).
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

    stopped = threading.Event()  # the run ends early: a group under way takes no further item

    def run(group: range) -> list[R]:
        out = []
        for i in group:
            if stopped.is_set():
                break  # (what it returns then is never read)
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
            return [r for rs in results_of(futures) for r in rs]
        except BaseException:
            # The first error, or Ctrl-C (SIGTERM) in this thread, starts no further item: the groups
            # queued are dropped (leaving the ``with`` alone ran every one), those under way end with
            # their current item (a group of small chunks went on to its last), and so does the work
            # they handed on, at once (a push's queued writes had gone on after Ctrl-C).
            stopped.set()
            pool.shutdown(wait=False, cancel_futures=True)
            if on_stop is not None:
                on_stop()
            raise  # (leaving the ``with`` waits for the items under way)


def results_of(futures: Sequence[Future[R]]) -> list[R]:
    """The futures' results in order, once every one is done; the first error (in order, of those
    failed by then) as soon as one fails, without waiting for the rest.

    The calling thread wakes every :data:`WAKE_S` while it waits, so that a signal (Ctrl-C,
    SIGTERM) is acted on within that time whichever thread took it: Python runs the handler in
    the main thread only, once that thread runs. The kernel hands a signal sent to the process
    to the main thread, unless another thread unblocks signals before that one is scheduled:
    every thread starting a thread does (glibc blocks them around the clone), as a pool's do
    with their first items. The main thread, asleep on a lock until every item was done
    (``concurrent.futures.wait``), then raised KeyboardInterrupt at the end: a push interrupted
    at its first chunk wrote all 129 (1 run in 30 here; 4 in 20 beside 2 busy loops).
    """
    if not futures:
        return []
    settled = threading.Event()
    lock = threading.Lock()
    left = len(futures)

    def done(f: Future[R]) -> None:
        nonlocal left
        with lock:
            left -= 1
            if not left or (not f.cancelled() and f.exception() is not None):
                settled.set()

    for f in futures:
        f.add_done_callback(done)
    while not settled.wait(WAKE_S):  # (an Event's wait is safe to interrupt: it leaves no lock held)
        pass
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


# How long a thread waiting for workers sleeps at a time (:func:`results_of`): how late a Ctrl-C
# may be acted on at most, when a thread other than the main one took it. A wake costs microseconds.
WAKE_S = 0.05

# Items handed to a worker thread at once by push and pull: up to this many bytes of
# consecutive small chunks (a 4 MiB chunk goes alone).
BATCH_BYTES = 1 << 20
