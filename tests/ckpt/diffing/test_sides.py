"""The sides ``ckpt diff`` compares (ckpt/diffing/sides.py): one tensor per name, or a clear refusal."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ckpt.diffing.compare import diff
from ckpt.errors import TensorMismatchError


def test_a_side_with_one_tensor_name_in_two_files_is_refused_not_half_compared(store, tmp_path):
    d = tmp_path / "dup"
    d.mkdir()
    save_file({"x": torch.zeros(4)}, d / "a.safetensors")
    save_file({"x": torch.ones(8)}, d / "b.safetensors")
    store.push(d, "dup")
    save_file({"x": torch.zeros(4)}, tmp_path / "one.safetensors")
    for a, b in (("dup", str(tmp_path / "one.safetensors")), (str(tmp_path / "one.safetensors"), str(d))):
        with pytest.raises(TensorMismatchError, match="'x' appears in two files .*a.safetensors and b.safetensors") as e:
            diff(a, b, store)
        assert "one by one" in (e.value.hint or "")


def test_refs_only_never_opens_a_file(store, tmp_path, monkeypatch):
    """For untrusted input (the web view's URLs): a string is a ref even where a file of that name exists."""
    from ckpt.errors import InvalidNameError, InvalidSourceError, RefNotFoundError

    store.push({"w": torch.zeros(4)}, "m/a")
    save_file({"w": torch.ones(4)}, tmp_path / "m.safetensors")
    monkeypatch.chdir(tmp_path)
    assert diff("m/a", "m.safetensors", store).summary.changed == 1  # the CLI's rule: an existing path wins
    for other in ("m.safetensors", str(tmp_path / "m.safetensors"), "/etc/passwd"):
        with pytest.raises((RefNotFoundError, InvalidNameError)):
            diff("m/a", other, store, refs_only=True)
    with pytest.raises(InvalidSourceError, match="only refs"):
        diff("m/a", {"w": torch.ones(4)}, store, refs_only=True)
    assert diff("m/a", "m/a", store, refs_only=True).summary.identical == 1


def test_a_ref_named_like_a_weights_file_is_the_ref(store, tmp_path, monkeypatch):
    """`ckpt push best.ckpt run/best.ckpt` makes a ref diff could not name: a string ending in .pt,
    .ckpt... that was no existing path was read as a missing file ('no such file or directory'),
    though pull, show and load take the ref. It is the ref now; an existing path still wins, and a
    name that is neither is still 'no such file'."""
    from ckpt.errors import InvalidSourceError

    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.zeros(4)}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(4)}, tmp_path / "b.ckpt")
    store.push(tmp_path / "a.pt", "run/a.pt")
    store.push(tmp_path / "b.ckpt", "run/b.ckpt")
    r = diff("run/a.pt", "run/b.ckpt", store)
    assert (r.a_id, r.b_id) == (store.resolve("run/a.pt"), store.resolve("run/b.ckpt"))
    assert r.summary.changed == 1
    assert diff("run/a.pt", "a.pt", store).summary.identical == 1
    with pytest.raises(InvalidSourceError, match="no such file"):
        diff("run/a.pt", "run/c.pt", store)


def test_a_pipeline_folder_is_compared_model_by_model(store, tmp_path):
    """A diffusers pipeline: unet/, text_encoder/ and vae/ each a model, sharing names ('w'). diff
    refused it ('w' appears in two files), so two fine-tunes of one pipeline could not be compared
    at all. Where a side's folders share names its tensors are named FOLDER/NAME, each paired with
    the same model's in the other side; stored or on disk alike."""
    for name, scale in (("a", 1.0), ("b", 2.0)):
        for part, n in (("unet", 3), ("text_encoder", 2), ("vae", 4)):
            (tmp_path / name / part).mkdir(parents=True)
            w = torch.arange(n, dtype=torch.float32) * (scale if part == "unet" else 1.0)
            save_file({"w": w, "b": torch.ones(n)}, tmp_path / name / part / "diffusion_pytorch_model.safetensors")
        (tmp_path / name / "model_index.json").write_text("{}")
        store.push(tmp_path / name, f"sd/{name}")
    for a, b in (("sd/a", "sd/b"), (str(tmp_path / "a"), "sd/b"), ("sd/a", str(tmp_path / "b"))):
        r = diff(a, b, store)
        rows = {t.name: t.status for t in r.tensors}
        assert rows == {"text_encoder/b": "identical", "text_encoder/w": "identical", "unet/b": "identical",
                        "unet/w": "changed", "vae/b": "identical", "vae/w": "identical"}, (a, b)
        assert r.summary.changed_elements == 2  # unet/w: [0, 1, 2] -> [0, 2, 4]
    assert [t.name for t in diff("sd/a", "sd/b", store, include=["unet/*"]).tensors] == ["unet/b", "unet/w"]
    single = tmp_path / "unet-only"  # one model: names as they are
    single.mkdir()
    save_file({"w": torch.zeros(3)}, single / "model.safetensors")
    assert [t.name for t in diff(str(single), str(single), store).tensors] == ["w"]
    apart = tmp_path / "apart"  # folders whose names differ (most real pipelines): paired as they always were
    for part, name in (("unet", "conv_in.weight"), ("vae", "encoder.conv_in.weight")):
        (apart / part).mkdir(parents=True)
        save_file({name: torch.zeros(2)}, apart / part / "diffusion_pytorch_model.safetensors")
    assert [t.name for t in diff(str(apart), str(apart), store).tensors] == ["conv_in.weight", "encoder.conv_in.weight"]
