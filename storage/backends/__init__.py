"""Backends by URL scheme: a plain path or ``file://`` is a local directory, ``s3://`` is S3,
any other scheme goes to fsspec.

The registry is a table, not an import side effect: a backend's module is imported
when a store of its scheme is first opened, and a missing optional dependency becomes a
:class:`MissingDependencyError` saying which extra to install. Registering a scheme twice
is an error, never a silent overwrite.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from ckpt_store.storage.backends.base import Backend, Data, Entry, joined
from ckpt_store.storage.errors import MissingDependencyError, StoreLocationError


@dataclass(frozen=True)
class BackendSpec:
    """Where the backend of a scheme lives: ``module``'s class ``cls``, whose dependencies
    come with ``pip install 'ckpt-store[extra]'`` (None: always installed)."""

    module: str
    cls: str
    extra: str | None = None


_PKG = __name__
_REGISTRY: dict[str, BackendSpec] = {
    "file": BackendSpec(f"{_PKG}.local", "LocalBackend"),
    "s3": BackendSpec(f"{_PKG}.s3", "S3Backend", "s3"),
    "s3a": BackendSpec(f"{_PKG}.s3", "S3Backend", "s3"),
}
# Every scheme not in the table: fsspec knows memory://, gs://, az://, hdfs:// and more.
_FALLBACK = BackendSpec(f"{_PKG}.fsspec_backend", "FsspecBackend")


_FSSPEC_REMOTE = {"gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "webhdfs", "memory", "http", "https", "ftp",
                  "sftp", "ssh", "oss", "hf"}
# A scheme (two letters or more: "c:" is a Windows drive) and ':' without the '//' after it.
_SLASH_MISSING = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(?!//)/?")


def _remote_schemes() -> set[str]:
    """Schemes of stores that are no local folder: ours, and the common ones fsspec serves."""
    return {s for s in _REGISTRY if s != "file"} | _FSSPEC_REMOTE


def register_backend(scheme: str, spec: BackendSpec) -> None:
    """Serve ``scheme://`` URLs with ``spec``'s class (which implements :class:`Backend`,
    including ``from_url``). Raises ValueError if the scheme already has a backend."""
    if scheme in _REGISTRY:
        raise ValueError(f"scheme {scheme!r} already has a backend ({_REGISTRY[scheme].module}.{_REGISTRY[scheme].cls})")
    _REGISTRY[scheme] = spec


def scheme_of(url: str) -> str:
    """``s3`` for ``s3://b/p``; ``file`` for a plain path."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def backend_class(scheme: str) -> type[Backend]:
    """The class serving ``scheme``, imported now. Raises MissingDependencyError with an install hint."""
    spec = _REGISTRY.get(scheme, _FALLBACK)
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        if spec.extra is None:
            raise
        raise MissingDependencyError(f"{scheme}:// stores need {e.name or 'a package that is not installed'}",
                                     hint=f"install it: pip install 'ckpt-store[{spec.extra}]'") from None
    cls: type[Backend] = getattr(module, spec.cls)
    return cls


def open_backend(url: str, *, storage_options: dict[str, Any] | None = None, fsync: bool = True,
                 remote: dict[str, Any] | None = None) -> Backend:
    """The backend for ``url``. ``fsync`` applies to local stores; ``remote`` holds what
    remote backends take from the settings (``concurrency``, ``retry``, ``conditional_writes``)."""
    if not url.strip() or url.strip() == "file://":
        # An empty --store would otherwise mean the current directory, silently.
        raise StoreLocationError("empty store URL", hint="give a path or URL, e.g. --store ./ckpt-store")
    typo = _SLASH_MISSING.match(url)
    if typo and typo.group(1).lower() in _remote_schemes():
        # s3:/bucket/store would otherwise be a local folder named "s3:": a push the team never sees.
        scheme, rest = typo.group(1), url[typo.end():]
        raise StoreLocationError(f"{url!r} looks like a {scheme}:// URL with a slash missing",
                                 hint=f"write {scheme}://{rest.lstrip('/')}, or ./{url} for a local folder of that name")
    return backend_class(scheme_of(url)).from_url(url, storage_options=storage_options, fsync=fsync, remote=remote)


__all__ = ["Backend", "BackendSpec", "Data", "Entry", "backend_class", "joined", "open_backend", "register_backend",
           "scheme_of"]
