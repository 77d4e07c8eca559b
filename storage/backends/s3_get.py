"""GETs signed and sent as botocore sends them, without botocore's per-request machinery.

Every ``client.get_object`` costs ~1.9 ms of client CPU before a byte of body moves:
parameter validation, endpoint rules, a dozen event hooks, response parsing. A pull or a
load of a model with many small tensors makes a GET per chunk (118 for the 91 MB MiniLM
file), so on a fast server that overhead is a large part of the client's CPU. Measured on
SeaweedFS on loopback, 200 GETs of 200 KB one after the other: 1.9 ms of CPU per GET
through the client, 0.6 ms signed and sent this way.

How a GET stays what botocore would send: it is learned from botocore.

* The first GET of a backend goes through the client. A hook on its outgoing request
  records the URL (endpoint, addressing style, bucket, after any redirect botocore
  followed) and the scope of its SigV4 signature (region, service). It is kept only once
  the client's call succeeded, and only if the request is one this module reproduces
  exactly: the key last in the path, no query, a SigV4 signature or none, no header
  beyond those listed in ``_KNOWN`` (a checksum mode, SSE-C keys, or a header added by a
  user's hook switch it off).
* Later GETs put their key into that URL, quoted as botocore quotes it, are signed by
  botocore's own ``S3SigV4Auth`` with the client's current credentials (refreshable ones
  refresh as they do for the client), and go out through the client's own HTTP session:
  the same connection pool, timeouts, proxies, TLS settings and exceptions.
* A busy or failing server (5xx, 429: SlowDown) raises botocore's ``ClientError``, which
  the retry layer repeats with backoff. Any other answer but 200/206 (or 416, a range
  past the end) is asked again through the client, which raises its usual errors and
  follows redirects; if the client then succeeds where the direct GET did not, direct
  GETs are switched off for the backend.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

log = logging.getLogger(__name__)

# Headers of a learned GetObject request that this module reproduces (signature and
# request metadata); a request with any other header is not learned.
_KNOWN = {"host", "user-agent", "x-amz-date", "x-amz-content-sha256", "authorization", "x-amz-security-token",
          "amz-sdk-invocation-id", "amz-sdk-request", "range", "content-length", "accept-encoding", "connection",
          "expect"}
_ALGORITHM = "AWS4-HMAC-SHA256"
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")


class DirectGet:
    """GETs of ``client``'s objects without the client, once one GET taught it how (see the module)."""

    def __init__(self, client: Any) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.response import StreamingBody
        from botocore.utils import percent_encode

        self._auth, self._request, self._body, self._quote = S3SigV4Auth, AWSRequest, StreamingBody, percent_encode
        self._http = client._endpoint.http_session  # AttributeError: this botocore is not one we know
        self._signer = client._request_signer
        self._seen = threading.local()  # per thread: the key asked of the client, and its last outgoing request
        self.prefix: str | None = None  # the URL of a GET without its quoted key
        self.scope: tuple[str, str] | None = None  # (region, service) of the signature; None: unsigned
        self.user_agent = ""
        self.on = True
        self.sent = 0  # GETs sent directly (tests and benchmarks read it)
        client.meta.events.register("before-send.s3.GetObject", self._record)

    # -- learning from the client -------------------------------------------------
    def expect(self, key: str) -> None:
        """The calling thread is about to GET ``key`` through the client."""
        self._seen.key, self._seen.request = key, None

    def learned(self) -> None:
        """The calling thread's GET through the client succeeded: learn from its last request."""
        request, key = getattr(self._seen, "request", None), getattr(self._seen, "key", None)
        self._seen.key = self._seen.request = None
        if request is None or key is None or self.prefix is not None or not self.on:
            return
        url = request.url
        quoted = self._quote(key, safe="/~")
        headers = {k.lower(): (v.decode() if isinstance(v, bytes) else str(v)) for k, v in request.headers.items()}
        if "?" in url or not url.endswith("/" + quoted) or set(headers) - _KNOWN:
            self._off(f"a GET this module does not reproduce: {url.split('?')[0]} {sorted(set(headers) - _KNOWN)}")
            return
        auth = headers.get("authorization")
        if auth is not None:
            parts = auth.split("Credential=", 1)
            scope = parts[1].split(",", 1)[0].split("/") if len(parts) == 2 else []
            if not auth.startswith(_ALGORITHM + " ") or len(scope) != 5 or self._signer._credentials is None:
                self._off("the client signs GETs in a way this module does not")
                return
            self.scope = (scope[2], scope[3])
        self.user_agent = headers.get("user-agent", "")
        self.prefix = url[: len(url) - len(quoted)]

    def _record(self, request: Any, **_: Any) -> None:
        if getattr(self._seen, "key", None) is not None:
            self._seen.request = request  # the last one wins: botocore may redirect and send again
        # (and return None: anything else would be taken as the response)

    def _off(self, why: str) -> None:
        if self.on:
            log.debug("direct S3 GETs off: %s", why)
        self.on = False

    # -- sending --------------------------------------------------------------
    def ready(self) -> bool:
        return self.on and self.prefix is not None

    def get(self, key: str, range_header: str | None) -> Any:
        """Send a GET of ``key``: botocore's ``AWSResponse`` (``status_code``, ``headers``, ``raw``), its body unread."""
        headers = {"User-Agent": self.user_agent}
        if range_header:
            headers["Range"] = range_header
        request = self._request(method="GET", url=self.prefix + self._quote(key, safe="/~"), headers=headers,
                                stream_output=True)
        if self.scope is not None:
            region, service = self.scope
            self._auth(self._signer._credentials.get_frozen_credentials(), service, region).add_auth(request)
        self.sent += 1
        return self._http.send(request.prepare())

    def body(self, response: Any, length: int) -> Any:
        """The response's body as botocore hands it out (a ``StreamingBody``)."""
        return self._body(response.raw, length)

    def refused(self, response: Any) -> None:
        """An error answer: a busy or failing server (5xx, 429) raises botocore's ClientError
        for it, which the retry layer repeats (directly again); any other returns, to be
        asked again through the client."""
        status = response.status_code
        if status < 500 and status != 429:
            response.raw.close()
            return
        try:
            text = response.raw.read(64 * 1024).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - the code is a detail; the status decides
            text = ""
        finally:
            response.raw.close()
        code = _CODE.search(text)
        from botocore.exceptions import ClientError

        raise ClientError({"Error": {"Code": code.group(1) if code else str(status), "Message": f"HTTP {status}"},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    def failed(self, client_succeeded: bool) -> None:
        """A direct GET was answered with an error; the client, asked the same, succeeded or not."""
        if client_succeeded:
            self._off("the server refused a direct GET that it answered through the client")
