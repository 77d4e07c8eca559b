"""A destination's files are placed all or nothing (ckpt/store/atomic_files.py), even with another
pull placing files in the same folder at once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

# A pull that stops after its first file is renamed into place (the rest complete under their
# temporary names), says so by making ``paused``, and goes on once ``go`` exists.
_PAUSED_PULL = """
import os, sys, time
import ckpt
real_replace, marks = os.replace, sys.argv[4]
def replace(src, dst, *a, **kw):
    real_replace(src, dst, *a, **kw)
    if ".ckpt-" not in os.path.basename(dst) and not os.path.exists(marks + "/paused"):
        open(marks + "/paused", "w").close()
        while not os.path.exists(marks + "/go"):
            time.sleep(0.01)
os.replace = replace
ckpt.Store.open(sys.argv[1]).pull(sys.argv[2], sys.argv[3], overwrite=True)
"""
_PULL = "import ckpt, sys; ckpt.Store.open(sys.argv[1]).pull(sys.argv[2], sys.argv[3], overwrite=True)"


def _folder(d: Path, fill: float) -> Path:
    d.mkdir()
    save_file({"w": torch.full((16,), fill)}, d / "model.safetensors")
    for i in range(4):
        (d / f"part{i}.json").write_text(f'{{"fill": {fill}, "part": {i}}}')
    return d


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _waits_on_a_lock(pid: int) -> bool:
    """Whether process ``pid`` is blocked on a file lock (a ``->`` line of /proc/locks)."""
    with open("/proc/locks") as f:
        return any(line.split()[1] == "->" and line.split()[5] == str(pid) for line in f if len(line.split()) > 5)


def test_two_force_pulls_into_one_folder_at_once_leave_one_checkpoint_whole(store, tmp_path):
    """Two `pull --force` of different checkpoints into one folder at once both succeed; the folder
    then holds one of them whole, never some files of each (the second's renames wait for the first's)."""
    x, y = _folder(tmp_path / "x", 1.0), _folder(tmp_path / "y", 2.0)
    store.push(x, "x")
    store.push(y, "y")
    dest, marks = tmp_path / "dest", tmp_path / "marks"
    dest.mkdir()
    marks.mkdir()
    (dest / "keep.txt").write_text("precious")
    first = subprocess.Popen([sys.executable, "-c", _PAUSED_PULL, store.url, "x", str(dest), str(marks)],
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (marks / "paused").exists():
            assert first.poll() is None, first.stderr.read().decode() if first.stderr else ""
            assert time.monotonic() < deadline, "the first pull never reached its renames"
            time.sleep(0.01)
        second = subprocess.Popen([sys.executable, "-c", _PULL, store.url, "y", str(dest)], stderr=subprocess.PIPE)
        # The second pull either completes while the first is half placed, or waits for it.
        while second.poll() is None and not _waits_on_a_lock(second.pid):
            assert time.monotonic() < deadline, "the second pull neither ended nor waited"
            time.sleep(0.01)
    finally:
        (marks / "go").touch()
    _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err.decode()
    _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err.decode()
    got = _tree(dest)
    assert got.pop("keep.txt") == b"precious"
    assert got == _tree(y)  # the second, whole: it waited for the first's renames, then replaced each file
    assert [p.name for p in dest.iterdir() if ".ckpt-" in p.name] == []
