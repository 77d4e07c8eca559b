from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ckpt.errors import InvalidNameError, InvalidSourceError
from ckpt.snapshot.state import PerRank, RNGState, flatten, is_per_rank, tensor_refs, unflatten
from ckpt_store.storage.records import canonical_json


def _roundtrip(obj):
    tensors, tree = flatten({"x": obj})
    tree = __import__("json").loads(canonical_json(tree))  # really through JSON
    return unflatten(tree["x"]["value"], tensors), tensors, tree


@pytest.mark.parametrize("value", [
    {"a": 1, "b": [1, 2.5, "s", None, True]},
    {"t": (1, (2, 3)), 3: "int key", (1, 2): "tuple key"},
    {"inf": math.inf, "ninf": -math.inf, "b": b"\x00\xff"},
    [],
    {"__tuple__": "a key that looks like a tag"},
])
def test_values_roundtrip_exactly(value):
    assert _roundtrip(value)[0] == value


def test_nan_roundtrips():
    assert math.isnan(_roundtrip(float("nan"))[0])


def test_stateful_objects_roundtrip():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    state = {"model": model, "optim": opt, "sched": sched, "scaler": scaler}
    tensors, tree = flatten(state)
    assert set(tensor_refs(tree)) == set(tensors)
    assert "optim/state/0/exp_avg" in tensors
    for key, obj in state.items():
        restored = unflatten(tree[key]["value"], tensors)
        original = obj.state_dict()
        assert restored.keys() == original.keys()
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    opt2.load_state_dict(unflatten(tree["optim"]["value"], tensors))
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]  # betas moved by OneCycleLR


def test_rng_state_restores_every_generator():
    import random

    rng = RNGState()
    saved = rng.state_dict()
    tensors, tree = flatten({"rng": rng})
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    rng.load_state_dict(unflatten(tree["rng"]["value"], tensors))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
    assert saved["numpy"]["keys"].dtype == torch.uint32


def test_unstorable_values_are_refused():
    with pytest.raises(InvalidSourceError, match="object"):
        flatten({"x": {"f": object()}})
    with pytest.raises(InvalidNameError):
        flatten({"a/b": 1})


class _Position:
    def __init__(self, batch: int = 0) -> None:
        self.batch, self.order = batch, torch.arange(4)

    def state_dict(self):
        return {"batch": self.batch, "order": self.order}

    def load_state_dict(self, sd):
        self.batch, self.order = sd["batch"], sd["order"]


def test_per_rank_marks_state_and_is_the_object_itself_in_one_process(tmp_path):
    """Distributed snapshots keep RNGState and PerRank(...) once per rank (tests/ckpt/dcp/test_dcp.py);
    a single-process manager saves and restores the wrapped object as it is."""
    import ckpt

    assert is_per_rank(RNGState()) and is_per_rank(PerRank(_Position()))
    assert not is_per_rank(_Position()) and not is_per_rank(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="state_dict"):
        PerRank(3)
    pos = _Position(7)
    pos.order = torch.tensor([3, 1, 2, 0])
    with ckpt.CheckpointManager(str(tmp_path / "s"), "p", save_mode="sync") as mgr:
        mgr.save(1, {"pos": PerRank(pos)})
        back = _Position()
        assert mgr.restore_latest({"pos": PerRank(back)}) == 1
    assert back.batch == 7 and back.order.tolist() == [3, 1, 2, 0]


def _cuda_state(seed: int, offset: int) -> torch.Tensor:
    """A CUDA generator's state as torch records it: seed and Philox offset, 8 bytes each."""
    return torch.tensor(list(seed.to_bytes(8, "little") + offset.to_bytes(8, "little")), dtype=torch.uint8)


@pytest.mark.parametrize("offsets", [(0, 0), (64, 0), (0, 128)], ids=["unused", "gpu0-drawn", "gpu1-drawn"])
def test_rng_state_of_a_machine_with_more_gpus(tmp_path, monkeypatch, offsets):
    """A snapshot saved on a machine with two GPUs, restored on one with fewer (here none: the count is what
    matters). torch's set_rng_state_all raised a raw error for a device it lacks, and with no GPU the CUDA
    states were skipped without a word, also where a generator had been drawn from (the run cannot go on here
    as it would have). A generator never drawn from is left out (the resume is exact); one that was is refused
    with a SnapshotError, before any generator is set."""
    import ckpt
    from ckpt.snapshot.manager import SnapshotError

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= 2:
        pytest.skip("needs a machine with fewer than 2 GPUs")
    torch.manual_seed(5)
    with monkeypatch.context() as m:  # the save of the two-GPU machine
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "get_rng_state_all", lambda: [_cuda_state(5, o) for o in offsets])
        with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
            mgr.save(1, {"rng": RNGState()})
    want = torch.rand(3)
    torch.manual_seed(6)
    before = torch.get_rng_state()
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        if any(offsets[have:]):
            with pytest.raises(SnapshotError, match="machine with 2 GPUs, whose generator on GPU [01] had been drawn "
                                                    "from; this one has") as e:
                mgr.restore_latest({"rng": RNGState()})
            assert "without its RNGState" in e.value.hint
            assert torch.equal(torch.get_rng_state(), before)  # no generator was set
        else:
            assert mgr.restore_latest({"rng": RNGState()}) == 1
            assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("damage", ["python", "numpy-kind", "numpy-missing", "torch", "not-a-record"])
def test_a_damaged_rng_state_is_refused_and_sets_no_generator(damage):
    """An RNG state read from a store is outside data: a damaged one raised raw ValueError, KeyError or
    AttributeError from random/NumPy/torch, after setting the generators before it (Python's set, NumPy's
    not). SnapshotError, and every generator as it was."""
    import random

    from ckpt.snapshot.manager import SnapshotError

    tensors, tree = flatten({"rng": RNGState()})
    state = unflatten(tree["rng"]["value"], tensors)
    if damage == "python":
        state["python"] = (1, (2,), None)
    elif damage == "numpy-kind":
        state["numpy"]["kind"] = "PCG64"
    elif damage == "numpy-missing":
        del state["numpy"]
    elif damage == "torch":
        state["torch"] = state["torch"][:100]
    else:
        state = [state]
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    before = (random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state())
    with pytest.raises(SnapshotError, match="RNG state is malformed"):
        RNGState().load_state_dict(state)
    assert random.getstate() == before[0] and np.random.get_state()[1].tobytes() == before[1]
    assert torch.equal(torch.get_rng_state(), before[2])
