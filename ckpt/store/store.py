"""``Store``: the entry point of the Python API."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from ckpt.errors import AmbiguousRefError, RefNotFoundError
from ckpt.format.manifest import Manifest
from ckpt.progress import Progress
from ckpt.settings import Settings
from ckpt_store.storage.backends import Backend, open_backend
from ckpt_store.storage.config import (
    StoreConfig,
    check_location,
    init_config,
    read_config,
)
from ckpt_store.storage.errors import InvalidNameError, StoreNotFoundError
from ckpt_store.storage.objects import ObjectStore
from ckpt_store.storage.refs import RefEntry, Refs, validate_ref_name
from ckpt_store.storage.retry import RetryPolicy

if TYPE_CHECKING:
    import torch

    from ckpt.store.catalog import RefInfo
    from ckpt.store.maintenance import GcReport, RepairReport, StoreUsage, VerifyReport
    from ckpt.store.push import PushResult
    from ckpt.store.reader import CheckpointReader
    from ckpt_store.storage.copy import CopyReport

_HISTORY = re.compile(r"^(.*)@(\d+)$")
_HEX = re.compile(r"^[0-9a-f]{4,64}$")


def remote_options(settings: Settings) -> dict[str, Any]:
    """What a remote backend (S3) takes from the settings: concurrency, retries, conditional writes."""
    return {"concurrency": settings.transfer_concurrency,
            "retry": RetryPolicy(attempts=settings.retries + 1, base_delay=settings.retry_delay),
            "conditional_writes": settings.conditional_writes}


def default_store_url() -> str:
    """``$CKPT_STORE``, else ``$XDG_DATA_HOME/ckpt/store`` (``~/.local/share/ckpt/store``)."""
    env = os.environ.get("CKPT_STORE")
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "ckpt", "store")


class Store:
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
        self.objects = ObjectStore(backend)
        self.refs_db = Refs(backend)
        from ckpt.store.catalog import open_index

        self.index = open_index(self)
        self.refs_db.index = self.index

    # -- opening -------------------------------------------------------------
    @classmethod
    def open(cls, url: str | os.PathLike[str] | None = None, *, storage_options: dict[str, Any] | None = None,
             settings: Settings | None = None, create: bool = False) -> Store:
        """Open the store at ``url`` (default: :func:`default_store_url`).

        Raises :class:`StoreNotFoundError` when there is none (unless ``create``),
        :class:`StoreFormatError` when it is of a format version this ckpt cannot read,
        :class:`StoreLocationError` when ``url`` is empty or a file, or when ``create``
        would make a new store inside another local store.
        """
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

    @classmethod
    def init(cls, url: str | os.PathLike[str] | None = None, *, storage_options: dict[str, Any] | None = None,
             settings: Settings | None = None) -> Store:
        """Create a store at ``url`` (or open the one already there)."""
        return cls.open(url, storage_options=storage_options, settings=settings, create=True)

    @property
    def url(self) -> str:
        return self.backend.url

    # -- names ---------------------------------------------------------------
    def resolve(self, ref: str) -> str:
        """The checkpoint id ``ref`` names: a ref, ``name@N`` (N versions back), or an id prefix."""
        if not isinstance(ref, str) or not ref:
            raise RefNotFoundError("empty ref")
        m = _HISTORY.match(ref)
        if m:
            name, back = m.group(1), int(m.group(2))
            versions = [e for e in self.refs_db.history(name) if e.target is not None]
            if back >= len(versions):
                raise RefNotFoundError(f"{name} has {len(versions)} versions; {ref} does not exist", hint=f"see `ckpt log {name}`")
            if back == 0 and self.refs_db.current(name) is None:
                raise RefNotFoundError(f"ref {name} was removed", hint=f"its history: `ckpt log {name}`")
            return versions[back].target  # type: ignore[return-value]
        try:
            entry = self.refs_db.current(ref)
        except InvalidNameError:
            entry = None
            if not _HEX.match(ref):
                raise
        if entry is not None:
            return entry.target  # type: ignore[return-value]
        if _HEX.match(ref):
            found = self.objects.find_manifests(ref)
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                raise AmbiguousRefError(f"{ref} matches {len(found)} checkpoints", hint="give more digits")
        raise RefNotFoundError(f"no ref or checkpoint named {ref!r}", hint="see `ckpt ls`")

    def get_manifest(self, manifest_id: str) -> Manifest:
        return Manifest.from_json(self.objects.get_manifest(manifest_id), f"manifest {manifest_id}")

    def manifest(self, ref: str) -> Manifest:
        return self.get_manifest(self.resolve(ref))

    def refs(self) -> dict[str, RefEntry]:
        """Every live ref and its current entry, by name."""
        from ckpt.store.catalog import live_refs

        return live_refs(self)

    def ls(self) -> list[RefInfo]:
        """Every live ref with a summary of its checkpoint (size, tensors, message), by name.

        Reads the store's metadata index, checked against the listing of refs, instead of
        every manifest (storage/index.py).

        >>> import torch, ckpt
        >>> store = ckpt.Store.init("memory://doctest-ls")
        >>> _ = store.push({"w": torch.zeros(4)}, "demo/a", message="first")
        >>> [(r.name, r.bytes, r.tensors, r.message) for r in store.ls()]
        [('demo/a', 80, 1, 'first')]
        """
        from ckpt.store.catalog import list_refs

        return list_refs(self)

    def log(self, name: str) -> list[RefEntry]:
        """History of ``name``, newest first (removals included, with ``target`` None)."""
        history = self.refs_db.history(name)
        if not history:
            raise RefNotFoundError(f"no ref named {name!r}", hint="see `ckpt ls`")
        return history

    def remove(self, name: str) -> RefEntry:
        """Remove ref ``name`` (its data is freed by a later ``gc``)."""
        validate_ref_name(name)
        if self.refs_db.current(name) is None:
            raise RefNotFoundError(f"no ref named {name!r}", hint="see `ckpt ls`")
        return self.refs_db.remove(name)

    # -- data ----------------------------------------------------------------
    def push(self, source: object, name: str | None = None, message: str | None = None,
             metadata: dict[str, Any] | None = None, *, base: str | None = None, delta: bool = True,
             progress: Progress | None = None) -> str:
        """Store ``source`` and point ref ``name`` at it; returns the checkpoint id.

        ``source`` is a ``.safetensors`` file, a Hugging Face model directory, a
        ``.pt``/``.bin`` state dict (read with ``weights_only=True``) or a dict of tensors.
        Only chunks the store lacks are written. New chunks are delta-encoded against
        ``base`` (a ref), else the ref's previous version, else the stored checkpoint
        that shares the most tensors, whenever that is smaller; ``delta=False`` turns
        this off.
        """
        return self.push_report(source, name, message, metadata, base=base, delta=delta, progress=progress).id

    def push_report(self, source: object, name: str | None = None, message: str | None = None,
                    metadata: dict[str, Any] | None = None, *, base: str | None = None, delta: bool = True,
                    progress: Progress | None = None) -> PushResult:
        """Like :meth:`push`, returning what was written as well."""
        from ckpt.store.push import push

        return push(self, source, name, message=message, metadata=metadata, base=base, delta=delta, progress=progress)

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

    def load(self, ref: str, *, include: list[str] | None = None, progress: Progress | None = None) -> dict[str, torch.Tensor]:
        """All tensors of ``ref`` (or those matching ``include`` globs) as CPU tensors."""
        from ckpt.store.load import load

        return load(self, ref, include=include, progress=progress)

    def load_into(self, ref: str, target: Any, *, strict: bool = True, progress: Progress | None = None) -> None:
        """Decode ``ref`` straight into the tensors of ``target`` (``nn.Module`` or dict), in place."""
        from ckpt.store.load import load_into

        load_into(self, ref, target, strict=strict, progress=progress)

    def reader(self, ref: str) -> CheckpointReader:
        """A lazy reader that fetches one tensor at a time."""
        from ckpt.store.reader import CheckpointReader

        mid = self.resolve(ref)
        return CheckpointReader(self, mid, self.get_manifest(mid))

    # -- between stores ----------------------------------------------------------
    def copy_to(self, dest: Store | str | os.PathLike[str], refs: list[str], *,
                storage_options: dict[str, Any] | None = None, progress: Progress | None = None) -> CopyReport:
        """Copy checkpoints ``refs`` (``REF`` or ``REF:NAME``) to store ``dest`` (created if needed).

        Only objects ``dest`` lacks travel, verified, in the order chunks, manifests,
        refs; see :func:`ckpt.store.copy.copy_refs`.
        """
        from ckpt.store.copy import copy_refs

        if not isinstance(dest, Store):
            dest = Store.open(dest, storage_options=storage_options, settings=self.settings, create=True)
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
        from ckpt.store.maintenance import repair

        src = source if isinstance(source, Store) else Store.open(source)
        return repair(self, src, names, progress)

    def du(self) -> StoreUsage:
        from ckpt.store.maintenance import du

        return du(self)

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False, keep_history: bool = True) -> GcReport:
        from ckpt.store.maintenance import gc

        return gc(self, grace_s=grace_s, dry_run=dry_run, keep_history=keep_history)
