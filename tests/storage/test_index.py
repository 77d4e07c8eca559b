"""The metadata index (storage/index.py): the same answers as the refs and manifests, from a
few objects; rebuilt when missing, damaged or stale; never trusted over the refs.

Each test builds a small store (a base, fine-tunes, a removal, an alias, a ref with
history), then compares what ``push`` (base choice), ``ls``, ``du``, ``log``, ``refs`` and
``gc --dry-run`` say with the index and without it (``Settings(index=False)`` reads every
ref and manifest, as before the index existed).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.store.base import choose_base
from ckpt_store.storage.errors import StoreFormatError
from ckpt_store.storage.index import COMPACT_AFTER
from ckpt_store.storage.index_files import PREFIX, PRUNE_LAG

NAMES = [f"l{i}.w" for i in range(3)]


def base_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(32, 32, generator=g) for n in NAMES}


def fine_tune(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    return {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in base_tensors().items()}


def build(store: ckpt.Store, n: int = 4) -> None:
    store.push(base_tensors(), "fam/base", message="the base")
    for k in range(n):
        store.push(fine_tune(k), f"fam/ft{k}", message=f"ft {k}")
    store.push(fine_tune(99), "fam/ft0", message="ft 0 again")  # history
    store.remove("fam/ft1")
    store.push({"other": torch.arange(10, dtype=torch.int64)}, "misc/other")
    store.refs_db.set("fam/latest", store.resolve("fam/ft2"), alias=True)


def off(store: ckpt.Store) -> ckpt.Store:
    return ckpt.Store.open(store.url, settings=ckpt.Settings.from_env(index=False))


def answers(store: ckpt.Store) -> dict:
    g = store.gc(grace_s=0, dry_run=True)
    names = list(store.refs_db.all_entries())
    return {
        "ls": store.ls().refs,
        "refs": store.refs(),
        "du": store.du(),
        "log": {n: store.log(n) for n in names},
        "gc": (sorted((d.kind, d.name) for d in g.deleted), g.live_manifests, g.live_chunks, g.young),
        "base": choose_base(store, "fam/new", [(n, "F32", 32 * 32 * 4) for n in NAMES], None),
    }


def same_with_and_without(store: ckpt.Store) -> dict:
    with_index = answers(store)
    without = answers(off(store))
    assert with_index == without
    return with_index


def index_files(store: ckpt.Store) -> list[str]:
    return sorted(e.path for e in store.backend.list(PREFIX))


class Counting:
    """Counts the reads a backend serves, by top-level directory (instrumentation, not a mock)."""

    def __init__(self, store: ckpt.Store) -> None:
        self.reads: list[str] = []
        real = store.backend.read

        def read(path: str, limit: int | None = None) -> bytes:
            self.reads.append(path)
            return real(path, limit)

        store.backend.read = read  # type: ignore[method-assign]

    def of(self, prefix: str) -> list[str]:
        return [p for p in self.reads if p.startswith(prefix)]


def test_same_answers_with_and_without_the_index(store_url):
    store = ckpt.Store.init(store_url)
    build(store)
    got = same_with_and_without(store)
    assert [r.name for r in got["ls"]] == ["fam/base", "fam/ft0", "fam/ft2", "fam/ft3", "fam/latest", "misc/other"]
    assert got["base"][0] == store.resolve("fam/base")  # the fine-tunes' base: not a delta, oldest
    assert any(p.endswith(".log") for p in index_files(store))


def test_commands_read_the_index_not_every_ref_and_manifest(tmp_path):
    store = ckpt.Store.init(str(tmp_path / "s"))
    build(store, n=12)
    store.ls().refs  # brings the index up to date (the alias was set without a manifest summary)
    counting = Counting(store)
    store.ls()
    store.du()
    store.gc(grace_s=0, dry_run=True)
    choose_base(store, "fam/new", [(n, "F32", 32 * 32 * 4) for n in NAMES], None)
    assert counting.of("objects/manifests") == [] and counting.of("refs/") == []
    assert counting.of(PREFIX)  # ... what they read instead
    # A push reads the one base manifest it deltas against, not every candidate's.
    counting.reads.clear()
    store.push(fine_tune(50), "fam/new")
    assert len(counting.of("objects/manifests")) == 1 and counting.of("refs/") == []


def test_index_rebuilt_when_deleted(store_url):
    store = ckpt.Store.init(store_url)
    build(store)
    before = same_with_and_without(store)
    for e in list(store.backend.list(PREFIX)):
        store.backend.delete(e.path)
    assert index_files(store) == []
    assert same_with_and_without(store) == before
    assert any(p.endswith(".snap") for p in index_files(store))  # written back


@pytest.mark.parametrize("part", [".snap", ".chunks", ".log"])
def test_damaged_index_is_ignored_and_replaced(tmp_path, part):
    store = ckpt.Store.init(str(tmp_path / "s"))
    build(store)
    store.ls().refs  # a snapshot exists
    before = same_with_and_without(store)
    if part == ".log":
        store.push(fine_tune(7), "fam/ft7")
        before = same_with_and_without(store)
    victim = [p for p in index_files(store) if p.endswith(part)][-1]
    path = Path(store.backend.local_path(victim))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20  # one flipped bit, JSON still parses in most places
    path.write_bytes(bytes(data))
    assert same_with_and_without(store) == before
    if part != ".log":  # the damaged snapshot was replaced, and deleted
        assert victim not in index_files(store) or part == ".chunks"
        assert same_with_and_without(store) == before


def test_stale_index_catches_up_from_the_refs(tmp_path):
    store = ckpt.Store.init(str(tmp_path / "s"))
    build(store)
    store.ls()
    # Updates the index never hears of: a writer without it (an older ckpt, say).
    blind = off(store)
    blind.push(fine_tune(8), "fam/ft8")
    blind.remove("fam/ft2")
    blind.push(fine_tune(9), "fam/ft0")
    got = same_with_and_without(store)
    names = [r.name for r in got["ls"]]
    assert "fam/ft8" in names and "fam/ft2" not in names
    assert got["refs"]["fam/ft0"].target == blind.resolve("fam/ft0")


def test_a_recreated_ref_is_read_not_taken_from_the_index(tmp_path):
    """The index recorded ref x#1 -> A; x's directory is deleted by hand and x#1 written
    again, naming B, by a writer that does not update the index. gc must keep B."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push({"w": torch.zeros(64)}, "x")
    store.ls()
    shutil.rmtree(os.path.join(store.backend.root, "refs", "x"))
    want = torch.randn(64)
    b = off(store).push({"w": want}, "x")
    assert store.refs()["x"].target == b
    store.gc(grace_s=0)
    assert store.verify().ok
    assert torch.equal(store.load("x")["w"], want)
    assert same_with_and_without(store)["refs"]["x"].target == b


def test_stale_index_base_choice_loses_nothing(tmp_path):
    """The index still names a checkpoint whose ref was removed and whose data gc deleted:
    a push that would have chosen it as its base still stores its data whole and right."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push(base_tensors(), "fam/base")
    store.ls()
    blind = off(store)
    blind.remove("fam/base")
    blind.gc(grace_s=0)
    assert list(blind.objects.list("manifests")) == []
    ft = fine_tune(3)
    mid = store.push(ft, "fam/ft3")
    assert store.manifest(mid).lineage["base"] is None  # the stale candidate was skipped
    assert store.verify().ok
    got = store.load("fam/ft3")
    assert all(torch.equal(got[n], ft[n]) for n in NAMES)


def test_many_updates_fold_into_a_snapshot(tmp_path):
    store = ckpt.Store.init(str(tmp_path / "s"))
    x = {"w": torch.zeros(4)}
    for k in range(COMPACT_AFTER + 8):
        x = {"w": x["w"] + 1}
        store.push(x, f"r/{k % 5}")
    files = index_files(store)
    snaps = [p for p in files if p.endswith(".snap")]
    assert len(snaps) == 1 and int(Path(snaps[0]).name[:10]) >= COMPACT_AFTER
    same_with_and_without(store)


def test_base_choice_reads_only_the_recent_refs(tmp_path, monkeypatch):
    """A push reads the snapshot's part with the most recently updated refs, not all of them,
    and chooses the same base as with every ref and manifest read."""
    import ckpt.store.base as base_mod
    import ckpt_store.storage.index_state as index_state

    monkeypatch.setattr(base_mod, "MAX_CANDIDATES", 3)
    monkeypatch.setattr(index_state, "RECENT", 5)
    store = ckpt.Store.init(str(tmp_path / "s"))
    build(store, n=9)
    for k in range(2):  # newer refs of another shape: the family's base falls out of the recent part
        store.push({"other": torch.full((8,), float(k))}, f"misc/o{k}")
    store.ls()
    st = store.index.view(exact=True)
    st.damaged = True
    store.index.heal(st)  # a snapshot now
    keys = [(n, "F32", 32 * 32 * 4) for n in NAMES]
    counting = Counting(store)
    got = choose_base(store, "fam/new", keys, None)
    snap = [p for p in counting.reads if p.endswith(".snap")]
    assert snap == [] and any(p.endswith(".recent") for p in counting.reads)  # the header by a ranged read only
    assert got == choose_base(off(store), "fam/new", keys, None)
    assert got[0] is not None and got[0] != store.resolve("fam/base")  # the base is not among the 3 newest


def test_a_live_checkpoint_whose_manifest_is_gone_is_damaged_with_the_index_too(store_url):
    """The index keeps a summary of every live manifest. When one was deleted (by hand, or the store
    copied without it), `ls` and `du` listed its ref from the summary as whole, where without the
    index they name it damaged. Each live target is now checked to exist (one batch of checks)."""
    store = ckpt.Store.init(store_url)
    build(store)
    store.ls()
    gone = store.resolve("fam/ft2")
    store.backend.delete(store.objects.path("manifests", gone))
    plain = off(store)
    listing, usage = store.ls(), store.du()
    assert listing == plain.ls() and usage == plain.du()
    assert set(listing.damaged) == {"fam/ft2", "fam/latest"} and set(usage.damaged) == {"fam/ft2", "fam/latest"}


def test_du_on_s3_asks_which_manifests_exist_of_the_listing_it_made(s3_main_url, monkeypatch):
    """du lists every object (its stored sizes), then checked that each live manifest exists with
    a second listing of objects/manifests (or a HEAD each): on S3 the first listing answers (one
    LIST page per 1,000 manifests fewer). A manifest deleted is still named damaged, as without
    the index."""
    store = in_use(s3_main_url, 12)
    b = store.backend
    heads, pages = [], []
    real_head, real_page = b._head, b._list_page
    monkeypatch.setattr(b, "_head", lambda p: heads.append(p) or real_head(p))
    monkeypatch.setattr(b, "_list_page", lambda prefix, *a: pages.append(prefix[len(b.prefix) + 1:]) or real_page(prefix, *a))
    usage = store.du()
    assert usage == off(store).du() and usage.damaged == {}
    assert [p for p in pages if p.startswith("objects")] == ["objects/"]  # one listing of the objects, no other
    assert not [p for p in heads if p.startswith("objects/manifests")]
    gone = store.resolve("fam/ft2")
    b.delete(store.objects.path("manifests", gone))
    assert set(store.du().damaged) == {"fam/ft2", "fam/latest"}


class Pages:
    """The LIST pages an S3 store's backend asks for, by prefix below the store, each with when it
    was asked for and answered; ``hold``: a page of that prefix is answered only once a page of
    ``until`` has been asked for (what a command that sends them one after another never does: it
    waits ``patience`` seconds, then goes on, and the test fails on the order it records)."""

    def __init__(self, store: ckpt.Store, monkeypatch: pytest.MonkeyPatch, hold: str = "", until: str = "",
                 patience: float = 10.0) -> None:
        b = store.backend
        self.log: list[tuple[str, str]] = []  # ("ask" or "done", prefix)
        asked = threading.Event()
        real = b._list_page

        def page(prefix: str, *a: object) -> object:
            where = prefix[len(b.prefix) + 1:]
            self.log.append(("ask", where))
            if until and where.startswith(until):
                asked.set()
            if hold and where.startswith(hold):
                asked.wait(patience)
            try:
                return real(prefix, *a)
            finally:
                self.log.append(("done", where))

        monkeypatch.setattr(b, "_list_page", page)

    def asked(self) -> list[str]:
        return [p for what, p in self.log if what == "ask"]

    def first(self, what: str, prefix: str) -> int:
        return next(i for i, (w, p) in enumerate(self.log) if w == what and p.startswith(prefix))

    def last(self, what: str, prefix: str) -> int:
        return max(i for i, (w, p) in enumerate(self.log) if w == what and p.startswith(prefix))


def in_use(url: str, n: int) -> ckpt.Store:
    """A store at ``url`` holding a base and ``n`` fine-tunes, with an index snapshot (as a store in use has)."""
    store = ckpt.Store.init(url)
    build(store, n=n)
    store.ls()
    return store


def test_du_on_s3_lists_the_objects_while_it_reads_the_index_and_refs(s3_main_url, monkeypatch):
    """du's largest part on S3 is the listing of every object (a page per 1,000), which it made
    before reading the index and listing refs/: requests one after another (at 1,000 refs on
    SeaweedFS, 6 pages of objects, then 9 reads of the index and a page of refs). They are
    independent, and are now asked for together: the objects' first page is answered here only
    once refs/ has been asked for. The answer is the same, with the same requests."""
    store = in_use(s3_main_url, 6)
    expected = off(store).du()
    pages = Pages(store, monkeypatch, hold="objects/", until="refs/")
    assert store.du() == expected
    assert pages.first("ask", "refs/") < pages.first("done", "objects/")  # asked for while the objects were listed
    assert sorted(pages.asked()) == ["index/", "objects/", "refs/"]  # each listed once


def test_ls_on_s3_checks_the_manifests_exist_while_it_lists_refs(s3_main_url, monkeypatch):
    """ls checks that each live manifest exists (a listing of objects/manifests on S3, where that is
    cheaper than a HEAD each), which it asked for only after listing refs/: at 1,000 refs on
    SeaweedFS a page each, one after the other. The manifests the loaded index names are checked
    while refs/ is listed (the page of refs/ is answered here only once the manifests' has been
    asked for); one that only the listing of refs shows is read. A manifest deleted is still named damaged."""
    store = in_use(s3_main_url, 12)
    expected = off(store).ls()
    pages = Pages(store, monkeypatch, hold="refs/", until="objects/manifests")
    assert store.ls() == expected
    assert sorted(pages.asked()) == ["index/", "objects/manifests/", "refs/"]  # each listed once
    assert pages.first("ask", "objects/manifests") < pages.first("done", "refs/")
    off(store).push(fine_tune(50), "fam/new")  # named by the refs only: no index log records it
    gone = store.resolve("fam/ft2")
    store.backend.delete(store.objects.path("manifests", gone))
    listing = store.ls()
    assert listing == off(store).ls() and set(listing.damaged) == {"fam/ft2", "fam/latest"}
    assert "fam/new" in {r.name for r in listing.refs}


def test_gc_dry_run_on_s3_lists_each_prefix_once_and_reads_the_index_and_refs_while_it_lists_the_objects(s3_main_url, monkeypatch):
    """gc --dry-run listed index/ twice (the index's load, then again for leftovers of interrupted
    writes there, which that listing had passed), and loaded the index only after every object was
    listed. It lists each prefix once, and loads the index while the objects are listed. It listed
    refs/ only after the objects, as a gc that deletes must (storage/gc.py), though it deletes
    nothing: at 1,000 refs on SeaweedFS a page of ~100-300 ms after the objects' 6. It lists refs/
    while the objects are listed (the objects' first page is answered here only once refs/ has been
    asked for, after index/). The same plan, its leftovers of interrupted writes included."""
    store = in_use(s3_main_url, 6)
    leftover = f"{PREFIX}/.tmp-interrupted"
    store.backend.write(leftover, b"x")  # an interrupted write's leftover: found by the index's own listing
    in_refs = "refs/.tmp-interrupted"
    store.backend.write(in_refs, b"yz")  # and one below refs/: found by the listing of refs
    plan = off(store).gc(grace_s=0, dry_run=True)
    pages = Pages(store, monkeypatch, hold="objects/", until="refs/", patience=5.0)
    got = store.gc(grace_s=0, dry_run=True)
    assert (set(got.deleted), got.live_manifests, got.live_chunks) == (set(plan.deleted), plan.live_manifests, plan.live_chunks)
    assert {("temp", leftover, 1), ("temp", in_refs, 2)} <= {(d.kind, d.name, d.size) for d in got.deleted}
    assert sorted(pages.asked()) == ["index/", "objects/", "refs/"]  # each listed once
    assert pages.first("done", "index/") < pages.first("ask", "refs/") < pages.first("done", "objects/")


def test_gc_that_deletes_on_s3_lists_refs_only_after_every_object(s3_main_url, monkeypatch):
    """A gc that deletes reads the refs only once every object is listed (what its safety rests on:
    storage/gc.py), though its dry run reads them meanwhile."""
    store = in_use(s3_main_url, 6)
    store.backend.page_keys = 5  # the objects in several pages
    store.remove("misc/other")
    pages = Pages(store, monkeypatch)
    report = store.gc(grace_s=0)
    assert report.deleted and store.verify().ok
    assert pages.asked().count("objects/") > 1
    assert pages.first("ask", "refs/") > pages.last("done", "objects/")


def test_a_signature_many_checkpoints_share_is_checked_once(tmp_path, monkeypatch):
    """ls and du check the shape of every summary they take from the index, the tensor signature
    included: a base's fine-tunes share one signature (stored once), which was checked again for
    each of them (at 1,000 fine-tunes of a 300-tensor model, 300,000 tensors checked per ls). It is
    checked once per command; a crafted one still sends every checkpoint naming it to its manifest."""
    from ckpt_store.storage.index import IndexState

    store = in_use(str(tmp_path / "s"), 8)
    st = store.index.load(chunks=True)
    assert len(st.sigs) == 2 and len(st.info) > 8  # the family's signature, misc/other's
    asked = []
    real = IndexState.signature
    monkeypatch.setattr(IndexState, "signature", lambda self, mid: asked.append(mid) or real(self, mid))
    for command in (store.ls, store.du):
        asked.clear()
        assert command() == getattr(off(store), command.__name__)()
        assert len(asked) == 2
    key = next(k for k, v in st.sigs.items() if len(v) == len(NAMES))
    st.sigs[key] = [["l0.w", "F32", "many"]]  # crafted: the wrong shape
    st.max_gen += 1
    store.index.write_snapshot(st)
    counting = Counting(store)
    assert store.ls() == off(store).ls()
    family = [e.target for n, e in store.refs_db.live().items() if n.startswith("fam/")]
    assert set(family) <= {p.rsplit("/", 1)[1] for p in counting.of("objects/manifests")}  # read again
    assert store.du() == off(store).du()


def test_beside_a_newer_index_ls_reads_each_refs_newest_entry_only(tmp_path):
    """Beside a newer ckpt's index snapshot (left in place, never written over), ls rebuilt the index
    in memory from every entry of every ref (for a snapshot it would not write), each time: the
    history of a ref cost a read per version. It reads what it does without the index."""
    from ckpt_store.storage.records import sealed_json

    store = ckpt.Store.init(str(tmp_path / "s"))
    for k in range(10):
        store.push({"w": torch.full((8,), float(k))}, "r")
    store.push({"w": torch.zeros(8)}, "q")
    store.ls()
    top = max(int(Path(p).name[:10]) for p in index_files(store))
    head = {"format": "ckpt-index", "version": 2, "gen": top + 1, "body": "0" * 64, "length": 2}
    (tmp_path / "s" / PREFIX / f"{top + 1:010d}-0123456789abcdef.snap").write_bytes(sealed_json(head) + b"\n{}")
    store = ckpt.Store.open(str(tmp_path / "s"))
    counting = Counting(store)
    assert [r.name for r in store.ls().refs] == ["q", "r"]
    assert sorted(counting.of("refs/")) == ["refs/q/0000000001.ref", "refs/r/0000000010.ref"]


def test_beside_a_newer_index_gc_dry_run_keeps_the_earlier_versions_the_real_gc_keeps(tmp_path):
    """Beside a newer ckpt's index snapshot, the in-memory rebuild read each ref's newest entry only,
    for gc --dry-run too: its roots lacked every NAME@1..., and it listed their objects as deleted
    while the real gc (which reads every entry) kept them. A caller asking for history gets it."""
    from ckpt_store.storage.records import sealed_json

    store = ckpt.Store.init(str(tmp_path / "s"))
    for k in range(3):
        store.push({"w": torch.full((100,), float(k))}, "r")
    store.ls()
    top = max(int(Path(p).name[:10]) for p in index_files(store))
    head = {"format": "ckpt-index", "version": 2, "gen": top + 1, "body": "0" * 64, "length": 2}
    (tmp_path / "s" / PREFIX / f"{top + 1:010d}-0123456789abcdef.snap").write_bytes(sealed_json(head) + b"\n{}")
    store = ckpt.Store.open(str(tmp_path / "s"))
    dry = store.gc(grace_s=0, dry_run=True)
    assert (dry.deleted, dry.live_manifests) == ([], 3)
    assert store.gc(grace_s=0).deleted == [] and store.verify().ok


@pytest.mark.parametrize("damage", ["file", "folder"])
def test_a_damaged_old_entry_does_not_fail_live_refs_while_the_index_is_rebuilt(tmp_path, damage):
    """Rebuilding the index reads every entry, for the snapshot it writes: one damaged old entry
    made Store.refs() (the web view's ref list and every checkpoint page) fail, though live refs
    need only each ref's newest entry. Such a view is used and never written as a snapshot."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    ids = [store.push({"w": torch.full((3,), float(i))}, "m") for i in range(3)]
    store.push({"w": torch.ones(4)}, "other")
    shutil.rmtree(tmp_path / "s" / PREFIX)
    entry = tmp_path / "s" / "refs" / "m" / "0000000002.ref"
    if damage == "file":
        entry.write_bytes(b"x")
    else:
        entry.unlink()
        entry.mkdir()
    for _ in range(2):
        assert {n: e.target for n, e in store.refs().items()} == {"m": ids[2], "other": store.resolve("other")}
    assert not any(p.endswith(".snap") for p in index_files(store))  # a view lacking an entry is not written
    with pytest.raises(ckpt.CkptError, match="0000000002.ref"):
        store.gc(grace_s=0, dry_run=True)  # what gc keeps alive needs every entry: it stops


def test_an_entry_the_listing_of_refs_missed_is_read_and_no_snapshot_written(tmp_path, monkeypatch):
    """A listing of refs/ taken while a ref was updated may miss entry N and show N+1 (a directory is
    read in several calls as it changes): the index then saw a gap, read the entry as damage-or-not
    (Refs.read_entry), and, the file being there, had no listed size to record for it. The view
    uses the entry and is not written as a snapshot (whose records must match the listing)."""
    from ckpt_store.storage.refs import Refs

    store = ckpt.Store.init(str(tmp_path / "s"))
    build(store)
    expected = store.refs_db.history("fam/ft0")
    store.ls()  # an index snapshot, as a store in use has
    real = Refs.listing_and_temporaries

    def missing_one(self, prefix=""):  # entry 1 of fam/ft0 not seen by this listing, as in the race
        out, temporaries = real(self, prefix)
        if "fam/ft0" in out:
            out["fam/ft0"] = {s: (None if s == 1 else e) for s, e in out["fam/ft0"].items()}
        return out, temporaries

    monkeypatch.setattr(Refs, "listing_and_temporaries", missing_one)
    shutil.rmtree(tmp_path / "s" / PREFIX)  # rebuilt: every entry is read from the refs
    st = store.index.view(exact=True, history=True)
    assert st.entries()["fam/ft0"] == expected and st.partial
    assert store.gc(grace_s=0, dry_run=True).live_manifests == off(store).gc(grace_s=0, dry_run=True).live_manifests


@pytest.mark.slow
def test_a_long_lived_ref_is_updated_without_listing_its_history_or_the_growing_index(store_url):
    """A training run's RUN/latest gets an entry per save. Each update listed the ref's whole history
    to number the next entry, and told the index by a log the index never folded while it had no
    snapshot (one is written only by an exact reader, ls/du/gc, which a run's own store may never
    see): both listings grew with every save (1,000 updates of one ref: 10.6 s, the last ones
    17 ms each, index/ holding 1,000 logs). Now an update tries one past its own last entry (checked
    there), and a writer that finds many logs and no snapshot builds the first one."""
    store = ckpt.Store.init(store_url)
    store.push({"w": torch.zeros(4)}, "x")
    mid = store.resolve("x")
    listed: list[str] = []
    real = store.backend.list

    def counting_list(prefix: str):
        listed.append(prefix)
        return real(prefix)

    store.backend.list = counting_list  # type: ignore[method-assign]  (instrumentation, not a mock)
    n = PRUNE_LAG + 3 * COMPACT_AFTER
    for i in range(n):
        store.refs_db.set("run/latest", mid, alias=True)
        if i == 1:
            listed.clear()
    assert not [p for p in listed if p.startswith("refs/run")]  # after the first two: not one listing of the ref
    assert listed.count("refs") <= 1  # the refs of the store, listed once to build the index's first snapshot
    store.backend.list = real  # type: ignore[method-assign]
    files = index_files(store)
    assert any(p.endswith(".snap") for p in files) and sum(p.endswith(".log") for p in files) <= PRUNE_LAG + COMPACT_AFTER
    assert [e.seq for e in store.log("run/latest")] == list(range(n, 0, -1))
    assert store.resolve("run/latest") == mid and store.resolve(f"run/latest@{n - 1}") == mid
    same_with_and_without(store)


def test_a_ref_begun_again_elsewhere_is_numbered_from_its_entries_not_from_memory(tmp_path):
    """The next entry number a writer remembers is checked: a ref whose folder was removed and begun
    again by another process gets its next entry after the new ones, not past the old ones (a gap,
    which is damage)."""
    url = str(tmp_path / "s")
    a = ckpt.Store.init(url)
    a.push({"w": torch.zeros(4)}, "x")
    mid = a.resolve("x")
    for _ in range(3):
        a.refs_db.set("r", mid)
    shutil.rmtree(tmp_path / "s" / "refs" / "r")
    ckpt.Store.open(url).refs_db.set("r", mid)  # another writer begins it again: entry 1
    a.refs_db.set("r", mid)
    assert [e.seq for e in a.log("r")] == [2, 1] and a.resolve("r@1") == mid


class CountingWrites:
    """Bytes written below ``index/`` by a store's backend (instrumentation, not a mock)."""

    def __init__(self, store: ckpt.Store) -> None:
        self.written: dict[str, int] = {}
        real = store.backend.write

        def write(path: str, data) -> None:
            if path.startswith(PREFIX + "/"):
                ext = path.rsplit(".", 1)[-1]
                self.written[ext] = self.written.get(ext, 0) + len(data)
            real(path, data)

        store.backend.write = write  # type: ignore[method-assign]

    def take(self) -> dict[str, int]:
        out, self.written = self.written, {}
        return out


def saves(mgr: ckpt.CheckpointManager, model: torch.nn.Module, steps: range) -> None:
    for step in steps:
        with torch.no_grad():
            model.weight[0, 0] = step  # every save a new checkpoint (one chunk changed)
        mgr.save(step, {"model": model})


@pytest.mark.slow
def test_a_training_runs_index_keeps_no_summaries_of_its_removed_steps(tmp_path):
    """A run saves RUN/step-N, removes old steps (retention) and updates RUN/latest at every save.
    Each compaction (every 32 saves) rewrote the summary and chunk list of every checkpoint the
    run ever saved, removed steps included, which no reader of the index asks about: 64 saves
    after 100 wrote 0.4 MB of chunk lists, after 400 1.5 MB. A snapshot now summarises what its
    refs keep alive (gc's roots), so a save costs the same however long the run has been going."""
    model = torch.nn.Linear(16, 16)
    mgr = ckpt.CheckpointManager(str(tmp_path / "s"), "run", keep_last=2, save_mode="sync")
    counting = CountingWrites(mgr.store)
    saves(mgr, model, range(1, COMPACT_AFTER + 1))
    counting.take()
    saves(mgr, model, range(COMPACT_AFTER + 1, 2 * COMPACT_AFTER + 1))
    early = counting.take()
    saves(mgr, model, range(2 * COMPACT_AFTER + 1, 5 * COMPACT_AFTER + 1))
    counting.take()
    saves(mgr, model, range(5 * COMPACT_AFTER + 1, 6 * COMPACT_AFTER + 1))
    late = counting.take()
    assert 0 < late["chunks"] < 1.25 * early["chunks"]  # before: 3.5 times as much
    store = mgr.store
    (chunks,) = [p for p in index_files(store) if p.endswith(".chunks")]
    assert len(json.loads(store.backend.read(chunks).partition(b"\n")[2])) <= 3  # the steps kept, and the one saving
    same_with_and_without(store)


def snapshot_refs(store: ckpt.Store) -> dict[str, list]:
    (snap,) = [p for p in index_files(store) if p.endswith(".snap")]
    return json.loads(store.backend.read(snap).partition(b"\n")[2])["refs"]


def test_a_snapshot_keeps_no_history_behind_a_removal(tmp_path):
    """A snapshot kept every entry of every ref ever written: a run's removed steps (each its save
    and its removal) made every compaction rewrite them all. Behind a removal nothing is kept alive
    (gc's rule) and no reader of the index answers with it (``ckpt log`` reads refs/): a snapshot keeps
    each ref's entries back to its newest removal (and a removed ref not even that: it is counted), and
    gc --dry-run does not read the older ones."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    x = torch.zeros(4)
    for k in range(COMPACT_AFTER):
        for _ in range(2):
            x = x + 1
            store.push({"w": x}, f"run/step-{k}")
        store.remove(f"run/step-{k}")
    store.push({"w": x + 1}, "run/step-0")  # begun again: its entries after the removal count
    shutil.rmtree(tmp_path / "s" / PREFIX)
    store.ls()  # rebuilds the index, every entry read
    recs = snapshot_refs(store)
    # step-0: its entry after the removal (below it nothing counts); the others removed: only counted
    assert list(recs) == ["run/step-0"] and [r[0] for r in recs["run/step-0"]] == [4]
    counting = Counting(store)
    store.gc(grace_s=0, dry_run=True)
    assert counting.of("refs/") == []
    got = same_with_and_without(store)
    assert [r.name for r in got["ls"]] == ["run/step-0"] and len(got["log"]["run/step-1"]) == 3


def test_a_rebuilt_index_holds_the_earlier_versions_gc_dry_run_reads(tmp_path):
    """A snapshot rebuilt from the refs (index/ deleted or damaged, or a run's first compaction) held
    only the summaries its caller had read, the live targets, and every later snapshot carried that
    on: each gc --dry-run (which writes nothing) read the manifest of every earlier version (NAME@1...),
    every time. The rebuild reads them once; a version gc --no-history freed is left out."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    first = [store.push({"w": torch.full((100,), float(k))}, "r").id for k in range(3)]
    store.gc(grace_s=0, keep_history=False)
    freed = first[:-1]
    kept = first[-1:] + [store.push({"w": torch.full((100,), float(k))}, "r").id for k in range(10, 16)]
    store.push({"w": torch.zeros(100)}, "q")
    shutil.rmtree(tmp_path / "s" / PREFIX)
    store.ls()
    assert any(p.endswith(".snap") for p in index_files(store))
    counting = Counting(store)
    for _ in range(2):
        assert store.gc(grace_s=0, dry_run=True).live_manifests == len(kept) + 1
    read = {Path(p).name for p in counting.of("objects/manifests")}
    assert read and not read & set(kept) and read <= set(freed)  # before: the 6 earlier versions kept, each dry run
    same_with_and_without(store)


def test_the_index_reads_a_run_tier_pruning_meanwhile_without_calling_a_live_ref_damaged(tmp_path):
    """A run's local tier cuts its refs' histories as it prunes while `ckpt serve --local-tier` reads
    it: the index listed RUN/latest's newest entry, the tier saved a newer one and deleted the older
    before the index read it, and `Store.refs()` (the web view's list of refs) failed with 'ref entry
    ... was deleted after it was listed'. Deleted since listed is not damage: the refs are listed
    again, and the answer is the newer entry."""
    tier = ckpt.Store.init(str(tmp_path / "tier"))
    a = tier.push({"w": torch.zeros(4)}, "run/step-1").id
    b = tier.push({"w": torch.ones(4)}, "run/step-2").id
    tier.refs_db.set("run/latest", a, alias=True)
    tier.refs_db.cut_history("run/latest")
    shutil.rmtree(tmp_path / "tier" / PREFIX)  # (so that the reader reads the entries, not the index's records)
    reader = ckpt.Store.open(str(tmp_path / "tier"))
    real, moved = reader.backend.read, []

    def read(path, *args):
        if path.startswith("refs/run/latest/") and not moved:  # listed; the tier saves and prunes first
            moved.append(tier.refs_db.set("run/latest", b, alias=True))
            tier.refs_db.cut_history("run/latest")
        return real(path, *args)

    reader.backend.read = read  # type: ignore[method-assign]  (the tier's move staged between list and read)
    refs = reader.refs()
    assert moved and refs["run/latest"].target == b and refs["run/step-2"].target == b


@pytest.mark.slow
def test_a_training_runs_index_snapshot_does_not_grow_with_its_saves(tmp_path):
    """A run saves RUN/step-N, removes old steps (retention) and updates RUN/latest, an alias, at every
    save. A snapshot kept every RUN/latest entry (an alias's earlier targets keep nothing alive) and each
    removed step's removal (its history ends there): 7.3 KB after 32 saves, 40.9 KB after 160, so that
    a run saving every step rewrote megabytes each compaction. A snapshot now keeps each ref's records
    from its floor (below it, only aliases or a removal) and counts the removed refs instead of keeping
    them (their newest entries as listed: count and sum), so it holds the refs the run keeps, however
    long it has been going; exact readers read none of the removed steps' entries, and answer as
    without the index."""
    model = torch.nn.Linear(16, 16)
    mgr = ckpt.CheckpointManager(str(tmp_path / "s"), "run", keep_last=2, save_mode="sync")
    store = mgr.store

    def snapshot_size() -> int:
        (snap,) = [p for p in index_files(store) if p.endswith(".snap")]
        return len(store.backend.read(snap))

    saves(mgr, model, range(1, 2 * COMPACT_AFTER + 1))
    early = snapshot_size()
    saves(mgr, model, range(2 * COMPACT_AFTER + 1, 6 * COMPACT_AFTER + 1))
    late = snapshot_size()
    assert late < early + 100  # before: 15.7 KB after 64 saves, 49.3 KB after 192
    assert len(snapshot_refs(store)) <= 4  # RUN/latest and the steps kept when it was written
    counting = Counting(store)
    store.gc(grace_s=0, dry_run=True)
    store.ls()
    assert counting.of("refs/") == []  # not one entry of a removed step, nor of RUN/latest's past, read
    got = same_with_and_without(store)
    assert len(got["log"]["run/latest"]) == 6 * COMPACT_AFTER and len(got["ls"]) == 3
    # A ref the index does not know (written without the index: by an older ckpt, say), and a removed
    # step begun again: each read from the refs, as without the index, and counted anew.
    off(store).push({"w": torch.ones(3)}, "other")
    store.push({"w": torch.zeros(3)}, "run/step-5")
    got = same_with_and_without(store)
    live = ["other", "run/latest", f"run/step-{6 * COMPACT_AFTER - 1}", f"run/step-{6 * COMPACT_AFTER}", "run/step-5"]
    assert [r.name for r in got["ls"]] == live
    counting = Counting(store)  # (ls wrote a snapshot that counts the removed steps anew)
    assert [r.name for r in store.ls().refs] == live and counting.of("refs/") == []
    same_with_and_without(store)


def test_a_snapshot_written_after_ls_reads_each_index_log_once(tmp_path):
    """`ls` past a damaged index log writes a fresh snapshot (heal), which needs every chunk list: it read
    the snapshot again with every log after it, so each log was read twice (found with two sparse 200 MiB
    logs: 800 MiB of zeros read, and each warned of twice). The chunk lists the logs carried are kept
    from the first read; the snapshot still holds them all (a gc --dry-run after it reads no manifest)."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    build(store)
    for k in range(20, 23):
        store.push(fine_tune(k), f"fam/late{k}")
    top = max(int(Path(p).name[:10]) for p in index_files(store))
    (tmp_path / "s" / PREFIX / f"{top + 1:010d}.log").write_bytes(b"\0" * 4096)
    fresh = ckpt.Store.open(store.url)
    counting = Counting(fresh)
    fresh.ls()
    logs = [p for p in counting.reads if p.endswith(".log")]
    assert f"{PREFIX}/{top + 1:010d}.log" in logs and len(logs) == len(set(logs)), logs  # each once
    assert any(int(Path(p).name[:10]) > top for p in index_files(fresh) if p.endswith(".snap"))  # healed
    counting.reads.clear()
    fresh.gc(grace_s=0, dry_run=True)
    assert counting.of("objects/manifests") == []  # the new snapshot has the logs' chunk lists
    same_with_and_without(fresh)


def test_a_view_heal_wrote_is_written_again_only_for_what_was_read_since(tmp_path):
    """heal did not remember that it had written a view: a second heal of it (ls heals the view it lists
    the refs from, then reads the summaries it lacks and heals again) wrote the same snapshot again, so
    each caller that healed twice had to guard it. heal now writes a view again only where more was read."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    build(store)
    for e in list(store.backend.list(PREFIX)):
        store.backend.delete(e.path)
    st = store.index.view(exact=True)  # rebuilt from the refs: worth a snapshot
    writes = CountingWrites(store)
    store.index.heal(st)
    assert writes.take().get("snap")
    store.index.heal(st)
    assert writes.take() == {}  # the same view: not written again
    removed = store.refs_db.history("fam/ft1")[1].target  # a summary the snapshot lacks (a removed ref's)
    assert removed not in st.info
    store.index.ensure(st, [removed])
    store.index.heal(st)
    assert writes.take().get("snap")  # read more since: written again


def test_entries_deleted_below_an_alias_floor_are_damage_with_the_index_too(tmp_path):
    """A snapshot keeps a run's RUN/latest (an alias at every save) from its newest entry up, and a reader
    did not look below that floor: with two middle entries deleted by hand, the listing of refs/ shows the
    gap (damage: what those entries named is unknown, so gc stops), and gc --dry-run, from the index,
    planned to delete what the real gc keeps. Listed damage above the newest removal is read as without it."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    build(store)
    targets = [store.resolve("fam/ft0"), store.resolve("fam/base")]
    for i in range(6):
        store.refs_db.set("run/latest", targets[i % 2], alias=True)
    shutil.rmtree(tmp_path / "s" / PREFIX)
    store.ls()  # a snapshot holding run/latest's newest entry only (its floor)
    for seq in (3, 4):
        store.backend.delete(store.refs_db.entry_path("run/latest", seq))
    for s in (store, off(store)):
        with pytest.raises(StoreFormatError, match="0000000004.ref is missing"):
            s.gc(grace_s=0, dry_run=True)
    assert store.ls().refs == off(store).ls().refs  # the newest entry: no damage to ls


def test_a_removed_ref_pushed_again_and_removed_is_counted_once(tmp_path):
    """A snapshot counts the removed refs it keeps no record of (settled). One of them pushed again and
    removed again was counted twice (its old removal, and its new one, by the next snapshot a writer's
    compaction wrote): the count no longer matched the listing, and every `ls` read each removed ref's
    newest entry until an exact reader wrote a snapshot. It is counted once: ls reads no ref entry."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push({"w": torch.zeros(4)}, "x")
    mid = store.resolve("x")
    for i in range(4):
        store.refs_db.set(f"gone/{i}", mid)
        store.remove(f"gone/{i}")
    store.remove("x")
    shutil.rmtree(tmp_path / "s" / PREFIX)
    store.ls()  # a snapshot counting the five removed refs
    store.refs_db.set("x", mid)
    store.remove("x")
    reader = ckpt.Store.open(store.url)
    counting = Counting(reader)
    assert [r.name for r in reader.ls().refs] == [] and counting.of("refs/") == []  # x's records from the logs
    for _ in range(COMPACT_AFTER):  # a writer's compaction: a snapshot from the logs, without listing refs/
        store.refs_db.set("busy", mid, alias=True)
    fresh = ckpt.Store.open(store.url)
    counting = Counting(fresh)
    for _ in range(2):
        assert [r.name for r in fresh.ls().refs] == ["busy"]
    assert counting.of("refs/") == []
    assert [r.name for r in off(store).ls().refs] == ["busy"]


def test_a_folder_in_place_of_a_ref_begun_again_does_not_stop_compaction(tmp_path):
    """Compaction reads the entry before a ref begun again (its removal, to count it once). A folder in
    its place (a damaged or crafted store) raised past that read, so every writer's compaction failed:
    the logs grew without end and each ref update read them all. The entry is passed over (the count
    is then off by one, which the next exact reader mends), and the index compacts as without it."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push({"w": torch.zeros(4)}, "x")
    mid = store.resolve("x")
    store.remove("x")
    shutil.rmtree(tmp_path / "s" / PREFIX)
    store.ls()  # a snapshot counting x's removal (x@2)
    store.refs_db.set("x", mid)  # x@3, logged: begun again
    entry = tmp_path / "s" / store.refs_db.entry_path("x", 2)
    entry.unlink()
    entry.mkdir()
    for _ in range(3 * COMPACT_AFTER):
        store.refs_db.set("busy", mid, alias=True)
    snaps = [p for p in (tmp_path / "s" / PREFIX).iterdir() if p.name.endswith(".snap")]
    assert len(snaps) == 1 and not snaps[0].name.startswith("0000000000"), snaps
