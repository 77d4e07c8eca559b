"""ckpt: a content-addressed store for PyTorch checkpoints and fine-tunes.

>>> import ckpt
>>> store = ckpt.Store.init("memory://ckpt-init-doctest")
>>> sorted(store.refs())
[]

The public API is :class:`Store` (open/init, push, pull, load, load_into, reader,
verify, du, gc), :class:`CheckpointManager` (training-loop snapshots) with
:class:`RNGState` and the :class:`Stateful` protocol, :class:`Settings`, the
verbs :func:`diff`, :func:`merge` and :func:`remix`, and the errors in :mod:`ckpt.errors`.
Importing ckpt is cheap: torch and the rest load when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["CheckpointManager", "CheckpointReader", "CkptError", "RNGState", "Settings", "Stateful", "Store", "__version__",
           "diff", "merge", "remix"]

if TYPE_CHECKING:
    from ckpt.errors import CkptError
    from ckpt.manager import CheckpointManager
    from ckpt.state import RNGState, Stateful
    from ckpt.reader import CheckpointReader
    from ckpt.settings import Settings
    from ckpt.store import Store
    from ckpt.diff import diff
    from ckpt.merge import merge
    from ckpt.remix import remix

_LAZY = {
    "Store": "ckpt.store",
    "Settings": "ckpt.settings",
    "CheckpointReader": "ckpt.reader",
    "CkptError": "ckpt.errors",
    "CheckpointManager": "ckpt.manager",
    "RNGState": "ckpt.state",
    "Stateful": "ckpt.state",
    "diff": "ckpt.diff",
    "merge": "ckpt.merge",
    "remix": "ckpt.remix",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def _callable_module(module_name: str, fn_name: str) -> None:
    """Make module ``ckpt.X`` callable as its function ``X``.

    ``diff``, ``merge`` and ``remix`` are functions living in modules of the same name:
    importing such a module (``from ckpt.diff import DiffReport``) binds the package
    attribute ``ckpt.diff`` to the module, not the function. Calling the module calls
    the function, so ``ckpt.diff(a, b)`` works whatever was imported first.
    """
    import sys
    import types

    class CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            fn = getattr(self, fn_name)
            return fn(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
