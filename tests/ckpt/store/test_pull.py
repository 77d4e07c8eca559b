"""Pull never loses what is at the destination (ckpt/store/pull.py, ckpt/store/destination.py).

Every destination is treated as holding something precious: only the checkpoint's own
files are ever replaced, nothing is written inside a store, a failed pull leaves the
destination as it was, and a file named .pt is a torch file.
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration_util import assert_same_tree, opening_refused
from safetensors.torch import load_file, save_file

import ckpt
from ckpt.errors import CorruptObjectError, DestinationError, DestinationExistsError, TensorMismatchError


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry below ``root``: file bytes, or the target of a symbolic link."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = p.read_bytes()
    return out


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    save_file({"w": torch.randn(8, 8), "b": torch.randn(8)}, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text('{"hidden": 8}')
    (d / "sub" / "tokenizer.json").write_text('{"vocab": 3}')
    return d


def test_force_writes_into_a_directory_and_keeps_what_is_not_the_checkpoints(store, model_dir, tmp_path):
    store.push(model_dir, "two")
    dest = tmp_path / "dest"
    (dest / "notes").mkdir(parents=True)
    (dest / "keep.txt").write_text("precious")
    (dest / "notes" / "a.md").write_text("mine")
    (dest / "config.json").write_text("old config")
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(b"not yours")
    (dest / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(DestinationExistsError, match="in the way"):
        store.pull("two", dest)
    assert (dest / "config.json").read_text() == "old config"
    assert store.pull("two", dest, overwrite=True) == str(dest)
    assert (dest / "keep.txt").read_text() == "precious" and (dest / "notes" / "a.md").read_text() == "mine"
    for rel in ("config.json", "model.safetensors", "sub/tokenizer.json"):
        assert (dest / rel).read_bytes() == (model_dir / rel).read_bytes(), rel
    # The link at a checkpoint file's name was replaced, not written through.
    assert not (dest / "model.safetensors").is_symlink() and elsewhere.read_bytes() == b"not yours"
    assert not [p for p in dest.rglob("*") if "ckpt-tmp" in p.name]


@pytest.mark.parametrize("where", ["is the store", "inside the store", "holds the store", "link to the store"])
def test_directory_pull_never_writes_in_or_around_the_store(tmp_path, model_dir, where):
    sb = tmp_path / "sb"
    sb.mkdir()
    (sb / "keep.txt").write_text("precious")
    store = ckpt.Store.init(str(sb / "store"))
    store.push(model_dir, "two")
    os.symlink(sb / "store", tmp_path / "link")
    dest = {"is the store": sb / "store", "inside the store": sb / "store" / "refs",
            "holds the store": sb, "link to the store": tmp_path / "link"}[where]
    before = _tree(sb)
    with pytest.raises(DestinationError, match="store"):
        store.pull("two", dest, overwrite=True)
    assert _tree(sb) == before
    assert store.verify().ok and store.refs().keys() == {"two"}


@pytest.mark.parametrize("dest", ["store", "store/ckpt-store.json", "store/refs/new.safetensors", "link/x.safetensors"])
@pytest.mark.parametrize("include", [None, ["w"]])
def test_file_pull_never_writes_inside_a_store(tmp_path, dest, include):
    store = ckpt.Store.init(str(tmp_path / "store"))
    store.push({"w": torch.randn(4), "b": torch.randn(2)}, "one")
    os.symlink(tmp_path / "store", tmp_path / "link")
    before = _tree(tmp_path / "store")
    with pytest.raises(DestinationError, match="inside the store"):
        store.pull("one", tmp_path / dest, overwrite=True, include=include)
    assert _tree(tmp_path / "store") == before
    assert store.verify().ok


def test_pull_never_writes_inside_another_store(store, tmp_path):
    store.push({"w": torch.randn(4)}, "one")
    other = ckpt.Store.init(str(tmp_path / "other"))
    before = _tree(tmp_path / "other")
    with pytest.raises(DestinationError, match="inside the store"):
        store.pull("one", tmp_path / "other" / "refs" / "x.safetensors")
    assert _tree(tmp_path / "other") == before and other.verify().ok


def test_what_a_pull_never_replaces(store, model_dir, tmp_path):
    store.push(model_dir, "two")
    store.push({"w": torch.randn(4)}, "one")
    # A directory where a checkpoint file goes: never removed, even with --force.
    dest = tmp_path / "d1"
    (dest / "config.json").mkdir(parents=True)
    (dest / "config.json" / "x").write_text("mine")
    with pytest.raises(DestinationError, match="is a directory"):
        store.pull("two", dest, overwrite=True)
    assert (dest / "config.json" / "x").read_text() == "mine"
    # A file where the checkpoint needs a directory.
    dest = tmp_path / "d2"
    dest.mkdir()
    (dest / "sub").write_text("mine")
    with pytest.raises(DestinationError, match="a file where"):
        store.pull("two", dest, overwrite=True)
    assert (dest / "sub").read_text() == "mine" and sorted(os.listdir(dest)) == ["sub"]
    # A link among a file's parents inside the destination: not written through.
    dest, outside = tmp_path / "d3", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "sub").symlink_to(outside)
    with pytest.raises(DestinationError, match="symbolic link"):
        store.pull("two", dest, overwrite=True)
    assert os.listdir(outside) == [] and sorted(os.listdir(dest)) == ["sub"]
    # A file where a directory checkpoint goes.
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(DestinationError, match="not a directory"):
        store.pull("two", tmp_path / "afile", overwrite=True)
    assert (tmp_path / "afile").read_text() == "mine"
    # A dangling link at a one-file pull's destination is something in the way too.
    (tmp_path / "dangling.safetensors").symlink_to(tmp_path / "nowhere")
    with pytest.raises(DestinationExistsError):
        store.pull("one", tmp_path / "dangling.safetensors")
    assert (tmp_path / "dangling.safetensors").is_symlink()


def test_failed_pull_leaves_the_destination_as_it_was(tmp_path, model_dir):
    store = ckpt.Store.init(str(tmp_path / "store"))
    store.push(model_dir, "two")
    cid = store.manifest("two").tensors[0].chunks[0]
    path = tmp_path / "store" / store.objects.path("chunks", cid)
    path.write_bytes(path.read_bytes()[:-1])
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "config.json").write_text("old config")
    (dest / "keep.txt").write_text("precious")
    before = _tree(dest)
    with pytest.raises(CorruptObjectError):
        store.pull("two", dest, overwrite=True)
    assert _tree(dest) == before  # config.json untouched, no sub/, no temporaries
    with pytest.raises(CorruptObjectError):
        store.pull("two", tmp_path / "new" / "dir")
    assert sorted(os.listdir(tmp_path)) == ["dest", "model", "store"]


def test_pull_into_the_current_directory(store, model_dir, tmp_path, monkeypatch):
    store.push(model_dir, "two")
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("precious")
    monkeypatch.chdir(work)
    with pytest.raises(DestinationExistsError, match="keep.txt"):
        store.pull("two", ".")
    store.pull("two", ".", overwrite=True)
    assert (work / "keep.txt").read_text() == "precious"
    assert (work / "sub" / "tokenizer.json").read_bytes() == (model_dir / "sub" / "tokenizer.json").read_bytes()


def test_pt_named_pull_writes_a_weights_only_torch_file(store, tmp_path):
    sd = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3)).state_dict()
    values = {"epoch": 3, "note": "ok", "lrs": [0.1, 0.01], "sched": {"gamma": 0.5}}
    torch.save({"model": sd, **values}, tmp_path / "sd.pt")
    store.push(tmp_path / "sd.pt", "pt")
    out = store.pull("pt", tmp_path / "out.pt")
    assert_same_tree({"model": sd, **values}, torch.load(out, weights_only=True))  # as saved, nested
    # A safetensors name still gets the safetensors file, and --include honours the suffix too.
    assert set(load_file(store.pull("pt", tmp_path / "out.safetensors"))) == {f"model.{k}" for k in sd}
    only = torch.load(store.pull("pt", tmp_path / "w.pth", include=["model.0.*"]), weights_only=True)
    assert sorted(only) == ["model.0.bias", "model.0.weight"] and _bits(only["model.0.weight"]) == _bits(sd["0.weight"])


def test_pt_values_come_back_as_they_were_saved(store, tmp_path):
    """An optimizer's param_groups hold tuples (AdamW's betas), a training script's state holds
    inf (no best loss yet), int-keyed dicts inside lists and bytes: each comes back as itself, not as
    the list or string JSON would make of it. A checkpoint with such values is written as a version-2
    manifest (a reader that knows only version 1 refuses it); one without them keeps version 1."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    values = {"best_loss": float("inf"), "worst": float("-inf"), "shape": (2, 4), "tag": b"\x00\xff",
              "hist": [{0: "a", 1: (1.5, None)}], "nan": float("nan"), "plain": [1, 2.0, True, None, "s"],
              "looks_tagged": [{"__tuple__": [1]}], "size": torch.Size([3, 5])}
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), **values}, tmp_path / "sd.pt")
    store.push(tmp_path / "sd.pt", "pt")
    m = store.manifest("pt")
    assert m.extra_tagged and json.loads(store.objects.get_manifest(store.resolve("pt")))["version"] == 4  # (its structure, exact)
    got = torch.load(store.pull("pt", tmp_path / "out.pt"), weights_only=True)
    groups = got["optim"]["param_groups"]
    assert groups == opt.state_dict()["param_groups"] and type(groups[0]["betas"]) is tuple
    for k, v in values.items():
        if k == "nan":
            assert math.isnan(got[k])
        elif k == "size":
            assert got[k] == (3, 5) and type(got[k]) is torch.Size
        else:
            assert got[k] == v and type(got[k]) is type(v), k
    assert type(got["hist"][0][1]) is tuple and list(got["hist"][0]) == [0, 1]
    for k, v in opt.state_dict()["state"][0].items():
        assert _bits(got["optim"]["state"][0][k]) == _bits(v), k
    # A file of plain values keeps the version-1 manifest older readers know.
    torch.save({"w": torch.ones(2), "epoch": 3, "lrs": [0.1]}, tmp_path / "plain.pt")
    store.push(tmp_path / "plain.pt", "plain")
    assert not store.manifest("plain").extra_tagged
    assert json.loads(store.objects.get_manifest(store.resolve("plain")))["version"] == 1


def test_a_version_2_manifest_with_a_bad_tag_is_refused(store, tmp_path):
    """Tagged values are checked when the manifest is read, like its other fields: a hostile
    ``{"__float__": "1e400"}`` is a damaged manifest, never a value."""
    from ckpt.errors import StoreFormatError
    from ckpt.format.manifest import Manifest

    torch.save({"w": torch.ones(2), "t": (1, 2)}, tmp_path / "t.pt")
    store.push(tmp_path / "t.pt", "t")
    doc = json.loads(store.objects.get_manifest(store.resolve("t")))
    assert doc["extra"]["t"] == {"__tuple__": [1, 2]}
    doc["extra"]["t"] = {"__float__": "1e400"}
    with pytest.raises(StoreFormatError, match="extra 't'"):
        Manifest.from_json(json.dumps(doc).encode())
    doc["version"] = 7
    with pytest.raises(StoreFormatError, match="version 7; this ckpt reads versions 1, 2, 3, 4, 5, 6"):
        Manifest.from_json(json.dumps(doc).encode())


def test_pt_device_values_round_trip(store, tmp_path):
    """A ``torch.device`` (a config's ``{"device": torch.device("cuda", 0)}``), which
    ``torch.load(weights_only=True)`` reads, was refused at push, as a dtype was: it is the ``__device__``
    tag (version 3); one that is not a device torch knows makes the manifest damaged."""
    from ckpt.errors import StoreFormatError
    from ckpt.format.manifest import Manifest

    values = {"device": torch.device("cuda", 1), "devices": [torch.device("cpu"), (torch.device("meta"),)],
              "looks_tagged": [{"__device__": "cpu", "n": 1}]}
    torch.save({"w": torch.ones(2), **values}, tmp_path / "d.pt")
    store.push(tmp_path / "d.pt", "d")
    doc = json.loads(store.objects.get_manifest(store.resolve("d")))
    assert doc["version"] == 3 and doc["extra"]["device"] == {"__device__": "cuda:1"}
    got = torch.load(store.pull("d", tmp_path / "out.pt"), weights_only=True)
    assert {k: got[k] for k in values} == values and type(got["devices"][1]) is tuple
    for bad in ("npu", "cuda:x", "cuda:1:2", "CUDA", "", "cpu " * 100):
        doc["extra"]["device"] = {"__device__": bad}
        with pytest.raises(StoreFormatError, match="extra 'device': bad __device__ value"):
            Manifest.from_json(json.dumps(doc).encode())


def test_pt_complex_set_and_bytearray_values_round_trip(store, tmp_path):
    """``torch.load(weights_only=True)`` reads complex numbers, sets and bytearrays, which a push refused:
    they are the ``__complex__``, ``__set__`` (items in the order of their JSON, not the set's, which
    differs between processes) and ``__bytearray__`` tags, in a version-3 manifest like ``__dtype__`` (a
    version-2 reader would hand the tag out as a plain dict); a malformed one makes the manifest damaged."""
    from ckpt.errors import InvalidSourceError, StoreFormatError
    from ckpt.format.manifest import Manifest

    values = {"z": complex(1.5, float("-inf")), "zs": [1j, (complex(0, float("nan")),)], "tags": {"b", "a", (1, "c")},
              "empty": set(), "raw": bytearray(b"\x00\xff"), "mixed": {1, "1", 2.5, None, b"x"},
              "looks_tagged": [{"__set__": [1], "n": 1}]}
    torch.save({"w": torch.ones(2), **values}, tmp_path / "v.pt")
    store.push(tmp_path / "v.pt", "v")
    doc = json.loads(store.objects.get_manifest(store.resolve("v")))
    assert doc["version"] == 3 and doc["extra"]["tags"] == {"__set__": ["a", "b", {"__tuple__": [1, "c"]}]}
    got = torch.load(store.pull("v", tmp_path / "out.pt"), weights_only=True)
    for k, v in values.items():  # (nan != nan: the others by repr)
        assert (got[k] == v if isinstance(v, set) else repr(got[k]) == repr(v)) and type(got[k]) is type(v), k
    assert store.manifest("v").extra_values()["mixed"] == values["mixed"]
    for key, bad in (("z", {"__complex__": [1.0]}), ("z", {"__complex__": ["1", 2.0]}), ("tags", {"__set__": [[1]]}),
                     ("tags", {"__set__": [1, 1]}), ("raw", {"__bytearray__": "zz"})):
        with pytest.raises(StoreFormatError, match=f"extra '{key}': bad"):
            Manifest.from_json(json.dumps({**doc, "extra": {**doc["extra"], key: bad}}).encode())
    torch.save({"w": torch.ones(2), "s": {torch.ones(1)}}, tmp_path / "t.pt")
    with pytest.raises(InvalidSourceError, match="neither a tensor nor a plain value"):
        store.push(tmp_path / "t.pt", "t")


def test_a_dict_an_older_ckpt_wrote_with_a_key_now_a_tag_reads_as_that_dict(store, tmp_path):
    """Before the tags of torch values, sets... existed, {"__dtype__": "float32"} was a plain dict, written as it
    is in a version-2 manifest (a snapshot of format 1, a ckpt-dcp record of version 1): it read back as
    torch.float32, silently, and the manifest re-encoded as version 3 (other bytes, another id). Those tags
    are tags only in the records whose version has them."""
    from ckpt.dcp.format import decode_layout
    from ckpt.format.manifest import Manifest
    from ckpt.snapshot.state import unflatten

    torch.save({"w": torch.ones(2), "t": (1, 2)}, tmp_path / "t.pt")
    store.push(tmp_path / "t.pt", "t")
    doc = json.loads(store.objects.get_manifest(store.resolve("t")))
    assert doc["version"] == 2
    old = [{"__dtype__": "float32"}, {"__set__": [1]}, {"__bytearray__": "00"}, {"__complex__": [1.0, 2.0]}]
    doc["extra"]["opts"] = old
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    m = Manifest.from_json(raw)
    assert m.extra_values()["opts"] == old and m.to_json() == raw
    assert unflatten(old, {}, later=False) == old and unflatten(old, {})[0] is torch.float32
    layout = {"dcp": {"format": "ckpt-dcp", "version": 1, "planner_data": None, "items": {"v": {"kind": "value", "value": old}}}}
    assert decode_layout(layout, "m").values["v"] == old
    layout["dcp"]["version"] = 2
    assert decode_layout(layout, "m").values["v"][0] is torch.float32


def test_pt_dtype_values_round_trip(store, tmp_path):
    """``torch.load(weights_only=True)`` reads a ``torch.dtype`` (a config's ``{"dtype": torch.bfloat16}``):
    a push refused such a file. It is the ``__dtype__`` tag, in a version-3 manifest (a version-2 reader
    would hand the tag out as a plain dict); a stored name that is no dtype makes the manifest damaged."""
    from ckpt.errors import StoreFormatError
    from ckpt.format.manifest import Manifest

    values = {"dtype": torch.bfloat16, "dtypes": [(torch.float8_e4m3fn, torch.half), {0: torch.int64}],
              "looks_tagged": [{"__dtype__": "float32"}]}
    torch.save({"w": torch.ones(2), **values}, tmp_path / "d.pt")
    store.push(tmp_path / "d.pt", "d")
    doc = json.loads(store.objects.get_manifest(store.resolve("d")))
    assert doc["version"] == 3 and doc["extra"]["dtype"] == {"__dtype__": "bfloat16"}
    got = torch.load(store.pull("d", tmp_path / "out.pt"), weights_only=True)
    assert {k: got[k] for k in values} == values and type(got["dtypes"][0]) is tuple
    assert got["looks_tagged"] == [{"__dtype__": "float32"}]  # a user's dict, not a dtype
    for bad in ("_dynamo", "Tensor", "float99"):  # never looked up as an attribute of torch
        doc["extra"]["dtype"] = {"__dtype__": bad}
        with pytest.raises(StoreFormatError, match="extra 'dtype': bad __dtype__ value"):
            Manifest.from_json(json.dumps(doc).encode())


def test_include_refuses_tensors_of_one_name_in_two_files(store, tmp_path):
    d = tmp_path / "dup"
    d.mkdir()
    save_file({"x": torch.randn(4), "a_only": torch.randn(2)}, d / "a.safetensors")
    save_file({"x": torch.randn(8)}, d / "b.safetensors")
    store.push(d, "dup")
    for dest in ("sel.safetensors", "sel.pt"):
        with pytest.raises(TensorMismatchError, match="'x' appears in two files .*a.safetensors and b.safetensors"):
            store.pull("dup", tmp_path / dest, include=["*"])
        assert not (tmp_path / dest).exists()
    assert list(load_file(store.pull("dup", tmp_path / "a.safetensors", include=["a_*"]))) == ["a_only"]


def test_a_manifest_naming_one_path_twice_is_refused(tmp_path):
    from ckpt.errors import StoreFormatError
    from ckpt.store.destination import dir_targets

    store = ckpt.Store.init(str(tmp_path / "store"))
    for paths in (["a.json", "a.json"], ["sub", "sub/x.json"]):
        with pytest.raises(StoreFormatError, match="twice, or as both"):
            dir_targets(store, str(tmp_path / "d"), paths, True)
    assert dir_targets(store, str(tmp_path / "d"), ["sub/x.json", "sub.json"], False)[1][0].endswith("x.json")



@pytest.mark.parametrize("old,path", [("sub/tokenizer.json", "config.json"), ("sub/tokenizer.json", "config.json/x"),
                                      ("config.json", "sub")])
def test_a_manifest_naming_one_path_twice_is_damaged_for_every_command(store, model_dir, tmp_path, old, path):
    """A forged manifest naming one path twice (or a file and a directory above another) was refused by pull only,
    when it laid the files out: verify called its checkpoint sound, and show and copy took it. The manifest is
    refused when it is read, so verify reports it damaged, and a pull writes nothing."""
    from ckpt.errors import StoreFormatError

    store.push(model_dir, "m")

    def clash(doc: dict) -> None:
        next(f for f in doc["files"] if f["path"] == old)["path"] = path

    forged = _forge(store, "m", clash)
    report = store.verify([forged])
    assert not report.ok and any("twice, or as both a file and a directory" in p for p in report.problems), report.problems
    with pytest.raises(StoreFormatError, match="twice, or as both"):
        store.manifest(forged)
    with pytest.raises(StoreFormatError, match="twice, or as both"):
        store.pull(forged, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_distributed_checkpoint_pull_follows_the_same_rule(tmp_path):
    import torch.distributed.checkpoint as dcp

    import ckpt.dcp

    url = str(tmp_path / "store")
    full = {"rows": torch.randn(9, 7), "ids": torch.arange(5)}
    dcp.save({"t": full}, storage_writer=ckpt.dcp.Writer(url, "dist/a"))
    store = ckpt.Store.open(url)
    before = _tree(tmp_path / "store")
    for dest in ("store", "store/objects/x.safetensors"):
        with pytest.raises(DestinationError, match="inside the store"):
            store.pull("dist/a", tmp_path / dest, overwrite=True)
    assert _tree(tmp_path / "store") == before
    (tmp_path / "mine.safetensors").write_bytes(b"precious")
    with pytest.raises(DestinationExistsError):
        store.pull("dist/a", tmp_path / "mine.safetensors")
    assert (tmp_path / "mine.safetensors").read_bytes() == b"precious"
    got = torch.load(store.pull("dist/a", tmp_path / "out.pt"), weights_only=True)
    assert sorted(got) == ["t.ids", "t.rows"] and _bits(got["t.rows"]) == _bits(full["rows"])
    assert not [p for p in tmp_path.iterdir() if "ckpt-tmp" in p.name]


def test_a_distributed_checkpoint_pull_larger_than_the_free_space_is_refused_first(tmp_path, tmpfs):
    """Consolidated into one safetensors file, a distributed checkpoint was written until the disk was
    full (every other program writing there failing meanwhile), then removed: refused before anything
    is written, as every other pull is, whatever the file is named. (The ``out.pt`` case passed on the
    code before too: write_torch already checked the disk; it stays to keep that so.)"""
    import torch.distributed.checkpoint as dcp

    import ckpt.dcp
    from ckpt.errors import ResourceLimitError

    url = str(tmp_path / "store")
    dcp.save({"w": torch.randn(1 << 20)}, storage_writer=ckpt.dcp.Writer(url, "dist/big"))  # 4 MiB
    store = ckpt.Store.open(url)
    small = tmpfs(tmp_path / "small", "1m")
    for name, include in (("out.safetensors", None), ("sel.safetensors", ["*"]), ("out.pt", None)):
        with pytest.raises(ResourceLimitError, match="pulling needs"):
            store.pull("dist/big", os.path.join(small, name), include=include)
        assert os.listdir(small) == []


def _flush_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "ckpt-flush"]



def _recording(monkeypatch) -> list[tuple[str, int]]:
    """Record every fdatasync and fsync (by fd), then do it."""
    calls: list[tuple[str, int]] = []
    for name in ("fdatasync", "fsync"):
        real = getattr(os, name)

        def call(fd: int, name: str = name, real=real) -> None:
            calls.append((name, fd))
            real(fd)

        monkeypatch.setattr(os, name, call)
    return calls


def test_an_output_file_is_flushed_while_written_then_fsynced(tmp_path, monkeypatch):
    """Each FLUSH_EVERY bytes written wake a thread that flushes the file to the disk (so
    the final fsync has little left); the thread starts with the first flush and ends once the
    file is complete, and leaving the block fsyncs the file."""
    import time

    from ckpt.store import output_files

    monkeypatch.setattr(output_files, "FLUSH_EVERY", 1 << 20)
    calls = _recording(monkeypatch)
    piece = os.urandom(1 << 20)
    with output_files.OutputFile(str(tmp_path / "f"), 4 << 20) as out:
        fd = out.fd
        assert not _flush_threads()  # none until there is something to flush
        for i in range(3):
            out.write_at(piece, i << 20)
        deadline = time.monotonic() + 10
        while ("fdatasync", fd) not in calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ("fdatasync", fd) in calls and ("fsync", fd) not in calls
        out.write_at(piece, 3 << 20)  # the last bytes: the file is complete, its thread ends
        out.flusher.thread.join(10)
        assert not _flush_threads()
    assert calls[-1] == ("fsync", fd)
    assert (tmp_path / "f").read_bytes() == piece * 4


def test_a_large_pull_stops_its_flushing_whether_it_succeeds_or_fails(tmp_path, monkeypatch):
    """A pulled file of several FLUSH_EVERY (safetensors, then torch): its bytes are the
    source's, it was fsynced before it was renamed into place, and no flushing thread outlives
    the pull, even a failed one."""
    from ckpt.store import output_files

    monkeypatch.setattr(output_files, "FLUSH_EVERY", 1 << 20)
    store = ckpt.Store.init(str(tmp_path / "store"), settings=ckpt.Settings.from_env(chunk_size=1 << 20))
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(1 << 18, generator=g) for i in range(8)}  # 8 MiB, 8+ chunks
    src = tmp_path / "src.safetensors"
    save_file(tensors, str(src))
    store.push(str(src), "big")
    calls = _recording(monkeypatch)
    fsynced_before_rename: list[bool] = []

    def placing(real):  # a file takes its name by a rename, or where none may be replaced by renameat2 (or a link)
        def place(*args, **kwargs):
            fsynced_before_rename.append(any(k == "fsync" for k, _ in calls))
            return real(*args, **kwargs)
        return place

    from ckpt.store import placing as placing_module

    monkeypatch.setattr(os, "replace", placing(os.replace))
    monkeypatch.setattr(os, "link", placing(os.link))
    if placing_module._renameat2 is not None:
        monkeypatch.setattr(placing_module, "_renameat2", placing(placing_module._renameat2))
    out = tmp_path / "out.safetensors"
    store.pull("big", out)
    assert out.read_bytes() == src.read_bytes()
    assert fsynced_before_rename == [True]
    assert not _flush_threads()
    # A torch file: torch.save writes it through the flusher's wrapper.
    calls.clear()
    store.pull("big", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {k: v.numpy().tobytes() for k, v in got.items()} == {k: v.numpy().tobytes() for k, v in tensors.items()}
    assert fsynced_before_rename == [True, True]
    assert not _flush_threads()
    (tmp_path / "out.pt").unlink()

    cid = store.manifest("big").tensors[-1].chunks[0]
    path = tmp_path / "store" / store.objects.path("chunks", cid)
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CorruptObjectError):
        store.pull("big", tmp_path / "failed.safetensors")
    assert not _flush_threads()
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors", "src.safetensors", "store"]



@pytest.mark.parametrize("name", ["out.safetensors", "out.pt"])
def test_a_failed_background_flush_fails_the_pull(tmp_path, monkeypatch, name):
    """A flush that fails (the disk lost written data) fails the pull, and nothing is renamed
    into place: the error is not left to the final fsync, which Linux lets succeed once an
    earlier call on the same file has reported it. The same for a torch file (``torch.save``
    writes it through a file object)."""
    import errno
    import time

    from ckpt.store import output_files

    monkeypatch.setattr(output_files, "FLUSH_EVERY", 1 << 20)
    store = ckpt.Store.init(str(tmp_path / "store"), settings=ckpt.Settings.from_env(chunk_size=1 << 20))
    g = torch.Generator().manual_seed(4)
    store.push({f"w{i}": torch.randn(1 << 18, generator=g) for i in range(8)}, "big")
    flushed = []

    def failing(fd: int) -> None:
        flushed.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    real_wrote = output_files._Flusher.wrote

    def wrote(self, n: int) -> None:  # once a flush is asked for, let it run before more is written
        real_wrote(self, n)
        deadline = time.monotonic() + 10
        while not flushed and self.unflushed == 0 and time.monotonic() < deadline:
            time.sleep(0.01)

    monkeypatch.setattr(output_files._Flusher, "wrote", wrote)
    with pytest.raises(DestinationError, match="Input/output error"):
        store.pull("big", tmp_path / name)
    assert flushed
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert not _flush_threads()


def test_a_rename_failing_part_way_puts_back_every_file_already_replaced(tmp_path):
    """The renames into place come last, and one may still fail (a file made immutable, another
    user's file in a sticky directory; here a folder appears where the last file goes): every
    file already replaced gets its old bytes back, a new one goes, and nothing of ours stays."""
    from ckpt.store.destination import write_files

    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True)
    (dest / "config.json").write_text("old config")
    (dest / "model.safetensors").write_bytes(b"old weights")
    (tmp_path / "elsewhere").write_text("a link's target")
    (dest / "linked.json").symlink_to(tmp_path / "elsewhere")
    (dest / "sub" / "tok.json").write_text("old tokenizer")
    targets = [dest / "config.json", dest / "new.txt", dest / "model.safetensors", dest / "linked.json", dest / "sub" / "tok.json"]

    def fill(tmps):
        for tmp in tmps:
            Path(tmp).write_bytes(b"new")
        (dest / "sub" / "tok.json").unlink()  # in the way of the last rename, after every check
        (dest / "sub" / "tok.json").mkdir()
        (dest / "sub" / "tok.json" / "inside").write_text("someone's")

    before = _tree(dest)
    with pytest.raises(DestinationError, match="tok.json"):
        write_files([str(t) for t in targets], fill)
    del before["sub/tok.json"]
    before["sub/tok.json/inside"] = b"someone's"
    assert _tree(dest) == before  # old bytes back, the link a link again, no new.txt, no temporaries
    assert (dest / "linked.json").is_symlink() and (tmp_path / "elsewhere").read_text() == "a link's target"


def test_a_force_pull_onto_an_immutable_file_leaves_every_file_as_it_was(tmp_path, model_dir):
    """The same through a pull, with the real obstacle: the last file of the checkpoint made
    immutable (``chattr +i``; where this machine allows it)."""
    import subprocess

    store = ckpt.Store.init(str(tmp_path / "store"))
    store.push(model_dir, "two")
    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True)
    for rel in ("config.json", "model.safetensors", "sub/tokenizer.json"):
        (dest / rel).write_text(f"old {rel}")
    locked = dest / "sub" / "tokenizer.json"
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode:
        pytest.skip("chattr +i is not allowed here")
    try:
        before = _tree(dest)
        with pytest.raises(DestinationError):
            store.pull("two", dest, overwrite=True)
        assert _tree(dest) == before
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=False)


def test_a_pull_under_a_file_says_so_and_leaves_it(store, tmp_path):
    """A destination whose parent is a file: a DestinationError, not a traceback from the cleanup
    (whose own removal of the temporary fails there too)."""
    store.push({"w": torch.randn(16)}, "one")
    (tmp_path / "afile").write_text("precious")
    for name in ("out.safetensors", "out.pt"):
        with pytest.raises(DestinationError):
            store.pull("one", tmp_path / "afile" / name)
    assert (tmp_path / "afile").read_text() == "precious"


def test_a_torch_file_pull_to_a_full_disk_is_refused_or_fails_saying_so(tmp_path, tmpfs):
    """A .pt pull larger than the free space is refused before anything is written, like a
    safetensors one; and if the disk fills while torch.save writes (the free-space check passed),
    the error says the disk is full rather than torch's 'unexpected pos'."""
    from ckpt.errors import ResourceLimitError
    from ckpt.store import output_files

    store = ckpt.Store.init(str(tmp_path / "store"))
    store.push({"w": torch.randn(1 << 20)}, "big")  # 4 MiB
    small = tmpfs(tmp_path / "small", "1m")
    with pytest.raises(ResourceLimitError):
        store.pull("big", os.path.join(small, "out.pt"))
    assert os.listdir(small) == []
    output_files.check_disk, real = (lambda need, path: None), output_files.check_disk
    try:
        with pytest.raises(DestinationError, match="No space left"):
            store.pull("big", os.path.join(small, "out.pt"))
    finally:
        output_files.check_disk = real
    assert os.listdir(small) == []


def test_a_rename_that_fails_after_the_backup_leaves_no_backup(tmp_path):
    """The old file is kept as a hard link, then the rename over it fails (here: the temporary is
    on another filesystem): the target is its old self and no `.NAME.ckpt-old-*` stays behind
    (one did: renaming a link over itself does nothing, so the 'restore' kept both names)."""
    import tempfile

    from ckpt.store.placing import replace_all

    other = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    if other is None or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a temporary on another filesystem than the destination")
    try:
        (tmp_path / "t.json").write_text("old")
        (tmp_path / "u.json").write_text("old u")
        new = Path(other) / "new"
        new.write_text("new")
        first = tmp_path / ".u.json.tmp"
        first.write_text("new u")
        with pytest.raises(OSError):
            replace_all([str(first), str(new)], [str(tmp_path / "u.json"), str(tmp_path / "t.json")])
        assert _tree(tmp_path) == {"t.json": b"old", "u.json": b"old u"}
    finally:
        import shutil

        shutil.rmtree(other, ignore_errors=True)


@pytest.mark.parametrize("what", ["file", "pt", "dir"])
def test_a_file_made_at_the_destination_while_a_pull_runs_is_kept(store, model_dir, tmp_path, monkeypatch, what):
    """Without --force a pull checks its destination first, then writes for as long as the
    transfer takes: a file another program makes there meanwhile is not replaced (it was, by
    the rename into place), and the pull fails saying so, leaving nothing of its own."""
    import ckpt.store.pull as pull_module

    if what == "dir":
        store.push(model_dir, "ref")
        dest = tmp_path / "dest"
        dest.mkdir()
        target = dest / "config.json"
    else:
        store.push(model_dir / "model.safetensors", "ref")
        dest = target = tmp_path / ("out.pt" if what == "pt" else "out.safetensors")
    real_write, real_torch = pull_module._write_files, pull_module.write_torch

    def made_meanwhile() -> None:
        target.write_bytes(b"written by someone else while the pull ran")

    def write_files_then_another_program(*args, **kwargs):
        real_write(*args, **kwargs)
        made_meanwhile()

    def write_torch_after_another_program(*args, **kwargs):
        made_meanwhile()
        real_torch(*args, **kwargs)

    monkeypatch.setattr(pull_module, "_write_files", write_files_then_another_program)
    monkeypatch.setattr(pull_module, "write_torch", write_torch_after_another_program)
    with pytest.raises(DestinationExistsError, match="while this pull ran"):
        store.pull("ref", dest)
    assert target.read_bytes() == b"written by someone else while the pull ran"
    left = sorted(p.name for p in target.parent.iterdir())
    assert left == (["config.json"] if what == "dir" else sorted(["model", "store", target.name]))


# -- what a killed pull leaves -------------------------------------------------------------
_KILLED_PULL = """
import os, signal, sys
import ckpt, ckpt.store.atomic_files as atomic_files
def killed():  # the files are complete under their temporary names, about to be renamed into place
    os.kill(os.getpid(), signal.SIGKILL)
atomic_files._placing_files = killed
ckpt.Store.open(sys.argv[1]).pull(sys.argv[2], sys.argv[3], overwrite=sys.argv[4] == "1")
"""


def _left_temporaries(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if ".ckpt-tmp-" in p.name)


def _age(p: Path, seconds: float = 60.0) -> None:
    t = os.lstat(p).st_mtime - seconds
    os.utime(p, (t, t), follow_symlinks=False)


@pytest.mark.parametrize("what", ["file", "folder", "file over an old one"])
def test_the_next_pull_removes_what_a_killed_pull_left(store, model_dir, tmp_path, what):
    """A SIGKILLed pull leaves its complete temporaries under hidden names (as large as the
    checkpoint); the next pull to the same name removes them, and only them."""
    import subprocess
    import sys

    if what == "folder":
        store.push(model_dir, "ref")
        dest = tmp_path / "out"
    else:
        store.push(model_dir / "model.safetensors", "ref")
        dest = tmp_path / "out" / "model.safetensors"
        dest.parent.mkdir()
        if what == "file over an old one":
            dest.write_bytes(b"the old file")
    (dest.parent / "keep.txt").write_text("precious")
    (dest.parent / f".{dest.name}.ckpt-old-12345678").write_text("a backup: never swept")
    killed = subprocess.run([sys.executable, "-c", _KILLED_PULL, str(store.url), "ref", str(dest),
                             "1" if what == "file over an old one" else "0"], capture_output=True)
    assert killed.returncode == -9, killed.stderr.decode()
    (left,) = _left_temporaries(dest.parent)
    assert left.is_dir() == (what == "folder")
    if what == "file over an old one":
        assert dest.read_bytes() == b"the old file"
    else:
        assert not dest.exists()
    store.pull("ref", dest, overwrite=True)  # the temporary is a few seconds old at most: kept
    assert left.exists()
    _age(left)
    (dest.parent / "keep.txt").write_text("precious")
    _remove(dest)
    store.pull("ref", dest)
    assert not left.exists() and _left_temporaries(dest.parent) == []
    assert (dest.parent / "keep.txt").read_text() == "precious"
    assert (dest.parent / f".{dest.name}.ckpt-old-12345678").read_text() == "a backup: never swept"
    src = model_dir if what == "folder" else model_dir / "model.safetensors"
    if what == "folder":
        assert _tree(dest) == _tree(src)
    else:
        assert dest.read_bytes() == src.read_bytes()


def _remove(p: Path) -> None:
    import shutil

    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink()


def test_a_temporary_a_live_pull_holds_is_never_swept(tmp_path):
    """Only temporaries no process holds are removed: a pull under way keeps its own, however
    old; links and other kinds of file named like temporaries are left alone too."""
    import subprocess
    import sys

    from ckpt.store.destination import sweep_left, temp_name

    target = str(tmp_path / "model.safetensors")
    live = temp_name(target)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, ckpt.store.destination as d\n"
        f"fd = d.create_new({live!r}); print('ready', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"ready\n"
        Path(live).write_bytes(b"half a model")
        _age(Path(live))
        link = Path(temp_name(target))
        link.symlink_to(tmp_path / "elsewhere")
        (tmp_path / "elsewhere").write_text("not a temporary")
        _age(link)
        fifo = temp_name(target)
        os.mkfifo(fifo)
        _age(Path(fifo))
        sweep_left(target)
        assert Path(live).read_bytes() == b"half a model" and link.is_symlink() and Path(fifo).exists()
    finally:
        holder.kill()
        holder.wait()
    sweep_left(target)  # its process is gone: the temporary is swept, the rest stays
    assert not os.path.lexists(live) and link.is_symlink() and Path(fifo).exists()
    assert (tmp_path / "elsewhere").read_text() == "not a temporary"


def test_a_folder_of_another_names_stale_temporaries_is_empty_and_keeps_them(store, model_dir, tmp_path):
    """A folder holding only what killed pulls of other names left (a file's temporary, a directory
    checkpoint's folder) counts as empty (``_placed`` skips every temporary name): a pull without --force
    writes the checkpoint there, and loses nothing. It takes only names nothing holds and sweeps only
    its own names' temporaries: the others' stay as they were, for a pull of their names to sweep."""
    from ckpt.store.destination import temp_name

    store.push(model_dir, "two")
    dest = tmp_path / "dest"
    dest.mkdir()
    other = Path(temp_name(str(dest / "other.safetensors")))
    other.write_bytes(b"half of another model")
    folder = Path(temp_name(str(dest / "sub")))
    (folder / "x").mkdir(parents=True)
    (folder / "x" / "y.json").write_text("another pull's")
    for p in (other, folder):
        _age(p, 3600)
    before = _tree(dest)
    assert len(before) == 2
    store.pull("two", dest)
    after = _tree(dest)
    assert {k: v for k, v in after.items() if k in before} == before
    assert {k: v for k, v in after.items() if k not in before} == _tree(model_dir)


@pytest.mark.parametrize("skew", [7200, -7200])
def test_a_temporary_is_judged_young_or_old_by_its_folders_clock(tmp_path, monkeypatch, skew):
    """A temporary is protected for a few seconds after its creation, before its pull locks it.
    Its age was this machine's clock less the file's mtime, which a file server stamps (NFS): on a
    client whose clock runs 2 h ahead, another client's temporary a moment old was swept under its
    pull; on one 2 h behind, a killed pull's an hour old was never swept. Ages are now read against
    the mtime of a file the sweep makes in that folder (and removes)."""
    import time
    import types

    from ckpt.store import atomic_files
    from ckpt.store.destination import sweep_left, temp_name

    target = str(tmp_path / "model.safetensors")
    fresh, old = Path(temp_name(target)), Path(temp_name(target))
    fresh.write_bytes(b"another pull's, not yet locked")
    old.write_bytes(b"a killed pull's")
    _age(old, 3600)
    (tmp_path / "keep.txt").write_text("precious")
    real = time.time
    monkeypatch.setattr(atomic_files, "time", types.SimpleNamespace(time=lambda: real() + skew))  # this sweep's clock only
    sweep_left(target)
    assert fresh.read_bytes() == b"another pull's, not yet locked" and not old.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, "keep.txt"])  # nothing else made or left


def test_pull_include_picks_one_model_of_a_pipeline_whose_models_share_names(store, tmp_path):
    """A diffusers-style pipeline whose unet/ and text_encoder/ both hold '0.weight': `ckpt pull REF
    unet.safetensors -i 'unet/*'` said 'no tensor matches', and -i '0.*' refused ('appears in two
    files'), while store.load names them FOLDER/NAME. pull -i now takes the names load gives: one
    model's tensors, as a safetensors or a torch file, bit for bit."""
    parts = {"unet": {"0.weight": torch.randn(4, 4), "0.bias": torch.randn(4)},
             "text_encoder": {"0.weight": torch.randn(2, 2)}}
    for part, sd in parts.items():
        (tmp_path / "pipe" / part).mkdir(parents=True)
        save_file(sd, tmp_path / "pipe" / part / "model.safetensors")
    store.push(tmp_path / "pipe", "sd")
    want = {f"unet/{k}": v for k, v in parts["unet"].items()}
    for name in ("unet.safetensors", "unet.pt"):
        out = tmp_path / name
        store.pull("sd", out, include=["unet/*"])
        got = load_file(out) if name.endswith(".safetensors") else torch.load(out, weights_only=True)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k].dtype == v.dtype and got[k].numpy().tobytes() == v.numpy().tobytes()
    with pytest.raises(TensorMismatchError, match="no tensor matches"):
        store.pull("sd", tmp_path / "none.safetensors", include=["0.*"])


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    for _ in range(2):
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _resume_one_step(saved: dict) -> tuple[dict, dict]:
    """A fresh model and optimizer loaded from ``saved`` (as a training script does), stepped once."""
    model, opt = _trained(seed=1)  # other weights and moments: everything must come from ``saved``
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    torch.manual_seed(2)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    return ({k: _bits(v) for k, v in model.state_dict().items()},
            {i: {k: _bits(v) for k, v in st.items()} for i, st in opt.state_dict()["state"].items()})


def test_a_pulled_pt_file_has_the_structure_that_was_pushed(store, tmp_path):
    """A pull to a .pt name wrote a flat dict (``model.0.weight``, ``optim.state.0.exp_avg``...), which
    ``opt.load_state_dict`` cannot take: a training script's ``{"model", "optim", "epoch"}`` pushed and
    pulled is now the object saved, exactly (nested dicts, int keys, key order, lists and tuples of
    tensors, values where they were), and training resumes from it as from the original file."""
    model, opt = _trained()
    saved = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, 7: {"b": 1, "a": (torch.ones(2), None)},
             "caches": [torch.arange(3), {0: torch.zeros(1, dtype=torch.bfloat16)}], "empty": {}, "dtype": torch.float16}
    torch.save(saved, tmp_path / "train.pt")
    store.push(tmp_path / "train.pt", "run")
    pulled = tmp_path / "pulled.pt"
    store.pull("run", pulled)
    back = torch.load(pulled, weights_only=True)
    assert_same_tree(saved, back)
    assert _resume_one_step(back) == _resume_one_step(torch.load(tmp_path / "train.pt", weights_only=True))
    # The same dict pushed from memory keeps its structure too; load, --include and safetensors stay flat.
    store.push(saved, "mem")
    assert_same_tree(saved, torch.load(store.pull("mem", tmp_path / "mem.pt"), weights_only=True))
    assert "optim.state.0.exp_avg" in store.load("run") and "optim" not in store.load("run")
    only = torch.load(store.pull("run", tmp_path / "only.pt", include=["optim.*"]), weights_only=True)
    assert sorted(only) == sorted(k for k in store.load("run") if k.startswith("optim."))
    # A flat dict of tensors needs no structure (its manifest keeps the version it had); its tensors come
    # back in the order they are stored.
    torch.save(dict(model.state_dict()), tmp_path / "flat.pt")
    store.push(tmp_path / "flat.pt", "flat")
    assert json.loads(store.objects.get_manifest(store.resolve("flat")))["version"] == 1
    flat = torch.load(store.pull("flat", tmp_path / "f.pt"), weights_only=True)
    assert_same_tree(dict(sorted(model.state_dict().items())), dict(sorted(flat.items())))
    assert store.verify().ok


def _same_exactly(want: object, got: object, at: str = "") -> None:
    """``got`` is ``want`` down to the types ``torch.load(weights_only=True)`` gives: an OrderedDict and
    its attributes (a state dict's ``_metadata``), a torch.Size, a Parameter and its requires_grad."""
    assert type(got) is type(want), (at, type(want), type(got))
    if isinstance(want, torch.Tensor):
        assert want.requires_grad == got.requires_grad, at
    elif isinstance(want, dict):
        assert list(got) == list(want), at
        if type(want) is collections.OrderedDict:
            assert sorted(vars(got)) == sorted(vars(want)), at
            _same_exactly(dict(vars(want)), dict(vars(got)), f"{at}.__dict__")
        for k, v in want.items():
            _same_exactly(v, got[k], f"{at}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            _same_exactly(w, g, f"{at}[{i}]")
    assert_same_tree(want, got, at)  # values, key order, tensor bytes


def test_a_pulled_pt_file_keeps_the_types_torch_load_gives(store, tmp_path):
    """A module's state_dict() is an OrderedDict whose ``_metadata`` holds each module's version, which
    load_state_dict passes on (BatchNorm reads it); a .pt may hold torch.Size values and Parameters. They
    came back as dict (``_metadata`` lost), tuple and Tensor: now as themselves, in a version-4 manifest
    (a version-3 reader would hand out the tags as plain dicts: it refuses the version instead). A plain
    dict of plain tensors keeps the version-1 manifest it had."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 4, 4)).sum().backward()
    opt.step()
    mask = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    saved = {
        "flat": model.state_dict(),
        "params": dict(model.named_parameters()),
        "lightning": {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 1,
                      "hparams": collections.OrderedDict(b=1, a=(2, torch.Size([4, 3]))), "mask": mask},
    }
    for name, obj in saved.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        store.push(tmp_path / f"{name}.pt", name)
        assert json.loads(store.objects.get_manifest(store.resolve(name)))["version"] == 4, name
        want = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        _same_exactly(want, torch.load(store.pull(name, tmp_path / f"{name}.back.pt"), weights_only=True), name)
        _same_exactly(want, store.load(name, structure=True), name)
    back = torch.load(tmp_path / "flat.back.pt", weights_only=True)
    assert back._metadata["1"] == {"version": 2} and back._metadata == model.state_dict()._metadata
    fresh = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    fresh.load_state_dict(back)
    assert _bits(fresh[1].num_batches_tracked) == _bits(model[1].num_batches_tracked)
    store.push({"w": torch.ones(2)}, "plain")
    assert json.loads(store.objects.get_manifest(store.resolve("plain")))["version"] == 1
    # A version-3 manifest holding such a key wrote a plain dict: it reads as one.
    doc = json.loads(store.objects.get_manifest(store.resolve("lightning")))
    doc["version"], doc["extra"]["x"] = 3, {"__size__": [1]}
    del doc["extra"][""]
    store.refs_db.set("old", store.objects.put_manifest(json.dumps(doc).encode()))
    assert store.manifest("old").extra_values()["x"] == {"__size__": [1]}
    assert store.verify().ok


def _memory(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride()


def test_tensors_that_share_memory_pull_back_sharing_it(store, tmp_path):
    """Tied weights (an embedding and the output layer that reuses it) are two entries of a state_dict
    over one storage, which torch.save writes once and torch.load gives back shared: they came back as
    two copies. The structure records which tensor lies where one met before it lies, and a pull (or
    load(structure=True)) gives them one memory again; the stored bytes are still each tensor's own,
    and a forged record naming a tensor of other bytes is a damaged manifest, never two tensors made one."""
    from ckpt.errors import StoreFormatError

    emb = torch.nn.Embedding(50, 16)
    model = torch.nn.Sequential(emb, torch.nn.Linear(16, 50, bias=False))
    model[1].weight = emb.weight
    t = torch.randn(4)
    saved = {"model": model.state_dict(), "pair": [t, t], "other": t + 1, "empty": [torch.ones(0), torch.ones(0)]}
    torch.save(saved, tmp_path / "tied.pt")
    store.push(tmp_path / "tied.pt", "tied")
    want = torch.load(tmp_path / "tied.pt", weights_only=True)
    for got in (torch.load(store.pull("tied", tmp_path / "back.pt"), weights_only=True), store.load("tied", structure=True)):
        _same_exactly(want, got)
        assert _memory(got["model"]["0.weight"]) == _memory(got["model"]["1.weight"])
        assert _memory(got["pair"][0]) == _memory(got["pair"][1]) != _memory(got["other"])
    assert store.verify().ok

    def forge(doc: dict, name: str) -> None:
        pairs = doc["extra"][""]["__dict__"]
        pairs[2][1] = {"__shared__": [pairs[2][1], name]}  # "other", said to share "pair.0"'s memory

    for name in ("pair.0", "other", "nope"):  # other bytes; itself; no such tensor
        with pytest.raises(StoreFormatError, match="structure"):
            store.pull(_forge(store, "tied", lambda d, name=name: forge(d, name)), tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_reading_a_manifest_with_exact_types_never_imports_torch(store, tmp_path):
    """The reader checks a structure's tags without building its torch values: ``ckpt show`` of a pushed
    state_dict() (now a version-4 structure) imported torch to check it, several seconds of every command."""
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "size": torch.Size([2])}, tmp_path / "m.pt")
    store.push(tmp_path / "m.pt", "m")
    code = (f"import ckpt, sys; m = ckpt.Store.open({str(store.url)!r}).manifest('m'); "
            "print(m.read_version, '' in m.extra, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.split() == ["4", "True", "False"], r.stdout + r.stderr


@pytest.mark.parametrize("bad", [
    {"__size__": [1 << 64]}, {"__size__": [True]}, {"__size__": [1.5]},
    {"__odict__": [[["a", 1]]]}, {"__odict__": [[["a", 1]], {"__class__": 1}]},
    {"__odict__": [[["a", 1]], {"items": 1}]}, {"__odict__": [[["a", 1], ["a", 2]], {}]},
    {"__parameter__": [{"__tensor__": "model.weight"}, 1]}, {"__parameter__": [{"__tensor__": "model.weight"}]},
    {"__parameter__": [{"__tensor__": "model.step"}, True]},
], ids=["huge_size", "bool_size", "float_size", "no_attributes", "dunder_attribute", "method_attribute", "key_twice", "int_flag", "no_flag",
        "int_tensor_with_grad"])
def test_a_forged_exact_type_is_a_damaged_manifest(store, tmp_path, bad):
    """The tags of the exact types are checked like the others: a malformed one makes the manifest
    damaged (an OrderedDict given ``__class__`` would have had it set on the pulled object; one given
    ``items`` had its method hidden: torch.save failed with a TypeError traceback)."""
    from ckpt.errors import StoreFormatError

    model = torch.nn.Linear(2, 2).state_dict()
    model["step"] = torch.ones(1, dtype=torch.int64)
    torch.save({"model": model, "epoch": 3}, tmp_path / "m.pt")
    store.push(tmp_path / "m.pt", "m")
    pairs = {"model.weight": 0, "model.step": 2}

    def forge(doc: dict) -> None:  # a Parameter in place of its tensor, other values in place of the epoch
        if "__parameter__" in bad:
            _model_pairs(doc)[pairs[bad["__parameter__"][0]["__tensor__"]]][1] = bad
        else:
            _epoch(doc, bad)

    with pytest.raises(StoreFormatError, match="structure"):
        store.pull(_forge(store, "m", forge), tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_load_gives_the_pushed_structure_only_when_asked(store, tmp_path):
    """``store.load(ref)`` still gives the dict of tensors by flat name; ``structure=True`` gives the
    object pushed (what a pull to a .pt writes), or that same dict where no structure was recorded."""
    model, opt = _trained()
    saved = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}
    torch.save(saved, tmp_path / "train.pt")
    store.push(tmp_path / "train.pt", "run")
    flat = store.load("run")
    assert all(isinstance(v, torch.Tensor) for v in flat.values()) and "optim.state.0.exp_avg" in flat
    assert_same_tree(saved, store.load("run", structure=True))
    assert_same_tree(saved, ckpt.load(store.url, "run", structure=True))
    assert _resume_one_step(store.load("run", structure=True)) == _resume_one_step(saved)
    store.push({"w": torch.ones(2)}, "plain")
    assert_same_tree({"w": torch.ones(2)}, store.load("plain", structure=True))
    with pytest.raises(TensorMismatchError, match="include"):
        store.load("run", include=["model.*"], structure=True)


def _nested(depth: int, leaf: object) -> object:
    for _ in range(depth):
        leaf = {"n": leaf}
    return leaf


def test_structures_that_tagged_json_cannot_hold_pull_flat(store, tmp_path):
    """A state dict nested deeper than tagged JSON's MAX_DEPTH pushes as before (by flat names) and
    pulls flat, as every checkpoint pushed before structures were kept does."""
    from ckpt.format.tagged_json import MAX_DEPTH

    torch.save({"deep": _nested(MAX_DEPTH + 5, torch.ones(2)), "w": torch.zeros(1)}, tmp_path / "deep.pt")
    store.push(tmp_path / "deep.pt", "deep")
    back = torch.load(store.pull("deep", tmp_path / "back.pt"), weights_only=True)
    assert sorted(back) == ["deep" + ".n" * (MAX_DEPTH + 5), "w"]


def test_a_structure_is_not_kept_past_its_bound(store, tmp_path, monkeypatch):
    """The structure repeats the values ``extra`` holds by flat name: a .pt whose values are huge (a
    sampler's permutation of millions of indexes) had its manifest doubled, towards the size no reader
    accepts. Past MAX_STRUCTURE_BYTES (lowered here) it is not kept, and the checkpoint pulls flat."""
    from ckpt.store import source_tensors

    monkeypatch.setattr(source_tensors, "MAX_STRUCTURE_BYTES", 4096)
    saved = {"model": {"w": torch.ones(2)}, "order": list(range(2000))}
    torch.save(saved, tmp_path / "big.pt")
    store.push(tmp_path / "big.pt", "big")
    doc = json.loads(store.objects.get_manifest(store.resolve("big")))
    assert "" not in doc["extra"] and doc["version"] == 1 and doc["extra"]["order"] == saved["order"]
    back = torch.load(store.pull("big", tmp_path / "back.pt"), weights_only=True)
    assert sorted(back) == ["model.w", "order"] and back["order"] == saved["order"]
    torch.save({"model": {"w": torch.ones(2)}, "order": list(range(20))}, tmp_path / "small.pt")
    store.push(tmp_path / "small.pt", "small")
    assert list(torch.load(store.pull("small", tmp_path / "s.pt"), weights_only=True)) == ["model", "order"]


def _forge(store, ref: str, change) -> str:
    """A copy of ``ref``'s manifest with ``change(doc)`` applied, stored and named ``forged``."""
    doc = json.loads(store.objects.get_manifest(store.resolve(ref)))
    change(doc)
    store.refs_db.set("forged", store.objects.put_manifest(json.dumps(doc).encode()))
    return "forged"


def test_a_checkpoint_pushed_before_structures_were_kept_pulls_flat(store, tmp_path):
    """An older manifest (version 2, no structure) still pulls as the flat dict it always did."""
    model, opt = _trained()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, tmp_path / "train.pt")
    store.push(tmp_path / "train.pt", "run")

    def older(doc: dict) -> None:
        del doc["extra"][""]
        doc["version"] = 2

    back = torch.load(store.pull(_forge(store, "run", older), tmp_path / "old.pt"), weights_only=True)
    assert_same_tree({**store.load("run"), "epoch": 3, "optim.param_groups": opt.state_dict()["param_groups"]},
                     {k: back[k] for k in sorted(back, key=lambda k: (k in ("epoch", "optim.param_groups"), k))})


def test_a_value_nested_too_deeply_for_a_torch_file_is_refused(store, tmp_path, capsys):
    """A version-1 manifest (an older push kept any value json.dumps took; or one made by hand) may hold
    a value hundreds of lists deep, which the reader takes but torch.save cannot write: a pull to a
    .pt ended in a RecursionError traceback. It is a DestinationError now, one line at the CLI, and
    nothing is left at the destination."""
    from ckpt_store.cli.main import main

    torch.save({"w": torch.ones(2), "epoch": 3}, tmp_path / "m.pt")
    store.push(tmp_path / "m.pt", "m")
    doc = store.objects.get_manifest(store.resolve("m"))
    assert json.loads(doc)["version"] == 1 and b'"epoch":3' in doc
    deep = doc.replace(b'"epoch":3', b'"epoch":' + b"[" * 700 + b"]" * 700)
    store.refs_db.set("deep", store.objects.put_manifest(deep))
    with pytest.raises(DestinationError, match="nested too deeply"):
        store.pull("deep", tmp_path / "out.pt")
    with pytest.raises(SystemExit) as e:
        main(["--store", store.url, "pull", "deep", str(tmp_path / "cli.pt")])
    err = capsys.readouterr().err.strip()
    assert e.value.code != 0 and "nested too deeply" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "store"]
    assert _bits(load_file(store.pull("deep", tmp_path / "w.safetensors"))["w"]) == _bits(torch.ones(2))


@pytest.mark.parametrize("where,bad", [
    ("epoch", {"__view__": 1}), ("epoch", {"__shared__": "x"}), ("epoch", {"__parameter__": None}),
    ("epoch", {"__requires_grad__": {}}), ("epoch", {"__odict__": 1}),
    ("weight", {"__shared__": []}), ("weight", {"__shared__": [{"__tensor__": "model.weight"}]}),
    ("epoch", {"__tensor__": ["w"]}), ("epoch", {"__view__": [{"__tensor__": "model.weight"}, {"x": 1}, 0, [1]]}),
], ids=["view_int", "shared_str", "parameter_null", "grad_object", "odict_int", "shared_empty", "shared_one",
        "tensor_list", "view_base_object"])
def test_a_malformed_exact_tag_is_a_damaged_manifest_not_a_traceback(store, tmp_path, where, bad):
    """In a structure with the exact types (version 4 on), a one-key dict keyed by one of their tags whose value is not
    the tag's list was decoded as a plain dict, which the structure's check then read as the tag: reading the manifest
    (every command: show, verify, pull) failed with "TypeError: 'int' object is not subscriptable". A ``__shared__`` of
    fewer than two items failed in its decoder with an IndexError. A writer of those versions writes a dict keyed by a
    tag as pairs, never so: each is a damaged manifest, said by name."""
    from ckpt.errors import StoreFormatError

    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "epoch": 3}, tmp_path / "m.pt")
    store.push(tmp_path / "m.pt", "m")

    def forge(doc: dict) -> None:
        if where == "epoch":
            _epoch(doc, bad)
        else:
            _model_pairs(doc)[0][1] = bad

    forged = _forge(store, "m", forge)
    with pytest.raises(StoreFormatError, match="structure: bad __"):
        store.manifest(forged)
    report = store.verify([forged])
    assert not report.ok and any("bad __" in p for p in report.problems), report.problems
    with pytest.raises(StoreFormatError, match="structure: bad __"):
        store.pull(forged, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def _model_pairs(doc: dict) -> list:
    return doc["extra"][""]["__dict__"][0][1]["__odict__"][0]  # [["weight", {"__tensor__": "model.weight"}], ["bias", ...]]


def _epoch(doc: dict, value: object) -> None:
    doc["extra"][""]["__dict__"][1][1] = value


def _swap(doc: dict) -> None:
    pairs = _model_pairs(doc)
    pairs[0][1], pairs[1][1] = pairs[1][1], pairs[0][1]


def _deep(depth: int) -> object:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


@pytest.mark.parametrize("forge", [
    lambda d: _model_pairs(d)[0].__setitem__(1, {"__tensor__": "model.nope"}),
    lambda d: _model_pairs(d).pop(0),
    lambda d: _model_pairs(d)[1].__setitem__(1, {"__tensor__": "model.weight"}),
    lambda d: d["extra"][""]["__dict__"].append(["again", {"__tensor__": "model.weight"}]),
    lambda d: _model_pairs(d).__setitem__(0, [{"__tensor__": "model.weight"}, 0]),
    lambda d: _epoch(d, {"__tuple__": 5}),
    lambda d: _epoch(d, {"__dtype__": "_dynamo"}),
    lambda d: _epoch(d, {"__tensor__": 1}),
    lambda d: _epoch(d, _deep(70)),
    lambda d: d["extra"].__setitem__("", [{"__tensor__": "model.weight"}, {"__tensor__": "model.bias"}]),
    lambda d: _model_pairs(d)[1].__setitem__(0, "weight"),
    lambda d: (_model_pairs(d)[0].__setitem__(0, 1), _model_pairs(d)[1].__setitem__(0, True)),
    lambda d: _epoch(d, {"__dict__": ["ab"]}),
    _swap,
    lambda d: _model_pairs(d)[0].__setitem__(1, {"__set__": [{"__tensor__": "model.weight"}]}),
], ids=["missing_tensor", "tensor_left_out", "tensor_twice", "tensor_named_twice", "tensor_as_key", "bad_tuple",
        "bad_dtype", "bad_tensor_ref", "too_deep", "not_a_dict", "key_twice", "int_and_bool_key", "not_a_pair",
        "tensors_swapped", "tensor_in_a_set"])
def test_a_forged_structure_is_a_damaged_manifest(store, tmp_path, forge, capsys):
    """A structure that names a tensor the checkpoint lacks, leaves one out or names one twice, uses a
    tag that does not decode, nests past MAX_DEPTH or is not a dict: the manifest is damaged (a clear
    StoreFormatError, one line at the CLI), never a traceback or a file holding other tensors. So is a
    dict given one key twice (``weight``, or ``1`` and ``true``, equal keys in Python) or a pair that is
    not ``[key, value]`` (``"ab"`` unpacked as one): it decoded to a dict that silently lost a tensor.
    And so is one holding a tensor anywhere but at the place its flat name spells: swapped, the pulled
    file had ``weight`` where ``load`` and a safetensors pull have ``bias``; in a set, where no push
    puts one."""
    from ckpt.errors import StoreFormatError
    from ckpt_store.cli.main import main

    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "epoch": 3}, tmp_path / "m.pt")
    store.push(tmp_path / "m.pt", "m")
    ref = _forge(store, "m", forge)
    with pytest.raises(StoreFormatError, match="structure"):
        store.pull(ref, tmp_path / "out.pt")
    with pytest.raises(SystemExit) as e:
        main(["--store", store.url, "pull", ref, str(tmp_path / "cli.pt")])
    err = capsys.readouterr().err.strip()
    assert e.value.code != 0 and "structure" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "cli.pt").exists()


@pytest.mark.parametrize("forge", [
    lambda d: _epoch(d, 4),
    lambda d: d["extra"].__setitem__("epoch", 4),
    lambda d: d["extra"].pop("epoch"),
    lambda d: d["extra"][""]["__dict__"].append(["lr", 0.1]),
    lambda d: d["extra"].__setitem__("lr", 0.1),
    lambda d: _epoch(d, {"__size__": [3]}),
], ids=["structure", "by_name", "name_left_out", "structure_only", "name_only", "other_type"])
def test_a_structure_and_its_values_by_name_that_disagree_are_a_damaged_manifest(store, tmp_path, forge):
    """A structure holds the values ``extra`` holds by flat name: a forged one with an epoch of 4 where the
    name says 3 pulled as a .pt holding 4 while ``extra_values()`` (ckpt show, a safetensors pull) said 3,
    unchecked. Every way of reading must give one answer: the reader refuses such a manifest."""
    from ckpt.errors import StoreFormatError

    model = torch.nn.Linear(2, 2).state_dict()
    saved = {"model": model, "epoch": 3, "shape": torch.Size([2, 2]), "cfg": {"odict": collections.OrderedDict(b=1, a=2), "e": {}},
             "empty": collections.OrderedDict(), "ys": [torch.ones(1), (1, 2.5)], "set": {torch.Size([2]), (1,)}}
    vars(saved["empty"])["note"] = 1
    torch.save(saved, tmp_path / "m.pt")
    store.push(tmp_path / "m.pt", "m")
    assert store.manifest("m").extra_values()["epoch"] == 3  # (the genuine one reads)
    _same_exactly(saved, torch.load(store.pull("m", tmp_path / "back.pt"), weights_only=True))
    assert store.verify().ok
    with pytest.raises(StoreFormatError, match="structure and its value"):
        store.manifest(_forge(store, "m", forge))
    # In version 3 an exact tag's key was a plain dict's, in the structure as by name: they agree.
    torch.save({"cfgs": [1], "model": {"w": torch.ones(2)}}, tmp_path / "v3.pt")
    store.push(tmp_path / "v3.pt", "v3")

    def old(doc: dict) -> None:
        assert doc["version"] == 3
        doc["extra"]["cfgs"] = doc["extra"][""]["cfgs"] = [{"__size__": [1]}, {"__odict__": [[], {}]}]

    assert store.manifest(_forge(store, "v3", old)).extra_values()["cfgs"] == [{"__size__": [1]}, {"__odict__": [[], {}]}]

    def nested(doc: dict) -> None:  # {"x": {"__size__": [1]}}: flattened to x.__size__ by then
        del doc["extra"]["cfgs"], doc["extra"][""]["cfgs"]
        doc["extra"]["x.__size__"], doc["extra"][""]["x"] = [1], {"__size__": [1]}

    assert store.manifest(_forge(store, "v3", nested)).extra_values()["x.__size__"] == [1]


def test_one_object_under_two_keys_pulls_back_as_one_object(store, tmp_path):
    """``{"a": t, "b": t}`` (or one Parameter under two keys) is one object in a .pt: torch.load gives
    ``o["a"] is o["b"]``. It came back as two objects sharing memory (a Parameter twice: two Parameters,
    which an optimizer given both would step twice). The structure marks the very object met before
    (``__shared__`` with ``true``), and the reader gives that object again, after checking it is of the
    same bytes, type and requires_grad: a forged mark never makes two different tensors one."""
    from ckpt.errors import StoreFormatError

    t, p = torch.randn(3), torch.nn.Parameter(torch.randn(2))
    frozen = torch.nn.Parameter(p.detach(), requires_grad=False)
    saved = {"m": {"a": t, "b": t, "p": p, "view": p.detach(), "q": p, "e": [torch.ones(0)] * 2, "frozen": frozen}, "other": t + 1,
             "r": t}
    torch.save(saved, tmp_path / "same.pt")
    store.push(tmp_path / "same.pt", "same")
    want = torch.load(tmp_path / "same.pt", weights_only=True)
    assert want["m"]["a"] is want["m"]["b"] is want["r"] and want["m"]["p"] is want["m"]["q"]
    for got in (torch.load(store.pull("same", tmp_path / "back.pt"), weights_only=True), store.load("same", structure=True)):
        _same_exactly(want, got)
        m = got["m"]
        assert m["a"] is m["b"] is got["r"] and m["p"] is m["q"] and m["e"][0] is m["e"][1]
        assert m["view"] is not m["p"] and _memory(m["view"]) == _memory(m["p"]) and type(m["view"]) is torch.Tensor
        assert got["other"] is not m["a"]
    assert store.verify().ok

    def forge(doc: dict, key: str, name: str) -> None:  # ``key`` said to be the object met by ``name``
        pairs = doc["extra"][""]["m"]["__dict__"]
        at = doc["extra"][""] if key == "other" else next(p for p in pairs if p[0] == key)
        value = at[key] if key == "other" else at[1]
        value = {"__shared__": [value.get("__shared__", [value])[0], name, True]}
        if key == "other":
            at[key] = value
        else:
            at[1] = value

    # other bytes; a Tensor as the Parameter; another requires_grad; one met later; none
    for key, name in (("other", "m.a"), ("view", "m.p"), ("frozen", "m.p"), ("a", "m.b"), ("a", "nope")):
        with pytest.raises(StoreFormatError, match="structure"):
            store.pull(_forge(store, "same", lambda d, key=key, name=name: forge(d, key, name)), tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_a_plain_tensor_that_requires_grad_pulls_back_requiring_it(store, tmp_path):
    """torch.save keeps ``requires_grad`` of a plain tensor (not a Parameter: a learned temperature kept as a
    tensor, an output saved mid-graph); it came back False. The structure marks it
    (``{"__requires_grad__": [ref]}``), checked like the other tags: an integer tensor cannot require grad."""
    from ckpt.errors import StoreFormatError

    w = torch.randn(3, requires_grad=True)
    saved = {"m": {"w": w, "out": w * 2, "again": w, "view": w.detach(), "steps": torch.arange(2)}, "epoch": 1}
    torch.save(saved, tmp_path / "g.pt")
    store.push(tmp_path / "g.pt", "g")
    want = torch.load(tmp_path / "g.pt", weights_only=True)
    assert want["m"]["w"].requires_grad and want["m"]["out"].requires_grad and not want["m"]["view"].requires_grad
    for got in (torch.load(store.pull("g", tmp_path / "back.pt"), weights_only=True), store.load("g", structure=True)):
        _same_exactly(want, got)
        assert got["m"]["again"] is got["m"]["w"] and got["m"]["w"].is_leaf and got["m"]["out"].is_leaf
        assert _memory(got["m"]["view"]) == _memory(got["m"]["w"])
    assert store.verify().ok

    def forge(doc: dict, value: object) -> None:
        pairs = doc["extra"][""]["__dict__"][0][1]["__dict__"]
        next(p for p in pairs if p[0] == "steps")[1] = value

    for bad in ({"__requires_grad__": [{"__tensor__": "m.steps"}]}, {"__requires_grad__": [{"__tensor__": "m.steps"}, True]}):
        with pytest.raises(StoreFormatError, match="structure"):
            store.pull(_forge(store, "g", lambda d, bad=bad: forge(d, bad)), tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_views_at_other_offsets_or_shapes_pull_back_as_views(store, tmp_path):
    """``{"full": x, "half": x[:2]}`` is one storage in a .pt (torch.save writes it once; torch.load gives
    ``half`` as a view into ``full``): it came back as two storages, so a write to one no longer showed in
    the other (a buffer and a slice of it kept in one state). The structure marks a view of a contiguous
    tensor met before (``__view__``: its offset in that tensor, its strides); the reader makes it that view
    again only where it lies within that tensor and has its bytes there: a forged mark never points a
    tensor at other bytes or outside the memory it names."""
    from ckpt.errors import StoreFormatError

    x = torch.arange(12.0).reshape(3, 4)
    saved = {"m": {"full": x, "half": x[:2], "col": x[:, 1], "t": x.t(), "row": torch.nn.Parameter(x[2])}, "alone": torch.arange(4.0)[1:]}
    torch.save(saved, tmp_path / "v.pt")
    store.push(tmp_path / "v.pt", "v")
    want = torch.load(tmp_path / "v.pt", weights_only=True)
    for got in (torch.load(store.pull("v", tmp_path / "back.pt"), weights_only=True), store.load("v", structure=True)):
        _same_exactly(want, got)
        full = got["m"]["full"]
        for k in ("half", "col", "t", "row"):
            w, g = want["m"][k], got["m"][k]
            assert g.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), k
            assert (g.storage_offset(), g.stride()) == (w.storage_offset(), w.stride()), k
        with torch.no_grad():
            full[0, 1] = 99.0
        assert got["m"]["half"][0, 1].item() == got["m"]["col"][0].item() == got["m"]["t"][1, 0].item() == 99.0
    assert store.verify().ok

    def forge(doc: dict, key: str, value: list) -> None:
        pair = next(p for p in doc["extra"][""]["__dict__"][0][1]["__dict__"] if p[0] == key)
        pair[1] = {"__view__": [pair[1]["__view__"][0], *value]}

    for key, value in (("half", ["m.full", 1, [4, 1]]),  # other bytes there
                       ("row", ["m.full", 9, [1]]),  # reaching past the tensor it names
                       ("col", ["m.full", 1, [-4]]), ("col", ["m.full", True, [4]]), ("col", ["m.full", 1, [4, 1]]),
                       ("half", ["m.t", 0, [4, 1]]),  # not contiguous
                       ("half", ["m.row", 0, [4, 1]]), ("half", ["m.half", 0, [4, 1]])):  # met later; itself
        with pytest.raises(StoreFormatError, match="structure"):
            store.pull(_forge(store, "v", lambda d, key=key, value=value: forge(d, key, value)), tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_views_saved_before_their_base_pull_back_as_views(store, tmp_path):
    """``{"wt": w.t(), "w": w}`` (a transposed weight saved before the weight, a slice before its buffer, a
    Parameter over it) is one storage in a .pt: it came back as several, since only a view of a tensor met
    *before* it was marked. The view is marked against the tensor met later (manifest version 5, which a
    version-4 reader refuses instead of calling it damaged), and a reader makes it that view again, after
    checking its bytes there: a forged mark still never points a tensor at other bytes."""
    from ckpt.errors import StoreFormatError

    x = torch.arange(24.0).reshape(4, 6)
    saved = {"m": {"wt": x.t(), "row": x[1], "top": x[:2], "col": x[:, 2], "w": torch.nn.Parameter(x)}, "after": x[3]}
    torch.save(saved, tmp_path / "ahead.pt")
    store.push(tmp_path / "ahead.pt", "ahead")
    assert json.loads(store.objects.get_manifest(store.resolve("ahead")))["version"] == 5
    want = torch.load(tmp_path / "ahead.pt", weights_only=True)
    for got in (torch.load(store.pull("ahead", tmp_path / "back.pt"), weights_only=True), store.load("ahead", structure=True)):
        _same_exactly(want, got)  # (bytes too)
        pairs = [(want["m"][k], got["m"][k]) for k in want["m"]] + [(want["after"], got["after"])]
        for w, g in pairs:
            assert g.untyped_storage().data_ptr() == got["m"]["w"].untyped_storage().data_ptr()
            assert (g.storage_offset(), g.shape, g.stride()) == (w.storage_offset(), w.shape, w.stride())
        with torch.no_grad():
            got["m"]["w"][1, 2] = 99.0
        assert got["m"]["wt"][2, 1].item() == got["m"]["row"][2].item() == got["m"]["col"][1].item() == 99.0
    assert store.verify().ok

    def forge(doc: dict, offset: int) -> None:
        pair = next(p for p in doc["extra"][""]["__dict__"][0][1]["__dict__"] if p[0] == "row")
        pair[1]["__view__"][2] = offset

    with pytest.raises(StoreFormatError, match="structure"):  # other bytes there
        store.pull(_forge(store, "ahead", lambda d: forge(d, 0)), tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("order", ["base first", "base last"])
def test_a_view_met_twice_pulls_back(store, tmp_path, order):
    """A view met twice (one ``w.t()`` under two keys, or two equal ``w.t()``) beside its base: the second is
    marked ``__shared__`` with the first, which the reader had already made a view, not contiguous; it refused
    that as "a bad __shared__ value": the push succeeded and every .pt pull and load(structure=True) of the
    checkpoint failed as damaged. The shared tensor's bytes are compared in its own order."""
    x = torch.arange(12.0).reshape(3, 4)
    wt = x.t()
    views = {"wt": wt, "again": wt, "wt2": x.t()}
    saved = {"w": x, **views} if order == "base first" else {**views, "w": x}
    torch.save(saved, tmp_path / "twice.pt")
    store.push(tmp_path / "twice.pt", "twice")
    want = torch.load(tmp_path / "twice.pt", weights_only=True)
    for got in (torch.load(store.pull("twice", tmp_path / "back.pt"), weights_only=True), store.load("twice", structure=True)):
        _same_exactly(want, got)  # (bytes too)
        assert got["again"] is got["wt"]
        for k in saved:
            assert got[k].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr(), k
            assert (got[k].storage_offset(), got[k].stride()) == (want[k].storage_offset(), want[k].stride()), k
    assert store.verify().ok


def _sharing(d: dict) -> dict:
    """Which tensors of ``d`` share a storage, and each one's place in it: offset from the storage's first tensor
    (the reader keeps a storage from its first piece on), strides and shape."""
    first = {}
    for t in d.values():
        ptr = t.untyped_storage().data_ptr()
        first[ptr] = min(first.get(ptr, t.storage_offset()), t.storage_offset())
    groups = {ptr: sorted(k for k in d if d[k].untyped_storage().data_ptr() == ptr) for ptr in first}
    return {k: (groups[d[k].untyped_storage().data_ptr()], d[k].storage_offset() - first[d[k].untyped_storage().data_ptr()],
                d[k].stride(), d[k].shape) for k in d}


def test_pieces_of_one_storage_without_their_base_pull_back_sharing_it(store, tmp_path):
    """``{"q": w[:2], "k": w[2:4], "v": w[4:]}`` (a fused weight's pieces saved without it; slices that overlap; a
    column beside rows) is one storage in a .pt, but no tensor of it covers the others: each came back in a storage
    of its own. The first piece met now heads a span, the storage the pieces lie in (manifest version 6), and the
    others are views of it (``qt``, a view of the piece met before it, too): torch.load of the pull shares memory as torch.load of the file does, bytes exact. A
    forged span never hands out other bytes: a piece that disagrees with one before it where they overlap, or a
    span mostly no tensor's memory, makes the checkpoint damaged."""
    from ckpt.errors import StoreFormatError

    w = torch.arange(36.0).reshape(6, 6)
    flat = torch.arange(40, dtype=torch.int16)
    saved = {"attn": {"q": w[:2], "qt": w[:2].t(), "k": w[2:4], "v": torch.nn.Parameter(w[4:])}, "col": w[:, 5].t(),
             "lo": flat[:24], "hi": flat[16:], "other": torch.ones(3)}
    torch.save(saved, tmp_path / "pieces.pt")
    store.push(tmp_path / "pieces.pt", "pieces")
    assert json.loads(store.objects.get_manifest(store.resolve("pieces")))["version"] == 6
    want = torch.load(tmp_path / "pieces.pt", weights_only=True)
    flat_want = {**want["attn"], **{k: v for k, v in want.items() if k != "attn"}}
    for got in (torch.load(store.pull("pieces", tmp_path / "back.pt"), weights_only=True), store.load("pieces", structure=True)):
        _same_exactly(want, got)  # (bytes too)
        flat_got = {**got["attn"], **{k: v for k, v in got.items() if k != "attn"}}
        assert _sharing(flat_got) == _sharing(flat_want)
        with torch.no_grad():
            got["attn"]["k"][1, 5] = -1.0
            got["lo"][20] = -1
        assert got["col"][3].item() == -1.0 and got["hi"][4].item() == -1
    assert store.verify().ok

    def forge(doc: dict, key: str, change) -> None:
        pair = next(p for p in doc["extra"][""]["__dict__"] if p[0] == key)
        change(pair[1]["__view__"])

    for key, change in (("hi", lambda v: v.__setitem__(2, 0)),  # overlaps "lo" with other bytes
                        ("lo", lambda v: v.__setitem__(4, 10**6)),  # a span mostly no tensor's memory
                        ("lo", lambda v: v.__setitem__(4, 10)),  # too short for its own tensor
                        ("lo", lambda v: v.__setitem__(1, "hi"))):  # a span naming another tensor
        with pytest.raises(StoreFormatError, match="structure"):
            store.pull(_forge(store, "pieces", lambda d, key=key, change=change: forge(d, key, change)), tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()



@pytest.mark.parametrize("ref,version", [("pieces", 5), ("pieces", 4), ("ahead", 4)])
def test_a_mark_of_a_later_version_is_a_damaged_manifest(store, tmp_path, ref, version):
    """A span (a ``__view__`` of five items, version 6) in a manifest that says version 4 or 5, or a view saved
    before its base (version 5) in one that says 4: no writer of that version made it, and a reader of that version
    refuses it as damaged, but it was decoded as the later mark, and such a checkpoint pulled. It is damaged, said
    when its manifest is read (by any command, as by pull), with nothing written."""
    from ckpt.errors import StoreFormatError

    w = torch.arange(36.0).reshape(6, 6)
    torch.save({"q": w[:2], "k": w[2:4]}, tmp_path / "pieces.pt")
    torch.save({"wt": w.t(), "w": w}, tmp_path / "ahead.pt")
    store.push(tmp_path / f"{ref}.pt", ref)
    assert json.loads(store.objects.get_manifest(store.resolve(ref)))["version"] == (6 if ref == "pieces" else 5)
    forged = _forge(store, ref, lambda d: d.__setitem__("version", version))
    mark = "a span" if ref == "pieces" else "a view saved before its base"
    with pytest.raises(StoreFormatError, match=f"structure holds {mark}.*version {version} does not have"):
        store.pull(forged, tmp_path / "out.pt")
    with pytest.raises(StoreFormatError, match="structure holds"):
        store.manifest(forged)
    assert not (tmp_path / "out.pt").exists()


_SPAN_MEMORY = """
import resource, sys
import ckpt
from ckpt.errors import StoreFormatError
store = ckpt.Store.open(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    store.pull("forged", sys.argv[2])
except StoreFormatError as e:
    print("refused", e, file=sys.stderr)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_forged_span_length_is_refused_before_its_memory_is_taken(store, tmp_path):
    """A span's length is an allocation (its storage, zeros where no piece lies): a forged one of 2**28 int16
    elements (512 MiB, and 256 MiB more for which elements are taken) in a manifest of 80 bytes of tensors was
    allocated, and touched, before the walk's end found it mostly empty. It is refused at the span now, past
    SPAN_SLACK times the bytes of every tensor the manifest holds: the pulling process's peak memory grows by
    far less than the span would take."""
    flat = torch.arange(40, dtype=torch.int16)
    torch.save({"lo": flat[:24], "hi": flat[16:]}, tmp_path / "pieces.pt")
    store.push(tmp_path / "pieces.pt", "pieces")

    def forge(doc: dict) -> None:
        pair = next(p for p in doc["extra"][""]["__dict__"] if p[0] == "lo")
        pair[1]["__view__"][4] = 1 << 28

    _forge(store, "pieces", forge)
    r = subprocess.run([sys.executable, "-c", _SPAN_MEMORY, str(store.url), str(tmp_path / "out.pt")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "refused" in r.stderr and "structure" in r.stderr, r.stderr
    assert int(r.stdout.split()[-1]) < 128, r.stdout  # MiB of peak memory the pull added (the span: 768)
    assert not (tmp_path / "out.pt").exists()

    # Each span within the bound, but every tensor heading one (a review's forgery): the bound is for them all.
    n = 400
    torch.save({"m": {f"t{i}": torch.full((1024,), i % 100, dtype=torch.int8) for i in range(n)}, "epoch": 1},
               tmp_path / "many.pt")
    store.push(tmp_path / "many.pt", "many")

    def spans(doc: dict) -> None:
        doc["version"] = 6
        inner = next(p for p in doc["extra"][""]["__dict__"] if p[0] == "m")[1]["__dict__"]
        for pair in inner:
            pair[1] = {"__view__": [pair[1], pair[1]["__tensor__"], 0, [1], 2 * n * 1024]}

    _forge(store, "many", spans)
    r = subprocess.run([sys.executable, "-c", _SPAN_MEMORY, str(store.url), str(tmp_path / "out.pt")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "refused" in r.stderr, r.stderr
    assert int(r.stdout.split()[-1]) < 128, r.stdout  # (400 spans of 800 KiB and their maps: ~600 MiB before)


def test_a_manifest_of_many_spans_decodes_in_time_linear_in_them(store, tmp_path, monkeypatch):
    """Each span made was checked against the bound on their memory by summing the storages of every span made
    before it: a forged manifest making each of its tensors head a span of its own took time growing with their
    square (8,000 tensors of 4 bytes: 30 s to load, 2.5 s now; 32,000: minutes). The bytes are counted as each span is
    made. Counted here as the storages' numel() calls the load makes: a few per tensor, not one per pair of spans
    (400 tensors: 82,200 before, 2,400 now). What it gives back is each tensor's bytes, each in a storage of its own."""
    n = 400
    saved = {"m": {f"t{i}": torch.full((4,), i % 100, dtype=torch.int8) for i in range(n)}, "epoch": 1}
    torch.save(saved, tmp_path / "many.pt")
    store.push(tmp_path / "many.pt", "many")

    def spans(doc: dict) -> None:
        doc["version"] = 6
        for pair in next(p for p in doc["extra"][""]["__dict__"] if p[0] == "m")[1]["__dict__"]:
            pair[1] = {"__view__": [pair[1], pair[1]["__tensor__"], 0, [1], 4]}

    forged = _forge(store, "many", spans)
    calls = collections.Counter()
    numel = torch.Tensor.numel

    def counted(t: torch.Tensor) -> int:
        calls["numel"] += 1
        return numel(t)

    monkeypatch.setattr(torch.Tensor, "numel", counted)
    got = store.load(forged, structure=True)
    monkeypatch.undo()
    assert calls["numel"] < 20 * n, calls
    _same_exactly(saved, got)
    assert len({t.untyped_storage().data_ptr() for t in got["m"].values()}) == n


@pytest.mark.parametrize("kind", ["columns", "rows"])
def test_more_than_16_views_saved_before_their_base_pull_back_as_views(store, tmp_path, kind):
    """Twenty columns (or rows) of a weight saved before the weight: only the first 16 tensors of a storage met
    before one that covers them were looked up (a flat buffer of many stays linear), so the columns past them came
    back in storages of their own (rows: all twenty, the 16 contiguous tensors a later view is looked up in being
    taken before the weight came). What the walk leaves apart is joined at its end: all share one storage again."""
    x = torch.arange(120.0).reshape(6, 20) if kind == "columns" else torch.arange(120.0).reshape(20, 6)
    saved = {**{f"p{i}": (x[:, i] if kind == "columns" else x[i]) for i in range(20)}, "w": x}
    torch.save(saved, tmp_path / "many.pt")
    store.push(tmp_path / "many.pt", "many")
    want = torch.load(tmp_path / "many.pt", weights_only=True)
    for got in (torch.load(store.pull("many", tmp_path / "back.pt"), weights_only=True), store.load("many", structure=True)):
        _same_exactly(want, got)  # (bytes too)
        assert _sharing(got) == _sharing(want)
        assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    assert store.verify().ok


def test_a_pull_makes_durable_every_folder_it_made_and_every_name_in_them(store, model_dir, tmp_path, monkeypatch):
    """A pulled file is fsynced and so is the folder it lands in; but the folders a pull made on the way
    (``out/new/model``: ``out`` and ``new`` did not exist) are names in their parents, and a directory
    checkpoint's own folders (built under a temporary name, then renamed) hold names of their own: none of
    those folders were fsynced, so a power loss after the pull said done could take them with the files.
    There is no power to cut here: every fsync is recorded by the folder's identity (it may be fsynced
    under its temporary name) and still done; each folder the pull made, and the one above it, must have
    been fsynced."""
    synced: set[tuple[int, int]] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real(fd)

    store.push(str(model_dir), "folder")
    store.push(str(model_dir / "model.safetensors"), "file")
    monkeypatch.setattr(os, "fsync", fsync)
    store.pull("folder", tmp_path / "out" / "new" / "model")
    store.pull("file", tmp_path / "out2" / "deep" / "m.safetensors")
    made = [tmp_path / "out", tmp_path / "out" / "new", tmp_path / "out" / "new" / "model",
            tmp_path / "out" / "new" / "model" / "sub", tmp_path / "out2", tmp_path / "out2" / "deep"]
    for d in [*made, tmp_path]:
        st = os.stat(d)
        assert (st.st_dev, st.st_ino) in synced, f"{d} never fsynced"
    assert _tree(tmp_path / "out" / "new" / "model") == _tree(model_dir)


def test_a_pull_into_a_folder_this_user_may_write_but_not_read_says_it_wrote(store, model_dir, tmp_path, monkeypatch):
    """A drop box (mode 0333) holding the folder a pull makes: the fsync of the drop box, which cannot be opened,
    failed after the file had taken its name, and the pull said "cannot write" of a file it had placed (review
    rev23o). Such a folder is passed over. (Opening it is refused here by the test: root reads any folder.)"""
    import ckpt.store.atomic_files as atomic_files

    drop = tmp_path / "drop"
    drop.mkdir()
    store.push(str(model_dir / "model.safetensors"), "file")
    monkeypatch.setattr(atomic_files.os, "open", opening_refused(drop))
    store.pull("file", drop / "new" / "m.safetensors")
    store.pull("file", drop / "m.safetensors")
    for got in (drop / "new" / "m.safetensors", drop / "m.safetensors"):
        assert got.read_bytes() == (model_dir / "model.safetensors").read_bytes()
