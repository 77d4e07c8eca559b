from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest
import torch

import ckpt
from ckpt_store.storage.chunk_lists import referenced_chunks
from ckpt_store.storage.gc import Root, gc_roots


def _age(store_path, seconds):
    """Make every object look ``seconds`` old."""
    t = time.time() - seconds
    for root, _, files in os.walk(os.path.join(store_path, "objects")):
        for f in files:
            os.utime(os.path.join(root, f), (t, t))


def test_user_json_named_chunks_is_not_a_chunk_list(tmp_path):
    """Non-tensor state may hold a key "chunks" (e.g. a data loader's position): it names no chunk."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    mid = store.push({"w": torch.ones(8)}, "a", metadata={"chunks": "3"})
    assert len(referenced_chunks(store.objects.get_manifest(mid))) == 2  # the file header and the data
    m = b'{"extra":{"loader":{"chunks":["not-an-id"]}},"format":"ckpt-manifest","tensors":[{"chunks":["' + b"b" * 64 + b'"]}],"version":1}'
    assert referenced_chunks(m) == {"b" * 64}


def test_referenced_chunks_rule():
    m = b'{"files":[{"chunks":["' + b"a" * 64 + b'"]}],"format":"ckpt-manifest","tensors":[{"chunks":["' + b"b" * 64 + b'"],"delta_bases":[["' + b"c" * 64 + b'"]]}],"version":1}'
    assert referenced_chunks(m) == {"a" * 64, "b" * 64, "c" * 64}


def test_gc_frees_removed_ref_and_keeps_shared(tmp_path):
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    shared = torch.randn(1000)
    store.push({"shared": shared, "own": torch.randn(500)}, "a")
    store.push({"shared": shared, "own": torch.randn(500) + 5}, "b")
    store.remove("a")
    _age(path, 7200)
    dry = store.gc(grace_s=3600, dry_run=True)
    assert dry.planned == 2  # a's manifest and a's own chunk (headers are equal, so shared)
    assert store.verify().ok
    r = store.gc(grace_s=3600)
    assert len(r.deleted) == 2
    assert store.verify().ok
    assert torch.equal(store.load("b")["shared"], shared)
    assert store.gc(grace_s=0).planned == 0


def test_gc_respects_grace_period(tmp_path):
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push({"x": torch.randn(100)}, "a")
    store.remove("a")
    r = store.gc(grace_s=3600)
    assert r.deleted == [] and r.young == 3


def test_gc_keeps_history_unless_told(tmp_path):
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    first = {"x": torch.randn(100)}
    store.push(first, "a")
    store.push({"x": torch.randn(100)}, "a")
    _age(path, 10)
    store.gc(grace_s=0)
    assert torch.equal(store.load("a@1")["x"], first["x"])
    store.gc(grace_s=0, keep_history=False)
    with pytest.raises(ckpt.CkptError):
        store.load("a@1")
    assert store.verify().ok


def test_touched_objects_survive(tmp_path):
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    t = {"x": torch.randn(100)}
    store.push(t, "a")
    store.remove("a")
    _age(path, 7200)
    plan_first = store.gc(grace_s=3600, dry_run=True)
    assert plan_first.planned == 3
    store.push(t, "b")  # reuses (and touches) the same chunks
    store.gc(grace_s=3600)
    assert store.verify().ok
    assert torch.equal(store.load("b")["x"], t["x"])


def test_gc_removes_stale_temporaries(tmp_path):
    """Leftovers of writes killed mid-way, below objects/, refs/ and index/ (a push killed while
    it wrote the metadata index left one there), go once they are older than the grace period."""
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    leftovers = [tmp_path / "s" / sub / ".tmp-deadbeef" for sub in ("objects/chunks/ab", "refs/run", "index")]
    for f in leftovers:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"partial")
    old = time.time() - 7200
    for f in leftovers:
        os.utime(f, (old, old))
    young = tmp_path / "s" / "index" / ".tmp-young"
    young.write_bytes(b"a write in progress")
    r = store.gc(grace_s=3600)
    assert [x.kind for x in r.deleted] == ["temp"] * 3
    assert not any(f.exists() for f in leftovers) and young.exists()


def test_gc_reports_the_size_of_the_temporaries_it_deletes(tmp_path):
    """Stale temporaries were reported as 0 bytes freed (`ckpt gc` said "0 B" after deleting a
    killed push's half-written 3 MB chunk): each is reported with its size, as objects are."""
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    sizes = {"objects/chunks/ab/.tmp-1": 3 << 20, "refs/run/.tmp-2": 321, "index/.tmp-3": 7}
    old = time.time() - 7200
    for rel, n in sizes.items():
        f = tmp_path / "s" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(os.urandom(n))
        os.utime(f, (old, old))
    dry = store.gc(grace_s=3600, dry_run=True)
    r = store.gc(grace_s=3600)
    assert {d.name: d.size for d in dry.deleted} == {d.name: d.size for d in r.deleted} == sizes
    assert dry.bytes == r.bytes == sum(sizes.values())


def test_a_dry_run_lists_the_refs_once(tmp_path):
    """A dry run previews from the metadata index, checked against a listing of refs/; it then
    listed refs/ again for leftovers of interrupted writes (on S3 a LIST page per 1,000 entries,
    locally a stat per entry): that listing gives them. What it plans is unchanged."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    for i in range(3):
        store.push({"x": torch.full((8,), float(i))}, f"run/m{i}")
    store.ls()  # an index snapshot, as a store in use has
    old = time.time() - 7200
    for rel in ("refs/run/m1/.tmp-1", "index/.tmp-2"):
        (tmp_path / "s" / rel).write_bytes(b"partial")
        os.utime(tmp_path / "s" / rel, (old, old))
    listed = []
    b = store.backend
    real, real_tree = b.list, b.tree
    b.list = lambda prefix: listed.append(prefix) or real(prefix)  # type: ignore[method-assign]
    b.tree = lambda prefix: listed.append(prefix) or real_tree(prefix)  # type: ignore[method-assign]  # (list and folders)
    dry = store.gc(grace_s=3600, dry_run=True)
    assert listed.count("refs") == 1
    plain = ckpt.Store.open(store.url, settings=ckpt.Settings.from_env(index=False)).gc(grace_s=3600, dry_run=True)
    assert [(d.kind, d.name, d.size) for d in dry.deleted] == [(d.kind, d.name, d.size) for d in plain.deleted]
    assert {d.name for d in dry.deleted if d.kind == "temp"} == {"refs/run/m1/.tmp-1", "index/.tmp-2"}


# -- the delete protocol under a concurrent touch ---------------------------------------


def _backend(tmp_path):
    from ckpt_store.storage.backends.local import LocalBackend

    return LocalBackend(str(tmp_path), fsync=False)


def test_delete_if_stale_deletes_old_and_keeps_touched(tmp_path):
    b = _backend(tmp_path)
    b.write("objects/chunks/ab/old", b"x")
    b.write("objects/chunks/ab/new", b"y")
    past = time.time() - 100
    os.utime(tmp_path / "objects/chunks/ab/old", (past, past))
    cutoff = time.time() - 50
    assert b.delete_if_stale("objects/chunks/ab/old", cutoff) is True
    assert b.delete_if_stale("objects/chunks/ab/new", cutoff) is False
    assert b.delete_if_stale("objects/chunks/ab/missing", cutoff) is False
    assert not b.exists("objects/chunks/ab/old") and b.read("objects/chunks/ab/new") == b"y"
    assert b.touch("objects/chunks/ab/new") is True and b.touch("objects/chunks/ab/old") is False
    assert list(b.list("objects")) and not [e for e in b.list("objects") if ".tmp-" in e.path]


@pytest.mark.parametrize("when", ["after the rename", "before the link back"])
def test_a_gc_interrupted_while_an_object_is_condemned_leaves_it_to_be_put_back(when, tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM (both unwind as KeyboardInterrupt in the CLI) landing after gc renamed an
    object to its condemned name, before it decided, ran the cleanup that unlinks the condemned
    name: an object a writer had just touched (live from then on) was deleted, where a gc killed
    there leaves it for the next one to put back. Interrupted, it is now left the same way."""
    import ckpt_store.storage.backends.local as local

    b = _backend(tmp_path)
    b.write("objects/chunks/ab/obj", b"data")
    past = time.time() - 100
    os.utime(tmp_path / "objects/chunks/ab/obj", (past, past))
    real_rename, real_stat = os.rename, os.stat

    def rename(src, dst):
        real_rename(src, dst)
        os.utime(dst)  # a writer's touch that landed just before the rename: the object is live

    def stat(path, *a, **kw):
        if when == "after the rename" and ".tmp-gc-" in os.fspath(path):
            raise KeyboardInterrupt
        return real_stat(path, *a, **kw)

    def link(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(local.os, "rename", rename)
    monkeypatch.setattr(local.os, "stat", stat)
    monkeypatch.setattr(local.os, "link", link)
    with pytest.raises(KeyboardInterrupt):
        b.delete_if_stale("objects/chunks/ab/obj", time.time() - 50)
    monkeypatch.undo()
    assert b.recover_condemned("objects") == 1
    assert b.read("objects/chunks/ab/obj") == b"data"


def test_a_touch_racing_the_delete_is_never_lost(tmp_path):
    """A writer that touched an object successfully may rely on it: the gc racing it keeps it.

    Two threads start together, many times: gc deleting an old object, a writer
    touching it (or writing it again when the touch finds it gone). Afterwards the
    object must exist whenever the writer's touch succeeded; both orders must occur.
    A tiny thread switch interval makes the threads interleave inside the protocol:
    with it, plain check-then-delete (``Backend.delete_if_stale``) lost the touched
    object in 7 of 600 rounds here.
    """
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _race(tmp_path)
    finally:
        sys.setswitchinterval(interval)


def _race(tmp_path):
    import threading

    b = _backend(tmp_path)
    path = "objects/chunks/cd/obj"
    outcomes = {"touched": 0, "rewritten": 0, "deleted": 0}
    # 600 rounds, then on until both orders have occurred (a loaded machine can run one
    # order hundreds of times in a row), at most 6,000.
    for rounds in range(6000):
        if rounds >= 600 and outcomes["touched"] and outcomes["deleted"]:
            break
        b.write(path, b"data")
        past = time.time() - 100
        os.utime(tmp_path / path, (past, past))
        barrier = threading.Barrier(2)
        result = {}

        def gc():
            barrier.wait()
            result["deleted"] = b.delete_if_stale(path, time.time() - 50)

        def writer():
            barrier.wait()
            if b.touch(path):
                result["touched"] = True
            else:
                b.write(path, b"data")
                result["touched"] = False

        errors = []

        def run(fn):
            try:
                fn()
            except BaseException as e:  # reported below, not lost in the thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(gc,)), threading.Thread(target=run, args=(writer,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert b.exists(path) and b.read(path) == b"data", (result, outcomes)  # touched or rewritten: it is there
        outcomes["touched" if result["touched"] else "rewritten"] += 1
        outcomes["deleted"] += result["deleted"]
    assert not [e.path for e in b.list("objects") if ".tmp-" in e.path]
    # Both orders occurred: the writer's touch came first (gc kept the object) and gc's
    # rename came first (the touch failed and the writer wrote the object again). A round
    # in which gc deleted is always one whose writer rewrote (a touch that succeeded keeps
    # the object); a rewrite can also meet a gc that then leaves the new object alone.
    assert outcomes["touched"] > 0 and outcomes["rewritten"] > 0, outcomes
    assert 0 < outcomes["deleted"] <= outcomes["rewritten"], outcomes


def test_gc_killed_mid_delete_is_recovered(tmp_path):
    """A gc killed between condemning an object and deciding leaves it recoverable."""
    from ckpt_store.storage.backends.base import CONDEMNED

    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    t = torch.arange(1000, dtype=torch.float32)
    store.push({"t": t}, "a")
    mid = store.resolve("a")
    mpath = store.objects.path("manifests", mid)
    head, _, name = mpath.rpartition("/")
    os.rename(os.path.join(path, mpath), os.path.join(path, head, f"{CONDEMNED}0123abcd-{name}"))
    assert not store.verify().ok  # the ref's manifest is missing now
    r = store.gc(grace_s=0)
    assert r.recovered == 1
    assert store.verify().ok and torch.equal(store.load("a")["t"], t)


def test_a_removed_then_repushed_ref_does_not_revive_its_old_history(tmp_path):
    """Found by tests/test_concurrency.py: gc used to treat pre-removal history as roots and stop on it."""
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    store.push({"x": torch.full((1000,), 1.0)}, "r")
    store.remove("r")
    _age(path, 7200)
    assert {d.kind for d in store.gc(grace_s=3600).deleted} >= {"manifests", "chunks"}  # the old version goes
    new = torch.full((1000,), 2.0)
    store.push({"x": new}, "r")
    assert [e.target is None for e in store.log("r")] == [False, True, False]
    _age(path, 7200)
    assert store.gc(grace_s=3600).deleted == []  # no error on the gone history, nothing live lost
    assert store.verify().ok and torch.equal(store.load("r")["x"], new)


def test_gc_roots_is_what_gc_keeps_and_what_verify_checks(tmp_path):
    """One owner for "what gc keeps": versions labelled as `ckpt log` and `resolve` count them."""
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    a1 = store.push({"x": torch.full((10,), 1.0)}, "a")
    a2 = store.push({"x": torch.full((10,), 2.0)}, "a")
    store.push({"x": torch.full((10,), 3.0)}, "gone")
    store.remove("gone")
    b1 = store.push({"x": torch.full((10,), 4.0)}, "b")
    store.refs_db.set("b/latest", b1, alias=True)
    roots = gc_roots(store.refs_db).roots
    assert roots == [Root("a", 0, a2), Root("a", 1, a1), Root("b", 0, b1), Root("b/latest", 0, b1)]
    assert [r.label for r in roots] == ["a", "a@1", "b", "b/latest"]
    assert all(store.resolve(r.label) == r.target for r in roots)
    assert [r.label for r in gc_roots(store.refs_db, keep_history=False).roots] == ["a", "b", "b/latest"]
    report = store.verify()
    assert report.ok and (report.refs_checked, report.versions_checked) == (3, 1)


def test_verify_reports_a_damaged_history_manifest(tmp_path):
    """Issue 15 item 5: a corrupt manifest of NAME@1 broke `pull NAME@1` and `gc -n`, yet verify said ok."""
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    store.push({"x": torch.full((10,), 1.0)}, "a")
    store.push({"x": torch.full((10,), 2.0)}, "a")
    old = store.resolve("a@1")
    with open(os.path.join(path, store.objects.path("manifests", old)), "r+b") as f:
        f.write(b"XX")
    with pytest.raises(ckpt.CkptError, match="corrupt"):
        store.gc(grace_s=0, dry_run=True)  # gc cannot know what it keeps: it stops, and says to verify
    report = store.verify()
    assert not report.ok and list(report.damaged_refs) == ["a@1"]
    assert ("manifest", old) in report.damaged_objects  # so `verify --repair-from` puts it back
    # a missing chunk of an earlier version is damage too (gc keeps it alive)
    store.push({"x": torch.full((10,), 3.0)}, "c")
    store.push({"x": torch.full((10,), 4.0)}, "c")
    cid = store.manifest("c@1").tensors[0].chunks[0]
    os.remove(os.path.join(path, store.objects.path("chunks", cid)))
    assert "c@1" in store.verify().damaged_refs and "c" not in store.verify().damaged_refs


def test_gc_after_gc_no_history_runs(tmp_path):
    """`gc --no-history` frees earlier versions; a plain gc afterwards used to stop on their missing
    manifests with "run `ckpt verify`", and verify then said ok."""
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    store.push({"x": torch.full((100,), 1.0)}, "a")
    latest = {"x": torch.full((100,), 2.0)}
    store.push(latest, "a")
    _age(path, 10)
    assert store.gc(grace_s=0, keep_history=False).deleted
    assert store.gc(grace_s=0).deleted == []
    r = store.verify()
    assert r.ok and r.freed == ["a@1"]
    assert torch.equal(store.load("a")["x"], latest["x"])


def test_an_alias_written_over_a_plain_ref_keeps_its_earlier_targets(tmp_path):
    """History is kept by entry: a plain ref whose newest entry is an alias (another store's alias
    copied over it, say) keeps its earlier, plain versions alive."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    a1 = store.push({"x": torch.full((10,), 1.0)}, "main")
    a2 = store.push({"x": torch.full((10,), 2.0)}, "main")
    other = store.push({"x": torch.full((10,), 3.0)}, "other")
    store.refs_db.set("main", other, alias=True)
    assert [r.target for r in gc_roots(store.refs_db).roots if r.ref == "main"] == [other, a2, a1]
    _age(str(tmp_path / "s"), 7200)
    store.gc(grace_s=0)
    assert torch.equal(store.load("main@2")["x"], torch.full((10,), 1.0)) and store.verify().ok


def test_gc_deletes_by_the_manifests_never_by_the_index(tmp_path):
    """The metadata index is never trusted over refs and manifests: an index log (sealed, not
    signed) that says a live manifest names no chunks made gc free all of them. A dry run may
    preview from the index; what deletes reads the manifests."""
    from ckpt_store.storage.records import sealed_json

    path = tmp_path / "s"
    store = ckpt.Store.init(str(path))
    mid = store.push({"w": torch.randn(1000), "b": torch.randn(10)}, "base")
    store.gc(grace_s=3600)  # the index now holds the manifest's chunk list
    gen = max(int(n[:10]) for n in os.listdir(path / "index")) + 1
    lie = {"format": "ckpt-index-log", "version": 1, "gen": gen,
           "ref": {"name": "nobody", "rec": [1, None, 0.0, "w", False, 0, None]},
           "manifest": {"id": mid, "info": {}, "sig": None, "chunks": [], "detail": None}}
    (path / "index" / f"{gen:010d}.log").write_bytes(sealed_json(lie))
    _age(str(path), 7200)
    store = ckpt.Store.open(str(path))
    store.gc(grace_s=0)
    assert store.verify().ok and store.load("base")["b"].numel() == 10


def test_a_dry_run_plans_with_what_a_killed_gc_left_condemned_as_the_real_run_will(tmp_path):
    """A gc killed mid-delete leaves objects renamed ``.tmp-gc-<hex>-<id>``; the next gc puts them back
    first, but a dry run (which writes nothing) listed them as stale temporaries to delete: a live
    chunk among them was shown as deleted, and a condemned unreferenced chunk as a temporary. The
    dry run now plans with them as the objects the real run's recovery will find."""
    from ckpt_store.storage.backends.base import CONDEMNED

    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    store.push({"w": torch.randn(1000)}, "live")
    store.push({"own": torch.randn(500) + 5}, "gone")
    gone = store.manifest("gone").tensors[0].chunks[0]
    store.remove("gone")

    def condemn(cid: str, tag: str, keep: bool = False) -> None:
        p = os.path.join(path, store.objects.path("chunks", cid))
        head, name = os.path.split(p)
        os.link(p, os.path.join(head, f"{CONDEMNED}{tag * 32}-{name}"))
        if not keep:
            os.unlink(p)

    live = store.manifest("live").tensors[0].chunks[0]
    condemn(live, "a")
    condemn(gone, "b")
    other = sorted(referenced_chunks(store.objects.get_manifest(store.resolve("live"))) - {live})[0]
    condemn(other, "c", keep=True)  # its name taken: dropped on recovery
    _age(path, 7200)
    dry = store.gc(grace_s=3600, dry_run=True)
    real = store.gc(grace_s=3600)
    assert sorted(dry.deleted, key=str) == sorted(real.deleted, key=str) and gone in {d.name for d in real.deleted}
    assert (dry.live_chunks, dry.young) == (real.live_chunks, real.young)
    assert store.verify().ok


@pytest.mark.parametrize("index", ["1", "0"])
@pytest.mark.parametrize("version", ["current", "history"])
def test_a_dry_run_reads_a_root_manifest_a_killed_gc_left_condemned(version, index, tmp_path, monkeypatch):
    """A gc killed mid-delete may leave a *root manifest* condemned (``.tmp-gc-<hex>-<id>``): the real
    run puts it back first and keeps what it names, but the dry run, which writes nothing, looked for it
    under its name: it failed ("manifest ... is missing") for a current target, and for a history
    version planned to delete it and its chunks. It now reads it where the recovery will find it."""
    from ckpt_store.storage.backends.base import CONDEMNED

    monkeypatch.setenv("CKPT_INDEX", index)
    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    torch.manual_seed(0)
    store.push({"w": torch.randn(1000)}, "r")
    store.push({"w": torch.randn(1000)}, "r")
    store.ls()  # the index summarises the current target only
    mid = store.resolve("r" if version == "current" else "r@1")
    p = os.path.join(path, store.objects.path("manifests", mid))
    os.rename(p, os.path.join(os.path.dirname(p), f"{CONDEMNED}{'a' * 32}-{mid}"))
    _age(path, 7200)
    store = ckpt.Store.open(path)
    dry = store.gc(grace_s=3600, dry_run=True)
    real = store.gc(grace_s=3600)
    assert real.deleted == [] and os.path.exists(p)
    assert (dry.deleted, dry.live_manifests, dry.live_chunks) == (real.deleted, real.live_manifests, real.live_chunks)
    assert store.verify().ok


def test_an_object_a_stopped_gc_left_condemned_is_reported_as_set_aside_not_lost(tmp_path):
    """Until the next gc puts them back, reading a manifest or chunk a stopped gc left condemned said
    it "is missing from the store" and to run `ckpt verify`, which called the ref damaged: nothing
    said the data was there, and that `ckpt gc` brings it back. The error now says so."""
    from ckpt_store.storage.backends.base import CONDEMNED
    from ckpt_store.storage.errors import ObjectNotFoundError

    path = str(tmp_path / "s")
    store = ckpt.Store.init(path)
    torch.manual_seed(0)
    store.push({"w": torch.randn(1000)}, "r")
    store.push({"v": torch.randn(10)}, "gone")
    mid, gone = store.resolve("r"), store.resolve("gone")
    p = os.path.join(path, store.objects.path("manifests", mid))
    os.rename(p, os.path.join(os.path.dirname(p), f"{CONDEMNED}{'a' * 32}-{mid}"))
    os.unlink(os.path.join(path, store.objects.path("manifests", gone)))
    store = ckpt.Store.open(path)
    with pytest.raises(ObjectNotFoundError) as e:
        store.manifest("r")
    assert "`ckpt gc` puts it back" in str(e.value.hint)
    with pytest.raises(ObjectNotFoundError) as e:
        store.manifest("gone")
    assert "ckpt verify" in str(e.value.hint)  # truly missing: as before
    store.remove("gone")
    store.gc(grace_s=3600)
    assert store.verify().ok and store.manifest("r").tensors[0].name == "w"


def test_gc_reports_only_what_it_deleted(store_url):
    """An object in the plan that is gone when gc comes to delete it (another gc took it, or it was
    lost) is not in the report: on fsspec stores (memory://, ...) a missing object's time read as
    0.0, so gc 'deleted' it and counted it, bytes and all."""
    from ckpt_store.storage.gc import execute_gc, plan_gc

    store = ckpt.Store.init(store_url)
    for i in range(3):
        store.push({"x": torch.full((100,), float(i))}, "a")
    plan = plan_gc(store.objects, store.refs_db, grace_s=-60, keep_history=False)  # everything counts as old
    assert sorted(d.kind for d in plan.delete) == ["chunks", "chunks", "manifests", "manifests"]
    gone, kept = plan.delete[::2], plan.delete[1::2]
    for d in gone:
        store.backend.delete(store.objects.path(d.kind, d.name))
    assert list(execute_gc(store.objects, plan)) == kept
    assert not any(store.objects.has(d.kind, d.name) for d in plan.delete)


@pytest.mark.parametrize("what", ["file", "fifo", "link to nothing"])
def test_a_refs_folder_that_is_not_a_folder_stops_gc(tmp_path, what):
    """refs/ replaced by a file, a FIFO, or a symbolic link to a disk that is not mounted listed as
    no ref at all: `ckpt ls` said the store was empty, and a gc deleted every checkpoint in it.
    The refs cannot be listed: every command that needs them says so, and gc deletes nothing."""
    import shutil

    from ckpt.errors import StoreFormatError

    path = tmp_path / "s"
    store = ckpt.Store.init(str(path))
    store.push({"w": torch.randn(1000)}, "a")
    _age(path, 86400)
    before = sorted(p for p in (path / "objects").rglob("*") if p.is_file())
    shutil.rmtree(path / "refs")
    if what == "file":
        (path / "refs").write_bytes(b"x")
    elif what == "fifo":
        os.mkfifo(path / "refs")
    else:
        (path / "refs").symlink_to(tmp_path / "unmounted" / "refs")
    store = ckpt.Store.open(str(path))
    for call in (lambda: store.gc(grace_s=60), lambda: store.gc(grace_s=60, dry_run=True), store.ls, store.du):
        with pytest.raises(StoreFormatError, match="the store's refs folder, is not a folder"):
            call()
    assert sorted(p for p in (path / "objects").rglob("*") if p.is_file()) == before


@pytest.mark.parametrize("history", [True, False])
def test_gc_beside_a_ref_folder_no_command_can_name_says_what_is_damaged(tmp_path, history):
    """refs/m@1/ holding a sealed entry (no command can name it: m@1 is version 1 of m) is damage,
    but gc failed with "invalid ref name 'm@1' (use segments of letters...)", as if the user had
    typed it: checking whether that ref's newest entry could be read validated its name. gc now
    says that it deleted nothing and which folder to rename or remove."""
    from ckpt.errors import StoreFormatError
    from ckpt_store.storage.refs import RefEntry

    path = tmp_path / "s"
    store = ckpt.Store.init(str(path))
    mid = store.push({"w": torch.randn(100)}, "m")
    (path / "refs" / "m@1").mkdir()
    (path / "refs" / "m@1" / "0000000001.ref").write_bytes(RefEntry("m@1", 1, mid, time.time(), "w").to_json())
    for dry_run in (True, False):
        with pytest.raises(StoreFormatError, match=r"gc deleted nothing: .*refs/m@1/, which is not a valid ref name"):
            store.gc(grace_s=60, dry_run=dry_run, keep_history=history)


# -- ages by the store's clock ---------------------------------------------------------

# A gc on a machine whose clock runs 2 h ahead of the store's (a container without NTP): test-only,
# the process's time.time is moved, not the system clock.
_SKEWED_GC = ("import sys, time\n"
              "real = time.time\n"
              "time.time = lambda: real() + 7200\n"
              "from ckpt_store.cli.main import main\n"
              "main(sys.argv[1:])\n")


def _in_progress(url: str) -> set[str]:
    """What a push in progress has written, its ref not yet landed: objects a second old."""
    store = ckpt.Store.init(url)
    store.push({"w": torch.arange(1000, dtype=torch.float32)}, "b")
    store.remove("b")  # (the push's objects, referenced by no ref, as before its commit)
    return {e.path for e in store.backend.list("objects")}


def _skewed_gc_keeps_what_is_young(url: str, *flags: str, env: dict[str, str] | None = None) -> None:
    written = _in_progress(url)
    r = subprocess.run([sys.executable, "-c", _SKEWED_GC, "--store", url, "gc", "--grace", "1h", *flags],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    verb = "would delete" if "--dry-run" in flags else "deleted"
    assert f"{verb} 0 objects" in r.stdout and "3 recent unreferenced objects" in r.stdout, r.stdout
    assert "this machine's clock is 720" in r.stderr and "s ahead of the clock of the store" in r.stderr
    assert {e.path for e in ckpt.Store.open(url).backend.list("objects")} == written  # and no marker left


def test_a_gc_whose_clock_runs_ahead_keeps_what_is_younger_than_the_grace_by_the_stores_clock(tmp_path):
    """Objects are stamped by the store (an S3 server, an NFS server) and gc compared those times
    with its own clock: on a machine 2 h ahead, `ckpt gc --grace 1h` took the chunks a push had
    written a second before (here 3 objects), under the running push. gc now reads the store's
    clock from a marker it writes, and says how far this machine's is off."""
    _skewed_gc_keeps_what_is_young(str(tmp_path / "s"))


def test_a_gc_whose_clock_runs_ahead_of_the_s3_servers_keeps_what_is_young(s3_url):
    """The same on S3, whose LastModified is the server's clock (there a push's commit writes again
    under its lease what a gc took, but a DCP save or a rank's persist fails: "push again")."""
    _skewed_gc_keeps_what_is_young(s3_url)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_dry_run_whose_clock_runs_ahead_of_the_s3_servers_plans_what_the_real_run_does(s3_url, direct):
    """A dry run writes nothing, so it kept its own clock: 2 h ahead, `ckpt gc --dry-run --grace 1h`
    listed a push's second-old chunks as deleted, which the real run keeps. It now reads the
    server's time from the Date of an answer (a request sent directly or through botocore)."""
    _skewed_gc_keeps_what_is_young(s3_url, "--dry-run", env={"CKPT_S3_DIRECT": direct})


def test_a_gc_whose_clock_runs_ahead_cannot_break_a_push_it_races(tmp_path, monkeypatch):
    """The loss that skew made: on a shared folder (NFS) a push's commit touches every chunk it
    names, so a gc that read the refs before the ref landed sees them young and keeps them -- by the
    file server's clock. A gc 2 h ahead took them all the same, and the pushed ref could not load."""
    from ckpt_store.storage import gc as gcmod

    store = ckpt.Store.init(str(tmp_path / "s"))
    t = {"x": torch.randn(100)}
    store.push(t, "a")
    store.remove("a")
    _age(str(tmp_path / "s"), 600)  # garbage, 10 minutes old
    real = time.time
    monkeypatch.setattr(gcmod, "time", types.SimpleNamespace(time=lambda: real() + 7200))  # this gc's clock only
    plan = gcmod.plan_gc(store.objects, store.refs_db, grace_s=3600)
    assert plan.young == 3  # 10 minutes old by the store's clock: kept
    store.push(t, "b")  # reuses (touches) the same chunks, and its ref lands
    assert list(gcmod.execute_gc(store.objects, plan)) == []
    assert store.verify().ok
    assert torch.equal(store.load("b")["x"], t["x"])


@pytest.mark.parametrize("damage", ["garbled", "gap"])
@pytest.mark.parametrize("removed", [False, True])
def test_a_damaged_entry_older_than_a_removal_stops_neither_gc_nor_its_dry_run(tmp_path, damage, removed):
    """The metadata index's snapshot keeps no entry behind a ref's newest removal, so gc --dry-run
    listed the removed versions' objects for deletion while the real gc, reading every entry, stopped
    on a damaged one older than the removal: the dry run promised what the real run refused. What
    such an entry named keeps nothing alive either way (the history gc counts ends at the removal):
    gc goes on, both agree, and verify still reports the entry."""
    path = tmp_path / "s"
    store = ckpt.Store.init(str(path))
    old = [store.push({"w": torch.full((1000,), float(i))}, "a") for i in range(3)]
    store.remove("a")
    new = torch.full((1000,), 9.0)
    store.push({"w": new}, "a")
    keep = store.push({"w": torch.full((1000,), 7.0)}, "b")
    if removed:
        store.remove("a")
    store.ls()  # an index snapshot, as a store in use has
    entry = path / "refs" / "a" / "0000000002.ref"
    if damage == "gap":
        entry.unlink()
    else:
        entry.write_bytes(b"{")
    plain = ckpt.Store.open(str(path), settings=ckpt.Settings.from_env(index=False))
    dry, dry_plain = store.gc(grace_s=0, dry_run=True), plain.gc(grace_s=0, dry_run=True)
    real = store.gc(grace_s=0)
    assert {(d.kind, d.name) for d in dry.deleted} == {(d.kind, d.name) for d in dry_plain.deleted} \
        == {(d.kind, d.name) for d in real.deleted}
    assert {d.name for d in real.deleted if d.kind == "manifests"} >= set(old)
    assert store.objects.has("manifests", keep)
    if not removed:
        assert store.load("a")["w"].numpy().tobytes() == new.numpy().tobytes()
    report = store.verify()
    assert [p for p in report.problems if "0000000002.ref" in p] and len(report.problems) == 1


@pytest.mark.parametrize("how", ["touched while condemned", "put back by the next gc"])
def test_an_object_put_back_under_its_name_is_on_disk_before_its_condemned_name_goes(how, tmp_path, monkeypatch):
    """gc links a condemned object back under its name when a writer touched it (or the next gc puts back what a
    killed one left), then unlinks the condemned name. Neither was fsynced, and the writer that touched it
    wrote nothing in that folder to fsync: a power loss could keep the unlink and lose the link, and the
    writer's durable checkpoint would name a chunk that is gone. There is no power to cut here: the calls are
    recorded (and done), and the folder must be fsynced between the link and the unlink."""
    import ckpt_store.storage.backends.local as local
    from ckpt_store.storage.backends.base import CONDEMNED
    from ckpt_store.storage.backends.local import LocalBackend

    b = LocalBackend(str(tmp_path), fsync=True)
    b.write("objects/chunks/ab/obj", b"data")
    folder = os.stat(tmp_path / "objects/chunks/ab")
    events: list[str] = []
    real_rename, real_fsync, real_unlink = os.rename, os.fsync, os.unlink

    def rename(src, dst):
        real_rename(src, dst)
        os.utime(dst)  # a writer's touch that landed just before the rename: the object is live

    def fsync(fd):
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (folder.st_dev, folder.st_ino):
            events.append("fsync folder")
        real_fsync(fd)

    def unlink(p, *a, **kw):
        if CONDEMNED in os.path.basename(os.fspath(p)):
            events.append("unlink condemned")
        real_unlink(p, *a, **kw)

    if how == "touched while condemned":
        past = time.time() - 100
        os.utime(tmp_path / "objects/chunks/ab/obj", (past, past))
        monkeypatch.setattr(local.os, "rename", rename)
    else:  # a gc killed while the object was condemned
        real_rename(tmp_path / "objects/chunks/ab/obj", tmp_path / f"objects/chunks/ab/{CONDEMNED}{'0' * 32}-obj")
    monkeypatch.setattr(local.os, "fsync", fsync)
    monkeypatch.setattr(local.os, "unlink", unlink)
    if how == "touched while condemned":
        assert b.delete_if_stale("objects/chunks/ab/obj", time.time() - 50) is False
    else:
        assert b.recover_condemned("objects") == 1
    assert "unlink condemned" in events and "fsync folder" in events[: events.index("unlink condemned")], events
    assert b.read("objects/chunks/ab/obj") == b"data"
    assert os.listdir(tmp_path / "objects/chunks/ab") == ["obj"]


def test_gc_aborts_the_unfinished_uploads_of_killed_writes_in_its_own_store_only(s3_url, s3_server):
    """A push killed in the middle of an object of 16 MiB or more (chunk_size may be up to 256 MiB) leaves a
    multipart upload begun and never completed: in no listing, its parts stored (and billed by S3) for ever,
    and no ckpt command ever looked for them. gc now aborts those older than the grace period, below its own
    store's prefix only (a neighbour's prefix that starts with the same letters, the rest of the bucket:
    someone else's), counts younger ones as recent (a push in flight), and a dry run only names them.
    The uploads are made here as a killed writer leaves them: begun, a part sent, never completed."""
    from s3support import client

    store = ckpt.Store.init(s3_url)
    store.push({"w": torch.arange(10.0)}, "m")
    bucket, _, prefix = s3_url.removeprefix("s3://").partition("/")
    parent = prefix.rpartition("/")[0] + "/" if "/" in prefix else ""
    c = client(s3_server.endpoint)  # type: ignore[attr-defined]

    def begin(key: str) -> str:
        up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * (5 << 20))
        return str(up)

    def unfinished() -> set[str]:
        return {u["UploadId"] for u in c.list_multipart_uploads(Bucket=bucket, Prefix=parent).get("Uploads", [])}

    mine = begin(f"{prefix}/objects/chunks/ab/" + "ab" * 32)
    theirs = {begin(f"{prefix}2/objects/chunks/ab/" + "ab" * 32), begin(f"{parent}elsewhere/big.bin")}
    time.sleep(1.1)  # (older than a grace of 0 by the server's clock, which stamps whole seconds)
    kept = store.gc(grace_s=3600)
    assert not [d for d in kept.deleted if d.kind == "upload"] and kept.young >= 1
    dry = store.gc(grace_s=0, dry_run=True)
    assert [(d.kind, d.name, d.size) for d in dry.deleted if d.kind == "upload"] == \
        [("upload", "objects/chunks/ab/" + "ab" * 32, 5 << 20)]
    assert unfinished() == {mine, *theirs}
    cli = subprocess.run([sys.executable, "-m", "ckpt_store.cli.main", "--store", s3_url, "gc", "--dry-run", "--grace", "0"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "including 1 unfinished upload(s)" in cli.stdout, cli.stdout + cli.stderr
    done = store.gc(grace_s=0)
    assert [(d.kind, d.size) for d in done.deleted if d.kind == "upload"] == [("upload", 5 << 20)]
    assert unfinished() == theirs
    assert torch.equal(store.load("m")["w"], torch.arange(10.0))
    again = store.gc(grace_s=0)
    assert not [d for d in again.deleted if d.kind == "upload"]


def test_a_store_that_may_not_list_unfinished_uploads_is_collected_all_the_same(s3_main_url, monkeypatch, caplog):
    """A server without ListMultipartUploads, or a key whose policy does not allow it (a narrow IAM role):
    gc warns that it did not look for unfinished uploads and does the rest of its work."""
    from ckpt_store.storage.backends.s3 import S3Backend
    from ckpt_store.storage.errors import StorageIOError

    def refused(self, before):
        raise StorageIOError(f"list {self.url} failed: AccessDenied")

    store = ckpt.Store.init(s3_main_url)
    store.push({"w": torch.arange(10.0)}, "m")
    store.remove("m")
    monkeypatch.setattr(S3Backend, "incomplete_uploads", refused)
    with caplog.at_level("WARNING"):
        r = store.gc(grace_s=0)
    assert r.deleted and all(d.kind != "upload" for d in r.deleted)
    assert "unfinished uploads were not looked for" in caplog.text and "AccessDenied" in caplog.text


def test_gc_of_a_store_at_a_buckets_root_aborts_no_upload_but_its_own_objects(s3_main):
    """A store at s3://BUCKET lists the whole bucket: gc aborted a user's half-sent dataset upload beside it
    (review rev23o). Only uploads below the store's objects/ and index/ are its own; a key with a '..' segment
    is no object of the store, whatever it starts with. (The first server only: a bucket of its own, and SeaweedFS
    refuses '..' in a key, and gives each bucket volumes of its own.)"""
    s3_server = s3_main
    from s3support import KEY, SECRET, client

    c = client(s3_server.endpoint)  # type: ignore[attr-defined]
    bucket = f"t-{os.urandom(6).hex()}"
    c.create_bucket(Bucket=bucket)
    env = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": s3_server.endpoint}  # type: ignore[attr-defined]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        store = ckpt.Store.init(f"s3://{bucket}")
        store.push({"w": torch.arange(10.0)}, "m")

        def begin(key: str) -> str:
            up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * (5 << 20))
            return str(up)

        mine = begin("objects/chunks/ab/" + "ab" * 32)
        theirs = {begin("datasets/imagenet.tar"), begin("objects/../datasets/other.tar"), begin("refs/../x.bin")}
        time.sleep(1.1)
        done = store.gc(grace_s=0)
        assert [d.name for d in done.deleted if d.kind == "upload"] == ["objects/chunks/ab/" + "ab" * 32]
        left = {u["UploadId"] for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
        assert mine not in left and left == theirs
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_a_server_whose_upload_pages_never_move_on_is_warned_of_and_gc_ends(s3_main_url, monkeypatch, caplog):
    """A server answering the listing of unfinished uploads with markers that come round again (a, b, a, b...) kept
    gc asking for ever, holding its lock while every push waited on it (review rev23o). A page seen before ends the
    listing with an error, which gc warns of and goes on."""
    store = ckpt.Store.init(s3_main_url)
    store.push({"w": torch.arange(10.0)}, "m")
    client = store.backend.client
    asked = []

    def cycling(**kw):
        asked.append(kw.get("KeyMarker"))
        nxt = "b" if kw.get("KeyMarker") == "a" else "a"
        return {"Uploads": [], "IsTruncated": True, "NextKeyMarker": nxt, "NextUploadIdMarker": "u"}

    monkeypatch.setattr(client, "list_multipart_uploads", cycling)
    with caplog.at_level("WARNING"):
        r = store.gc(grace_s=3600)
    assert r.live_manifests == 1 and len(asked) <= 6, asked
    assert "unfinished uploads were not looked for" in caplog.text and "do not move on" in caplog.text
