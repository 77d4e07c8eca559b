"""A ckpt store as the storage of ``torch.distributed.checkpoint``.

``dcp.save(state, storage_writer=ckpt.dcp.Writer(url, "run7/step-500"))`` on every rank;
``dcp.load(state, storage_reader=ckpt.dcp.Reader(url, "run7/step-500"))`` at any world size.
Each rank writes its own shards as chunks; the coordinator commits one manifest
(ckpt/dcp/checkpoint.py). The manifest's layout (ckpt/dcp/format.py) also lets
``ckpt pull``/``Store.load`` consolidate the shards into whole tensors (ckpt/dcp/consolidate.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt._lazy import lazy_exports

if TYPE_CHECKING:
    from ckpt.dcp.checkpoint import Reader, Writer

__all__ = ["Reader", "Writer"]
__getattr__ = lazy_exports(__name__, {"Reader": "ckpt.dcp.checkpoint", "Writer": "ckpt.dcp.checkpoint"}, globals())
