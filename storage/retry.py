"""Retries with exponential backoff for remote stores: one layer, owned here.

Object-store clients retry on their own (botocore and s3fs each have a loop, see
``storage/backends/s3.py``); the S3 backend turns both off and retries *whole operations*
here instead, so that the number of attempts, the delays and the final error are
known and tested. Every operation the store issues is safe to repeat: objects are
immutable and named by their content, and an exclusive create that is repeated
after its first attempt landed is recognised by reading the object back.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ckpt_store.storage.errors import StorageIOError

log = logging.getLogger(__name__)
T = TypeVar("T")

# A failed attempt that took this long is retried with a warning, not a debug note: whoever waits
# (a command that seems to hang on a server that stopped answering) learns why, and what comes.
SLOW_ATTEMPT_S = 10.0


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; before try *k* (k >= 2) sleep a random time up to
    ``min(max_delay, base_delay * 2**(k-2))`` ("full jitter", so that many clients
    throttled at once do not come back in step)."""

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 10.0
    # Seconds a request may spend in attempts that get nothing from the server (and the waits
    # between them), across its retries (None: no limit): a server that accepts connections and
    # never answers fails after about this long, not after attempts x the read timeout. An attempt
    # that made progress (:func:`progressed`) starts the count again, so a transfer that moved on
    # before it broke is retried as before, whatever its size.
    deadline: float | None = None

    def delay(self, retry: int) -> float:
        """Sleep before retry number ``retry`` (1 = the first retry)."""
        # (doublings capped: 2**1024 is no float, and far fewer reach any max_delay; too large a
        # product is inf, which min() turns into max_delay)
        return random.uniform(0.0, min(self.max_delay, self.base_delay * 2.0 ** min(retry - 1, 1000)))


NO_RETRY = RetryPolicy(attempts=1)

_progress = threading.local()


def progressed() -> None:
    """Note that the request under way in this thread made progress (the server answered, or sent
    or took part of a body): its attempt does not count towards :attr:`RetryPolicy.deadline`."""
    _progress.at = time.monotonic()


def call_with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    transient: Callable[[BaseException], str | None],
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()``, repeated while it fails with an error ``transient`` names (it returns a short
    reason such as ``"connection reset"``, or None for an error that repeating cannot fix,
    which propagates at once).

    When the attempts run out, or the policy's deadline passes without progress, raises a
    retryable :class:`StorageIOError` that says what failed, how often, and the last reason.
    """
    quiet = 0.0  # seconds in attempts without progress since the last one with some, and waits
    for attempt in range(1, policy.attempts + 1):
        began = time.monotonic()
        try:
            return fn()
        except Exception as e:
            reason = transient(e)
            if reason is None:
                raise
            if attempt == policy.attempts:
                raise StorageIOError(
                    f"{what} failed {attempt} times; last error: {reason}",
                    retryable=True,
                    hint="the store is unreachable or overloaded; check the endpoint and network, then retry",
                ) from None
            wait = policy.delay(attempt)
            now = time.monotonic()
            took = now - began
            quiet = 0.0 if getattr(_progress, "at", began) > began else quiet + took
            if policy.deadline is not None and quiet + wait >= policy.deadline:
                raise StorageIOError(
                    f"{what} failed: no answer in {quiet:.0f} s ({attempt} attempt{'s' if attempt > 1 else ''}); "
                    f"last error: {reason}",
                    retryable=True,
                    hint="the store does not answer: check the endpoint and network, then retry; "
                         f"CKPT_REQUEST_DEADLINE (now {policy.deadline:g} s) is how long a request may wait",
                ) from None
            level = logging.WARNING if took >= SLOW_ATTEMPT_S else logging.INFO
            log.log(level, "%s: %s after %.1f s; retry %d of %d in %.2f s", what, reason, took, attempt,
                    policy.attempts - 1, wait)
            sleep(wait)
            quiet += wait
    raise AssertionError("unreachable")  # pragma: no cover


__all__ = ["NO_RETRY", "RetryPolicy", "call_with_retries", "progressed"]
