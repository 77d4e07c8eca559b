"""Architecture rules checked on the source: layering and never executing stored data."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# source folder -> the name it is installed under (setup.py)
PACKAGES = {"cli": "ckpt_store.cli", "ckpt": "ckpt", "storage": "ckpt_store.storage"}
LAYER_OF = {name: folder for folder, name in PACKAGES.items()}


def _layer(module: str) -> str:
    """The layer (source folder) ``module`` belongs to, or its top-level name if none."""
    for name, folder in LAYER_OF.items():
        if module == name or module.startswith(name + "."):
            return folder
    return module.split(".")[0]


def _imports(path: pathlib.Path) -> set[str]:
    """Layers and top-level modules ``path`` imports (lazy imports inside functions included)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_layer(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(_layer(node.module))
    return found


def _files(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


def test_layers_point_one_way():
    """cli -> ckpt -> storage, with no shortcut: cli talks to ckpt's API only; storage never imports torch."""
    forbidden = {"storage": {"ckpt", "cli", "torch", "numpy"}, "ckpt": {"cli"}, "cli": {"storage"}}
    for pkg, bad in forbidden.items():
        for f in _files(pkg):
            assert not (_imports(f) & bad), f"{f.relative_to(ROOT)} imports {_imports(f) & bad}"


def test_cli_uses_only_the_public_store_api():
    """cli/ asks Store's public methods; it never reaches into ``store.objects``, ``store.refs_db``
    or ``store.backend`` (storage's objects), which would tie the command line to the layer below."""
    internals = {"objects", "refs_db", "backend"}
    stores = {"store", "src", "dst", "dest", "s"}  # how cli/ names an open Store (a report's .objects is fine)
    for f in _files("cli"):
        for node in ast.walk(ast.parse(f.read_text())):
            owner = node.value.id if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) else ""
            if isinstance(node, ast.Attribute) and node.attr in internals and (owner in stores or "store" in owner):
                raise AssertionError(f"{f.relative_to(ROOT)}:{node.lineno} uses .{node.attr}")


def test_layer_check_sees_every_spelling(tmp_path):
    """The check above must not be blind to lazy imports or the installed names."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from ckpt_store.storage.refs import Refs\n    import ckpt_store.cli.main\n")
    assert {"storage", "cli"} <= _imports(f)


def test_no_private_name_crosses_a_module():
    """``from X import _name`` is how one module reaches into another's internals: never."""
    for pkg in PACKAGES:
        for f in _files(pkg):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and _layer(node.module) in PACKAGES:
                    private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                    private = [n for n in private if not (node.module.endswith("codecs") and n == "_native")]
                    # A public name imported under a private alias hides the same crossing from a reader.
                    private += [f"{a.name} as {a.asname}" for a in node.names if a.asname and a.asname.startswith("_")]
                    assert not private, f"{f.relative_to(ROOT)}:{node.lineno} imports {private} from {node.module}"


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


def test_import_names_cannot_be_shadowed(tmp_path):
    """A user's own ``storage.py`` and ``cli.py`` (or PyPI's unrelated ``storage``) next to their
    script must not replace ours: ckpt and its command import their layers by names of ours."""
    (tmp_path / "storage.py").write_text("raise ImportError('decoy storage imported')\n")
    (tmp_path / "cli.py").write_text("raise ImportError('decoy cli imported')\n")
    code = ("import ckpt, torch; s = ckpt.Store.init('memory://decoy'); s.push({'w': torch.ones(2)}, 'a'); "
            "import ckpt_store.cli.main; print(sorted(s.refs()))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['a']"


def test_import_ckpt_is_light():
    code = "import ckpt, sys; print(sorted(m for m in ('torch', 'rich', 'typer', 'numpy', 'fsspec') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_housekeeping_modules_import_no_codec():
    """What ls, log, show, du and gc run on (the store, its maintenance, the CLI and its documents)
    imports neither numpy nor zstandard nor the codecs: those commands decode no chunk."""
    heavy = ("torch", "numpy", "safetensors", "zstandard", "ckpt.codecs.chunk", "ckpt.transfer.pipeline", "fsspec")
    code = ("import ckpt.store.store, ckpt.store.maintenance, ckpt_store.cli.main, ckpt_store.cli.results, sys; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_integrations_load_their_framework_only_on_request():
    """``import ckpt`` and ``ckpt.integrations`` never import Lightning or transformers."""
    frameworks = ("pytorch_lightning", "lightning", "transformers", "accelerate", "torch")
    code = f"import ckpt, ckpt.integrations, sys; print(sorted(m for m in {frameworks!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow  # (8-9 s: a whole collection in a subprocess; run by .ci/run's slow pass)
def test_pytest_collects_without_the_optional_frameworks():
    """--doctest-modules imports every module; without pytorch_lightning/transformers the
    modules that need them are left out by the root conftest, instead of stopping the run."""
    code = ("import sys, pytest; sys.modules['pytorch_lightning'] = sys.modules['transformers'] = None; "
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'ckpt/integrations', "
            "'tests/ckpt']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 5), r.stdout[-2000:] + r.stderr[-2000:]  # 5: nothing left to collect there
    assert "errors during collection" not in r.stdout and "ERROR " not in r.stdout, r.stdout[-2000:]


def test_the_wheel_ships_no_test_configuration():
    assert not list((ROOT / "ckpt").rglob("conftest.py"))


def _module_name(path: pathlib.Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """Our modules ``path`` imports, lazily inside functions too, but not under TYPE_CHECKING."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for alt in child.orelse:
                    visit(alt)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name in known)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.update(n for n in [child.module, *(f"{child.module}.{a.name}" for a in child.names)] if n in known)
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def test_no_import_cycles():
    """Each module's imports (lazy ones included) form no cycle: a lazy import that only
    hides a cycle still ties the two modules together."""
    paths = {_module_name(p): p for pkg in PACKAGES for p in _files(pkg)}
    graph = {m: _module_imports(p, set(paths)) - {m} for m, p in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def dfs(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                dfs(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
