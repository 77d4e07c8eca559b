"""The bytes of one file a pull writes, made durable: :class:`OutputFile` (written at offsets from
many threads, flushed to the disk in the background as it grows, fsynced at the end) and
:func:`write_torch` (a torch file, written by ``torch.save``). Each is a temporary of
:func:`~ckpt.store.atomic_files.write_files`, renamed into place with the others."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt.errors import DestinationError, TensorMismatchError
from ckpt.store.atomic_files import create_new, write_files
from ckpt.store.limits import check_disk
from ckpt.store.sources import STATE_DICT_SUFFIXES

if TYPE_CHECKING:
    import torch


class OutputFile:
    """A new file of ``size`` bytes at ``path`` (a temporary name from :func:`write_files`),
    written at offsets from any number of threads. Created exclusively: nothing already at
    ``path`` is ever written through. Leaving the ``with`` block fsyncs it (unless it failed);
    a large file is flushed in the background while it is written (:class:`_Flusher`)."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.fd = create_new(path)
        try:
            os.ftruncate(self.fd, size)
            self.flusher = _Flusher.for_file(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def write_at(self, data: bytes | memoryview, off: int) -> None:
        view = memoryview(data)
        start, length = off, len(view)
        while view:
            n = os.pwrite(self.fd, view, off)
            view, off = view[n:], off + n
        _start_writeback(self.fd, start, length)
        if self.flusher is not None:
            self.flusher.wrote(length)

    def sink_at(self, off: int) -> Callable[[bytes], None]:
        """A sink writing the bytes it receives at ``off``."""
        return lambda data: self.write_at(data, off)

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            _finish(self.fd, self.flusher, ok=exc_type is None)
        finally:
            os.close(self.fd)


# Bytes written between two background flushes of a pulled file.
FLUSH_EVERY = 16 << 20


class _Flusher:
    """Flushes a file being written to the disk in the background: an ``fdatasync`` each time
    another :data:`FLUSH_EVERY` bytes were written, on a thread of its own (the flush waits on
    the disk, not the CPU). The fsync that ends the file then has little left to wait for.

    ``sync_file_range`` (:func:`_start_writeback`) only starts writing to the disk: this
    VM's disk acknowledges that into a cache of its host's, and the final fsync waited ~0.07 s
    for every 91 MB however early the writeback had started (a tiny file's fsync: 0.3 ms).
    Flushed as it was written, the same file's final fsync took 0.003-0.02 s, and writing it
    took no longer (MiniLM pulls from SeaweedFS, three alternating runs: 0.02-0.08 s faster). The final fsync stays: it
    is what makes the file durable.

    A failed flush is kept and raised by the file's close, not left to the final fsync: Linux
    reports a writeback error once per open file, so after the flush has seen it the fsync
    would succeed over lost data.

    The thread starts with the first flush and ends once ``size`` bytes were written (the file
    is complete; its fsync is next): a pull of many files, opened together, has a thread only
    for those being written."""

    @classmethod
    def for_file(cls, fd: int, size: int) -> _Flusher | None:
        """A flusher for a file of ``size`` bytes, or None for one too small to need it."""
        return cls(fd, size) if size >= 2 * FLUSH_EVERY else None

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.left = size  # bytes still to be written
        self.unflushed = 0
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.closing = False
        self.error: OSError | None = None
        self.thread: threading.Thread | None = None

    def wrote(self, n: int) -> None:
        with self.lock:
            self.left -= n
            if self.left <= 0:
                self.closing = True  # complete: the thread ends (close() joins it)
            else:
                self.unflushed += n
                if self.unflushed < FLUSH_EVERY:
                    return
                self.unflushed = 0
                if self.thread is None and not self.closing:
                    self.thread = threading.Thread(target=self._run, name="ckpt-flush", daemon=True)
                    self.thread.start()
        self.wake.set()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            if self.closing:
                return
            try:
                os.fdatasync(self.fd)
            except OSError as e:
                self.error = e
                return

    def close(self, check: bool = True) -> None:
        """Stop (after a flush in progress); with ``check``, raise the error of a failed flush.
        The caller then fsyncs or drops the file and closes it."""
        with self.lock:
            self.closing = True
            thread = self.thread
        self.wake.set()
        if thread is not None:
            thread.join()
        if check and self.error is not None:
            raise self.error


def _finish(fd: int, flusher: _Flusher | None, ok: bool) -> None:
    """End writing a file: stop its flusher, and if the writing went well (``ok``) raise a failed
    flush's error or fsync the file."""
    if flusher is not None:
        flusher.close(check=ok)
    if ok:
        os.fsync(fd)


class _Flushing:
    """A binary file's ``write`` and ``flush``, telling ``flusher`` (if any) what is written, for
    writers that take a file object, such as ``torch.save``. It keeps the first write error:
    torch.save reports one as a RuntimeError that no longer says what failed (a full disk)."""

    def __init__(self, f: Any, flusher: _Flusher | None) -> None:
        self.f = f
        self.flusher = flusher
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        if self.flusher is not None:
            self.flusher.wrote(n)
        return n

    def flush(self) -> None:
        self.f.flush()


def _sync_file_range() -> object:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return fn
    except (OSError, AttributeError):
        return None


_SFR = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, off: int, length: int) -> None:
    """Start writing this range to disk now (Linux), so the final fsync has little left.

    Measured by benchmarks/push_pull.py: without it the kernel starts writeback only
    after ~2 GB are dirty and a 1 GB pull waited on one long fsync (499 -> 787 MB/s).
    """
    if _SFR is not None and length:
        _SFR(fd, off, length, _SYNC_FILE_RANGE_WRITE)  # type: ignore[operator]


def is_torch_name(path: str) -> bool:
    """Whether ``path`` is named like a torch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``)."""
    return path.lower().endswith(STATE_DICT_SUFFIXES)


def write_torch(target: str, tensors: dict[str, torch.Tensor], values: dict[str, Any], overwrite: bool = True,
                tree: Any = None) -> None:
    """Write ``tensors`` and JSON ``values`` as one flat dict to torch file ``target``, atomically;
    or, where ``tree`` is given (a pushed .pt's structure, holding ``tensors``), that object.

    Everything in it (tensors and JSON types) loads with ``torch.load(weights_only=True)``.
    """
    import torch

    clash = sorted(set(tensors) & set(values)) if tree is None else []
    if clash:
        raise TensorMismatchError(f"{clash[0]!r} names both a tensor and a value of this checkpoint",
                                  hint="pull it as .safetensors (tensors only)")
    obj: Any = {**tensors, **values} if tree is None else tree

    size = sum(t.nbytes for t in tensors.values())
    check_disk(size, target)

    def fill(tmps: list[str]) -> None:
        with os.fdopen(create_new(tmps[0]), "wb") as f:
            flusher = _Flusher.for_file(f.fileno(), size)
            out = _Flushing(f, flusher)
            try:
                try:
                    torch.save(obj, out)
                except RecursionError:  # (pickle recurses: a value an older push kept, some hundreds of lists deep)
                    raise DestinationError(f"cannot write {target}: the checkpoint holds values nested too deeply for a "
                                           "torch file", hint="pull it as .safetensors (its tensors only)") from None
                except RuntimeError:
                    if out.error is not None:
                        raise out.error from None  # what failed (ENOSPC, EIO): a DestinationError
                    raise
                f.flush()
            except BaseException:
                _finish(f.fileno(), flusher, ok=False)
                raise
            _finish(f.fileno(), flusher, ok=True)

    write_files([target], fill, overwrite)
