"""Rank programs for tests/ckpt/dcp/test_dcp.py: real processes, gloo on CPU.

:func:`run_ranks` starts ``world`` processes from a forkserver that has torch
(and dynamo, which FSDP2 imports on first use) loaded once, so each group starts
in about a second instead of re-importing torch per rank. Each rank joins a gloo
group through a file store, runs one scenario below, and writes what it found to
``rank-N.json``; the parent test asserts on those.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta

PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor",
           "ckpt.dcp", "ckpt.snapshot.manager", "safetensors.torch"]


def run_ranks(scenario: str, world: int, tmp: str, *, deadline_s: float = 90, pg_timeout_s: float = 30,
              stuck: tuple[int, ...] = (), unexpected: tuple[int, ...] = (), **kw) -> list[dict]:
    """Run ``scenario`` on ``world`` ranks; returns each rank's result (``{"killed": True}`` for one that
    died). Ranks in ``stuck`` are expected to hang: the others are waited for, then those are killed.
    Ranks in ``unexpected`` are made to catch a bug on purpose: their ``unexpected`` records are returned."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    init = os.path.join(tmp, f"pg-{uuid.uuid4().hex}")
    procs = [ctx.Process(target=_entry, args=(scenario, r, world, tmp, init, pg_timeout_s, kw)) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for r, p in enumerate(procs):
        if r not in stuck:
            p.join(max(0.1, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in stuck]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {deadline_s} s"
    out = []
    for r, p in enumerate(procs):
        path = os.path.join(tmp, f"rank-{r}.json")
        if p.exitcode == -signal.SIGKILL and not os.path.exists(path):
            out.append({"killed": True})
            continue
        assert os.path.exists(path), f"rank {r} exited with {p.exitcode} and no result"
        with open(path) as f:
            out.append(json.load(f))
        os.unlink(path)
        assert "unexpected" not in out[-1] or r in unexpected, f"rank {r} caught and logged an unexpected error: {out[-1]['unexpected']}"
    return out


class _Unexpected(logging.Handler):
    """Keeps the records (with their tracebacks) of errors ckpt caught and logged as unexpected."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "unexpected", False):
            self.into.append(self.format(record)[-3000:])


def _entry(scenario: str, rank: int, world: int, tmp: str, init: str, pg_timeout_s: float, kw: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict = {}
    unexpected: list[str] = []  # errors a rank caught and logged as unexpected (a bug: tiers.caught), for the parent
    logging.getLogger("ckpt").addHandler(_Unexpected(unexpected))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        result = SCENARIOS[scenario](rank, world, tmp, **kw)
    except BaseException as e:  # noqa: BLE001 - reported to the parent test
        result = {"error": f"{type(e).__name__}: {e}", "type": type(e).__name__, "trace": traceback.format_exc()[-3000:]}
    if unexpected:
        result["unexpected"] = unexpected
    with open(os.path.join(tmp, f"rank-{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(tmp, f"rank-{rank}.json.tmp"), os.path.join(tmp, f"rank-{rank}.json"))
    os._exit(0)  # no teardown collectives with peers that may be gone


# -- deterministic state, identical in every process -------------------------------------
def full_tensors():
    """The plain tensors every scenario shards, with awkward sizes, dtypes and bit patterns."""
    import torch

    g = torch.Generator().manual_seed(1234)
    rows = torch.randn(9, 7, generator=g)  # 9 rows over 2 ranks: an uneven split
    rows.view(torch.int32)[0, :3] = torch.tensor([0x7FC00001, 0x7F800000, -0x800000], dtype=torch.int32)  # NaN payload, inf
    cols = torch.randn(6, 10, generator=g).to(torch.bfloat16)
    return {"rows": rows, "cols": cols, "ids": torch.arange(11, dtype=torch.int64) * 7, "rep": torch.randn(5, generator=g)}


def plain_model():
    import torch

    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _dtensors(mesh, layout):
    """``full_tensors`` as DTensors: layout "a" shards rows/cols by dim 0/1, layout "b" the other way."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = full_tensors()
    dims = {"rows": 0, "cols": 1, "ids": 0} if layout == "a" else {"rows": 1, "cols": 0, "ids": 0}
    out = {k: distribute_tensor(v, mesh, [Shard(dims[k])]) for k, v in full.items() if k in dims}
    out["rep"] = distribute_tensor(full["rep"], mesh, [Replicate()])
    return out


def bits(t) -> str:
    """Exact identity of a tensor's bytes (shape, dtype, hash of the bit pattern)."""
    import hashlib

    import torch

    t = t.detach().contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return f"{t.dtype}{list(t.shape)}:{hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()}"


def _fsdp(mesh):
    import torch
    from torch.distributed.fsdp import fully_shard

    model = plain_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


# -- scenarios ---------------------------------------------------------------------------
def save_and_reshard(rank, world, tmp, store):
    """Save DTensors (layout a) + an FSDP2 model and optimizer after one step; load back in layout b;
    async_save; load a 1-process checkpoint into this layout. Full tensors go to expected.safetensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckpt.dcp

    mesh = _mesh(world)
    model, opt = _fsdp(mesh)
    torch.manual_seed(100 + rank)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"t": _dtensors(mesh, "a"), "model": msd, "optim": osd, "step": 3, "note": {"tags": ("a", 1), "best": float("inf")}}
    md = dcp.save(state, storage_writer=ckpt.dcp.Writer(store, "dist/two"))
    expected = {f"model.{k}": v.full_tensor() for k, v in msd.items()}
    expected.update({f"optim.state.{k}.{s}": v.full_tensor() if hasattr(v, "full_tensor") else v
                     for k, st in osd["state"].items() for s, v in st.items()})
    if rank == 0:
        save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(tmp, "expected.safetensors"))
    res: dict = {"id": md.storage_meta.checkpoint_id}

    # 2 -> 2, another layout: rows by dim 1, cols by dim 0; model weights into column shards.
    from torch.distributed.tensor import Shard, distribute_tensor

    into = {"t": {k: torch.zeros_like(v) for k, v in _dtensors(mesh, "b").items()}, "step": 0, "note": {"tags": None, "best": None},
            "model": {k: distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), mesh, [Shard(v.dim() - 1)]) for k, v in msd.items()}}
    dcp.load(into, storage_reader=ckpt.dcp.Reader(store, "dist/two"))
    want = _dtensors(mesh, "b")
    res["layout_b_exact"] = all(bits(into["t"][k].to_local()) == bits(want[k].to_local()) for k in want)
    res["layout_b_model_exact"] = all(bits(into["model"][k].full_tensor()) == bits(expected[f"model.{k}"]) for k in msd)
    res["local_is_column_shard"] = [list(into["t"]["rows"].to_local().shape)]
    res["values"] = [into["step"], repr(into["note"])]

    # FSDP2 restore into a fresh model + optimizer through set_state_dict, then one more identical step.
    model2, opt2 = _fsdp(mesh)
    msd2, osd2 = get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, storage_reader=ckpt.dcp.Reader(store, "dist/two"))
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    res["fsdp_restore_exact"] = all(bits(p2.full_tensor()) == bits(p.full_tensor()) for p, p2 in zip(model.parameters(), model2.parameters()))

    # async_save: returns once staged; the ref moves when the future completes.
    fut = dcp.async_save({"t": _dtensors(mesh, "a")}, storage_writer=ckpt.dcp.Writer(store, "dist/async"))
    res["async_id"] = fut.result().storage_meta.checkpoint_id

    # 1 -> 2: a checkpoint the parent saved from one process, loaded into this layout.
    if os.path.exists(os.path.join(tmp, "one-ready")):
        got = {k: torch.zeros_like(v) for k, v in _dtensors(mesh, "a").items()}
        dcp.load({"t": got}, storage_reader=ckpt.dcp.Reader(store, "dist/one"))
        res["one_to_two_exact"] = all(bits(got[k].full_tensor()) == bits(v) for k, v in full_tensors().items())
    return res


def manager(rank, world, tmp, store, kill_rank=None, signum=signal.SIGKILL, async_save=True, timeout_s=8):
    """CheckpointManager with a process group: save twice, restore into fresh state (and optionally die)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckpt

    mesh = _mesh(world)
    model, opt = _fsdp(mesh)

    class Train:  # DCP's recipe for FSDP state: model and optimizer keyed by parameter name
        def __init__(self, model, opt):
            self.model, self.opt = model, opt

        def state_dict(self):
            m, o = get_state_dict(self.model, self.opt)
            return {"model": m, "optim": o}

        def load_state_dict(self, sd):
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def step():
        torch.manual_seed(7 + rank)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()

    res: dict = {}
    with ckpt.CheckpointManager(store, "run", keep_last=2, save_mode="async" if async_save else "sync", process_group=torch.distributed.group.WORLD,
                                timeout_s=timeout_s) as mgr:
        res["restored_none"] = mgr.restore_latest({"train": Train(model, opt), "step": 0})
        for s in (1, 2, 3):
            step()
            mgr.save(s, {"train": Train(model, opt), "step": s}, metrics={"loss": float(s)})
        mgr.wait()
        res["steps"] = mgr.steps()
        saved = [bits(p.full_tensor()) for p in model.parameters()]
        if kill_rank is not None:
            import ckpt.dcp

            original = ckpt.dcp.Writer.write_data

            def dying(self, plan, planner):
                out = original(self, plan, planner)  # this rank's chunks are in the store...
                if rank == kill_rank:
                    halt(signum)  # ...and it dies (or hangs) before reporting them
                return out

            ckpt.dcp.Writer.write_data = dying
            step()
            t0 = time.monotonic()
            try:
                mgr.save(4, {"train": Train(model, opt), "step": 4})
                mgr.wait()
                res["kill"] = "no error"
            except ckpt.CkptError as e:
                res["kill"] = f"{type(e).__name__}: {e}"
            res["kill_s"] = time.monotonic() - t0
            return res
        model2, opt2 = _fsdp(mesh)
        state = {"train": Train(model2, opt2), "step": 0}
        res["restored"] = mgr.restore_latest(state)
        res["step_value"] = state["step"]
        res["exact"] = [bits(p.full_tensor()) for p in model2.parameters()] == saved
    return res


# -- the README's training loop on DDP ranks: exact resume -----------------------------------
def _ddp_state(rank, group=None, find_unused=False):
    """The README's state on DDP: AdamW (no state until its first step), a scheduler, a grad
    scaler, per-rank RNG streams (torch, Python, NumPy) and a plain step counter."""
    import random

    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ckpt

    torch.manual_seed(0)  # the same initial weights on every rank, as DDP expects
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3))
    model = DistributedDataParallel(net, process_group=group, find_unused_parameters=find_unused)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)  # its scale grows every 2 steps
    torch.manual_seed(100 + rank)  # each rank draws its own data and dropout masks
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    return {"model": model, "optim": opt, "sched": sched, "scaler": scaler, "rng": ckpt.RNGState(), "step": 0}


def preempt_ddp(rank, world, tmp, store, signal_at=7):
    """DDP training with ``handle_signals``: the preemption signal reaches rank 0 just before its
    ``maybe_save(signal_at)`` and the other ranks just after theirs (each raises it itself, at that
    point). Returns the step at which each rank's ``maybe_save`` ended the run, its exit code, the
    seconds that took from the signal, the durable steps and the state's bits at the final save."""
    import torch.distributed as dist

    import ckpt

    state = _ddp_state(rank)
    mgr = ckpt.CheckpointManager(store, "pre", every_n_steps=1000, process_group=dist.group.WORLD, timeout_s=30,
                                 handle_signals=True)
    out: dict = {}
    t0 = None
    for step in range(1, 30):
        _ddp_step(state)
        state["step"] = step
        if step == signal_at and rank == 0:
            t0 = time.monotonic()
            signal.raise_signal(signal.SIGTERM)
        try:
            mgr.maybe_save(step, state)
        except SystemExit as e:
            out.update(final=step, code=e.code, bits=_ddp_bits(state), waited=time.monotonic() - (t0 or time.monotonic()))
            break
        if step == signal_at and rank != 0:
            t0 = time.monotonic()
            signal.raise_signal(signal.SIGTERM)
    with ckpt.CheckpointManager(store, "pre") as check:
        out["durable"] = check.steps()
    return out


def ddp_restore_bits(rank, world, tmp, store, run):
    """A fresh DDP state restored from run ``run``'s latest snapshot: the step and the state's bits."""
    import torch.distributed as dist

    import ckpt

    state = _ddp_state(rank)
    with ckpt.CheckpointManager(store, run, process_group=dist.group.WORLD, timeout_s=30) as mgr:
        step = mgr.restore_latest(state)
    return {"step": step, "bits": _ddp_bits(state)}


def _ddp_train(mgr, state, steps):
    """Train ``steps`` (step numbers), offering each to ``mgr.maybe_save``."""
    for step in steps:
        _ddp_step(state)
        state["step"] = step
        mgr.maybe_save(step, state)


def _ddp_step(state):
    """One step on this rank's own batch; its local loss as float.hex."""
    import random

    import numpy as np
    import torch

    model, opt, scaler = state["model"], state["optim"], state["scaler"]
    x = torch.randn(5, 6) * (1 + random.random()) + float(np.random.standard_normal())  # all three generators
    y = torch.randint(0, 3, (5,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    state["sched"].step()
    return loss.item().hex()


def _ddp_bits(state):
    """Everything a resumed run must match, bit for bit: parameters, optimizer moments and steps,
    scheduler, scaler, every generator's state, the step counter."""
    import hashlib
    import random

    import numpy as np
    import torch

    opt = state["optim"].state_dict()
    np_state = np.random.get_state()
    return {"params": {k: bits(v) for k, v in state["model"].state_dict().items()},
            "optim": {str(i): {k: bits(v) for k, v in st.items()} for i, st in opt["state"].items()},
            "groups": repr([sorted(g.items()) for g in opt["param_groups"]]), "sched": repr(state["sched"].state_dict()),
            "scaler": repr(state["scaler"].state_dict()), "torch_rng": bits(torch.get_rng_state()),
            "python_rng": hashlib.blake2b(repr(random.getstate()).encode(), digest_size=16).hexdigest(),
            "numpy_rng": hashlib.blake2b(repr((np_state[0], np_state[1].tolist(), *np_state[2:])).encode(),
                                         digest_size=16).hexdigest(),
            "step": state["step"]}


def ddp_resume(rank, world, tmp, store, mode, steps, at=0, find_unused=False):
    """``full``: train ``steps`` steps. ``crash``: snapshot every ``at`` steps with maybe_save, and
    once step ``at`` is durable train two more steps and SIGKILL this process. ``resume``: a fresh
    process restores the latest snapshot and trains on to ``steps``. Returns per-step losses,
    :func:`_ddp_bits` at step ``at`` (``full``) or right after the restore (``resume``) and at the end,
    and the warnings the restore gave."""
    import warnings

    import torch.distributed as dist

    import ckpt

    state = _ddp_state(rank, find_unused=find_unused)
    out = {}
    losses = {}
    mgr = None
    start = 0
    if mode != "full":
        mgr = ckpt.CheckpointManager(store, "ddp", every_n_steps=at, keep_last=2, process_group=dist.group.WORLD,
                                     timeout_s=30)
    if mode == "resume":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = mgr.restore_latest(state)
        out["warnings"] = [f"{w.category.__name__}: {w.message} ({os.path.basename(w.filename)})" for w in caught]
        out["bits_at"] = _ddp_bits(state)
        assert start == state["step"] == at, (start, state["step"])
    for step in range(start + 1, steps + 1):
        losses[step] = _ddp_step(state)
        state["step"] = step
        if mode == "full" and step == at:
            out["bits_at"] = _ddp_bits(state)
        if mode == "crash" and mgr.maybe_save(step, state) and step == at:
            mgr.wait()  # durable on every rank: the coordinator has committed
            _ddp_step(state)  # the live state moves on past the snapshot...
            _ddp_step(state)
            os.kill(os.getpid(), signal.SIGKILL)  # ...and the process dies without any cleanup
    if mgr is not None:
        mgr.close()
    return {**out, "losses": losses, "bits": _ddp_bits(state)}


def ddp_restore_in_place(rank, world, tmp, store, at=3):
    """Train ``at`` steps, snapshot, then restore into a freshly built state (AdamW without
    state, generators elsewhere): the restored state must be the saved one on every rank."""
    import torch
    import torch.distributed as dist

    import ckpt

    state = _ddp_state(rank)
    with ckpt.CheckpointManager(store, "ddp", process_group=dist.group.WORLD, timeout_s=30) as mgr:
        for step in range(1, at + 1):
            _ddp_step(state)
            state["step"] = step
        mgr.save(at, state)
        mgr.wait()
        saved = _ddp_bits(state)
        fresh = _ddp_state(rank)
        torch.rand(3)  # the fresh process's generators are not where the snapshot's were
        restored_step = mgr.restore_latest(fresh)
        return {"saved": saved, "restored": _ddp_bits(fresh), "restored_step": restored_step,
                "opt_state_len": len(fresh["optim"].state), "params": len(list(fresh["model"].parameters()))}


class _Position:
    """A data position that differs per rank (not a tensor: a plain value)."""

    def __init__(self, batch=0):
        self.batch = batch

    def state_dict(self):
        return {"batch": self.batch}

    def load_state_dict(self, sd):
        self.batch = sd["batch"]


class _Lazy:
    """State that exists only once it has been used, like an optimizer's before its first step."""

    def __init__(self):
        self.buf = None

    def state_dict(self):
        return {} if self.buf is None else {"buf": self.buf, "n": 1}

    def load_state_dict(self, sd):
        self.buf = sd.get("buf")


def ddp_refusals(rank, world, tmp, store):
    """What a restore cannot do exactly is refused (and a save of state that differs per rank),
    each outcome as "ok", or the error's type and message."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckpt
    import ckpt.dcp
    from ckpt.snapshot.state import PerRank

    def outcome(fn):
        try:
            fn()
            return "ok"
        except BaseException as e:  # noqa: BLE001 - reported (DCP's CheckpointException is a BaseException)
            return f"{type(e).__name__}: {e}"

    res: dict = {}
    group = dist.group.WORLD
    with ckpt.CheckpointManager(store, "r", save_mode="sync", process_group=group, timeout_s=30) as mgr:
        res["differs"] = outcome(lambda: mgr.save(1, {"w": torch.ones(2), "pos": _Position(rank)}))
        res["differs_steps"] = mgr.steps()
        # Ranks at different steps (a preemption signal seen by one rank before its maybe_save, by the
        # other after it): the shared state is alike, but the snapshot would mix the two steps.
        res["steps_differ"] = outcome(lambda: mgr.save(3 + rank, {"w": torch.ones(2), "rng": ckpt.RNGState()}))
        res["steps_differ_steps"] = mgr.steps()
        state = _ddp_state(rank)
        _ddp_step(state)
        lazy = _Lazy()
        lazy.buf = torch.full((3,), float(rank))
        saved_opt = {i: {k: bits(v) for k, v in st.items()} for i, st in state["optim"].state_dict()["state"].items()}
        note = {"shard": 2, "offsets": (1, 2), "best": float("-inf")}
        res["per_rank_save"] = outcome(lambda: mgr.save(2, {**state, "pos": PerRank(_Position(10 + rank)),
                                                            "lazy": PerRank(lazy), "note": note}))
        pos, used = PerRank(_Position()), _Lazy()
        used.buf = torch.zeros(3)
        into = {**_ddp_state(rank), "pos": pos, "lazy": PerRank(used), "note": None}
        res["per_rank_restore"] = outcome(lambda: mgr.restore(into, 2))
        res["per_rank_value"] = [pos.obj.batch, used.buf.tolist()]
        res["note_exact"] = into["note"] == note and isinstance(into["note"]["offsets"], tuple)
        res["unplaced"] = outcome(lambda: mgr.restore({"lazy": PerRank(_Lazy())}, 2))
        some = _Lazy()
        if rank == 0:
            some.buf = torch.zeros(3)  # rank 0 could restore; rank 1 cannot: neither does, neither waits
        t0 = time.monotonic()
        res["one_refuses"] = outcome(lambda: mgr.restore({"lazy": PerRank(some)}, 2))
        res["one_refuses_s"] = time.monotonic() - t0
        res["not_per_rank"] = outcome(lambda: mgr.restore({"rng": _Position()}, 2))
        other = _ddp_state(rank)  # the saved AdamW's state into an SGD: torch's load_state_dict would take it
        other["optim"] = torch.optim.SGD(other["model"].parameters(), lr=0.1)
        res["other_optimizer"] = outcome(lambda: mgr.restore({"model": other["model"], "optim": other["optim"]}, 2))
        res["other_optimizer_state"] = len(other["optim"].state)
        # the saved StepLR's state into a CosineAnnealingLR: torch's load_state_dict takes it too
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(other["optim"], T_max=10)
        cosine_before = cosine.state_dict()
        res["other_scheduler"] = outcome(lambda: mgr.restore({"sched": cosine}, 2))
        res["other_scheduler_untouched"] = cosine.state_dict() == cosine_before
        # A snapshot saved with the RNG state once for all ranks (as ckpt did before it kept it per rank).
        old = {"format": 1, "run": "old", "step": 1, "metrics": {}, "ranks": True}
        dcp.save({"rng": ckpt.RNGState().state_dict()}, process_group=group,
                 storage_writer=ckpt.dcp.Writer(store, "old/step-1", aliases=("old/latest",), extra={"snapshot": old}))
    with ckpt.CheckpointManager(store, "old", save_mode="sync", process_group=group, timeout_s=30) as mgr:
        res["shared_rng"] = outcome(lambda: mgr.restore_latest({"rng": ckpt.RNGState()}))
    # A LambdaLR's state into a MultiplicativeLR: the same fields (a placement check passes them), another schedule
    sgd = torch.optim.SGD(_ddp_state(rank)["model"].parameters(), lr=0.1)
    with ckpt.CheckpointManager(store, "lam", save_mode="sync", process_group=group, timeout_s=30) as mgr:
        mgr.save(1, {"sched": torch.optim.lr_scheduler.LambdaLR(sgd, lambda epoch: 0.9 ** epoch)})
        mult = torch.optim.lr_scheduler.MultiplicativeLR(sgd, lambda epoch: 0.9)
        mult_before = mult.state_dict()
        res["same_fields"] = outcome(lambda: mgr.restore_latest({"sched": mult}))
        res["same_fields_untouched"] = mult.state_dict() == mult_before
    solo = dist.new_group([0])  # every rank creates it; rank 0 alone restores through it
    if rank == 0:
        with ckpt.CheckpointManager(store, "r", save_mode="sync", process_group=solo, timeout_s=30) as mgr:
            res["other_world"] = outcome(lambda: mgr.restore({"rng": ckpt.RNGState()}, 2))
            one = _ddp_state(rank, solo)
            res["other_world_shared"] = outcome(lambda: mgr.restore({"model": one["model"], "optim": one["optim"]}, 2))
            res["other_world_opt_exact"] = {i: {k: bits(v) for k, v in st.items()}
                                            for i, st in one["optim"].state_dict()["state"].items()} == saved_opt
    return res


def fsdp_plain_state(rank, world, tmp, store):
    """An FSDP2 model and its optimizer put in the state as they are (no get_state_dict wrapper):
    restored into a fresh pair, the optimizer gets DTensor moments sharded like its parameters."""
    import torch
    import torch.distributed as dist

    import ckpt

    mesh = _mesh(world)
    model, opt = _fsdp(mesh)
    torch.manual_seed(7 + rank)
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    want = {i: {k: bits(v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in st.items()}
            for i, st in opt.state_dict()["state"].items()}
    with ckpt.CheckpointManager(store, "fsdp", save_mode="sync", process_group=dist.group.WORLD, timeout_s=30) as mgr:
        mgr.save(2, {"model": model, "optim": opt})
        model2, opt2 = _fsdp(mesh)
        mgr.restore_latest({"model": model2, "optim": opt2})
    got = {i: {k: bits(v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in st.items()}
           for i, st in opt2.state_dict()["state"].items()}
    sharded = all(type(v).__name__ == "DTensor" for st in opt2.state.values() for k, v in st.items() if k != "step")
    return {"exact": got == want and len(want) == 4, "sharded": sharded,
            "params": [bits(p.full_tensor()) for p in model2.parameters()] == [bits(p.full_tensor()) for p in model.parameters()]}


def count_chunk_reads(backend) -> list[int]:
    """Count the reads of chunk objects ``backend`` makes from now on (the real reads, counted)."""
    n = [0]
    for name in ("read", "read_range", "read_into", "read_split"):
        real = getattr(backend, name)

        def counting(path, *a, _real=real, **k):
            if "chunks" in str(path):
                n[0] += 1
            return _real(path, *a, **k)

        setattr(backend, name, counting)
    return n


def count_chunk_writes(store) -> list[int]:
    """Count the chunk blobs written into ``store`` from now on (written whole or staged): [all, those
    that do not decode to their id (a delta whose base the store lacks is not counted as either)]."""
    from ckpt.store.copy import chunk_checker
    from ckpt_store.storage.errors import CorruptObjectError, ObjectNotFoundError

    backend, check, n, lock = store.objects.backend, chunk_checker(store, store), [0, 0], threading.Lock()
    for name in ("write", "stage"):
        real = getattr(backend, name)

        def counting(path, data, *a, _real=real, **k):
            if "chunks" in str(path):
                blob = b"".join(data) if isinstance(data, tuple) else bytes(data)
                try:
                    check(str(path).rsplit("/", 1)[-1], blob)
                    bad = 0
                except ObjectNotFoundError:
                    bad = -1
                except CorruptObjectError:
                    bad = 1
                with lock:
                    n[0] += bad >= 0
                    n[1] += bad > 0
            return _real(path, data, *a, **k)

        setattr(backend, name, counting)
    return n


def _kill_in_refill(tmp: str) -> None:
    """SIGKILL this process in a peer restore's refill (ckpt.snapshot.peer_targets.keep_decoded), in
    its second batch of chunks (one chunk a batch): the first is in the tier (its ids in
    ``tmp``/first-batch.json), the step is not named."""
    import ckpt.snapshot.peer_targets as targets
    import ckpt.transfer.pipeline as pipeline

    real, calls = pipeline.put_chunks, [0]

    def put_then_die(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        got = real(*a, **k)
        with open(os.path.join(tmp, "first-batch.json"), "w") as f:
            json.dump([r.id for r in got], f)
        return got

    targets.KEEP_BATCH = 1
    pipeline.put_chunks = put_then_die


def _garble_first_sends(peers, out, only=None) -> Callable[[], None]:
    """Make ``peers`` (this rank's :class:`~ckpt.snapshot.peers.Peers`) send a byte flipped in the first
    copy of each chunk whose id starts with an even byte (or is in ``only``), listed in ``out["garbled"]``
    (damaged on the way, after the real read of the tier). Returns what puts the real sender back."""
    real = peers._read_into
    out["garbled"] = []

    def garbling(cid, buf):
        real(cid, buf)
        if (cid in only if only is not None else int(cid[:2], 16) % 2 == 0) and cid not in out["garbled"]:
            buf[len(buf) // 2] ^= 0xFF
            out["garbled"].append(cid)

    peers._read_into = garbling
    return lambda: setattr(peers, "_read_into", real)


def _bug_in_checks(store: str) -> Callable[[], None]:
    """Make the checks of ckpt.store.copy (a peer transfer's, before a chunk enters a tier) raise a TypeError
    (a bug) on each chunk the durable store ``store`` holds too (there the load still finds it). Returns what
    puts the real decode back."""
    import ckpt
    import ckpt.store.copy as copy_module

    durable, real = ckpt.Store.open(store), copy_module.decode_chunk

    def broken(blob, oid, *a, **k):
        return len(blob) + None if durable.objects.has("chunks", oid) else real(blob, oid, *a, **k)

    copy_module.decode_chunk = broken
    return lambda: setattr(copy_module, "decode_chunk", real)


def _kill_after_fetch(peers) -> None:
    """SIGKILL this process once ``peers`` (its :class:`~ckpt.snapshot.peers.Peers`) has fetched a
    restore's chunks from peers, before the load reads them."""
    real = peers.fetch

    def fetch_then_die(*a, **k):
        real(*a, **k)
        os.kill(os.getpid(), signal.SIGKILL)

    peers.fetch = fetch_then_die


def _count_decoded(out) -> Callable[[], None]:
    """Count the chunks a peer restore decodes straight into this rank's tensors
    (``ckpt.snapshot.peers.decode_into_targets``): ``out["filled"]`` those that landed in
    ``tiers.filled``, ``out["refused"]`` those that did not. Returns what puts the real one back."""
    import threading

    import ckpt.snapshot.peers as peers_module
    from ckpt.snapshot.tiers import address

    real = peers_module.decode_into_targets
    lock = threading.Lock()
    out["filled"] = out["refused"] = 0

    def counting(cid, blob, views, tiers, max_length):
        done = real(cid, blob, views, tiers, max_length)
        with lock:
            out["filled" if (cid, address(views[0]), len(views[0])) in tiers.filled else "refused"] += 1
        return done

    peers_module.decode_into_targets = counting
    return lambda: setattr(peers_module, "decode_into_targets", real)


def _record_fetches(peers, out) -> Callable[[], None]:
    """Record what a restore logs on this rank (``out["logs"]``: the messages of ckpt.snapshot's loggers,
    INFO and up) and, after each of its fetches from peers, the chunks held in its in-memory peer tier
    (``out["in_memory"]``: a list per fetch). Returns what stops recording."""
    import logging

    real, logger = peers.fetch, logging.getLogger("ckpt.snapshot")
    out["logs"], out["in_memory"] = [], []

    class Keep(logging.Handler):
        def emit(self, record):
            out["logs"].append(record.getMessage())

    def fetch_and_look(tiers, *a, **k):
        got = real(tiers, *a, **k)
        out["in_memory"].append(sorted(i.id for i in dict(tiers.stores)["peer"].objects.list("chunks")))
        return got

    handler, level = Keep(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    peers.fetch = fetch_and_look

    def stop():
        logger.removeHandler(handler)
        logger.setLevel(level)
        peers.fetch = real

    return stop


def tiers_resume(rank, world, tmp, store, mode, steps, at=0, wipe=(), flip=None, big=False, count=False, garble=None,
                 kill_refill=False, delta=False, change=False, garble_only=None, kill_fetch=False,
                 lose=None, flip_bases=False, logs=False, room=None, bug=None):
    """:func:`ddp_resume` with local tiers: local snapshots every 2 steps, replicated to 1 peer
    rank, persisted every 4. ``resume`` first wipes the local tiers of the ranks in ``wipe`` (a
    replaced machine) and, on rank ``flip``, flips a byte of every chunk its tier holds of the
    newest snapshot (``flip``: a list, on each of those ranks; ``flip_bases``: and of the delta bases
    its manifest records); then reports ``mgr.last_restore``. ``big``: the state also holds a 64 MB
    tensor of zeros, shared by the ranks. ``killrep``: at step ``at`` that tensor becomes random
    (so rank 0, which saves it, replicates 64 MB to rank 1) and rank 0 is SIGKILLed right after
    posting that send, while it is in flight; rank 1 reports what its save and its tier made of it.
    ``count``: report how many chunk reads the restore (and its refill) made from this rank's tier, and
    the chunks the restore wrote there until it returned (``restore_chunk_writes``: [all, damaged]; the
    refill is held back until then).
    ``garble``: that rank damages the first copy it sends of half the chunks (or of those in ``garble_only``)
    during the restore (``out["garbled"]``: their ids); a wiped rank reports how many chunks it decoded from peers straight into
    its tensors (``filled``) and refused (``refused``). ``kill_refill``: a wiped rank is SIGKILLed in its
    refill, once it has written the first of the chunks it decoded into its tensors to its tier;
    ``kill_fetch``: right after its restore's fetch from peers, before the load.
    ``delta``: snapshots are stored as deltas against the previous one (local tiers too), and the state
    holds two 64 KiB tensors of the same random bytes until step 4; from step 5 one element of the
    second moves each step: step 6 stores it as a delta against a chunk the state also holds as it is;
    and a third whose one element moves each step (a delta against its chunk of the step before)
    (``out["extra"]``: their bits; ``out["restore_checks"]``: the chunk checks (decodes before a write)
    the restore made until it returned). ``change``: a wiped rank changes a tensor right after its
    restore, before its refill reads it (``out["tier_warnings"]``: the TierWarnings until ``wait()``);
    ``lose``: a wiped rank deletes that chunk from its tier then (the same warnings reported).
    ``logs``: a wiped rank reports what its restore logged and held in memory (:func:`_record_fetches`).
    ``room``: a wiped rank fills the medium of its tier (a small tmpfs, say) but ``room`` bytes before it
    restores; ``out["extra_at"]``: the ``delta`` tensors' bits at step ``at`` (``full``) or right after the
    restore. ``bug``: on that rank, the restore's checks of the chunks from peers raise a TypeError (a bug) on
    those the durable store holds too (:func:`_bug_in_checks`; put right before the refill)."""
    import shutil
    import warnings

    import torch.distributed as dist

    import ckpt

    local = os.path.join(tmp, "local")
    state = _ddp_state(rank)
    if big:
        import torch

        state["big"] = torch.zeros(16 << 20)
    if delta:
        import torch

        state["frozen"] = torch.randn(16 << 10, generator=torch.Generator().manual_seed(7))
        state["moving"] = state["frozen"].clone()
        state["drift"] = torch.randn(16 << 10, generator=torch.Generator().manual_seed(8))
    losses = {}
    mgr = None
    start = 0
    out = {}
    if mode == "resume":
        if rank in wipe:
            shutil.rmtree(os.path.join(local, f"rank-{rank}"), ignore_errors=True)
        if rank == flip or isinstance(flip, list) and rank in flip:
            out["flipped"] = _flip_newest(os.path.join(local, f"rank-{rank}"), bases=flip_bases)
        dist.barrier()
    if mode != "full":
        mgr = ckpt.CheckpointManager(store, "ddp", every_n_steps=4, local=local, local_every_n_steps=2, replicas=1,
                                     process_group=dist.group.WORLD, timeout_s=30, delta_vs_previous=delta,
                                     local_compress=delta)
    if mode == "resume":
        if room is not None and rank in wipe:
            from integration_util import fill_medium

            fill_medium(os.path.join(local, f"rank-{rank}", "ballast"), room)  # (the tmpfs is the tier's folder)
        reads = count_chunk_reads(mgr._local.store.objects.backend) if count else None
        writes = count_chunk_writes(mgr._local.store) if count else None
        gate = threading.Event()
        if count or change or delta or lose or bug is not None:  # the refill (queued on the save thread) waits until the restore is counted
            mgr._pool.submit(gate.wait, 60)
        checks = _count_checks() if delta and rank in wipe else None
        undo = _garble_first_sends(mgr._group_path.peers, out, garble_only) if rank == garble else None
        if garble is not None and rank in wipe:
            undo = _count_decoded(out)
        if kill_refill and rank in wipe:
            _kill_in_refill(tmp)
        if kill_fetch and rank in wipe:
            _kill_after_fetch(mgr._group_path.peers)
        stop_recording = _record_fetches(mgr._group_path.peers, out) if logs and rank in wipe else None
        unbug = _bug_in_checks(store) if rank == bug else None
        start = mgr.restore_latest(state)
        if unbug is not None:
            unbug()
        if stop_recording is not None:
            stop_recording()
        if checks is not None:
            out["restore_checks"] = checks()
        if undo is not None:
            undo()
        assert start == state["step"], (start, state["step"])
        out["restore"] = mgr.last_restore
        if delta:
            out["extra_at"] = [bits(state["frozen"]), bits(state["moving"]), bits(state["drift"])]
        if writes is not None:
            out["restore_chunk_writes"] = list(writes)
        if (change or lose) and rank in wipe:
            if change:
                state["model"].module[0].weight.data[0, 0] += 1  # training moved on before the refill read it
            if lose:
                mgr._local.store.objects.delete("chunks", lose)  # the tier lost it before the refill
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gate.set()
                mgr.wait()
            out["tier_warnings"] = [str(w.message) for w in caught if w.category is ckpt.TierWarning]
        gate.set()
        if reads is not None:
            mgr.wait()  # (the refill runs in the save thread)
            out["tier_chunk_reads"] = reads[0]
    for step in range(start + 1, steps + 1):
        losses[step] = _ddp_step(state)
        state["step"] = step
        if delta:
            state["moving"][0] = state["frozen"][0] + max(0, step - 4)
            state["drift"][1] = step  # (a delta against its own chunk of the step before)
        if mode == "full" and step == at:
            out["bits_at"] = _ddp_bits(state)
            if delta:
                out["extra_at"] = [bits(state["frozen"]), bits(state["moving"]), bits(state["drift"])]
        if mode == "killrep" and step == at:
            return _kill_in_replication(rank, state, mgr, step)
        if mode in ("crash", "killrep") and mgr.maybe_save(step, state) and step == at:
            mgr.wait()
            _ddp_step(state)
            _ddp_step(state)
            os.kill(os.getpid(), signal.SIGKILL)
    if mgr is not None:
        mgr.wait()  # (a restore's refill of the tier runs in the save thread)
        out["local_steps"] = mgr.local_tier.steps
        mgr.close()
    if delta:
        out["extra"] = [bits(state["frozen"]), bits(state["moving"]), bits(state["drift"])]
    return {**out, "losses": losses, "bits": _ddp_bits(state)}


def _count_checks():
    """Count the chunks ckpt.store.copy's checkers decode from now on; returns a function that stops
    counting and gives the count."""
    import ckpt.store.copy as copy_module

    real, n = copy_module.decode_chunk, [0]

    def counting(*a, **k):
        n[0] += 1
        return real(*a, **k)

    copy_module.decode_chunk = counting

    def stop():
        copy_module.decode_chunk = real
        return n[0]

    return stop


def tiers_rollback(rank, world, tmp, store):
    """Local tiers (every 2 steps, persisted every 4): train to 12, go back to step 4 and train on to 6
    (a new timeline). A fresh manager's restore_latest must give step 6, bit for bit, not the abandoned
    step 12: first with the local tiers, then with them wiped (from the durable store)."""
    import shutil

    import torch.distributed as dist

    import ckpt

    local = os.path.join(tmp, "local")
    state = _ddp_state(rank)

    def manager():
        return ckpt.CheckpointManager(store, "ddp", every_n_steps=4, local=local, local_every_n_steps=2, keep_last=1,
                                      keep_every=4, process_group=dist.group.WORLD, timeout_s=30)

    mgr = manager()
    _ddp_train(mgr, state, range(1, 13))
    mgr.restore(state, 4)
    _ddp_train(mgr, state, (5, 6))
    mgr.close()
    want = _ddp_bits(state)
    out = {}
    for wipe in (False, True):
        if wipe:
            shutil.rmtree(os.path.join(local, f"rank-{rank}"))
            dist.barrier()
        fresh = _ddp_state(rank)
        mgr = manager()
        out[f"wiped={wipe}"] = [mgr.restore_latest(fresh), mgr.last_restore["store"] > 0, _ddp_bits(fresh) == want]
        mgr.close()
    return out


def tiers_rollback_unread(rank, world, tmp, store):
    """Local tiers (every 2 steps, persisted every 4): train to 8; a fresh manager goes back to step 4
    and trains on to 6, but rank 1's first read of the durable RUN/latest fails (a transient I/O
    error), so only rank 0 sees that step 6 begins a new timeline. Returns the step the durable store's
    RUN/latest names afterwards, and what a fresh manager restores (step, bit-identical to step 6)."""
    import torch.distributed as dist

    import ckpt

    local = os.path.join(tmp, "local")
    state = _ddp_state(rank)

    def manager():
        return ckpt.CheckpointManager(store, "ddp", every_n_steps=4, local=local, local_every_n_steps=2,
                                      process_group=dist.group.WORLD, timeout_s=10)

    mgr = manager()
    _ddp_train(mgr, state, range(1, 9))
    mgr.close()
    mgr = manager()
    if rank == 1:
        real, failed = mgr.store.manifest, []

        def manifest(ref, *args, **kwargs):
            if ref == "ddp/latest" and not failed:
                failed.append(ref)
                raise OSError(5, "Input/output error (injected)", ref)
            return real(ref, *args, **kwargs)

        mgr.store.manifest = manifest
    mgr.restore(state, 4)
    _ddp_train(mgr, state, (5, 6))
    mgr.close()
    want = _ddp_bits(state)
    latest = ckpt.Store.open(store).manifest("ddp/latest").extra["snapshot"]["step"]
    fresh = _ddp_state(rank)
    mgr = manager()
    restored = mgr.restore_latest(fresh)
    mgr.close()
    return {"durable_latest": latest, "restored": restored, "exact": _ddp_bits(fresh) == want}


def tiers_restore_unread(rank, world, tmp, store, failing, missing=False):
    """Local tiers (every 2 steps, persisted every 4): train to 9 (durable 4, 8; local 6, 8). A fresh
    manager restores while rank ``failing``'s read of the durable RUN/latest fails: an I/O error, or with
    ``missing`` a RefNotFoundError (a listing that lags). Returns the outcome, its seconds, and whether
    the state is bit-identical to step 8's."""
    import torch.distributed as dist

    import ckpt
    from ckpt_store.storage.errors import RefNotFoundError

    local = os.path.join(tmp, "local")
    state = _ddp_state(rank)

    def manager():
        return ckpt.CheckpointManager(store, "ddp", every_n_steps=4, local=local, local_every_n_steps=2, replicas=1,
                                      process_group=dist.group.WORLD, timeout_s=20)

    mgr = manager()
    _ddp_train(mgr, state, range(1, 9))
    mgr.wait()
    want = _ddp_bits(state)
    _ddp_train(mgr, state, [9])
    mgr.close()
    mgr = manager()
    if rank == failing:
        real = mgr.store.resolve

        def resolve(ref, *args, **kwargs):
            if ref == "ddp/latest":
                raise RefNotFoundError(ref) if missing else OSError(5, "Input/output error (injected)", ref)
            return real(ref, *args, **kwargs)

        mgr.store.resolve = resolve
    fresh = _ddp_state(rank)
    t0 = time.monotonic()
    try:
        outcome = mgr.restore_latest(fresh)
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    mgr.close()
    return {"outcome": outcome, "seconds": seconds, "exact": _ddp_bits(fresh) == want}


def tiers_pushed_latest(rank, world, tmp, store):
    """Local tiers (every 2 steps, persisted every 4): train to 8, then a user's checkpoint is pushed as
    RUN/latest. Fresh managers (with the run's tiers, with fresh empty ones, without tiers) restore and
    ask for the latest step: what each call raised or returned, by case."""
    import torch
    import torch.distributed as dist

    import ckpt

    def manager(local):
        kw = {} if local is None else {"local": local, "local_every_n_steps": 2, "replicas": 1}
        return ckpt.CheckpointManager(store, "ddp", every_n_steps=4, process_group=dist.group.WORLD, timeout_s=20, **kw)

    mgr = manager(os.path.join(tmp, "local"))
    _ddp_train(mgr, _ddp_state(rank), range(1, 9))
    mgr.close()
    if rank == 0:
        ckpt.Store.open(store).push({"w": torch.arange(4.0)}, "ddp/latest")
    dist.barrier()
    out = {}
    for case, local in (("tiers", os.path.join(tmp, "local")), ("fresh", os.path.join(tmp, "fresh")), ("none", None)):
        mgr = manager(local)
        for call in ("latest_step", "restore_latest"):
            try:
                got = mgr.latest_step() if call == "latest_step" else mgr.restore_latest(_ddp_state(rank))
                out[f"{case} {call}"] = got
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[f"{case} {call}"] = f"{type(e).__name__}: {e}"
        mgr.close()
    return out


def tiers_persist_over_pushed_latest(rank, world, tmp, store):
    """Local tiers (every 2 steps, persisted every 4): train to 4; rank 0 pushes a user's checkpoint as
    ``ddp/latest``; train on to 8, whose persist moves ddp/latest to step 8. The TierWarnings each rank saw
    while training on, and where ddp/latest ended."""
    import warnings

    import torch
    import torch.distributed as dist

    import ckpt

    state = _ddp_state(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = ckpt.CheckpointManager(store, "ddp", every_n_steps=4, process_group=dist.group.WORLD, timeout_s=20,
                                     local=os.path.join(tmp, "local"), local_every_n_steps=2, replicas=1)
        _ddp_train(mgr, state, range(1, 5))
        mgr.wait()
        pushed = ckpt.Store.open(store).push({"w": torch.arange(4.0)}, "ddp/latest") if rank == 0 else None
        dist.barrier()
        _ddp_train(mgr, state, range(5, 9))
        mgr.close()
    latest = ckpt.Store.open(store).manifest("ddp/latest")
    return {"pushed": pushed, "warnings": [str(w.message) for w in caught if issubclass(w.category, ckpt.TierWarning)],
            "latest": latest.extra["snapshot"]["step"]}


def tiers_removed_latest(rank, world, tmp, store):
    """Local tiers (every 2 steps, persisted every 4): train to 8, then ``ckpt rm ddp/latest`` (what the refusal of
    a checkpoint pushed there advises). Fresh managers (with the run's tiers, with fresh empty ones, without tiers)
    ask for the latest step and restore: by case, what each gave, whether the state is bit-identical to step 8's,
    and the warnings."""
    import warnings

    import torch.distributed as dist

    import ckpt

    def manager(local):
        kw = {} if local is None else {"local": local, "local_every_n_steps": 2, "replicas": 1}
        return ckpt.CheckpointManager(store, "ddp", every_n_steps=4, process_group=dist.group.WORLD, timeout_s=20, **kw)

    state = _ddp_state(rank)
    mgr = manager(os.path.join(tmp, "local"))
    _ddp_train(mgr, state, range(1, 9))
    mgr.close()
    want = _ddp_bits(state)
    if rank == 0:
        ckpt.Store.open(store).remove("ddp/latest")
    dist.barrier()
    out = {}
    for case, local in (("tiers", os.path.join(tmp, "local")), ("fresh", os.path.join(tmp, "fresh")), ("none", None)):
        mgr = manager(local)
        fresh = _ddp_state(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = [mgr.latest_step(), mgr.restore_latest(fresh)]
            except Exception as e:  # noqa: BLE001 - reported to the test
                got = f"{type(e).__name__}: {e}"
        mgr.close()
        out[case] = {"got": got, "exact": _ddp_bits(fresh) == want, "warnings": [str(w.message) for w in caught]}
    return out


def _ddp_sync_manager(store):
    """A manager of run "ddp" saving synchronously over the whole group, with no tiers."""
    import torch.distributed as dist

    import ckpt

    return ckpt.CheckpointManager(store, "ddp", save_mode="sync", process_group=dist.group.WORLD, timeout_s=20)


def _ddp_saved_steps_1_to_4(rank, store):
    """DDP state trained and saved at steps 1..4 by a manager then closed: the bits of step 4's state."""
    state = _ddp_state(rank)
    mgr = _ddp_sync_manager(store)
    for step in range(1, 5):
        _ddp_step(state)
        state["step"] = step
        mgr.save(step, state)
    mgr.close()
    return _ddp_bits(state)


def restore_stale_view(rank, world, tmp, store, view):
    """DDP state saved at steps 1..4 (no tiers); a fresh manager restores the latest while rank 1 sees
    the store's RUN/latest apart (a shared file system's stale listing): ``stale``, still naming step 3;
    ``missing``, no ref at all (rank 1 then finds no step-4 either). Returns what restore_latest and
    ``restore(state, 4)`` gave and whether each left the state bit-identical to step 4's."""
    from ckpt_store.storage.errors import RefNotFoundError

    want = _ddp_saved_steps_1_to_4(rank, store)
    mgr = _ddp_sync_manager(store)
    if rank == 1:
        real = mgr.store.resolve

        def resolve(ref, *args, **kwargs):
            if ref == "ddp/latest" and view == "stale":
                return real("ddp/step-3")
            if view == "missing":
                raise RefNotFoundError(ref)
            return real(ref, *args, **kwargs)

        mgr.store.resolve = resolve
    fresh = _ddp_state(rank)
    t0 = time.monotonic()
    restored = mgr.restore_latest(fresh)
    out = {"restored": restored, "exact": _ddp_bits(fresh) == want}
    fresh = _ddp_state(rank)
    out["restore_4"] = mgr.restore(fresh, 4)
    out["exact_4"] = _ddp_bits(fresh) == want
    out["seconds"] = time.monotonic() - t0
    mgr.close()
    return out


def latest_step_unread(rank, world, tmp, store, failing):
    """DDP state saved at steps 1..4 (no tiers); a fresh manager asks for latest_step while rank ``failing``'s
    read of a manifest fails (an I/O error), then restores. Returns what each call gave (or raised) and whether
    the restored state is bit-identical to step 4's."""
    want = _ddp_saved_steps_1_to_4(rank, store)
    mgr = _ddp_sync_manager(store)
    real = mgr.store.manifest
    if rank == failing:
        def manifest(ref, *args, **kwargs):
            raise OSError(5, "Input/output error (injected)", ref)

        mgr.store.manifest = manifest
    out = {}
    try:
        out["latest_step"] = mgr.latest_step()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["latest_step"] = f"{type(e).__name__}: {e}"
    mgr.store.manifest = real
    fresh = _ddp_state(rank)
    out["restored"] = mgr.restore_latest(fresh)
    out["exact"] = _ddp_bits(fresh) == want
    mgr.close()
    return out


def tiers_left_timeline(rank, world, tmp, store):
    """Local tiers (every 2 steps, persisted every 10): the run trains to 12 with its tiers on "node A",
    is begun anew under its name with tiers on "node B" (its step 2 persisted: a save below the durable
    step) and trains to 8; then restarts on node A. Returns what that restore gave, whether the state is
    node B's step 2, bit for bit, and the TierWarnings."""
    import warnings

    import torch.distributed as dist

    import ckpt

    def manager(node):
        return ckpt.CheckpointManager(store, "ddp", every_n_steps=10, local=os.path.join(tmp, node), local_every_n_steps=2,
                                      replicas=1, process_group=dist.group.WORLD, timeout_s=20)

    def train(mgr, state, steps):
        for step in steps:
            _ddp_train(mgr, state, [step])
            mgr.wait()

    mgr, state = manager("node-a"), _ddp_state(rank)
    train(mgr, state, range(1, 13))
    mgr.close()
    mgr, state = manager("node-b"), _ddp_state(rank)
    train(mgr, state, range(1, 3))
    want = _ddp_bits(state)
    train(mgr, state, range(3, 9))
    mgr.close()
    mgr, fresh = manager("node-a"), _ddp_state(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = mgr.restore_latest(fresh)
    mgr.close()
    return {"restored": restored, "exact": _ddp_bits(fresh) == want,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, ckpt.TierWarning)]}


def _kill_in_replication(rank, state, mgr, step):
    """Save ``step`` with 64 MB of new shared data: rank 0 dies once it has posted over 40 MB of the
    sends of it to its replica (a transfer goes in rounds of 32 MB: one has gone, the next is posted); rank 1 returns its warnings and what its tier holds afterwards."""
    import warnings

    import torch
    import torch.distributed as dist

    import ckpt

    state["big"] = torch.randn(16 << 20, generator=torch.Generator().manual_seed(step))  # the same on every rank
    if rank == 0:
        real, posted = dist.isend, [0]

        def isend_then_die(tensor, *args, **kwargs):
            work = real(tensor, *args, **kwargs)
            posted[0] += tensor.numel()
            if posted[0] > 40 << 20:  # rounds of the big tensor have arrived, the rest is under way
                time.sleep(0.002)  # (part of it on the wire)
                os.kill(os.getpid(), signal.SIGKILL)
            return work

        dist.isend = isend_then_die
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.maybe_save(step, state)
        mgr.wait()
    assert rank != 0, "rank 0 replicated its snapshot and lived"
    from ckpt.store.copy import chunk_checker

    tier = ckpt.Store.open(mgr.local_tier.path)
    check, bad, n = chunk_checker(tier, tier), [], 0
    for info in tier.objects.list("chunks"):  # every chunk this tier holds, whoever sent it, re-hashed
        n += 1
        try:
            check(info.id, tier.objects.get("chunks", info.id))
        except Exception as e:  # noqa: BLE001 - reported to the test
            bad.append(f"{info.id[:12]}: {e}")
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, ckpt.TierWarning)],
            "local_steps": mgr.local_tier.steps, "tier_bytes": mgr.local_tier.bytes, "chunks": n, "bad": bad,
            "temporaries": len(list(tier.objects.list_temporaries()))}


def halt(signum):
    """Send ``signum`` (SIGSTOP, SIGKILL) to this process and let it act before going on. Sent from
    a thread other than the one the kernel acts on it in, ``os.kill`` returns and the thread runs on
    for a moment before the process stops or dies (seen here under load: a replication ran to its
    end, and the stopped rank's peer never waited); the sleep lets the signal act first. After a
    SIGSTOP longer than the sleep and a SIGCONT, the sleep is already over."""
    os.kill(os.getpid(), signum)
    time.sleep(1.0)


def _stop_when_replicating(state, at):
    """SIGSTOP this process as its replication of step ``at`` begins (it keeps its connections open)."""
    from ckpt.snapshot.peers import Peers

    real = Peers.exchange

    def stall(self, sends, *args, **kwargs):
        if state["step"] == at:
            halt(signal.SIGSTOP)
        return real(self, sends, *args, **kwargs)

    Peers.exchange = stall


def _same_batch_step(model, opt, step):
    """One step on a batch seeded by ``step`` (the same on every rank: the state stays identical); the loss as float.hex."""
    import torch

    torch.manual_seed(step)
    loss = model(torch.randn(8, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item().hex()


def tiers_stall(rank, world, tmp, store, steps=4, at=2, timeout_s=5):
    """Identical plain training on every rank (no DDP: nothing in the training step waits for a
    peer), local snapshots every step, one replica, ``timeout_s``. At step ``at`` rank 1 stops
    (SIGSTOP) as its replication begins, keeping its connections open: rank 0's save gives up after
    ``timeout_s`` with a TierWarning and its training goes on to ``steps``."""
    import warnings

    import torch
    import torch.distributed as dist

    import ckpt
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt, "step": 0}
    mgr = ckpt.CheckpointManager(store, "stall", local=os.path.join(tmp, "local"), local_every_n_steps=1, replicas=1,
                                 process_group=dist.group.WORLD, timeout_s=timeout_s)
    if rank == 1:
        _stop_when_replicating(state, at)
    losses, waited = {}, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            losses[step] = _same_batch_step(model, opt, step)
            state["step"] = step
            if step <= at:
                t0 = time.monotonic()
                mgr.save(step, state)
                mgr.wait()
                waited = time.monotonic() - t0
    out = {"warnings": [str(w.message) for w in caught if issubclass(w.category, ckpt.TierWarning)],
           "losses": losses, "local_steps": mgr.local_tier.steps, "waited": waited}
    mgr.close()
    return out


def _stall_bits(state):
    """Parameters and optimizer state (moments, step counts), bit for bit."""
    opt = state["optim"].state_dict()
    return {"params": {k: bits(v) for k, v in state["model"].state_dict().items()},
            "optim": {str(i): {k: bits(v) for k, v in st.items()} for i, st in opt["state"].items()},
            "step": state["step"]}


def tiers_stall_recover(rank, world, tmp, store, mode, steps=8, at=2, timeout_s=5, gone=False):
    """Identical plain training on every rank (AdamW, no DDP), local snapshots every step, one replica,
    durable every 4 steps. ``train``: at step ``at`` rank 1 stops (SIGSTOP) as its replication begins;
    rank 0's save gives up after ``timeout_s``, and rank 0 wakes rank 1 (SIGCONT) a second later.
    Both train on to ``steps``, saving every step; returns each rank's TierWarnings and save errors,
    and the state's bits at each durable step. ``gone``: rank 0 SIGKILLs rank 1 instead. ``restore``: a fresh process restores the latest
    snapshot and the one of step 4; returns their bits."""
    import warnings

    import torch
    import torch.distributed as dist

    import ckpt

    torch.manual_seed(0 if mode == "train" else 1)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt, "step": 0}
    mgr = ckpt.CheckpointManager(store, "stall", every_n_steps=4, local=os.path.join(tmp, "local"), local_every_n_steps=1,
                                 replicas=1, process_group=dist.group.WORLD, timeout_s=timeout_s)
    if mode == "restore":
        out = {"latest": mgr.restore_latest(state), "restore": mgr.last_restore, "bits": _stall_bits(state)}
        out["step4"] = mgr.restore(state, 4)
        out["restore4"] = mgr.last_restore
        out["bits4"] = _stall_bits(state)
        out["durable"] = mgr.steps()
        mgr.close()
        return out
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())  # (the default group: not the manager's)
    groups = len(dist.distributed_c10d._world.pg_map)  # process groups that exist (with their sockets)
    if rank == 1:
        _stop_when_replicating(state, at)
    losses, saved, errors = {}, {}, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            losses[step] = _same_batch_step(model, opt, step)
            state["step"] = step
            try:
                mgr.maybe_save(step, state)
                mgr.wait()
            except Exception as e:  # noqa: BLE001 - reported to the test: training itself goes on
                errors[step] = f"{type(e).__name__}: {e}"
            if step % 4 == 0:
                saved[step] = _stall_bits(state)
            if rank == 0 and step == at:
                time.sleep(1)  # rank 1 has been stopped for longer than timeout_s
                os.kill(pids[1], signal.SIGKILL if gone else signal.SIGCONT)
    out = {"warnings": [str(w.message) for w in caught if issubclass(w.category, ckpt.TierWarning)],
           "errors": errors, "losses": losses, "saved": saved, "local_steps": mgr.local_tier.steps,
           "durable": mgr.steps(), "groups": [groups, len(dist.distributed_c10d._world.pg_map)]}
    mgr.close()
    return out


def tiers_replication(rank, world, tmp, store, bug=False):
    """Local tiers with one replica: a large frozen layer and a small trained one, saved twice.
    Returns the stored bytes each save sent to the replica. ``bug``: on every rank, the first save's
    publish of the manifest (before its collective) raises a TypeError (a bug); ``"writer"``: on rank 1,
    the first save's DCP writer does (the failure DCP gathers from the ranks, pickled)."""
    import torch
    import torch.distributed as dist

    import ckpt

    if bug == "writer" and rank == 1:
        from ckpt.dcp import Writer

        real_write = Writer.write_data

        def broken_write(self, plan, planner):
            Writer.write_data = real_write
            return len(None)

        Writer.write_data = broken_write
    elif bug is True:
        from ckpt.snapshot.peers import Peers

        real = Peers.publish

        def broken(self, published):
            Peers.publish = real
            return len(None)

        Peers.publish = broken
    torch.manual_seed(0)
    frozen, head = torch.nn.Linear(512, 512), torch.nn.Linear(512, 4)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    state = {"frozen": frozen, "head": head, "step": 0}
    mgr = ckpt.CheckpointManager(store, "rep", local=os.path.join(tmp, "local"), local_every_n_steps=1, replicas=1,
                                 process_group=dist.group.WORLD, timeout_s=30)
    sent = []
    for step in (1, 2):
        torch.manual_seed(step)
        head(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
        state["step"] = step
        mgr.save(step, state)
        mgr.wait()
        sent.append(mgr.last_save.replicated_bytes if mgr.last_save is not None else None)
    out = {"sent": sent, "local_steps": mgr.local_tier.steps, "durable_steps": mgr.steps()}
    mgr.close()
    return out


def tiers_exchange(rank, world, tmp, round_bytes):
    """Peers.exchange on its own: each rank holds blobs of sizes around ``round_bytes`` (some larger)
    and sends all of them to the next rank and two to the one after. Returns what arrived (blob ids,
    each checked against its bytes), the rounds handed over, and the buffers the transfer allocated."""
    import random

    import torch.distributed as dist

    import ckpt.snapshot.peer_group as G
    from ckpt.snapshot.local_tier import LocalTier
    from ckpt.snapshot.peers import Peers
    from ckpt_store.storage.objects import object_id

    tier = LocalTier(os.path.join(tmp, f"tier-{rank}"), "x")
    objects = tier.store.objects
    rng = random.Random(rank)
    ids = []
    for size in (10, round_bytes // 3, round_bytes // 2, 3 * round_bytes, 7, round_bytes, round_bytes + 1, 100)[: 5 + rank]:
        blob = rng.randbytes(size)
        ids.append(object_id(blob))
        objects.backend.write(objects.path("chunks", ids[-1]), blob)
    allocated = []
    real_empty = G._empty

    def recording(n):
        allocated.append(n)
        return real_empty(n)

    G._empty = recording
    peers = Peers(tier, dist.group.WORLD, 1)
    sends = {(rank + 1) % world: ids, (rank + 2) % world: ids[:2]}
    rounds, got = [], {}

    def sink(blobs):
        rounds.append([sum(len(b) for b in blobs.values()), len(blobs)])
        got.update({cid: object_id(bytes(b)) == cid for cid, b in blobs.items()})

    sent = peers.exchange(sends, sink, round_bytes=round_bytes)
    return {"ids": ids, "sent": sent, "got": got, "rounds": rounds, "allocated": allocated}


def _big_ddp_state(rank, seed=0):
    """DDP over 1 MB of weights with AdamW (~3 MB of state: more than a tiny tier holds), per-rank RNG."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ckpt

    torch.manual_seed(seed)  # DDP broadcasts rank 0's weights anyway
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + rank)
    return {"model": model, "optim": opt, "rng": ckpt.RNGState(), "step": 0}


def _big_step(state):
    import torch

    x = torch.randn(16, 512)
    loss = state["model"](x).square().mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    return loss.item().hex()


def _big_bits(state):
    import torch

    opt = state["optim"].state_dict()
    return {"params": {k: bits(v) for k, v in state["model"].state_dict().items()},
            "optim": {str(i): {k: bits(v) for k, v in st.items()} for i, st in opt["state"].items()},
            "torch_rng": bits(torch.get_rng_state()), "step": state["step"]}


def tiers_full(rank, world, tmp, store, mode, steps=8):
    """Local tiers under ``tmp/local`` (the test mounts a tiny tmpfs as some rank's tier), one replica,
    local snapshots every 2 steps, durable every 4. ``train``: train ``steps`` steps; returns the
    TierWarnings this rank saw, the state's bits at each durable step and what each store holds.
    ``restore``: a fresh state restores the latest snapshot, then step 4; returns their bits."""
    import warnings

    import torch.distributed as dist

    import ckpt

    state = _big_ddp_state(rank, seed=0 if mode == "train" else 1)
    mgr = ckpt.CheckpointManager(store, "full", every_n_steps=4, local=os.path.join(tmp, "local"), local_every_n_steps=2,
                                 replicas=1, process_group=dist.group.WORLD, timeout_s=30)
    out: dict = {}
    if mode == "restore":
        out["latest"] = mgr.restore_latest(state)
        out["restore"] = mgr.last_restore
        out["bits"] = _big_bits(state)
        out["step4"] = mgr.restore(state, 4)
        out["bits4"] = _big_bits(state)
        mgr.close()
        return out
    saved, losses = {}, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            losses[step] = _big_step(state)
            state["step"] = step
            if mgr.maybe_save(step, state) and step % 4 == 0:
                saved[step] = _big_bits(state)  # what the save took: nothing changes before the next step
        mgr.wait()
    out = {"warnings": [str(w.message) for w in caught if issubclass(w.category, ckpt.TierWarning)],
           "saved": saved, "losses": losses, "durable": mgr.steps(), "local_steps": mgr.local_tier.steps,
           "tier_bytes": mgr.local_tier.bytes, "last_tier": mgr.last_save.tier if mgr.last_save else None}
    mgr.close()
    return out


def tiers_room_order(rank, world, tmp, store):
    """Every rank's tier in one tmpfs (the test mounts it at ``tmp/local``), local_keep=4: step 1 saved before training
    (the weights alone, ~1 MiB), steps 2 and 4 after (with AdamW's moments, ~3 MiB), the group goes back to 2; another
    tenant (``tmp/local/tenant``) fills the tmpfs, the save of 3 runs out of space; the tenant frees 1.5 MiB and the
    group saves 5. Returns this rank's TierWarnings, its tier's steps, and whether a fresh state restores 5 and then
    2 from the tiers alone, bit-exact."""
    import warnings

    import torch.distributed as dist

    import ckpt

    local, tenant = os.path.join(tmp, "local"), os.path.join(tmp, "local", "tenant")
    state = _big_ddp_state(rank)

    def manager():
        return ckpt.CheckpointManager(store, "room", every_n_steps=100, local=local, local_every_n_steps=1, local_keep=4,
                                      process_group=dist.group.WORLD, timeout_s=30)

    def step(n, train=True):
        if train:
            _big_step(state)
        state["step"] = n
        mgr.save(n, state, persist=False)
        mgr.wait()

    mgr, bits = manager(), {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(1, train=False)
        step(2)
        bits[2] = _big_bits(state)
        step(4)
        mgr.restore(state, 2)
        if rank == 0:
            with open(tenant, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
        dist.barrier()
        step(3)
        dist.barrier()
        if rank == 0:
            os.truncate(tenant, max(os.path.getsize(tenant) - (3 << 19), 0))
        dist.barrier()
        step(5)
        bits[5] = _big_bits(state)
    out = {"warnings": [str(w.message) for w in caught if issubclass(w.category, ckpt.TierWarning)],
           "local_steps": mgr.local_tier.steps}
    mgr.close()
    if rank == 0:
        os.unlink(tenant)
    dist.barrier()
    mgr, fresh = manager(), _big_ddp_state(rank, seed=1)
    for n in (5, 2):
        out[f"restored{n}"] = [mgr.restore(fresh, n), mgr.last_restore["store"], _big_bits(fresh) == bits[n]]
    mgr.close()
    return out


def _flip_newest(path, bases=False):
    """Flip the last byte of every chunk of the newest snapshot in the tier at ``path`` (``bases``: and of
    the delta bases its manifest records for them); how many."""
    import ckpt
    from ckpt.snapshot.local_tier import LocalTier
    from ckpt_store.storage.chunk_lists import recorded_chains

    tier = LocalTier(path, "ddp")
    store = tier.store
    mid = store.resolve(tier.ref(tier.steps()[-1]))
    m = store.manifest(mid)
    ids = {c for t in m.tensors for c in t.chunks}
    if bases:
        ids.update(*recorded_chains(store.objects.get_manifest(mid)).values())
    n = 0
    for cid in sorted(ids):
        f = os.path.join(path, store.objects.path("chunks", cid))
        if os.path.exists(f):
            data = bytearray(open(f, "rb").read())
            data[-1] ^= 1
            open(f, "wb").write(bytes(data))
            n += 1
    del ckpt
    return n



def _flip_chunk(path, store, cid):
    """Flip the last byte of chunk ``cid`` in the store at ``path`` (a rank's tier)."""
    f = os.path.join(path, store.objects.path("chunks", cid))
    data = bytearray(open(f, "rb").read())
    data[-1] ^= 1
    open(f, "wb").write(bytes(data))


def tiers_damaged_frozen(rank, world, tmp, store, mode):
    """A group's fine-tune (a frozen first layer) in local tiers every step, one byte of the frozen weight's chunk
    flipped in the rank's tier after steps 1-3 (the tests run one rank: two would restore it from each other's replica). ``local_only``: never persisted, so no snapshot can be assembled:
    restore_latest fails; then the run begun again from scratch saves step 1. ``no_room``: persisted every step, deltas
    against the previous one, compressed; the restore of step 3 reads the chunk from the durable store, but writing the
    verified copy over the damaged one fails (ENOSPC), so the refill removes it with the steps naming it, step 3 too;
    then steps 4 and 5 are saved. Returns what the tier holds, whether it verifies, the TierWarnings, the saves' tiers."""
    import errno
    import warnings

    import torch
    import torch.distributed as dist

    import ckpt
    import ckpt.snapshot.peer_refill as peer_refill
    from ckpt.snapshot.local_tier import LocalTier

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        m[0].weight.requires_grad_(False)
        return m

    local = os.path.join(tmp, "local")
    kw = dict(save_mode="sync", local=local, local_every_n_steps=1, process_group=dist.group.WORLD, timeout_s=30)
    if mode == "no_room":
        kw.update(every_n_steps=1, delta_vs_previous=True, local_compress=True)
    m = model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.TierWarning)  # (local only: never persisted, as meant)
        with ckpt.CheckpointManager(store, "run", **kw) as mgr:
            for step in (1, 2, 3):
                with torch.no_grad():
                    m[1].weight.add_(1)
                mgr.save(step, {"model": m})
    path = os.path.join(local, f"rank-{rank}")
    tier = LocalTier(path, "run")
    entry = next(t for t in tier.store.manifest("run/step-3").tensors if "0.weight" in t.name)
    _flip_chunk(path, tier.store, entry.chunks[0])
    tier.close()
    dist.barrier()
    out: dict = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mgr = ckpt.CheckpointManager(store, "run", **kw)
        if mode == "local_only":
            try:
                mgr.restore_latest({"model": model()})
                out["restored"] = True
            except ckpt.CkptError as e:
                out["restored"] = type(e).__name__
            mgr.wait()
            out["after"] = mgr.local_tier.steps
            mgr.save(1, {"model": model()})
            mgr.wait()
        else:
            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            real, peer_refill.keep_copies = peer_refill.keep_copies, full
            m = model()
            out["restored"] = mgr.restore_latest({"model": m})
            mgr.wait()
            peer_refill.keep_copies = real
            out["after"] = mgr.local_tier.steps
            out["saved"] = []
            for step in (4, 5):
                with torch.no_grad():
                    m[1].weight.add_(1)
                mgr.save(step, {"model": m})
                mgr.wait()
                out["saved"].append(mgr.last_save.tier if mgr.last_save else None)
        out["steps"] = mgr.local_tier.steps
        mgr.close()
    out["warnings"] = [str(w.message) for w in said if issubclass(w.category, ckpt.TierWarning)]
    tier = LocalTier(path, "run")
    out["verify"] = tier.store.verify().ok
    tier.close()
    return out


def tiers_rank_lost_base(rank, world, tmp, store):
    """Two ranks, deltas against the previous snapshot, compressed tiers, persisted every step; each rank's own layer
    (PerRank) besides a shared model. After steps 1-3 a byte of one of rank 1's own chunks of step 3 flips in its tier;
    the restore of step 3 reads it from the durable store, and rank 1's refill cannot write the verified copy over it
    (ENOSPC): it removes the chunk with the steps naming it, step 3 too, on rank 1 alone. Rank 0 still names step 3 as
    the next save's delta base. Saves 4 and 5 follow, then a fresh state restores the latest. Returns the steps each
    tier holds, where each save went, and whether the restored state is the saved one, bit for bit."""
    import errno
    import warnings

    import torch
    import torch.distributed as dist

    import ckpt
    import ckpt.snapshot.peer_refill as peer_refill
    from ckpt.snapshot.local_tier import LocalTier
    from ckpt.snapshot.state import PerRank

    def fresh(seed=0):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        mine = torch.nn.Linear(256, 256)
        with torch.no_grad():
            mine.weight.fill_(rank + 1.0)
        return m, mine

    def train(m, mine):
        with torch.no_grad():
            m[0].weight.add_(1)
            mine.weight.add_(1)

    def bits(m, mine):
        import hashlib

        return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest()
                for k, v in {**m.state_dict(), **{f"mine.{k}": v for k, v in mine.state_dict().items()}}.items()}

    local = os.path.join(tmp, "local")
    kw = dict(save_mode="sync", local=local, local_every_n_steps=1, every_n_steps=1, delta_vs_previous=True,
              local_compress=True, process_group=dist.group.WORLD, timeout_s=30)
    m, mine = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.TierWarning)
        with ckpt.CheckpointManager(store, "run", **kw) as mgr:
            for step in (1, 2, 3):
                train(m, mine)
                mgr.save(step, {"model": m, "mine": PerRank(mine)})
    path = os.path.join(local, f"rank-{rank}")
    if rank == 1:
        tier = LocalTier(path, "run")
        held = [c for t in tier.store.manifest("run/step-3").tensors if "rank-1" in t.name and "weight" in t.name
                for c in t.chunks if tier.store.objects.has("chunks", c)]
        _flip_chunk(path, tier.store, held[0])
        tier.close()
    dist.barrier()
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.TierWarning)
        mgr = ckpt.CheckpointManager(store, "run", **kw)
        real = peer_refill.keep_copies
        if rank == 1:
            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            peer_refill.keep_copies = full
        m, mine = fresh(1)
        out["restored"] = mgr.restore_latest({"model": m, "mine": PerRank(mine)})
        mgr.wait()
        peer_refill.keep_copies = real
        out["after"] = mgr.local_tier.steps
        out["saved"] = []
        for step in (4, 5):
            train(m, mine)
            mgr.save(step, {"model": m, "mine": PerRank(mine)})
            mgr.wait()
            out["saved"].append(mgr.last_save.tier if mgr.last_save else None)
        want = bits(m, mine)
        out["steps"] = mgr.local_tier.steps
        mgr.close()
        mgr = ckpt.CheckpointManager(store, "run", **kw)
        m, mine = fresh(2)
        out["latest"] = mgr.restore_latest({"model": m, "mine": PerRank(mine)})
        out["same"] = bits(m, mine) == want
        mgr.close()
    return out


def ranks_disagree(rank, world, tmp, store):
    """Plain (not DTensor) tensors that the ranks save under one name with different sizes or dtypes:
    each save's error (or the checkpoint id) and its seconds. Different names per rank are fine."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckpt.dcp

    cases = {"size": {"a": torch.arange(4.0 + 2 * rank)}, "dtype": {"a": torch.ones(3, dtype=(torch.float32, torch.float16)[rank])},
             "names": {"a": torch.ones(3), f"own{rank}": torch.full((2,), float(rank))}}
    from torch.distributed.tensor import Shard, distribute_tensor

    # a key named like a shard of another: same bytes, another dtype (once: one entry, a checkpoint that never loaded)
    cases["shard_named"] = {"x": distribute_tensor(torch.zeros(4), _mesh(world), [Shard(0)]), "x[0:2]": torch.zeros(2, dtype=torch.int32)}
    cases["steps"] = {"x": distribute_tensor(torch.arange(4.0), _mesh(world), [Shard(0)])}
    out = {}
    for case, state in cases.items():
        t0 = time.monotonic()
        try:
            name = f"{case}/x" if case != "steps" else f"steps/step-{7 + rank}"  # each rank its own step
            out[case] = dcp.save(state, storage_writer=ckpt.dcp.Writer(store, name)).storage_meta.checkpoint_id
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            failures = getattr(e, "failures", None) or {rank: (e, None)}
            err = next(iter(failures.values()))[0]
            out[case] = f"{type(err).__name__}: {err}"
        out[f"{case}_s"] = time.monotonic() - t0
    return out



def forged_key_path(rank, world, tmp, store):
    """A snapshot whose record of key paths (DCP's planner_data) was edited to put a list item at
    index ``i``: the restore's outcome for each ``i`` (one rank)."""
    import json

    import torch
    import torch.distributed as dist

    import ckpt
    from ckpt.format.manifest import Manifest
    from ckpt_store.storage.commit import commit

    out = {}
    with ckpt.CheckpointManager(store, "run", save_mode="sync", process_group=dist.group.WORLD, timeout_s=20) as mgr:
        mgr.save(1, {"pos": {"a": [torch.ones(2), 3]}, "step": 1})
        s = ckpt.Store.open(store)
        saved = s.manifest("run/step-1").to_json()
        raw = json.loads(saved)
        damaged_steps = {"step": "five", "step=-1": -1, "step=True": True}  # (True is an int to Python)
        for step, i in ((2, 10**12), (3, -1), (4, "size"), (5, "step"), (5, "step=-1"), (5, "step=True"), (6, "keys"),
                        (7, "per_rank")):
            if i in (*damaged_steps, "keys", "per_rank"):  # the snapshot's record of its step, keys or per-rank keys is malformed
                raw = json.loads(saved)
                raw["extra"]["snapshot"].update({"step": damaged_steps[i]} if i in damaged_steps else {"step": step, i: [["pos"]]})
                mid, _ = commit(s.objects, s.refs_db, Manifest.from_json(json.dumps(raw).encode(), "forged").to_json(), "run/step-5")
                s.refs_db.set("run/latest", mid, alias=True)
                try:
                    out[i] = f"restored {mgr.restore_latest({'pos': None, 'step': 0})}"
                except Exception as e:  # noqa: BLE001 - reported to the test
                    out[i] = f"{type(e).__name__}: {e}"
                continue
            if i == "size":  # a sane key path, and a tensor of 4 TiB whose one shard names the real entry
                raw["extra"]["dcp"]["planner_data"]["pos.a.1"] = ["pos", "a", 1]
                raw["extra"]["dcp"]["items"]["pos.a.0"].update(size=[2**40], shards=[{"offsets": [0], "sizes": [2**40], "entry": "pos.a.0"}])
            else:
                raw["extra"]["dcp"]["planner_data"]["pos.a.1"] = ["pos", "a", i]
            raw["extra"]["snapshot"]["step"] = step
            mid, _ = commit(s.objects, s.refs_db, Manifest.from_json(json.dumps(raw).encode(), "forged").to_json(), f"run/step-{step}")
            s.refs_db.set("run/latest", mid, alias=True)
            state = {"pos": None, "step": 0}
            try:
                out[str(i)] = f"restored {mgr.restore_latest(state)}: {state!r}"
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[str(i)] = f"{type(e).__name__}: {e}"
    return out



def forged_optimizer_path(rank, world, tmp, store):
    """A snapshot of an AdamW optimizer whose record of key paths (planner_data) names its state's
    parameter index otherwise: "²" (a digit to str.isdigit that int() refuses) or "x", for a tensor
    (exp_avg) and for a value (step). The restore's outcome for each (one rank)."""
    import json

    import torch
    import torch.distributed as dist

    import ckpt
    from ckpt.format.manifest import Manifest
    from ckpt_store.storage.commit import commit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, capturable=False)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    out = {}
    with ckpt.CheckpointManager(store, "opt", save_mode="sync", process_group=dist.group.WORLD, timeout_s=20) as mgr:
        mgr.save(1, {"opt": opt})
        s = ckpt.Store.open(store)
        saved = s.manifest("opt/step-1").to_json()
        for step, (item, index) in enumerate([("exp_avg", "²"), ("exp_avg", "x"), ("step", "²"), ("step", "x")], start=2):
            raw = json.loads(saved)
            pd = raw["extra"]["dcp"]["planner_data"]
            fqn = next(f for f, path in pd.items() if path[1:2] == ["state"] and path[-1] == item)
            pd[fqn] = [*pd[fqn][:2], index, *pd[fqn][3:]]
            raw["extra"]["snapshot"]["step"] = step
            mid, _ = commit(s.objects, s.refs_db, Manifest.from_json(json.dumps(raw).encode(), "forged").to_json(), f"opt/step-{step}")
            s.refs_db.set("opt/latest", mid, alias=True)
            fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
            try:
                out[f"{item}/{index}"] = f"restored {mgr.restore_latest({'opt': fresh})}"
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[f"{item}/{index}"] = f"{type(e).__name__}: {e}"
    return out


def save_fine_tunes(rank, world, tmp, store):
    """A base and two fine-tunes of one tensor, saved row-sharded over the ranks as d/base, d/ft1, d/ft2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckpt.dcp

    mesh = _mesh(world)
    for name, t in fine_tunes().items():
        dcp.save({"w": distribute_tensor(t, mesh, [Shard(0)])}, storage_writer=ckpt.dcp.Writer(store, f"d/{name}"))
    return {}


def fine_tunes():
    import torch

    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 32, generator=g)
    return {"base": base, "ft1": base + 0.01 * torch.randn(64, 32, generator=g), "ft2": base + 0.01 * torch.randn(64, 32, generator=g)}


def tiers_late_rank_asks(rank, world, tmp, store, asker, late, timeout_s=3):
    """Local tiers on every rank, no durable schedule. Step 1 is saved; at step 2 rank ``asker`` asks
    for the snapshot to be persisted (``save(2, persist=True)``), and rank ``late`` arrives after the
    others gave up waiting (``timeout_s``): the agreement round is abandoned. Returns, per step, what
    each save did ("ok", or the error or TierWarning), and the durable store's steps at the end."""
    import warnings

    import torch
    import torch.distributed as dist

    import ckpt

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    state = {"model": model, "step": 0}
    # (every_n_steps: none of these steps is due, what persists is asked for; without it the first save
    # warns that nothing is persisted)
    mgr = ckpt.CheckpointManager(store, "late", local=os.path.join(tmp, "local"), local_every_n_steps=1, every_n_steps=1000,
                                 process_group=dist.group.WORLD, timeout_s=timeout_s)
    done = {}
    for step in (1, 2, 3):
        state["step"] = step
        if step == 2 and rank == late:
            time.sleep(timeout_s + 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                mgr.save(step, state, persist=True if step == 2 and rank == asker else None)
                mgr.wait()
                done[step] = "ok"
            except Exception as e:  # noqa: BLE001 - reported to the test
                done[step] = f"{type(e).__name__}: {e}"
        warned = [str(w.message) for w in caught if issubclass(w.category, ckpt.TierWarning)]
        if warned and done[step] == "ok":
            done[step] = f"TierWarning: {warned[0]}"
        dist.barrier()  # (the default group: not the manager's) the ranks begin the next step together
    out = {"done": done, "durable": mgr.steps()}
    mgr.close()
    return out


def restore_peer_dies(rank, world, tmp, store, timeout_s=10):
    """Steps 1 and 2 saved by every rank; then a restore in which the last rank dies (SIGKILL) as it
    plans its part, after the ranks agreed on the snapshot: what the others' restore_latest raised,
    and after how many seconds."""
    import torch
    import torch.distributed as dist

    import ckpt
    from ckpt.snapshot.distributed import DistributedSnapshots

    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(8, 8), "step": 0}
    mgr = ckpt.CheckpointManager(store, "dies", save_mode="sync", process_group=dist.group.WORLD, timeout_s=timeout_s)
    for step in (1, 2):
        state["step"] = step
        mgr.save(step, state)
    if rank == world - 1:
        def die(self, *args, **kwargs):
            halt(signal.SIGKILL)

        DistributedSnapshots._plan_restore = die
    t0 = time.monotonic()
    try:
        got = f"restored {mgr.restore_latest(state)}"
    except BaseException as e:  # noqa: BLE001 - reported to the test
        got = f"{type(e).__name__}: {e}"
    return {"restore": got, "seconds": time.monotonic() - t0, "is_ckpt_error": got.split(":")[0] in ("SnapshotError", "GroupUnavailable")}


def save_stale_view(rank, world, tmp, store):
    """Steps 1..3 saved (no tiers) while the last rank's view of the store lags (a shared file system's
    stale listing): the refs a save just moved are not there yet for it. What each save gave, and
    the snapshot ids each rank's manager holds afterwards."""
    import torch
    import torch.distributed as dist

    import ckpt
    from ckpt_store.storage.errors import RefNotFoundError

    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(8, 8), "step": 0}
    mgr = ckpt.CheckpointManager(store, "lag", save_mode="sync", process_group=dist.group.WORLD, timeout_s=20)
    if rank == world - 1:
        real = mgr.store.resolve

        def resolve(ref, *args, **kwargs):
            if ref.startswith("lag/"):
                raise RefNotFoundError(ref)
            return real(ref, *args, **kwargs)

        mgr.store.resolve = resolve
    done = {}
    for step in (1, 2, 3):
        state["step"] = step
        try:
            mgr.save(step, state)
            done[step] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the test
            done[step] = f"{type(e).__name__}: {e}"
        dist.barrier()  # (the default group) the next step begins together, whatever this one did
    out = {"done": done, "last_id": mgr._path.last_id}
    mgr.close()
    return out


def load_missing(rank, world, tmp, store):
    """dcp.load of a ref that does not exist, named to the Reader and as checkpoint_id: each error's
    type, message and seconds; then a collective on the group, which every rank reaches at once."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckpt.dcp

    out = {}
    for case, load in {"reader": lambda: dcp.load({"w": torch.zeros(3)}, storage_reader=ckpt.dcp.Reader(store, "no/such")),
                       "checkpoint_id": lambda: dcp.load({"w": torch.zeros(3)}, checkpoint_id="no/such",
                                                         storage_reader=ckpt.dcp.Reader(store))}.items():
        t0 = time.monotonic()
        try:
            load()
            out[case] = "loaded"
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            out[case] = f"{type(e).__name__}: {e}"
        out[f"{case}_s"] = time.monotonic() - t0
    got = [None] * world
    dist.all_gather_object(got, rank)
    out["gathered"] = got
    return out


def load_lagging_view(rank, world, tmp, store, lagging):
    """dcp.load of a ref every rank but ``lagging`` finds: that rank is given a store where it is missing
    (a view of the store that lags). The ref named to the Reader and as checkpoint_id: each error's type
    and message; then a collective on the group, which every rank reaches together."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckpt.dcp

    url = os.path.join(tmp, "lagging") if rank == lagging else store
    out = {}
    group = dist.group.WORLD
    for case, load in {"reader": lambda: dcp.load({"w": torch.zeros(3)}, storage_reader=ckpt.dcp.Reader(url, "lag/x", process_group=group)),
                       "checkpoint_id": lambda: dcp.load({"w": torch.zeros(3)}, checkpoint_id="lag/x",
                                                         storage_reader=ckpt.dcp.Reader(url, process_group=group))}.items():
        try:
            load()
            out[case] = "loaded"
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            out[case] = f"{type(e).__name__}: {e}"
    got = [None] * world
    dist.all_gather_object(got, rank)
    out["gathered"] = got
    return out


def column_shards_to_rows(rank, world, tmp, store, chunk_size, saved=1, loaded=0, batch_bytes=None, piece_bytes=None):
    """A 512x1024 tensor saved sharded along dimension ``saved``, loaded sharded along ``loaded``:
    whether each rank's part came back bit for bit, the buffers the read allocated
    (ckpt/dcp/consolidate.py, with BATCH_BYTES and PIECE_BYTES as given) and the bytes of the
    region this rank reads from each stored shard."""
    import sys

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckpt.dcp
    import ckpt.dcp.consolidate
    from ckpt.settings import Settings

    if batch_bytes is not None:
        ckpt.dcp.consolidate.BATCH_BYTES, ckpt.dcp.consolidate.PIECE_BYTES = batch_bytes, piece_bytes
    mesh = _mesh(world)
    full = torch.randn(512, 1024, generator=torch.Generator().manual_seed(3))
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(saved)])},
             storage_writer=ckpt.dcp.Writer(store, "cols/x", settings=Settings(chunk_size=chunk_size)))
    into = {"w": distribute_tensor(torch.zeros(512, 1024), mesh, [Shard(loaded)])}
    real, sizes = torch.empty, []

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("dcp", "consolidate.py")):
            sizes.append(t.numel() * t.element_size())
        return t

    torch.empty = empty
    try:
        dcp.load(into, storage_reader=ckpt.dcp.Reader(store, "cols/x"))
    finally:
        torch.empty = real
    part = full.size(loaded) // world
    return {"exact": bits(into["w"].to_local()) == bits(full.narrow(loaded, rank * part, part)), "buffers": sizes,
            "region_bytes": 512 * 1024 * 4 // world // world}


def load_on_one_rank(rank, world, tmp, store):
    """Rank 0 alone loads (``no_dist=True``, the group initialized; rank 1 does not load): it must not
    wait for rank 1 in an agreement rank 1 never joins. Then a collective every rank reaches."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckpt.dcp

    out = {}
    if rank == 0:
        into = {"w": torch.zeros(3)}
        dcp.load(into, storage_reader=ckpt.dcp.Reader(store, "one/x"), no_dist=True)
        out["w"] = into["w"].tolist()
        try:
            dcp.load(into, storage_reader=ckpt.dcp.Reader(store, "one/missing"), no_dist=True)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            out["missing"] = type(e).__name__
    got = [None] * world
    dist.all_gather_object(got, rank)
    out["gathered"] = got
    return out


def plain_grad_values(rank, world, tmp, store):
    """Tensors kept as plain values (a learnable temperature, say), restored through a process group:
    each comes back with the requires_grad and the class it was saved with, bit for bit."""
    import torch
    import torch.distributed as dist

    import ckpt

    saved = {"temp": torch.tensor([0.25, -1.5], requires_grad=True), "scale": torch.nn.Parameter(torch.tensor(3.0)),
             "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False), "plain": torch.arange(3.0)}
    with ckpt.CheckpointManager(store, "grad", save_mode="sync", process_group=dist.group.WORLD, timeout_s=30) as mgr:
        mgr.save(1, {"model": plain_model(), "extra": saved})
        state = {"model": plain_model(), "extra": None}
        mgr.restore_latest(state)
    return {"got": {k: [type(v).__name__, v.requires_grad, v.is_leaf, bits(v)] for k, v in state["extra"].items()},
            "want": {k: [type(v).__name__, v.requires_grad, v.is_leaf, bits(v)] for k, v in saved.items()}}


def plain_value_devices(rank, world, tmp, store, device="cpu"):
    """A plain value's tensors (``device``) saved through a process group, restored into ``None``; then the
    snapshot's record of their devices forged (a device this machine lacks, malformed records) and restored
    into a zeroed model: what each restore gave, and whether the model was touched."""
    import copy
    import dataclasses

    import torch
    import torch.distributed as dist

    import ckpt
    from ckpt_store.storage.commit import commit

    value = {"t": torch.arange(4.0, device=device), "nested": [torch.tensor([0.5, -2.0], device=device), 3]}
    out = {}
    with ckpt.CheckpointManager(store, "dev", save_mode="sync", process_group=dist.group.WORLD, timeout_s=20) as mgr:
        mgr.save(1, {"model": plain_model(), "extra": value})
        state = {"model": plain_model(), "extra": None}
        mgr.restore_latest(state)
        got = state["extra"]
        out["restored"] = [str(got["t"].device), bits(got["t"].cpu()), str(got["nested"][0].device),
                           bits(got["nested"][0].cpu()), got["nested"][1]]
        out["saved"] = [device, bits(value["t"].cpu()), device, bits(value["nested"][0].cpu()), 3]
        s = ckpt.Store.open(store)
        m = s.manifest("dev/step-1")
        out["recorded"] = m.extra["snapshot"].get("devices")
        lacking = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        for step, (case, devices) in enumerate({"absent": {lacking: ["extra.t"]}, "malformed": {lacking: "extra.t"},
                                                "not-a-device": {"no such device": ["extra.t"]}}.items(), start=2):
            snap = {**copy.deepcopy(m.extra["snapshot"]), "step": step, "devices": devices}
            if rank == 0:
                mid, _ = commit(s.objects, s.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(),
                                f"dev/step-{step}")
                s.refs_db.set("dev/latest", mid, alias=True)
            dist.barrier()
            model = plain_model()
            torch.nn.init.zeros_(model[0].weight)
            try:
                out[case] = f"restored {mgr.restore_latest({'model': model, 'extra': None})}"
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[case] = f"{type(e).__name__}: {e} ({getattr(e, 'hint', '')})"
            out[f"{case}_touched"] = bool(model[0].weight.any())
    out["lacking"] = lacking
    return out


def small_tensors():
    """A transformer's state, as after training (no two tensors alike): many biases and norms of under 2 KiB."""
    import torch

    torch.manual_seed(7)
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    return {k: torch.randn_like(v) * 0.02 for k, v in model.state_dict().items()}


def save_small_tensors(rank, world, tmp, store, env):
    """Save :func:`small_tensors` (the same on every rank: DCP spreads the saving over the ranks) to ``store`` (S3)."""
    import torch.distributed.checkpoint as dcp

    import ckpt
    import ckpt.dcp

    os.environ.update(env)  # (the forkserver may have started before the test set its endpoint)
    s = ckpt.Store.open(store, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    md = dcp.save(small_tensors(), storage_writer=ckpt.dcp.Writer(s, "dist/small"))
    return {"id": md.storage_meta.checkpoint_id}


SCENARIOS = {"save_small_tensors": save_small_tensors, "preempt_ddp": preempt_ddp, "ddp_restore_bits": ddp_restore_bits, "tiers_resume": tiers_resume, "tiers_exchange": tiers_exchange, "tiers_full": tiers_full, "tiers_room_order": tiers_room_order, "tiers_stall": tiers_stall, "tiers_stall_recover": tiers_stall_recover, "tiers_replication": tiers_replication, "save_and_reshard": save_and_reshard, "manager": manager, "ddp_resume": ddp_resume,
             "ddp_restore_in_place": ddp_restore_in_place, "ddp_refusals": ddp_refusals,
             "fsdp_plain_state": fsdp_plain_state, "tiers_rollback": tiers_rollback,
             "tiers_rollback_unread": tiers_rollback_unread, "tiers_restore_unread": tiers_restore_unread,
             "tiers_pushed_latest": tiers_pushed_latest, "tiers_removed_latest": tiers_removed_latest,
             "tiers_persist_over_pushed_latest": tiers_persist_over_pushed_latest,
             "latest_step_unread": latest_step_unread,
             "restore_stale_view": restore_stale_view, "tiers_left_timeline": tiers_left_timeline,
             "ranks_disagree": ranks_disagree, "forged_key_path": forged_key_path,
             "save_fine_tunes": save_fine_tunes, "load_missing": load_missing,
             "tiers_late_rank_asks": tiers_late_rank_asks, "restore_peer_dies": restore_peer_dies,
             "save_stale_view": save_stale_view, "forged_optimizer_path": forged_optimizer_path,
             "plain_grad_values": plain_grad_values, "load_lagging_view": load_lagging_view,
             "column_shards_to_rows": column_shards_to_rows, "load_on_one_rank": load_on_one_rank,
             "plain_value_devices": plain_value_devices}


def restore_checks(rank, world, tmp, store):
    """Restores torch would take silently and wrongly, on a gloo group: an optimizer over the same
    parameters in another order, a scheduler of an optimizer with another number of groups, a grad scaler
    enabled otherwise. Each outcome, and whether the live state was left as it was."""
    import copy

    import torch
    import torch.distributed as dist

    import ckpt

    def outcome(fn):
        try:
            fn()
            return "ok"
        except BaseException as e:  # noqa: BLE001 - reported
            return f"{type(e).__name__}: {e}"

    def build(order=(0, 1, 2, 3), groups=2, scaler=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        ps = [list(model.parameters())[i] for i in order]
        split = [ps[:2], ps[2:]] if groups == 2 else [ps]
        opt = torch.optim.Adam([{"params": g, "lr": 1e-3 * (i + 1)} for i, g in enumerate(split)])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
        return {"model": model, "optim": opt, "sched": sched, "scaler": torch.amp.GradScaler("cpu", enabled=scaler)}

    def opt_bits(opt):
        return {i: {k: bits(v) for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}

    res: dict = {}
    state = build()
    for _ in range(2):
        state["optim"].zero_grad()
        state["model"](torch.ones(2, 4)).pow(2).sum().backward()
        state["optim"].step()
        state["sched"].step()
    group = dist.group.WORLD
    with ckpt.CheckpointManager(store, "r", save_mode="sync", process_group=group, timeout_s=30) as mgr:
        mgr.save(2, state)
        res["params"] = ckpt.Store.open(store).manifest("r/latest").extra["snapshot"].get("params")
        swapped = build(order=(2, 3, 0, 1))
        res["order"] = outcome(lambda: mgr.restore(swapped, 2))
        res["order_untouched"] = len(swapped["optim"].state) == 0
        fresh = build(groups=1)
        one, model = fresh["sched"], fresh["model"]
        with torch.no_grad():
            model[0].weight.add_(1.0)  # (not the saved weights: a load would change them)
        before = copy.deepcopy(one.state_dict()), {k: bits(v) for k, v in model.state_dict().items()}
        res["groups"] = outcome(lambda: mgr.restore({"model": model, "sched": one}, 2))
        res["groups_untouched"] = (one.state_dict(), {k: bits(v) for k, v in model.state_dict().items()}) == before
        res["scaler_off"] = outcome(lambda: mgr.restore({"scaler": torch.amp.GradScaler("cpu", enabled=False)}, 2))
        same = build()
        res["same"] = outcome(lambda: mgr.restore(same, 2))
        res["same_exact"] = opt_bits(same["optim"]) == opt_bits(state["optim"]) and \
            same["sched"].state_dict() == state["sched"].state_dict() and \
            same["scaler"].state_dict() == state["scaler"].state_dict()
    return res


def plain_value_structure(rank, world, tmp, store):
    """Plain values whose dicts DCP's names alone do not give back (keys out of sorted order, int keys, empty
    dicts, a list of dicts) saved through a process group and restored into ``None``, from the durable store
    and from a local tier: each as ``repr`` (key order and types); then the snapshot's record of their
    structure forged to name an item it lacks: what that restore gave, and whether the model was touched; then
    a save of dict keys that DCP's names cannot tell apart (1 and '1'; 'a.b' and 'a' holding 'b'): what it gave."""
    import copy
    import dataclasses

    import torch
    import torch.distributed as dist

    import ckpt
    from ckpt_store.storage.commit import commit

    values = {"sources": {"wiki": 3, "books": {"shard": 2, "offset": 7}, "arxiv": [{"z": 1, "a": (2, 3)}]},
              "shards": {3: "x", 1: {2: [torch.arange(2.0)]}}, "empty": {"done": {}, "n": 1, "deep": {"x": {}}},
              "listed": [{"b": 1, "a": 2}, {}], "plain": {"a": 1, "b": {"c": 2}}}
    out: dict = {"saved": repr(values)}
    for where, kw in (("store", {}), ("tier", {"local": os.path.join(tmp, "tier"), "every_n_steps": 1})):
        url = f"{store}-{where}"
        with ckpt.CheckpointManager(url, "run", save_mode="sync", process_group=dist.group.WORLD, timeout_s=30, **kw) as mgr:
            mgr.save(1, {"model": plain_model(), **values})
            state = {"model": plain_model(), **dict.fromkeys(values)}
            mgr.restore_latest(state)
        out[where] = repr({k: state[k] for k in values})
    s = ckpt.Store.open(f"{store}-store")
    m = s.manifest("run/step-1")
    out["recorded"] = sorted(m.extra["snapshot"].get("skeletons", {}))
    snap = copy.deepcopy(m.extra["snapshot"])
    snap["step"] = 2
    snap.setdefault("skeletons", {})["empty"] = {"done": {}, "n": None, "deep": {"x": None}}
    if rank == 0:
        mid, _ = commit(s.objects, s.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "run/step-2")
        s.refs_db.set("run/latest", mid, alias=True)
    dist.barrier()
    model = plain_model()
    torch.nn.init.zeros_(model[0].weight)
    with ckpt.CheckpointManager(f"{store}-store", "run", process_group=dist.group.WORLD, timeout_s=30) as mgr:
        try:
            out["forged"] = f"restored {mgr.restore_latest({'model': model, **dict.fromkeys(values)})}"
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["forged"] = f"{type(e).__name__}: {e}"
        out["forged_touched"] = bool(model[0].weight.any())
        for case, value in {"int_and_str": {1: "a", "1": "b"}, "dotted": {"a.b": 1, "a": {"b": 2}},
                            # names apart (what the keys hold differs), the keys alike: a traceback at each restore
                            "apart": {1: {"a": 1}, "1": {"b": 2}}, "apart_in_a_list": {1: [{"a": 1}], "1": {"b": 2}}}.items():
            try:
                mgr.save(3, {"model": model, "col": value})
                out[case] = "saved"
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[case] = f"{type(e).__name__}: {e}"
    out["steps"] = sorted(ckpt.Store.open(f"{store}-store").refs())
    return out


SCENARIOS["restore_checks"] = restore_checks
SCENARIOS["plain_value_structure"] = plain_value_structure
SCENARIOS["tiers_damaged_frozen"] = tiers_damaged_frozen
SCENARIOS["tiers_rank_lost_base"] = tiers_rank_lost_base
