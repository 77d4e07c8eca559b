"""The calling convention of the verbs that make checkpoints from others.

``diff``, ``merge``, ``remix`` and ``remix_scores`` take what they work on first and the
store as the keyword ``store=`` (default: the default store, as ``Store.open()`` finds
it). Earlier releases took ``merge(store, inputs, ...)`` and ``remix(store, ...)``; those
calls still work for one release, with a DeprecationWarning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt._deprecation import deprecated

if TYPE_CHECKING:
    from ckpt.store.store import Store


def positionals(verb: str, args: tuple[Any, ...], defaults: tuple[Any, ...], store: Store | None) -> tuple[tuple[Any, ...], Store]:
    """The positional arguments of ``verb`` as today's signature names them, padded with
    ``defaults``, and the store to use. A first argument that is a store is the old order."""
    from ckpt.store.store import Store

    if args and isinstance(args[0], Store):
        if store is not None:
            raise TypeError(f"{verb}() got a store both first and as store=")
        deprecated(f"ckpt.{verb}(store, ...)", f"ckpt.{verb}(..., store=store)", stacklevel=4)
        store, args = args[0], args[1:]
    if len(args) > len(defaults):
        raise TypeError(f"{verb}() takes at most {len(defaults)} positional arguments ({len(args)} given)")
    return (*args, *defaults[len(args):]), store if store is not None else Store.open()
