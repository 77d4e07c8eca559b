"""Pushes into real S3 servers of what the store already holds: the requests they make (a chunk the
base's manifest records costs none; a chunk pushed twice in one push is stored once), and that a
record stands for a blob only where the blob is no newer than the manifest (transfer/writing.py:
``Recorded``). Every pull compared byte for byte."""

from __future__ import annotations

import math
import time

import pytest

pytest.importorskip("botocore")
torch = pytest.importorskip("torch")

from s3support import http_requests  # noqa: E402

import ckpt  # noqa: E402
from ckpt.codecs.chunk import encode_chunk  # noqa: E402

CHUNK = 64 * 1024


def _settings() -> ckpt.Settings:
    return ckpt.Settings.from_env(chunk_size=CHUNK)


def _model(layers: int = 6) -> torch.nn.Sequential:
    torch.manual_seed(0)
    parts: list[torch.nn.Module] = []
    for _ in range(layers):
        parts += [torch.nn.Linear(256, 256), torch.nn.LayerNorm(256)]  # fresh norms: ones and zeros, every layer alike
    return torch.nn.Sequential(*parts, torch.nn.Linear(256, 512))


def _save(model: torch.nn.Module, path) -> str:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def _fine_tune(model: torch.nn.Sequential) -> None:
    """One AdamW step on the last layer only: every other tensor stays as it was."""
    for p in model.parameters():
        p.requires_grad_(False)
    head = list(model[-1].parameters())
    for p in head:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(head, lr=1e-3)
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()


def _chunk_reads(seen: list[tuple[str, str]]) -> list[str]:
    """The chunk ids read (a whole GET or a ranged one)."""
    return [key.rsplit("/", 1)[-1] for kind, key in seen if kind.startswith("GET") and "/objects/chunks/" in key]


def _tensor_chunks(m) -> set[str]:
    return {c for t in m.tensors for c in t.chunks}


def test_repush_and_fine_tune_read_no_header_of_a_chunk_the_base_records(s3_url, tmp_path):
    model = _model()
    base_file = _save(model, tmp_path / "base.safetensors")
    store = ckpt.Store.init(s3_url, settings=_settings())
    first = store.push(base_file, "m")
    m = store.manifest("m")
    assert sum(len(t.chunks) for t in m.tensors) > 40

    again = ckpt.Store.open(s3_url, settings=_settings())
    with http_requests(again.objects.backend) as seen:
        same = again.push(base_file, "m")
    # Before: a ranged GET of every chunk's header (and its chain's). Now only the chunks no tensor
    # record covers: the file's header and the bundle.
    read = _chunk_reads(seen)
    assert not set(read) & _tensor_chunks(m), read
    assert len(read) <= sum(len(f.chunks) for f in m.files) + sum(len(b.chunks) for b in m.bundles)
    assert same.id == first.id or store.manifest(same.id).tensors == m.tensors  # the same codecs and chains named

    _fine_tune(model)
    ft_file = _save(model, tmp_path / "ft.safetensors")
    ft_store = ckpt.Store.open(s3_url, settings=_settings())
    with http_requests(ft_store.objects.backend) as seen:
        ft_store.push(ft_file, "ft", base="m")
    ft = ft_store.manifest("ft")
    reused = _tensor_chunks(ft) & _tensor_chunks(m)
    assert len(reused) > 20
    assert not set(_chunk_reads(seen)) & (reused - {b for t in ft.tensors for chain in t.chains() for b in chain})
    for t, bt in zip(ft.tensors, m.tensors, strict=True):  # unchanged chunks name what the base names
        for c, codec, chain, bc, bcodec, bchain in zip(t.chunks, t.codecs, t.chains(), bt.chunks, bt.codecs, bt.chains(), strict=True):
            if c == bc:
                assert (codec, chain) == (bcodec, bchain)

    for ref, src in (("m", base_file), ("ft", ft_file)):
        out = tmp_path / f"{ref}.out.safetensors"
        ckpt.Store.open(s3_url, settings=_settings()).pull(ref, str(out))
        assert out.read_bytes() == open(src, "rb").read()
    assert not ckpt.Store.open(s3_url).verify().problems


def test_a_chunk_pushed_twice_in_one_push_is_stored_and_looked_up_once(s3_url, tmp_path):
    model = _model()
    path = _save(model, tmp_path / "m.safetensors")
    store = ckpt.Store.init(s3_url, settings=_settings())
    with http_requests(store.objects.backend) as seen:
        r = store.push(path, "m")
    m = store.manifest("m")
    ids = [c for t in m.tensors for c in t.chunks]
    assert len(set(ids)) < len(ids) - 8  # the norms of every layer are alike
    puts = [key for kind, key in seen if kind == "PUT" and "/objects/chunks/" in key]
    assert len(puts) == len(set(puts)) == r.new_chunks  # before: a PUT per occurrence, each but one refused
    assert _chunk_reads(seen) == []  # before: a GET of each refused one's header
    out = tmp_path / "out.safetensors"
    store.pull("m", str(out))
    assert out.read_bytes() == open(path, "rb").read()


def test_a_blob_written_after_the_base_manifest_has_its_header_read(s3_url, tmp_path):
    """A chunk the base names, taken by a gc and created anew as a delta against another chunk after
    the base's manifest was written: the record (stored whole) would name fewer bases than the blob
    needs, and gc could free the one it needs. The push reads its header and names its real chain."""
    model = _model()
    with torch.no_grad():  # layer 2 near layer 0: a delta of one against the other pays
        model[2].weight.copy_(model[0].weight + 1e-4 * torch.randn_like(model[0].weight))
    base_file = _save(model, tmp_path / "base.safetensors")
    store = ckpt.Store.init(s3_url, settings=_settings())
    store.push(base_file, "m")
    m = store.manifest("m")
    weight = next(t for t in m.tensors if t.name == "0.weight")
    other = next(t for t in m.tensors if t.name == "2.weight")
    x, d = weight.chunks[0], other.chunks[0]
    assert weight.chains()[0] == () and other.chains()[0] == ()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    x_bytes = state["0.weight"].view(-1).view(torch.uint8)[:CHUNK].numpy().tobytes()
    d_bytes = state["2.weight"].view(-1).view(torch.uint8)[:CHUNK].numpy().tobytes()
    written = store.objects.backend.mtime(store.objects.path("manifests", m_id := store.resolve("m")))
    while math.floor(time.time()) <= math.floor(written) + 1:  # the store's second after the manifest's
        time.sleep(0.2)
    enc = encode_chunk(x_bytes, elem=4, base=d_bytes, base_id=d)
    assert enc.base
    store.objects.backend.write(store.objects.path("chunks", x), enc.parts)

    _fine_tune(model)
    ft_file = _save(model, tmp_path / "ft.safetensors")
    ft_store = ckpt.Store.open(s3_url, settings=_settings())
    with http_requests(ft_store.objects.backend) as seen:
        ft_store.push(ft_file, "ft", base=m_id)
    assert x in _chunk_reads(seen)
    ft = ft_store.manifest("ft")
    t = next(t for t in ft.tensors if t.name == "0.weight")
    assert t.chunks[0] == x and t.chains()[0] == (d,)  # the blob's chain, not the base's record
    out = tmp_path / "ft.out.safetensors"
    ft_store.pull("ft", str(out))
    assert out.read_bytes() == open(ft_file, "rb").read()


def test_a_copied_manifest_records_what_its_blobs_at_the_destination_need(s3_url, tmp_path):
    """A copy kept a blob the destination held as a delta wherever its base was any chunk the copied
    manifest names; the manifest's record for that chunk could say "stored whole". A push naming the
    chunk as that record says (its base's manifest, no header read) then let gc free the base (a review
    found it: verify "chunk ... is missing"). A copy now keeps a blob only where the record of that
    chunk names its chain, else sends it whole: every record stands for its blob."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    d = torch.randn(16384, generator=g)
    c, e = d + 1e-4 * torch.randn(16384, generator=g), torch.randn(16384, generator=g)
    dst = ckpt.Store.init(s3_url, settings=_settings())
    for name, sd, base in (("p1", {"x": d}, None), ("p2", {"x": c}, "p1")):
        save_file(sd, tmp_path / f"{name}.safetensors")
        dst.push(str(tmp_path / f"{name}.safetensors"), name, base=base)
    assert any(dst.manifest("p2").tensors[0].chains())  # c is stored as a delta against d there
    src = ckpt.Store.init(str(tmp_path / "src"), settings=_settings())
    save_file({"x": c, "y": d}, tmp_path / "m.safetensors")
    src.push(str(tmp_path / "m.safetensors"), "m")  # c and d stored whole here: its record says so
    src.copy_to(dst, ["m"])
    save_file({"x": c, "y": e}, tmp_path / "n.safetensors")
    dst.push(str(tmp_path / "n.safetensors"), "n", base="m")
    for r in ("p1", "p2", "m"):
        dst.remove(r)
    dst.gc(grace_s=0)
    assert dst.verify().ok
    dst.pull("n", str(tmp_path / "out.safetensors"))
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "n.safetensors").read_bytes()
