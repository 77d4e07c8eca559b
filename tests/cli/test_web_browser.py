"""`ckpt serve` in a real browser: headless Chromium (Debian's package) driven by Playwright.

The server is the real command in a subprocess, over a store built here (base, fine-tunes,
a merge, an XSS probe, a training run). Each test opens pages, clicks through them, checks
the numbers on the page against `ckpt ... --json`, and saves screenshots under its tmp_path
(and under $CKPT_WEB_SCREENSHOTS too, when set: that is how docs/ got its pictures).
Skipped, with one line, where Playwright or a Chromium binary is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("CKPT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    pytest.skip("browser tests skipped: the playwright package is missing (pip install playwright)", allow_module_level=True)
if CHROMIUM is None:
    pytest.skip("browser tests skipped: no chromium binary (apt-get install chromium, or set CKPT_CHROMIUM)", allow_module_level=True)
pytest.importorskip("starlette", reason="ckpt serve needs the web extra: pip install 'ckpt-store[web]'")

from test_cli_runner import invoke  # noqa: E402
from webstore import XSS, XSS_META, XSS_TENSOR  # noqa: E402

from ckpt_store.cli.units import human_bytes  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(url: str):
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "ckpt_store.cli.main", "--store", url, "serve", "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = p.stdout.readline()
    if not line.startswith("ckpt serve: http://"):
        p.kill()
        raise AssertionError(f"ckpt serve did not start: {line!r} {p.stderr.read()}")
    return p, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def site(web_store):
    store = web_store
    p, base = _serve(store.url)
    yield store, base
    p.terminate()
    p.wait(timeout=20)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A page that fails the test on any script error, console error (CSP violations included) or dialog."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = ctx.new_page()
    problems: list[str] = []
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
    yield pg
    ctx.close()
    assert not problems, problems


def shot(pg, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    out = os.environ.get("CKPT_WEB_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)
    return path


def cli(store, *args: str):
    return json.loads(invoke("--store", store.url, *args, "--json"))


def test_overview_numbers_sort_and_filter(site, page, tmp_path):
    store, base = site
    du, ls = cli(store, "du"), cli(store, "ls")
    page.goto(base + "/")
    for key, field in (("logical", "logical_bytes"), ("stored", "stored_bytes"), ("dedup", "dedup_saved_bytes"),
                       ("compression", "compression_saved_bytes")):
        assert int(page.get_attribute(f"#{key}", "data-bytes")) == du[field]
    assert page.locator("#refs-table tbody tr").count() == len(ls)
    bars = {page.locator("#savings .bar").nth(i).get_attribute("data-label"): int(page.locator("#savings .bar").nth(i).get_attribute("data-bytes"))
            for i in range(page.locator("#savings .bar").count())}
    assert bars["dedup saved"] == du["dedup_saved_bytes"]
    for codec, c in du["codecs"].items():
        assert bars[f"{codec} saved"] == c["decoded_bytes"] - c["stored_bytes"]
    page.click("#refs-table th:has-text('logical')")
    page.click("#refs-table th:has-text('logical')")  # descending
    shown = [int(v) for v in page.locator("#refs-table td.logical").evaluate_all("els => els.map(e => e.dataset.v)")]
    assert shown == sorted((r["bytes"] for r in ls), reverse=True)
    page.fill("input[data-filter=refs-table]", "ft/")
    visible = page.locator("#refs-table tbody tr:visible").evaluate_all("rows => rows.map(r => r.dataset.ref)")
    assert sorted(visible) == ["ft/bottom", "ft/top"]
    shot(page, tmp_path, "overview")


def test_lineage_click_through_to_checkpoint_and_diff(site, page, tmp_path):
    store, base = site
    page.goto(base + "/lineage")
    api = json.loads(page.evaluate("fetch('/api/lineage').then(r => r.text())"))
    assert page.locator("#lineage .node").count() == len(api["nodes"])
    top = next(n for n in api["nodes"] if n["label"] == "ft/top")
    label = page.locator(f"#lineage .edge-label[data-target='{top['id']}']")
    assert label.text_content() == "+" + human_bytes(top["cost_bytes"])
    page.fill("#graph-filter", "run1")
    assert page.locator("#lineage .node.hit").count() == 1 and page.locator("#lineage .node.dim").count() == len(api["nodes"]) - 1
    page.fill("#graph-filter", "")
    page.click("#lineage .node.k-run .expand")  # a run lists its snapshots
    assert page.locator("#run-train\\/run1 li").count() == 2 and page.locator("#run-train\\/run1 li").first.is_visible()
    shot(page, tmp_path, "lineage")

    page.click(f"#lineage .node[data-id='{top['id']}'] a >> nth=0")
    page.wait_for_url("**/checkpoint/ft/top")
    show = cli(store, "show", "ft/top")
    assert page.text_content("#ckpt-id") == show["id"]
    assert int(page.text_content("#n-tensors")) == len(show["tensors"])
    assert page.text_content("#message") == "fine-tuned top layers"
    assert int(page.get_attribute("#adds", "data-bytes")) == top["cost_bytes"]  # what this version costs to store
    stored = {r["name"]: r["stored_bytes"] for r in show["tensors"]}
    rows = page.locator("#tensor-table tbody tr").evaluate_all(
        "rows => rows.map(r => [r.dataset.name, +r.querySelector('td.stored').dataset.v])")
    assert dict(rows) == stored
    page.click("#tensor-table th:has-text('stored')")
    page.click("#tensor-table th:has-text('stored')")
    order = page.locator("#tensor-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.name)")
    assert [stored[n] for n in order] == sorted(stored.values(), reverse=True)
    page.fill("input[data-filter=tensor-table]", "layer.3.")
    assert page.locator("#tensor-table tbody tr:visible").count() == sum(n.startswith("layer.3.") for n in stored)
    shot(page, tmp_path, "checkpoint")

    page.click("#diff-base")
    page.wait_for_url("**/diff?**")
    doc = cli(store, "diff", "base", "ft/top")
    s = doc["summary"]
    assert int(page.text_content("#s-changed")) == s["changed"] and int(page.text_content("#s-tensors")) == s["tensors"]
    assert int(page.get_attribute("#s-delta", "data-bytes")) == s["delta_bytes"]
    layered = [t for t in doc["tensors"] if t["name"].startswith("layer.")]
    assert page.locator("#heatmap .cell").count() == len(layered)
    # the heatmap's strongest cells are the top layers this fine-tune changed
    values = page.locator("#heatmap .cell").evaluate_all("cs => cs.map(c => [c.dataset.name, parseFloat(c.dataset.value) || 0])")
    assert max(values, key=lambda v: v[1])[0].startswith(("layer.2.", "layer.3."))
    rel = {t["name"]: t["relative_change"] for t in doc["tensors"]}
    for name, v in values:
        assert v == pytest.approx(rel[name] or 0, rel=1e-12)  # the same float, through HTML
    shot(page, tmp_path, "diff")


def test_diff_from_the_dropdowns(site, page):
    store, base = site
    page.goto(base + "/diff")
    page.select_option("#sel-a", "base")
    with page.expect_navigation():
        page.select_option("#sel-b", "ft/bottom")
    doc = cli(store, "diff", "base", "ft/bottom")
    assert int(page.text_content("#s-changed")) == doc["summary"]["changed"]
    table = page.locator("#diff-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.name)")
    assert table == [t["name"] for t in doc["tensors"]]


def test_training_run_page(site, page, tmp_path):
    store, base = site
    page.goto(base + "/run/train/run1")
    run = json.loads(page.evaluate("fetch('/api/run/train/run1').then(r => r.text())"))
    assert page.locator("svg.runchart[data-metric=loss] circle.kept").count() == 2
    assert page.locator("svg.runchart[data-metric=loss] circle.removed").count() == 2
    assert page.locator("svg.runchart[data-metric=loss] circle.latest").get_attribute("data-step") == "8"
    rows = page.locator("#snap-table tbody tr").evaluate_all(
        "rows => rows.map(r => [+r.dataset.step, r.className, +r.querySelector('td.metric').dataset.v])")
    assert rows == [[s["step"], "kept" if s["live"] else "removed", s["metrics"]["loss"]] for s in run["snapshots"]]
    for step, cls, loss in rows:  # the kept ones against `ckpt show RUN/step-N --json`
        if cls == "kept":
            assert loss == cli(store, "show", f"train/run1/step-{step}")["extra"]["snapshot"]["metrics"]["loss"]
    shot(page, tmp_path, "run")
    page.click("svg.runchart[data-metric=loss] circle.latest")
    page.wait_for_url("**/checkpoint/train/run1/step-8")
    assert page.text_content("#ckpt-id") == cli(store, "show", "train/run1/step-8")["id"]


def test_user_strings_show_as_text(site, page, tmp_path):
    store, base = site
    page.goto(base + "/checkpoint/xss/probe")
    assert page.text_content("#message") == XSS
    assert page.locator("dd.metadata").text_content() == XSS_META
    assert page.locator("#tensor-table tbody tr td.mono").all_text_contents().count(XSS_TENSOR) == 1
    assert page.locator("script").count() == 1 and page.locator("img").count() == 0 and page.locator("b:has-text('bold')").count() == 0
    shot(page, tmp_path, "xss")
    page.goto(base + "/")
    assert XSS in page.locator("#refs-table tr[data-ref='xss/probe'] td.msg").text_content()
    page.goto(base + "/diff?a=base&b=xss/probe")
    assert page.locator("#diff-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.name)").count(XSS_TENSOR) == 1
    assert page.locator("script").count() == 1


def test_lineage_readable_at_200_nodes(wide_store, tmp_path, page):
    p, base = _serve(wide_store.url)
    try:
        page.goto(base + "/lineage")
        assert page.locator("#lineage .node").count() == 200
        boxes = page.locator("#lineage .node rect:first-of-type").evaluate_all(
            "rs => rs.map(r => { const b = r.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; })")
        labels = page.locator("#lineage .edge-label").evaluate_all(
            "ts => ts.map(t => { const b = t.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; })")
        names = page.locator("#lineage .node text.name").evaluate_all(
            "ts => ts.map(t => [parseFloat(getComputedStyle(t).fontSize), t.getComputedTextLength()])")

        def overlap(a, b):
            return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5

        for i, a in enumerate(boxes):  # no node hides another
            assert not any(overlap(a, b) for b in boxes[i + 1 :])
        for lab in labels:  # no cost label sits on a node
            assert not any(overlap(lab, b) for b in boxes)
        assert all(size >= 12 and width <= 200 for size, width in names)  # legible, and inside its box
        page.fill("#graph-filter", "merge/07")
        page.press("#graph-filter", "Enter")
        hit = page.locator("#lineage .node.hit")
        assert hit.count() == 1 and hit.is_visible()
        shot(page, tmp_path, "lineage-200")
    finally:
        p.terminate()
        p.wait(timeout=20)


def test_the_diff_pages_filter_searches_every_row_on_enter(site, page):
    """Typing filters the rows shown; Enter asks the server for every row whose name holds the text (a
    tensor past the first page was never found), keeping the pair and the sort."""
    store, base = site
    page.goto(base + "/diff?a=base&b=ft/top&sort=relative_change")
    page.fill("input[data-filter=diff-table]", "layer.3.")
    with page.expect_navigation():
        page.press("input[data-filter=diff-table]", "Enter")
    assert "q=layer.3." in page.url and "sort=relative_change" in page.url
    doc = cli(store, "diff", "base", "ft/top", "--sort", "relative_change")
    table = page.locator("#diff-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.name)")
    assert table == [t["name"] for t in doc["tensors"] if "layer.3." in t["name"]] and table


def test_a_page_on_another_port_cannot_start_a_diff(site, browser):
    """A page served from another port of 127.0.0.1 (a notebook, a dev server) is the same site to the browser:
    its <img> of /api/diff was answered, and each one computed a diff. What Chromium says of such a request
    (its Sec-Fetch headers, as a server on a third port receives them; the answer to an <img> is blocked
    before a test could read it) is sent to the view: refused (403). Only "cross-site" was refused before."""
    import http.server
    import threading
    import urllib.error
    import urllib.request

    store, base = site
    target = base + "/api/diff?a=base&b=ft/bottom&estimate=0"
    received: list[dict[str, str]] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            received.append({k.lower(): v for k, v in self.headers.items() if k.lower().startswith("sec-fetch-")})
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    recorder = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)

    class Other(Recorder):
        def do_GET(self):
            body = f'<html><body><img src="http://127.0.0.1:{recorder.server_address[1]}/x.png"></body></html>'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body)

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    for server in (recorder, other):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    ctx = browser.new_context()  # not the page fixture: the failed <img> is a console error
    try:
        ctx.new_page().goto(f"http://127.0.0.1:{other.server_address[1]}/", wait_until="load")
    finally:
        ctx.close()
        for server in (recorder, other):
            server.shutdown()
            server.server_close()
    assert len(received) == 1
    sent = received[0]
    assert (sent["sec-fetch-site"], sent["sec-fetch-dest"]) == ("same-site", "image")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(target, headers=sent), timeout=30)
    assert refused.value.code == 403
