from __future__ import annotations

import os

import pytest
import torch

import ckpt
from ckpt.errors import (
    AmbiguousRefError,
    CorruptObjectError,
    DestinationExistsError,
    ObjectNotFoundError,
    RefNotFoundError,
    StoreNotFoundError,
)


def test_push_same_twice_adds_no_objects(store_url):
    store = ckpt.Store.init(store_url)
    t = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    store.push(t, "a")
    before = sorted(o.id for o in store.objects.list("chunks"))
    r = store.push(t, "b")
    assert r.new_chunks == 0 and r.written_bytes == 0
    assert sorted(o.id for o in store.objects.list("chunks")) == before
    assert store.manifest("a").tensors == store.manifest("b").tensors


def test_shared_tensors_share_chunks(store_url):
    store = ckpt.Store.init(store_url)
    shared = torch.randn(512, 512)
    store.push({"w": shared, "head": torch.randn(10)}, "a")
    r = store.push({"w": shared, "head": torch.randn(10)}, "b")
    assert r.new_chunks == 1  # only the new head; the header is identical too
    u = store.du()
    assert u.dedup_saved >= shared.numel() * 4


def test_ref_forms(store):
    first = store.push({"x": torch.zeros(1)}, "m/a")
    second = store.push({"x": torch.ones(1)}, "m/a")
    assert store.resolve("m/a") == second == store.resolve("m/a@0")
    assert store.resolve("m/a@1") == first
    assert store.resolve(first[:10]) == first
    with pytest.raises(RefNotFoundError, match="2 versions"):
        store.resolve("m/a@2")
    # a version number past what int() reads (4,300 digits) raised ValueError: a traceback in
    # `ckpt show`, a 500 in `ckpt serve` (/checkpoint/m/a@999...)
    for many in ("9" * 5000, "1" + "0" * 20):
        with pytest.raises(RefNotFoundError, match="2 versions"):
            store.resolve(f"m/a@{many}")
    assert store.resolve("m/a@" + "0" * 5000 + "1") == first
    with pytest.raises(RefNotFoundError):
        store.resolve("nope")
    store.remove("m/a")
    with pytest.raises(RefNotFoundError, match=r"m/a was removed \(its last version is m/a@0"):
        store.resolve("m/a")
    # `ckpt log` labels the versions of a removed ref m/a@0, m/a@1: both resolve until gc
    assert store.resolve("m/a@0") == second and store.resolve("m/a@1") == first


def test_versions_gc_freed_say_so(tmp_path):
    """Issue 15 item 15: after `rm x`, `log` showed x@0 that resolve called removed; after gc, an
    ObjectNotFoundError said "run `ckpt verify`", which then reported ok."""
    path = tmp_path / "s"
    store = ckpt.Store.init(str(path))
    store.push({"w": torch.ones(3)}, "x")
    store.push({"w": torch.zeros(3)}, "x")
    keep = store.push({"w": torch.ones(5)}, "y")
    store.push({"w": torch.ones(6)}, "y")
    store.remove("x")
    _age(path)
    store.gc(grace_s=0)
    for label in ("x@0", "x@1"):
        with pytest.raises(RefNotFoundError, match=rf"{label} \(checkpoint [0-9a-f]{{12}}\) is no longer in the store: "
                                                    r"`ckpt gc` freed it \(x was removed\)"):
            store.resolve(label)
    assert store.resolve("y@1") == keep
    store.gc(grace_s=0, keep_history=False)
    with pytest.raises(RefNotFoundError, match=r"y@1 .* no longer in the store: `ckpt gc` freed it \(gc --no-history"):
        store.resolve("y@1")
    r = store.verify()
    assert r.ok and r.freed == ["y@1"]


def test_a_ref_named_as_a_checkpoint_id_names_one_checkpoint_everywhere(store):
    """A ref named with the 64 hex digits of another checkpoint's id: `ckpt show`, `ckpt copy` and
    the reader (through resolve) took the ref's checkpoint, while `ckpt pull` and `load` (through
    manifest) took the checkpoint of that id, and `ckpt pull --json` reported the ref's id for the
    other checkpoint's bytes. A full id now names its checkpoint in every command."""
    first = {"w": torch.ones(3)}
    cid = store.push(first, "other")
    store.push({"w": torch.zeros(5)}, cid)
    assert store.resolve(cid) == cid
    reader = store.reader(cid)
    assert reader.id == cid and [tuple(t.shape) for t in reader.manifest.tensors] == [(3,)]
    got = store.load(cid)
    assert got["w"].numpy().tobytes() == first["w"].numpy().tobytes()
    assert store.resolve(f"{cid}@0") != cid  # the ref itself stays reachable as NAME@N

def test_a_removed_ref_named_with_hex_digits_is_said_removed(store):
    """`rm` of a ref named with hex digits (a commit hash, say): resolving it said "no ref or
    checkpoint named ..." while `ckpt log` listed its history, instead of "was removed" and where
    its last version is."""
    store.push({"w": torch.ones(3)}, "cafe1234")
    store.remove("cafe1234")
    with pytest.raises(RefNotFoundError, match=r"ref cafe1234 was removed \(its last version is cafe1234@0"):
        store.resolve("cafe1234")
    assert store.manifest("cafe1234@0").tensors[0].shape == (3,)

def test_versions_newer_than_a_damaged_ref_entry_still_resolve(tmp_path):
    """One damaged old entry of a ref (a flipped bit in refs/m/0000000001.ref) made every NAME@N of
    it fail, `m@0` included, though `m` itself pulled: the versions newer than the damaged entry
    are numbered from the newest and are known. Beyond it, the damage is the answer."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    ids = [store.push({"w": torch.full((3,), float(i))}, "m") for i in range(3)]
    path = tmp_path / "s/refs/m/0000000001.ref"
    raw = bytearray(path.read_bytes())
    raw[40] ^= 1
    path.write_bytes(raw)
    assert store.resolve("m@0") == ids[2] == store.resolve("m") and store.resolve("m@1") == ids[1]
    with pytest.raises(ckpt.CkptError, match="0000000001.ref is damaged"):
        store.resolve("m@2")
    with pytest.raises(ckpt.CkptError, match="0000000001.ref is damaged"):
        store.resolve("m@7")

def test_versions_gc_freed_name_the_real_reason(tmp_path):
    """A version gc freed because the ref was removed and pushed again since, or because it was an
    earlier target of an alias (RUN/latest), was said freed by `gc --no-history`, which was never run:
    the message sent the user looking for a gc option nobody used."""
    path = tmp_path / "s"
    store = ckpt.Store.init(str(path))
    store.push({"w": torch.ones(3)}, "x")
    store.remove("x")
    store.push({"w": torch.zeros(3)}, "x")
    a = store.push({"w": torch.ones(4)}, "run/step-1")
    b = store.push({"w": torch.ones(5)}, "run/step-2")
    store.refs_db.set("run/latest", a, alias=True)
    store.refs_db.set("run/latest", b, alias=True)
    store.remove("run/step-1")
    _age(path)
    store.gc(grace_s=0)
    with pytest.raises(RefNotFoundError, match=r"x@1 .* freed it \(x was removed, then pushed again\)"):
        store.resolve("x@1")
    with pytest.raises(RefNotFoundError, match=r"run/latest@1 .* freed it \(run/latest@1 was set as an alias \(like "
                                               r"RUN/latest\): gc keeps only the current version of an alias\)"):
        store.resolve("run/latest@1")
    # A plain ref whose older entry was an alias's (an alias copied over it, then a push): that
    # version is the alias's, not the ref's
    c = store.push({"w": torch.ones(6)}, "y")
    store.refs_db.set("y", b, alias=True)
    store.push({"w": torch.ones(7)}, "y")
    _age(path)
    store.gc(grace_s=0)
    assert store.resolve("y@1") == b and store.resolve("y@2") == c  # b is run/step-2's: still there
    store.remove("run/step-2")
    store.refs_db.set("run/latest", c, alias=True)
    _age(path)
    store.gc(grace_s=0)
    with pytest.raises(RefNotFoundError, match=r"y@1 .* \(y@1 was set as an alias"):
        store.resolve("y@1")
    assert store.verify().ok


def _age(path, seconds=100):
    import time

    t = time.time() - seconds
    for root, _, files in os.walk(path / "objects"):
        for f in files:
            os.utime(os.path.join(root, f), (t, t))


def test_ambiguous_prefix(store):
    from ckpt_store.storage.objects import object_id

    seen: dict[str, bytes] = {}
    for i in range(100_000):  # birthday search for two records sharing 4 hex digits
        data = b'{"n":%d}' % i
        prev = seen.setdefault(object_id(data)[:4], data)
        if prev is not data:
            break
    ids = [store.objects.put_manifest(prev), store.objects.put_manifest(data)]
    assert ids[0][:4] == ids[1][:4]
    with pytest.raises(AmbiguousRefError, match="2 checkpoints"):
        store.resolve(ids[0][:4])
    assert store.resolve(ids[0]) == ids[0]


def test_open_missing_store(tmp_path):
    with pytest.raises(StoreNotFoundError):
        ckpt.Store.open(str(tmp_path / "none"))


def _chunk_path(store, cid):
    return store.backend.local_path(store.objects.path("chunks", cid))


def test_corrupted_chunk_is_an_error_never_wrong_data(store, tmp_path):
    store.push({"w": torch.randn(1000, 100)}, "a")
    m = store.manifest("a")
    cid = m.tensors[0].chunks[0]
    p = _chunk_path(store, cid)
    data = bytearray(open(p, "rb").read())
    data[-10] ^= 0x40
    with open(p, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptObjectError, match=cid):
        store.load("a")
    with pytest.raises(CorruptObjectError):
        store.pull("a", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    assert [p for p in os.listdir(tmp_path) if "ckpt-tmp" in p] == []
    report = store.verify()
    assert not report.ok and list(report.damaged_refs) == ["a"]


def test_missing_chunk_names_ref(store):
    store.push({"w": torch.randn(100)}, "a")
    store.push({"v": torch.randn(100)}, "b")
    cid = store.manifest("a").tensors[0].chunks[0]
    os.unlink(_chunk_path(store, cid))
    with pytest.raises(ObjectNotFoundError):
        store.load("a")
    r = store.verify()
    assert list(r.damaged_refs) == ["a"] and store.verify(["b"]).ok


def test_corrupted_manifest_detected(store):
    mid = store.push({"w": torch.randn(10)}, "a")
    p = store.backend.local_path(store.objects.path("manifests", mid))
    with open(p, "r+b") as f:
        f.seek(20)
        f.write(b"X")
    with pytest.raises(CorruptObjectError, match=mid):
        store.load("a")
    assert "a" in store.verify().damaged_refs


def test_pull_refuses_to_overwrite(store, tmp_path):
    store.push({"w": torch.randn(10)}, "a")
    dest = tmp_path / "x.safetensors"
    dest.write_bytes(b"precious")
    with pytest.raises(DestinationExistsError):
        store.pull("a", dest)
    assert dest.read_bytes() == b"precious"
    store.pull("a", dest, overwrite=True)
    assert dest.read_bytes() != b"precious"


def test_memory_backend_full_cycle():
    store = ckpt.Store.init("memory://full-cycle-test")
    t = {"w": torch.randn(300, 300)}
    store.push(t, "a")
    assert torch.equal(ckpt.Store.open("memory://full-cycle-test").load("a")["w"], t["w"])
    assert store.verify().ok
    store.remove("a")
    assert store.gc(grace_s=0).planned >= 2


def test_push_returns_the_id_with_what_was_written_and_old_spellings_warn(tmp_path):
    """One verb per job: push's result is the id (a str) and says what it wrote; push_report,
    get_manifest and open(create=True) still work for a release, with a DeprecationWarning."""
    import warnings

    store = ckpt.Store.init(str(tmp_path / "s"))
    t = {"w": torch.arange(1000, dtype=torch.float32)}
    r = store.push(t, "a")
    assert isinstance(r, str) and r == store.resolve("a") and r.id == r and type(r.id) is str
    assert r.new_chunks == r.chunks >= 1 and r.logical_bytes > 4000 and r.as_dict()["id"] == r
    assert store.push(t, "b").new_chunks == 0  # the same bytes: nothing new to write
    assert store.manifest(r).tensors[0].name == "w" == store.manifest("a").tensors[0].name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.push_report(t, "c").new_chunks == 0
        assert store.get_manifest(r) == store.manifest(r)
        assert ckpt.Store.open(str(tmp_path / "new"), create=True).url
    assert [w.category for w in caught] == [DeprecationWarning] * 3


def test_merge_and_remix_take_the_store_as_a_keyword_and_the_old_order_warns(tmp_path):
    import warnings

    store = ckpt.Store.init(str(tmp_path / "s"))
    for i in range(3):
        store.push({"w": torch.full((4,), float(i))}, f"ft/{i}")
    new = ckpt.merge(["ft/0", "ft/2"], "linear", name="m/new", store=store)
    with pytest.warns(DeprecationWarning, match="merge"):
        old = ckpt.merge(store, ["ft/0", "ft/2"], "linear", name="m/old")
    assert new.inputs == old.inputs and store.load("m/new")["w"].tolist() == store.load("m/old")["w"].tolist() == [1.0] * 4
    with pytest.warns(DeprecationWarning, match="remix"):
        a = ckpt.remix(store, ["ft/0", "ft/1", "ft/2"], lambda sd: float(sd["w"][0]), 2, name="r/old")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = ckpt.remix(["ft/0", "ft/1", "ft/2"], lambda sd: float(sd["w"][0]), 2, name="r/new", store=store)
    assert store.load("r/old")["w"].tolist() == store.load("r/new")["w"].tolist() == [1.5] * 4 and a and b
    with pytest.raises(TypeError, match="both"):
        ckpt.merge(store, ["ft/0"], name="x", store=store)


def test_copy_to_a_path_checks_the_refs_before_it_makes_a_store_there(tmp_path):
    """Store.copy_to(PATH, refs) made a store at PATH before it looked the refs up: a copy of a ref
    that does not exist left a new, empty store behind."""
    src = ckpt.Store.init(str(tmp_path / "src"))
    src.push({"w": torch.ones(4)}, "a")
    for refs in (["nosuch"], [], ["a:-bad"]):
        with pytest.raises(ckpt.CkptError):
            src.copy_to(str(tmp_path / "dst"), refs)
        assert not (tmp_path / "dst").exists()
    src.copy_to(str(tmp_path / "dst"), ["a"])
    assert ckpt.Store.open(str(tmp_path / "dst")).resolve("a") == src.resolve("a")


def test_a_deleted_entry_stops_numbering_on_every_backend(store_url):
    """A ref entry deleted from the store (on S3: an object deleted by hand) silently renumbered
    NAME@N below it. On every backend the gap is damage: newer versions resolve, older ones and gc
    say which entry is missing; an entry a listing missed but that is there is read."""
    store = ckpt.Store.init(store_url)
    ids = [store.push({"w": torch.full((3,), float(i))}, "m") for i in range(3)]
    store.backend.delete(store.refs_db.entry_path("m", 2))
    assert store.resolve("m@0") == ids[2]
    for label in ("m@1", "m@2"):
        with pytest.raises(ckpt.CkptError, match="0000000002.ref is missing"):
            store.resolve(label)
    with pytest.raises(ckpt.CkptError, match="gc deleted nothing: .*0000000002.ref is missing"):
        store.gc(grace_s=0, dry_run=True)
    assert store.refs_db.read_entry("m", 3, is_file=False).target == ids[2]


def test_a_manifest_no_reader_accepts_is_never_written(tmp_path, monkeypatch):
    """A .pt whose non-tensor values made a manifest past MAX_RECORD_BYTES (a sampler's permutation of
    millions of indexes) pushed "successfully": the ref then named a checkpoint no command could read
    ("corrupt: ... more than any valid object"). The push is refused before the manifest is written:
    no ref moves, and the store stays whole. Nor is any chunk uploaded first (left for gc): the values
    and metadata the manifest will hold are measured before anything is written. (The limit is lowered
    here so as to need kilobytes, not hundreds of megabytes.)"""
    from ckpt.errors import RecordTooLargeError
    from ckpt_store.storage import objects

    monkeypatch.setattr(objects, "MAX_RECORD_BYTES", 1 << 16)
    store = ckpt.Store.init(str(tmp_path / "store"))
    torch.save({"w": torch.ones(2), "order": list(range(20_000))}, tmp_path / "big.pt")
    with pytest.raises(RecordTooLargeError, match="more than the 65,536"):
        store.push(str(tmp_path / "big.pt"), "big")
    with pytest.raises(RecordTooLargeError, match="more than the 65,536"):
        store.push({"w": torch.ones(2)}, "big", metadata={"notes": "x" * 70_000})
    assert store.refs() == {} and list(store.objects.list("manifests")) == [] and list(store.objects.list("chunks")) == []
    torch.save({"w": torch.ones(2), "order": list(range(100))}, tmp_path / "small.pt")
    store.push(str(tmp_path / "small.pt"), "small")
    assert store.load("small")["w"].tolist() == [1.0, 1.0] and store.verify().ok


def test_verify_of_checkpoints_sharing_thousands_of_chunks_holds_no_set_per_chunk(tmp_path):
    """verify intersected, for every chunk two checkpoints share, the sets of chunks each keeps
    alive: a new set per shared chunk, quadratic (two 10,000-tensor fine-tunes: 43 s and 4.7 GB).
    Each checkpoint's set is now kept once and the chunks refer to it."""
    import tracemalloc

    store = ckpt.Store.init(str(tmp_path / "s"))
    g = torch.Generator().manual_seed(3)
    base = {f"experts.{i}.w": torch.randn(16, generator=g) for i in range(1000)}
    store.push(base, "base")
    store.push({**base, "head": torch.randn(16, generator=g)}, "ft")  # shares every chunk of base
    tracemalloc.start()
    try:
        report = store.verify()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.ok and report.chunks_checked == 1003  # 1001 tensors and the two files' headers
    assert peak < 16 << 20, peak  # 1000 sets of 1000 ids each: 37 MB


def test_two_removals_racing_write_one_removal_and_the_other_is_refused(tmp_path, monkeypatch):
    """`ckpt rm X` checked that X was live, then appended a removal: two racing both succeeded and X's
    history showed "removed" twice. The removal is written only past a live entry read in the same
    step; the second remover (staged to land right after the first one's read) is refused."""
    from ckpt.errors import RefNotFoundError
    from ckpt_store.storage.refs import Refs

    url = str(tmp_path / "s")
    store = ckpt.Store.init(url)
    store.push({"w": torch.ones(2)}, "x")
    read = Refs._read
    other: list[object] = []

    def read_then_another_removes(self, name, *args):
        entry = read(self, name, *args)
        if not other and name == "x" and entry.target is not None:
            other.append("staged")  # (before: the other remover reads through this too)
            ckpt.Store.open(url).remove("x")
        return entry

    monkeypatch.setattr(Refs, "_read", read_then_another_removes)
    with pytest.raises(RefNotFoundError, match="no ref named 'x'"):
        store.remove("x")
    monkeypatch.setattr(Refs, "_read", read)
    assert other and [e.target is None for e in store.refs_db.history("x")] == [True, False]  # one removal
    with pytest.raises(RefNotFoundError, match="no ref named 'x'"):
        store.remove("x")


def _reading_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("ckpt-read")]


def test_a_lazy_reader_keeps_one_pool_of_reading_threads(s3_main_url, monkeypatch):
    """get_tensor on a remote store started (and joined) a pool of reading threads per call: 30 lazy
    reads from S3 started 30 x io_workers threads. The reader keeps one pool for its life; close (a
    with-block) ends it, a reader never closed ends it when collected, and after an error mid-read
    no thread reads on."""
    import gc
    import threading

    from ckpt.errors import ObjectNotFoundError
    from ckpt.settings import Settings

    settings = Settings.from_env(workers=2, io_workers=2, cache=False)  # every read a request
    store = ckpt.Store.init(s3_main_url, settings=settings)
    g = torch.Generator().manual_seed(4)
    sd = {f"t{i}": torch.randn(5_000 + i, generator=g) for i in range(30)}
    store.push(sd, "m")
    started: list[str] = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), start(self))[1])
    with store.reader("m") as reader:
        got = {k: reader.get_tensor(k) for k in sd}
    readers = [n for n in started if n.startswith("ckpt-read")]
    assert 0 < len(readers) <= max(settings.io_workers, store.objects.backend.concurrency), len(readers)  # was 30 x 2
    assert {k: v.numpy().tobytes() for k, v in got.items()} == {k: v.numpy().tobytes() for k, v in sd.items()}
    assert not _reading_threads()

    reader = store.reader("m")
    reader.get_tensor("t0")
    assert _reading_threads()
    del reader
    gc.collect()
    for t in [t for t in threading.enumerate() if t.name.startswith("ckpt-read")]:
        t.join(10)
    assert not _reading_threads()  # collected: its threads end

    lost = next(t for t in store.manifest("m").tensors if t.name == "t3").chunks[0]
    store.objects.backend.delete(store.objects.path("chunks", lost))
    with store.reader("m") as reader:
        with pytest.raises(ObjectNotFoundError, match=lost):
            reader.get_tensor("t3")
        assert reader.get_tensor("t4").numpy().tobytes() == sd["t4"].numpy().tobytes()  # still reads after it
    assert not _reading_threads()


def test_a_lazy_reader_closed_by_another_thread_mid_read_ends_the_read(s3_main_url):
    """A read ending in an error cancels its reads still queued in the reader's pool and waits for them:
    cancelled by close() (another thread's, or a with-block left by Ctrl-C while a thread reads), no
    thread ever takes them up, and that wait never returned: the reading thread hung for good. The
    read ends, with an error that says the reader was closed (it was a bare CancelledError, or a
    RuntimeError where the read went on to submit more), and the reader reads again after it."""
    import threading
    import time

    from ckpt.errors import ReaderClosedError
    from ckpt.settings import Settings

    store = ckpt.Store.init(s3_main_url, settings=Settings.from_env(workers=2, io_workers=2, cache=False, chunk_size=1 << 16))
    sd = {"big": torch.randn(1_000_000, generator=torch.Generator().manual_seed(5))}  # 62 chunks
    store.push(sd, "m")
    reader = store.reader("m")
    started = threading.Event()
    real = store.objects.backend._get
    head = store.manifest("m").files[0].chunks  # (read first, by itself, to check the entry: the tensor's reads are closed)

    def slow(path, *args, **kwargs):
        if not any(c in str(path) for c in head):
            started.set()
            time.sleep(0.5)  # the window of reads ahead fills: 16 run, the rest wait in the pool's queue
        return real(path, *args, **kwargs)

    store.objects.backend._get = slow
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(reader.get_tensor("big"))
        except Exception as e:
            outcome.append(e)

    t = threading.Thread(target=read, daemon=True)  # (daemon: a hung one must not hang the test run)
    t.start()
    assert started.wait(30)
    time.sleep(0.1)  # (the reads ahead are all submitted within a few ms: half of them still queued)
    reader.close()
    t.join(30)
    assert not t.is_alive()  # was hung in get_chunks, waiting for the reads close() cancelled
    assert len(outcome) == 1 and isinstance(outcome[0], ReaderClosedError), outcome  # was CancelledError
    assert "the reader was closed while this read was under way" in str(outcome[0])
    store.objects.backend._get = real
    with reader:
        assert reader.get_tensor("big").numpy().tobytes() == sd["big"].numpy().tobytes()
    assert not _reading_threads()


def test_du_whose_listing_of_objects_fails_raises_its_error_without_reading_every_manifest(s3_main_url, s3_main):
    """du lists the store's objects while it reads the index (S3). When that listing failed, du read
    every live ref's manifest one by one, as for a damaged ref, and then raised the listing's error
    all the same: now it raises it at once. A real failure: every connection that asks the server
    for a listing of objects/ is reset on its way (the refs and the index are listed as usual)."""
    from s3support import FaultProxy, http_requests

    from ckpt.errors import CkptError

    store = ckpt.Store.init(s3_main_url)
    g = torch.Generator().manual_seed(6)
    for i in range(6):
        store.push({"w": torch.randn(1000, generator=g)}, f"m{i}")
    host, port = s3_main.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port))).start()
    try:
        proxied = ckpt.Store.open(s3_main_url, storage_options={"endpoint_url": proxy.endpoint},
                                  settings=ckpt.Settings.from_env(cache=False, retries=1))
        assert proxied.du().refs  # (what the test asks of the store works through the proxy)
        proxy.reset_dir, proxy.reset_match, proxy.reset_conns = "up", b"prefix=store%2Fobjects", 1000
        with http_requests(proxied.objects.backend) as seen, pytest.raises(CkptError) as failed:
            proxied.du()
        assert proxy.resets_fired >= 1
    finally:
        proxy.stop()
    assert "objects" in str(failed.value)
    assert not [key for kind, key in seen if kind == "GET" and "/objects/manifests/" in key]  # was a GET each
