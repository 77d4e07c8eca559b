"""Shared by the integration tests: load a training script as a module, run it as a process, compare bits."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

HERE = pathlib.Path(__file__).parent / "ckpt" / "integrations"  # the framework scripts
ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ckpt_test_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: object, expect: int = 0) -> tuple[dict, dict]:
    """Run ``name``.py in a fresh interpreter; its (losses, tensors) when it exits normally."""
    outdir = pathlib.Path(str(args[1]))
    outdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    r = subprocess.run([sys.executable, str(HERE / f"{name}.py"), *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=300, check=False)
    assert r.returncode == expect, r.stdout[-3000:] + r.stderr[-3000:]
    if expect != 0:
        return {}, {}
    from safetensors.torch import load_file

    losses = json.loads((outdir / "result.json").read_text())
    return {int(k) if k.isdigit() else k: v for k, v in losses.items()}, load_file(outdir / "result.safetensors")


def start_process(script: pathlib.Path, *args: object, **env: str) -> subprocess.Popen[str]:
    """Start ``script`` in a fresh interpreter on one torch thread (``env`` added to the environment),
    its output captured: a training process a test kills or lets run (:func:`wait_process`)."""
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def wait_process(p: subprocess.Popen[str], expect: int = 0) -> subprocess.CompletedProcess[str]:
    """Wait for ``p`` (at most 120 s: then it is killed) and check that it exits with ``expect``."""
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode == expect, out + err
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def fill_medium(path: str | os.PathLike[str], leave: int = 0) -> None:
    """Another tenant of a medium (a small tmpfs, say): the file ``path`` on it, of all its free space but
    ``leave`` bytes (written until ENOSPC, then cut)."""
    block = b"\0" * (1 << 20)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass
    os.truncate(path, max(os.path.getsize(path) - leave, 0))


def flip_a_byte(path: str | os.PathLike[str]) -> None:
    """Damage a stored object in place: a bit of its middle byte flipped (made writable first: a store writes its
    objects read-only)."""
    os.chmod(path, 0o644)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[len(raw) // 2] ^= 1
    with open(path, "wb") as f:
        f.write(bytes(raw))


def opening_refused(folder: str | os.PathLike[str]) -> Callable[..., int]:
    """``os.open`` that refuses to open ``folder`` as a folder, as a drop box (mode 0333: write, no read) refuses a
    user; root reads any folder, so tests make the refusal so (``monkeypatch.setattr(os, "open", ...)``)."""
    real, refused = os.open, os.fspath(folder)

    def open_(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if os.fspath(path) == refused and flags & os.O_DIRECTORY:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, flags, *a, **kw)

    return open_


def tensor_bits(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` (any device, any layout): what bit-exact tests compare."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_bits(model: torch.nn.Module | dict, opt: torch.optim.Optimizer | dict) -> tuple[dict, dict]:
    """The bytes of a model's state dict and of its optimizer's per-parameter state (either given as the
    object, or as its state dict: one read back with ``torch.load``, say)."""
    model_sd = model if isinstance(model, dict) else model.state_dict()
    opt_sd = opt if isinstance(opt, dict) else opt.state_dict()
    return ({k: tensor_bits(v) for k, v in model_sd.items()},
            {i: {k: tensor_bits(v) for k, v in st.items()} for i, st in opt_sd["state"].items()})


def assert_same_bits(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(got)
    for name, a in expected.items():
        b = got[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), name


def assert_same_tree(want: object, got: object, at: str = "") -> None:
    """``got`` is ``want`` exactly: the same dicts (keys of the same types, in the same order; an
    OrderedDict compares as a dict), lists and tuples, values equal and of the same type, tensors
    of the same dtype, shape and bytes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and (got.dtype, got.shape) == (want.dtype, want.shape), at
        assert tensor_bits(got) == tensor_bits(want), at
    elif isinstance(want, dict):
        assert isinstance(got, dict) and [(type(k), k) for k in got] == [(type(k), k) for k in want], at
        for k, v in want.items():
            assert_same_tree(v, got[k], f"{at}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), at
        for i, (w, g) in enumerate(zip(want, got)):
            assert_same_tree(w, g, f"{at}[{i}]")
    else:
        assert type(got) is type(want) and (got == want or (got != got and want != want)), at  # nan is itself


def script_main(train: object) -> None:
    """The command line of a training script: ``SCRIPT STORE OUTDIR MODE STEPS [KILL_AT]``.

    Runs ``train`` and writes its losses (``result.json``) and tensors
    (``result.safetensors``, each tensor its own copy: tied weights share storage) to
    OUTDIR, which :func:`run_script` reads back.
    """
    from safetensors.torch import save_file

    store, outdir, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    losses, flat = train(store, outdir, mode, steps, int(sys.argv[5]) if len(sys.argv) > 5 else -1)  # type: ignore[operator]
    with open(os.path.join(outdir, "result.json"), "w") as f:
        json.dump(losses, f)
    save_file({k: v.clone() for k, v in flat.items()}, os.path.join(outdir, "result.safetensors"))
