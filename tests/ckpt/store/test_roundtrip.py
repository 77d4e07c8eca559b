"""Every dtype and shape class survives push -> pull/load bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt
import ckpt.dcp
from ckpt.settings import Settings

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8,
    torch.bool,
]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)  # arbitrary bit patterns: NaN payloads, -0, inf, subnormals


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert _bytes(a[k]) == _bytes(b[k]), k


SHAPES = {"scalar": (), "empty": (0, 3), "vector": (7,), "matrix": (33, 17), "big": (700, 1000)}


@pytest.fixture
def small_chunks(tmp_path):
    # 64 KiB chunks so that "big" tensors span many chunks and the last chunk is partial.
    return ckpt.Store.init(str(tmp_path / "store"), settings=Settings.from_env(chunk_size=64 * 1024))


def _all_tensors() -> dict[str, torch.Tensor]:
    out = {}
    for i, dtype in enumerate(DTYPES):
        for label, shape in SHAPES.items():
            if label == "big" and dtype not in (torch.float32, torch.bfloat16, torch.uint8):
                continue
            out[f"{str(dtype)[6:]}.{label}"] = _random(dtype, shape, seed=i)
    out["noncontig"] = torch.randn(40, 30).t()[3:, ::2]
    assert not out["noncontig"].is_contiguous()
    return out


def test_dict_roundtrip_every_dtype_and_shape(small_chunks, tmp_path):
    tensors = _all_tensors()
    small_chunks.push(tensors, "all/dtypes")
    _same(tensors, small_chunks.load("all/dtypes"))
    out = small_chunks.pull("all/dtypes", tmp_path / "out.safetensors")
    _same(tensors, load_file(out))


def test_safetensors_file_roundtrip_is_byte_identical(small_chunks, tmp_path):
    tensors = {k: v.contiguous() for k, v in _all_tensors().items()}
    src = tmp_path / "in.safetensors"
    save_file(tensors, src, metadata={"format": "pt", "note": "ünïcode ✓"})
    small_chunks.push(src, "file")
    out = small_chunks.pull("file", tmp_path / "out.safetensors")
    assert open(out, "rb").read() == src.read_bytes()
    reader = small_chunks.reader("file")
    assert reader.metadata() == {"format": "pt", "note": "ünïcode ✓"}


def test_hf_directory_roundtrip(small_chunks, tmp_path):
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    a = {"layer.0.w": torch.randn(300, 300), "layer.0.b": torch.randn(300)}
    b = {"layer.1.w": torch.randn(300, 300).to(torch.bfloat16), "layer.1.b": torch.zeros(300)}
    save_file(a, src / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(b, src / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = {"metadata": {"total_size": 1}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in a},
                                                          **{k: "model-00002-of-00002.safetensors" for k in b}}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text('{"hidden_size": 300}')
    (src / "sub" / "tokenizer.json").write_text("x" * 200_000)
    (src / "empty.txt").write_bytes(b"")
    small_chunks.push(src, "hf/model")
    dest = tmp_path / "pulled"
    small_chunks.pull("hf/model", dest)
    for root, _, files in os.walk(src):
        for f in files:
            p = os.path.join(root, f)
            assert open(p, "rb").read() == open(dest / os.path.relpath(p, src), "rb").read(), p
    assert sorted(os.listdir(dest)) == sorted(os.listdir(src))
    _same({**a, **b}, small_chunks.load("hf/model"))


def test_pt_state_dict_roundtrip(small_chunks, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.BatchNorm1d(30), torch.nn.Linear(30, 2))
    sd = model.state_dict()
    torch.save({"model": sd, "epoch": 3, "note": "ok"}, tmp_path / "sd.pt")
    small_chunks.push(tmp_path / "sd.pt", "pt")
    loaded = small_chunks.load("pt")
    _same({f"model.{k}": v for k, v in sd.items()}, loaded)
    assert small_chunks.manifest("pt").extra_values() == {"epoch": 3, "note": "ok"}


def test_load_into_module_in_place(small_chunks):
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    small_chunks.push(src.state_dict(), "m")
    dst = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    ptr = dst[0].weight.data_ptr()
    small_chunks.load_into("m", dst)
    assert dst[0].weight.data_ptr() == ptr
    _same(src.state_dict(), dst.state_dict())


def test_load_into_reports_mismatches(small_chunks):
    small_chunks.push({"w": torch.zeros(3, 4), "extra": torch.zeros(1)}, "m")
    with pytest.raises(ckpt.errors.TensorMismatchError, match="extra"):
        small_chunks.load_into("m", {"w": torch.zeros(3, 4)})
    with pytest.raises(ckpt.errors.TensorMismatchError, match="w: checkpoint F32"):
        small_chunks.load_into("m", {"w": torch.zeros(4, 3), "extra": torch.zeros(1)})
    target = {"w": torch.ones(3, 4)}
    small_chunks.load_into("m", target, strict=False)
    assert torch.equal(target["w"], torch.zeros(3, 4))


def test_load_into_a_target_that_is_not_a_module_or_dict_of_tensors(small_chunks):
    """An optimizer (a Lightning checkpoint holds its state too), None, a tensor, a dict holding a
    non-tensor where the checkpoint has a tensor: each was a raw TypeError, AttributeError or
    ValueError from inside load_into; each is a TensorMismatchError saying what load_into fills."""
    small_chunks.push({"w": torch.zeros(3), "b": torch.ones(2)}, "m")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    for target in (opt, None, torch.zeros(3), "w"):
        with pytest.raises(ckpt.errors.TensorMismatchError, match="fills a torch.nn.Module or a dict of tensors, not a") as e:
            small_chunks.load_into("m", target)
        assert "store.load(ref)" in e.value.hint
    with pytest.raises(ckpt.errors.TensorMismatchError, match=r"w: checkpoint F32\[3\] vs target a int"):
        small_chunks.load_into("m", {"w": 3, "b": torch.zeros(2)})
    with pytest.raises(ckpt.errors.TensorMismatchError, match="keys 0 are not strings"):
        small_chunks.load_into("m", {0: torch.zeros(3)}, strict=False)
    target = {"w": torch.ones(3), "epoch": 3}  # a value the checkpoint does not hold is left alone, as before
    small_chunks.load_into("m", target, strict=False)
    assert target["w"].tolist() == [0.0, 0.0, 0.0] and target["epoch"] == 3


def test_load_into_under_a_prefix(small_chunks, tmp_path):
    """A model's tensors stored under a prefix (a Lightning checkpoint's ``state_dict.``, a pushed
    ``{"model": ..., "optim": ...}``'s ``model.``): ``prefix=`` loads them, strict compares only
    the tensors under it, and a strict mismatch names the prefix that would have matched."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(src.parameters())
    src(torch.randn(2, 8)).sum().backward()
    opt.step()
    torch.save({"model": src.state_dict(), "optim": opt.state_dict(), "epoch": 1}, tmp_path / "run.pt")
    small_chunks.push(tmp_path / "run.pt", "run")
    dst = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with pytest.raises(ckpt.errors.TensorMismatchError) as e:
        small_chunks.load_into("run", dst)
    assert "the checkpoint holds them under 'model.': pass prefix='model.'" in e.value.hint
    small_chunks.load_into("run", dst, prefix="model.")
    _same(src.state_dict(), dst.state_dict())
    with pytest.raises(ckpt.errors.TensorMismatchError, match=r"not in target \['model.1.bias'"):
        small_chunks.load_into("run", {"0.weight": torch.zeros(8, 8), "0.bias": torch.zeros(8), "1.weight": torch.zeros(8)},
                               prefix="model.")
    part = {"0.bias": torch.zeros(8)}
    ckpt.load_into(small_chunks, "run", part, prefix="model.", strict=False)
    _same({"0.bias": src.state_dict()["0.bias"]}, part)


def test_load_into_a_model_with_tied_weights_from_its_hf_folder(small_chunks, tmp_path):
    """save_pretrained writes tied weights once (GPT-2's lm_head.weight is the embedding): a strict
    load_into of that folder into the same model fills lm_head through the embedding, bit for bit.
    It was refused ('missing in checkpoint [lm_head.weight]'), and strict=False was the only way."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    src = transformers.GPT2LMHeadModel(cfg)
    src.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    small_chunks.push(tmp_path / "hf", "gpt2")
    assert "lm_head.weight" not in small_chunks.load("gpt2")
    torch.manual_seed(1)
    dst = transformers.GPT2LMHeadModel(cfg)
    small_chunks.load_into("gpt2", dst)
    _same(src.state_dict(), dst.state_dict())
    assert dst.lm_head.weight.data_ptr() == dst.transformer.wte.weight.data_ptr()
    # a tensor that is missing and tied to nothing is still refused
    untied = {n: torch.zeros_like(t) for n, t in src.state_dict().items()}
    with pytest.raises(ckpt.errors.TensorMismatchError, match=r"missing in checkpoint \['lm_head.weight'\]"):
        small_chunks.load_into("gpt2", untied)


def test_load_into_a_wrapped_model_says_to_load_into_the_model_inside(small_chunks):
    """A torch.compile'd target names its tensors '_orig_mod.*', a DataParallel/DDP one 'module.*': a
    plain checkpoint (or a DDP one) loaded into it was refused with only 'pass strict=False', which
    loads nothing. The hint says to load into model._orig_mod / model.module (with the prefix that matches)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    small_chunks.push(net.state_dict(), "plain")
    small_chunks.push({"module." + k: v for k, v in net.state_dict().items()}, "ddp")
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    parallel = torch.nn.DataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    for ref, target, says in (("plain", compiled, "the target is a torch.compile'd model: load into model._orig_mod"),
                              ("ddp", compiled, "load into model._orig_mod with prefix='module.'"),
                              ("plain", parallel, "the target is a DistributedDataParallel (or DataParallel) model: "
                                                  "load into model.module")):
        with pytest.raises(ckpt.errors.TensorMismatchError) as e:
            small_chunks.load_into(ref, target)
        assert says in e.value.hint
    small_chunks.load_into("ddp", compiled._orig_mod, prefix="module.")
    small_chunks.load_into("plain", parallel.module)
    _same(net.state_dict(), compiled._orig_mod.state_dict())
    _same(net.state_dict(), parallel.module.state_dict())


def test_load_into_with_strict_false_that_would_load_nothing_is_refused(small_chunks):
    """strict=False loads the common tensors; with none in common (a wrapped model, a forgotten
    prefix, another model's ref) it returned having loaded nothing, the model still at its random
    init, and the strict error's hint suggested exactly that. Both now say where the tensors are."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    small_chunks.push({"model": net.state_dict(), "epoch": 1}, "run")
    dst = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ckpt.errors.TensorMismatchError, match="no tensor of the target is in the checkpoint") as e:
        small_chunks.load_into("run", dst, strict=False)
    assert e.value.hint == "the checkpoint holds them under 'model.': pass prefix='model.'"
    with pytest.raises(ckpt.errors.TensorMismatchError, match="checkpoint and target differ") as e:
        small_chunks.load_into("run", dst)
    assert "strict=False" not in e.value.hint and "prefix='model.'" in e.value.hint
    with pytest.raises(ckpt.errors.TensorMismatchError, match="in the checkpoint under 'optim.'"):
        small_chunks.load_into("run", dst, prefix="optim.", strict=False)
    _same(before, dst.state_dict())
    small_chunks.load_into("run", {"weight": dst.weight}, prefix="model.", strict=False)  # one in common: loaded
    assert _bytes(dst.weight) == _bytes(net.weight) and _bytes(dst.bias) == _bytes(before["bias"])
    small_chunks.load_into("run", {}, strict=False)  # nothing asked, nothing to refuse
    with pytest.raises(ckpt.errors.TensorMismatchError, match=r"not in target \['model.bias'") as e:
        small_chunks.load_into("run", {})
    assert e.value.hint is None  # (not an empty one)


def test_load_into_a_tied_target_from_a_checkpoint_with_them_untied_is_refused(small_chunks):
    """A fine-tune that untied its head (lm_head != embedding) loaded into a model that ties them:
    both were written to the one tensor, one silently lost. Refused before anything is written;
    a checkpoint holding the tied pair equal (torch.save of a tied model) still loads."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as a language model's lm_head
    tied = torch.nn.ModuleDict({"emb": emb, "head": head})
    small_chunks.push(tied.state_dict(), "tied")  # both names, equal bytes
    untied = {"emb.weight": torch.randn(10, 4), "head.weight": torch.randn(10, 4)}
    small_chunks.push(untied, "untied")
    before = emb.weight.detach().clone()
    with pytest.raises(ckpt.errors.TensorMismatchError, match="'emb.weight' and 'head.weight' differ, but the target "
                       "holds them in one tensor") as e:
        small_chunks.load_into("untied", tied)
    assert "tie_word_embeddings=False" in e.value.hint
    assert _bytes(emb.weight) == _bytes(before)
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
    fresh["head"].weight = fresh["emb"].weight
    small_chunks.load_into("tied", fresh)
    _same(tied.state_dict(), fresh.state_dict())


def test_load_and_load_into_a_pipeline_whose_models_share_names(small_chunks, tmp_path):
    """A diffusers-style pipeline: unet/ and text_encoder/ are two models that both hold
    'proj.weight'. Store.load and load_into refused the whole checkpoint ('appears in two files;
    use ckpt pull'), so no model of it could be loaded from Python. Their tensors are now named
    FOLDER/NAME (as diff names them): load(include=['unet/*']) and load_into(model, prefix='unet/')
    work, bit for bit; a strict mismatch hints the prefix. A pipeline whose names never collide
    keeps its plain names."""
    torch.manual_seed(0)
    unet = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    text = torch.nn.Sequential(torch.nn.Linear(6, 6))
    for part, model in (("unet", unet), ("text_encoder", text)):
        (tmp_path / "pipe" / part).mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  tmp_path / "pipe" / part / "diffusion_pytorch_model.safetensors")
        (tmp_path / "pipe" / part / "config.json").write_text("{}")
    small_chunks.push(tmp_path / "pipe", "sd")
    got = small_chunks.load("sd")
    assert sorted(got) == ["text_encoder/0.bias", "text_encoder/0.weight", "unet/0.bias", "unet/0.weight",
                           "unet/1.bias", "unet/1.weight"]
    _same({f"unet/{k}": v for k, v in unet.state_dict().items()}, small_chunks.load("sd", include=["unet/*"]))
    dst = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    with pytest.raises(ckpt.errors.TensorMismatchError) as e:
        small_chunks.load_into("sd", dst)
    assert "pass prefix='unet/'" in e.value.hint
    small_chunks.load_into("sd", dst, prefix="unet/")
    _same(unet.state_dict(), dst.state_dict())
    dst_text = torch.nn.Sequential(torch.nn.Linear(6, 6))
    small_chunks.load_into("sd", dst_text, prefix="text_encoder/")
    _same(text.state_dict(), dst_text.state_dict())
    apart = tmp_path / "apart"
    for part, name in (("unet", "conv_in.weight"), ("vae", "encoder.conv_in.weight")):
        (apart / part).mkdir(parents=True)
        save_file({name: torch.ones(2)}, apart / part / "diffusion_pytorch_model.safetensors")
    small_chunks.push(apart, "apart")
    assert sorted(small_chunks.load("apart")) == ["conv_in.weight", "encoder.conv_in.weight"]


def test_load_into_a_dcp_checkpoint_under_a_prefix(tmp_path):
    import torch.distributed.checkpoint as dcp

    url = str(tmp_path / "s")
    torch.manual_seed(0)
    src = torch.nn.Linear(6, 4)
    dcp.save({"model": src.state_dict(), "step": 3}, storage_writer=ckpt.dcp.Writer(url, "d"))
    dst = torch.nn.Linear(6, 4)
    with pytest.raises(ckpt.errors.TensorMismatchError) as e:
        ckpt.load_into(url, "d", dst)
    assert "pass prefix='model.'" in e.value.hint
    ckpt.load_into(url, "d", dst, prefix="model.")
    _same(src.state_dict(), dst.state_dict())


def test_reader_fetches_one_tensor(small_chunks, tmp_path):
    tensors = {"a": torch.randn(500, 500), "b": torch.randn(10)}
    small_chunks.push(tensors, "r")
    reader = small_chunks.reader("r")
    assert set(reader.keys()) == {"a", "b"} and "a" in reader and len(reader) == 2
    # Remove the chunks of "a": reading "b" must still work, so only b's chunks were fetched.
    for cid in reader.info("a").chunks:
        os.unlink(small_chunks.backend.local_path(small_chunks.objects.path("chunks", cid)))
    assert _bytes(reader.get_tensor("b")) == _bytes(tensors["b"])
    with pytest.raises(ckpt.errors.ObjectNotFoundError):
        reader.get_tensor("a")


def test_pull_include_selects_tensors(small_chunks, tmp_path):
    tensors = {"layers.0.w": torch.randn(5), "layers.1.w": torch.randn(5), "head": torch.randn(2)}
    small_chunks.push(tensors, "sel")
    out = small_chunks.pull("sel", tmp_path / "sel.safetensors", include=["layers.0.*", "head"])
    _same({k: tensors[k] for k in ("layers.0.w", "head")}, load_file(out))


def test_generated_header_matches_safetensors(tmp_path):
    """A dict push pulls to the same bytes safetensors' own save_file writes (same layout rules)."""
    tensors = {"b": torch.randn(3, 2), "a": torch.arange(5), "c": torch.zeros(2, dtype=torch.float16)}
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push(tensors, "x")
    out = store.pull("x", tmp_path / "ours.safetensors")
    save_file(tensors, tmp_path / "theirs.safetensors")
    ours, theirs = open(out, "rb").read(), (tmp_path / "theirs.safetensors").read_bytes()
    n1, n2 = struct.unpack("<Q", ours[:8])[0], struct.unpack("<Q", theirs[:8])[0]
    assert json.loads(ours[8 : 8 + n1]) == json.loads(theirs[8 : 8 + n2])
    assert hashlib.sha256(ours[8 + n1 :]).digest() == hashlib.sha256(theirs[8 + n2 :]).digest()
