"""Restores that torch's load_state_dict would take silently and wrongly (ckpt/snapshot/restore_checks.py),
and modules with extra state (get_extra_state), restored by a CheckpointManager of one process."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from integration_util import state_bits, tensor_bits

import ckpt
from ckpt.snapshot.manager import SnapshotError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))


def _train(model, opt, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()


def _rewrite_record(store_url, ref, change):
    """Replace the latest snapshot's record by ``change(record)`` (as an older ckpt, which wrote less, left it)."""
    from ckpt_store.storage.commit import commit

    store = ckpt.Store.open(store_url)
    m = store.manifest(ref)
    snap = change(copy.deepcopy(m.extra["snapshot"]))
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), ref)


def test_an_optimizer_over_the_parameters_in_another_order_is_refused_from_either_tier(tmp_path):
    """Two same-shaped weights: an Adam built over them in another order takes the saved moments by position
    (torch checks only the groups' sizes), so each weight would get the other's. The snapshot records each
    group's parameter names and the restore refuses, naming the first that differs, before anything is
    written: from the local tier and from the durable store. The same order restores bit-exact; a snapshot
    without the record restores as before (by position)."""
    model = _model()
    opt = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-2}])
    _train(model, opt)
    store_url, node = str(tmp_path / "s"), str(tmp_path / "node")
    with ckpt.CheckpointManager(store_url, "r", every_n_steps=2, local=node, local_every_n_steps=1) as mgr:
        mgr.save(2, {"model": model, "optim": opt, "loose": torch.nn.Parameter(torch.ones(3))})
    assert ckpt.Store.open(store_url).manifest("r/latest").extra["snapshot"]["params"] == {
        "optim": [["model/0.weight", "model/0.bias"], ["model/2.weight", "model/2.bias"]]}
    for tier in ("local", "store"):
        with ckpt.CheckpointManager(store_url, "r", **({"local": node} if tier == "local" else {})) as mgr:
            model2 = _model()
            swapped = torch.optim.Adam([{"params": [model2[2].weight, model2[0].bias]},
                                        {"params": [model2[0].weight, model2[2].bias], "lr": 1e-2}])
            before = state_bits(model2, swapped)
            with pytest.raises(SnapshotError, match=r"state\['optim'\]: parameter 0 of group 0 is model/2.weight, but the "
                                                    r"snapshot of step 2 holds the state of model/0.weight there"):
                mgr.restore_latest({"model": model2, "optim": swapped, "loose": None})
            assert state_bits(model2, swapped) == before  # nothing written
            model2 = _model()
            same = torch.optim.Adam([{"params": model2[0].parameters()}, {"params": model2[2].parameters(), "lr": 1e-2}])
            assert mgr.restore_latest({"model": model2, "optim": same, "loose": None}) == 2
            assert mgr.last_restore[tier] > 0
            assert state_bits(model2, same) == state_bits(model, opt)
    # the optimizer alone (no module in the state): its parameters have no names, and are not compared
    with ckpt.CheckpointManager(store_url, "r") as mgr:
        alone = torch.optim.Adam([{"params": [torch.zeros(16, 16), torch.zeros(16)]},
                                  {"params": [torch.zeros(16, 16), torch.zeros(16)], "lr": 1e-2}])
        assert mgr.restore_latest({"optim": alone}) == 2
    # written by the ckpt before the record: restored by position, as torch does
    _rewrite_record(store_url, "r/latest", lambda s: {k: v for k, v in s.items() if k != "params"})
    with ckpt.CheckpointManager(store_url, "r") as mgr:
        model2 = _model()
        swapped = torch.optim.Adam([{"params": [model2[2].weight, model2[0].bias]},
                                    {"params": [model2[0].weight, model2[2].bias], "lr": 1e-2}])
        assert mgr.restore_latest({"model": model2, "optim": swapped, "loose": None}) == 2
        assert tensor_bits(swapped.state[model2[2].weight]["exp_avg"]) == tensor_bits(opt.state[model[0].weight]["exp_avg"])
    _rewrite_record(store_url, "r/latest", lambda s: {**s, "params": {"optim": "model/0.weight"}})
    with ckpt.CheckpointManager(store_url, "r") as mgr:
        with pytest.raises(SnapshotError, match="record of its optimizers' parameters is malformed"):
            mgr.restore_latest({"model": _model(), "optim": torch.optim.Adam(_model().parameters())})


def test_a_parameter_in_no_module_is_recorded_by_its_shape():
    from ckpt.snapshot.restore_checks import param_order

    model, loose = _model(), torch.nn.Parameter(torch.zeros(2, 3))
    opt = torch.optim.SGD([loose, *model[0].parameters()], lr=0.1)
    assert param_order({"model": model, "optim": opt}) == {"optim": [["shape [2, 3]", "model/0.weight", "model/0.bias"]]}
    assert param_order({"optim": opt}) == {}


def test_a_scheduler_of_an_optimizer_with_another_number_of_groups_is_refused(tmp_path):
    """A scheduler restored without its optimizer, into one whose optimizer has one parameter group where
    the saved one had two: torch takes the saved base_lrs (two entries) without a word."""
    model = _model()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    _train(model, opt)
    sched.step()
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"sched": sched})
        mgr.wait()
        one = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(_model().parameters(), lr=0.1), step_size=2)
        before = copy.deepcopy(one.state_dict())
        with pytest.raises(SnapshotError, match=r"state\['sched'\]: the snapshot of step 1 holds an LR scheduler of an "
                                                r"optimizer with 2 parameter groups \(base_lrs\); this one's has 1"):
            mgr.restore_latest({"sched": one})
        assert one.state_dict() == before
        model2 = _model()
        two = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(
            [{"params": model2[0].parameters()}, {"params": model2[2].parameters()}], lr=0.1), step_size=2)
        assert mgr.restore_latest({"sched": two}) == 1 and two.state_dict() == sched.state_dict()


def test_a_scheduler_accelerate_wraps_has_its_groups_checked_as_the_one_it_steps(tmp_path):
    """accelerate's AcceleratedScheduler (what a transformers Trainer may hold) is no LRScheduler; its state is
    the wrapped one's: its optimizer's groups are checked as the wrapped scheduler's would be."""
    accelerate_scheduler = pytest.importorskip("accelerate.scheduler")
    model = _model()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}], lr=0.1)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"sched": torch.optim.lr_scheduler.StepLR(opt, step_size=2)})
        mgr.wait()
        one = torch.optim.SGD(_model().parameters(), lr=0.1)
        wrapped = accelerate_scheduler.AcceleratedScheduler(torch.optim.lr_scheduler.StepLR(one, step_size=2), one)
        with pytest.raises(SnapshotError, match=r"optimizer with 2 parameter groups \(base_lrs\); this one's has 1"):
            mgr.restore_latest({"sched": wrapped})
        assert wrapped.scheduler.base_lrs == [0.1]


@pytest.mark.parametrize("saved_enabled", [True, False])
def test_a_grad_scaler_enabled_otherwise_is_refused_before_anything_is_written(tmp_path, saved_enabled):
    """An enabled scaler's state into a disabled one: torch's load_state_dict returns early and the scale is
    dropped. The reverse: torch refuses, but only after the rest of the state had been written. Both refused
    before anything is written; the same kind restores exactly."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=saved_enabled)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"model": model, "optim": opt, "scaler": scaler})
        mgr.wait()
        model2 = _model()
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
        before = state_bits(model2, opt2)
        other = torch.amp.GradScaler("cpu", enabled=not saved_enabled)
        was, now = ("enabled", "disabled") if saved_enabled else ("disabled", "enabled")
        with pytest.raises(SnapshotError, match=rf"state\['scaler'\]: the snapshot of step 1 holds the state of a grad "
                                                rf"scaler that was {was}; this one is {now}"):
            mgr.restore_latest({"model": model2, "optim": opt2, "scaler": other})
        assert state_bits(model2, opt2) == before
        same = torch.amp.GradScaler("cpu", enabled=saved_enabled)
        assert mgr.restore_latest({"model": model2, "optim": opt2, "scaler": same}) == 1
        assert same.state_dict() == scaler.state_dict() and state_bits(model2, opt2) == state_bits(model, opt)


class _WithExtraState(torch.nn.Module):
    """A real module keeping state beside its parameters and buffers through get_extra_state/set_extra_state."""

    def __init__(self, extra):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.extra = extra

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_a_module_with_extra_state_restores_exactly_from_either_tier(tmp_path):
    """The one-process restore compared the module's state_dict() keys with the snapshot's tensors alone: a
    module whose extra state is a plain value was refused ("not in snapshot ['m/_extra_state']", though the
    snapshot holds it). Its state is now loaded through the module's load_state_dict (set_extra_state):
    a plain value, a tensor, and a dict holding both, bit-exact."""
    torch.manual_seed(1)
    extras = {"plain": {"tokens_seen": 12345, "name": "x", "pair": (1, 2.5)}, "tensor": torch.randn(5, dtype=torch.float64),
              "both": {"t": torch.arange(6, dtype=torch.int32), "n": 3}}
    mods = {k: _WithExtraState(v) for k, v in extras.items()}
    store_url, node = str(tmp_path / "s"), str(tmp_path / "node")
    with ckpt.CheckpointManager(store_url, "r", every_n_steps=2, local=node, local_every_n_steps=1) as mgr:
        mgr.save(2, dict(mods))
    for tier in ("local", "store"):
        with ckpt.CheckpointManager(store_url, "r", **({"local": node} if tier == "local" else {})) as mgr:
            torch.manual_seed(2)
            fresh = {"plain": _WithExtraState({"tokens_seen": 0}), "tensor": _WithExtraState(torch.zeros(5, dtype=torch.float64)),
                     "both": _WithExtraState({"t": torch.zeros(6, dtype=torch.int32), "n": 0})}
            assert mgr.restore_latest(fresh) == 2 and mgr.last_restore[tier] > 0
            for k, m in fresh.items():
                assert {n: tensor_bits(t) for n, t in m.lin.state_dict().items()} == \
                       {n: tensor_bits(t) for n, t in mods[k].lin.state_dict().items()}
            assert fresh["plain"].extra == extras["plain"]
            assert tensor_bits(fresh["tensor"].extra) == tensor_bits(extras["tensor"])
            assert fresh["tensor"].extra.dtype == torch.float64
            assert fresh["both"].extra["n"] == 3 and tensor_bits(fresh["both"].extra["t"]) == tensor_bits(extras["both"]["t"])
    # a module without the extra state the snapshot holds (or the reverse) is still refused
    with ckpt.CheckpointManager(store_url, "r") as mgr:
        plain = torch.nn.Module()
        plain.lin = torch.nn.Linear(8, 8)
        with pytest.raises(ckpt.errors.TensorMismatchError, match=r"not in module \['plain/_extra_state'\]"):
            mgr.restore_latest({"plain": plain})


def test_a_parameter_tied_between_two_modules_answers_to_either_name():
    """A weight tied between two modules of the state (an embedding and its output head) was recorded by its
    first name in the state's order, and a restore naming it otherwise was refused though its order is right:
    the state's keys in another order, or only the head restored with the optimizer."""
    from ckpt.snapshot.restore_checks import check_param_order, param_order

    embed, head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
    head.weight = embed.weight
    opt = torch.optim.Adam([embed.weight], lr=0.1)
    snap = {"params": param_order({"model": embed, "head": head, "optim": opt})}
    assert snap["params"] == {"optim": [["model/weight"]]}
    mid = "0" * 64
    check_param_order(snap, {"head": head, "model": embed, "optim": opt}, mid, 1)
    check_param_order(snap, {"head": head, "optim": opt}, mid, 1)
    other = torch.nn.Linear(4, 8, bias=False)  # the same shape, not tied: refused while "model" is restored
    with pytest.raises(SnapshotError, match="parameter 0 of group 0 is head2/weight"):
        check_param_order(snap, {"model": embed, "head2": other, "optim": torch.optim.Adam(other.parameters())}, mid, 1)
