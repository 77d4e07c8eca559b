"""Architecture rules checked on the source: layering and never executing stored data."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "ckpt", "storage")


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _files(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


def test_layers_point_one_way():
    """cli -> ckpt -> storage; storage never imports torch."""
    forbidden = {"storage": {"ckpt", "cli", "torch", "numpy"}, "ckpt": {"cli"}}
    for pkg, bad in forbidden.items():
        for f in _files(pkg):
            assert not (_imports(f) & bad), f"{f.relative_to(ROOT)} imports {_imports(f) & bad}"


def test_no_code_execution_on_stored_data():
    """No pickle.load(s), eval, exec, or torch.load without weights_only=True anywhere in the product."""
    for pkg in PACKAGES:
        for f in _files(pkg):
            for node in ast.walk(ast.parse(f.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                owner = getattr(fn.value, "id", "") if isinstance(fn, ast.Attribute) else ""
                where = f"{f.relative_to(ROOT)}:{node.lineno}"
                assert name not in ("eval", "exec", "loads" if owner in ("pickle", "marshal") else "", "Unpickler"), where
                assert not (owner in ("pickle", "marshal", "dill", "cloudpickle") and name in ("load", "loads")), where
                if owner == "torch" and name == "load":
                    kw = {k.arg: k.value for k in node.keywords}
                    assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, where


def test_import_ckpt_is_light():
    code = "import ckpt, sys; print(sorted(m for m in ('torch', 'rich', 'typer', 'numpy', 'fsspec') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_integrations_load_their_framework_only_on_request():
    """``import ckpt`` and ``ckpt.integrations`` never import Lightning or transformers."""
    frameworks = ("pytorch_lightning", "lightning", "transformers", "accelerate", "torch")
    code = f"import ckpt, ckpt.integrations, sys; print(sorted(m for m in {frameworks!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
