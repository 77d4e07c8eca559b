"""held_in: the modules and optimizers a save trusts by version, found in Stateful wrappers without running their code.

(Saves through wrappers, bytes compared: tests/ckpt/snapshot/test_manager.py.)"""

from __future__ import annotations

import torch

import ckpt
from ckpt.snapshot.held import held_in
from ckpt.snapshot.state import PerRank, flatten


class _Odd:
    """A Stateful wrapper with attributes that code reading them carelessly trips over."""

    calls = 0

    def __init__(self, model, optim) -> None:
        self.me = self  # a cycle
        self.loop = []
        self.loop.append(self.loop)  # a list holding itself
        self.huge = list(range(1_000_000)) + [torch.nn.Linear(2, 2)]  # (past what is looked at: not found)
        self.module_namespace = torch  # a Python module: not looked into
        self.cls = torch.nn.Linear  # a class
        self.parts = {"model": model, "nested": (self,)}
        self.optim = optim

    @property
    def broken(self):
        _Odd.calls += 1
        raise RuntimeError("a property a save must not call")

    def __getattr__(self, name):
        _Odd.calls += 1  # (what held_in must not call; the save asks the state's values for a "scheduler")
        raise AttributeError(name)

    def state_dict(self):
        return {"model": self.parts["model"].state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, sd):
        self.parts["model"].load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])


class _MadeUpDict:
    """A class whose ``__dict__`` is a property of its own: not looked into."""

    def __init__(self, model) -> None:
        object.__setattr__(self, "model", model)

    @property
    def __dict__(self):
        _Odd.calls += 1
        raise RuntimeError("a made-up __dict__ a save must not call")


class _Slots:
    __slots__ = ("model",)

    def __init__(self, model) -> None:
        self.model = model


def test_held_in_reads_a_wrappers_attributes_without_running_its_code(tmp_path):
    """held_in (the modules and optimizers whose parameters a save trusts by version) looks into a wrapper's instance
    attributes as stored: a property that raises, or __getattr__, is never called, a cycle ends, a huge list is read up
    to a bound (a module past it goes unfound, read at every save: safe), a module namespace, a class, a made-up
    __dict__ and a slots object are left alone. A manager saves through the wrapper and a fresh one restores its bytes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    odd = _Odd(model, optim)
    odd.made_up, odd.slots = _MadeUpDict(torch.nn.Linear(3, 3)), _Slots(torch.nn.Linear(3, 3))
    _Odd.calls = 0
    modules, optimizers = held_in({"odd": odd, "rank": PerRank(odd), "n": 3})
    assert (modules, optimizers, _Odd.calls) == ([model], [optim], 0)
    with ckpt.CheckpointManager(str(tmp_path), "run", save_mode="sync") as mgr:
        for step in (1, 2):
            model(torch.randn(2, 4)).square().mean().backward()
            optim.step()
            optim.zero_grad()
            mgr.save(step, {"odd": odd})
    want = {n: t.numpy().tobytes() for n, t in flatten({"odd": odd})[0].items()}
    fresh_model = torch.nn.Linear(4, 4)
    fresh = _Odd(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=0.1))
    with ckpt.CheckpointManager(str(tmp_path), "run") as mgr:
        assert mgr.restore_latest({"odd": fresh}) == 2
    assert {n: t.numpy().tobytes() for n, t in flatten({"odd": fresh})[0].items()} == want
