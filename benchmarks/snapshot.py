"""Training-loop snapshots: ckpt's CheckpointManager beside torch.save, DCP, torchsnapshot and memcpy.

Run from the repository root (estimated 8-10 minutes on a quiet 2-core machine, about
twice that while other jobs load it; ``--small`` is a smoke test of 4-5 minutes, most
of it fixed costs: training steps, child processes)::

    . .venv/bin/activate
    pip install torchsnapshot==0.1.0        # optional: its column is skipped if missing
    python benchmarks/snapshot.py           # ~100M-param GPT + AdamW, 5 saves per contender
    python benchmarks/snapshot.py --small   # ~10M params, 3 saves

It prints markdown tables and writes them, with the command, date, machine facts and
versions, to ``benchmarks/results/snapshot.md`` (``--out`` changes that). Progress goes
to stderr. ``--only ckpt,dcp.async_save,memcpy`` runs a subset of the contenders.

One process trains one GPT-style decoder (untied head) with AdamW; every contender
saves the same live state ``{"model", "optim"}`` ``--saves`` times, with one real
training step (2 x 64 tokens) before each save:

* ``memcpy``: ``copy_`` of every tensor into preallocated, already-touched buffers (the floor);
* ``ckpt``: ``CheckpointManager(save_mode="async")`` with its defaults into a store on local disk (fsync on);
* ``ckpt-overlap``: the same with ``save_mode="overlap"``: parameters and optimizer state are
  copied while the next forward/backward runs, and the optimizer step waits for the copy;
  that wait counts as blocked time of the save;
* ``torch.save``: of the two state dicts into one file; durable after an fsync of file and folder;
* ``dcp.save`` / ``dcp.async_save``: ``torch.distributed.checkpoint`` with a
  ``FileSystemWriter(thread_count=2)`` (it fsyncs its files), one process, no process group;
* ``torchsnapshot.async_take`` (and ``torchsnapshot.take`` with ``--only``): durable after
  the benchmark fsyncs the files it wrote (torchsnapshot itself does not).

At most one save is in flight, as the DCP docs recommend for ``async_save``: before
saving, the loop waits for the previous save to be durable, and that wait counts as
blocked time (ckpt's ``save`` does the same wait itself). *Blocked* is the time the
training thread spends in the save (waiting included); *durable* runs from the save
call until the data is on disk, measured by a watcher thread while training goes on.
The first save of each contender is reported on its own (warm-up: page faults of new
buffers), the rest as medians.

Then: bytes written per save (full training, and a fine-tune whose embeddings and lower
half of the blocks are frozen and left out of the optimizer); restore into the live
model and optimizer from a warm and a cold page cache (``os.sync`` +
``POSIX_FADV_DONTNEED`` on every file the contender reads), checked bit for bit; and the
peak resident memory of each contender's saves, each in a fresh child process (VmHWM,
reset through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

# Run as a script, Python puts benchmarks/ first on sys.path, where benchmarks/storage.py
# would shadow the ``storage`` package that ckpt imports; the repository root goes first.
_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

import torch
import torch.nn.functional as F

from benchmarks.models import GPTConfig, TinyGPT

RESULTS = ROOT / "benchmarks" / "results" / "snapshot.md"
VOCAB, CONTEXT, LAYERS, HEAD_DIM = 32000, 128, 12, 64
BATCH, SEQ = 2, 64
LR = 3e-4
RESTORE_REPS = 3
MB = 1e6
CONTENDER_NAMES = ("memcpy", "ckpt", "ckpt-overlap", "ckpt-delta", "torch.save", "dcp.save", "dcp.async_save",
                   "torchsnapshot.take", "torchsnapshot.async_take")
DEFAULT_CONTENDERS = tuple(n for n in CONTENDER_NAMES if n != "torchsnapshot.take")

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", category=FutureWarning)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- model and training ----------------------------------------------------------------------


def gpt_params(cfg: GPTConfig) -> int:
    """Parameter count of :class:`TinyGPT` (untied head, learned positions)."""
    d = cfg.d_model
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * cfg.mlp_ratio * d * d + cfg.mlp_ratio * d + d
    return 2 * cfg.vocab_size * d + cfg.context * d + cfg.n_layers * per_block + 2 * d


def gpt_config(params_m: float) -> GPTConfig:
    """12 layers, vocab 32000, context 128; d_model (a multiple of 64) closest to ``params_m`` millions."""
    def cfg(d: int) -> GPTConfig:
        return GPTConfig(vocab_size=VOCAB, d_model=d, n_layers=LAYERS, n_heads=d // HEAD_DIM, context=CONTEXT)

    return min((cfg(d) for d in range(HEAD_DIM, 4097, HEAD_DIM)), key=lambda c: abs(gpt_params(c) - params_m * 1e6))


@dataclass
class Training:
    """A model, its AdamW optimizer and a token stream: the live state every contender saves."""

    model: TinyGPT
    opt: torch.optim.Optimizer
    gen: torch.Generator
    frozen: int = 0  # parameters left out of the optimizer
    step: int = 0

    @classmethod
    def build(cls, cfg: GPTConfig, *, freeze_lower_half: bool = False, seed: int = 0) -> Training:
        torch.manual_seed(seed)
        model = TinyGPT(cfg)
        if freeze_lower_half:
            frozen = [model.tok_emb, model.pos_emb, *model.blocks[: cfg.n_layers // 2]]
            for p in (p for m in frozen for p in m.parameters()):
                p.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
        n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        return cls(model, opt, torch.Generator().manual_seed(seed), n_frozen)

    def train_step(self) -> float:
        """One forward/backward/AdamW step on random tokens; its wall time."""
        t0 = time.perf_counter()
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=self.gen)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return time.perf_counter() - t0

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the live state by name (model, then optimizer state)."""
        out = {f"model/{k}": v for k, v in self.model.state_dict().items()}
        for index, per_param in self.opt.state_dict()["state"].items():
            out.update({f"optim/{index}/{k}": v for k, v in per_param.items() if isinstance(v, torch.Tensor)})
        return out

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def describe(self) -> str:
        c = self.model.config
        n = sum(p.numel() for p in self.model.parameters())
        return (f"GPT decoder, {n / 1e6:.1f}M params (vocab {c.vocab_size}, d_model {c.d_model}, {c.n_layers} layers, "
                f"{c.n_heads} heads, context {c.context}, untied head), AdamW (exp_avg, exp_avg_sq) state, fp32: "
                f"{self.state_bytes() / MB:,.0f} MB of tensors; training step: {BATCH}x{SEQ} random tokens")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass
class Reference:
    """A private copy of the live state, to check restores bit for bit."""

    tensors: dict[str, torch.Tensor]
    param_groups: list[dict[str, Any]]

    @classmethod
    def capture(cls, tr: Training) -> Reference:
        return cls({n: t.detach().clone() for n, t in tr.tensors().items()},
                   [dict(g) for g in tr.opt.state_dict()["param_groups"]])

    def verify(self, tr: Training, who: str) -> None:
        live = tr.tensors()
        if live.keys() != self.tensors.keys():
            raise AssertionError(f"{who}: restored tensor names differ: {sorted(live.keys() ^ self.tensors.keys())[:5]}")
        bad = [n for n, t in live.items()
               if t.dtype != self.tensors[n].dtype or t.shape != self.tensors[n].shape
               or not torch.equal(raw_bytes(t), raw_bytes(self.tensors[n]))]
        if bad:
            raise AssertionError(f"{who}: {len(bad)} restored tensors differ from the saved ones, e.g. {bad[:5]}")
        if tr.opt.state_dict()["param_groups"] != self.param_groups:
            raise AssertionError(f"{who}: restored optimizer param_groups differ")


def scramble(tr: Training) -> None:
    """Flip every bit of the live state, so a restore that skips a tensor cannot pass the check."""
    with torch.no_grad():
        for t in tr.tensors().values():
            raw_bytes(t).bitwise_not_()


# -- files -------------------------------------------------------------------------------------


def iter_files(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    for dirpath, _, names in os.walk(path):
        yield from (Path(dirpath) / n for n in names)


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in iter_files(path))


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (or the file itself) and the folders that hold them."""
    folders = {path.parent}
    for f in iter_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        folders.add(f.parent)
    for d in folders:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(paths: list[Path]) -> None:
    """Drop the files from the page cache (after writing back whatever is dirty)."""
    os.sync()
    for f in (f for p in paths for f in iter_files(p)):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# -- contenders -------------------------------------------------------------------------------

Handle = tuple[Path, Any]  # (what the save wrote, what to wait on)


class Contender:
    """One way to save (and restore) the live state; a subclass per library."""

    name: ClassVar[str]
    family: ClassVar[str]  # contenders of one family write the same bytes and restore alike
    restore_label: ClassVar[str]
    asynchronous: ClassVar[bool] = False
    on_disk: ClassVar[bool] = True

    def __init__(self, root: Path, tr: Training) -> None:
        self.dir = root / self.name
        self.dir.mkdir(parents=True)
        self.tr = tr
        self.outputs: list[Path] = []

    def save(self, step: int) -> Handle:
        """Start a save; returns when the training loop may modify the state again."""
        raise NotImplementedError

    def finish(self, handle: Handle) -> None:
        """Block until the save is durable."""

    def step_wait_total(self) -> float:
        """Seconds training's optimizer steps have waited for this contender's saves, in all."""
        return 0.0

    def account(self, handle: Handle, rec: SaveRecord) -> None:
        rec.written_bytes = disk_bytes(handle[0])

    def restore(self) -> None:
        raise NotImplementedError

    def restore_paths(self) -> list[Path]:
        return self.outputs[-1:]

    def disk_total(self) -> int:
        return sum(disk_bytes(p) for p in self.outputs if p.exists())

    def prune(self) -> None:
        """Delete every output but the newest."""
        for p in self.outputs[:-1]:
            remove(p)

    def close(self) -> None:
        pass

    def _out(self, step: int, suffix: str = "") -> Path:
        path = self.dir / f"step-{step}{suffix}"
        self.outputs.append(path)
        return path


class Memcpy(Contender):
    name, family, restore_label, on_disk = "memcpy", "memcpy", "memcpy back (floor)", False

    def __init__(self, root: Path, tr: Training) -> None:
        super().__init__(root, tr)
        self.buffers = {n: torch.zeros_like(t) for n, t in tr.tensors().items()}  # zeros: pages touched

    def save(self, step: int) -> Handle:
        with torch.no_grad():
            for n, t in self.tr.tensors().items():
                self.buffers[n].copy_(t)
        return self.dir, None

    def account(self, handle: Handle, rec: SaveRecord) -> None:
        rec.written_bytes = 0

    def restore(self) -> None:
        with torch.no_grad():
            for n, t in self.tr.tensors().items():
                t.copy_(self.buffers[n])

    def restore_paths(self) -> list[Path]:
        return []


class Ckpt(Contender):
    name, family, restore_label, asynchronous = "ckpt", "ckpt", "ckpt restore_latest", True
    delta = False
    overlap = False

    def __init__(self, root: Path, tr: Training) -> None:
        import ckpt

        super().__init__(root, tr)
        self.store_dir = self.dir / "store"
        # The manager's defaults: no delta against the previous snapshot, compression
        # only where it saves 25% (restore speed first). ckpt-delta: delta_vs_previous=True.
        self.mgr = ckpt.CheckpointManager(str(self.store_dir), "bench", save_mode="overlap" if self.overlap else "async",
                                          keep_last=None, delta_vs_previous=self.delta)
        self.settings = self.mgr.store.settings
        self.last_step = -1
        self._du = disk_bytes(self.store_dir)

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.tr.model, "optim": self.tr.opt, "step": step}

    def save(self, step: int) -> Handle:
        self.mgr.save(step, self.state(step))
        self.last_step = step
        return self.store_dir, step

    def finish(self, handle: Handle) -> None:
        self.mgr.wait()

    def account(self, handle: Handle, rec: SaveRecord) -> None:
        from dataclasses import asdict

        stats = asdict(self.mgr.last_save) if self.mgr.last_save is not None else {}
        if stats.get("step") != handle[1]:
            raise AssertionError(f"ckpt last_save is for step {stats.get('step')}, not {handle[1]}")
        du = disk_bytes(self.store_dir)
        rec.stats = stats | {"store_growth": du - self._du}
        rec.written_bytes = int(stats["written_bytes"])
        self._du = du

    def restore(self) -> None:
        got = self.mgr.restore_latest(self.state(-1))
        if got != self.last_step:
            raise AssertionError(f"ckpt restored step {got}, expected {self.last_step}")

    def restore_paths(self) -> list[Path]:
        return [self.store_dir]

    def disk_total(self) -> int:
        return disk_bytes(self.store_dir)

    def prune(self) -> None:
        pass  # keep_last=None: the store keeps every snapshot, as configured

    def close(self) -> None:
        self.mgr.close()


class CkptOverlap(Ckpt):
    # The same bytes and restore as ckpt; parameters and optimizer state are read in
    # place during the next forward/backward, and the optimizer step copies only what
    # the save has not read yet (its own family: its memory differs).
    name, family = "ckpt-overlap", "ckpt-overlap"
    overlap = True

    def step_wait_total(self) -> float:
        return self.mgr.step_wait_s


class CkptDelta(Ckpt):
    name, family, restore_label = "ckpt-delta", "ckpt-delta", "ckpt restore_latest (delta chains)"
    delta = True


class TorchSave(Contender):
    name, family, restore_label = "torch.save", "torch.save", "torch.load + load_state_dict"

    def save(self, step: int) -> Handle:
        path = self._out(step, ".pt")
        torch.save(self.tr.state_dicts(), path)
        return path, None

    def finish(self, handle: Handle) -> None:
        fsync_tree(handle[0])

    def restore(self) -> None:
        sd = torch.load(self.outputs[-1], weights_only=True)
        self.tr.model.load_state_dict(sd["model"])
        self.tr.opt.load_state_dict(sd["optim"])


class DcpSave(Contender):
    name, family, restore_label = "dcp.save", "dcp", "dcp.load + load_state_dict"

    def _writer(self, step: int) -> tuple[Path, Any]:
        from torch.distributed.checkpoint import FileSystemWriter

        path = self._out(step)
        return path, FileSystemWriter(path, thread_count=2)  # sync_files=True: it fsyncs

    def save(self, step: int) -> Handle:
        import torch.distributed.checkpoint as dcp

        path, writer = self._writer(step)
        dcp.save(self.tr.state_dicts(), storage_writer=writer)
        return path, None

    def restore(self) -> None:
        import torch.distributed.checkpoint as dcp

        sd = self.tr.state_dicts()
        dcp.load(sd, checkpoint_id=self.outputs[-1])  # in place into the live tensors
        self.tr.model.load_state_dict(sd["model"])
        self.tr.opt.load_state_dict(sd["optim"])  # the non-tensor values (param_groups)


class DcpAsyncSave(DcpSave):
    name, asynchronous = "dcp.async_save", True

    def save(self, step: int) -> Handle:
        import torch.distributed.checkpoint as dcp

        path, writer = self._writer(step)
        return path, dcp.async_save(self.tr.state_dicts(), storage_writer=writer)

    def finish(self, handle: Handle) -> None:
        handle[1].result()


class TorchSnapshotTake(Contender):
    name, family, restore_label = "torchsnapshot.take", "torchsnapshot", "torchsnapshot restore"

    def app_state(self) -> dict[str, Any]:
        return {"model": self.tr.model, "optim": self.tr.opt}

    def save(self, step: int) -> Handle:
        from torchsnapshot import Snapshot

        path = self._out(step)
        Snapshot.take(str(path), app_state=self.app_state())
        return path, None

    def finish(self, handle: Handle) -> None:
        fsync_tree(handle[0])  # torchsnapshot writes without fsync

    def restore(self) -> None:
        from torchsnapshot import Snapshot

        Snapshot(str(self.outputs[-1])).restore(app_state=self.app_state())


class TorchSnapshotAsyncTake(TorchSnapshotTake):
    name, asynchronous = "torchsnapshot.async_take", True

    def save(self, step: int) -> Handle:
        from torchsnapshot import Snapshot

        path = self._out(step)
        return path, Snapshot.async_take(str(path), app_state=self.app_state())

    def finish(self, handle: Handle) -> None:
        handle[1].wait()
        fsync_tree(handle[0])


CONTENDERS: dict[str, type[Contender]] = {c.name: c for c in (
    Memcpy, Ckpt, CkptOverlap, CkptDelta, TorchSave, DcpSave, DcpAsyncSave, TorchSnapshotTake, TorchSnapshotAsyncTake)}


def torchsnapshot_available() -> bool:
    try:
        import torchsnapshot  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: skip the column
        log(f"torchsnapshot unavailable ({type(e).__name__}: {e}); its contenders are skipped")
        return False
    return True


def one_per_family(names: list[str], skip: tuple[str, ...] = ()) -> list[str]:
    """The first selected contender of each family (sync before async, as CONTENDER_NAMES orders them)."""
    seen: set[str] = set()
    out = []
    for n in names:
        fam = CONTENDERS[n].family
        if fam not in seen and fam not in skip:
            seen.add(fam)
            out.append(n)
    return out


# -- saving while training --------------------------------------------------------------------


@dataclass
class SaveRecord:
    """One save: where the time went and what it wrote."""

    index: int
    train_s: float  # the training step just before this save
    wait_prev_s: float = 0.0  # waiting for the previous save to be durable
    call_s: float = 0.0  # the save call itself
    step_wait_s: float = 0.0  # the next optimizer step, waiting for this save's copy (ckpt-overlap)
    durable_s: float = float("nan")  # from the save call until durable
    written_bytes: int = 0
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def blocked_s(self) -> float:
        return self.wait_prev_s + self.call_s + self.step_wait_s


class Watcher:
    """Waits in a thread until a save is durable, while the training thread goes on."""

    def __init__(self, c: Contender, handle: Handle, rec: SaveRecord, t_call: float) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(c, handle, rec, t_call), daemon=True)
        self.thread.start()

    def _run(self, c: Contender, handle: Handle, rec: SaveRecord, t_call: float) -> None:
        try:
            c.finish(handle)
            rec.durable_s = time.perf_counter() - t_call
            c.account(handle, rec)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by join()
            self.error = e

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def save_and_wait(c: Contender, step: int) -> None:
    c.finish(c.save(step))


def run_saves(c: Contender, tr: Training, n: int) -> list[SaveRecord]:
    """``n`` saves of the live state, one training step before each; at most one save in flight."""
    records: list[SaveRecord] = []
    watcher: Watcher | None = None
    for i in range(n):
        waited = c.step_wait_total()
        rec = SaveRecord(i, tr.train_step())
        if records:  # the step after a save pays for what its optimizer step waited
            records[-1].step_wait_s = c.step_wait_total() - waited
        t0 = time.perf_counter()
        if watcher is not None:
            watcher.join()
        t1 = time.perf_counter()
        handle = c.save(tr.step)
        rec.wait_prev_s, rec.call_s = t1 - t0, time.perf_counter() - t1
        if c.asynchronous:
            watcher = Watcher(c, handle, rec, t1)
        else:
            c.finish(handle)
            rec.durable_s = time.perf_counter() - t1
            c.account(handle, rec)
        records.append(rec)
    if type(c).step_wait_total is not Contender.step_wait_total:
        waited = c.step_wait_total()
        tr.train_step()  # the last save's copy is waited for by the step after it
        records[-1].step_wait_s = c.step_wait_total() - waited
    if watcher is not None:
        watcher.join()
    return records


def save_phase(names: list[str], tr: Training, root: Path, saves: dict[str, int],
               label: str) -> tuple[dict[str, list[SaveRecord]], dict[str, int], dict[str, Contender]]:
    """Each contender in turn does its saves; returns the records, bytes on disk and the live contenders."""
    records, totals, live = {}, {}, {}
    for name in names:
        os.sync()  # earlier contenders' dirty pages are not written back on this one's time
        c = CONTENDERS[name](root / label, tr)
        log(f"{label}: {name}, {saves[name]} saves")
        records[name] = run_saves(c, tr, saves[name])
        totals[name] = c.disk_total()
        c.prune()
        live[name] = c
    return records, totals, live


# -- restoring --------------------------------------------------------------------------------


def restore_phase(restorers: list[Contender], tr: Training, reps: int) -> dict[str, dict[str, list[float]]]:
    """Warm and cold restores into the live model and optimizer, each checked bit for bit."""
    tr.train_step()
    for c in restorers:
        save_and_wait(c, tr.step)
    ref = Reference.capture(tr)
    for c in restorers:  # untimed first pass: correctness, and a warm page cache
        scramble(tr)
        c.restore()
        ref.verify(tr, c.name)
    times: dict[str, dict[str, list[float]]] = {c.name: {"warm": [], "cold": []} for c in restorers}
    for mode in ("warm", "cold"):
        for rep in range(reps):
            log(f"restore: {mode} {rep + 1}/{reps}")
            for c in restorers:
                if mode == "cold" and not c.on_disk:
                    continue
                scramble(tr)
                if mode == "cold":
                    evict(c.restore_paths())
                t0 = time.perf_counter()
                c.restore()
                times[c.name][mode].append(time.perf_counter() - t0)
                ref.verify(tr, f"{c.name} ({mode})")
    return times


# -- peak memory (one fresh child process per contender) ------------------------------------------


def rss_bytes(field_name: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field_name} in /proc/self/status")


def trim() -> None:
    """Collect garbage and give freed heap back to the OS, so RSS counts live memory only."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS may include freed heap


def reset_peak() -> None:
    """Reset VmHWM (the peak RSS) to the current RSS (Linux >= 4.0)."""
    trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def memory_child(name: str, cfg: GPTConfig, root: Path) -> dict[str, float]:
    """Peak RSS of a first save until durable; then of a training step, alone or overlapping a second save."""
    tr = Training.build(cfg)
    tr.train_step()  # AdamW state exists from here on
    out = {"state": tr.state_bytes()}
    reset_peak()
    out["before"] = rss_bytes()
    c = CONTENDERS[name](root, tr)  # its buffers count towards the save
    save_and_wait(c, tr.step)
    out["save_peak"] = rss_bytes("VmHWM")
    reset_peak()
    if c.asynchronous:
        watcher = Watcher(c, c.save(tr.step), SaveRecord(1, 0.0), time.perf_counter())
        tr.train_step()
        watcher.join()
        out["overlap_peak"] = rss_bytes("VmHWM")
    else:
        tr.train_step()
        out["train_peak"] = rss_bytes("VmHWM")
    c.close()
    return out


def measure_memory(names: list[str], params_m: float, root: Path) -> dict[str, dict[str, float]]:
    out = {}
    for name in names:
        log(f"memory: {name} (child process)")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", name,
               "--params-m", str(params_m), "--dir", str(root)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"memory child for {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# -- machine and versions ---------------------------------------------------------------------


class CpuMeter:
    """Cores kept busy by everything but this process and its children, from /proc/stat."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    @staticmethod
    def _own() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def others_cores(self) -> float:
        wall = time.monotonic() - self.t0
        return ((self._busy() - self.busy0) - (self._own() - self.own0)) / wall


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _filesystem(path: Path) -> str:
    best = ("?", "?", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fs = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) >= len(best[2]):
                best = (dev, fs, mnt)
    return f"{best[0]} {best[1]}"


def machine_facts(root: Path) -> list[str]:
    import psutil

    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    dirty = _git("status", "--porcelain", "--", "ckpt", "storage")
    commit = _git("rev-parse", "--short", "HEAD") or "?"
    return [
        f"nproc {os.cpu_count()} ({cpu}), RAM {psutil.virtual_memory().total / 2**30:.1f} GiB, {platform.platform()}",
        f"work dir {root.parent} on {_filesystem(root)}; torch threads {torch.get_num_threads()}",
        (f"Python {platform.python_version()}, torch {torch.__version__}, numpy {_version('numpy')}, "
         f"torchsnapshot {_version('torchsnapshot')}, psutil {_version('psutil')}"),
        f"ckpt {_version('ckpt')} at commit {commit}" + (" with uncommitted changes in ckpt/ or storage/" if dirty else ""),
    ]


# -- tables -----------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fs(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def fmb(b: float) -> str:
    return "-" if math.isnan(b) else f"{b / MB:,.1f}"


def fx(num: float, den: float | None) -> str:
    return "-" if den is None or math.isnan(den) or den <= 0 or math.isnan(num) else f"{num / den:.2f}x"


def fgbs(nbytes: int, seconds: float) -> str:
    return "-" if math.isnan(seconds) or seconds <= 0 else f"{nbytes / 1e9 / seconds:.2f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def later(recs: list[SaveRecord]) -> list[SaveRecord]:
    """The saves after the warm-up one (all of them if there is only one)."""
    return recs[1:] or recs


def save_table(records: dict[str, list[SaveRecord]]) -> str:
    def ref(name: str, attr: str) -> float | None:
        return med([getattr(r, attr) for r in later(records[name])]) if name in records else None

    header = ["contender", "save 1 blocked / durable s", "blocked s", "of which waiting for previous save",
              "of which optimizer step waiting for the copy", "durable s", "ckpt background s", "training step s", "blocked vs dcp.async_save",
              "blocked vs memcpy", "durable vs dcp.async_save"]
    rows = []
    for name, recs in records.items():
        rest = later(recs)
        blocked, durable = med([r.blocked_s for r in rest]), med([r.durable_s for r in rest])
        bg = med([r.stats["background_s"] for r in rest if "background_s" in r.stats])
        rows.append([name, f"{fs(recs[0].blocked_s)} / {fs(recs[0].durable_s)}", fs(blocked),
                     fs(med([r.wait_prev_s for r in rest])), fs(med([r.step_wait_s for r in rest])), fs(durable), fs(bg), fs(med([r.train_s for r in rest])),
                     fx(blocked, ref("dcp.async_save", "blocked_s")), fx(blocked, ref("memcpy", "blocked_s")),
                     fx(durable, ref("dcp.async_save", "durable_s"))])
    return table(header, rows)


def bytes_rows(scenario: str, state: int, records: dict[str, list[SaveRecord]], totals: dict[str, int]) -> list[list[str]]:
    rows = []
    for name, recs in records.items():
        if name == "memcpy":
            continue
        first, rest = recs[0].written_bytes, [r.written_bytes for r in recs[1:]]
        per_save = " / ".join(f"{r.written_bytes / MB:,.0f}" for r in recs)
        tensors = "; ".join(f"{int(r.stats['staged_tensors'])}/{int(r.stats['reused_tensors'])}"
                            for r in recs if "staged_tensors" in r.stats) or "-"
        rows.append([scenario, name, per_save, fmb(med(rest)), fx(med(rest), first), fx(med(rest), state),
                     fx(first, state), fmb(totals[name]), tensors])
    return rows


def bytes_table(rows: list[list[str]]) -> str:
    header = ["scenario", "contender", "MB written, save 1 / 2 / ...", "later saves MB (median)",
              "later / save 1", "later / state", "save 1 / state", "on disk after all saves, MB",
              "ckpt tensors staged/reused per save"]
    return table(header, rows)


def restore_table(times: dict[str, dict[str, list[float]]], state: int) -> str:
    base = times.get("torch.save")
    header = ["contender", "restore", "warm s", "cold s", "warm GB/s", "cold GB/s", "warm vs torch.load",
              "cold vs torch.load", "bit-identical"]
    rows = []
    for name, t in times.items():
        warm, cold = med(t["warm"]), med(t["cold"])
        checks = 1 + len(t["warm"]) + len(t["cold"])
        rows.append([name, CONTENDERS[name].restore_label, fs(warm), fs(cold), fgbs(state, warm), fgbs(state, cold),
                     fx(warm, med(base["warm"]) if base else None), fx(cold, med(base["cold"]) if base else None),
                     f"yes ({checks} of {checks})"])
    return table(header, rows)


def memory_table(mem: dict[str, dict[str, float]]) -> str:
    header = ["contender", "RSS before save", "peak: first save until durable", "save's own extra",
              "peak: training step after it (sync)", "peak: 2nd save + training step overlapping (async)"]
    rows = []
    for name, m in mem.items():
        s = m["state"]
        rows.append([name, fx(m["before"], s), fx(m["save_peak"], s), fx(m["save_peak"] - m["before"], s),
                     fx(m.get("train_peak", math.nan), s), fx(m.get("overlap_peak", math.nan), s)])
    return table(header, rows)


# -- the run ----------------------------------------------------------------------------------


@dataclass
class Results:
    state: int = 0
    finetune_state: int = 0
    model: str = ""
    finetune: str = ""
    ckpt_settings: str = ""
    saves: dict[str, list[SaveRecord]] = field(default_factory=dict)
    bytes_rows: list[list[str]] = field(default_factory=list)
    restores: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds per part of the run


def full_training(args: argparse.Namespace, cfg: GPTConfig, root: Path, res: Results) -> None:
    tr = Training.build(cfg)
    tr.train_step()  # AdamW state exists from here on
    res.state, res.model = tr.state_bytes(), tr.describe()
    log(res.model)
    records, totals, live = save_phase(args.only, tr, root, {n: args.saves for n in args.only}, "full")
    res.saves = records
    res.bytes_rows += bytes_rows("full training", res.state, records, totals)
    if "ckpt" in live:
        res.ckpt_settings = repr(live["ckpt"].settings)  # type: ignore[attr-defined]
    restorers = [live[n] for n in one_per_family(args.only)]
    res.restores = restore_phase(restorers, tr, RESTORE_REPS)
    for c in live.values():
        c.close()
    shutil.rmtree(root / "full")


def fine_tune(args: argparse.Namespace, cfg: GPTConfig, root: Path, res: Results) -> None:
    tr = Training.build(cfg, freeze_lower_half=True)
    tr.train_step()
    res.finetune_state = tr.state_bytes()
    res.finetune = (f"embeddings and blocks 0-{cfg.n_layers // 2 - 1} frozen ({tr.frozen / 1e6:.1f}M params, "
                    f"requires_grad False, not in the optimizer); state {res.finetune_state / MB:,.0f} MB")
    names = one_per_family(args.only, skip=("memcpy",))
    saves = {n: args.saves if n.startswith("ckpt") else min(args.saves, 2) for n in names}
    records, totals, live = save_phase(names, tr, root, saves, "finetune")
    res.bytes_rows += bytes_rows("fine-tune, lower half frozen", res.finetune_state, records, totals)
    for c in live.values():
        c.close()
    shutil.rmtree(root / "finetune")


SAVE_NOTE = (
    "Medians over saves 2..N (save 1 is the warm-up, shown on its own). *Blocked*: the training thread inside "
    "the save, including the wait for the previous save to be durable (at most one in flight). *Durable*: from "
    "the save call until the data is on disk (fsynced). torch.save blocks only for the write into the page "
    "cache; its fsync then runs in the training thread too. *ckpt background*: `last_save.background_s` "
    "(hash, encode, write). *Training step*: the step before each save, which overlaps the previous save's "
    "background work for the async contenders (memcpy's is the undisturbed step). For ckpt-overlap, blocked "
    "also counts the next optimizer step's wait for the copy (`step_wait_s`), and its training step includes "
    "that wait."
)
BYTES_NOTE = (
    "ckpt: `written_bytes` (new compressed chunks, manager defaults: no delta); the others: the size "
    "of what the save wrote. *State*: the logical size of the tensors. In the fine-tune the other formats do 2 "
    "saves (they write the whole state every time). *On disk*: the whole ckpt store; for the others the sum of "
    "their saves."
)
RESTORE_NOTE = (
    "The last save of each format (one more save of the current state) is restored in place; before every "
    "restore every bit of the live state is flipped, and after it every tensor is compared byte for byte "
    "with a copy taken at the save (and the optimizer's param_groups for equality). Warm: files in the page "
    "cache (after an untimed first restore). Cold: `os.sync()` and `POSIX_FADV_DONTNEED` on every file of "
    "the contender's directory (the whole ckpt store). ckpt restores the newest snapshot of its run."
)
MEMORY_NOTE = (
    "A fresh child process per contender builds the same model and optimizer and trains one step; then, "
    "with freed heap handed back to the OS (`malloc_trim`) and VmHWM reset before each window: *RSS before "
    "save*; the peak of the *first save until durable* (it includes the contender's own buffers, such as "
    "ckpt's staging area and memcpy's copy); *save's own extra* = that peak minus RSS before; then for sync "
    "contenders the peak of the *training step* that follows (gradients and activations: the training's own "
    "peak), for async ones that of a *2nd save with a training step overlapping it*, until durable. "
    "Target for ckpt: first-save peak <= 2.2x the state."
)


def timed(res: Results, label: str, fn: Callable[[], object]) -> None:
    t0 = time.perf_counter()
    fn()
    gc.collect()
    res.phases[label] = time.perf_counter() - t0


def render_header(res: Results, facts: list[str], wall: float, others: float) -> list[str]:
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ckpt_env = ", ".join(k for k in os.environ if k.startswith("CKPT_")) or "none"
    phases = "; ".join(f"{k} {v:.0f} s" for k, v in res.phases.items())
    return [
        "# Training-loop snapshots: ckpt beside torch.save, DCP, torchsnapshot and memcpy", "",
        f"Command: `{cmd}` (from the repository root)  ",
        f"Date: {date}; whole run {wall:.0f} s ({phases})", "",
        *[f"- {x}" for x in facts],
        (f"- load from everything else on the machine (other processes, kernel writeback), over the run: "
         f"{others:.2f} cores on average"),
        f"- state: {res.model}",
        f"- fine-tune: {res.finetune or '-'}",
        f"- ckpt settings: {res.ckpt_settings or '-'}; CKPT_* environment: {ckpt_env}", "",
        ("Contenders and method: the module docstring of `benchmarks/snapshot.py`. Times are wall seconds; "
         "MB = 10^6 bytes; ratios are of this run's medians (single runs on this machine move by up to 2x, "
         "so compare within a run)."), "",
    ]


def render(args: argparse.Namespace, res: Results, facts: list[str], wall: float, others: float) -> str:
    return "\n".join([
        *render_header(res, facts, wall, others),
        f"## 1. Saving while training ({args.saves} saves each, one training step before each)", "",
        SAVE_NOTE, "", save_table(res.saves), "",
        "## 2. Bytes written per save", "",
        BYTES_NOTE, "", bytes_table(res.bytes_rows), "",
        f"## 3. Restore into the live model and optimizer (medians of {RESTORE_REPS})", "",
        RESTORE_NOTE, "", restore_table(res.restores, res.state), "",
        "## 4. Peak resident memory of a save, relative to the state size", "",
        MEMORY_NOTE, "", memory_table(res.memory) if res.memory else "(not measured)", "",
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params-m", type=float, default=None, help="model size in millions of parameters (default 100)")
    p.add_argument("--saves", type=int, default=None, help="saves per contender (default 5)")
    p.add_argument("--small", action="store_true", help="smoke test: a ~10M-param model and 3 saves")
    p.add_argument("--only", default=",".join(DEFAULT_CONTENDERS),
                   help=f"comma-separated contenders, of {', '.join(CONTENDER_NAMES)}")
    p.add_argument("--dir", type=Path, default=None, help="where the temporary stores go (default: the temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS, help="the markdown report")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.params_m = args.params_m if args.params_m is not None else (10.0 if args.small else 100.0)
    args.saves = args.saves if args.saves is not None else (3 if args.small else 5)
    if args.saves < 1:
        p.error("--saves must be at least 1")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        p.error(f"unknown contenders {unknown}; known: {', '.join(CONTENDER_NAMES)}")
    args.only = [n for n in CONTENDER_NAMES if n in names]  # canonical order: sync before async
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(2)
    cfg = gpt_config(args.params_m)
    if args.memory_child:
        work = Path(tempfile.mkdtemp(prefix="memory-child-", dir=args.dir))
        try:
            print(json.dumps(memory_child(args.memory_child, cfg, work)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    if any(n.startswith("torchsnapshot") for n in args.only) and not torchsnapshot_available():
        args.only = [n for n in args.only if not n.startswith("torchsnapshot")]
    t0, meter, res = time.perf_counter(), CpuMeter(), Results()
    root = Path(tempfile.mkdtemp(prefix="ckpt-snapshot-bench-", dir=args.dir))
    try:
        facts = machine_facts(root)
        timed(res, "full training: saves and restores", lambda: full_training(args, cfg, root, res))
        timed(res, "fine-tune saves", lambda: fine_tune(args, cfg, root, res))
        timed(res, "memory children", lambda: setattr(res, "memory", measure_memory(args.only, args.params_m, root)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = render(args, res, facts, time.perf_counter() - t0, meter.others_cores())
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    log(f"wrote {args.out} after {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
