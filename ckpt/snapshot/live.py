"""Reading a snapshot straight from live CPU tensors until the optimizer steps.

With ``CheckpointManager(overlap_copy=True)`` the parameters and optimizer state do
not change between ``save()`` and the optimizer's next ``step()``. So the save thread
reads their chunks from the live tensors themselves (one chunk-sized copy at a time,
which it hashes, encodes and writes), and only when the step is about to run does
:meth:`LiveTensors.release` copy what has not been read yet into fresh buffers; the
rest of the save reads those. When the background keeps up with forward and backward,
no staging copy of the state is made at all: memory stays at the state plus the
chunks in flight, and the step does not wait.

Every read checks the tensor's in-place version counter against the one taken at
``save()``: a tensor changed by anything but the (waiting) optimizer step fails the
save, and the snapshot is never published.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ckpt.format.dtypes import byte_view

if TYPE_CHECKING:
    import torch


class LiveTensors:
    """The deferred tensors of one save, read in place until :meth:`release`."""

    def __init__(self, tensors: dict[str, torch.Tensor], versions: dict[str, int]) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._released = False
        self._tensors = tensors  # contiguous CPU tensors
        self.names = frozenset(tensors)
        self._versions = versions
        self._views = {name: byte_view(t) for name, t in tensors.items()}
        self._left = {name: len(v) for name, v in self._views.items()}  # bytes not read yet
        self._copies: dict[str, memoryview] = {}
        self._changed: set[str] = set()  # found modified by release(): their reads fail
        self._held: list[Any] = []
        self.copied_bytes = 0  # what release() had to copy

    def source(self, name: str) -> _LiveBytes:
        return _LiveBytes(self, name)

    def read(self, name: str, offset: int, length: int) -> bytes | memoryview:
        with self._cond:
            copy = self._copies.get(name)
            if copy is not None:
                return copy[offset : offset + length]
            if name in self._changed:
                self._check(name)  # raises
            self._readers += 1
        try:
            data = bytes(self._views[name][offset : offset + length])
            self._check(name)
        finally:
            with self._cond:
                self._readers -= 1
                self._left[name] -= length
                self._cond.notify_all()
        return data

    def release(self) -> None:
        """The optimizer is about to step: copy every tensor not yet read in full, so that
        the rest of the save reads the copies. Idempotent. Never raises into the step:
        a tensor found modified is left uncopied and its next read fails the save."""
        import torch

        with self._cond:
            if self._released:
                return
            while self._readers:
                self._cond.wait()
            for name, left in self._left.items():
                if left > 0:
                    t = self._tensors[name]
                    if t._version != self._versions[name]:
                        self._changed.add(name)
                        continue
                    buf = torch.empty_like(t, memory_format=torch.contiguous_format)
                    buf.copy_(t)
                    self._held.append(buf)
                    self._copies[name] = byte_view(buf)
                    self.copied_bytes += len(self._copies[name])
            self._released = True

    def _check(self, name: str) -> None:
        from ckpt.snapshot.run import modified_under_save

        if self._tensors[name]._version != self._versions[name]:
            raise modified_under_save([name])


class _LiveBytes:
    """A ByteSource (ckpt.store.sources) over one live tensor."""

    def __init__(self, live: LiveTensors, name: str) -> None:
        self._live, self._name = live, name

    def read(self, offset: int, length: int) -> bytes | memoryview:
        return self._live.read(self._name, offset, length)
