"""`ckpt serve` on a long training run (cli/web/runs.py, the runs of cli/web/graph.py's lineage): which refs
RUN/step-N are snapshots, and what their chunks are, come from the metadata index's summaries, not a
manifest read and parsed per snapshot; a snapshot whose manifest the view has found damaged is left out (one
not read since it was damaged is drawn from its summary, as `ckpt ls` lists it)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("starlette", reason="ckpt serve needs the web extra: pip install 'ckpt-store[web]'")
pytest.importorskip("httpx", reason="starlette's TestClient needs httpx")

from integration_util import flip_a_byte  # noqa: E402

import ckpt  # noqa: E402
from ckpt.format.manifest import Manifest  # noqa: E402
from ckpt.store import catalog  # noqa: E402
from ckpt_store.cli.web import data  # noqa: E402
from ckpt_store.cli.web.data import StoreView  # noqa: E402
from ckpt_store.cli.web.graph import lineage  # noqa: E402
from ckpt_store.cli.web.runs import run_names  # noqa: E402

STEPS = 24


def _long_run(tmp_path) -> ckpt.Store:
    """A base, then STEPS snapshots of one run (all kept) of a real model and optimizer."""
    torch.manual_seed(0)
    store = ckpt.Store.init(str(tmp_path / "store"))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    store.push({k: v.detach().clone() for k, v in model.state_dict().items()}, "base", "pretrained")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.randint(0, 2, (16,))
    with ckpt.CheckpointManager(store, "train/long", save_mode="sync") as mgr:
        for step in range(1, STEPS + 1):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.save(step, {"model": model, "optim": opt, "step": step}, metrics={"loss": loss.item()})
    return store



def _small_run(store: ckpt.Store, run: str, steps: int) -> ckpt.Store:
    """``steps`` snapshots of run ``run`` of a small model whose weights move a little each step."""
    model = nn.Linear(4, 2)
    with ckpt.CheckpointManager(store, run, save_mode="sync") as mgr:
        for step in range(1, steps + 1):
            with torch.no_grad():
                model.weight.add_(0.01)
            mgr.save(step, {"model": model, "step": step})
    return store


def _sans_verified(doc: dict) -> dict:
    """A lineage document without its snapshots' ``verified`` (whether the view read them, not what they hold)."""
    return {**doc, "nodes": [{**n, "snapshots": [{k: v for k, v in s.items() if k != "verified"} for s in n["snapshots"]]}
                             if "snapshots" in n else n for n in doc["nodes"]]}


@pytest.fixture
def parsed(monkeypatch):
    """Manifests parsed from here on (by id)."""
    seen: list[str] = []
    real = Manifest.from_json

    def counting(data, what, *a, **k):
        seen.append(what)
        return real(data, what, *a, **k)

    monkeypatch.setattr(Manifest, "from_json", staticmethod(counting))
    return seen


def test_a_long_runs_lineage_reads_a_few_manifests_not_one_per_snapshot(tmp_path, monkeypatch, parsed):
    """The lineage read every live ref's manifest to tell a run's snapshots from pushed checkpoints, then
    every snapshot's again for the run's chunks: 1,500 snapshots took 3-11 s on a new view. The index's
    summaries tell both; the manifests read are the base's and the run's newest (its time and size) only,
    and the document is the one the manifests give."""
    store = _long_run(tmp_path)
    parsed.clear()
    got = lineage(StoreView(store))
    assert len(parsed) <= 3  # the base, train/long/latest and its step: was STEPS + 1
    run = next(n for n in got["nodes"] if n["kind"] == "run")
    assert [s["step"] for s in run["snapshots"]] == list(range(1, STEPS + 1))
    assert [s["verified"] for s in run["snapshots"]] == [False] * (STEPS - 1) + [True]  # drawn from the index
    monkeypatch.setattr(catalog, "overviews", lambda store, mids, checked, index=None: {})  # every overview from its manifest
    read = lineage(StoreView(store))
    assert all(s["verified"] for s in next(n for n in read["nodes"] if n["kind"] == "run")["snapshots"])
    assert _sans_verified(read) == _sans_verified(got)


def test_a_damaged_newest_snapshot_is_left_out_of_the_lineage(tmp_path):
    """The index still summarizes a snapshot whose manifest was damaged since: the run's newest is read
    (its time and size are shown), and one that cannot be is left out, as the manifests had it."""
    store = _long_run(tmp_path)
    newest = store.resolve(f"train/long/step-{STEPS}")
    path = tmp_path / "store" / "objects" / "manifests" / newest[:2] / newest
    os.chmod(path, 0o644)
    path.write_bytes(path.read_bytes()[:-9] + b"damaged!}")
    run = next(n for n in lineage(StoreView(store))["nodes"] if n["kind"] == "run")
    assert [s["step"] for s in run["snapshots"]] == list(range(1, STEPS))


def test_the_runs_of_a_store_read_a_manifest_per_run_at_most(tmp_path, monkeypatch, parsed):
    """runs() read the manifest of every ref named RUN/step-N until one was a snapshot: a sweep of
    checkpoints pushed as sweep/step-N (no run) read each of them, at every overview page. Now one ref of
    each run is asked first (from its manifest, where few), the others from the index's summaries."""
    store = _long_run(tmp_path)
    g = torch.Generator().manual_seed(2)
    for n in range(12):
        store.push({"w": torch.randn(32, generator=g)}, f"sweep/step-{n}")
    parsed.clear()
    assert run_names(StoreView(store)) == ["train/long"]
    assert len(parsed) <= data.FEW_MANIFESTS  # was 12 + 1
    monkeypatch.setattr(catalog, "overviews", lambda store, mids, checked, index=None: {})
    assert run_names(StoreView(store)) == ["train/long"]


def test_a_run_page_asked_again_does_not_load_the_index_again(tmp_path, monkeypatch):
    """Each run page told the run's live steps from pushed checkpoints by a fresh view of the metadata index
    (a listing of refs/ and a load: 0.2 s of a 1,500-snapshot run's page, every time). The answers are by
    checkpoint id, cached with the view's overviews: the page asked again makes no view of the index, and
    loads it only for its ref records (no chunk lists; Store.readable_ref_history)."""
    from ckpt_store.cli.web.runs import run_doc
    from ckpt_store.storage.index import StoreIndex

    store = _long_run(tmp_path)
    store.push({"w": torch.arange(3.0)}, "train/long/step-99")  # a user's checkpoint under the run's name
    view = StoreView(store)
    first = run_doc(view, "train/long")
    loads = []
    for name in ("view", "load"):
        real = getattr(StoreIndex, name)
        monkeypatch.setattr(StoreIndex, name, lambda self, *a, _real=real, _name=name, **k: loads.append((_name, k)) or _real(self, *a, **k))
    again = run_doc(view, "train/long")
    assert loads == [("load", {})]  # the ref records; was a view of the index (a listing of refs/) and its load
    assert again == first
    assert [r["step"] for r in first["snapshots"]] == list(range(1, STEPS + 1))  # the pushed one is no row


def test_a_long_runs_lineage_on_s3_makes_a_few_requests_not_one_per_snapshot(s3_main_url, tmp_path):
    """On S3 each manifest the lineage read was a GET: a run's thousands of snapshots, as many requests. The
    requests of a new view's lineage are the listings (refs, chunks, the index's) and a few GETs."""
    from s3support import http_requests

    store = _small_run(ckpt.Store.init(s3_main_url), "train/s3", 12)
    with http_requests(store.objects.backend) as seen:
        run = next(n for n in lineage(StoreView(store))["nodes"] if n["kind"] == "run")
    assert [s["step"] for s in run["snapshots"]] == list(range(1, 13))
    manifests = [key for kind, key in seen if kind.startswith("GET") and "/objects/manifests/" in key]
    assert len(manifests) <= 1, seen  # train/s3/latest's (its step's is the same): was one per snapshot
    assert len(seen) <= 16, seen  # 9 here: 5 listings, 3 GETs of the index, 1 manifest; was 12 manifest GETs more


def _damage_manifest(store: ckpt.Store, root, ref: str, how: str = "flip") -> str:
    """Damage the stored manifest ``ref`` names in the store at folder ``root``: a bit flipped ("flip") or the
    file removed ("delete"); its id."""
    mid = store.resolve(ref)
    path = root / "objects" / "manifests" / mid[:2] / mid
    if how == "delete":
        path.unlink()
        return mid
    flip_a_byte(path)
    return mid


def _run_with_step_2_damaged(tmp_path) -> ckpt.Store:
    """A run of 8 snapshots, the index summarizing each (`ls`), step 2's manifest damaged since (a bit flipped)."""
    store = _small_run(ckpt.Store.init(str(tmp_path / "store")), "r", 8)
    store.ls()
    _damage_manifest(store, tmp_path / "store", "r/step-2")
    return store


def test_a_manifest_read_from_the_local_tier_does_not_verify_the_stores_copy(tmp_path):
    """A run page read a step's manifest from the run's local tier first; cached by id, the lineage of the
    (durable) store then drew that step verified, and took the cached copy for its newest step, though the
    store's copies of steps 2 and 4 are damaged (a bit flipped after the copy). The run page reads the
    store's copies now (they are what "durable" means): steps 2 and 4 are the local tier's alone, the
    damage named, and the lineage leaves them out (found damaged)."""
    from ckpt_store.cli.web.runs import run_doc

    store = _small_run(ckpt.Store.init(str(tmp_path / "store")), "r", 4)
    store.ls()
    local = ckpt.Store.init(str(tmp_path / "local"))
    store.copy_to(local, ["r/step-2", "r/step-3", "r/step-4"])
    for step in (2, 4):
        _damage_manifest(store, tmp_path / "store", f"r/step-{step}")
    view = StoreView(store, local)
    rows = run_doc(view, "r")["snapshots"]
    assert [(r["step"], r["tier"], r["available"]) for r in rows] == [
        (1, "durable", True), (2, "local", True), (3, "durable + local", True), (4, "local", True)]
    run = next(n for n in lineage(view)["nodes"] if n["kind"] == "run")
    assert [(s["step"], s["verified"]) for s in run["snapshots"]] == [(1, True), (3, True)]  # was all 4, True


@pytest.mark.parametrize("how", ["delete", "flip"])
def test_a_step_is_drawn_durable_only_where_the_stores_copy_reads_whole(tmp_path, how):
    """A step live in the store and the local tier was drawn "durable + local" with its metrics read from the
    local tier's copy, the store's never read: its manifest there gone (or a bit flipped) still read as held
    by the store, and a user freeing the node would have deleted the one whole copy. The store's copy is read
    for each shown row: that step is the local tier's alone, the store's damage named; a step the store alone
    holds, damaged, is drawn damaged (it was "durable")."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _small_run(ckpt.Store.init(str(tmp_path / "store")), "r", 4)
    local = ckpt.Store.init(str(tmp_path / "local"))
    store.copy_to(local, ["r/step-3", "r/step-4"])
    _damage_manifest(store, tmp_path / "store", "r/step-3", how)
    _damage_manifest(store, tmp_path / "store", "r/step-1", how)
    c = TestClient(create_app(store, local=local))
    rows = {r["step"]: r for r in c.get("/api/run/r").json()["snapshots"]}
    assert {s: (r["tier"], r["live"], r["available"]) for s, r in rows.items()} == {
        1: ("damaged", True, False), 2: ("durable", True, True), 3: ("local", True, True), 4: ("durable + local", True, True)}
    assert rows[3]["damaged"].startswith("durable: ") and rows[1]["damaged"].startswith("durable: ")
    assert rows[3]["id"] == local.resolve("r/step-3")
    assert rows[2]["damaged"] is None and rows[4]["damaged"] is None
    page = c.get("/run/r").text
    assert page.count('class="error damaged"') == 2 and page.count("<td>durable + local</td>") == 1


@pytest.mark.parametrize("how", ["delete", "flip"])
def test_a_warm_run_page_reads_the_stores_copy_again(tmp_path, how):
    """A run page asked again drew a step "durable + local" from the manifest it had cached, after the store's
    copy was deleted (or a bit flipped) underneath it: the cache is by id (its bytes cannot change) but the
    store's copy can be lost. The page's rows read the store's copies again (checked against their ids):
    the step is the local tier's alone, the damage named, and the lineage leaves it out."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _small_run(ckpt.Store.init(str(tmp_path / "store")), "r", 4)
    local = ckpt.Store.init(str(tmp_path / "local"))
    store.copy_to(local, ["r/step-3", "r/step-4"])
    c = TestClient(create_app(store, local=local))
    assert [r["tier"] for r in c.get("/api/run/r").json()["snapshots"]] == ["durable", "durable", "durable + local", "durable + local"]
    _damage_manifest(store, tmp_path / "store", "r/step-3", how)
    rows = c.get("/api/run/r").json()["snapshots"]
    assert [r["tier"] for r in rows] == ["durable", "durable", "local", "durable + local"]  # was "durable + local"
    assert rows[2]["damaged"].startswith("durable: ") and rows[2]["available"]
    run = next(n for n in c.get("/api/lineage").json()["nodes"] if n["kind"] == "run")
    assert [s["step"] for s in run["snapshots"]] == [1, 2, 4]


def test_a_step_is_drawn_local_only_where_the_tiers_copy_reads_whole(tmp_path):
    """The local tier's copy of a step was not read where the store's answered, or where the view had the
    manifest cached (read from the store before retention removed the step there): a step whose local copy is
    gone read as held by the tier ("durable + local", "local"), a restore from the node taken for possible.
    Each tier holding a shown step has its copy read for the request."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _small_run(ckpt.Store.init(str(tmp_path / "store")), "r", 4)
    local = ckpt.Store.init(str(tmp_path / "local"))
    store.copy_to(local, ["r/step-2", "r/step-3", "r/step-4"])
    c = TestClient(create_app(store, local=local))
    assert [r["tier"] for r in c.get("/api/run/r").json()["snapshots"]] == ["durable"] + ["durable + local"] * 3
    store.remove("r/step-2")  # (retention: the durable store no longer holds step 2; the view has its manifest)
    for step in (2, 3):
        _damage_manifest(local, tmp_path / "local", f"r/step-{step}", "delete")
    rows = c.get("/api/run/r").json()["snapshots"]
    assert [(r["step"], r["tier"]) for r in rows] == [(1, "durable"), (2, "damaged"), (3, "durable"), (4, "durable + local")]
    assert rows[1]["damaged"].startswith("local: ") and rows[2]["damaged"].startswith("local: ")


def test_a_damaged_copy_the_store_no_longer_holds_a_kept_step_by_does_not_make_it_damaged(tmp_path):
    """A step removed from the store by retention (its manifest not collected yet, and damaged) and kept by the
    local tier, whose copy is whole: the store's copy was read first and its damage named the kept step's row
    damaged ("kept · damaged", no tier said). Only the copies of the tiers holding a step decide it; a removed
    copy's damage is named only where no copy could be read."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _small_run(ckpt.Store.init(str(tmp_path / "store")), "r", 3)
    local = ckpt.Store.init(str(tmp_path / "local"))
    store.copy_to(local, ["r/step-1", "r/step-2", "r/step-3"])
    _damage_manifest(store, tmp_path / "store", "r/step-2")
    store.remove("r/step-2")
    c = TestClient(create_app(store, local=local))
    rows = c.get("/api/run/r").json()["snapshots"]
    assert [(r["step"], r["tier"], r["available"], r["damaged"]) for r in rows] == [
        (1, "durable + local", True, None), (2, "local", True, None), (3, "durable + local", True, None)]
    assert 'class="error damaged"' not in c.get("/run/r").text


def test_a_store_not_answering_is_no_damage_on_a_run_page(tmp_path):
    """A read of a step's manifest that failed in a way that may pass (a retryable StorageIOError: S3 throttling
    past its retries) drew that step "damaged" on a warm run page and dropped it from the view's caches. The page
    answers 503 as a checkpoint's does, and the next request draws the step as before."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app
    from ckpt_store.storage.errors import StorageIOError

    store = _small_run(ckpt.Store.init(str(tmp_path / "store")), "r", 3)
    c = TestClient(create_app(store))
    assert [r["tier"] for r in c.get("/api/run/r").json()["snapshots"]] == ["durable"] * 3
    mid, read, fail = store.resolve("r/step-2"), store.backend.read, [1]

    def flaky(path, *args, **kwargs):  # (the store's medium failing once, as a throttled S3 does)
        if path.endswith(mid) and fail[0]:
            fail[0] -= 1
            raise StorageIOError("read timed out", retryable=True)
        return read(path, *args, **kwargs)

    store.backend.read = flaky
    r = c.get("/api/run/r")
    assert r.status_code == 503 and "read timed out" in r.json()["error"]
    rows = c.get("/api/run/r").json()["snapshots"]
    assert [(x["tier"], x["damaged"]) for x in rows] == [("durable", None)] * 3


def test_an_overview_read_from_the_local_tier_is_not_the_stores(tmp_path):
    """Overviews were cached by id whichever store gave them: a run page read the local tier's (to tell its
    steps from pushed checkpoints), and the lineage of the store then drew step 2, whose manifest the store
    has lost (a fresh view leaves it out: no overview), as one of the run's snapshots, its chunks counted."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _small_run(ckpt.Store.init(str(tmp_path / "store")), "r", 4)
    store.ls()
    local = ckpt.Store.init(str(tmp_path / "local"))
    store.copy_to(local, ["r/step-1", "r/step-2", "r/step-3", "r/step-4"])
    _damage_manifest(store, tmp_path / "store", "r/step-2", "delete")

    def run_node(doc: dict) -> dict:
        return next(n for n in doc["nodes"] if n["kind"] == "run")

    fresh = run_node(TestClient(create_app(store, local=local)).get("/api/lineage").json())
    assert [s["step"] for s in fresh["snapshots"]] == [1, 3, 4]
    c = TestClient(create_app(store, local=local))
    assert c.get("/api/run/r").json()["snapshots"][1]["tier"] == "local"
    warm = run_node(c.get("/api/lineage").json())
    assert [s["step"] for s in warm["snapshots"]] == [1, 3, 4]  # was 1, 2, 3, 4
    assert warm["stored_bytes"] == fresh["stored_bytes"]


@pytest.mark.parametrize("few", [0, 100])
def test_a_damaged_snapshot_the_view_found_is_left_out_however_many_are_read(tmp_path, monkeypatch, few):
    """A run of 8 snapshots, the index summarizing each, step 2's manifest damaged since: past FEW_MANIFESTS
    uncached the lineage trusted the index (step 2 drawn, its chunks counted) while the overview page of the
    same view named it damaged; at FEW_MANIFESTS or fewer it read the manifests and left it out. One rule
    now: a summary is trusted, one the view found damaged (here by the overview page's check) is left out."""
    store = _run_with_step_2_damaged(tmp_path)
    monkeypatch.setattr(data, "FEW_MANIFESTS", few)
    monkeypatch.setattr(data.StoreView.overviews, "__defaults__", (None, few, None))
    view = StoreView(store)
    rows = {r["ref"]: r for r in view.overview_rows(view.ls())}  # the overview page checks each listed manifest
    assert "r/step-2" in rows and rows["r/step-2"]["damaged"]
    run = next(n for n in lineage(view)["nodes"] if n["kind"] == "run")
    assert [s["step"] for s in run["snapshots"]] == [1, 3, 4, 5, 6, 7, 8]
    sound = {c for s in (1, 3, 4, 5, 6, 7, 8) for c in catalog.own_chunks(store.manifest(store.resolve(f"r/step-{s}")))}
    assert run["stored_bytes"] == data.stored_bytes(sound, store.chunk_sizes())
    assert run_names(view) == ["r"]


def test_a_watched_run_page_reads_the_new_steps_manifest_not_the_index(tmp_path, monkeypatch):
    """A run page asked again after a save told the one new live step from pushed checkpoints by a load of the
    metadata index with every checkpoint's chunk lists (0.04-0.3 s; the step's manifest: 0.006 s). A few new
    steps are read from their manifests (the index is loaded for its ref records only)."""
    from ckpt_store.cli.web.runs import run_doc
    from ckpt_store.storage.index import StoreIndex

    store = _long_run(tmp_path)
    view = StoreView(store)
    run_doc(view, "train/long")
    with ckpt.CheckpointManager(store, "train/long", save_mode="sync") as mgr:
        mgr.save(STEPS + 1, {"step": STEPS + 1, "w": torch.ones(4)})
    loads = []
    real = StoreIndex.load
    monkeypatch.setattr(StoreIndex, "load", lambda self, *a, **k: loads.append(k) or real(self, *a, **k))
    doc = run_doc(view, "train/long")
    assert loads == [{}]  # the ref records (Store.readable_ref_history); was a load with the chunk lists besides
    assert [r["step"] for r in doc["snapshots"]][-1] == STEPS + 1 and doc["latest"] == store.resolve(f"train/long/step-{STEPS + 1}")


def test_a_run_page_takes_its_steps_entries_from_the_index_not_one_read_each(tmp_path, monkeypatch):
    """The run page read every entry file below the run's name (Store.readable_ref_history): each step's, and
    every entry of RUN/latest, one per save (1,500 snapshots: 3,000 files, 0.2 s of a warm page). Its steps
    only now, each entry from the metadata index where the listing shows its file as recorded; the document is
    the one the entry files give."""
    from ckpt_store.cli.web.runs import run_doc
    from ckpt_store.storage.index import StoreIndex
    from ckpt_store.storage.refs import Refs

    store = _long_run(tmp_path)
    read: list[tuple[str, int]] = []
    real = Refs._read
    monkeypatch.setattr(Refs, "_read", lambda self, name, seq, *a, **k: read.append((name, seq)) or real(self, name, seq, *a, **k))
    doc = run_doc(StoreView(store), "train/long")
    assert read == []  # was 2 * STEPS: every step's entry and every one of train/long/latest
    assert [r["step"] for r in doc["snapshots"]] == list(range(1, STEPS + 1))
    monkeypatch.setattr(StoreIndex, "recorded", lambda self: None)  # every entry read from its file
    assert run_doc(StoreView(store), "train/long") == doc
    # not latest's history: its newest entry alone (what a restore begins from, which the page marks latest)
    assert read and all(name.startswith("train/long/step-") or (name, seq) == ("train/long/latest", STEPS) for name, seq in read)


def test_a_run_page_reads_an_entry_file_changed_since_the_index_recorded_it(tmp_path):
    """The index is never trusted over the refs: an entry file the listing shows with another time than the
    record's (here step 2's rewritten to name step 3's checkpoint, at the same size) is read."""
    from ckpt_store.cli.web.runs import run_doc
    from ckpt_store.storage.refs import RefEntry

    store = _long_run(tmp_path)
    three = store.resolve("train/long/step-3")
    path = tmp_path / "store" / "refs" / "train" / "long" / "step-2" / "0000000001.ref"
    old = RefEntry.from_json(path.read_bytes(), "entry")
    new = RefEntry(old.name, old.seq, three, old.time, old.writer).to_json()
    assert len(new) == path.stat().st_size
    os.chmod(path, 0o644)
    path.write_bytes(new)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    rows = {r["step"]: r for r in run_doc(StoreView(store), "train/long")["snapshots"]}
    assert rows[2]["id"] == three


def test_a_runs_chunks_are_added_up_without_every_steps_set_held_at_once(tmp_path, monkeypatch):
    """The lineage kept every step's overview (its chunk set) in a dict while it added up the run's chunks:
    past the view's cache bound, a run's 1,500 sets at once. It keeps whether each is a snapshot; the sets
    are the view's cache's (here bounded to one), asked for a page of steps at a time. Same document."""
    import gc

    from ckpt.store.catalog import Overview
    from ckpt_store.cli.web import graph

    store = _long_run(tmp_path)
    want = lineage(StoreView(store))
    alive: list[int] = []
    real = graph.stored_bytes
    gc.collect()  # what earlier tests (a server's views) and the first view leave alive is not this lineage's
    before = sum(type(o) is Overview for o in gc.get_objects())

    def counting(chunks, sizes):
        alive.append(sum(type(o) is Overview for o in gc.get_objects()) - before)
        return real(chunks, sizes)

    monkeypatch.setattr(graph, "stored_bytes", counting)
    small = StoreView(store, cache_tensors=1)  # the view's caches keep one item each
    assert _sans_verified(lineage(small)) == _sans_verified(want)
    assert max(alive) <= 2, alive  # was STEPS: every step's, held by the lineage


def test_a_runs_lineage_past_the_views_cache_loads_the_index_once(tmp_path, monkeypatch):
    """The lineage asked a run's overviews a page of steps at a time (graph.HISTORY_PAGE, here 5 of the 24); past
    the view's cache each page loaded the whole metadata index again (a 1,500-step run with a 2,000-id cache: 16
    loads, 1.3-1.9 s of the page). The page's calls share one load; the view's cache stays bounded (one item
    here), and the document is the one a view caching every step draws."""
    from ckpt_store.cli.web import graph
    from ckpt_store.storage.index import StoreIndex

    store = _long_run(tmp_path)
    want = lineage(StoreView(store, cache_tensors=10**9))
    monkeypatch.setattr(graph, "HISTORY_PAGE", 5)
    loads = []
    real = StoreIndex.load
    monkeypatch.setattr(StoreIndex, "load", lambda self, *a, **k: loads.append(k.get("chunks", False)) or real(self, *a, **k))
    small = StoreView(store, cache_tensors=1)  # the view's caches keep one item each
    got = lineage(small)
    assert loads.count(True) == 1  # loads with the chunk lists: was 5 (one, then one per page of 5; the last 4 were read)
    assert len(small._overviews) == 1
    assert _sans_verified(got) == _sans_verified(want)
    loads.clear()
    assert _sans_verified(lineage(small)) == _sans_verified(want)  # and again with the cache past its bound
    assert loads.count(True) == 1


def test_the_pages_say_which_snapshots_are_drawn_unverified_and_name_a_damaged_one(tmp_path):
    """A fresh view draws a run's snapshots from the metadata index (as `ckpt ls` lists them): one damaged
    since, not yet read, was drawn like the others. The lineage marks those the view has not read as
    unverified and names `ckpt verify`; the run page, which reads its rows' manifests, named nothing for a
    kept step whose manifest failed its check (blank cells): it says damaged, with the error."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _run_with_step_2_damaged(tmp_path)
    c = TestClient(create_app(store))
    run = next(n for n in c.get("/api/lineage").json()["nodes"] if n["kind"] == "run")
    verified = {s["step"]: s["verified"] for s in run["snapshots"]}
    assert verified == {**dict.fromkeys(range(1, 8), False), 8: True}  # step 8 (the newest) is read: its time and size
    page = c.get("/lineage").text
    assert page.count('class="unverified" title=') == 7 and "<code>ckpt verify</code> checks every one" in page
    rows = {r["step"]: r for r in c.get("/api/run/r").json()["snapshots"]}
    assert rows[2]["live"] and not rows[2]["available"] and "is corrupt" in rows[2]["damaged"]
    assert all(rows[s]["damaged"] is None for s in (1, 3, 4, 5, 6, 7, 8))
    page = c.get("/run/r").text
    assert page.count('class="error damaged"') == 1 and "<code>ckpt verify</code> checks every snapshot" in page
    # The lineage asked again at once leaves out what the run page found damaged (it was cached for 5 s, step 2 drawn)
    run = next(n for n in c.get("/api/lineage").json()["nodes"] if n["kind"] == "run")
    assert [s["step"] for s in run["snapshots"]] == [1, 3, 4, 5, 6, 7, 8]


def test_a_run_page_on_s3_gets_no_ref_entry_the_index_records(s3_main_url):
    """On S3 each entry file the run page read was a GET: a step's, and each of RUN/latest's, one per save.
    The page's requests are the listings, the index's objects and the page's manifests."""
    from s3support import http_requests

    from ckpt_store.cli.web.runs import run_doc

    store = _small_run(ckpt.Store.init(s3_main_url), "train/s3p", 12)
    with http_requests(store.objects.backend) as seen:
        doc = run_doc(StoreView(store), "train/s3p")
    assert [r["step"] for r in doc["snapshots"]] == list(range(1, 13)) and all(r["available"] for r in doc["snapshots"])
    entries = [key for kind, key in seen if kind.startswith("GET") and "/refs/" in key and key.endswith(".ref")]
    assert entries == [], seen  # was 24: every step's entry and every one of train/s3p/latest


def _trained_run(root, local: bool = False) -> ckpt.Store:
    """Steps 1-5 of a real model and AdamW saved by a CheckpointManager at ``root/store``; with ``local``, each
    kept in the run's local tier at ``root/local`` and every second one persisted (step 5 is the tier's alone)."""
    torch.manual_seed(0)
    store = ckpt.Store.init(str(root / "store"))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.randint(0, 2, (16,))
    tier = {"local": str(root / "local"), "local_keep": 3, "local_every_n_steps": 1, "every_n_steps": 2} if local else {}
    with ckpt.CheckpointManager(store, "r", save_mode="sync", **tier) as mgr:
        for step in range(1, 6):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            (mgr.maybe_save if local else mgr.save)(step, {"model": model, "optim": opt, "step": step}, metrics={"loss": loss.item()})
    return store


def _resumed(store: ckpt.Store, root) -> int | str:
    """What a restart's ``restore_latest`` gives (the step, or the error's class): what the run page must say."""
    import warnings

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "step": 0}
    tier = {"local": str(root / "local")} if (root / "local").exists() else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the TierWarning of a step passed over)
        with ckpt.CheckpointManager(store, "r", save_mode="sync", **tier) as mgr:
            try:
                return mgr.restore_latest(state)
            except ckpt.CkptError as e:
                return type(e).__name__


def _damage_newest_chunk(store: ckpt.Store, root, ref: str, older: str, how: str) -> str:
    """Damage (``how``: "delete", "flip") a chunk of ``ref`` that ``older`` does not name, in the store at ``root``."""
    from ckpt.store.catalog import own_chunks

    cid = sorted(own_chunks(store.manifest(store.resolve(ref))) - own_chunks(store.manifest(store.resolve(older))))[0]
    path = root / "objects" / "chunks" / cid[:2] / cid
    if how == "delete":
        path.unlink()
    else:
        flip_a_byte(path)
    return cid


@pytest.mark.parametrize("what", ["manifest-delete", "manifest-flip", "chunk-delete"])
def test_a_damaged_newest_step_is_not_marked_latest(tmp_path, what):
    """The run page marked the newest kept step "latest" (and linked it as such) whatever its state: with its
    manifest gone or a bit flipped, or a chunk of it missing, a restart's restore_latest fails, and a user
    resuming from "latest" picked a step that cannot restore. The manager does not fall back to the step before
    (RUN/latest is what it restores): the page marks no step latest, draws step 5 damaged, and says why."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _trained_run(tmp_path)
    if what.startswith("manifest"):
        _damage_manifest(store, tmp_path / "store", "r/step-5", what.split("-")[1])
    else:
        _damage_newest_chunk(store, tmp_path / "store", "r/step-5", "r/step-4", "delete")
    c = TestClient(create_app(store))
    doc = c.get("/api/run/r").json()
    assert _resumed(store, tmp_path) in ("ObjectNotFoundError", "CorruptObjectError")  # what the page must agree with
    assert doc["latest"] is None and doc["latest_step"] is None and not any(r["latest"] for r in doc["snapshots"])
    assert doc["latest_error"].startswith(("step 5: ", "step 5 (r/latest): ")) and ("missing" in doc["latest_error"] or "corrupt" in doc["latest_error"])
    assert [(r["step"], r["tier"], bool(r["damaged"])) for r in doc["snapshots"]] == [
        (1, "durable", False), (2, "durable", False), (3, "durable", False), (4, "durable", False), (5, "damaged", True)]
    page = c.get("/run/r").text
    assert " · latest" not in page and 'id="latest"' not in page and 'id="no-latest"' in page
    assert 'class="error damaged"' in page


def test_a_local_step_no_tier_holds_whole_is_passed_over_for_latest_as_the_manager_does(tmp_path):
    """With a local tier, restore_latest passes over a snapshot no tier holds whole (step 5, kept in the tier
    alone, a chunk of it missing there) for the next newest, durable step 4: the page marked step 5 latest."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _trained_run(tmp_path, local=True)
    local = ckpt.Store.open(str(tmp_path / "local"))
    assert "r/step-5" in local.refs() and "r/step-5" not in store.refs()
    _damage_newest_chunk(local, tmp_path / "local", "r/step-5", "r/step-4", "delete")
    c = TestClient(create_app(store, local=local))
    doc = c.get("/api/run/r").json()
    assert _resumed(store, tmp_path) == 4
    rows = {r["step"]: r for r in doc["snapshots"]}
    assert [s for s, r in rows.items() if r["latest"]] == [4]  # was 5
    assert doc["latest_step"] == 4 and doc["latest"] == store.resolve("r/step-4") and doc["latest_error"] is None
    assert rows[5]["tier"] == "damaged" and "is missing from every tier" in rows[5]["damaged"]
    assert doc["latest_url"] == "/checkpoint/r/step-4" and 'href="/checkpoint/r/step-4" class="mono" id="latest"' in c.get("/run/r").text


def test_a_step_the_local_tier_alone_holds_links_to_no_page_of_the_store(tmp_path):
    """A step kept in the local tier alone (not persisted yet) linked to /checkpoint/r/step-5 of the durable store,
    a 404 ("no such ref"); so did "Latest", and the chart's points of removed steps (their refs are gone). Every link
    of the run page now answers; the tier's step is said to be local only, not yet durable."""
    import re

    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _trained_run(tmp_path, local=True)
    store.remove("r/step-2")  # (retention)
    local = ckpt.Store.open(str(tmp_path / "local"))
    c = TestClient(create_app(store, local=local))
    page = c.get("/run/r").text
    links = set(re.findall(r'href="(/checkpoint/[^"]+)"', page))
    assert links and {u: c.get(u).status_code for u in links} == dict.fromkeys(links, 200)  # r/step-5, -3, -2, latest: 404
    doc = c.get("/api/run/r").json()
    assert _resumed(store, tmp_path) == 5 and doc["latest_step"] == 5 and doc["latest_url"] is None
    assert [(r["step"], r["tier"], r["url"]) for r in doc["snapshots"]] == [
        (2, "removed", f"/checkpoint/{doc['snapshots'][0]['id']}"), (3, "local", None),
        (4, "durable + local", "/checkpoint/r/step-4"), (5, "local", None)]
    assert page.count("local only, not yet durable") == 5  # steps 3 and 5 (row and chart point), and "Latest"


def test_a_damaged_durable_latest_is_read_from_the_local_tier_as_the_manager_does(tmp_path):
    """The durable copy of RUN/latest's manifest damaged while the local tier holds that snapshot whole: the manager's
    restore_latest read the store's copy alone and failed (the page marked no step latest, as it did); it now reads the
    tier's copy of that id (checked by its hash) and restores the tier's newest step, 5. The page marks step 5 latest
    with it; step 4 is drawn as the tier holds it ("local"), the store's damage named."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = _trained_run(tmp_path, local=True)
    _damage_manifest(store, tmp_path / "store", "r/step-4", "flip")
    doc = TestClient(create_app(store, local=ckpt.Store.open(str(tmp_path / "local")))).get("/api/run/r").json()
    assert _resumed(store, tmp_path) == 5
    assert [r["step"] for r in doc["snapshots"] if r["latest"]] == [5] and doc["latest_step"] == 5
    assert doc["latest_error"] is None and doc["latest"] == ckpt.Store.open(str(tmp_path / "local")).resolve("r/step-5")
    assert [(r["step"], r["tier"], bool(r["damaged"])) for r in doc["snapshots"]] == [
        (2, "durable", False), (3, "local", False), (4, "local", True), (5, "local", False)]
    # step 4's ref is the durable store's (its manifest damaged there): linked to its page, which names the damage, and
    # never "local only" (review rev22m); steps 3 and 5 the local tier alone holds
    assert [(r["step"], r["url"], r["local_only"]) for r in doc["snapshots"]] == [
        (2, "/checkpoint/r/step-2", False), (3, None, True), (4, "/checkpoint/r/step-4", False), (5, None, True)]


def test_the_newest_steps_chunks_missing_from_the_cached_listing_are_asked_for_once_each(tmp_path, monkeypatch):
    """The run page's check that every chunk of the latest is in a tier asked the store, for each chunk the view's
    cached listing lacked (a save since it was made, or chunks really gone), about all of them again: N squared
    size queries (100 chunks on moto, 10,000 HEADs and 36 s for one page; review rev22w). One query per chunk now."""
    from ckpt_store.cli.web.runs import run_doc
    from ckpt_store.storage.objects import ObjectStore

    store = ckpt.Store.init(str(tmp_path / "s"))
    state = {f"w{i}": torch.randn(64) for i in range(60)}  # a chunk each
    view = StoreView(store, ttl_s=600)
    with ckpt.CheckpointManager(store, "r", save_mode="sync") as mgr:
        mgr.save(1, state)
        run_doc(view, "r")  # a page load: the view lists the store's chunks, kept for ttl_s
        for t in state.values():
            t.add_(1)
        mgr.save(2, state)  # the run's next save, within ttl_s of that listing
    asked: list[str] = []
    real = ObjectStore.size

    def size(self, kind, oid):
        asked.append(oid)
        return real(self, kind, oid)
    monkeypatch.setattr(ObjectStore, "size", size)
    doc = run_doc(view, "r")
    assert doc["latest_step"] == 2 and doc["latest_error"] is None
    assert 60 <= len(asked) <= 2 * 61, len(asked)  # (each new chunk once; was 3,600)


def test_a_durable_step_that_cannot_be_restored_keeps_its_link_and_is_never_called_local_only(tmp_path):
    """No local tier; a chunk of the newest step deleted: restore_latest fails, and the page cleared the step's tiers,
    so it lost its link (its checkpoint page names the missing chunk) and was drawn "(local only, not yet durable)"
    on a store without a local tier (review rev22w). It links to its page, drawn damaged, never local only."""
    from starlette.testclient import TestClient

    from ckpt.store.catalog import own_chunks
    from ckpt_store.cli.web.app import create_app

    store = ckpt.Store.init(str(tmp_path / "s"))
    w = {"w": torch.randn(4096)}
    with ckpt.CheckpointManager(store, "r", save_mode="sync") as mgr:
        for step in (1, 2, 3):
            w["w"].add_(1)
            mgr.save(step, w, metrics={"loss": 1.0 / step})
    cid = sorted(own_chunks(store.manifest(store.resolve("r/step-3"))) - own_chunks(store.manifest(store.resolve("r/step-2"))))[0]
    (tmp_path / "s" / "objects" / "chunks" / cid[:2] / cid).unlink()
    client = TestClient(create_app(store))
    doc = client.get("/api/run/r").json()
    row = next(r for r in doc["snapshots"] if r["step"] == 3)
    assert row["url"] == "/checkpoint/r/step-3" and row["damaged"] and not row["local_only"], row
    assert doc["latest"] is None and doc["latest_error"]
    assert "local only" not in client.get("/run/r").text
    assert client.get(row["url"]).status_code == 200


def test_the_latest_links_to_its_page_when_its_row_is_on_another_page_or_its_step_ref_is_gone(tmp_path):
    """RUN/latest names step 5, whose step ref a user removed: restore_latest restores it. With its row on another page
    of the run, the page said "step 5, ID (local only, not yet durable)" without a link, on a store with no local tier
    (review rev22w): it links to the checkpoint's page by id, which answers."""
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    store = ckpt.Store.init(str(tmp_path / "s"))
    w = {"w": torch.randn(256)}
    with ckpt.CheckpointManager(store, "r", save_mode="sync") as mgr:
        for step in range(1, 6):
            w["w"].add_(1)
            mgr.save(step, w)
    mid = store.resolve("r/step-5")
    store.remove("r/step-5")
    assert _resumed_plain(store) == 5
    client = TestClient(create_app(store))
    for q in ("", "?limit=2"):
        doc = client.get("/api/run/r" + q).json()
        assert doc["latest_step"] == 5 and doc["latest_url"] == f"/checkpoint/{mid}", (q, doc["latest_url"])
        assert "local only" not in client.get("/run/r" + q).text
    assert client.get(f"/checkpoint/{mid}").status_code == 200


def _resumed_plain(store: ckpt.Store) -> int | None:
    with ckpt.CheckpointManager(store, "r", save_mode="sync") as mgr:
        return mgr.restore_latest({"w": torch.zeros(256)})
