"""A store for the web view's tests: a base, two fine-tunes, a merge, a remix-free XSS
probe and a training run with retention, all from a real (small) torch model."""

from __future__ import annotations

import torch
from torch import nn

import ckpt
from ckpt.merging.remixing import remix_scores

XSS = "<script>alert(1)</script>"
XSS_META = '<img src=x onerror="alert(2)">'
XSS_TENSOR = "<b>bold</b>.weight"


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attention = nn.Linear(d, d)
        self.output = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)


class Tiny(nn.Module):
    """Named like a transformer stack (``layer.N.module``) so that diffs have a layer x module heatmap."""

    def __init__(self, d: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(64, d)
        self.layer = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(x).mean(1)
        for b in self.layer:
            h = b.norm(h + b.output(torch.relu(b.attention(h))))
        return self.head(h)


def tuned(base: dict[str, torch.Tensor], layers: tuple[int, ...], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """``base`` with the weights of ``layers`` nudged (the rest bit-identical, so it dedups)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        hit = any(k.startswith(f"layer.{i}.") for i in layers)
        out[k] = (v + scale * torch.randn(v.shape, generator=g)).contiguous() if hit else v.clone()
    return out


def build(url: str, probe: bool = True) -> ckpt.Store:
    """base -> ft/top (layers 2, 3), ft/bottom (layer 0) -> merged/avg (linear), remix/start (best 2 of 3); xss/probe (with ``probe``);
    train/run1: 4 snapshots every 2 steps with loss and lr, keep_last=2 (steps 2 and 4 removed)."""
    torch.manual_seed(0)
    store = ckpt.Store.init(url)
    model = Tiny()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    store.push(base, "base", "the pretrained model", metadata={"license": "apache-2.0"})
    store.push(tuned(base, (2, 3), 0.05, 1), "ft/top", "fine-tuned top layers")
    store.push(tuned(base, (0,), 0.002, 2), "ft/bottom", "fine-tuned the first layer")
    ckpt.merge(["ft/top", "ft/bottom"], "linear", store=store, name="merged/avg", message="average of two fine-tunes")
    remix_scores({"ft/top": 0.9, "ft/bottom": 0.7, "merged/avg": 0.2}, k=2, store=store, name="remix/start")
    if probe:
        hostile = tuned(base, (1,), 0.01, 3)
        hostile[XSS_TENSOR] = torch.ones(3)
        store.push(hostile, "xss/probe", XSS, metadata={"note": XSS_META})

    model.load_state_dict(base)
    model.embeddings.weight.requires_grad_(False)  # unchanged by training: the run shares its chunks with base
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, 64, (32, 5), generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(5))
    with ckpt.CheckpointManager(store, "train/run1", every_n_steps=2, keep_last=2, save_mode="sync") as mgr:
        for step in range(1, 9):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.maybe_save(step, {"model": model, "optim": opt, "step": step}, metrics={"loss": loss.item(), "lr": 1e-2})
    return store


def build_wide(url: str) -> ckpt.Store:
    """200 lineage nodes: a base, 150 fine-tunes, 40 merges of neighbours and 9 fine-tunes
    pushed again (their first versions stay in the graph as earlier versions)."""
    store = ckpt.Store.init(url)
    g = torch.Generator().manual_seed(0)
    base = {f"layer.{i}.w": torch.randn(8, generator=g) for i in range(3)}
    store.push(base, "base")
    for j in range(150):
        store.push({**base, f"layer.{j % 3}.w": base[f"layer.{j % 3}.w"] + j + 1}, f"ft/{j:03d}", base="base")
    for j in range(40):
        ckpt.merge([f"ft/{j:03d}", f"ft/{j + 1:03d}"], "linear", store=store, name=f"merge/{j:02d}")
    for j in range(9):
        store.push({**base, "layer.0.w": base["layer.0.w"] * (j + 2)}, f"ft/{j:03d}", base="base")
    return store
