"""Bad input: each case is a clear error naming the problem, and nothing is stored.

Hostile inputs of every kind push accepts: malformed safetensors, pickles, .pt structures
that do not flatten, tensors without plain bytes, and folders with links, FIFOs and devices."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
from integration_util import assert_same_tree
from safetensors.torch import load_file, save_file

from ckpt.errors import InvalidNameError, InvalidSourceError, ResourceLimitError, UnsafeInputError
from ckpt.store import source_files, sources


def _valid(tmp_path):
    p = tmp_path / "ok.safetensors"
    save_file({"w": torch.randn(100, 10), "b": torch.randn(10)}, p)
    return p


def _header(obj) -> bytes:
    js = json.dumps(obj).encode()
    return struct.pack("<Q", len(js)) + js


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda b: b[:-7], "truncated"),
        (lambda b: b[:5], "too short"),
        (lambda b: b + b"junk", "trailing"),
        (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "claims"),
        (lambda b: b[:8] + b"[" + b[9:], "JSON"),
        (lambda b: _header({"w": {"dtype": "F32", "shape": [1 << 30, 1 << 30], "data_offsets": [0, 4]}}) + b"\0" * 4, "needs"),
        (lambda b: _header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}) + b"\0" * 8, "gap"),
        (lambda b: _header({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}) + b"\0" * 4, "bad shape"),
        (lambda b: _header({"w": {"dtype": "F32", "shape": [1 << 62, 1 << 62, 0], "data_offsets": [0, 0]}}), "overflows 64 bits"),
        (lambda b: _header({"w": {"dtype": "Q4_K", "shape": [1 << 63], "data_offsets": [0, 0]}}), "overflows 64 bits"),
        (lambda b: _header({"__metadata__": {"a": 1}}), "__metadata__"),
        (lambda b: _header({"a\x00b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}) + b"\0", "invalid tensor name"),
    ],
)
def test_malformed_safetensors(tmp_path, store, make, words):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(make(_valid(tmp_path).read_bytes()))
    with pytest.raises((InvalidSourceError, InvalidNameError), match=words):
        store.push(bad, "x")
    assert store.refs() == {}
    assert list(store.objects.list("chunks")) == []


def test_duplicate_keys_rejected(tmp_path, store):
    js = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    bad = tmp_path / "dup.safetensors"
    bad.write_bytes(struct.pack("<Q", len(js)) + js + b"\0")
    with pytest.raises(InvalidSourceError, match="duplicate"):
        store.push(bad, "x")


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_payload_is_refused_without_running(tmp_path, store):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "x": _Evil(marker)}, evil)
    with pytest.raises(UnsafeInputError, match="refused"):
        store.push(evil, "x")
    assert not marker.exists()
    raw = tmp_path / "raw.bin"
    raw.write_bytes(pickle.dumps({"x": _Evil(marker)}))
    with pytest.raises(InvalidSourceError):
        store.push(raw, "x")
    assert not marker.exists()
    assert store.refs() == {}


def test_a_trainer_checkpoints_pickled_file_is_refused_saying_to_push_the_folder(tmp_path, store):
    """A transformers Trainer checkpoint-N holds training_args.bin (a pickled TrainingArguments, no
    tensors) beside model.safetensors. Pushed alone it is refused, and the hint only said to re-save
    its tensors (it has none); it now says the folder push keeps it as bytes, never unpickled,
    which the folder push does, bit for bit."""
    import argparse

    ckpt_dir = tmp_path / "checkpoint-500"
    ckpt_dir.mkdir()
    save_file({"w": torch.randn(4, 4)}, ckpt_dir / "model.safetensors")
    torch.save(argparse.Namespace(learning_rate=5e-5, output_dir="out"), ckpt_dir / "training_args.bin")
    torch.save({"state": {}, "param_groups": [{"lr": 5e-5, "params": [0]}]}, ckpt_dir / "optimizer.pt")
    with pytest.raises(UnsafeInputError, match="it holds a pickled argparse.Namespace") as e:
        store.push(ckpt_dir / "training_args.bin", "x")
    assert f"or push its whole folder ({ckpt_dir})" in e.value.hint
    store.push(ckpt_dir, "run/checkpoint-500")
    store.pull("run/checkpoint-500", tmp_path / "back")
    for name in ("model.safetensors", "training_args.bin", "optimizer.pt"):
        assert (tmp_path / "back" / name).read_bytes() == (ckpt_dir / name).read_bytes()
    (tmp_path / "alone").mkdir()  # no model beside it: no folder advice
    torch.save(argparse.Namespace(x=1), tmp_path / "alone" / "args.bin")
    with pytest.raises(UnsafeInputError) as e:
        store.push(tmp_path / "alone" / "args.bin", "y")
    assert "whole folder" not in e.value.hint


def test_a_whole_pickled_module_is_refused_saying_what_to_save_instead(tmp_path, store):
    """torch.save(model), the common mistake: the error was cut mid-sentence out of torch's
    ("... Please use `torch.serialization.add_safe"); it names the class and the fix."""
    torch.save(torch.nn.Linear(3, 3), tmp_path / "full.pt")
    with pytest.raises(UnsafeInputError) as e:
        store.push(tmp_path / "full.pt", "x")
    assert "it holds a pickled torch.nn.modules.linear.Linear, a whole module (torch.save(model)): " \
           "save model.state_dict() instead" in _one_line(e)
    assert store.refs() == {}


def test_a_legacy_format_file_torch_cannot_read_says_what_to_do(tmp_path, store):
    """torch.save(..., _use_new_zipfile_serialization=False) writes float8 and uint16 tensors that
    torch.load cannot read back ('UntypedStorage' has no attribute 'dtype'): that was the whole
    message. The refusal now says the file is in the legacy format and how to save it again; a
    legacy file torch reads (views of one storage included) pushes and loads bit for bit."""
    p = tmp_path / "old.pt"
    torch.save({"w": torch.randn(4, 3).to(torch.float8_e4m3fn)}, p, _use_new_zipfile_serialization=False)
    with pytest.raises(InvalidSourceError, match="not a readable torch file") as e:
        store.push(p, "x")
    assert "legacy format (_use_new_zipfile_serialization=False)" in e.value.hint
    assert "default torch.save" in e.value.hint
    base = torch.randn(6, 4)
    sd = {"base": base, "rows": base[1:4], "t": base.t(), "h": torch.randn(3).half(), "bf": torch.randn(3).bfloat16()}
    torch.save(sd, p, _use_new_zipfile_serialization=False)
    store.push(p, "x")
    got = store.load("x")
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert got[k].view(-1).view(torch.uint8).tolist() == v.contiguous().view(-1).view(torch.uint8).tolist(), k
    torch.save({"w": torch.zeros(2)}, p)  # the zip format, broken: no legacy hint
    with open(p, "r+b") as f:
        f.truncate(100)
    with pytest.raises(InvalidSourceError, match="not a readable torch file") as e:
        store.push(p, "y")
    assert e.value.hint is None or "legacy" not in e.value.hint


def test_pt_that_is_not_a_dict(tmp_path, store):
    p = tmp_path / "t.pt"
    torch.save(torch.zeros(3), p)
    with pytest.raises(InvalidSourceError, match="not a state dict"):
        store.push(p, "x")


def test_missing_and_empty_sources(tmp_path, store):
    with pytest.raises(InvalidSourceError, match="no such file"):
        store.push(tmp_path / "nope.safetensors", "x")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(InvalidSourceError, match="no .safetensors"):
        store.push(tmp_path / "emptydir", "x")


def test_a_folder_of_pytorch_model_bin_shards_is_refused_with_a_way_forward(tmp_path, store):
    """A Hugging Face model saved with safe_serialization=False: pytorch_model-0000N-of-0000M.bin
    and pytorch_model.bin.index.json. The refusal said 'push a .pt/.bin file directly', which
    scatters one model over a ref per shard with no config; it names the shards and says to
    convert the folder to safetensors."""
    d = tmp_path / "m"
    d.mkdir()
    weight_map = {}
    for i in range(4):
        name = f"pytorch_model-{i + 1:05d}-of-00004.bin"
        torch.save({f"layer{i}.weight": torch.randn(3, 3)}, d / name)
        weight_map[f"layer{i}.weight"] = name
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text("{}")
    with pytest.raises(InvalidSourceError, match=r"no .safetensors files; its weights are torch pickle files "
                       r"\(pytorch_model-00001-of-00004.bin, pytorch_model-00002-of-00004.bin, "
                       r"pytorch_model-00003-of-00004.bin and 1 more\)") as e:
        store.push(d, "x")
    assert "save_pretrained(OUT)" in e.value.hint and "push a .pt/.bin file directly" not in e.value.hint
    assert store.refs() == {}


def test_hf_index_must_match_shards(tmp_path, store):
    d = tmp_path / "m"
    d.mkdir()
    save_file({"a": torch.zeros(2)}, d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"b": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(InvalidSourceError, match="'b' is not in shard"):
        store.push(d, "x")


@pytest.mark.parametrize("name", ["../x", "/abs", "a\x07b", "a/../b", "x" * 300])
def test_bad_ref_names_rejected_before_io(tmp_path, store, name):
    with pytest.raises(InvalidNameError):
        store.push(_valid(tmp_path), name)
    assert list(store.objects.list("chunks")) == []


def test_a_nested_state_dict_in_memory_pushes_as_its_pt_file_would(store, tmp_path):
    """store.push({"model": ..., "optim": ..., "epoch": 3}) was refused ("'model' is a OrderedDict,
    not a tensor") while the same dict saved with torch.save pushed: both now store the same
    names, bytes and values. Values JSON cannot hold are still refused."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "w": [1, 2]}
    store.push(sd, "mem")
    torch.save(sd, tmp_path / "sd.pt")
    store.push(tmp_path / "sd.pt", "file")
    mem, file = store.manifest("mem"), store.manifest("file")
    assert [(t.name, t.dtype, t.shape, t.chunks) for t in mem.tensors] == [(t.name, t.dtype, t.shape, t.chunks) for t in file.tensors]
    assert mem.extra_values() == file.extra_values() and mem.extra_values()["epoch"] == 3
    assert mem.extra_values()["optim.param_groups"][0]["betas"] == (0.9, 0.999)
    store.pull("mem", str(tmp_path / "back.pt"))
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_same_tree(sd, back)
    with pytest.raises(InvalidSourceError, match="neither a tensor nor a plain value"):
        store.push({"w": torch.zeros(2), "s": frozenset({1, 2})}, "x")
    assert "x" not in store.refs()



def test_a_dict_of_tensors_with_int_keys_in_memory_pushes_as_its_pt_file_would(store, tmp_path):
    """store.push({0: t}) was refused ("key 0 is not a string") while the same dict saved with
    torch.save pushed (as the flat name "0", its int key kept in the structure): both now do the same."""
    sd = {0: torch.arange(4, dtype=torch.float32), "w": torch.ones(2, dtype=torch.bfloat16)}
    store.push(sd, "mem")
    torch.save(sd, tmp_path / "sd.pt")
    store.push(tmp_path / "sd.pt", "file")
    mem, file = store.manifest("mem"), store.manifest("file")
    assert [(t.name, t.dtype, t.shape, t.chunks) for t in mem.tensors] == [(t.name, t.dtype, t.shape, t.chunks) for t in file.tensors]
    assert mem.extra == file.extra and mem.source == file.source
    store.pull("mem", str(tmp_path / "back.pt"))
    assert_same_tree(sd, torch.load(tmp_path / "back.pt", weights_only=True))
    with pytest.raises(InvalidSourceError, match="only str and int keys"):
        store.push({1.5: torch.zeros(2)}, "x")
    assert "x" not in store.refs()


def _nothing_stored(store) -> None:
    assert store.refs() == {}
    assert list(store.objects.list("chunks")) == []


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.isprintable(), msg
    return msg


def _push_with_timeout(store, source, name: str = "x", timeout: float = 20.0, unblock: str | None = None):
    """Push in a thread; a push that hangs (a FIFO opened for reading) fails the test
    instead of the suite. ``unblock``: a FIFO to open for writing so a stuck reader returns."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["id"] = store.push(source, name)
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if unblock is not None:  # release the reader blocked in open() so the thread ends
            fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        pytest.fail(f"push of {source} hung")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["id"]


@pytest.mark.parametrize(
    "obj, names",
    [
        ({"a": {"b": torch.ones(3)}, "a.b": torch.zeros(3)}, ("['a']['b']", "['a.b']")),
        ({"a.b": torch.zeros(3), "a": {"b": torch.ones(3)}}, ("['a.b']", "['a']['b']")),
        ({"a": {"b": 3}, "a.b": torch.zeros(3)}, ("['a']['b']", "['a.b']")),
        ({"a": {"b": torch.zeros(3)}, "a.b": "note"}, ("['a']['b']", "['a.b']")),
        ({"s": {0: torch.zeros(3), "0": torch.ones(3)}}, ("['s'][0]", "['s']['0']")),
    ],
)
def test_flattened_name_collisions_are_refused(tmp_path, store, obj, names):
    p = tmp_path / "c.pt"
    torch.save(obj, p)
    with pytest.raises(InvalidSourceError, match="both") as e:
        store.push(p, "x")
    msg = _one_line(e)
    assert all(n in msg for n in names), msg
    _nothing_stored(store)


def test_optimizer_int_keys_are_named_in_decimal(tmp_path, store):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    fresh = {"model": model.state_dict(), "optim": opt.state_dict()}
    torch.save(fresh, tmp_path / "fresh.pt")
    store.push(tmp_path / "fresh.pt", "fresh")
    # An optimizer that has not stepped has an empty state dict: it is kept, not dropped.
    assert store.manifest("fresh").extra["optim.state"] == {}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    torch.save(sd, tmp_path / "train.pt")
    store.push(tmp_path / "train.pt", "train")
    m = store.manifest("train")
    assert {"optim.state.0.exp_avg", "optim.state.1.exp_avg_sq", "model.weight"} <= {t.name for t in m.tensors}
    assert m.extra_values()["optim.param_groups"][0]["params"] == [0, 1]
    store.pull("train", str(tmp_path / "out.safetensors"))
    back = load_file(tmp_path / "out.safetensors")
    want = sd["optim"]["state"][0]["exp_avg"]
    assert torch.equal(back["optim.state.0.exp_avg"].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("key", [1.5, None, (1, 2), True, b"k"])
def test_keys_that_are_not_strings_or_ints_are_refused(tmp_path, store, key):
    p = tmp_path / "k.pt"
    torch.save({"a": {key: torch.zeros(2)}}, p)
    with pytest.raises(InvalidSourceError, match="key") as e:
        store.push(p, "x")
    _one_line(e)
    _nothing_stored(store)


def test_self_referencing_and_deep_state_dicts(tmp_path, store):
    loop: dict = {"w": torch.zeros(2)}
    loop["again"] = loop
    torch.save(loop, tmp_path / "loop.pt")
    with pytest.raises(InvalidSourceError, match="contains itself") as e:
        store.push(tmp_path / "loop.pt", "x")
    _one_line(e)
    deep: dict = {"w": torch.zeros(2)}
    for _ in range(3000):
        deep = {"k": deep}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # only for pickling the test input
    try:
        torch.save(deep, tmp_path / "deep.pt")
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises((InvalidSourceError, InvalidNameError), match="too long|too deep") as e:
        store.push(tmp_path / "deep.pt", "x")
    _one_line(e)
    _nothing_stored(store)


class _Wrapper(torch.Tensor):
    """A wrapper subclass (like DTensor, FakeTensor, torchao's quantized tensors): no plain storage."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, _Wrapper) else x  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class _Lying(torch.Tensor):
    """A subclass whose torch-function hook substitutes other data: its own bytes are pushed."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("detach", "contiguous", "cpu", "reshape", "view"):
            return torch.full((3,), 7.0)
        return super().__torch_function__(func, types, args, kwargs or {})


def _quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.arange(4.0), 0.5, 0, torch.qint8)


def _nested() -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


KINDS = {
    "sparse-coo": (lambda: torch.eye(3).to_sparse(), "sparse"),
    "sparse-csr": (lambda: torch.eye(3).to_sparse_csr(), "sparse"),
    "meta": (lambda: torch.empty(3, device="meta"), "meta"),
    "quantized": (_quantized, "quantized"),
    "nested": (_nested, "nested"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_tensor_kinds_without_plain_bytes_in_a_pt(tmp_path, store, kind):
    make, word = KINDS[kind]
    p = tmp_path / "k.pt"
    torch.save({"ok": torch.zeros(2), "bad": make()}, p)
    with pytest.raises(InvalidSourceError, match=word) as e:
        store.push(p, "x")
    assert "'bad'" in _one_line(e) and e.value.hint
    _nothing_stored(store)


@pytest.mark.parametrize("kind", sorted(KINDS) + ["wrapper"])
def test_tensor_kinds_without_plain_bytes_in_memory(store, kind):
    make, word = KINDS[kind] if kind != "wrapper" else ((lambda: _Wrapper(torch.zeros(3))), "_Wrapper")
    with pytest.raises(InvalidSourceError, match=word) as e:
        store.push({"ok": torch.zeros(2), "bad": make()}, "x")
    assert "'bad'" in _one_line(e) and e.value.hint
    _nothing_stored(store)


def test_dtensor_in_memory_is_refused_with_a_hint(store):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(InvalidSourceError, match="DTensor") as e:
            store.push({"w": d}, "x")
        assert "full_tensor" in _one_line(e)
    finally:
        dist.destroy_process_group()
    _nothing_stored(store)


def test_subclasses_and_lazy_views_push_their_own_bytes(tmp_path, store):
    c = torch.tensor([1 + 2j, 3 - 4j, 0.5j], dtype=torch.complex64)
    plain = torch.arange(3.0)
    tensors = {
        "conj": c.conj(),  # a lazy conjugate view: its bytes are the conjugated values
        "neg": torch._neg_view(plain),
        "param": torch.nn.Parameter(torch.ones(2)),
        "lying": plain.clone().as_subclass(_Lying),
    }
    want = {"conj": c.conj().resolve_conj(), "neg": -plain, "param": torch.ones(2), "lying": plain}
    store.push(tensors, "mem")
    torch.save({"conj": c.conj()}, tmp_path / "conj.pt")
    store.push(tmp_path / "conj.pt", "pt")
    for ref, names in (("mem", list(tensors)), ("pt", ["conj"])):
        store.pull(ref, str(tmp_path / f"{ref}.safetensors"))
        back = load_file(tmp_path / f"{ref}.safetensors")
        for n in names:
            w = want[n].as_subclass(torch.Tensor)
            assert torch.equal(back[n].view(torch.uint8), w.view(torch.uint8)), n


def test_one_element_sliced_from_a_row_pushes_and_loads_into_place(tmp_path, store):
    # w[:, 0] of a (1, 3) weight (a Linear with one output) is contiguous but has stride 3:
    # push refused it and load_into such a target raised a bare RuntimeError.
    w = torch.tensor([[1.5, -0.0, float("nan")]])
    one, deep = w[:, 2], w.view(1, 1, 3)[:, :, 1]
    assert one.is_contiguous() and one.stride() == (3,)
    store.push({"one": one, "deep": deep}, "slices")
    torch.save({"one": one}, tmp_path / "one.pt")
    store.push(tmp_path / "one.pt", "pt")
    for ref in ("slices", "pt"):
        back = store.load(ref)
        assert back["one"].view(torch.int32).tolist() == one.view(torch.int32).tolist()
    assert store.load("slices")["deep"].view(torch.int32).tolist() == [[deep.view(torch.int32).item()]]
    target = torch.zeros(1, 3)
    store.load_into("slices", {"one": target[:, 1], "deep": target.view(1, 1, 3)[:, :, 0]})
    assert target.view(torch.int32)[0].tolist() == [w.view(torch.int32)[0, 1].item(), w.view(torch.int32)[0, 2].item(), 0]


def test_expanded_tensor_is_refused_before_allocating(tmp_path, store):
    # A .pt of a few hundred bytes can describe a tensor of 2**44 elements over one element
    # of storage (stride 0): densifying it would need 64 TiB.
    p = tmp_path / "bomb.pt"
    torch.save({"w": torch.zeros(1).expand(2**44)}, p)
    with pytest.raises(ResourceLimitError, match="memory") as e:
        store.push(p, "x")
    _one_line(e)
    _nothing_stored(store)


def _model_dir(tmp_path) -> str:
    d = tmp_path / "m"
    d.mkdir()
    save_file({"w": torch.arange(6.0)}, d / "model.safetensors")
    (d / "config.json").write_text('{"k": 1}')
    return str(d)


@pytest.mark.parametrize(
    "link, target, words",
    [
        ("passwd_link", "/etc/passwd", "outside"),
        ("creds", "../secret/credentials", "outside"),
        ("up", "..", "outside"),
        ("self", ".", "directory"),
        ("sub/up", "..", "directory"),
        ("dangling", "nowhere", "broken"),
        ("loop", "loop", "loop"),
        ("sub/deep/escape", "../../../secret/credentials", "outside"),
    ],
)
def test_folder_links_that_leave_loop_or_dangle_are_refused(tmp_path, store, link, target, words):
    d = _model_dir(tmp_path)
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "credentials").write_text("aws_secret_access_key = hunter2")
    os.makedirs(os.path.dirname(os.path.join(d, link)), exist_ok=True)
    os.symlink(target, os.path.join(d, link))
    with pytest.raises(InvalidSourceError, match=words) as e:
        _push_with_timeout(store, d)
    assert link in _one_line(e) and e.value.hint
    _nothing_stored(store)


def test_all_refused_entries_are_named_in_one_line(tmp_path, store):
    d = _model_dir(tmp_path)
    os.symlink("/etc/passwd", os.path.join(d, "a_link"))
    os.symlink("gone", os.path.join(d, "b_link"))
    os.mkfifo(os.path.join(d, "c_fifo"))
    with pytest.raises(InvalidSourceError) as e:
        _push_with_timeout(store, d, unblock=os.path.join(d, "c_fifo"))
    msg = _one_line(e)
    assert all(n in msg for n in ("a_link", "b_link", "c_fifo")), msg
    _nothing_stored(store)


def test_links_inside_the_folder_are_stored_as_copies(tmp_path, store):
    d = _model_dir(tmp_path)
    os.makedirs(os.path.join(d, "sub"))
    os.symlink("config.json", os.path.join(d, "alias.json"))
    os.symlink("alias.json", os.path.join(d, "chain.json"))  # a link to a link, still inside
    os.symlink("../model.safetensors", os.path.join(d, "sub", "copy.safetensors"))
    # The pushed root may itself be a link: that is the user's explicit choice.
    root_link = tmp_path / "root_link"
    os.symlink(d, root_link)
    _push_with_timeout(store, str(root_link))
    m = store.manifest("x")
    assert [f.path for f in m.files] == ["alias.json", "chain.json", "config.json", "model.safetensors", "sub/copy.safetensors"]
    out = tmp_path / "out"
    store.pull("x", str(out))
    for rel, orig in [("alias.json", "config.json"), ("chain.json", "config.json"),
                      ("sub/copy.safetensors", "model.safetensors")]:
        assert (out / rel).read_bytes() == (tmp_path / "m" / orig).read_bytes()
        assert not (out / rel).is_symlink()


def test_fifo_and_socket_in_a_folder_are_refused_without_hanging(tmp_path, store):
    d = _model_dir(tmp_path)
    fifo = os.path.join(d, "pipe")
    os.mkfifo(fifo)
    with pytest.raises(InvalidSourceError, match="FIFO") as e:
        _push_with_timeout(store, d, unblock=fifo)
    assert "pipe" in _one_line(e)
    os.unlink(fifo)
    os.symlink("model.safetensors", os.path.join(d, "ok_link"))
    os.mkfifo(os.path.join(d, "p2"))
    os.symlink("p2", os.path.join(d, "to_fifo"))  # an in-folder link to a FIFO: refused too
    with pytest.raises(InvalidSourceError, match="FIFO") as e:
        _push_with_timeout(store, d, unblock=os.path.join(d, "p2"))
    assert "to_fifo" in _one_line(e)
    os.unlink(os.path.join(d, "p2"))
    os.unlink(os.path.join(d, "to_fifo"))
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(os.path.join(d, "sock"))
        with pytest.raises(InvalidSourceError, match="socket") as e:
            _push_with_timeout(store, d)
        assert "sock" in _one_line(e)
    finally:
        s.close()
    _nothing_stored(store)


@pytest.mark.parametrize("name", ["pipe.safetensors", "pipe.pt", "pipe"])
def test_single_fifo_push_is_refused_without_hanging(tmp_path, store, name):
    fifo = str(tmp_path / name)
    os.mkfifo(fifo)
    with pytest.raises(InvalidSourceError, match="FIFO") as e:
        _push_with_timeout(store, fifo, unblock=fifo)
    _one_line(e)
    _nothing_stored(store)


@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/null"])
def test_device_push_is_refused(store, dev):
    if not os.path.exists(dev):
        pytest.skip(f"no {dev}")
    with pytest.raises(InvalidSourceError, match="character device") as e:
        _push_with_timeout(store, dev)
    _one_line(e)
    _nothing_stored(store)


def test_open_under_never_follows_a_swapped_in_link(tmp_path):
    """The walk opens every file relative to the folder with O_NOFOLLOW at each step, so a
    file or directory replaced by a link after the walk looked at it is refused, not followed."""
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (tmp_path / "secret").write_text("s")
    os.symlink(tmp_path / "secret", d / "f")
    os.symlink(tmp_path, d / "dirlink")
    root_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for parts in (["f"], ["dirlink", "secret"]):
            with pytest.raises(InvalidSourceError, match="changed"):
                source_files.open_under(root_fd, parts, str(d))
    finally:
        os.close(root_fd)


@pytest.mark.parametrize("name", ["a\x1b[31m.json", "a\x9b31m.json", "a\nb.json", "a\\b.json"])
def test_folder_file_names_are_checked(tmp_path, store, name):
    d = _model_dir(tmp_path)
    (tmp_path / "m" / name).write_text("{}")
    with pytest.raises(InvalidNameError) as e:
        store.push(d, "x")
    _one_line(e)
    _nothing_stored(store)


def test_dangling_root_and_root_loop(tmp_path, store):
    os.symlink("nowhere", tmp_path / "dangling.safetensors")
    os.symlink("loop.pt", tmp_path / "loop.pt")
    for p in ("dangling.safetensors", "loop.pt"):
        with pytest.raises(InvalidSourceError) as e:
            store.push(tmp_path / p, "x")
        _one_line(e)
    _nothing_stored(store)


def _in_child_without_root(fn) -> str:
    """Run ``fn`` in a forked child that, when this is root, becomes "nobody" first (root
    reads any file); returns what it returned, or its exception as "Type message"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            out = str(fn())
        except BaseException as e:  # reported to the parent, which asserts on it
            out = f"{type(e).__name__} {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode()
    os.waitpid(pid, 0)
    return got


def test_unreadable_file_is_a_clear_error(tmp_path):
    base = tempfile.mkdtemp() if os.geteuid() == 0 else str(tmp_path)  # "nobody" must reach it
    try:
        os.chmod(base, 0o755)
        d = os.path.join(base, "m")
        os.mkdir(d)
        save_file({"w": torch.zeros(2)}, os.path.join(d, "model.safetensors"))
        os.chmod(os.path.join(d, "model.safetensors"), 0o644)
        secret = os.path.join(d, "tokenizer.json")
        with open(secret, "w") as f:
            f.write("{}")
        os.chmod(secret, 0)
        for target in (d, secret):
            got = _in_child_without_root(lambda: sources.open_source(target).close())
            assert got.startswith("InvalidSourceError") and "permission denied" in got, got
            assert "tokenizer.json" in got and "\n" not in got
        os.unlink(secret)
        os.mkdir(os.path.join(d, "locked"))
        os.chmod(os.path.join(d, "locked"), 0)
        got = _in_child_without_root(lambda: sources.open_source(d).close())
        assert got.startswith("InvalidSourceError") and "permission denied" in got and "locked" in got, got
    finally:
        if base != str(tmp_path):
            shutil.rmtree(base)


def test_reserved_metadata_name_is_refused(tmp_path, store):
    # A tensor named __metadata__ would be written over the header's metadata: a file no reader loads.
    with pytest.raises(InvalidNameError, match="__metadata__") as e:
        store.push({"__metadata__": torch.zeros(2), "w": torch.ones(2)}, "x")
    _one_line(e)
    torch.save({"__metadata__": torch.zeros(2)}, tmp_path / "m.pt")
    with pytest.raises(InvalidNameError, match="reserved"):
        store.push(tmp_path / "m.pt", "x")
    _nothing_stored(store)


def _nested(depth: int) -> list:
    out = x = []
    for _ in range(depth):
        x.append([])
        x = x[0]
    return out


@pytest.mark.parametrize("value", [[{"a": {torch.zeros(1)}}], _nested(100), [torch.zeros(1), {torch.ones(1)}]],
                         ids=["set_of_a_tensor", "too_deep", "set_beside_a_tensor"])
def test_values_that_cannot_be_stored_as_values_are_refused(tmp_path, store, value):
    # A value tagged JSON has no form for (a set holds values, never a tensor), or one nested past any
    # real one: refused, naming the entry. (Sets and complex numbers of plain values are stored: test_pull.)
    torch.save({"w": torch.zeros(2), "v": value}, tmp_path / "v.pt")
    with pytest.raises(InvalidSourceError, match="neither a tensor nor a plain value") as e:
        store.push(tmp_path / "v.pt", "x")
    assert "'v'" in _one_line(e)
    _nothing_stored(store)


def _raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_tensors_inside_lists_and_tuples_are_named_by_their_index(tmp_path, store):
    """A tensor inside a list or tuple (a Lightning checkpoint's ``optimizer_states``, a list of
    per-layer caches) was refused ("neither a tensor nor a plain value"): such lists are now
    flattened as mappings of their indexes, each tensor bit for bit under its name, the other
    items as values; a list that holds no tensor stays one value."""
    a, b, c = torch.randn(3), torch.arange(4, dtype=torch.int64), torch.tensor(7.0)
    sd = {"w": torch.zeros(2), "caches": [a, {"k": (1, b)}, "x"], "pair": (c, None), "plain": [1, (2, 3)], "empty": []}
    torch.save(sd, tmp_path / "l.pt")
    store.push(tmp_path / "l.pt", "l")
    m = store.manifest("l")
    assert sorted(t.name for t in m.tensors) == ["caches.0", "caches.1.k.1", "pair.0", "w"]
    assert m.extra_values() == {"caches.1.k.0": 1, "caches.2": "x", "pair.1": None, "plain": [1, (2, 3)], "empty": []}
    store.pull("l", str(tmp_path / "back.pt"))
    assert_same_tree(sd, torch.load(tmp_path / "back.pt", weights_only=True))
    # A list holding itself beside a tensor is a cycle, refused as a mapping's is.
    loop: list = [torch.zeros(1)]
    loop.append(loop)
    torch.save({"v": loop}, tmp_path / "loop.pt")
    with pytest.raises(InvalidSourceError, match="contains itself"):
        store.push(tmp_path / "loop.pt", "loop")


def test_a_lightning_checkpoint_pushes_and_pulls_bit_for_bit(tmp_path, store):
    """`ckpt push epoch=0-step=2.ckpt` of a real Lightning checkpoint was refused: its
    ``optimizer_states`` is a list of AdamW state dicts."""
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": 0.01, "name": "tiny"})
            self.layer = torch.nn.Linear(4, 4)

        def training_step(self, batch, i):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    store.push(tmp_path / "run.ckpt", "run")
    names = {t.name for t in store.manifest("run").tensors}
    assert {"state_dict.layer.weight", "optimizer_states.0.state.0.exp_avg", "optimizer_states.0.state.1.step"} <= names
    store.pull("run", str(tmp_path / "back.pt"))
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    want = torch.load(tmp_path / "run.ckpt", weights_only=True)
    assert_same_tree(want, back)
    assert back["global_step"] == 2


def test_hugging_face_cache_snapshot_gets_a_hint(tmp_path, store):
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, repo / "blobs" / "0123")
    os.symlink("../../blobs/0123", repo / "snapshots" / "abc" / "model.safetensors")
    with pytest.raises(InvalidSourceError, match="outside the folder") as e:
        store.push(repo / "snapshots" / "abc", "x")
    assert "--local-dir" in e.value.hint and "model.safetensors" in _one_line(e)
    _nothing_stored(store)


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt", "dir"])
def test_a_file_rewritten_in_place_while_it_is_pushed_is_refused(tmp_path, store, name, monkeypatch):
    """Another process rewrites the file, same size, after the push has read part of it: the push
    fails and records nothing (it recorded tensors of both versions, a file that never existed)."""
    old = {f"t{i}": torch.full((1 << 16,), 1.0) for i in range(4)}
    new = {f"t{i}": torch.full((1 << 16,), 2.0) for i in range(4)}
    path = tmp_path / name
    target = path / "model.safetensors" if name == "dir" else path
    if name == "dir":
        path.mkdir()
    write = (lambda d: torch.save(d, target)) if name.endswith(".pt") else (lambda d: save_file(d, target))
    write(new)
    rewritten = target.read_bytes()
    write(old)
    assert len(rewritten) == target.stat().st_size
    real = sources.FileBytes.read
    done: list[bool] = []

    def read(self, offset, length):  # the push's reads, with the other writer running after the first
        data = real(self, offset, length)
        if not done and offset > 0:
            done.append(True)
            with open(target, "r+b") as f:
                f.write(rewritten)
        return data

    monkeypatch.setattr(sources.FileBytes, "read", read)
    writers: list[subprocess.Popen[bytes]] = []
    if name.endswith(".pt"):
        # torch reads a .pt through its own mapping, under a read lease: another process that opens
        # it for writing waits, and the push's next read stops it (a truncation under the mapping
        # would kill the pusher with SIGBUS). The writer starts once torch has mapped the file.
        real_from = sources.from_tensors

        def from_tensors(*a, **k):
            src = real_from(*a, **k)
            (tmp_path / "new.bin").write_bytes(rewritten)
            code = f"open({str(target)!r}, 'r+b').write(open({str(tmp_path / 'new.bin')!r}, 'rb').read())"
            writers.append(subprocess.Popen([sys.executable, "-c", code]))
            _wait_for_lease_break(target)
            done.append(True)
            return src

        monkeypatch.setattr(sources, "from_tensors", from_tensors)
    with pytest.raises(InvalidSourceError, match="changed while it was being pushed|opened it for writing while"):
        store.push(str(path), "m")
    assert done and not store.refs()
    for w in writers:  # let go of at once: the kernel would have held the writer 45 s
        assert w.wait(timeout=30) == 0
    if writers:
        assert target.read_bytes() == rewritten


def _wait_for_lease_break(path, timeout: float = 30.0) -> None:
    """Until no descriptor of this process on ``path`` holds a read lease any more: a writer
    elsewhere has asked for the file (the kernel answers F_GETLEASE with the lease's target)."""
    import fcntl

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = False
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                    held |= fcntl.fcntl(int(fd), fcntl.F_GETLEASE) == fcntl.F_RDLCK
            except OSError:
                continue
        if not held:
            return
        time.sleep(0.01)
    raise AssertionError(f"no writer asked for {path}")


def test_a_pt_truncated_while_it_is_pushed_is_refused_not_a_crash(tmp_path, store, monkeypatch):
    """``torch.save`` over the file being pushed truncates it in place: without the read lease the
    pusher, reading torch's mapping of it, died with SIGBUS (bus error, exit -7)."""
    path = tmp_path / "m.pt"
    torch.save({f"t{i}": torch.randn(1 << 18) for i in range(8)}, path)
    real_from = sources.from_tensors
    writers: list[subprocess.Popen[bytes]] = []

    def from_tensors(*a, **k):
        src = real_from(*a, **k)
        code = f"import torch; torch.save({{'x': torch.zeros(4)}}, {str(path)!r})"
        writers.append(subprocess.Popen([sys.executable, "-c", code]))
        _wait_for_lease_break(path, timeout=60)
        return src

    monkeypatch.setattr(sources, "from_tensors", from_tensors)
    with pytest.raises(InvalidSourceError, match="opened it for writing while"):
        store.push(str(path), "m")
    assert not store.refs()
    assert writers[0].wait(timeout=60) == 0
    assert torch.load(path, weights_only=True)["x"].equal(torch.zeros(4))


def test_a_pt_open_for_writing_elsewhere_is_refused_before_it_is_read(tmp_path, store):
    """A training job still writing its .pt: the push refuses at once, in one line, instead of
    mapping a file that may be truncated under it."""
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(1000, dtype=torch.float32)}, path)
    holder = subprocess.Popen([sys.executable, "-c", f"import sys; f = open({str(path)!r}, 'r+b'); print(1, flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"1"
        with pytest.raises(InvalidSourceError, match="open for writing by another process"):
            store.push(str(path), "m")
        assert not store.refs()
    finally:
        holder.communicate(b"")
    store.push(str(path), "m")  # written and closed: pushed
    assert store.load("m")["w"].equal(torch.arange(1000, dtype=torch.float32))


@pytest.mark.parametrize("view", ["itself", "transposed"])  # read in place; copied first (a copy can be torn too)
def test_a_tensor_written_by_another_thread_while_pushed_is_refused_and_no_chunk_is_damaged(store, view):
    """A careless async save: store.push(model.state_dict()) in a thread while training goes on.
    Push hashed a chunk and encoded it in two reads of live memory, storing blobs whose bytes
    are not their ids (a later push of those bytes dedups against the damage), and published a
    ref whose tensor mixed two versions."""
    from ckpt.codecs.chunk import parse_header
    from ckpt.transfer.pipeline import fetch_chunk

    w = torch.zeros(2048, 4096)
    stop, started = threading.Event(), threading.Event()

    def train() -> None:
        while not stop.is_set():
            w.add_(1.0)
            started.set()

    t = threading.Thread(target=train)
    t.start()
    try:
        started.wait(10)
        with pytest.raises(InvalidSourceError, match="modified while it was being pushed") as e:
            store.push({"w": w if view == "itself" else w.t()}, "x")
        _one_line(e)
    finally:
        stop.set()
        t.join()
    assert store.refs() == {}
    chunks = list(store.objects.list("chunks"))
    assert chunks  # written before the change was seen: each must hold the bytes its id names
    for info in chunks:
        h = parse_header(store.objects.get("chunks", info.id))
        fetch_chunk(store.objects, info.id, h.length, store.settings)  # raises CorruptObjectError otherwise
    store.push({"w": w}, "x")  # nothing writes it now
    assert torch.equal(store.load("x")["w"].view(torch.int32), w.view(torch.int32))


def test_a_folder_holding_the_store_pushed_to_is_refused(tmp_path):
    # A store kept inside the project folder that is pushed: the first push stored the store's
    # own files in the checkpoint; later ones failed every time, 'changed while it was being
    # pushed', as the push touched the very chunk files it was reading.
    import ckpt

    proj = tmp_path / "proj"
    proj.mkdir()
    save_file({"w": torch.randn(1 << 12)}, proj / "model.safetensors")
    store = ckpt.Store.init(str(proj / ".ckpt"))
    with pytest.raises(InvalidSourceError, match="holds the store at") as e:
        store.push(proj, "m")
    _one_line(e)
    with pytest.raises(InvalidSourceError, match="is inside the store at"):
        store.push(proj / ".ckpt", "m")
    _nothing_stored(store)
    store.push(proj / "model.safetensors", "m")  # a file beside the store is fine
    assert store.manifest("m").files[0].path == "model.safetensors"


def _doubled(depth: int, leaf: object) -> list:
    """A list holding the same list twice, ``depth`` times over: a few hundred bytes of pickle (which
    shares objects) that a walk entering every reference expands to 2**depth leaves."""
    x: list = [leaf]
    for _ in range(depth):
        x = [x, x]
    return x


@pytest.mark.parametrize("value", [_doubled(16, torch.ones(1)), _doubled(20, 1), {f"k{i}": list(range(20_000)) for i in range(64)},
                                   {f"k{i}": "s" * 100_000 for i in range(64)}],
                         ids=["shared_lists_of_tensors", "shared_lists_of_values", "a_list_under_many_keys", "a_string_under_many_keys"])
def test_a_file_whose_shared_objects_expand_without_bound_is_refused(tmp_path, store, value):
    """Pickle shares objects, and torch.load(weights_only=True) keeps them shared: a .pt of a few
    hundred bytes can hold a list that holds itself twice, 40 times over. The flattening (and the
    encoding of values) entered every reference: 2**40 entries, a push that ran for hours and took all
    memory. A file that expands far past what it holds is refused at once, naming the entry; sharing a
    few objects (one state dict under two keys) still pushes, and pulls back as it was saved."""
    if isinstance(value, dict):
        v = dict(value)
        value = {k: v["k0"] for k in v}  # each key the same object: what pickle's memo rebuilds
    torch.save({"w": torch.zeros(2), "v": value}, tmp_path / "bomb.pt")
    assert os.path.getsize(tmp_path / "bomb.pt") < 3_000_000
    with pytest.raises(InvalidSourceError, match="shared") as e:
        store.push(tmp_path / "bomb.pt", "x")
    assert "['v']" in _one_line(e)
    _nothing_stored(store)
    sd = torch.nn.Linear(3, 2).state_dict()
    shared = {"model": sd, "ema": sd, "order": list(range(1000)), "again": None}
    shared["again"] = shared["order"]
    torch.save(shared, tmp_path / "shared.pt")
    store.push(tmp_path / "shared.pt", "shared")
    assert_same_tree(shared, torch.load(store.pull("shared", tmp_path / "back.pt"), weights_only=True))


def test_a_flat_state_dict_builds_no_structure_unless_it_needs_one(tmp_path, store, monkeypatch):
    """A push of a flat dict built its whole exact structure (every tensor's storage looked up) only to
    find it needed none and drop it: 10x the flattening's CPU for a 20,000-tensor state dict. It decides
    from types in one pass now, and still keeps a structure wherever one is needed (a Parameter, a tensor
    that requires grad, tied weights, a view, one object twice, a torch.Size or OrderedDict among the values)."""
    import collections

    from ckpt.store import source_tensors

    built: list[bool] = []
    encode = source_tensors.encode

    def counting(*args, **kwargs):
        built.append(bool(kwargs.get("exact")))
        return encode(*args, **kwargs)

    monkeypatch.setattr(source_tensors, "encode", counting)
    plain = {"w": torch.randn(3), "b": torch.randn(2), "e": torch.ones(0), "f": torch.ones(0), "step": 3, "cfg": [1, (2, "x")]}
    assert source_tensors.flatten_state_dict(plain, "plain")[1].keys() == {"step", "cfg"} and not any(built)
    x = torch.randn(4)
    needs = {"param": {"w": torch.nn.Parameter(x.clone())}, "grad": {"w": x.clone().requires_grad_()}, "tied": {"w": x, "v": x.view(4)},
             "view": {"w": x, "v": x[1:]}, "twice": {"e": torch.ones(0), "f": None}, "size": {"w": x, "s": [torch.Size([1])]},
             "odict": {"w": x, "o": (collections.OrderedDict(a=1),)}}
    needs["twice"]["f"] = needs["twice"]["e"]
    for name, obj in needs.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        store.push(tmp_path / f"{name}.pt", name)
        assert "" in store.manifest(name).extra, name
        want = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        got = torch.load(store.pull(name, tmp_path / f"{name}.back.pt"), weights_only=True)
        assert type(got) is dict and list(got) == list(want), name
        for k, w in want.items():
            assert type(got[k]) is type(w), (name, k)
            if isinstance(w, torch.Tensor):
                assert w.requires_grad == got[k].requires_grad and w.numpy(force=True).tobytes() == got[k].numpy(force=True).tobytes()
    assert store.verify().ok


_PUSH_MEMORY = """
import resource, sys
import ckpt
from ckpt.errors import InvalidSourceError
store = ckpt.Store.open(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    store.push(sys.argv[2], "bomb")
except InvalidSourceError as e:
    print("refused", e, file=sys.stderr)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_torch_file_with_a_compressed_entry_is_refused_before_it_is_loaded(tmp_path, store):
    """torch.save stores every entry of its zip as it is, but torch.load inflates a deflated one: a .pt of 256 KB
    whose tensor entry is 256 MiB of deflated zeros took ~200 MiB of the pushing process (mapped: refused after
    that as 'Trying to resize storage that is not resizable'; read: loaded whole). It is refused from the zip's
    directory, saying why, before torch reads it: the push's peak memory stays far below the tensor's size."""
    import zipfile

    torch.save({"w": torch.zeros(256 << 20, dtype=torch.uint8)}, tmp_path / "big.pt")
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(tmp_path / "big.pt") as zin, zipfile.ZipFile(bomb, "w") as zout:
        for info in zin.infolist():
            packed = zipfile.ZIP_DEFLATED if info.filename.endswith("data/0") else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info.filename), compress_type=packed)
    (tmp_path / "big.pt").unlink()
    assert bomb.stat().st_size < 1 << 20
    r = subprocess.run([sys.executable, "-c", _PUSH_MEMORY, str(store.url), str(bomb)], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0 and "refused" in r.stderr and "data/0 is compressed" in r.stderr, r.stderr
    assert "torch.save never writes" in r.stderr
    assert int(r.stdout.split()[-1]) < 64, r.stdout  # MiB of peak memory the push added (the tensor: 256)
    assert store.refs() == {}


def _central(name: bytes, offset: int, size: int, crc: int, method: int = 0, packed: int | None = None,
             extra: bytes = b"") -> bytes:
    """One record of a zip's central directory (stored, ``packed`` = ``size``, unless told)."""
    packed = size if packed is None else packed
    return b"PK\x01\x02" + struct.pack("<6H3I5H2I", 20, 20, 0, method, 0, 0, crc, packed, size, len(name), len(extra),
                                       0, 0, 0, 0, offset) + name + extra


def _end(count: int, cd_size: int, cd_at: int, zip64: bool = True) -> bytes:
    """A zip's end records for a directory of ``count`` entries at ``cd_at``, written right after it (zip64: as torch does)."""
    if not zip64:
        return b"PK\x05\x06" + struct.pack("<4H2IH", 0, 0, count, count, cd_size, cd_at, 0)
    return (b"PK\x06\x06" + struct.pack("<QHHIIQQQQ", 44, 45, 45, 0, 0, count, count, cd_size, cd_at)
            + b"PK\x06\x07" + struct.pack("<IQI", 0, cd_at + cd_size, 1)
            + b"PK\x05\x06" + struct.pack("<4H2IH", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))


def _torch_zip(path, sd) -> tuple[bytes, list[tuple[bytes, int, int, int]]]:
    """``torch.save(sd)``'s bytes before its directory, and its entries: (name, offset, size, crc)."""
    import zipfile

    torch.save(sd, path)
    with zipfile.ZipFile(path) as z:
        return path.read_bytes()[: z.start_dir], [(i.filename.encode(), i.header_offset, i.file_size, i.CRC) for i in z.infolist()]


def test_the_compressed_entry_check_takes_constant_memory_whatever_the_entry_count(tmp_path):
    """A .pt listing 100,000 empty entries (6 MB; the last one deflated in the second file): reading its
    directory with zipfile.ZipFile built a ZipInfo per entry, ~50 MiB before the check ran (433 MiB for a
    million). The directory is walked record by record: the stored file passes (and torch loads it), the other
    is refused naming its last entry, and the check's peak is its buffer's, whatever the count."""
    import tracemalloc

    from ckpt.store.source_zip import check_stored_entries

    body, entries = _torch_zip(tmp_path / "real.pt", {"w": torch.arange(10, dtype=torch.float32)})
    archive = entries[0][0].split(b"/")[0]
    empty_at = len(body)
    body += b"PK\x03\x04" + struct.pack("<5H3I2H", 20, 0, 0, 0, 0, 0, 0, 0, 1, 0) + b"x"  # one empty entry's local header
    n = 100_000
    for name, method in (("many.pt", 0), ("many-last-deflated.pt", 8)):
        cd = b"".join(_central(*e) for e in entries) + b"".join(
            _central(archive + b"/e/%d" % k, empty_at, 0, 0, method=method if k == n - 1 else 0) for k in range(n))
        (tmp_path / name).write_bytes(body + cd + _end(len(entries) + n, len(cd), len(body)))
        del cd
    assert torch.load(tmp_path / "many.pt", weights_only=True)["w"].equal(torch.arange(10, dtype=torch.float32))
    peaks = []
    for name in ("many.pt", "many-last-deflated.pt"):
        fd = os.open(tmp_path / name, os.O_RDONLY)
        tracemalloc.start()
        try:
            if name == "many.pt":
                check_stored_entries(fd, name)
            else:
                with pytest.raises(InvalidSourceError, match=f"e/{n - 1} is compressed"):
                    check_stored_entries(fd, name)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
            os.close(fd)
    assert max(peaks) < 4 << 20, peaks  # bytes (zipfile: ~50 MiB)


def test_a_torch_file_whose_directory_zipfile_would_read_elsewhere_is_refused(tmp_path, store):
    """Python's zipfile reads a directory where the end record implies (data prepended to an archive), torch's
    reader (miniz) where the end record says: two directories of one size, one after the other, showed zipfile
    one of stored entries and torch one whose tensor entry is deflated (torch inflated it: measured with ones
    deflated behind stored zeros), and the file was let through. A directory the end records do not follow
    is refused; the deflated directory alone is refused as compressed."""
    import zlib

    zeros = torch.zeros(4 << 20, dtype=torch.uint8)
    body, entries = _torch_zip(tmp_path / "real.pt", {"w": zeros})
    (data,) = [e for e in entries if e[0].endswith(b"/data/0")]
    packed = zlib.compressobj(9, zlib.DEFLATED, -15)
    deflated = packed.compress(zeros.numpy().tobytes()) + packed.flush()
    bomb_at = len(body)
    body += b"PK\x03\x04" + struct.pack("<5H3I2H", 20, 0, 8, 0, 0, data[3], len(deflated), data[2], len(data[0]), 0) + data[0] + deflated
    good = b"".join(_central(*e) for e in entries)
    bad = b"".join(_central(e[0], bomb_at, e[2], e[3], method=8, packed=len(deflated)) if e is data else _central(*e)
                   for e in entries)
    assert len(good) == len(bad)
    p = tmp_path / "two.pt"
    p.write_bytes(body + bad + good + _end(len(entries), len(good), len(body), zip64=False))
    with pytest.raises(InvalidSourceError, match="not a readable torch file: its zip directory ends at byte"):
        store.push(p, "x")
    p.write_bytes(body + bad + _end(len(entries), len(bad), len(body)))
    with pytest.raises(InvalidSourceError, match="data/0 is compressed"):
        store.push(p, "x")
    assert store.refs() == {}


@pytest.mark.parametrize("lie", ["sizes", "past-the-end"])
def test_a_stored_entry_claiming_more_than_the_file_holds_is_refused(tmp_path, store, lie):
    """torch's reader allocates what an entry's directory record claims, then reads it. A tensor entry of 40
    bytes claiming 1 TiB in zip64 fields (its uncompressed size, or both) is refused naming the entry and what
    it claims, before torch is asked. (torch's miniz refuses both too, as 'invalid header or archive is
    corrupted'; the size lie was reported as 'compressed'.)"""
    body, entries = _torch_zip(tmp_path / "real.pt", {"w": torch.arange(10, dtype=torch.float32)})
    records = []
    for name, offset, size, crc in entries:
        if name.endswith(b"/data/0") and lie == "sizes":  # the zip64 field holds the uncompressed size
            records.append(_central(name, offset, 0xFFFFFFFF, crc, packed=size, extra=struct.pack("<HHQ", 1, 8, 1 << 40)))
        elif name.endswith(b"/data/0"):  # and the compressed one
            records.append(_central(name, offset, 0xFFFFFFFF, crc, packed=0xFFFFFFFF,
                                    extra=struct.pack("<HHQQ", 1, 16, 1 << 40, 1 << 40)))
        else:
            records.append(_central(name, offset, size, crc))
    cd = b"".join(records)
    p = tmp_path / "lie.pt"
    p.write_bytes(body + cd + _end(len(records), len(cd), len(body)))
    with pytest.raises(InvalidSourceError, match="data/0 claims 1099511627776 bytes") as e:
        store.push(p, "x")
    assert ("past the file's end" in str(e.value)) == (lie == "past-the-end")
    assert store.refs() == {}


def test_a_torch_file_with_zip64_entry_fields_passes_and_loads(tmp_path, store):
    """Past 4 GiB, torch.save writes an entry's sizes and offset as zip64 fields (all ones, the values in the
    record's extra field). A real torch file's directory rewritten so, every entry's three fields in zip64 form
    and an extra field of another kind before it, is read as torch reads it: it passes, pushes and pulls back
    bit for bit."""
    sd = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(0)), "b": torch.arange(7)}
    body, entries = _torch_zip(tmp_path / "real.pt", sd)
    wide = b"".join(_central(name, 0xFFFFFFFF, 0xFFFFFFFF, crc, packed=0xFFFFFFFF,
                             extra=struct.pack("<HH2s", 0x5455, 2, b"ok") + struct.pack("<HHQQQ", 1, 24, size, size, offset))
                    for name, offset, size, crc in entries)
    p = tmp_path / "wide.pt"
    p.write_bytes(body + wide + _end(len(entries), len(wide), len(body)))
    got = torch.load(p, weights_only=True)
    assert all(got[k].numpy().tobytes() == v.numpy().tobytes() for k, v in sd.items())
    store.push(p, "wide")
    back = torch.load(store.pull("wide", tmp_path / "back.pt"), weights_only=True)
    assert all(back[k].numpy().tobytes() == v.numpy().tobytes() for k, v in sd.items())
