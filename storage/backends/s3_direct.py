"""GETs, HEADs, PUTs and LISTs signed and sent as botocore sends them, without botocore's per-request machinery.

Every botocore call costs client CPU before a byte of body moves: parameter validation,
endpoint rules, a dozen event hooks, response parsing. For a GET that is ~1.9 ms, and a
pull or load of a model with many small tensors makes a GET per chunk (118 for the 91 MB
MiniLM file); a push makes a PUT per new chunk, and into a large store a HEAD per chunk to
learn which it lacks. For a LIST it is ~0.13 ms per key listed,
nearly all of it botocore's timestamp parsing, and ``du``, ``gc`` and ``verify`` list every
object of the store. A conditional create (``If-None-Match: *``: a new chunk, a ref entry)
is a PUT with that header, its 412 an answer like a HEAD's 404. Multipart uploads always go
through botocore: they are few, and their upload ids are botocore's to read.
Measured on SeaweedFS on loopback: 200 GETs of 200 KB one after the other, 1.9 ms of CPU
per GET through the client and 0.6 ms sent here; 300 HEADs of missing objects, 1.3-1.5 ms
each through the client and 0.7 ms here; a listing of 2,500 keys, 0.33 s of CPU through
the client and 0.03 s here (``benchmarks/results/s3.md`` and ``metadata.md`` have the
effect on whole commands).

How a request stays what botocore would send: it is learned from botocore.

* The first GET (HEAD, PUT, LIST) of a backend goes through the client. A hook on its
  outgoing request records its URL (endpoint, addressing style, bucket, after any
  redirect botocore followed) and the scope of its SigV4 signature (region, service).
  It is kept only once the client's call succeeded, and only if the request is one this
  module reproduces exactly: the key last in the path and no query (GET, HEAD, PUT), a LIST's query
  its own (``list-type=2``), a SigV4 signature or none, and no header beyond those in
  ``_KNOWN`` (a checksum mode, SSE-C keys, or a header added by a user's hook switch
  direct requests off).
* Later requests put their key into that URL (or their parameters into the query),
  quoted as botocore quotes them, are signed by botocore's own ``S3SigV4Auth`` (a PUT's
  payload hashed into the signature as botocore hashes it) with the
  client's current credentials (refreshable ones refresh as they do for the client), and
  go out through the client's own HTTP session: the same connection pool, timeouts,
  proxies, TLS settings and exceptions. A LIST's XML is read here (:func:`parse_list`),
  into the dict botocore would have returned.
* A busy or failing server (5xx, 429: SlowDown) raises botocore's ``ClientError``, which
  the retry layer repeats with backoff. A HEAD's 404 is an answer (the object is missing:
  most HEADs ask about chunks a push is about to write). Any other answer but a success
  (or a GET's 416, a range past the end) is asked again through the client, which raises its usual errors
  and follows redirects; if the client then succeeds where the direct request did not,
  direct requests are switched off for the backend.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple, TypeVar
from urllib.parse import quote, unquote_plus
from xml.etree import ElementTree

from ckpt_store.storage.backends.watchdog import allowed, socket_of, watch
from ckpt_store.storage.retry import progressed

log = logging.getLogger(__name__)
T = TypeVar("T")

GET, HEAD, LIST, PUT = "GetObject", "HeadObject", "ListObjectsV2", "PutObject"
# Headers of a learned request that this module reproduces (signature and request
# metadata); a request with any other header is not learned.
_KNOWN = {"host", "user-agent", "x-amz-date", "x-amz-content-sha256", "authorization", "x-amz-security-token",
          "amz-sdk-invocation-id", "amz-sdk-request", "range", "content-length", "accept-encoding", "connection",
          "expect", "if-none-match"}
_METHOD = {GET: "GET", HEAD: "HEAD", LIST: "GET", PUT: "PUT"}
_ALGORITHM = "AWS4-HMAC-SHA256"
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")
# What a LIST answer may hold: one page is at most 1,000 keys (~250 KB of XML).
_MAX_LIST_BYTES = 8 << 20  # a page of 1,000 keys is ~250 KB; parsing costs ~20x its bytes in memory


class _Learned(NamedTuple):
    """What one operation's requests look like: its URL (a GET's without the quoted key, a
    LIST's without the query), the signature's (region, service) or None, the user agent."""

    url: str
    scope: tuple[str, str] | None
    user_agent: str


class DirectRequests:
    """GETs, HEADs, PUTs and LISTs of ``client``'s bucket without the client, once one of each taught it how (see the module)."""

    def __init__(self, client: Any) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.response import StreamingBody
        from botocore.utils import percent_encode

        self._auth, self._request, self._body, self._quote = S3SigV4Auth, AWSRequest, StreamingBody, percent_encode
        # AttributeError on any of these: a botocore whose insides are not the ones known here.
        self._http = client._endpoint.http_session
        self._patience = float(client.meta.config.read_timeout or 60)  # see watchdog.py
        self._signer = client._request_signer
        self._signer._credentials  # noqa: B018 - read when signing
        self._seen = threading.local()  # per thread: the key asked of the client, and its last outgoing request
        self._learned: dict[str, _Learned] = {}
        self._taught: set[str] = set()  # operations :meth:`teach` sent a request of
        self._teaching = threading.Lock()
        self.on = True
        self.sent = {GET: 0, HEAD: 0, LIST: 0, PUT: 0}  # requests sent directly (tests and benchmarks read them)
        for op in (GET, HEAD, LIST, PUT):
            client.meta.events.register(f"before-send.s3.{op}", self._record)

    # -- learning from the client -------------------------------------------------
    def _expect(self, key: str) -> None:
        """The calling thread is about to send a request through the client (of ``key``; LIST: "")."""
        self._seen.key, self._seen.request = key, None

    def _learn(self, op: str) -> None:
        """The calling thread's request through the client succeeded: learn from it."""
        request, key = getattr(self._seen, "request", None), getattr(self._seen, "key", None)
        self._seen.key = self._seen.request = None
        if request is None or key is None or op in self._learned or not self.on:
            return
        url = request.url
        headers = {k.lower(): (v.decode() if isinstance(v, bytes) else str(v)) for k, v in request.headers.items()}
        if op in (GET, HEAD, PUT):
            quoted = self._quote(key, safe="/~")
            shaped = "?" not in url and url.endswith("/" + quoted)
            base = url[: len(url) - len(quoted)]
        else:
            base, _, query = url.partition("?")
            shaped = "list-type=2" in query.split("&")
        shaped = shaped and request.method == _METHOD[op]
        if not shaped or set(headers) - _KNOWN:
            self._off(f"a request this module does not reproduce: {url.split('?')[0]} {sorted(set(headers) - _KNOWN)}")
            return
        auth = headers.get("authorization")
        scope = None
        if auth is not None:
            parts = auth.split("Credential=", 1)
            fields = parts[1].split(",", 1)[0].split("/") if len(parts) == 2 else []
            if not auth.startswith(_ALGORITHM + " ") or len(fields) != 5 or self._signer._credentials is None:
                self._off("the client signs requests in a way this module does not")
                return
            scope = (fields[2], fields[3])
        self._learned[op] = _Learned(base, scope, headers.get("user-agent", ""))

    def teach(self, op: str, client: Callable[[], Any]) -> None:
        """Learn ``op`` from ``client()``, a small request of its kind through the client, where
        nothing taught it yet (once: a refused one stays with the client). A LIST's first page
        through botocore costs ~0.13 ms of CPU per key (~130 ms for 1,000, what ``du`` and ``gc``
        asked first in a new process); a page of one key costs a request's round trip. Other
        threads asking meanwhile wait for it, rather than each sending its request through the client."""
        with self._teaching:
            if not self.on or op in self._learned or op in self._taught:
                return
            self._taught.add(op)
            self._expect("")
            client()
            self._learn(op)

    def _record(self, request: Any, **_: Any) -> None:
        if getattr(self._seen, "key", None) is not None:
            self._seen.request = request  # the last one wins: botocore may redirect and send again
        # (and return None: anything else would be taken as the response)

    def _off(self, why: str) -> None:
        if self.on:
            log.debug("direct S3 requests off: %s", why)
        self.on = False

    # -- sending --------------------------------------------------------------
    def ready(self, op: str) -> bool:
        return self.on and op in self._learned

    def call(self, op: str, key: str, send: Callable[[], Any], ok: tuple[int, ...], client: Callable[[], T]) -> tuple[Any, T | None]:
        """One request of ``op``: ``(response, None)`` when sent directly (``send()``) and
        answered with a status in ``ok``, else ``(None, client())``, the same request through
        the client (which teaches this module, or shows that a refusal was the direct path's)."""
        refused = False
        if self.ready(op):
            r = send()
            progressed()  # an answer began (its body is watched on its own: watchdog.py)
            if r.status_code in ok:
                return r, None
            self.refused(r)  # raises for a server error, to be retried
            refused = True
        else:
            self._expect(key)
        answer = client()
        progressed()
        if refused:
            self._off("the server refused a direct request that it answered through the client")
        else:
            self._learn(op)
        return None, answer

    def get(self, key: str, range_header: str | None) -> Any:
        """Send a GET of ``key``: botocore's ``AWSResponse`` (``status_code``, ``headers``, ``raw``), its body unread."""
        how = self._learned[GET]
        headers = {"User-Agent": how.user_agent}
        if range_header:
            headers["Range"] = range_header
        return self._send(GET, how, self._url(how, key), headers)

    def list(self, prefix: str, token: str | None, delimiter: str, max_keys: int = 0, start_after: str = "") -> Any:
        """Send a LIST (ListObjectsV2) of keys under ``prefix`` (after ``start_after``, where given); the
        answer is read by :meth:`page`."""
        how = self._learned[LIST]
        params = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
        if token:
            params["continuation-token"] = token
        if start_after:
            params["start-after"] = start_after
        if delimiter:
            params["delimiter"] = delimiter
        if max_keys:
            params["max-keys"] = str(max_keys)
        query = "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))
        return self._send(LIST, how, f"{how.url}?{query}", {"User-Agent": how.user_agent})

    def head(self, key: str) -> Any:
        """Send a HEAD of ``key``; :meth:`headers` reads a 200's answer."""
        how = self._learned[HEAD]
        return self._send(HEAD, how, self._url(how, key), {"User-Agent": how.user_agent}, "HEAD")

    def headers(self, response: Any) -> dict[str, Any]:
        """A HEAD's answer as botocore returns the fields read here: ``ContentLength``,
        ``LastModified`` (an aware datetime), ``ETag``. Malformed ones are a ValueError."""
        self.finish(response)
        h = response.headers
        try:
            return {"ContentLength": int(h["content-length"]), "ETag": h.get("etag", ""),
                    "LastModified": parsedate_to_datetime(h["last-modified"])}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a HEAD answer without a readable length or time: {e}") from None

    def put(self, key: str, blob: bytes, *, create: bool = False) -> Any:
        """Send a PUT of ``blob`` as object ``key`` (its payload signed as botocore signs it); read by
        :meth:`finish`. ``create``: only if ``key`` is absent (``If-None-Match: *``; a 412 says it exists)."""
        how = self._learned[PUT]
        headers = {"User-Agent": how.user_agent, "Content-Length": str(len(blob))}
        if create:
            headers["If-None-Match"] = "*"
        return self._send(PUT, how, self._url(how, key), headers, "PUT", blob)

    def _url(self, how: _Learned, key: str) -> str:
        """The URL of object ``key``: the learned one with its key, quoted as botocore quotes it."""
        return how.url + self._quote(key, safe="/~")

    def _send(self, op: str, how: _Learned, url: str, headers: dict[str, str], method: str = "GET",
              body: bytes | None = None) -> Any:
        request = self._request(method=method, url=url, headers=headers, data=body, stream_output=True)
        if how.scope is not None:
            region, service = how.scope
            self._auth(self._signer._credentials.get_frozen_credentials(), service, region).add_auth(request)
        self.sent[op] += 1
        return self._http.send(request.prepare())

    def body(self, response: Any, length: int) -> Any:
        """A GET's body as botocore hands it out (a ``StreamingBody``)."""
        return self._body(response.raw, length)

    def page(self, response: Any) -> dict[str, Any]:
        """A LIST's answer, read and parsed (:func:`parse_list`)."""
        return parse_list(self.finish(response, _MAX_LIST_BYTES))

    def finish(self, response: Any, limit: int = 64 * 1024) -> bytes:
        """Read a whole answer of at most ``limit`` bytes; its connection goes back to the pool."""
        try:
            size = min(limit, int(response.headers.get("content-length") or limit))
        except ValueError:
            size = limit
        within = allowed(self._patience, size)
        d = watch(socket_of(getattr(response.raw, "_fp", None)), within)
        try:
            data = response.raw.read(limit + 1)
        except BaseException:
            response.raw.close()
            if d.fired:
                raise TimeoutError(f"an answer was not in after {within:.1f} s") from None
            raise
        finally:
            d.cancel()
        if d.fired:
            response.raw.close()
            raise TimeoutError(f"an answer was not in after {within:.1f} s")
        if len(data) > limit:
            response.raw.close()  # unread bytes left: the connection cannot be reused
            raise ValueError(f"an answer of more than {limit} bytes")
        response.raw.release_conn()
        return data  # type: ignore[no-any-return]

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
                           "ResponseMetadata": {"HTTPStatusCode": status}}, "Direct")


class ClientOnly:
    """Every request through the client: direct requests switched off (``CKPT_S3_DIRECT=0``)
    or not available with this botocore. Answers :meth:`DirectRequests.call` the same way."""

    on = False

    def __init__(self) -> None:
        self.sent = {GET: 0, HEAD: 0, LIST: 0, PUT: 0}

    def ready(self, op: str) -> bool:
        return False

    def teach(self, op: str, client: Callable[[], Any]) -> None:
        pass

    def call(self, op: str, key: str, send: Callable[[], Any], ok: tuple[int, ...], client: Callable[[], T]) -> tuple[Any, T | None]:
        answer = client()
        progressed()  # an answer began (a GET's body is read after)
        return None, answer


def parse_list(data: bytes) -> dict[str, Any]:
    """A ListObjectsV2 answer as botocore returns it: ``Contents`` (``Key``, ``Size``,
    ``LastModified`` as an aware datetime), ``CommonPrefixes`` (``Prefix``), ``IsTruncated``,
    ``NextContinuationToken``; keys URL-decoded where the answer says they are encoded.
    Anything malformed is a ValueError (the server's answer is not trusted)."""
    try:
        root = ElementTree.fromstring(data)
    except ElementTree.ParseError as e:
        raise ValueError(f"a LIST answer that is not XML: {e}") from None
    if _local(root.tag) != "ListBucketResult":
        raise ValueError(f"a LIST answer with root <{_local(root.tag)}>")
    out: dict[str, Any] = {"IsTruncated": False}
    contents: list[dict[str, Any]] = []
    prefixes: list[dict[str, Any]] = []
    encoded = False
    for node in root:
        name = _local(node.tag)
        if name == "Contents":
            fields = {_local(c.tag): c.text or "" for c in node}
            if "Key" not in fields:
                raise ValueError("a LIST entry without a key")
            try:
                when = datetime.fromisoformat(fields.get("LastModified", "").replace("Z", "+00:00"))
                size = int(fields.get("Size", "0"))
            except ValueError:
                raise ValueError(f"a LIST entry with a bad time or size: {fields!r:.200}") from None
            contents.append({"Key": fields["Key"], "Size": size, "LastModified": when})
        elif name == "CommonPrefixes":
            fields = {_local(c.tag): c.text or "" for c in node}
            prefixes.append({"Prefix": fields.get("Prefix", "")})
        elif name == "IsTruncated":
            out["IsTruncated"] = (node.text or "").strip().lower() == "true"
        elif name == "NextContinuationToken":
            out["NextContinuationToken"] = node.text or ""
        elif name == "EncodingType":
            encoded = (node.text or "").strip().lower() == "url"
    if encoded:
        for c in contents:
            c["Key"] = unquote_plus(c["Key"])
        for p in prefixes:
            p["Prefix"] = unquote_plus(p["Prefix"])
    if contents:
        out["Contents"] = contents
    if prefixes:
        out["CommonPrefixes"] = prefixes
    return out


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]
