"""Make a "fine-tuned" copy of a Hugging Face model directory for the demo.

Copies every file and replaces the weights of the top encoder layer with a
slightly changed version (as a short fine-tune of that layer would), so most
tensors are shared with the base and a few differ.

    python examples/make_variant.py SRC_DIR DEST_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main(src: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    changed = 0
    for name, t in tensors.items():
        if name.startswith("encoder.layer.5.") and t.is_floating_point():
            tensors[name] = t + 1e-3 * torch.randn(t.shape, generator=g, dtype=t.dtype)
            changed += 1
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    print(f"{dest}: changed {changed} of {len(tensors)} tensors (encoder.layer.5.*)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
