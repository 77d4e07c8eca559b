"""`ckpt serve`'s StoreView (cli/web/data.py) under requests arriving together: a diff is of the ids the
view resolved, a failure reaches every request waiting for it, and diffs past the few computed at a time
are answered 503 instead of holding a request thread."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

pytest.importorskip("starlette", reason="ckpt serve needs the web extra: pip install 'ckpt-store[web]'")
pytest.importorskip("httpx", reason="starlette's TestClient needs httpx")

from starlette.testclient import TestClient  # noqa: E402
from test_cli_runner import invoke  # noqa: E402

import ckpt  # noqa: E402
from ckpt_store.cli.web import data  # noqa: E402
from ckpt_store.cli.web.app import create_app  # noqa: E402


def cli_json(store, *args: str):
    return json.loads(invoke("--store", store.url, *args, "--json"))


def _store(tmp_path, n: int) -> ckpt.Store:
    store = ckpt.Store.init(str(tmp_path / "store"))
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        store.push({"w": torch.randn(64, generator=g)}, f"c{i}")
    return store


class CountingDiff:
    """ckpt.diff, counted, each call held until ``gate`` is set (every request is in before any diff ends)."""

    def __init__(self) -> None:
        self.real, self.calls, self.gate = ckpt.diff, [], threading.Event()

    def __call__(self, a, b, **kw):
        self.calls.append((a, b))
        self.gate.wait(10)
        return self.real(a, b, **kw)


def test_a_ref_moved_between_resolving_and_diffing_is_not_cached_under_the_old_pair(tmp_path, monkeypatch):
    """The view keyed a diff by the ids it resolved, then had ckpt.diff resolve the names again: a save
    to the ref in between (a run's latest) computed the new checkpoint's diff, cached it under the old
    pair's ids, and served it later for the old checkpoint asked by id. The diff is now of those ids."""
    store = _store(tmp_path, 2)
    old = store.resolve("c1")
    real, moved = store.resolve, []

    def resolve(ref, *args, **kw):
        mid = real(ref, *args, **kw)
        if ref == "c1" and not moved:  # a save lands right after the view resolved the name: a real push
            moved.append(store.push({"w": torch.zeros(64)}, "c1").id)
        return mid

    monkeypatch.setattr(store, "resolve", resolve)
    c = TestClient(create_app(store))
    first = c.get("/api/diff", params={"a": "c0", "b": "c1"}).json()
    assert moved and moved[0] != old and real("c1") == moved[0]
    assert first["b"] == {"ref": "c1", "id": old}
    assert first["tensors"] == cli_json(store, "diff", "c0", old)["tensors"]
    assert c.get("/api/diff", params={"a": "c0", "b": old}).json() == cli_json(store, "diff", "c0", old)


def test_a_failing_diff_fails_once_for_the_requests_waiting_for_it_and_is_tried_again_later(tmp_path, monkeypatch):
    """A failure was not shared: each request waiting for a diff being made became the maker in turn when it
    failed, and failed after the whole time again (six requests for a failing diff answered at 0.5, 1.0 ...
    3.0 s; with an S3 store down, every page waited six retry times). Now they take the maker's error, and
    the failure is not kept: a later request tries again."""
    store = _store(tmp_path, 2)
    for cid in store.manifest(store.resolve("c1")).tensors[0].chunks:  # c1's data is gone: its diff fails, for real
        os.remove(tmp_path / "store" / "objects" / "chunks" / cid[:2] / cid)
    counting = CountingDiff()
    monkeypatch.setattr(data.ckpt, "diff", counting)
    c = TestClient(create_app(store))
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(c.get("/api/diff", params={"a": "c0", "b": "c1"})))
               for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    counting.gate.set()
    for t in threads:
        t.join()
    assert len(counting.calls) == 1
    assert len(answers) == 6 and len({(r.status_code, r.text) for r in answers}) == 1
    assert answers[0].status_code == 500 and "Traceback" not in answers[0].text and answers[0].json()["error"]
    assert c.get("/api/diff", params={"a": "c0", "b": "c1"}).status_code == answers[0].status_code
    assert len(counting.calls) == 2  # not cached: asked again


def test_diffs_past_the_few_at_a_time_are_answered_503_not_held(tmp_path, monkeypatch):
    """Requests for diffs past DIFFS_AT_ONCE waited on the semaphore for as long as those took, each holding
    one of the server's 40 request threads: a burst of distinct diffs stalled every page. A diff now waits
    DIFF_WAIT_S for a turn, then is answered 503 (retryable: ask again), and is computed when asked again."""
    store = _store(tmp_path, data.DIFFS_AT_ONCE + 2)
    counting = CountingDiff()
    monkeypatch.setattr(data.ckpt, "diff", counting)
    monkeypatch.setattr(data, "DIFF_WAIT_S", 0.3)
    c = TestClient(create_app(store))
    busy = [threading.Thread(target=c.get, args=("/api/diff",), kwargs={"params": {"a": f"c{i}", "b": f"c{i + 1}"}})
            for i in range(data.DIFFS_AT_ONCE)]
    for t in busy:
        t.start()
    deadline = time.monotonic() + 10
    while len(counting.calls) < data.DIFFS_AT_ONCE and time.monotonic() < deadline:
        time.sleep(0.01)
    last = {"a": f"c{data.DIFFS_AT_ONCE}", "b": f"c{data.DIFFS_AT_ONCE + 1}"}
    try:
        r = c.get("/api/diff", params=last)
        page = c.get("/diff", params=last)
    finally:
        counting.gate.set()
        for t in busy:
            t.join()
    assert (r.status_code, page.status_code) == (503, 503)
    assert "diffs are being computed" in r.json()["error"] and "Traceback" not in page.text
    assert len(counting.calls) == data.DIFFS_AT_ONCE  # the refused ones computed nothing
    assert c.get("/api/diff", params=last).json() == cli_json(store, "diff", last["a"], last["b"])


@pytest.mark.parametrize("site", ["same-site", "cross-site", "some-future-value"])
def test_requests_a_page_on_another_port_makes_are_refused_too(tmp_path, site):
    """Only Sec-Fetch-Site "cross-site" was refused: a page on another port of 127.0.0.1 or localhost (a
    notebook, a dev server) is "same-site" and could still start diffs with an <img>. Every request a page
    made is refused unless it is the view's own (same-origin), the user's (none), or a link followed."""
    store = _store(tmp_path, 2)
    c = TestClient(create_app(store, hosts=["testserver"]))
    path = "/api/diff?a=c0&b=c1"
    for mode, dest in (("no-cors", "image"), ("navigate", "iframe"), ("cors", "empty")):
        r = c.get(path, headers={"sec-fetch-site": site, "sec-fetch-mode": mode, "sec-fetch-dest": dest})
        assert r.status_code == 403 and "another site" in r.text, (mode, dest)
    link = {"sec-fetch-site": site, "sec-fetch-mode": "navigate", "sec-fetch-dest": "document"}
    assert c.get("/checkpoint/c1", headers=link).status_code == 200
    own = {"sec-fetch-site": "same-origin", "sec-fetch-mode": "no-cors", "sec-fetch-dest": "image"}
    assert c.get(path, headers=own).status_code == 200


def test_a_warm_checkpoint_history_reads_its_rows_manifests_again(tmp_path):
    """A checkpoint's history (its page and /api/checkpoint's ``log``) drew its versions from the view's cache of
    manifests: after `ckpt gc` freed the earlier versions' manifests, a warm view still showed their messages as
    stored, where `ckpt log` (and a fresh view) says they are no longer in the store. The page's rows read the
    store's copies again, checked against their ids."""
    store = ckpt.Store.init(str(tmp_path / "store"))
    for i in range(3):
        store.push({"w": torch.full((64,), float(i))}, "m", f"version {i}")
    c = TestClient(create_app(store))
    assert [r["message"] for r in c.get("/api/checkpoint/m").json()["log"]] == ["version 2", "version 1", "version 0"]
    store.gc(grace_s=0, keep_history=False)
    log = c.get("/api/checkpoint/m").json()["log"]
    assert log == cli_json(store, "log", "m")  # was the messages of the versions gc freed
    assert [r["message"] for r in log][1:] == ["(no longer in the store: freed by `ckpt gc`)"] * 2
    assert "freed by" in c.get("/checkpoint/m").text


def test_a_warm_lineage_leaves_out_a_manifest_deleted_since(tmp_path, monkeypatch):
    """The lineage is made again every few seconds from the view's cache of manifests: an earlier version whose
    manifest `ckpt gc` freed since the view warmed was drawn as a node, and a run whose snapshot's manifest was
    deleted as a run, for as long as the view ran, where a fresh view leaves them out. The manifests it draws are
    checked against one listing of the store's, each the listing lacks read again."""
    real = data.StoreView.__init__
    monkeypatch.setattr(data.StoreView, "__init__", lambda self, *a, **k: real(self, *a, **{**k, "ttl_s": 0.0}))  # (no reuse)
    store = ckpt.Store.init(str(tmp_path / "store"))
    for i in range(2):
        store.push({"w": torch.full((64,), float(i))}, "m", f"version {i}")
    earlier = store.resolve("m@1")  # (m@0 is the current version)
    with ckpt.CheckpointManager(store, "run", save_mode="sync") as mgr:
        mgr.save(1, {"w": torch.full((64,), 1.0)})
    snapshot = store.resolve("run/step-1")
    c = TestClient(create_app(store))
    warm = c.get("/api/lineage").json()
    assert earlier in {n["id"] for n in warm["nodes"]} and "run:run" in {n["id"] for n in warm["nodes"]}
    store.gc(grace_s=0, keep_history=False)  # frees m@1's manifest
    (tmp_path / "store" / "objects" / "manifests" / snapshot[:2] / snapshot).unlink()  # (damage: the run's one snapshot)
    assert earlier not in store.manifest_ids() and snapshot not in store.manifest_ids()
    doc = c.get("/api/lineage").json()
    assert {n["id"] for n in doc["nodes"]} == {store.resolve("m")}  # were drawn: m@1 ("earlier") and the run
    assert doc == TestClient(create_app(store)).get("/api/lineage").json()  # what a fresh view draws
