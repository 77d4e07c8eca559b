"""Bundles: copies of a checkpoint's small chunks that a remote reader fetches in one request
(ckpt.format.manifest.BundleEntry). Real models pushed to real S3 servers; every pull and load
compared byte for byte; a bundle that is missing, damaged or wrong costs requests, never bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("botocore")
torch = pytest.importorskip("torch")

from s3support import chunk_gets  # noqa: E402

import ckpt  # noqa: E402
from ckpt.transfer.pipeline import BUNDLE_CHUNK_MAX  # noqa: E402
from ckpt_store.storage.commit import commit  # noqa: E402


def _model_state() -> dict[str, torch.Tensor]:
    """A small transformer: 256 KiB weight matrices (chunks of their own) and many biases and norms of 1-4 KiB."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=512, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    # As after training: no two tensors equal (fresh layers are copies, biases zeros, norms ones).
    return {k: torch.randn_like(v) * 0.02 for k, v in model.state_dict().items()}


def _exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(got[k].numpy().tobytes() == want[k].numpy().tobytes() for k in want)


def test_small_chunks_come_from_the_bundle_in_one_request(s3_url, tmp_path):
    state = _model_state()
    writer = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(cache=False))
    writer.push(state, "m")
    m = writer.manifest("m")
    assert len(m.bundles) == 1
    (b,) = m.bundles
    small = {cid for cid, n in m.chunk_lengths().items() if cid not in b.chunks and n <= BUNDLE_CHUNK_MAX}
    assert {cid for cid, _, _ in b.members} == small  # every small chunk, each once
    every = set(m.chunk_lengths()) - set(b.chunks)
    assert len(every) - len(b.members) >= 9  # the weight matrices (and the header) stay out

    reader = ckpt.Store.open(s3_url, settings=ckpt.Settings.from_env(cache=False))
    gets = chunk_gets(reader)
    out = tmp_path / "m.safetensors"
    reader.pull("m", str(out))
    from safetensors.torch import load_file

    assert _exact(load_file(str(out)), state)
    assert gets[0] == len(every) - len(b.members) + len(b.chunks)  # one request for all the small ones
    gets[0] = 0
    target = {k: torch.empty_like(v) for k, v in state.items()}
    reader.load_into("m", target)
    # (load_into checks each entry against its file's stored header before it writes into the model: one
    #  request of its own per file, the header's)
    heads = len({c for f in m.files if f.kind == "safetensors" for c in f.chunks})
    assert _exact(target, state) and gets[0] == len(every) - len(b.members) + len(b.chunks) + heads
    gets[0] = 0
    assert _exact(reader.load("m"), state) and gets[0] == len(every) - len(b.members) + len(b.chunks)

    # None for a few small chunks (a request or two saved is not worth a write per push), nor for a
    # model of small tensors only (it would be stored twice).
    writer.push({"w": torch.randn(512, 512), "b": torch.randn(16)}, "few")
    assert writer.manifest("few").bundles == ()
    writer.push({f"b{i}": torch.randn(16) for i in range(40)}, "all-small")
    assert writer.manifest("all-small").bundles == ()
    # A local store gets none: reading a small file there costs little.
    local = ckpt.Store.init(str(tmp_path / "local"))
    local.push(state, "m")
    assert local.manifest("m").bundles == ()


def test_a_missing_or_damaged_or_lying_bundle_costs_requests_never_bytes(s3_url, tmp_path):
    state = _model_state()
    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(cache=False))
    store.push(state, "m")
    m = store.manifest("m")
    (b,) = m.bundles
    every = set(m.chunk_lengths()) - set(b.chunks)

    # A bundle whose members point at each other's bytes (a hostile or buggy writer): each member
    # is checked against its own id, so the wrong ones are fetched on their own.
    members = list(b.members)
    (c0, o0, n0), (c1, o1, n1) = next((x, y) for x, y in zip(members, members[1:]) if x[2] == y[2])
    i0 = members.index((c0, o0, n0))
    members[i0], members[i0 + 1] = (c0, o1, n0), (c1, o0, n1)
    lying = replace(m, bundles=(replace(b, members=tuple(members)),), message="lying bundle")
    commit(store.objects, store.refs_db, lying.to_json(), "lying")
    gets = chunk_gets(store)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    store.load_into("lying", target)
    assert _exact(target, state)
    heads = len({c for f in m.files if f.kind == "safetensors" for c in f.chunks})  # load_into reads them first
    assert gets[0] == len(every) - len(b.members) + len(b.chunks) + 2 + heads  # the two swapped members, fetched

    # One that claims more bytes than its members hold (a hostile manifest): not even allocated.
    from ckpt.transfer import fetch, reading

    huge = replace(m, bundles=(replace(b, nbytes=b.nbytes + (64 << 30), chunks=b.chunks * ((b.nbytes + (64 << 30)) // m.chunk_size + 1)),),
                   message="huge bundle")
    commit(store.objects, store.refs_db, huge.to_json(), "huge")
    asked: list[int] = []
    real_empty = fetch.empty_buffer
    for module in (fetch, reading):  # every buffer a read allocates
        module.empty_buffer = lambda n: (asked.append(n), real_empty(n))[1]
    try:
        gets[0] = 0
        target = {k: torch.empty_like(v) for k, v in state.items()}
        store.load_into("huge", target)
    finally:
        fetch.empty_buffer = reading.empty_buffer = real_empty
    assert _exact(target, state) and max(asked, default=0) < 64 << 20
    assert gets[0] == len(every)  # every chunk on its own (the header too, checked first), no bundle tried

    # Damaged: another chunk's blob under the bundle chunk's name.
    path = store.objects.path("chunks", b.chunks[0])
    other = next(iter(every))
    store.objects.backend.write(path, store.objects.backend.read(store.objects.path("chunks", other)))
    gets[0] = 0
    out = tmp_path / "d.safetensors"
    store.pull("m", str(out))
    from safetensors.torch import load_file

    assert _exact(load_file(str(out)), state)
    assert gets[0] == len(every) + len(b.chunks)  # the bundle tried, then every chunk on its own

    # Missing (an older gc, which does not know bundles, removed it).
    store.objects.backend.delete(path)
    gets[0] = 0
    target = {k: torch.empty_like(v) for k, v in state.items()}
    store.load_into("m", target)
    assert _exact(target, state) and gets[0] == len(every) + len(b.chunks)


def test_gc_keeps_bundles_and_copy_carries_them(s3_url, tmp_path):
    state = _model_state()
    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(cache=False))
    store.push(state, "m")
    (b,) = store.manifest("m").bundles
    store.gc(grace_s=0)
    assert all(store.objects.has("chunks", c) for c in b.chunks)
    v = store.verify()
    assert not v.problems and v.chunks_checked == len(store.manifest("m").chunk_lengths())  # the bundle's too
    dest = ckpt.Store.init(str(tmp_path / "copy"))
    store.copy_to(dest, ["m"])
    assert all(dest.objects.has("chunks", c) for c in b.chunks)
    assert dest.manifest("m").bundles == (b,)


def test_a_merge_into_a_remote_store_bundles_its_small_merged_chunks(s3_url):
    # The bundle re-reads each small chunk from its source; a merged tensor's source is computed
    # once and dropped after its last chunk, so a merge into S3 failed with a bare AssertionError.
    writer = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(cache=False))
    a = _model_state()
    b = {k: v * 3 for k, v in a.items()}
    writer.push(a, "m/a")
    writer.push(b, "m/b")
    r = ckpt.merge(["m/a", "m/b"], "linear", name="m/avg", store=writer)
    assert r.merged == len(a)
    m = writer.manifest("m/avg")
    assert len(m.bundles) == 1 and len(m.bundles[0].members) >= 8
    from ckpt.merging.combine import merge_state_dicts

    want = merge_state_dicts([a, b])
    reader = ckpt.Store.open(s3_url, settings=ckpt.Settings.from_env(cache=False))
    assert _exact(reader.load("m/avg"), want)


def test_a_merge_input_whose_bundle_claims_another_length_of_kept_chunks_is_an_error_naming_the_chunk(s3_url):
    """A merge reads all its inputs through one pool, which keeps each bundle it fetched by its chunk ids.
    A hostile input whose bundle names the same chunks as the first input's, claims more bytes, and has a
    member past their end whose shorter bytes hash to its id, was served a piece shorter than its chunk:
    a bare ValueError. The member is fetched on its own: the chunk is not of the length claimed, and
    the error says so and names it."""
    from ckpt.errors import CorruptObjectError
    from ckpt.transfer.pipeline import PutTask, put_chunks
    from ckpt_store.storage.objects import object_id

    store = ckpt.Store.init(s3_url, settings=ckpt.Settings.from_env(cache=False))
    g = torch.Generator().manual_seed(1)
    a = {"big": torch.randn(300_000, generator=g)} | {f"s{i:02}": torch.randn(100, generator=g) for i in range(20)}
    store.push(a, "a")
    store.push({k: v + 1 for k, v in a.items()}, "b")
    ma, mb = store.manifest("a"), store.manifest("b")
    (bundle,) = ma.bundles
    tensor_of = {c: t.name for t in ma.tensors for c in t.chunks}
    raw = bytearray(bundle.nbytes)
    for cid, off, n in bundle.members:
        if cid in tensor_of:
            raw[off : off + n] = a[tensor_of[cid]].numpy().tobytes()
    tail = bytes(raw[-150:])  # the last 150 bytes of A's bundle, stored as a chunk of their own
    (stored,) = put_chunks(store.objects, [PutTask(lambda _at, _n: tail, 0, len(tail))], store.settings)
    cid = object_id(tail)
    assert stored.id == cid
    lying = tuple(replace(t, chunks=(cid,), codecs=(), delta_bases=()) if t.name == "s05" else t for t in mb.tensors)
    members = (*bundle.members, (cid, bundle.nbytes - 150, 400))  # 400 bytes claimed: s05's
    hostile = replace(mb, tensors=lying, message="hostile",
                      bundles=(replace(bundle, nbytes=sum(n for _, _, n in members), members=members),))
    commit(store.objects, store.refs_db, hostile.to_json(), "hostile")
    with pytest.raises(CorruptObjectError, match=f"{cid}.*header says 150 bytes, manifest says 400"):  # was ValueError
        ckpt.merge(["a", "hostile"], "linear", name="m", store=store)


@pytest.mark.parametrize("how", ["explicit", "lineage", "similar"])
def test_a_push_into_s3_reads_its_small_delta_bases_from_the_base_checkpoints_bundle(s3_main_url, tmp_path, how):
    """A push with a base (``--base REF``, the ref's previous version, or the most similar checkpoint)
    delta-encodes each chunk against the base's chunk in the same place, and read each of the base's
    small chunks one GET at a time (100 here), though the base's bundle holds them all: only a merge's
    push took them from the bundle. Every push reads them from it, in a few requests; the result's
    chunks and chains are those of the old way, and it loads exact."""
    from s3support import chunk_gets

    settings = ckpt.Settings.from_env(workers=2, io_workers=2, cache=False)  # every read a request
    store = ckpt.Store.init(s3_main_url, settings=settings)
    g = torch.Generator().manual_seed(5)
    a = {"big": torch.randn(300_000, generator=g)} | {f"small.{i}": torch.randn(100, generator=g) for i in range(100)}
    b = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in a.items()}
    aid = store.push(a, "m/a" if how != "lineage" else "m/b")
    ma = store.manifest(aid)
    (bundle,) = ma.bundles
    small_a = {c for t in ma.tensors if t.name.startswith("small") for c in t.chunks}
    assert len(small_a) == 100 and small_a <= {cid for cid, _, _ in bundle.members}
    gets = chunk_gets(store.objects)
    asked: list[str] = []
    counting = store.objects.backend._get
    store.objects.backend._get = lambda path, *x, **k: (asked.append(path.rsplit("/", 1)[-1]), counting(path, *x, **k))[1]
    if how == "explicit":
        path = tmp_path / "b.safetensors"
        from safetensors.torch import save_file

        save_file(b, str(path))
        store.push(str(path), "m/b", base="m/a")
    else:
        store.push(b, "m/b")
    assert not small_a & set(asked), len(small_a & set(asked))  # was 100: a GET per delta base
    big = next(t for t in ma.tensors if t.name == "big").chunks
    header = [c for f in ma.files for c in f.chunks]  # the same header: a dedup hit, its chain read
    assert gets[0] == len(big) + len(bundle.chunks) + len(header), gets[0]  # was 102 more
    mb = store.manifest("m/b")
    assert mb.lineage["base"] == aid
    deltas = [t for t in mb.tensors if t.name.startswith("small") and any(t.chains())]
    assert len(deltas) >= 50  # the small chunks are deltas against A's
    by_name = {t.name: t for t in ma.tensors}
    assert all(t.chains() == tuple((c,) for c in by_name[t.name].chunks) for t in deltas)
    reader = ckpt.Store.open(s3_main_url, settings=settings)
    assert _exact(reader.load("m/b"), b)
    assert not store.verify().problems
