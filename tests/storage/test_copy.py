"""Copying checkpoints between stores: only what is missing travels, in order, verified; resumable."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
import ckpt  # noqa: E402
from ckpt.store.copy import copy_refs  # noqa: E402
from ckpt_store.storage.chunk_lists import chunk_depths, recorded_chains, referenced_chunks  # noqa: E402
from ckpt_store.storage.errors import CorruptObjectError, StorageIOError  # noqa: E402

SMALL = {"chunk_size": 64 * 1024}


def _open(url: str) -> ckpt.Store:
    return ckpt.Store.init(url, settings=ckpt.Settings.from_env(**SMALL))


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(256, 256, generator=g), "w": torch.randn(128, 128, generator=g).bfloat16(),
            "b": torch.randn(100, generator=g)}


def _finetune(base: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 1e-3 * torch.randn(v.shape, generator=g)).to(v.dtype) if k != "b" else v
            for k, v in base.items()}


@pytest.fixture
def source(tmp_path) -> ckpt.Store:
    s = _open(str(tmp_path / "src"))
    base = _model()
    s.push(base, "m/base", message="base")
    s.push(_finetune(base), "m/ft", base="m/base", message="fine-tune")
    return s


def _same(a: ckpt.Store, b: ckpt.Store, ref: str) -> None:
    ta, tb = a.load(ref), b.load(ref)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(params=["local", "memory", "s3"])
def dest_url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "dst")
    if request.param == "s3":
        return request.getfixturevalue("s3_main_url")
    import uuid

    return f"memory://copy-dst-{uuid.uuid4().hex}"


def test_copy_sends_only_what_is_missing(source, dest_url):
    dst = _open(dest_url)
    r1 = copy_refs(source, dst, ["m/base"])
    assert r1.refs == {"m/base": source.resolve("m/base")} and r1.refs_set == 1 and r1.manifests_sent == 1
    base_chunks = r1.chunks_sent
    assert base_chunks > 0 and r1.chunks_present == 0
    r2 = copy_refs(source, dst, ["m/ft"])
    # the fine-tune's unchanged tensor and header are there already; its changed chunks travel as deltas
    assert r2.chunks_present > 0 and 0 < r2.chunks_sent <= base_chunks
    ft_chunks = set(source.manifest(source.resolve("m/ft")).chunk_lengths())
    base_chunks_ids = set(source.manifest(source.resolve("m/base")).chunk_lengths())
    delta_bytes = sum(source.objects.size("chunks", c) for c in ft_chunks - base_chunks_ids)
    manifest_bytes = source.objects.size("manifests", source.resolve("m/ft"))
    assert r2.bytes_sent == delta_bytes + manifest_bytes  # exactly the fine-tune's own objects
    assert r2.bytes_sent < r1.bytes_sent  # deltas: less than the base itself
    r3 = copy_refs(source, dst, ["m/ft", "m/base"])
    assert r3.objects_sent == 0 and r3.bytes_sent == 0  # a second run changes nothing
    assert [e.seq for e in dst.log("m/ft")] == [1]  # no extra history entry
    _same(source, dst, "m/ft")
    assert dst.verify().ok


def test_a_manifest_damaged_at_the_destination_is_sent_again_not_named(source, dest_url):
    """The destination holds the manifest to copy under its id, but damaged there (bit rot, a
    crafted store): the copy took its presence for the manifest, set the ref, and the destination
    then failed to load or verify it. Now its bytes are checked, and the source's replace them."""
    dst = _open(dest_url)
    copy_refs(source, dst, ["m/base"])
    mid = source.resolve("m/ft")
    good = source.objects.get_manifest(mid)
    dst.backend.write(dst.objects.path("manifests", mid), good[:-1] + b" ")
    r = copy_refs(source, dst, ["m/ft"])
    assert r.manifests_sent == 1 and r.manifests_present == 0 and r.refs == {"m/ft": mid}
    assert dst.objects.get_manifest(mid) == good
    _same(source, dst, "m/ft")
    assert dst.verify().ok


def test_copy_back_and_across(source, tmp_path, s3_main_url):
    """local -> S3 -> local and S3 -> S3 (two buckets)."""
    s3a = _open(s3_main_url)
    copy_refs(source, s3a, ["m/ft"])
    s3b = _open(s3_main_url.replace("/store", "/other"))
    r = copy_refs(s3a, s3b, ["m/ft:copied/ft"])
    assert r.refs == {"copied/ft": source.resolve("m/ft")}
    back = _open(str(tmp_path / "back"))
    copy_refs(s3b, back, ["copied/ft"])
    got, want = back.load("copied/ft"), source.load("m/ft")
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert s3b.verify().ok and back.verify().ok


def test_copy_by_id_and_history_spec(source, tmp_path):
    dst = _open(str(tmp_path / "dst"))
    mid = source.resolve("m/base")
    r = copy_refs(source, dst, [mid[:10]])
    assert r.refs == {} and dst.objects.has("manifests", mid) and dst.refs() == {}
    r = copy_refs(source, dst, [f"{mid[:10]}:named/base"])
    assert r.refs == {"named/base": mid} and r.chunks_sent == 0


def test_order_chunks_then_manifests_then_refs(source, tmp_path):
    """Watch every write at the destination: no manifest before its chunks, no ref before its manifest."""
    dst = _open(str(tmp_path / "dst"))
    seen: list[str] = []
    real = dst.backend.write
    real_create = dst.backend.create_exclusive

    def write(path, data):
        if path.startswith("objects/manifests/"):
            needed = referenced_chunks(bytes(data))
            assert dst.objects.has_many("chunks", needed) == needed
        seen.append(path.split("/")[1])
        return real(path, data)

    def create(path, data):
        if path.startswith("refs/"):
            assert dst.objects.has("manifests", json.loads(data)["target"])
            seen.append("refs")
        elif path.startswith("objects/chunks/"):  # (a chunk the destination lacks: created exclusively)
            seen.append("chunks")
        return real_create(path, data)

    dst.backend.write = write  # type: ignore[method-assign]
    dst.backend.create_exclusive = create  # type: ignore[method-assign]
    copy_refs(source, dst, ["m/ft"])
    assert seen.index("manifests") > max(i for i, k in enumerate(seen) if k == "chunks")
    assert seen[-1] == "refs"


def test_delta_bases_go_first():
    chain_a, chain_b = "a" * 64, "b" * 64
    m = {"tensors": [{"chunks": ["c" * 64, "d" * 64], "delta_bases": [[chain_a, chain_b], []]}],
         "files": [{"chunks": ["e" * 64]}]}
    assert chunk_depths(json.dumps(m).encode()) == {"c" * 64: 2, chain_a: 1, chain_b: 0, "d" * 64: 0}


def test_interrupted_copy_resumes_with_what_is_left(source, dest_url):
    dst = _open(dest_url)
    real_write, real_create = dst.backend.write, dst.backend.create_exclusive
    written: list[str] = []

    def flaky(real):
        def write(path, data):
            if path.startswith("objects/chunks/") and len(written) >= 3:
                raise StorageIOError("connection lost (injected)", retryable=True)
            done = real(path, data)
            written.append(path)
            return done

        return write

    # (a chunk the destination lacks is created exclusively where creates are exclusive: both ways fail)
    dst.backend.write, dst.backend.create_exclusive = flaky(real_write), flaky(real_create)  # type: ignore[method-assign]
    with pytest.raises(StorageIOError):
        copy_refs(source, dst, ["m/ft"])
    assert dst.refs() == {} and not list(dst.objects.list("manifests"))  # nothing names the partial data
    dst.backend.write, dst.backend.create_exclusive = real_write, real_create  # type: ignore[method-assign]
    total = len(source.manifest(source.resolve("m/ft")).chunk_lengths())
    r = copy_refs(source, dst, ["m/ft"])
    assert r.chunks_present == len(written) and r.chunks_sent == total - len(written)
    assert dst.verify().ok
    _same(source, dst, "m/ft")


def test_corrupt_source_chunk_is_not_copied(source, tmp_path):
    m = source.manifest(source.resolve("m/base"))
    victim = m.tensors[0].chunks[0]
    path = source.backend.local_path(source.objects.path("chunks", victim))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x55
    open(path, "wb").write(bytes(data))
    dst = _open(str(tmp_path / "dst"))
    with pytest.raises(CorruptObjectError):
        copy_refs(source, dst, ["m/base"])
    assert not dst.objects.has("chunks", victim) and dst.refs() == {}
    assert not list(dst.objects.list("manifests"))


def test_a_copied_alias_does_not_change_how_the_destination_keeps_a_ref(tmp_path):
    """A source whose ``main`` is an alias (an alias's earlier targets are not kept alive) copied
    onto a destination where ``main`` is a plain ref with a history: ``main`` stays plain there,
    and the destination's gc keeps its earlier versions. A new name takes the source's kind."""
    src, dst = _open(str(tmp_path / "src")), _open(str(tmp_path / "dst"))
    dst.push({"w": torch.full((64,), 1.0)}, "main")
    dst.push({"w": torch.full((64,), 2.0)}, "main")
    other = src.push({"w": torch.full((64,), 3.0)}, "other")
    src.refs_db.set("main", other, alias=True)
    src.refs_db.set("run/latest", other, alias=True)
    copy_refs(src, dst, ["main", "run/latest"])
    assert dst.resolve("main") == other and not dst.refs_db.current("main").alias
    assert dst.refs_db.current("run/latest").alias
    dst.gc(grace_s=0)
    assert torch.equal(dst.load("main@2")["w"], torch.full((64,), 1.0)) and dst.verify().ok


def test_a_copy_never_publishes_a_ref_whose_objects_a_gc_took(tmp_path, monkeypatch):
    """Copying a checkpoint into a store that already holds its manifest, unreferenced and half
    collected (a ref removed there, a gc under way), sent nothing and set the ref: it then could
    not load. And a chunk found present, then taken by a concurrent gc before the copy touched it,
    was taken as there. Now every chunk of every manifest copied is checked and touched before
    the ref moves, and what is gone is sent."""
    src, dst = _open(str(tmp_path / "src")), _open(str(tmp_path / "dst"))
    model = _model()
    src.push(model, "m")
    mid = src.resolve("m")
    copy_refs(src, dst, ["m"])
    dst.remove("m")
    cids = sorted(referenced_chunks(dst.objects.get_manifest(mid)))
    for cid in cids[:2]:  # a gc that has deleted these chunks and not yet the manifest
        (tmp_path / "dst" / dst.objects.path("chunks", cid)).unlink()
    copy_refs(src, dst, ["m"])
    got = dst.load("m")
    assert all(got[k].view(torch.uint8).numpy().tobytes() == v.view(torch.uint8).numpy().tobytes() for k, v in model.items())

    src.push(_finetune(model), "ft")
    real = dst.backend.touch
    taken: list[str] = []

    def gc_was_faster(path: str) -> bool:  # a gc deletes each chunk between the copy's presence check and its touch
        if path.startswith("objects/chunks/") and not taken:
            taken.append(path)
            (tmp_path / "dst" / path).unlink()
        return real(path)

    monkeypatch.setattr(dst.backend, "touch", gc_was_faster)
    copy_refs(src, dst, ["ft"])
    assert taken and dst.verify().ok
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dst.load("ft").values(), src.load("ft").values()))


def _base_and_fine_tune():
    """Settings of 64 KiB chunks, a 512 KiB base and a fine-tune of it (a delta against it where pushed so)."""
    settings = ckpt.Settings.from_env(chunk_size=64 * 1024)
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(256, 512, generator=g)}
    tuned = {"w": base["w"] + 1e-3 * torch.randn(256, 512, generator=g)}
    return settings, base, tuned


def test_chunks_copied_before_a_commit_are_not_left_as_deltas_against_what_it_does_not_name(tmp_path):
    """A snapshot persisted by ranks (copy_chunks, then the manifest committed): a chunk the durable
    store already held as a delta against a chunk of another checkpoint was skipped as present.
    Once that checkpoint was removed there, gc deleted the base and the snapshot could not load."""
    import torch

    from ckpt.store.copy import copy_chunks
    from ckpt.transfer.pipeline import stored_chain
    from ckpt_store.storage.commit import commit

    settings, base, tuned = _base_and_fine_tune()
    dst = ckpt.Store.init(str(tmp_path / "dst"), settings=settings)
    dst.push(base, "base")
    dst.push(tuned, "ft", base="base")
    src = ckpt.Store.init(str(tmp_path / "src"), settings=settings)
    mid = src.push(tuned, "ft", delta=False)
    data = src.objects.get_manifest(mid)
    ids = referenced_chunks(data)
    assert any(stored_chain(dst.objects, c)[1] for c in ids)  # held at dst as deltas against base's chunks
    copy_chunks(src, dst, ids, named=recorded_chains(data))
    commit(dst.objects, dst.refs_db, data, "mine")
    dst.remove("base")
    dst.remove("ft")
    dst.gc(grace_s=0)
    assert dst.load("mine")["w"].view(torch.int32).equal(tuned["w"].view(torch.int32))
    assert dst.verify().ok


def test_copy_chunks_writes_a_verified_copy_over_a_damaged_one_it_is_told_to_replace(tmp_path):
    """A chunk the destination holds damaged (a tier whose copy failed its hash on a read) is present
    there, so a copy skips it; ``replace`` sends it all the same, verified, written over the damaged
    blob (ckpt/snapshot/peer_refill.py). A delta sent so is written whole: the base the damaged blob
    had there is none of the copy's business."""
    import os

    from ckpt.codecs.chunk import parse_header
    from ckpt.store.copy import chunk_checker, copy_chunks

    settings, base, tuned = _base_and_fine_tune()
    src = ckpt.Store.init(str(tmp_path / "src"), settings=settings)
    src.push(base, "base")
    data = src.objects.get_manifest(src.push(tuned, "ft", base="base"))
    ids = set(src.manifest("ft").tensors[0].chunks)
    dst = ckpt.Store.init(str(tmp_path / "dst"), settings=settings)
    copy_chunks(src, dst, ids, named=recorded_chains(data))
    bad = next(c for c in sorted(ids) if parse_header(dst.objects.get("chunks", c), c).base is not None)  # a delta there
    path = os.path.join(str(tmp_path / "dst"), dst.objects.path("chunks", bad))
    blob = bytearray(open(path, "rb").read())
    blob[-1] ^= 1
    open(path, "wb").write(bytes(blob))
    check = chunk_checker(src, dst)
    copy_chunks(src, dst, ids, named=recorded_chains(data))
    with pytest.raises(CorruptObjectError):
        check(bad, dst.objects.get("chunks", bad))  # present: skipped
    report = copy_chunks(src, dst, ids, named=recorded_chains(data), replace={bad})
    assert report.chunks_sent == 1
    for cid in ids:
        check(cid, dst.objects.get("chunks", cid))
    assert parse_header(dst.objects.get("chunks", bad), bad).base is None


@pytest.mark.parametrize("first", ["push", "push against another base", "copy"])
def test_a_copy_and_a_push_storing_one_new_chunk_at_once_leave_both_loadable(tmp_path, monkeypatch, first):
    """A copy (chunks stored as deltas against a base it brings) and a push of the same tensors
    into one store at once, both finding the chunks missing: the copy overwrote the push's blobs
    with its deltas, so once the copied refs were removed and collected, the push's checkpoint named
    chunks whose bases were gone. Now the second writer of a chunk keeps the first one's blob where
    its manifests name that blob's chain (the push records it), and a copy replaces it whole where
    they do not (a delta against a checkpoint of the destination the copy knows nothing of)."""
    settings = ckpt.Settings.from_env(**SMALL)
    src, dst = _open(str(tmp_path / "src")), _open(str(tmp_path / "dst"))
    base = _model()
    tuned = _finetune(base)
    src.push(base, "base")
    src.push(tuned, "ft", base="base")
    pusher = ckpt.Store.open(str(tmp_path / "dst"), settings=settings)  # another process's view of dst
    if first == "push against another base":
        pusher.push(_finetune(base, seed=7), "other")
    ft_chunks = referenced_chunks(src.objects.get_manifest(src.resolve("ft")))
    base_chunks = referenced_chunks(src.objects.get_manifest(src.resolve("base")))
    real_get = src.objects.get
    raced: list[str] = []

    def push(**how) -> None:
        pusher.push(tuned, "pushed", **how)

    def get_while_someone_pushes(kind: str, oid: str, *a, **k):
        blob = real_get(kind, oid, *a, **k)
        if kind == "chunks" and not raced and oid in ft_chunks and oid not in base_chunks:
            raced.append(oid)  # the push stores the fine-tune's chunks before the copy writes them
            if first == "push":
                push(delta=False)
            elif first == "push against another base":
                push(base="other")
        return blob

    monkeypatch.setattr(src.objects, "get", get_while_someone_pushes)
    copy_refs(src, dst, ["base", "ft"])
    if first == "copy":
        push(delta=False)  # finds the copy's deltas there: records their chain
    assert raced
    if first == "push against another base":  # the push's delta replaced by the chunk whole
        from ckpt.transfer.pipeline import stored_chain

        assert stored_chain(dst.objects, raced[0])[1] == ()
    gone, kept = (["other", "pushed"], "ft") if first == "push against another base" else (["base", "ft"], "pushed")
    for ref in gone:
        dst.remove(ref)
    dst.gc(grace_s=0)
    got = dst.load(kept)
    assert all(got[k].view(torch.uint8).equal(v.view(torch.uint8)) for k, v in tuned.items())
    assert dst.verify().ok



def test_a_copy_from_a_sound_store_is_not_failed_by_another_stores_blob_in_the_chunk_cache(s3_servers, monkeypatch, tmp_path):
    """Two S3 stores of one store id (a bucket synced from another, then written to: the id is in
    ckpt-store.json) share a folder of the local chunk cache. A pull from theirs cached a fine-tune's
    chunk as theirs stores it, a delta against a base chunk that ours lacks; copied from ours, that
    cached blob was checked against its base, which neither store of the copy holds, and the copy
    failed ("source store ...: chunk ... is missing") though ours is sound (pulls read past such an
    entry: ckpt/transfer/fetch.py, cache_at_fault)."""
    from ckpt.codecs.chunk import parse_header
    from ckpt_store.storage.backends import open_backend
    from conftest import S3_SERVERS, new_s3_store_url

    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))
    theirs_url, ours_url = (new_s3_store_url(s3_servers, S3_SERVERS[0], monkeypatch) for _ in range(2))
    base, ft = _model(), _finetune(_model())
    theirs = _open(theirs_url)
    theirs.push(base, "m/base")
    theirs.push(ft, "m/ft", base="m/base")
    open_backend(ours_url).write("ckpt-store.json", theirs.backend.read("ckpt-store.json"))
    ours = _open(ours_url)
    ours.push(ft, "m/ft")  # no base here: stored whole
    assert ours.objects.cache is not None and ours.objects.cache.dir == theirs.objects.cache.dir
    _same(theirs, ours, "m/ft")  # read from theirs: the cache holds its blobs
    deltas = {cid: h.base for t in ours.manifest("m/ft").tensors for cid in t.chunks
              if (blob := ours.objects.cache.get(cid)) is not None and (h := parse_header(blob, cid)).base is not None}
    assert deltas and not ours.objects.has_many("chunks", list(deltas.values()))
    for b in deltas.values():
        ours.objects.cache.drop(b)
    dst = _open(str(tmp_path / "dst"))
    ours.copy_to(dst, ["m/ft"])
    assert dst.verify().ok
    assert torch.equal(dst.load("m/ft")["emb"], ft["emb"])
