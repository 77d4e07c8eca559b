"""Checks a snapshot restore makes, before anything is written, where torch's ``load_state_dict`` would
take a state that does not fit without a word: an optimizer or LR scheduler of another class, an
optimizer over the same parameters in another order (its per-parameter state is matched by position),
an LR scheduler of an optimizer with another number of parameter groups, a grad scaler's state
restored into one enabled otherwise.

The first two need records written at save (:func:`snapshot_records`: ``"classes"`` and ``"params"`` in
the snapshot's record, checked by :func:`check_records`); the others read the saved state's structure
(plain values), which both restore paths have (:func:`check_saved_state`)."""

from __future__ import annotations

from typing import Any

from ckpt.snapshot.state import optimizers_by_key


def snapshot_records(state: dict[str, Any]) -> dict[str, Any]:
    """What a snapshot of ``state`` records for :func:`check_records`: ``"classes"`` (always, ``{}`` with
    neither an optimizer nor a scheduler) and ``"params"`` (where ``state`` holds a module and an optimizer)."""
    order = param_order(state)
    return {"classes": recorded_classes(state), **({"params": order} if order else {})}


def check_records(snap: dict[str, Any], state: dict[str, Any], mid: str, step: int) -> None:
    """Refuse a restore of ``state`` that the snapshot's records (:func:`snapshot_records`) do not fit: an
    object of another class (:func:`check_classes`), an optimizer's parameters in another order
    (:func:`check_param_order`)."""
    check_classes(snap, state, mid, step)
    check_param_order(snap, state, mid, step)


def param_order(state: dict[str, Any]) -> dict[str, list[list[str]]]:
    """What a snapshot records (``"params"``) of the order of each optimizer's parameters, where ``state``
    holds a module and an optimizer: per parameter group, each parameter's name (``<key>/<name>``, found by
    identity among the state's modules' ``named_parameters()``), or ``shape [4, 4]`` for one in no module.
    Empty without a module or an optimizer."""
    named = _named(state)
    return {key: [[names[0] for names in group] for group in groups] for key, groups in named.items()}


def _named(state: dict[str, Any]) -> dict[str, list[list[list[str]]]]:
    """Each optimizer's (by key) parameters, per group, each with every name it has in the state's modules
    (a parameter tied between two has two; the first in the state's order is the one recorded), or its
    shape (``shape [4, 4]``) where it is in none. Empty without a module or an optimizer."""
    import torch

    modules = {k: o for k, o in state.items() if isinstance(o, torch.nn.Module)}
    optimizers = optimizers_by_key(state)
    if not modules or not optimizers:
        return {}
    names: dict[int, list[str]] = {}  # (walked once, however many groups)
    for key, module in modules.items():
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(f"{key}/{name}")
    return {key: [[names.get(id(p)) or [f"shape {list(p.shape)}"] for p in g["params"]] for g in opt.param_groups]
            for key, opt in optimizers.items()}


def check_param_order(snap: dict[str, Any], state: dict[str, Any], mid: str, step: int) -> None:
    """Refuse an optimizer of ``state`` whose parameters come in another order than those the snapshot
    ``mid`` (of ``step``; ``snap``: its record) recorded under its key (:func:`param_order`): torch matches
    the saved per-parameter state (Adam's moments) by position and checks only the groups' sizes, so two
    same-shaped weights would swap their state. A parameter named on one side and in no module on the other
    (a restore without the module), or named from a module not restored now, is not compared. Snapshots without
    the record are not checked."""
    from ckpt.snapshot.run import SnapshotError

    recorded = snap.get("params")
    if recorded is None:
        return
    if not isinstance(recorded, dict) or not all(
            isinstance(gs, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in gs)
            for gs in recorded.values()):
        raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of its optimizers' parameters is malformed",
                            hint="restore from another snapshot")
    for key, groups in _named(state).items():
        saved = recorded.get(key)
        if saved is None or [len(g) for g in saved] != [len(g) for g in groups]:
            continue  # (another number of groups or parameters has its own error)
        for gi, (want, have) in enumerate(zip(saved, groups)):
            for pi, (w, hs) in enumerate(zip(want, have)):
                # Compared where both sides name it from a module restored now: a name against a shape is a restore
                # without the module, and a name of a module not restored now may be a parameter tied to one that is
                # (a tied parameter answers to each of its names).
                if w not in hs and "/" in hs[0] and w.split("/", 1)[0] in state:
                    raise SnapshotError(
                        f"state[{key!r}]: parameter {pi} of group {gi} is {hs[0]}, but the snapshot of step {step} holds "
                        f"the state of {w} there: the optimizer's state would be given to other parameters",
                        hint="build the optimizer over the parameters in the order the saved run used")


def check_saved_state(key: str, obj: Any, saved: Any, step: int) -> None:
    """Refuse, before anything is written, a saved state ``saved`` (its structure: plain values as saved)
    that ``obj``'s ``load_state_dict`` would take wrongly or drop: an LR scheduler's of an optimizer with
    another number of parameter groups than ``obj.optimizer`` (its ``base_lrs`` would be taken as they are),
    a grad scaler's saved enabled into a disabled one (torch drops it) or the reverse."""
    import torch
    from torch.optim.lr_scheduler import LRScheduler

    from ckpt.snapshot.run import SnapshotError

    if not isinstance(saved, dict):
        return
    obj = stepped_scheduler(obj)  # (accelerate's wrapper: its state is the wrapped scheduler's)
    if isinstance(obj, LRScheduler) and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
        have = len(obj.optimizer.param_groups)
        for field in ("base_lrs", "_last_lr"):
            if isinstance(saved.get(field), list) and len(saved[field]) != have:
                raise SnapshotError(f"state[{key!r}]: the snapshot of step {step} holds an LR scheduler of an optimizer "
                                    f"with {len(saved[field])} parameter groups ({field}); this one's has {have}",
                                    hint="build the optimizer with the parameter groups the saved run used")
    if isinstance(obj, torch.amp.GradScaler) and bool(saved) != obj.is_enabled():
        was, now = ("enabled", "disabled") if saved else ("disabled", "enabled")
        raise SnapshotError(f"state[{key!r}]: the snapshot of step {step} holds the state of a grad scaler that was "
                            f"{was}; this one is {now}: " + ("torch would drop the saved scale" if saved else
                                                              "it has no scale to restore"),
                            hint=f"restore into a GradScaler {was} as it was saved, or leave {key!r} out of the state")


def recorded_classes(state: dict[str, Any]) -> dict[str, str]:
    """What a snapshot records of ``state``'s objects whose ``load_state_dict`` takes another class's state
    without a word (``"classes"`` in its record): each one's class as ``module.qualname`` text
    (:func:`_class_text`), by state key (:func:`_classed_objects` says which)."""
    return {key: _class_text(o) for key, o in _classed_objects(state).items()}


def _classed_objects(state: dict[str, Any]) -> dict[str, Any]:
    """The objects of ``state`` whose class a snapshot records, by key: each optimizer (unwrapped as
    :func:`optimizers_in` unwraps it) and LR scheduler (torch's ``load_state_dict`` of either takes any
    state dict; one accelerate's ``AcceleratedScheduler`` steps is unwrapped too). Not modules (a restore
    matches their tensors by name, shape and dtype), nor grad scalers or RNG states (their
    ``load_state_dict`` needs their own fields), nor plain values (given back as saved)."""
    from torch.optim.lr_scheduler import LRScheduler

    found = optimizers_by_key(state)
    for key, obj in state.items():
        obj = stepped_scheduler(obj)
        if isinstance(obj, LRScheduler):
            found[key] = obj
    return found


def stepped_scheduler(obj: Any) -> Any:
    """The LR scheduler a wrapper such as accelerate's ``AcceleratedScheduler`` (no ``LRScheduler``; its
    state is the wrapped one's) steps; any other object as it is."""
    from torch.optim.lr_scheduler import LRScheduler

    while isinstance(getattr(obj, "scheduler", None), LRScheduler) and not isinstance(obj, LRScheduler):
        obj = obj.scheduler
    return obj


def _class_text(obj: Any) -> str:
    """``obj``'s class as ``module.qualname``; a scheduler made of others (``SequentialLR``, ``ChainedScheduler``:
    torch's ``load_state_dict`` loads each saved child's state into the child at its place, whatever its
    class) adds theirs in order: ``torch.optim.lr_scheduler.SequentialLR[torch.optim.lr_scheduler.LinearLR, ...]``."""
    text = f"{type(obj).__module__}.{type(obj).__qualname__}"
    children = getattr(obj, "_schedulers", None)  # (torch's attribute; its state_dict saves the children under it)
    if isinstance(children, (list, tuple)):
        text += "[" + ", ".join(_class_text(c) for c in children) + "]"
    return text


def check_classes(snap: dict[str, Any], state: dict[str, Any], mid: str, step: int) -> None:
    """Refuse, before anything is restored, an object of ``state`` of another class than the one the snapshot
    ``mid`` (of ``step``; ``snap``: its record) recorded under its key (:func:`recorded_classes`): torch's
    ``load_state_dict`` takes an AdamW's state into an SGD, a StepLR's into a CosineAnnealingLR, without a
    word; and one whose key the record lacks (a module's state, say, or a grad scaler's, saved there, which a
    scheduler's ``load_state_dict`` takes too). A snapshot written before the record is not checked (one of
    the release that recorded its optimizers alone, as ``"optimizers"``, has those checked: a key it lacks
    may be a scheduler's); :class:`~ckpt.snapshot.run.SnapshotError` too where the record is malformed."""
    import re

    import torch

    from ckpt.snapshot.run import SnapshotError

    recorded = snap.get("classes", snap.get("optimizers"))
    if recorded is None:
        return
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise SnapshotError(f"checkpoint {mid[:12]}: the snapshot's record of its objects' classes is malformed",
                            hint="restore from another snapshot")
    every = "classes" in snap  # (the record of every optimizer and scheduler saved, not of the optimizers alone)
    for key, obj in _classed_objects(state).items():
        saved, have = recorded.get(key), _class_text(obj)
        kind = "optimizer" if isinstance(obj, torch.optim.Optimizer) else "LR scheduler"
        if saved is None and every:
            raise SnapshotError(f"state[{key!r}] is a {have}, but the snapshot of step {step} holds no optimizer's or "
                                f"LR scheduler's state under {key!r}: another object's state would be taken as an {kind}'s",
                                hint=f"restore into the kind of object that was saved as {key!r}, or leave {key!r} out "
                                     "of the state to start it afresh")
        if saved is not None and saved != have:
            short = re.sub(r"[\w.]*\.(\w+)", r"\1", saved)  # torch.optim.adamw.AdamW -> AdamW
            raise SnapshotError(f"state[{key!r}] is a {have}, but the snapshot of step {step} holds the state of a {saved}: "
                                f"its state would be taken as another {kind}'s",
                                hint=f"restore into a {short} built as the saved run built it, or leave "
                                     f"{key!r} out of the state to start it afresh")
