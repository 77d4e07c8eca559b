"""``torch.distributed.checkpoint`` storage backed by a ckpt store.

>>> import torch, torch.distributed.checkpoint as dcp, warnings, ckpt.dcp
>>> warnings.filterwarnings("ignore", message="torch.distributed is disabled")
>>> state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}
>>> md = dcp.save(state, storage_writer=ckpt.dcp.Writer("memory://dcp-doctest", "run/step-7"))
>>> into = {"w": torch.zeros(2, 3), "step": 0}
>>> dcp.load(into, storage_reader=ckpt.dcp.Reader("memory://dcp-doctest", "run/step-7"))
>>> into["w"].tolist(), into["step"]
([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 7)

Every rank hashes, encodes and writes the chunks of its own shards in parallel
(``ckpt.transfer.pipeline.put_chunks``: chunks already in the store are not written
again, and a shard saved before under the same name is delta-encoded against
it where that is smaller). The coordinator then writes one ordinary manifest
(source ``"dcp"``: one tensor entry per saved shard, DCP's metadata as JSON
under ``extra["dcp"]``, see :mod:`ckpt.dcp.format`) and moves the ref; DCP calls
it only after every rank has finished writing, so a rank that fails or dies
leaves the previous checkpoint current. ``ckpt ls/show/verify/pull`` work on the
result; ``ckpt pull`` writes one consolidated safetensors file.

Non-tensor state is stored as JSON (DCP would pickle it): values JSON cannot
hold (arbitrary objects) are refused with :class:`~ckpt.dcp.format.UnsupportedStateError`.
A rank that dies makes its peers' next DCP collective fail (gloo: at once, on the
reset connection); one that hangs, after the process group's timeout: give
``init_process_group`` a timeout (``CheckpointManager(timeout_s=...)`` uses its own group).
Either way ``finish`` never runs and the ref stays where it was.

The writer is :mod:`ckpt.dcp.writer`, the reader :mod:`ckpt.dcp.reader`; both are named here too.
"""

from __future__ import annotations

from ckpt.dcp.format import UnsupportedStateError
from ckpt.dcp.reader import Reader
from ckpt.dcp.writer import Writer

__all__ = ["Reader", "UnsupportedStateError", "Writer"]
