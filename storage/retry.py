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

    def delay(self, retry: int) -> float:
        """Sleep before retry number ``retry`` (1 = the first retry)."""
        return random.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (retry - 1)))


NO_RETRY = RetryPolicy(attempts=1)


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

    When the attempts run out, raises a retryable :class:`StorageIOError` that says what
    failed, how often, and the last reason.
    """
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
            took = time.monotonic() - began
            level = logging.WARNING if took >= SLOW_ATTEMPT_S else logging.INFO
            log.log(level, "%s: %s after %.1f s; retry %d of %d in %.2f s", what, reason, took, attempt,
                    policy.attempts - 1, wait)
            sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


__all__ = ["NO_RETRY", "RetryPolicy", "call_with_retries"]
