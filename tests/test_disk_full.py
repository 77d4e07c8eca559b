"""A full disk and a read-only store: a push fails cleanly and says why; nothing committed is lost.

Three real setups:

* a small tmpfs mounted for the test (needs root / CAP_SYS_ADMIN; skipped otherwise):
  the kernel's own ENOSPC, at whatever write it lands on;
* an fsspec filesystem (a real in-memory one) that refuses writes once a byte budget is
  spent, so the failing write is chosen precisely and runs everywhere;
* a read-only store (permissions; as root the reader runs as ``nobody``): pulls, ls,
  show and verify work, a push fails with one clear line.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from safetensors.torch import save_file

import ckpt
from ckpt_store.storage.errors import StorageIOError


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensors(seed: int, mb: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(mb * 2**20 / 4 / 4)
    return {f"t{i}": torch.randn(n, generator=g) for i in range(4)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(_bits(a[k]) == _bits(b[k]) for k in a)


def _check_after_failure(store: ckpt.Store, kept: dict[str, dict[str, torch.Tensor]]) -> None:
    report = store.verify()
    assert report.ok, report.problems
    assert sorted(store.refs()) == sorted(kept)
    for ref, want in kept.items():
        assert _same(store.load(ref), want), ref


# -- a real full filesystem -----------------------------------------------------------


@pytest.fixture
def small_fs():
    mnt = Path(tempfile.mkdtemp(prefix="ckpt-full-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or 'not root'}); the fsspec test covers ENOSPC")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def test_push_into_a_full_filesystem_fails_cleanly(small_fs: Path) -> None:
    store = ckpt.Store.init(str(small_fs / "store"))
    first = _tensors(1, 4)
    store.push(first, "first")
    big = _tensors(2, 16)  # random floats barely compress: this cannot fit in what is left
    with pytest.raises(StorageIOError, match="disk is full"):
        store.push(big, "big")
    _check_after_failure(store, {"first": first})
    # The failed push's leftovers go with gc, and the space is usable again.
    store.gc(grace_s=0)
    assert not [p for p in (small_fs / "store").rglob(".tmp-*")]
    small = _tensors(3, 1)
    store.push(small, "small")
    _check_after_failure(store, {"first": first, "small": small})


def test_cli_says_disk_full_in_one_line(small_fs: Path, tmp_path: Path) -> None:
    store_url = str(small_fs / "store")
    ckpt.Store.init(store_url)
    src = tmp_path / "big.safetensors"
    save_file(_tensors(4, 16), str(src))
    exe = Path(sys.executable).parent / "ckpt"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "cli.main"]
    r = subprocess.run([*cmd, "--store", store_url, "push", str(src), "big"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error:") and "disk is full" in r.stderr, r.stderr


# -- a filesystem that runs out after N bytes (fsspec) -----------------------------------


class BudgetFileSystem(MemoryFileSystem):
    """An in-memory filesystem whose writes fail with ENOSPC once ``budget`` bytes are spent."""

    protocol = "ckpt-budget"
    budget: dict[str, int] = {}  # root -> bytes left (class-level: fsspec caches instances)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):  # type: ignore[override]
        root = next((r for r in self.budget if f"{r}/" in path), None)
        if root is not None:
            left = self.budget[root]
            if len(value) > left:
                raise OSError(errno.ENOSPC, "No space left on device", path)
            self.budget[root] = left - len(value)
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation(BudgetFileSystem.protocol, BudgetFileSystem, clobber=True)


def test_push_over_budget_fails_cleanly_on_fsspec() -> None:
    root = f"full-{uuid.uuid4().hex[:8]}"
    url = f"{BudgetFileSystem.protocol}://{root}/store"
    store = ckpt.Store.init(url)
    first = _tensors(5, 1)
    store.push(first, "first")
    # Budget for about half of the next push: some chunks land, then the disk is "full".
    BudgetFileSystem.budget[root] = 2 * 2**20
    with pytest.raises(StorageIOError, match="disk is full") as exc:
        store.push(_tensors(6, 4), "second")
    assert not exc.value.retryable
    _check_after_failure(store, {"first": first})
    BudgetFileSystem.budget.pop(root)
    second = _tensors(6, 4)
    store.push(second, "second")  # space again: the push completes, reusing what landed
    _check_after_failure(store, {"first": first, "second": second})


# -- a read-only store ------------------------------------------------------------------

READER = r"""
import sys, json
sys.path.insert(0, sys.argv[1])
import ckpt
store = ckpt.Store.open(sys.argv[2])
print(json.dumps({"refs": sorted(store.refs()), "ok": store.verify().ok}))
store.pull("m", sys.argv[3])
"""


def _read_only_mount(src: Path, dst: Path) -> str:
    dst.mkdir()
    for args in (["mount", "--bind", str(src), str(dst)], ["mount", "-o", "remount,ro,bind", str(dst)]):
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["umount", str(dst)], capture_output=True)
            pytest.skip(f"running as root and cannot make a read-only bind mount: {r.stderr.strip()}")
    return str(dst)


def test_read_only_store_serves_pulls() -> None:
    base = Path(tempfile.mkdtemp(prefix="ckpt-ro-"))
    try:
        os.chmod(base, 0o755)
        url = str(base / "store")
        store = ckpt.Store.init(url)
        src = base / "m.safetensors"
        save_file(_tensors(7, 1), str(src))
        store.push(str(src), "m")
        out = base / "out"
        out.mkdir()
        os.chmod(out, 0o777)
        for p in [base / "store", *(base / "store").rglob("*")]:
            os.chmod(p, 0o555 if p.is_dir() else 0o444)
        if os.geteuid() == 0:  # root ignores permissions: serve the store through a read-only bind mount
            url = _read_only_mount(base / "store", base / "ro")
        repo = str(Path(ckpt.__file__).resolve().parent.parent)
        env = {**os.environ, "HOME": str(out), "PYTHONPATH": repo}
        r = subprocess.run([sys.executable, "-c", READER, repo, url, str(out / "m.safetensors")], capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert '"ok": true' in r.stdout and '"refs": ["m"]' in r.stdout
        assert (out / "m.safetensors").read_bytes() == src.read_bytes()
        # A push into it fails with one line that says why, and changes nothing.
        exe = Path(sys.executable).parent / "ckpt"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "cli.main"]
        before = sorted(str(p) for p in (base / "store").rglob("*"))
        r = subprocess.run([*cmd, "--store", url, "push", str(src), "again"], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert r.stderr.startswith("error:") and "permission denied" in r.stderr.lower(), r.stderr
        assert sorted(str(p) for p in (base / "store").rglob("*")) == before
    finally:
        if (base / "ro").is_dir():
            subprocess.run(["umount", str(base / "ro")], check=False)
        for p in [base, *base.rglob("*")]:
            if p.is_dir():
                os.chmod(p, 0o755)
        shutil.rmtree(base)
