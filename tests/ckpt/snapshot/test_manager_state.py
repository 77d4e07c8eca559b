"""ckpt/snapshot/manager_state.py: every attribute and method a mixin of CheckpointManager uses is declared."""

from __future__ import annotations

import ast
import pathlib

import pytest

import ckpt.snapshot as snapshot

HERE = pathlib.Path(snapshot.__file__).parent
MIXINS = {"saving.py": "Saving", "persisting.py": "Persisting", "restoring.py": "Restoring", "pruning.py": "Pruning",
          "preemption.py": "Preemption"}


def _class(path: pathlib.Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)


def _defined(cls: ast.ClassDef) -> set[str]:
    """What a class body declares: annotated names and functions (also under ``if TYPE_CHECKING:``)."""
    names: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    return names


@pytest.mark.parametrize("module", sorted(MIXINS))
def test_a_mixin_uses_only_what_it_defines_or_the_shared_state_declares(module):
    """The mixins read state only CheckpointManager.__init__ sets: a reader (and a type checker) of one
    mixin found no word of it. ManagerState declares it; this keeps it so."""
    declared = _defined(_class(HERE / "manager_state.py", "ManagerState"))
    cls = _class(HERE / module, MIXINS[module])
    own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    used = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}
    assert sorted(used - own - declared) == []
    assert cls.bases and {b.id for b in cls.bases if isinstance(b, ast.Name)} == {"ManagerState"}


def test_the_manager_sets_every_attribute_the_shared_state_declares():
    """Declared, and set by __init__ (so that no declaration outlives the state it names)."""
    import torch

    import ckpt
    from ckpt.snapshot.manager_state import ManagerState

    with ckpt.CheckpointManager("memory://manager-state", "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        missing = [n for n in ManagerState.__annotations__ if not hasattr(mgr, n)]
    assert missing == []
