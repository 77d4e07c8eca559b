"""A stored tensor becomes a tensor only as its file's stored header says (ckpt/store/load.py's ``fill``).

The manifest names each tensor's dtype and shape; the stored safetensors header (chunks named by their
hash) says them too. A forged or damaged manifest that gives an fp32 tensor's bytes as fp16 (same byte
count, another shape) made load, the lazy reader, load_into, a pull to a torch file and a snapshot's
restore hand out (or write into a model) the right bytes as the wrong tensor; only ``verify`` noticed.
"""

from __future__ import annotations

import json

import pytest
import torch

import ckpt
from ckpt_store.storage.errors import StoreFormatError


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _forge(store, ref: str, change, name: str = "forged") -> str:
    """A copy of ``ref``'s manifest with ``change(doc)`` applied, stored (under its own id) and named ``name``."""
    doc = json.loads(store.objects.get_manifest(store.resolve(ref)))
    change(doc)
    store.refs_db.set(name, store.objects.put_manifest(json.dumps(doc).encode()))
    return name


def _as_half(doc: dict, name: str = "w") -> None:
    """Tensor ``name`` (fp32 [4, 4]) said to be fp16 [8, 4]: the same 64 bytes, another tensor."""
    t = next(t for t in doc["tensors"] if t["name"] == name)
    t["dtype"], t["shape"] = "F16", [8, 4]


# (a shape alone: the same dtype and bytes, other rows; and a dtype alone: the same shape, other bytes per element
#  are refused by the manifest's own check of nbytes, so a forged dtype comes with a shape that fits)
@pytest.mark.parametrize("change", [_as_half, lambda d: next(t for t in d["tensors"] if t["name"] == "w").update(shape=[2, 8])],
                         ids=["dtype", "shape"])
def test_a_manifest_that_retypes_a_tensor_is_refused_by_every_reader(store, tmp_path, change):
    """Every path from stored bytes to a tensor refuses the forged entry, naming the tensor, and leaves
    what it would write (a model's tensors, a destination file) as it was."""
    torch.save({"w": torch.randn(4, 4), "b": torch.randn(4)}, tmp_path / "m.pt")
    store.push(str(tmp_path / "m.pt"), "m")
    forged = _forge(store, "m", change)
    t = next(t for t in store.manifest(forged).tensors if t.name == "w")
    shape, dtype = t.shape, {"F16": torch.float16, "F32": torch.float32}[t.dtype]

    with pytest.raises(StoreFormatError, match="place tensor w where the manifest does"):
        store.load(forged)
    with pytest.raises(StoreFormatError, match="place tensor w where the manifest does"):
        store.reader(forged).get_tensor("w")
    reader = store.reader(forged)  # refused again on a second read: a refusal does not count as checked
    for _ in range(2):
        with pytest.raises(StoreFormatError, match="place tensor w"):
            reader.get_tensor("b")
    # a contiguous target is written in place, a strided one (as a GPU one) through staging buffers: neither is
    for w in (torch.full(shape, 7, dtype=dtype), torch.full(shape[::-1], 7, dtype=dtype).t()):
        target = {"w": w, "b": torch.full((4,), 7.0)}
        before = {k: _bits(v) for k, v in target.items()}
        with pytest.raises(StoreFormatError, match="place tensor w where the manifest does"):
            store.load_into(forged, target)
        assert {k: _bits(v) for k, v in target.items()} == before  # nothing written into the model
    for dest, kw in ((tmp_path / "out.pt", {}), (tmp_path / "sel.safetensors", {"include": ["w"]}),
                     (tmp_path / "sel.pt", {"include": ["*"]})):
        with pytest.raises(StoreFormatError, match="place tensor w where the manifest does"):
            store.pull(forged, dest, **kw)
        assert not dest.exists()
    report = store.verify([forged])
    assert not report.ok
    # the checkpoint as pushed loads as before
    assert torch.equal(store.load("m")["w"], torch.load(tmp_path / "m.pt", weights_only=True)["w"])


def test_a_forged_snapshot_is_refused_before_the_model_is_touched(tmp_path):
    """A snapshot's restore fills the model's own tensors in place: a manifest saying fp16 [8, 4] where
    an fp32 [4, 4] weight was saved filled a model of that shape with the fp32 bytes. Refused now,
    before any of them is written."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    src = {"w": torch.nn.Parameter(torch.randn(4, 4)), "b": torch.nn.Parameter(torch.randn(4))}
    with ckpt.CheckpointManager(store, "run", save_mode="sync") as mgr:
        mgr.save(1, {"model": torch.nn.ParameterDict(src)})
    _forge(store, "run/step-1", lambda d: _as_half(d, "model/w"), name="run/step-1")
    store.refs_db.set("run/latest", store.resolve("run/step-1"))
    model = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.full((8, 4), 7, dtype=torch.float16)),
                                    "b": torch.nn.Parameter(torch.full((4,), 7.0))})
    before = {k: _bits(v.detach()) for k, v in model.items()}
    with ckpt.CheckpointManager(store, "run") as mgr, pytest.raises(StoreFormatError, match="place tensor model/w") as e:
        mgr.restore_latest({"model": model})
    assert {k: _bits(v.detach()) for k, v in model.items()} == before
    # the refusal names the snapshot (it read "checkpoint: the stored header of ...", naming none)
    assert str(e.value).startswith(f"snapshot {store.resolve('run/latest')[:12]}: ")


def test_the_header_check_costs_a_load_no_request_of_its_own(s3_main_url, tmp_path):
    """Over S3 a load reads each stored header in the same pass as its tensors (from the checkpoint's
    bundle, with the other small chunks): as many GETs as a pull of the same file, which writes the
    header and so reads it too. load_into reads the headers first (before it writes into the model):
    one GET more, whatever the number of tensors."""
    from s3support import chunk_gets

    from ckpt.settings import Settings

    store = ckpt.Store.init(s3_main_url, settings=Settings.from_env(cache=False, chunk_size=1 << 16))
    sd = {f"layer{i}.{k}": torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(8)
          for k, n in (("weight", 40_000), ("bias", 100))}  # 8 weights of 3 chunks, 8 small biases (a bundle with the header)
    store.push(sd, "m")
    gets = chunk_gets(store)

    def count(op) -> int:
        gets[0] = 0
        op()
        return gets[0]

    pulled = count(lambda: store.pull("m", tmp_path / "m.safetensors"))
    loaded = count(lambda: store.load("m"))
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    filled = count(lambda: store.load_into("m", target))
    assert all(torch.equal(target[k], v) for k, v in sd.items())
    assert loaded == pulled, (loaded, pulled)
    assert filled == pulled + 1, (filled, pulled)


def test_diff_and_merge_read_a_tensor_as_its_stored_header_says(store, tmp_path):
    """A diff and a merge take dtypes and shapes from the lazy reader: a forged entry made a diff report an
    fp16 tensor of other values, and a merge of two such inputs stored a new checkpoint whose own header
    agreed with the forgery (laundered: verify called it sound). Both refuse it, naming the tensor, and
    the merge stores nothing."""
    for i in range(2):
        store.push({"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(i)), "b": torch.zeros(4)}, f"m{i}")
        _forge(store, f"m{i}", _as_half, name=f"f{i}")
    with pytest.raises(StoreFormatError, match="place tensor w where the manifest does"):
        ckpt.diff("f0", "m1", store=store)
    with pytest.raises(StoreFormatError, match="place tensor w where the manifest does"):
        ckpt.merge(["f0", "f1"], "linear", name="merged", store=store)
    assert "merged" not in store.refs()
    assert ckpt.diff("m0", "m1", store=store) is not None


def test_a_manifest_whose_header_size_is_forged_is_refused_before_a_buffer_is_made(store, tmp_path):
    """A reader holds a file's stored header whole before it checks an entry against it: a manifest of a
    few hundred bytes saying the header is 64 GiB (and the chunk size 1 TiB, so one chunk covers it)
    made load, load_into and the reader allocate it (a MemoryError, not a ckpt error; near the RAM,
    the process killed). The manifest is refused on read, as safetensors refuses such a header."""
    from safetensors.torch import save_file

    save_file({"w": torch.randn(4, 4), "b": torch.randn(4)}, str(tmp_path / "m.safetensors"))
    store.push(str(tmp_path / "m.safetensors"), "m")

    def huge_header(doc: dict) -> None:
        f = doc["files"][0]
        assert len(f["chunks"]) == 1
        doc["chunk_size"] = 1 << 40
        f["size"] += (1 << 36) - f["head_size"]
        f["head_size"] = 1 << 36

    forged = _forge(store, "m", huge_header)
    for read in (lambda: store.load(forged), lambda: store.reader(forged).get_tensor("w"),
                 lambda: store.load_into(forged, {"w": torch.zeros(4, 4), "b": torch.zeros(4)})):
        with pytest.raises(StoreFormatError, match="a safetensors header of 68719476736 bytes"):
            read()
