"""CUDA paths of the training-loop manager: pinned staging on a side stream, restore onto
the device. They run where a GPU is present and are skipped cleanly where it is not."""

from __future__ import annotations

import pytest
import torch
from integration_util import state_bits as _state_bits

import ckpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _step(model, opt):
    loss = model(torch.randn(64, 256, device="cuda")).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("overlap", [False, True], ids=["copy", "overlap_copy"])
def test_cuda_snapshot_is_the_state_at_save_while_training_goes_on(tmp_path, overlap):
    model, opt = _setup()
    _step(model, opt)
    want = _state_bits(model, opt)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "gpu", save_mode="overlap" if overlap else "async") as mgr:
        mgr.save(1, {"model": model, "optim": opt})
        for _ in range(3):  # queued on the device right behind the copy
            _step(model, opt)
        mgr.wait()
        assert all(b.is_pinned() for b in mgr._path._staging.values())
        assert _state_bits(model, opt) != want
        fresh, fresh_opt = _setup()
        _step(fresh, fresh_opt)  # the optimizer has state tensors on the device to restore into
        assert mgr.restore_latest({"model": fresh, "optim": fresh_opt}) == 1
    assert fresh[0].weight.is_cuda
    assert _state_bits(fresh, fresh_opt) == want


def test_load_into_device_tensors_through_pinned_buffers_in_groups(tmp_path):
    """Store.load_into a model on the GPU (on two GPUs where there are two, as a model spread over
    devices is): through pinned host buffers of at most CKPT_INFLIGHT_MB, reused group after group
    once the copies from them are done; bit for bit."""
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 18, generator=g) for i in range(12)}  # 1 MiB each
    store = ckpt.Store.init(str(tmp_path / "s"), settings=ckpt.Settings.from_env(inflight_mb=2))
    store.push(state, "m")
    devices = [torch.device("cuda", i % torch.cuda.device_count()) for i in range(len(state))]
    target = {k: torch.empty_like(v, device=d) for (k, v), d in zip(state.items(), devices)}
    store.load_into("m", target)
    torch.cuda.synchronize()
    assert all(target[k].cpu().numpy().tobytes() == v.numpy().tobytes() for k, v in state.items())


def test_plain_value_tensors_come_back_on_their_device(tmp_path):
    """A tensor in the state that is not a module's (a plain value, or one a Stateful hands out and that the
    restore cannot write in place) came back on the CPU: its device is recorded and it is made there."""

    class Holder:
        def __init__(self, t):
            self.t = t

        def state_dict(self):
            return {"t": self.t}

        def load_state_dict(self, sd):
            self.t = sd["t"]

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    g = torch.Generator().manual_seed(0)
    value, held = torch.randn(5, generator=g).to(device), torch.randn(3, generator=g).to(device)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "cuda", save_mode="sync") as mgr:
        mgr.save(1, {"value": {"v": value}, "holder": Holder(held)})
        into = Holder(None)
        state = {"value": None, "holder": into}
        assert mgr.restore_latest(state) == 1
    assert state["value"]["v"].device == device and into.t.device == device
    assert state["value"]["v"].cpu().numpy().tobytes() == value.cpu().numpy().tobytes()
    assert into.t.cpu().numpy().tobytes() == held.cpu().numpy().tobytes()
