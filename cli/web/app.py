"""The web application: pages and ``/api/`` documents over one store, read-only.

Every route is a GET. Templates escape every value (jinja2 autoescape), and the pages
run no inline script: a Content-Security-Policy of ``'self'`` means that even a string
that slipped through unescaped could not execute. Refs from URLs go to
:meth:`ckpt.Store.resolve` (which accepts only valid ref names, ``NAME@N`` and hex id
prefixes) and diffs are of refs only (``refs_only``), so no URL reaches a file; static
assets are a fixed set of files of this package, looked up by name in a dict.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

import ckpt
from ckpt.diffing.compare import SORT_KEYS
from ckpt.errors import (
    AmbiguousRefError,
    CkptError,
    InvalidMergeError,
    InvalidNameError,
    RefNotFoundError,
    ResourceLimitError,
    StorageIOError,
    TensorMismatchError,
    first_line,
)
from ckpt.format.manifest import lineage_fields
from ckpt.snapshot.run import is_snapshot
from ckpt.snapshot.steps import step_ref
from ckpt.store.catalog import own_chunks
from ckpt_store.cli.results import strict_json
from ckpt_store.cli.units import human_bytes, when
from ckpt_store.cli.web import charts
from ckpt_store.cli.web.data import (
    HISTORY_PAGE,
    MAX_PAGE,
    StoreView,
    page,
    snapshot_metrics,
    stored_bytes,
)
from ckpt_store.cli.web.graph import NODE_H, NODE_W, layout, lineage
from ckpt_store.cli.web.runs import run_doc, run_names

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
STATIC = {p.name: (p.read_bytes(), {".css": "text/css", ".js": "text/javascript"}[p.suffix])
          for p in sorted((HERE / "static").iterdir()) if p.suffix in (".css", ".js")}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
COOKIE = "ckpt_serve_token"
# The diff page's heatmap draws at most this many tensors, ~320 bytes of SVG each: the 20,000 of ckpt diff --plot
# (MAX_CELLS) made a 6.8 MB page of a 40,000-tensor diff, 1.7-2.5 s to answer from the cached diff; 2,000 made it
# 1.05 MB, 0.8-1.0 s (measured, 3 reps alternating). A dense model's every tensor fits (Llama-3-70B has 723).
HEAT_CELLS = 2000


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["bytes"] = human_bytes
    env.filters["when"] = when
    env.filters["short"] = lambda i: (i or "")[:12]
    env.filters["num"] = charts.fmt
    env.filters["metric"] = charts.metric_text
    return env


def _int(request: Request, key: str, default: int) -> int:
    try:
        return int(request.query_params.get(key, default))
    except ValueError:
        return default


def _rows_page(request: Request, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The tensor rows whose name holds the request's ``q`` (any case), paged by its ``offset`` and ``limit``
    (:func:`page`): a page shows at most MAX_PAGE rows, so a filter of the rows shown never found the rest."""
    q = request.query_params.get("q", "").strip().lower()
    if q:
        rows = [t for t in rows if q in t["name"].lower()]
    return page(rows, _int(request, "offset", 0), _int(request, "limit", MAX_PAGE))


class Guard:
    """ASGI middleware: GET/HEAD only, no requests from another site's page but links followed, the Host
    header where bound to loopback, the token when one is set, and the security headers."""

    def __init__(self, app: Any, token: str | None, hosts: list[str] | None) -> None:
        self.app = app
        self.token = token
        self.hosts = {h.lower() for h in hosts} if hosts else None
        # A cookie is the host's, whatever the port: two views on one machine (two stores, two ports) with
        # one cookie name replaced each other's token, and the first view answered 401 from then on.
        self.cookie = f"{COOKIE}_{hashlib.sha256(token.encode()).hexdigest()[:16]}" if token is not None else COOKIE

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        set_cookie = None
        if scope["method"] not in ("GET", "HEAD"):
            response: Response | None = PlainTextResponse("read-only: only GET and HEAD\n", status_code=405, headers={"Allow": "GET, HEAD"})
        elif (headers.get("sec-fetch-site") not in (None, "same-origin", "none")
              and (headers.get("sec-fetch-mode"), headers.get("sec-fetch-dest")) != ("navigate", "document")):
            # A page of another site can make a browser ask this view for anything (an <img>, a no-cors fetch, a hidden
            # frame): it cannot read the answer, but each request may start a diff of two large checkpoints. "same-site"
            # is such a page too: another port of 127.0.0.1 or localhost (a notebook, a dev server). A link followed
            # from another page (a top-level navigation) is let in; browsers send these headers, scripts need not.
            response = PlainTextResponse("requests made by another site's page are refused\n", status_code=403)
        elif self.hosts is not None and _host_name(headers.get("host", "")) not in self.hosts:
            # a page on another site whose name was re-pointed at 127.0.0.1 (DNS rebinding) gets nothing
            response = PlainTextResponse("unexpected Host header\n", status_code=400)
        elif self.token is not None:
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [None])[0]
            cookie = _cookie(headers.get("cookie", ""), self.cookie)
            auth = headers.get("authorization", "")
            bearer = auth[7:] if auth.lower().startswith("bearer ") else None
            if given is not None and _same(given, self.token):
                set_cookie = f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                response = None
                if not scope["path"].startswith("/api/"):  # a page: drop the token from the address bar and history
                    rest = [(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
                            if k != "token"]
                    # one leading slash: "//evil.example/" would send the browser to another site
                    path = "/" + scope["path"].lstrip("/")
                    response = RedirectResponse(path + ("?" + urlencode(rest) if rest else ""), status_code=303)
            elif any(v is not None and _same(v, self.token) for v in (cookie, bearer)):
                response = None
            else:
                response = PlainTextResponse("this ckpt serve needs its token: open the address it printed "
                                             "(…/?token=…) or send 'Authorization: Bearer TOKEN'\n", status_code=401)
        else:
            response = None

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
                         (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"),
                         (b"cache-control", b"no-store")]
                if set_cookie:
                    extra.append((b"set-cookie", set_cookie.encode("latin-1")))
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)

        if response is not None:
            await response(scope, receive, send_with_headers)
        else:
            await self.app(scope, receive, send_with_headers)


def _host_name(host: str) -> str:
    """The name of a Host header, without its port: ``[::1]:8765`` and ``[::1]`` give ``::1``."""
    if host.startswith("["):
        return host[1:].partition("]")[0].lower()
    return host.rsplit(":", 1)[0].lower()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8", "surrogateescape"), b.encode("utf-8", "surrogateescape"))


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v
    return None


class BadRequestError(CkptError):
    """A request the view does not take (a query's value): the client's mistake, answered 400."""


def error_status(e: Exception) -> int:
    """The HTTP status of a request that raised ``e``: the client's side (4xx) only for what the request
    asked, the server's (5xx) for what the store answered (a damaged store answered 400 "bad request",
    which a script takes for its own mistake and does not report or retry)."""
    if isinstance(e, (RefNotFoundError, AmbiguousRefError)):
        return 404
    if isinstance(e, (InvalidNameError, BadRequestError)):  # a ref name no ref can have, a query value the view refuses
        return 400
    # What the library refuses to compute for these checkpoints, sound as they are: a diff of a checkpoint whose
    # tensors do not pair by name (diffing/sides.py), one past this machine's memory. The same request fails again.
    if isinstance(e, (TensorMismatchError, InvalidMergeError, ResourceLimitError)):
        return 422
    if isinstance(e, CkptError) and e.retryable:  # an S3 server down or throttling, diffs busy: ask again
        return 503
    if isinstance(e, StorageIOError):  # the store behind the view cannot be read (permissions, a link in its folder)
        return 502
    return 500  # a damaged store (a corrupt or missing object, a malformed record), or the view's own failure


class StrictJSONResponse(JSONResponse):
    """An ``/api/`` document, every string valid Unicode as ``--json`` has it (cli/results.py:
    strict_json); a lone surrogate in a name made the response fail to encode (a 500)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return super().render(strict_json(content))


def create_app(store: ckpt.Store, *, token: str | None = None, hosts: list[str] | None = None,
               local: ckpt.Store | None = None) -> Any:
    """The ASGI application for ``store``. ``token``: every request must carry it (query
    ``?token=``, which also sets a cookie, a cookie, or ``Authorization: Bearer``).
    ``hosts``: the Host header values accepted (None: any). ``local``: a training run's
    local tier, whose snapshots the run pages show beside the store's."""
    view = StoreView(store, local)
    env = _env()

    def render(name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        # Names that are not valid Unicode are shown with U+FFFD (they cannot be encoded as UTF-8).
        return HTMLResponse(strict_json(env.get_template(name).render(store_url=view.url, **ctx)), status_code=status)

    def failed(e: Exception, api: bool) -> Response:
        status = error_status(e)
        if status == 500 and not isinstance(e, CkptError):
            log.exception("ckpt serve: request failed")
            e = RuntimeError("internal error (logged by the server)")
        error = first_line(e, type(e).__name__)
        return StrictJSONResponse({"error": error}, status_code=status) if api else render("error.html", status, error=error)

    def guarded(fn: Any, api: bool) -> Any:
        def endpoint(request: Request) -> Response:
            try:
                return fn(request)
            except Exception as e:  # noqa: BLE001 - one line to the client, never a traceback
                return failed(e, api)
        return endpoint

    # -- API -------------------------------------------------------------------------
    def api_refs(request: Request) -> Response:
        # the damaged refs too, as --json has them: a script must not take a damaged store for a sound one
        rows, pg = page(view.ls_json(), _int(request, "offset", 0), _int(request, "limit", 100))
        return StrictJSONResponse({"refs": rows, "page": pg})

    def graph() -> dict[str, Any]:  # the whole store's lineage, shared by the pages for a few seconds
        return view.fresh("lineage", lambda: lineage(view))

    def api_lineage(request: Request) -> Response:
        return StrictJSONResponse(graph())

    def checkpoint_doc(request: Request, ref: str) -> dict[str, Any]:
        doc = view.show(ref)
        doc["tensors"], doc["tensors_page"] = _rows_page(request, doc["tensors"])
        # a page of the ref's history (log_offset, log_limit): a run's latest may have thousands of entries
        doc["log"], doc["log_page"] = (view.log(ref, _int(request, "log_offset", 0), _int(request, "log_limit", HISTORY_PAGE))
                                       if view.is_ref_name(ref) else (None, None))
        return doc

    def api_checkpoint(request: Request) -> Response:
        return StrictJSONResponse(checkpoint_doc(request, request.path_params["ref"]))

    def diff_args(request: Request) -> tuple[str, str, str, int | None, bool]:
        """a, b, sort, top and estimate (``estimate=0`` is the CLI's --no-estimate: no delta size, faster)."""
        a, b = request.query_params.get("a", ""), request.query_params.get("b", "")
        sort = request.query_params.get("sort", "order")
        if sort not in SORT_KEYS:
            raise BadRequestError(f"sort must be one of {', '.join(SORT_KEYS)}")
        top = request.query_params.get("top", "")
        estimate = request.query_params.get("estimate", "1") not in ("0", "false", "no")
        # ASCII digits only ("²" is a digit to isdigit, not to int), and few: more rows than that is all of them;
        # 0 (which select refuses) is all of them too, as a negative number is
        return a, b, sort, (int(top) or None) if top.isascii() and top.isdigit() and len(top) <= 9 else None, estimate

    def api_diff(request: Request) -> Response:
        a, b, sort, top, estimate = diff_args(request)
        if not a or not b:
            raise BadRequestError("give both sides: /api/diff?a=REF&b=REF")
        return StrictJSONResponse(view.diff(a, b, estimate).to_json(sort, top))

    def api_du(request: Request) -> Response:
        return StrictJSONResponse(view.du())

    def api_run(request: Request) -> Response:
        return StrictJSONResponse(run_doc(view, request.path_params["name"], _int(request, "offset", 0),
                                           _int(request, "limit", HISTORY_PAGE)))

    # -- pages -------------------------------------------------------------------------
    def overview(request: Request) -> Response:
        rows, pg = page(view.ls(), _int(request, "offset", 0), _int(request, "limit", 100))
        du = view.du()
        return render("overview.html", refs=view.overview_rows(rows), page=pg, du=du, bars=charts.savings_bars(du),
                      runs=run_names(view), damaged=view.damaged())

    def lineage_page(request: Request) -> Response:
        doc = graph()
        boxes, width, height = layout(doc["nodes"], doc["edges"])
        by_id = {n["id"]: n for n in doc["nodes"]}
        edges = []
        for e in doc["edges"]:
            s, t = boxes[e["source"]], boxes[e["target"]]
            x1, y1, x2, y2 = s.x + s.w, s.y + s.h / 2, t.x, t.y + t.h / 2
            bend = max(30.0, (x2 - x1) / 2)
            edges.append({**e, "d": f"M{x1:.0f},{y1:.0f} C{x1 + bend:.0f},{y1:.0f} {x2 - bend:.0f},{y2:.0f} {x2:.0f},{y2:.0f}",
                          "lx": x2 - 5, "ly": y2 - 5, "from_label": by_id[e["source"]]["label"], "to_label": by_id[e["target"]]["label"]})
        nodes = [{**n, "box": boxes[n["id"]]} for n in doc["nodes"]]
        return render("lineage.html", nodes=nodes, edges=edges, width=width, height=height, node_w=NODE_W, node_h=NODE_H,
                      truncated=doc["truncated"], runs=[n for n in nodes if n["kind"] == "run"])

    def checkpoint_page(request: Request) -> Response:
        ref = request.path_params["ref"]
        doc = checkpoint_doc(request, ref)
        lin = lineage_fields(doc["lineage"])
        run = None
        m = step_ref(ref)
        if m and is_snapshot(view.manifest(doc["id"])):
            run = m[0]
        names: dict[str, str] = {}
        for n, e in sorted(view.refs().items(), reverse=True):  # the first name (sorted) wins
            names[e.target] = n
        diff_base = lin["base"] or lin["parent"]
        # what this version adds to the store beside the checkpoint it is a delta of
        mine = own_chunks(view.manifest(doc["id"]))
        try:
            adds = stored_bytes(mine - own_chunks(view.manifest(diff_base)) if diff_base else mine, view.chunk_sizes())
        except CkptError:  # its base was collected: what it adds is not known any more
            adds, diff_base = None, None
        if diff_base:  # compare by names where a ref names the checkpoint: the diff page then reads "base -> ft/x"
            diff_base = names.get(diff_base, diff_base)
        g = graph()
        by_id = {n["id"]: n for n in g["nodes"]}
        children = [{**by_id[e["target"]], "edge": e} for e in g["edges"] if e["source"] == doc["id"]]
        return render("checkpoint.html", ref=ref, doc=doc, lin=lin, merge=lin["merge"], run=run, diff_base=diff_base, names=names, adds=adds,
                      children=children, metrics=snapshot_metrics(doc["extra"]),
                      q=request.query_params.get("q", ""), stored=sum(t["stored_bytes"] for t in doc["tensors"]))

    def diff_page(request: Request) -> Response:
        a, b, sort, top, estimate = diff_args(request)
        names = sorted(view.refs())[:5000]
        q = request.query_params.get("q", "")
        ctx: dict[str, Any] = {"names": names, "a": a, "b": b, "sort": sort, "sort_keys": SORT_KEYS, "doc": None, "estimate": estimate,
                               "q": q}
        if a and b:
            doc = view.diff(a, b, estimate).to_json(sort, top)
            # A page of the rows (an MoE model's 40,000 tensors made a 28 MB page, 5 s to render), those whose name
            # holds q; the heatmap draws the first HEAT_CELLS of all in the order asked for (relative_change: the largest)
            heat = charts.heatmap(doc["tensors"][:HEAT_CELLS])
            doc["tensors"], pg = _rows_page(request, doc["tensors"])
            keep = {"a": a, "b": b, "sort": sort, "top": top or "", "estimate": int(estimate)}
            ctx.update(doc=doc, heat=heat, page=pg, keep=keep, query=urlencode({**keep, "q": q}))
        return render("diff.html", **ctx)

    def run_page(request: Request) -> Response:
        name = request.path_params["name"]
        doc = run_doc(view, name, _int(request, "offset", 0), _int(request, "limit", HISTORY_PAGE))
        rows, pg = doc["snapshots"], doc["page"]
        chart_metrics = doc["metrics"][:4]
        return render("run.html", doc=doc, rows=rows, page=pg, local_url=local.url if local is not None else None, charts=[charts.run_chart(rows, k) for k in chart_metrics])

    def static(request: Request) -> Response:
        hit = STATIC.get(request.path_params["name"])
        if hit is None:
            return PlainTextResponse("not found\n", status_code=404)
        return Response(hit[0], media_type=hit[1])

    def not_found(request: Request, exc: Exception) -> Response:
        if request.url.path.startswith("/api/"):
            return StrictJSONResponse({"error": "no such API path"}, status_code=404)
        return render("error.html", 404, error="no such page")

    routes = [
        Route("/api/refs", guarded(api_refs, True)),
        Route("/api/lineage", guarded(api_lineage, True)),
        Route("/api/checkpoint/{ref:path}", guarded(api_checkpoint, True)),
        Route("/api/diff", guarded(api_diff, True)),
        Route("/api/du", guarded(api_du, True)),
        Route("/api/run/{name:path}", guarded(api_run, True)),
        Route("/", guarded(overview, False)),
        Route("/lineage", guarded(lineage_page, False)),
        Route("/checkpoint/{ref:path}", guarded(checkpoint_page, False)),
        Route("/diff", guarded(diff_page, False)),
        Route("/run/{name:path}", guarded(run_page, False)),
        Route("/static/{name}", static),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found})
    return Guard(app, token, hosts)
