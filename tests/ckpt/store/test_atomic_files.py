"""A destination's files are placed all or nothing (ckpt/store/atomic_files.py), even with another
pull placing files in the same folder at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
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


# A pull that stops right after its first check of the destination (nothing of it written yet), says
# so by making ``checked-PID``, and goes on once ``go`` exists. ARGV: store ref dest marks force(0/1).
_CHECKED_PULL = """
import os, sys, time
import ckpt, ckpt.store.pull as pull
real, marks, first = pull.dir_targets, sys.argv[4], []
def checked(*a, **kw):
    found = real(*a, **kw)
    if not first:  # (the check again, as the files are placed, is not paused)
        first.append(1)
        open(f"{marks}/checked-{os.getpid()}", "w").close()
        while not os.path.exists(marks + "/go"):
            time.sleep(0.01)
    return found
pull.dir_targets = checked
ckpt.Store.open(sys.argv[1]).pull(sys.argv[2], sys.argv[3], overwrite=sys.argv[5] == "1")
"""


def _checked_pulls(store, dest: Path, marks: Path, refs: list[str], force: bool) -> list[subprocess.Popen]:
    """Start a paused pull of each of ``refs`` into ``dest``; return once every one has checked it."""
    marks.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _CHECKED_PULL, store.url, r, str(dest), str(marks), "1" if force else "0"],
                              stderr=subprocess.PIPE) for r in refs]
    deadline = time.monotonic() + 60
    while len(list(marks.glob("checked-*"))) < len(procs):
        for p in procs:
            assert p.poll() is None, p.stderr.read().decode() if p.stderr else ""
        assert time.monotonic() < deadline, "the pulls never checked their destination"
        time.sleep(0.01)
    return procs


def _ends(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    errs = [p.communicate(timeout=60)[1].decode() for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


def _ckpt_names(d: Path) -> list[str]:
    return sorted(p.name for p in d.rglob("*") if ".ckpt-" in p.name)


def test_two_pulls_into_one_empty_folder_never_mix_two_checkpoints(store, tmp_path):
    """Two pulls without --force of checkpoints sharing no file name, into one empty folder: both found
    it empty; the second to place its files finds the first's there and refuses (it placed them too:
    the folder held both checkpoints mixed). Nothing of the one refused is left."""
    x, y = _folder(tmp_path / "x", 1.0), tmp_path / "y"
    y.mkdir()
    save_file({"w": torch.full((16,), 2.0)}, y / "other.safetensors")
    (y / "other.json").write_text("{}")
    store.push(x, "x")
    store.push(y, "y")
    dest, marks = tmp_path / "dest", tmp_path / "marks"
    dest.mkdir()
    first = _checked_pulls(store, dest, marks, ["x"], force=False)[0]
    try:
        second = subprocess.run([sys.executable, "-c", _PULL.replace("overwrite=True", "overwrite=False"), store.url, "y", str(dest)],
                                capture_output=True, timeout=120)
        assert second.returncode == 0, second.stderr.decode()
    finally:
        (marks / "go").touch()
    [(rc, err)] = _ends([first])
    assert rc != 0 and "DestinationExistsError" in err and "made so while this pull ran" in err, err
    assert _tree(dest) == _tree(y)
    assert _ckpt_names(dest) == [] and _ckpt_names(tmp_path) == []


def test_force_pulls_into_a_folder_none_has_made_yet_all_succeed(store, tmp_path):
    """Every rank of a job pulls one checkpoint with --force into a folder that does not exist yet: the
    first builds it and renames it into place; the others, finding it there, write into it as --force
    says (they failed: "exists (made while this pull ran)"). The folder holds the checkpoint whole."""
    x = _folder(tmp_path / "x", 1.0)
    store.push(x, "x")
    dest, marks = tmp_path / "job" / "dest", tmp_path / "marks"
    procs = _checked_pulls(store, dest, marks, ["x"] * 4, force=True)
    (marks / "go").touch()
    for rc, err in _ends(procs):
        assert rc == 0, err
    assert _tree(dest) == _tree(x)
    assert _ckpt_names(tmp_path / "job") == []


def test_pulls_without_force_into_a_folder_none_has_made_yet_one_succeeds(store, tmp_path):
    """The same without --force: one pull makes the folder; the other refuses, saying why, and leaves nothing."""
    x = _folder(tmp_path / "x", 1.0)
    store.push(x, "x")
    dest, marks = tmp_path / "job" / "dest", tmp_path / "marks"
    procs = _checked_pulls(store, dest, marks, ["x"] * 2, force=False)
    (marks / "go").touch()
    ends = sorted(_ends(procs))
    assert ends[0][0] == 0 and ends[1][0] != 0 and "while this pull ran" in ends[1][1], ends
    assert _tree(dest) == _tree(x)
    assert _ckpt_names(tmp_path / "job") == []


# A pull with --force that is killed (SIGKILL) right after the first of its files is renamed into place.
_KILLED_PLACING = """
import os, signal, sys
import ckpt
real_replace = os.replace
def replace(src, dst, *a, **kw):
    real_replace(src, dst, *a, **kw)
    if ".ckpt-" not in os.path.basename(dst):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
ckpt.Store.open(sys.argv[1]).pull(sys.argv[2], sys.argv[3], overwrite=True)
"""


def _all_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_what_a_pull_killed_while_placing_its_files_left_is_said_and_removed_by_a_force_pull(store, tmp_path, caplog):
    """A --force pull killed among its renames leaves the folder part new, part old, with the old files
    kept as hidden backups. The next pull says so: without --force it refuses, naming it; with --force it
    removes what the killed pull's journal lists (only names ckpt gives its own backups) and places its
    files whole. A user's file named like a backup, which no journal lists, is kept. (The backups stayed
    for good, and nothing was said.)"""
    import logging

    from ckpt.errors import DestinationExistsError

    x, y = _folder(tmp_path / "x", 1.0), _folder(tmp_path / "y", 2.0)
    store.push(x, "x")
    store.push(y, "y")
    dest = tmp_path / "dest"
    store.pull("x", dest)
    users = dest / ".part0.json.ckpt-old-0123abcd"
    users.write_text("a user's file, named like a backup")
    killed = subprocess.run([sys.executable, "-c", _KILLED_PLACING, store.url, "y", str(dest)], capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode()
    got = _all_files(dest)
    new = [n for n in _tree(x) if got[n] == _tree(y)[n]]
    assert len(new) == 1 and sum(got[n] == _tree(x)[n] for n in _tree(x)) == len(_tree(x)) - 1  # part new, part old
    assert any(".ckpt-old-" in n and n != users.name for n in got) and any(n.startswith(".ckpt-placing-") for n in got)
    (dest / "notes.txt").write_text("the user's")
    (tmp_path / ".model.safetensors.ckpt-old-11112222").write_text("the user's, outside the folder")
    forged = [{"target": "part1.json", "old": "notes.txt", "temp": "../x/model.safetensors"},
              {"target": "../model.safetensors", "old": ".model.safetensors.ckpt-old-11112222", "temp": None}]
    (dest / ".ckpt-placing-0000beef").write_text(json.dumps({"files": forged}))  # names nothing ckpt would remove
    got = _all_files(dest)

    with pytest.raises(DestinationExistsError, match="killed while putting its files in place"):
        store.pull("y", dest)
    assert _all_files(dest) == got  # refused: nothing touched
    with caplog.at_level(logging.WARNING, logger="ckpt.store.placing"):
        store.pull("y", dest, overwrite=True)
    assert any("killed while putting" in r.message and "removed" in r.message for r in caplog.records), caplog.text
    assert _all_files(dest) == {**_tree(y), users.name: users.read_bytes(), "notes.txt": b"the user's"}
    assert (tmp_path / ".model.safetensors.ckpt-old-11112222").exists() and _tree(x)["model.safetensors"] == (x / "model.safetensors").read_bytes()


def test_what_is_named_like_a_journal_but_is_no_file_is_never_removed(store, tmp_path):
    """A FIFO or a folder named like a placing journal is no journal: a --force pull into that folder
    keeps both (the FIFO, opened and read as one, was removed)."""
    x = _folder(tmp_path / "x", 1.0)
    store.push(x, "x")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.mkfifo(dest / ".ckpt-placing-0000beef")
    (dest / ".ckpt-placing-1111beef").mkdir()
    store.pull("x", dest, overwrite=True)
    assert (dest / ".ckpt-placing-0000beef").is_fifo() and (dest / ".ckpt-placing-1111beef").is_dir()
    assert _tree(dest) == _tree(x)
