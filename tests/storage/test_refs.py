from __future__ import annotations

import os
import shutil
import threading

import pytest

from ckpt_store.storage.backends import open_backend
from ckpt_store.storage.backends.local import LocalBackend
from ckpt_store.storage.errors import InvalidNameError, RefConflictError, RefNotFoundError, StoreFormatError
from ckpt_store.storage.refs import Refs, validate_ref_name

A = "a" * 64
B = "b" * 64


@pytest.fixture
def refs(tmp_path):
    return Refs(LocalBackend(str(tmp_path), fsync=False))


@pytest.mark.parametrize("name", ["x", "run7/step-4000", "llama-ft/legal", "a.b_c-d/e", "0abc"])
def test_valid_names(name):
    assert validate_ref_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "..", "../x", "a/../b", "/abs", "a//b", "a/", ".hidden", "a\x00b", "a\nb", "a\x01b", "x" * 256,
     "a b", "a\\b", "c:/x", "a/0000000001.ref", "-flag",
     "m\n", "team/model\n", "a\n/b", "a/\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u0660.ref"],
)
def test_invalid_names_rejected(name):
    with pytest.raises(InvalidNameError):
        validate_ref_name(name)


def test_set_current_history(refs):
    assert refs.current("m/x") is None
    refs.set("m/x", A)
    refs.set("m/x", B)
    assert refs.current("m/x").target == B
    assert [e.target for e in refs.history("m/x")] == [B, A]
    assert [e.seq for e in refs.history("m/x")] == [2, 1]


def test_remove_keeps_history(refs):
    refs.set("m/x", A)
    refs.remove("m/x")
    assert refs.current("m/x") is None
    assert [e.target for e in refs.history("m/x")] == [None, A]
    assert "m/x" not in refs.live()


def test_nested_names_are_separate(refs):
    refs.set("a", A)
    refs.set("a/b", B)
    assert refs.current("a").target == A
    assert refs.current("a/b").target == B
    assert len(refs.history("a")) == 1
    assert sorted(refs.live()) == ["a", "a/b"]
    assert sorted(refs.all_entries()) == ["a", "a/b"]


def test_concurrent_updates_lose_nothing(tmp_path):
    backend = LocalBackend(str(tmp_path), fsync=False)
    targets = [f"{i:064x}" for i in range(40)]

    def writer(chunk):
        r = Refs(backend)
        for t in chunk:
            r.set("shared/ref", t)

    threads = [threading.Thread(target=writer, args=(targets[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    history = Refs(backend).history("shared/ref")
    assert sorted(e.target for e in history) == sorted(targets)
    assert [e.seq for e in history] == list(range(40, 0, -1))


def test_corrupt_entry_is_a_format_error(tmp_path):
    backend = LocalBackend(str(tmp_path), fsync=False)
    r = Refs(backend)
    r.set("x", A)
    path = tmp_path / "refs" / "x" / "0000000001.ref"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(StoreFormatError):
        r.current("x")


def test_refs_on_memory_backend():
    import uuid

    r = Refs(open_backend(f"memory://refs-{uuid.uuid4().hex}"))
    r.set("m/x", A)
    assert r.current("m/x").target == A


def test_a_stray_file_named_almost_like_an_entry_is_not_one(tmp_path):
    """An entry is exactly ten ASCII digits and ".ref": a stray file named so with a trailing newline
    or other digits (Arabic-Indic ones match Python's \\d) was taken for an entry, then could not be
    read under the name its number gives, and every command that lists refs failed with a traceback."""
    r = Refs(LocalBackend(str(tmp_path), fsync=False))
    r.set("x", A)
    (tmp_path / "refs" / "x" / "0000000002.ref\n").write_bytes(b"stray")
    (tmp_path / "refs" / "x" / "\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0663.ref").write_bytes(b"stray")
    assert r.current("x").target == A and list(r.live()) == ["x"] and [e.seq for e in r.all_entries()["x"]] == [1]


@pytest.mark.parametrize("time", [b"NaN", b"Infinity", b"1e400", b"1" + b"0" * 400])
def test_an_entry_whose_time_is_not_a_number_is_damaged(tmp_path, time):
    """Python's JSON parser takes NaN, Infinity and integers no float holds; a ref entry's seal is
    checked by encoding it again, which raised ValueError (a traceback from every command)."""
    r = Refs(LocalBackend(str(tmp_path), fsync=False))
    r.set("x", A)
    path = tmp_path / "refs" / "x" / "0000000001.ref"
    raw = path.read_bytes()
    start = raw.index(b'"time":') + 7
    end = raw.index(b",", start)
    path.write_bytes(raw[:start] + time + raw[end:])
    with pytest.raises(StoreFormatError):
        r.current("x")


@pytest.mark.parametrize("name", ["m@1", "-x", ".hidden"])
def test_a_ref_folder_no_command_can_name_is_damage_not_a_ref(tmp_path, name):
    """A store folder holding refs/m@1/ (a sealed entry naming "m@1": anyone who writes a store can
    make one) had `ckpt ls` list a ref m@1 pointing at one checkpoint while `ckpt show m@1` showed
    another (version 1 of m), and `verify` and `gc` counted it a live ref that no command could
    reach or remove. An entry under a name that is not a valid ref name is now damage."""
    import time

    from ckpt_store.storage.gc import gc_roots
    from ckpt_store.storage.refs import RefEntry

    r = Refs(LocalBackend(str(tmp_path), fsync=False))
    r.set("m", A)
    r.set("m", B)
    folder = tmp_path / "refs" / name
    folder.mkdir(parents=True)
    (folder / "0000000001.ref").write_bytes(RefEntry(name, 1, A, time.time(), "w").to_json())
    live, damaged = r.scan()
    assert list(live) == ["m"] and list(damaged) == [name]
    assert "not a valid ref name" in str(damaged[name][0])
    histories, damaged = r.scan_histories()
    assert list(damaged) == [name] and histories[name] == []
    found = gc_roots(r)
    assert [x.label for x in found.roots] == ["m", "m@1"] and list(found.damaged) == [name]


@pytest.mark.parametrize("inside", [None, "x", "b/0000000001.ref"])
@pytest.mark.parametrize("seq", [3, 2])
def test_a_folder_in_place_of_an_entry_is_damage_not_skipped(tmp_path, seq, inside):
    """A folder named like a ref's entry (empty, or holding anything) was not listed: with it in place
    of the newest entry, the ref silently named its previous version (resolve, pull and push went on
    from there), and in place of an older one, NAME@N named another version. It is damage, as a
    damaged entry file is: entries newer than it are known, the rest is not."""
    from ckpt_store.storage.gc import gc_roots

    r = Refs(LocalBackend(str(tmp_path), fsync=False))
    for target in (A, B, A):
        r.set("m", target)
    r.set("other", B)
    path = tmp_path / "refs" / "m" / f"{seq:010d}.ref"
    path.unlink()
    path.mkdir()
    if inside is not None:
        (path / inside).parent.mkdir(parents=True, exist_ok=True)
        (path / inside).write_bytes(b"x")
    live, damaged = r.scan()
    if seq == 3:
        with pytest.raises(StoreFormatError, match="0000000003.ref is not a file"):
            r.current("m")
        assert list(live) == ["other"] and list(damaged) == ["m"]
    else:
        assert r.current("m").target == A and list(live) == ["m", "other"] and not damaged
    with pytest.raises(StoreFormatError, match="is not a file"):
        r.history("m")
    entries, err = r.readable_history("m")
    assert [e.seq for e in entries] == list(range(3, seq, -1)) and "is not a file" in str(err)
    histories, damaged = r.scan_histories()
    assert list(damaged) == ["m"] and [e.seq for e in histories["m"]] == list(range(3, seq, -1))
    assert list(gc_roots(r).damaged) == ["m"]
    assert r.set("m", B).seq == 4  # a new entry goes after it, as after a damaged entry file


def test_an_object_store_prefix_in_place_of_an_entry_is_damage():
    """On an object store a "folder" is a prefix holding objects (refs/m/0000000002.ref/x): it was
    skipped as no entry at all, and m named its previous version."""
    import uuid

    backend = open_backend(f"memory://refs-{uuid.uuid4().hex}")
    r = Refs(backend)
    r.set("m", A)
    backend.write("refs/m/0000000002.ref/x", b"x")
    with pytest.raises(StoreFormatError, match="0000000002.ref is not a file"):
        r.current("m")
    assert list(r.scan()[1]) == ["m"]


@pytest.mark.parametrize("thing, said", [("fifo", "not a regular file"), ("link to a device", "not a regular file"),
                                         ("link to nothing", "cannot be read: nothing is there")])
def test_a_non_file_in_place_of_an_entry_is_damage_beside_the_other_refs(tmp_path, thing, said):
    """A FIFO (or a link to /dev/zero) named like a ref's entry was refused as 'not a regular file'
    with an error that stopped the whole listing: `ckpt ls` and `du` showed no ref at all, and
    `ckpt log` nothing; a dangling symbolic link is listed, then cannot be opened, and its
    FileNotFoundError escaped every command that lists refs (ls, log, verify, gc) as a traceback.
    Each is damage to that ref, reported beside the others like a damaged entry."""
    from ckpt_store.storage.gc import gc_roots

    r = Refs(LocalBackend(str(tmp_path), fsync=False))
    r.set("m", A)
    r.set("m", B)
    r.set("other", A)
    path = tmp_path / "refs" / "m" / "0000000002.ref"
    path.unlink()
    if thing == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero" if thing == "link to a device" else str(tmp_path / "nowhere"))
    live, damaged = r.scan()
    assert list(live) == ["other"] and list(damaged) == ["m"] and said in str(damaged["m"][0])
    entries, bad = r.log("m")
    assert [e.seq for e in entries] == [1] and list(bad) == [2]
    assert list(gc_roots(r).damaged) == ["m"]
    with pytest.raises(StoreFormatError, match=said):
        r.current("m")


@pytest.mark.parametrize("where", ["outside", "inside", "unmounted"])
@pytest.mark.parametrize("link", ["ft", "ft/x"])
def test_a_ref_folder_that_is_a_symlink_is_damage_to_every_reader(tmp_path, link, where):
    """refs/ft moved elsewhere (outside the store, or within refs/) and replaced by a symbolic link
    to it: `ckpt pull ft/x` followed the link and worked, while the listing of refs/ (`ls`, gc's
    roots) did not enter it, so a gc deleted the chunks of a checkpoint a user could still name.
    Such a folder is now damage to the refs through it, for every reader; gc stops, with or without
    history."""
    import time

    from ckpt_store.storage.gc import gc_roots, plan_gc
    from ckpt_store.storage.objects import ObjectStore

    store = tmp_path / "store"
    backend = LocalBackend(str(store), fsync=False)
    r = Refs(backend)
    r.set("keep", A)
    r.set("ft/x", A)
    r.set("ft/x", B)
    moved = tmp_path / "elsewhere" if where != "inside" else store / "refs" / "moved"
    (store / "refs" / link).rename(moved)
    if where == "unmounted":  # a link to a folder on a disk that is not mounted now: a link to nothing
        shutil.rmtree(moved)
    (store / "refs" / link).symlink_to(moved, target_is_directory=True)
    live, damaged = r.scan()
    assert "keep" in live and link in damaged and "ft/x" not in live
    assert f"refs/{link} in the store folder is a symbolic link" in str(damaged[link][0])
    said = f"refs/{link} in the store folder is a symbolic link"
    for read in (r.current, r.history):
        with pytest.raises(StoreFormatError, match=said):
            read("ft/x")
    entries, err = r.readable_history("ft/x")
    assert entries == [] and said in str(err)
    assert r.log("ft/x")[0] == [] and list(r.log("ft/x")[1]) == [0]
    assert link in gc_roots(r).damaged
    old = time.time() - 86400
    for p in (store / "objects").rglob("*"):
        os.utime(p, (old, old))
    for keep_history in (True, False):
        with pytest.raises(StoreFormatError, match=f"gc deleted nothing: .*{said}"):
            plan_gc(ObjectStore(backend, None), r, grace_s=0, keep_history=keep_history)


def test_a_deleted_entry_file_is_a_gap_not_a_renumbering(tmp_path):
    """Entry 2 of 4 deleted: m@2 named entry 1's checkpoint (m@3's), silently, and a gc freed the
    checkpoint only entry 2 named. A number missing between a ref's oldest and newest entries is
    damage: the versions newer than it keep their NAME@N, the older ones have none, gc stops. A
    history cut short below (entry 1 deleted too) renumbers nothing and is not damage."""
    from ckpt_store.storage.gc import gc_roots

    r = Refs(LocalBackend(str(tmp_path), fsync=False))
    targets = [c * 64 for c in "abcd"]
    for t in targets:
        r.set("m", t)
    r.set("other", A)
    (tmp_path / "refs" / "m" / "0000000002.ref").unlink()
    said = "0000000002.ref is missing, with entries of m before and after it"
    entries, err = r.readable_history("m")
    assert [e.target for e in entries] == targets[:1:-1] and said in str(err)
    found = gc_roots(r)
    assert [x.label for x in found.roots if x.ref == "m"] == ["m", "m@1"] and said in str(found.damaged["m"][0])
    assert r.current("m").target == targets[3] and list(r.scan()[0]) == ["m", "other"]
    logged, damaged = r.log("m")
    assert [e.seq for e in logged] == [4, 3, 1] and list(damaged) == [2]
    with pytest.raises(StoreFormatError, match=said):
        r.history("m")
    assert r.set("m", A).seq == 5
    (tmp_path / "refs" / "m" / "0000000001.ref").unlink()  # the history cut short below the gap: no gap left
    entries, err = r.readable_history("m")
    assert [e.seq for e in entries] == [5, 4, 3] and err is None and not gc_roots(r).damaged


def test_an_entry_a_listing_missed_is_read_not_called_damage(tmp_path):
    """A directory is listed in several reads while it changes: a listing of a ref with thousands of
    entries (RUN/latest) can miss entry N and show N+1, written meanwhile by a concurrent update.
    Such a number, a gap in the listing, was reported as damage (a folder in its place) though the
    file is there: resolve NAME@K and gc failed during a training run. What is a file when read is
    read; a folder there, or nothing, is damage."""
    r = Refs(LocalBackend(str(tmp_path), fsync=False))
    for t in (A, B, A):
        r.set("m", t)
    assert r.read_entry("m", 2, is_file=False).target == B  # listed as a gap, there when read
    path = tmp_path / "refs" / "m" / "0000000002.ref"
    path.unlink()
    with pytest.raises(StoreFormatError, match="0000000002.ref is missing"):
        r.read_entry("m", 2, is_file=False)
    path.mkdir()
    with pytest.raises(StoreFormatError, match="0000000002.ref is not a file"):
        r.read_entry("m", 2, is_file=False)


def _as_listed(r: Refs, name: str) -> object:
    """What the current entry of ``name`` is by a listing of its whole history: the entry, None, or the error."""
    seqs = r._entry_seqs(name)
    if not seqs:
        return None
    try:
        entry = r.read_entry(name, max(seqs), seqs[max(seqs)] is not None)
    except StoreFormatError as e:
        return str(e)
    return entry if entry.target is not None else None


def _current(r: Refs, name: str) -> object:
    try:
        return r.current(name)
    except StoreFormatError as e:
        return str(e)


def test_the_current_entry_of_a_long_history_is_found_without_listing_it_locally(tmp_path):
    """A run's RUN/latest gains an entry per save, and a restart resolves it: current() listed the
    ref's whole history (a stat per entry, and a walk of its folder) to read the newest. It now reads
    the folder's names once (no stat each) and the newest entry: the same answer."""
    w = Refs(LocalBackend(str(tmp_path), fsync=False))
    for i in range(3000):
        w.set("run/latest", A if i % 2 else B, alias=True)
    r = Refs(LocalBackend(str(tmp_path), fsync=False))  # a restarted process: no hint
    calls: list[tuple[str, str]] = []
    for op in ("list", "folders", "children", "read", "exists"):
        real = getattr(r.backend, op)
        setattr(r.backend, op, lambda path, *a, real=real, op=op: calls.append((op, path)) or real(path, *a))
    assert r.current("run/latest").seq == 3000 and r.current("run/latest").target == A
    assert calls == [("children", "refs/run/latest"), ("read", "refs/run/latest/0000003000.ref")] * 2
    assert _as_listed(r, "run/latest") == r.current("run/latest")


def test_the_current_entry_of_a_long_history_is_found_in_a_few_requests_on_s3(s3_url):
    """On S3 current() listed the ref's whole history, one LIST page per 1,000 entries, before reading
    the newest (here pages of 5 stand for them). Now a history longer than a page is listed from the
    newest entry the metadata index's snapshot records (two small reads of index/), and a reader that
    has read the ref lists from the entry it read: a fixed number of requests however long the history."""
    import ckpt

    store = ckpt.Store.init(s3_url)
    for i in range(60):
        store.refs_db.set("run/latest", A if i % 2 else B, alias=True)
    fresh = ckpt.Store.open(s3_url)  # a restarted process
    b = fresh.backend
    b.page_keys = 5
    pages, gets = [], []
    real_page, real_get = b._list_page, b._get
    b._list_page = lambda prefix, *a: pages.append(prefix[len(b.prefix) + 1:]) or real_page(prefix, *a)
    b._get = lambda path, *a, **k: gets.append(path) or real_get(path, *a, **k)
    assert fresh.refs_db.current("run/latest").seq == 60
    assert pages.count("refs/run/latest/") == 2  # the first page (more follow), then the page from the hint on
    assert gets[-1] == "refs/run/latest/0000000060.ref" and len([g for g in gets if g.startswith("index/")]) == 2
    pages.clear(), gets.clear()
    fresh.refs_db.set("run/latest", A, alias=True)  # another update, from elsewhere
    store.refs_db.set("run/latest", B, alias=True)
    assert fresh.refs_db.current("run/latest").seq == 62
    assert [p for p in pages if p.startswith("refs/")] == ["refs/run/latest/"] * 2  # the update's, and this
    assert _as_listed(fresh.refs_db, "run/latest") == fresh.refs_db.current("run/latest")


def test_the_current_entry_found_from_a_hint_is_the_one_a_full_listing_gives(store_url):
    """current() starts listing at a hint (the entry its Refs last wrote or read, or the index's):
    whatever happened to the ref since, its answer is the full listing's, or the same error. Three
    readers: the writer, one that read the ref before, and a restarted one (on S3 with pages of 4, so
    that the index's hint is taken)."""
    import ckpt

    store = ckpt.Store.init(store_url)
    w = store.refs_db
    for i in range(24):
        w.set("m", A if i % 2 else B)
    reader = ckpt.Store.open(store_url).refs_db
    assert reader.current("m").seq == 24
    b = store.backend
    path = w.entry_path

    def check(expected: object) -> None:
        readers = [w, reader, ckpt.Store.open(store_url).refs_db]
        for r in readers:
            if hasattr(r.backend, "page_keys"):
                r.backend.page_keys = 4
        for r in readers:
            got = _current(r, "m")
            assert got == _as_listed(readers[2], "m")
            if isinstance(expected, str):
                assert isinstance(got, str) and got.startswith(expected)
            else:
                assert getattr(got, "seq", got) == expected

    other = ckpt.Store.open(store_url).refs_db
    for _ in range(5):
        other.set("m", A)  # a concurrent updater
    check(29)
    b.delete(path("m", 27))  # a gap above where the readers start
    check(29)
    for s in range(1, 11):  # a history cut short
        b.delete(path("m", s))
    check(29)
    b.write(path("m", 30), b'{"format": "ckpt-ref", "na')  # half written
    check(f"ref entry {path('m', 30)} is not valid JSON")
    b.delete(path("m", 30))
    b.write(path("m", 9999999999), b.read(path("m", 29)))  # a forged entry far past the others
    check(f"ref entry {path('m', 9999999999)} names m#29")
    b.delete(path("m", 9999999999))
    other.remove("m")
    check(None)
    b.write(path("m", 31) + "/x", b"")  # a folder (an object store's prefix) in the entry's place
    check(f"ref entry {path('m', 31)} is not a file (a folder is there): what m named then is unknown")
    if b.local_path("refs") is not None:  # the ref removed from the store, then begun again
        shutil.rmtree(b.local_path("refs/m"))
    elif hasattr(b, "fs"):
        b.fs.rm(b._p("refs/m"), recursive=True)
    else:
        for e in list(b.list("refs/m")):
            b.delete(e.path)
    check(None)
    for _ in range(3):  # by the writer that wrote there before (locally: it had made the folder)
        other.set("m", B)
    check(3)


def test_cut_history_keeps_the_newest_entry_and_drops_a_removed_ref_whole(refs, tmp_path):
    """For a run's local tier (docs/format.md): a ref's older entries go, oldest first, and a removed
    ref goes with its folder; the current values are as before, and a name cut away begins again at 1."""
    for target in (A, B, A):
        refs.set("run/latest", target, alias=True)
    refs.set("run/step-1", A)
    refs.set("run/step-1/x", B)  # a ref below a removed one's folder stays
    refs.set("run/step-2", B)
    refs.remove("run/step-1")
    refs.remove("run/step-2")
    deleted = []
    real = refs.backend.delete
    refs.backend.delete = lambda path: deleted.append(path) or real(path)
    for name in ("run/latest", "run/step-1", "run/step-2", "run/step-9"):
        refs.cut_history(name)
    assert deleted == [f"refs/run/latest/{1:010d}.ref", f"refs/run/latest/{2:010d}.ref",
                       f"refs/run/step-1/{1:010d}.ref", f"refs/run/step-1/{2:010d}.ref",
                       f"refs/run/step-2/{1:010d}.ref", f"refs/run/step-2/{2:010d}.ref"]
    assert not (tmp_path / "refs" / "run" / "step-2").exists()
    assert sorted(refs.listing()) == ["run/latest", "run/step-1/x"]
    assert refs.current("run/latest").seq == 3 and refs.current("run/latest").target == A
    assert refs.current("run/step-1/x").target == B and refs.current("run/step-2") is None
    assert refs.set("run/step-2", A).seq == 1 and refs.set("run/latest", B, alias=True).seq == 4


def test_a_reader_racing_a_cut_of_history_reads_the_newest_entry_not_damage(tmp_path):
    """A run's local tier cuts its refs' histories as it prunes (cut_history), while another process
    reads them (`ckpt serve --local-tier`, say): the entry a reader listed as newest was deleted
    before it read it. The live RUN/latest was reported damaged ('listed but cannot be read'), as
    was a step removed and cut away, and a scan (steps()) left a live step out. Deleted since
    listed is not damage: a newer entry took its place, or the ref went whole; it is listed again.
    So for the histories the run page of `ckpt serve` reads: a step there was shown damaged, and for
    `ckpt log` (Refs.log), which reported the entry as damaged."""
    tier = Refs(LocalBackend(str(tmp_path), fsync=False))
    for name in ("run/latest", "run/step-1", "run/step-2", "run/step-3"):
        tier.set(name, A, alias=name.endswith("latest"))

    def save_and_prune(latest: str, drop: str) -> None:
        tier.set("run/latest", latest, alias=True)
        tier.remove(drop)
        for name in tier.listing("run"):
            tier.cut_history(name)

    def reader(*moves) -> Refs:
        """A reader whose next reads of an entry each first let the tier do the next of ``moves`` (None: nothing)."""
        r = Refs(LocalBackend(str(tmp_path), fsync=False))
        real, todo = r.backend.read, list(moves)
        r.backend.read = lambda path, *a: ((todo.pop(0) or (lambda: None))() if todo else None) or real(path, *a)
        return r

    r = reader(lambda: save_and_prune(B, "run/step-1"), None, lambda: save_and_prune(A, "run/step-2"))
    assert r.current("run/latest").target == B and r.current("run/step-2") is None
    assert r.current("run/latest").target == A  # (listed from its hint)
    live, damaged = reader(lambda: save_and_prune(B, "run/step-3")).scan("run")
    assert list(live) == ["run/latest"] and live["run/latest"].target == B and not damaged
    tier.set("run/step-1", A)
    with pytest.raises(RefNotFoundError):  # the tier removed it first
        reader(lambda: save_and_prune(A, "run/step-1")).remove("run/step-1")
    tier.set("run/step-1", B)
    with pytest.raises(RefConflictError):  # moved meanwhile: not removed
        reader(lambda: tier.set("run/step-1", A) and tier.cut_history("run/step-1")).remove("run/step-1", expect=B)
    assert tier.current("run/step-1").target == A
    tier.set("run/step-4", A)  # the run page of the web view: each step's history, read as the tier prunes
    histories, damaged = reader(None, lambda: save_and_prune(A, "run/step-4")).scan_histories("run")
    assert not damaged and [e.target for e in histories["run/latest"]] == [A] and histories["run/step-4"] == []
    entries, err = reader(lambda: save_and_prune(B, "run/step-1")).readable_history("run/latest")
    assert err is None and [e.target for e in entries] == [B]
    tier.set("run/step-5", A)  # `ckpt log`, and a resolve of a removed ref (which reads its history)
    assert [e.target for e in reader(lambda: save_and_prune(A, "run/step-5")).history("run/latest")] == [A]
    assert reader(lambda: save_and_prune(B, "run/step-1")).history("run/step-1") == []
    tier.set("run/step-6", A)  # `ckpt log` as the tier prunes: the entry it listed was reported damaged
    entries, damaged = reader(lambda: save_and_prune(B, "run/step-6")).log("run/latest")
    assert not damaged and [(e.seq, e.target) for e in entries] == [(tier.current("run/latest").seq, B)]
    latest = tmp_path / "refs" / "run" / "latest"
    os.symlink("nowhere", latest / f"{tier.current('run/latest').seq + 1:010d}.ref")  # a link to nothing is still damage
    with pytest.raises(StoreFormatError, match="listed but cannot be read: nothing is there"):
        Refs(LocalBackend(str(tmp_path), fsync=False)).current("run/latest")


def test_the_log_names_every_entry_missing_not_only_the_newest(tmp_path):
    """`ckpt log` (Refs.log) reported entry 8 alone as damaged where entries 3 and 6 to 8 were deleted by
    hand: the listing marks only the newest number missing (where every other reader stops), so the rest
    of the gap, and an older gap, went unsaid. Each run of missing entries is one error, by its newest,
    naming them all; the readable entries are as before."""
    import ckpt

    store = ckpt.Store.init(str(tmp_path / "store"))
    r = store.refs_db
    for t in [A, B] * 5:
        r.set("m", t)
    for seq in (3, 6, 7, 8):
        (tmp_path / "store" / "refs" / "m" / f"{seq:010d}.ref").unlink()
    entries, damaged = r.log("m")
    assert [e.seq for e in entries] == [10, 9, 5, 4, 2, 1] and sorted(damaged) == [3, 8]
    assert "ref entries refs/m/0000000006.ref to 0000000008.ref (3 of them) are missing" in str(damaged[8])
    assert "ref entry refs/m/0000000003.ref is missing, with entries of m before and after it" in str(damaged[3])
    assert store.readable_log("m")[1] == {s: str(e) for s, e in damaged.items()}
    (tmp_path / "store" / "refs" / "m" / "0000000005.ref").unlink()  # one run of them: 5 to 8
    assert sorted(r.log("m")[1]) == [3, 8] and "0000000005.ref to 0000000008.ref (4 of them)" in str(r.log("m")[1][8])
    (tmp_path / "store" / "refs" / "m" / "0000000008.ref").mkdir()  # a folder where the newest was: damage of its own
    damaged = r.log("m")[1]
    assert sorted(damaged) == [3, 7, 8] and "is not a file (a folder is there)" in str(damaged[8])
    assert "0000000005.ref to 0000000007.ref (3 of them)" in str(damaged[7])


def test_an_update_is_written_past_the_newest_entry_not_into_a_gap(store_url):
    """A writer tried the entry one past its own last first, taken where the one before it is there
    (so that RUN/latest is not listed each update). Above a gap (an entry deleted: damage) the update
    filled the gap: set() returned entry 3 while m's newest was still entry 5, naming another
    checkpoint (the push silently not current), and the gap no longer showed. It goes past the newest."""
    import ckpt

    w = ckpt.Store.init(store_url).refs_db
    w.set("m", A), w.set("m", A)
    other = ckpt.Store.open(store_url).refs_db
    for _ in range(3):
        other.set("m", B)
    w.backend.delete(w.entry_path("m", 3))
    entry = w.set("m", A)
    assert entry.seq == 6 and w.current("m") == entry == ckpt.Store.open(store_url).refs_db.current("m")
    assert [e.seq for e in w.log("m")[0]] == [6, 5, 4, 2, 1] and list(w.log("m")[1]) == [3]


def test_an_update_on_s3_goes_past_a_gap_of_two_entries_in_as_few_requests_as_the_guess(s3_url):
    """The writer's guess (one past its own last entry, taken where that entry is there and the next one
    is not: two HEADs) filled a gap of two or more entries deleted by hand: set() wrote entry 9 while m's
    newest was entry 11, so the push looked done and was not current. On S3 a listing from the writer's
    last entry is one request where the guess's HEADs were two: it sees the gap, and the update goes past."""
    from s3support import http_requests

    import ckpt

    w = ckpt.Store.init(s3_url).refs_db
    w.set("m", A), w.set("m", A)
    other = ckpt.Store.open(s3_url).refs_db
    for _ in range(4):
        other.set("m", B)
    assert w.set("m", A).seq == 7
    with http_requests(w.backend) as seen:
        assert w.set("m", A).seq == 8
    upto = next(i for i, (_, key) in enumerate(seen) if key.endswith("/refs/m/0000000008.ref")) + 1
    assert [k for k, _ in seen[:upto]] == ["LIST", "PUT"]  # the guess: HEAD, HEAD, PUT (then the index's log, as now)
    for _ in range(3):
        other.set("m", B)  # 9, 10, 11
    w.backend.delete(w.entry_path("m", 9)), w.backend.delete(w.entry_path("m", 10))
    entry = w.set("m", A)
    assert entry.seq == 12 and w.current("m") == entry == ckpt.Store.open(s3_url).refs_db.current("m")  # was 9, below 11
    assert [e.seq for e in w.log("m")[0]][:3] == [12, 11, 8]


def test_a_push_to_a_local_store_goes_past_a_gap_of_two_entries(tmp_path):
    """On a local store the writer's guess (one past its own last entry, taken where that entry is there and
    the next one is not: two stats) filled a gap of two or more entries deleted by hand: the push wrote entry 7
    while m's newest was entry 9, so it looked done and m still named the other checkpoint. The writer lists
    the ref's folder from its last entry, as on S3: it sees the gap, and the push goes past it."""
    import torch

    import ckpt

    url = str(tmp_path / "store")
    mine = ckpt.Store.init(url)
    ours, theirs = torch.nn.Linear(8, 4).state_dict(), torch.nn.Linear(8, 4).state_dict()
    mine.push(ours, "m"), mine.push(ours, "m")
    other = ckpt.Store.open(url)
    for _ in range(3):
        other.push(theirs, "m")  # 3, 4, 5
    mine.push(ours, "m")
    assert mine.refs_db.current("m").seq == 6  # (past 5: the entry above its guess is there)
    for _ in range(3):
        other.push(theirs, "m")  # 7, 8, 9
    (tmp_path / "store" / "refs" / "m" / "0000000007.ref").unlink()
    (tmp_path / "store" / "refs" / "m" / "0000000008.ref").unlink()
    pushed = mine.push(ours, "m")
    assert mine.refs_db.current("m").seq == 10  # was 7, below 9
    assert ckpt.Store.open(url).resolve("m") == pushed != ckpt.Store.open(url).resolve("m@1")
    assert [e.seq for e in mine.refs_db.log("m")[0]][:3] == [10, 9, 6]


def test_listing_the_refs_of_a_local_store_reads_each_folder_once(tmp_path, monkeypatch):
    """A local store holds a folder per ref: listing refs/ (ls, du and gc, at every run) read each
    folder twice, once for the entry files and once more (os.walk) for the folders among them
    (empty ones, ones named like an entry, links). One walk gives both, with the same answer."""
    refs = Refs(LocalBackend(str(tmp_path)))
    mid = "ab" * 32
    for i in range(20):
        refs.set(f"team/m{i}", mid)
    (tmp_path / "refs" / "team" / "empty").mkdir()
    (tmp_path / "refs" / "team" / "m3" / "0000000002.ref").mkdir()  # a folder in place of an entry: damage
    os.symlink(tmp_path / "refs" / "team" / "m4", tmp_path / "refs" / "team" / "linked")
    before = refs.listing()
    read = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p=".": read.append(os.fspath(p)) or real(p))
    assert refs.listing() == before
    assert len(read) == len(set(read)) and before["team/m3"][2] is None and before["team/linked"] == {0: None}


def test_a_removal_is_on_disk_before_the_command_returns(tmp_path, monkeypatch):
    """`ckpt rm` wrote the removal's entry (the file fsynced) but never fsynced the ref's folder that names it: a
    power loss after a gc had then freed the ref's data could bring the ref back, naming chunks that are gone.
    There is no power to cut here: fsyncs are recorded by the folder's identity (and done), and the ref's folder
    must be fsynced once the removal's entry is in it."""
    import ckpt_store.storage.backends.local as local

    backend = LocalBackend(str(tmp_path), fsync=True)
    r = Refs(backend)
    r.set("team/model", "a" * 64)
    backend.flush()
    folder = tmp_path / "refs" / "team" / "model"
    synced: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (os.stat(folder).st_dev, os.stat(folder).st_ino) and len(os.listdir(folder)) == 2:
            synced.append(fd)
        real(fd)

    monkeypatch.setattr(local.os, "fsync", fsync)
    r.remove("team/model")
    assert synced, "the ref's folder was not fsynced after its removal's entry was written"
