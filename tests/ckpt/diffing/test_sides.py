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
