"""Training state <-> (tensors, JSON): what a snapshot stores, without pickle.

A *state* is a dict whose values are ``nn.Module``s, optimizers, LR schedulers, grad
scalers, any object with ``state_dict()``/``load_state_dict()`` (the :class:`Stateful`
protocol), RNG states (:class:`RNGState`), or plain JSON values (step, epoch, data
position). :func:`flatten` turns each object's ``state_dict()`` into named tensors
plus a JSON tree that points at them; :func:`unflatten` rebuilds the state dicts.
Python values JSON cannot carry exactly (tuples, int dict keys, inf/nan, bytes) are
tagged, so a round trip gives back equal objects — and nothing is ever unpickled.
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

from ckpt.format import tagged_json


@runtime_checkable
class Stateful(Protocol):
    """Anything that can join a snapshot: the same two methods as ``nn.Module``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class RNGState:
    """The random number generators a training step consumes: Python's ``random``,
    NumPy's global generator, torch's CPU generator and, where present, every CUDA one.

    Put one in the state (``{"rng": ckpt.RNGState()}``) to make resumption exact.
    Every rank's generators differ: a distributed snapshot keeps one copy per rank
    (:class:`PerRank`) and gives each rank its own back.

    Restored on a machine with fewer GPUs than the one that saved it (or none), the generators
    of the GPUs it lacks are left out where they were never drawn from since they were seeded
    (a GPU the run did not use): the resumed run is exact all the same. Where one was drawn
    from, the run cannot go on here as it would have, and :class:`~ckpt.snapshot.run.SnapshotError`
    says so before any generator is set.
    """

    def state_dict(self) -> dict[str, Any]:
        import numpy as np
        import torch

        out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        np_state = np.random.get_state()
        out["numpy"] = {"kind": np_state[0], "keys": torch.from_numpy(np_state[1].copy()), "pos": int(np_state[2]),
                        "has_gauss": int(np_state[3]), "gauss": float(np_state[4])}
        if torch.cuda.is_available():
            out["cuda"] = [t for t in torch.cuda.get_rng_state_all()]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy as np
        import torch

        from ckpt.snapshot.run import SnapshotError

        if not isinstance(state, dict):
            raise SnapshotError("the snapshot's RNG state is malformed: not a record", hint="restore from another snapshot")
        cuda = _cuda_states(state.get("cuda", []))  # checked before any generator is set
        try:  # each state is tried on a generator of its own first: a damaged one sets none of them
            python = _as_tuples(state["python"])
            random.Random().setstate(python)
            torch.Generator().set_state(state["torch"])
            n = state["numpy"]
            np_state = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
            np.random.RandomState().set_state(np_state)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise SnapshotError(f"the snapshot's RNG state is malformed ({type(e).__name__}: {e})",
                                hint="restore from another snapshot") from None
        random.setstate(python)
        torch.set_rng_state(state["torch"])
        np.random.set_state(np_state)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


def _cuda_states(saved: Any) -> list[Any]:
    """The saved CUDA generator states this machine has devices for; :class:`SnapshotError` where a
    device it lacks had its generator drawn from (its state is seed and offset, 8 bytes each: the
    offset is 0 until the first draw after seeding; a state of another layout counts as drawn from)."""
    import torch

    from ckpt.snapshot.run import SnapshotError

    if not isinstance(saved, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in saved):
        raise SnapshotError("the snapshot's record of the CUDA random number generators is malformed",
                            hint="restore from another snapshot, or leave the RNGState out of the state")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    drawn = [i for i, t in enumerate(saved[have:], have) if t.numel() != 16 or t[8:].any()]
    if drawn:
        raise SnapshotError(f"the snapshot's RNG state is of a machine with {len(saved)} GPUs, whose generator on "
                            f"GPU {', '.join(map(str, drawn[:8]))} had been drawn from; this one has {have}: the run "
                            "cannot go on here as it would have",
                            hint=f"resume on a machine with {drawn[-1] + 1} GPUs or more; or, to go on without exact "
                                 "randomness, restore the state without its RNGState")
    return saved[:have]


class PerRank:
    """Marks state that differs between ranks (a data loader's position in its own shard, say).

    With ``CheckpointManager(process_group=...)`` each rank saves its own copy and
    restores it; anything else is taken to be identical on every rank and saved once.
    :class:`RNGState` is per rank without this wrapper. Outside a process group it is
    simply ``obj``.

    >>> import ckpt.snapshot.state
    >>> class Position:
    ...     def __init__(self): self.batch = 0
    ...     def state_dict(self): return {"batch": self.batch}
    ...     def load_state_dict(self, sd): self.batch = sd["batch"]
    >>> pos = ckpt.snapshot.state.PerRank(Position())
    >>> pos.state_dict()
    {'batch': 0}
    """

    def __init__(self, obj: Stateful) -> None:
        if not isinstance(obj, Stateful) or isinstance(obj, type):
            raise TypeError(f"PerRank wraps an object with state_dict()/load_state_dict(), not a {type(obj).__name__}")
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        return self.obj.load_state_dict(state_dict)


def is_per_rank(obj: Any) -> bool:
    """Whether a distributed snapshot keeps ``obj``'s state once per rank."""
    return isinstance(obj, (RNGState, PerRank))


def _as_tuples(x: Any) -> Any:
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors by name, JSON tree) for a state. Tensor names are ``<key>/<path>``."""
    from ckpt.errors import InvalidNameError, InvalidSourceError

    tensors: dict[str, Any] = {}

    def unsupported(path: str, what: str) -> Exception:
        return InvalidSourceError(path, f"{what} cannot be stored as JSON or a tensor",
                                  hint="give it state_dict()/load_state_dict() returning tensors and plain values")

    def enc(x: Any, key: str) -> Any:
        return tagged_json.encode(x, key, unsupported=unsupported, tensor=tensors.__setitem__)

    tree: dict[str, Any] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or "/" in key or not key:
            raise InvalidNameError(f"state key {key!r} must be a non-empty string without '/'")
        if isinstance(obj, Stateful) and not isinstance(obj, type):
            tree[key] = {"kind": "stateful", "value": enc(obj.state_dict(), key)}
        else:
            tree[key] = {"kind": "value", "value": enc(obj, key)}
    return tensors, tree


def version_key(t: Any) -> tuple[Any, ...]:
    """A tensor's identity and in-place version counter (``tensor._version``): equal keys at two times say that
    its bytes did not change in between (not where a fused optimizer updates it: it bumps no counter)."""
    return (t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device, t.stride())


def version_trusted(state: dict[str, Any], optimizers: list[Any]) -> frozenset[tuple[int, int]]:
    """What :func:`trusted` checks a tensor against: the (data pointer, version) of the parameters of the modules in
    ``state`` and of ``optimizers``, and of the optimizers' per-parameter state, whose version counters say whether
    they changed; not a module's buffers, nor anything else: ``torch.batch_norm`` (every BatchNorm module,
    ``F.batch_norm`` on plain tensors) updates running statistics in place without bumping their counters, so a save
    that trusted them reused the statistics of the first snapshot in every later one, and a resumed run evaluated (and
    went on) with stale ones. A save reads every other tensor each time (the hash finds its chunks unchanged where they
    are). Memory a buffer shares (tied) is not trusted; nor a tensor without an address (a wrapper tensor subclass)."""
    import torch

    modules = [m for m in state.values() if isinstance(m, torch.nn.Module)]
    params = [p for m in modules for p in m.parameters()]
    params += [p for o in optimizers for g in o.param_groups for p in g["params"]]
    params += [v for o in optimizers for per in o.state.values() for v in per.values() if isinstance(v, torch.Tensor)]
    buffers = {storage_address(b) for m in modules for b in m.buffers()}
    return frozenset((_address(p), p._version) for p in params if storage_address(p) not in buffers and _address(p) is not None)


def trusted(t: Any, pairs: frozenset[tuple[int, int]]) -> bool:
    """Whether ``t``'s version counter says when it changes: it is a parameter or an optimizer's state
    (:func:`version_trusted`), or shares its version counter (``.detach()``, as ``state_dict()`` hands them out), seen
    by the same address and version now. (Not a ``.data`` alias: a counter of its own, which the optimizer's step does
    not bump; trusted by the memory alone, one a Stateful handed out was reused stale.)"""
    return (_address(t), getattr(t, "_version", None)) in pairs


def storage_address(t: Any) -> int | None:
    """The address of ``t``'s storage; None where it has none to give (a wrapper tensor subclass, a sparse tensor)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass: no storage of its own
        return None


def _address(t: Any) -> int | None:
    try:
        return int(t.data_ptr()) if storage_address(t) is not None else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def autograd_flags(tensors: dict[str, Any]) -> dict[str, list[str]]:
    """What the bytes of :func:`flatten`'s tensors do not say and a restore must give back: the names
    of those that require grad and of those that are ``nn.Parameter`` objects (a learnable temperature kept
    as a plain value, say; a module's ``state_dict()`` hands out neither). Empty entries are left out.
    """
    import torch

    flags = {"requires_grad": sorted(n for n, t in tensors.items() if t.requires_grad),
             "parameters": sorted(n for n, t in tensors.items() if isinstance(t, torch.nn.Parameter))}
    return {k: v for k, v in flags.items() if v}


def autograd_flags_valid(flags: Any, dtypes: dict[str, Any]) -> bool:
    """Whether ``flags``, read from a snapshot's record, are what :func:`autograd_flags` writes: lists of
    names, and those that require grad of a floating point or complex dtype (``dtypes``: the saved ones by name)."""
    if not isinstance(flags, dict) or not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in flags.values()):
        return False
    return all(n not in dtypes or dtypes[n].is_floating_point or dtypes[n].is_complex for n in flags.get("requires_grad", ()))


def autograd_flag_sets(flags: Any, dtypes: dict[str, Any]) -> dict[str, frozenset[str]] | None:
    """The flags :func:`autograd_flags` recorded, read from a snapshot's record, as a set of names per
    flag (a restore looks up each tensor's: in the lists, that grew as tensors times parameters), or
    None where they are not what it writes (:func:`autograd_flags_valid`)."""
    if not autograd_flags_valid(flags, dtypes):
        return None
    return {k: frozenset(v) for k, v in flags.items()}


def tensor_devices(tensors: dict[str, Any]) -> dict[str, list[str]]:
    """The devices of :func:`flatten`'s tensors that are not on the CPU: names by device (``"cuda:0"``),
    which a restore gives back to the tensors it makes (a plain value that lived on a GPU goes back there)."""
    out: dict[str, list[str]] = {}
    for n, t in sorted(tensors.items()):
        if t.device.type != "cpu":
            out.setdefault(str(t.device), []).append(n)
    return out


def recorded_devices(recorded: Any) -> dict[str, str]:
    """The device of each tensor named in :func:`tensor_devices`' record, read from a snapshot;
    :class:`~ckpt.snapshot.run.SnapshotError` where it is not what that function writes."""
    from ckpt.snapshot.run import SnapshotError

    if not isinstance(recorded, dict) or not all(isinstance(d, str) and isinstance(v, list) and all(isinstance(n, str) for n in v)
                                                 for d, v in recorded.items()):
        raise SnapshotError("the snapshot's record of tensor devices is malformed", hint="restore from another snapshot")
    return {n: d for d, names in recorded.items() for n in names}


def device_here(name: str, where: str | None) -> Any:
    """The device to make tensor ``name`` on, saved from ``where`` (None: the CPU);
    :class:`~ckpt.snapshot.run.SnapshotError` where this machine has no such device."""
    import torch

    from ckpt.snapshot.run import SnapshotError

    if where is None:
        return torch.device("cpu")
    try:
        device = torch.device(where)
    except (RuntimeError, TypeError, ValueError):
        raise SnapshotError(f"the snapshot's record of tensor devices is malformed: {where!r} is no device",
                            hint="restore from another snapshot") from None
    if device.type == "cuda":
        present = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    elif device.type in ("cpu", "meta"):
        present = device.type == "cpu"  # (a meta tensor holds no data to restore)
    else:
        try:
            present = torch.empty(0, device=device) is not None
        except (RuntimeError, AssertionError):
            present = False
    if not present:
        raise SnapshotError(f"{name} was saved from {device}, which this machine lacks",
                            hint=f"restore on a machine with {device}, or leave {name.split('/')[0]!r} out of the state")
    return device


def with_autograd_flags(name: str, t: Any, flags: dict[str, Any]) -> Any:
    """``t``, a fresh tensor restored as ``name``, with the flags :func:`autograd_flags` recorded for it."""
    import torch

    grad = name in flags.get("requires_grad", ())
    if name in flags.get("parameters", ()):
        return torch.nn.Parameter(t, requires_grad=grad)
    return t.requires_grad_(grad) if grad else t


def unflatten(tree: Any, tensors: dict[str, Any], *, later: bool = True) -> Any:
    """Inverse of the encoding in :func:`flatten` for one value; ``later``: the snapshot is of a format
    with the tags added after format 1 (:data:`ckpt.snapshot.run.SNAPSHOT_TORCH_FORMAT`)."""
    return tagged_json.decode(tree, "snapshot state", tensor=tensors.__getitem__, later=later)


def tensor_refs(tree: Any) -> list[str]:
    """Names of every tensor a JSON tree points at."""
    return tagged_json.tensor_refs(tree)


def optimizers_in(state: dict[str, Any]) -> list[Any]:
    """The optimizers in ``state`` whose ``step`` runs the update, unwrapped: a wrapper such
    as accelerate's ``AcceleratedOptimizer`` (what a transformers ``Trainer`` holds) is an
    ``Optimizer`` subclass that never ran ``Optimizer.__init__`` and steps the one it wraps,
    so hooks go on that one."""
    return list(optimizers_by_key(state).values())


def optimizers_by_key(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`optimizers_in`, by their keys in ``state``."""
    import torch

    found = {}
    for key, obj in state.items():
        if isinstance(obj, torch.optim.Optimizer):
            while isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
                obj = obj.optimizer
            found[key] = obj
    return found
