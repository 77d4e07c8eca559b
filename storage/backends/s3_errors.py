"""How S3 failures are classified: what is worth retrying, what a 412 means, which strings are secrets.

Kept apart from ``storage/backends/s3.py`` so the rules can be read (and tested) on their own.
botocore, urllib3 and aiohttp are imported lazily: ``storage`` must import without them installed.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from typing import Any

from ckpt_store.storage.errors import StorageIOError

# Codes worth retrying (throttling, server-side trouble, a conditional write racing another).
THROTTLE = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
             "TooManyRequestsException", "RequestThrottled", "RequestTimeout", "InternalError",
             "ServiceUnavailable", "XAmzContentSHA256Mismatch", "ConditionalRequestConflict", "OperationAborted"}
# Codes that mean the credentials or the signature are wrong: never retried.
ACCESS = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
          "AccountProblem", "AllAccessDisabled", "RequestTimeTooSkewed", "InvalidSecurity"}
SECRET_OPTIONS = ("key", "secret", "token", "username", "password",
                  "aws_access_key_id", "aws_secret_access_key", "aws_session_token")
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def chain(e: BaseException | None) -> Iterator[BaseException]:
    seen = 0
    while e is not None and seen < 8:
        yield e
        e = e.__cause__ or e.__context__
        seen += 1


def client_error(e: BaseException) -> tuple[str, int] | None:
    """(error code, HTTP status) of the botocore ClientError behind ``e``, if any."""
    for x in chain(e):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict) and "Error" in resp:
            code = str(resp.get("Error", {}).get("Code", ""))
            status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or (code if code.isascii() and code.isdigit() else 0))
            return code, status
    return None


def is_precondition_failed(e: BaseException) -> bool:
    """A conditional write refused because the object exists (HTTP 412).

    s3fs turns a 412 into ``FileExistsError`` only when the server names the condition
    (moto does); SeaweedFS and others give ``OSError(EINVAL)`` caused by a ClientError
    with code ``PreconditionFailed``.
    """
    if isinstance(e, FileExistsError):
        return True
    ce = client_error(e)
    return ce is not None and (ce[0] == "PreconditionFailed" or ce[1] == 412)


def transient(e: BaseException) -> str | None:
    """A short reason if repeating the request may succeed (throttling, 5xx, network), else None."""
    if isinstance(e, (StorageIOError, FileNotFoundError, FileExistsError)):
        return None
    ce = client_error(e)
    if ce is not None:
        code, status = ce
        if status >= 500 or status == 429 or code in THROTTLE:
            return f"HTTP {status} {code}".strip()
        return None
    try:
        import botocore.exceptions as be

        boto_net: tuple[type[BaseException], ...] = (be.HTTPClientError, be.ConnectionError, be.IncompleteReadError)
    except ImportError:  # pragma: no cover
        boto_net = ()
    try:
        import aiohttp

        aio_net: tuple[type[BaseException], ...] = (aiohttp.ClientError,)
    except ImportError:  # pragma: no cover
        aio_net = ()
    try:
        import urllib3.exceptions as ue

        url_net: tuple[type[BaseException], ...] = (ue.HTTPError,)
    except ImportError:  # pragma: no cover
        url_net = ()
    for x in chain(e):
        if url_net and isinstance(x, url_net):
            return type(x).__name__
        if (boto_net and isinstance(x, boto_net)) or (aio_net and isinstance(x, aio_net)):
            detail = str(x).strip()
            return f"{type(x).__name__}: {detail}" if detail else type(x).__name__
        if isinstance(x, (asyncio.TimeoutError, TimeoutError, socket.timeout)) or type(x).__name__ == "FSTimeoutError":
            return "timeout"
        if isinstance(x, ConnectionError):
            return f"{type(x).__name__}"
    return None


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a wait that ran out (connect or read timeout): the server answered nothing."""
    return any(isinstance(x, (asyncio.TimeoutError, TimeoutError, socket.timeout)) or "Timeout" in type(x).__name__
               for x in chain(e))


def secrets_in(opts: Any) -> set[str]:
    """Every credential value in ``storage_options`` (also nested, e.g. in ``client_kwargs``)."""
    out: set[str] = set()
    if isinstance(opts, dict):
        for k, v in opts.items():
            if isinstance(v, str) and k in SECRET_OPTIONS and len(v) >= 4:
                out.add(v)
            elif isinstance(v, dict):
                out |= secrets_in(v)
    return out


def secrets_in_env() -> set[str]:
    return {v for k in SECRET_ENV if len(v := os.environ.get(k, "")) >= 4}


__all__ = ["chain", "client_error", "is_precondition_failed", "secrets_in", "secrets_in_env", "transient"]
