"""``Store``: the entry point of the Python API."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable, Literal, overload

from ckpt._deprecation import deprecated
from ckpt.progress import Progress
from ckpt.settings import Settings
from ckpt.store.names import StoreNames
from ckpt_store.storage.backends import Backend, open_backend, scheme_of
from ckpt_store.storage.cache import ChunkBlobCache, default_cache_dir
from ckpt_store.storage.config import (
    StoreConfig,
    check_location,
    init_config,
    read_config,
)
from ckpt_store.storage.errors import StoreNotFoundError
from ckpt_store.storage.objects import ObjectStore
from ckpt_store.storage.refs import Refs
from ckpt_store.storage.retry import RetryPolicy

if TYPE_CHECKING:
    import torch

    from ckpt.store.maintenance import GcReport, RepairReport, StoreUsage, VerifyReport
    from ckpt.store.push import PushResult
    from ckpt.store.reader import CheckpointReader
    from ckpt_store.storage.copy import CopyReport


def remote_options(settings: Settings) -> dict[str, Any]:
    """What a remote backend (S3) takes from the settings: concurrency, retries, conditional writes, direct requests."""
    return {"concurrency": settings.transfer_concurrency,
            "retry": RetryPolicy(attempts=settings.retries + 1, base_delay=settings.retry_delay,
                                 deadline=settings.request_deadline),
            "conditional_writes": settings.conditional_writes, "direct": settings.s3_direct}


def open_cache(backend: Backend, config: StoreConfig, settings: Settings) -> ChunkBlobCache | None:
    """The local read-through chunk cache for a remote store (None for local stores, or with ``settings.cache`` off)."""
    if not backend.caches or not settings.cache or settings.cache_mb <= 0:
        return None
    return ChunkBlobCache(settings.cache_dir or default_cache_dir(), config.store_id, settings.cache_mb << 20,
                          max_entry=settings.max_chunk_size + 4096)  # a blob: its chunk's bytes at most, and a header


def is_local_url(url: str | os.PathLike[str] | None) -> bool:
    """Whether ``url`` (None: :func:`default_store_url`) names a store in a local folder, which takes no storage options."""
    return scheme_of(os.fspath(url) if url is not None else default_store_url()) == "file"


def default_store_url() -> str:
    """``$CKPT_STORE``, else ``$XDG_DATA_HOME/ckpt/store`` (``~/.local/share/ckpt/store``)."""
    env = os.environ.get("CKPT_STORE")
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "ckpt", "store")


class Store(StoreNames):
    """A ckpt store at a local path or any fsspec URL.

    >>> import torch, ckpt
    >>> store = ckpt.Store.init("memory://doctest-store")
    >>> cid = store.push({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, "demo/tiny")
    >>> store.load("demo/tiny")["w"].tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    >>> store.resolve(cid[:8]) == cid
    True
    """

    def __init__(self, backend: Backend, config: StoreConfig, settings: Settings) -> None:
        self.backend = backend
        self.config = config
        self.settings = settings
        self.objects = ObjectStore(backend, open_cache(backend, config, settings), max_chunk_blob=settings.max_chunk_size + 4096)
        self.refs_db = Refs(backend)
        from ckpt.store.catalog import open_index

        self.index = open_index(self)
        self.refs_db.index = self.index

    # -- opening -------------------------------------------------------------
    @classmethod
    def open(cls, url: str | os.PathLike[str] | None = None, *, storage_options: dict[str, Any] | None = None,
             settings: Settings | None = None, create: bool | None = None) -> Store:
        """Open the store at ``url`` (default: :func:`default_store_url`).

        Raises :class:`StoreNotFoundError` when there is none (:meth:`init` creates one),
        :class:`StoreFormatError` when it is of a format version this ckpt cannot read,
        :class:`StoreLocationError` when ``url`` is empty or a file.
        """
        if create is not None:
            deprecated("Store.open(url, create=True)", "Store.init(url)")
        return cls._connect(url, storage_options, settings, create=bool(create))

    @classmethod
    def init(cls, url: str | os.PathLike[str] | None = None, *, storage_options: dict[str, Any] | None = None,
             settings: Settings | None = None) -> Store:
        """Open the store at ``url``, creating it if there is none.

        Raises :class:`StoreLocationError` when ``url`` is empty or a file, or when the
        new store would lie inside another local store.
        """
        return cls._connect(url, storage_options, settings, create=True)

    @classmethod
    def _connect(cls, url: str | os.PathLike[str] | None, storage_options: dict[str, Any] | None,
                 settings: Settings | None, *, create: bool) -> Store:
        settings = settings or Settings.from_env()
        url = os.fspath(url) if url is not None else default_store_url()
        backend = open_backend(url, storage_options=storage_options, fsync=settings.fsync, remote=remote_options(settings))
        check_location(backend, create=create)
        try:
            config = read_config(backend)
        except StoreNotFoundError:
            if not create:
                raise
            config, _ = init_config(backend)
        return cls(backend, config, settings)

    @property
    def url(self) -> str:
        return self.backend.url

    # -- data ----------------------------------------------------------------
    def push(self, source: object, name: str | None = None, message: str | None = None,
             metadata: dict[str, Any] | None = None, *, base: str | None = None, delta: bool = True,
             progress: Progress | None = None) -> PushResult:
        """Store ``source`` and point ref ``name`` at it; returns the checkpoint id, as a
        :class:`~ckpt.store.push.PushResult` (a ``str``) that also says what was written.

        ``source`` is a ``.safetensors`` file, a Hugging Face model directory, a
        ``.pt``/``.bin`` state dict (read with ``weights_only=True``) or a dict of tensors.
        Only chunks the store lacks are written. New chunks are delta-encoded against
        ``base`` (a ref), else the ref's previous version, else the stored checkpoint
        that shares the most tensors, whenever that is smaller; ``delta=False`` turns
        this off.
        """
        from ckpt.store.push import push

        return push(self, source, name, message=message, metadata=metadata, base=base, delta=delta, progress=progress)

    def push_report(self, source: object, name: str | None = None, message: str | None = None,
                    metadata: dict[str, Any] | None = None, *, base: str | None = None, delta: bool = True,
                    progress: Progress | None = None) -> PushResult:
        """Deprecated: :meth:`push` returns the same :class:`PushResult`."""
        deprecated("Store.push_report", "Store.push, which returns the same PushResult")
        return self.push(source, name, message, metadata, base=base, delta=delta, progress=progress)

    def pull(self, ref: str, dest: str | os.PathLike[str], *, overwrite: bool = False,
             include: list[str] | None = None, progress: Progress | None = None) -> str:
        """Write checkpoint ``ref`` to ``dest`` as it was pushed (bit-identical); returns the path written.

        A single-file checkpoint becomes ``dest`` (or ``dest/<name>`` if ``dest`` is a
        directory); a directory checkpoint becomes directory ``dest``, which must be new or
        empty unless ``overwrite``: then the checkpoint's files are written into it,
        replacing files of the same names only. With ``include`` (glob patterns), only
        matching tensors are written, as one safetensors file. A ``dest`` named ``.pt``,
        ``.pth``, ``.bin`` or ``.ckpt`` gets a torch file instead (see :func:`ckpt.store.pull.pull`).
        Nothing is ever written inside a store; the rules are in :mod:`ckpt.store.destination`.

        Raises :class:`DestinationExistsError` when something is in the way and
        ``overwrite`` is off, :class:`DestinationError` when the destination is unsafe
        (inside a store, a directory where a file goes) or cannot be written.
        """
        from ckpt.store.pull import pull

        return pull(self, ref, dest, overwrite=overwrite, include=include, progress=progress)

    @overload
    def load(self, ref: str, *, include: list[str] | None = None, progress: Progress | bool | None = None,
             structure: Literal[False] = False) -> dict[str, torch.Tensor]: ...

    @overload
    def load(self, ref: str, *, include: list[str] | None = None, progress: Progress | bool | None = None,
             structure: bool) -> Any: ...

    def load(self, ref: str, *, include: list[str] | None = None, progress: Progress | bool | None = None,
             structure: bool = False) -> Any:
        """All tensors of ``ref`` (or those matching ``include`` globs) as CPU tensors, by name.

        ``structure=True``: for a checkpoint pushed from a nested ``.pt`` file or dict, the object
        that was pushed, as it was (nested dicts, lists and tuples, its non-tensor values; what a
        pull to a ``.pt`` name writes); for any other checkpoint the same dict of tensors as without
        it. Not with ``include``.

        Where folders of the checkpoint share tensor names (a diffusers pipeline's unet/ and
        text_encoder/), each such tensor is named ``FOLDER/NAME``: ``include=["unet/*"]`` picks one
        model, and ``load_into(ref, unet, prefix="unet/")`` loads it.

        From a remote store the chunks stream into the new tensors (no local file), at most
        ``settings.inflight_mb`` fetched ahead of decoding. ``progress=True``: a bar on a terminal.
        """
        from ckpt.progress import as_progress
        from ckpt.store.load import load

        return load(self, ref, include=include, progress=as_progress(progress), structure=structure)

    def load_into(self, ref: str, target: Any, *, strict: bool = True, prefix: str = "",
                  progress: Progress | bool | None = None) -> None:
        """Decode ``ref`` straight into the tensors of ``target`` (``nn.Module`` or dict), in place.

        ``prefix``: the checkpoint's names of ``target``'s tensors start with it (``"state_dict."``
        in a Lightning checkpoint, ``"model."`` in a pushed ``{"model": ..., "optim": ...}``);
        ``strict`` then compares ``target`` with the tensors under it. From a remote store
        (``s3://...``) the chunks stream into the tensors with no local file; CUDA tensors are
        filled through pinned host buffers of at most ``settings.inflight_mb``.
        ``progress=True``: a bar on a terminal.
        """
        from ckpt.progress import as_progress
        from ckpt.store.load import load_into

        load_into(self, ref, target, strict=strict, prefix=prefix, progress=as_progress(progress))

    def reader(self, ref: str) -> CheckpointReader:
        """A lazy reader that fetches one tensor at a time."""
        from ckpt.store.reader import CheckpointReader

        mid = self.resolve(ref)
        return CheckpointReader(self, mid, self.manifest(mid))

    # -- between stores ----------------------------------------------------------
    def copy_to(self, dest: Store | str | os.PathLike[str], refs: list[str], *,
                storage_options: dict[str, Any] | None = None, progress: Progress | None = None) -> CopyReport:
        """Copy checkpoints ``refs`` (``REF`` or ``REF:NAME``) to store ``dest`` (created if needed).

        Only objects ``dest`` lacks travel, verified, in the order chunks, manifests,
        refs; see :func:`ckpt.store.copy.copy_refs`.
        """
        from ckpt.store.copy import check_copy_specs, copy_refs

        if not isinstance(dest, Store):
            check_copy_specs(self, refs)  # before a new store is made there
            dest = Store.init(dest, storage_options=storage_options, settings=self.settings)
        return copy_refs(self, dest, refs, progress=progress)

    # -- housekeeping ----------------------------------------------------------
    def verify(self, names: list[str] | None = None, *, progress: Progress | None = None) -> VerifyReport:
        from ckpt.store.maintenance import verify

        return verify(self, names, progress)

    def repair(self, source: Store | str, names: list[str] | None = None, *, progress: Progress | None = None) -> RepairReport:
        """Restore damaged or missing chunks and manifests from ``source`` (a Store or URL), verified.

        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> main, backup = Store.init(d + "/main"), Store.init(d + "/backup")
        >>> _ = main.push({"w": torch.ones(4)}, "m"); _ = backup.push({"w": torch.ones(4)}, "m")
        >>> cid = main.manifest("m").tensors[0].chunks[0]
        >>> main.backend.delete(main.objects.path("chunks", cid))
        >>> main.verify().ok
        False
        >>> r = main.repair(backup)
        >>> r.repaired == [("chunk", cid)], r.after.ok
        (True, True)
        """
        from ckpt.snapshot.local_lock import keeping_off
        from ckpt.store.maintenance import repair

        src = source if isinstance(source, Store) else Store.open(source)
        with keeping_off(self):  # (not a local tier in use: its manager collects it without grace)
            return repair(self, src, names, progress)

    def du(self) -> StoreUsage:
        from ckpt.store.maintenance import du

        return du(self)

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False, keep_history: bool = True) -> GcReport:
        from ckpt.store.maintenance import gc

        return gc(self, grace_s=grace_s, dry_run=dry_run, keep_history=keep_history)

    # -- sizes for reports ---------------------------------------------------------
    # (Read-only answers the CLI needs, so that it never reaches into objects/refs_db/backend.)
    def chunk_sizes(self) -> dict[str, int]:
        """Stored (encoded) bytes of every chunk in the store, by chunk id: one listing, no reads."""
        return {o.id: o.size for o in self.objects.list("chunks")}

    def manifest_ids(self) -> set[str]:
        """Ids of every manifest in the store: one listing (a request per 1,000 on S3), nothing read.

        >>> import torch
        >>> s = Store.init("memory://doctest-manifest-ids")
        >>> _ = s.push({"w": torch.zeros(4)}, "z")
        >>> s.manifest_ids() == {s.resolve("z")}
        True
        """
        return {o.id for o in self.objects.list("manifests")}

    def stored_sizes(self, chunk_ids: Iterable[str]) -> dict[str, int]:
        """Stored (encoded) size in bytes of each chunk of ``chunk_ids`` that the store holds.

        One size query per chunk asked about (run ``transfer_concurrency`` at a time on a
        remote store), never a listing of every chunk in the store; missing chunks are
        left out of the result.

        >>> import torch
        >>> s = Store.init("memory://doctest-sizes")
        >>> chunks = s.manifest(s.push({"w": torch.zeros(1024)}, "z")).tensors[0].chunks
        >>> [0 < n < 4096 for n in s.stored_sizes(chunks).values()]  # 4 KiB of zeros, compressed
        [True]
        """
        from concurrent.futures import ThreadPoolExecutor

        from ckpt.errors import ObjectNotFoundError

        ids = list(dict.fromkeys(chunk_ids))

        def size(cid: str) -> int | None:
            try:
                return self.objects.size("chunks", cid)
            except ObjectNotFoundError:
                return None

        if len(ids) < 2 or self.backend.local_path("") is not None:
            found = map(size, ids)
        else:
            with ThreadPoolExecutor(min(len(ids), self.settings.transfer_concurrency)) as pool:
                found = list(pool.map(size, ids))
        return {cid: n for cid, n in zip(ids, found) if n is not None}

@overload
def load(store: Store | str | os.PathLike[str], ref: str, *, include: list[str] | None = None,
         storage_options: dict[str, Any] | None = None, progress: Progress | bool | None = None,
         structure: Literal[False] = False) -> dict[str, torch.Tensor]: ...


@overload
def load(store: Store | str | os.PathLike[str], ref: str, *, include: list[str] | None = None,
         storage_options: dict[str, Any] | None = None, progress: Progress | bool | None = None, structure: bool) -> Any: ...


def load(store: Store | str | os.PathLike[str], ref: str, *, include: list[str] | None = None,
         storage_options: dict[str, Any] | None = None, progress: Progress | bool | None = None, structure: bool = False) -> Any:
    """The tensors of checkpoint ``ref`` in ``store`` (a :class:`Store` or its URL, ``s3://...`` too)
    as CPU tensors, streamed from the store with no local file. ``structure=True``: a checkpoint
    pushed from a nested ``.pt`` file or dict as it was pushed (see :meth:`Store.load`).

    >>> import torch, ckpt
    >>> _ = ckpt.Store.init("memory://load-doctest").push({"w": torch.ones(3), "opt": {"state": {0: [torch.zeros(1)]}}}, "m")
    >>> ckpt.load("memory://load-doctest", "m")["w"].tolist()
    [1.0, 1.0, 1.0]
    >>> sorted(ckpt.load("memory://load-doctest", "m"))
    ['opt.state.0.0', 'w']
    >>> ckpt.load("memory://load-doctest", "m", structure=True)["opt"]
    {'state': {0: [tensor([0.])]}}
    """
    s = store if isinstance(store, Store) else Store.open(store, storage_options=storage_options)
    return s.load(ref, include=include, progress=progress, structure=structure)


def load_into(store: Store | str | os.PathLike[str], ref: str, target: Any, *, strict: bool = True, prefix: str = "",
              storage_options: dict[str, Any] | None = None, progress: Progress | bool | None = None) -> None:
    """Decode checkpoint ``ref`` of ``store`` (a :class:`Store` or its URL) into ``target``'s tensors
    (``nn.Module`` or dict), in place; see :meth:`Store.load_into`.

    >>> import torch, ckpt
    >>> _ = ckpt.Store.init("memory://load-into-doctest").push({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, "m")
    >>> layer = torch.nn.Linear(2, 2)
    >>> ckpt.load_into("memory://load-into-doctest", "m", layer)
    >>> layer.weight.sum().item()
    4.0
    """
    s = store if isinstance(store, Store) else Store.open(store, storage_options=storage_options)
    s.load_into(ref, target, strict=strict, prefix=prefix, progress=progress)
