"""A destination's files are placed all or nothing (ckpt/store/atomic_files.py), even with another
pull placing files in the same folder at once."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt.errors import DestinationExistsError
from ckpt.store import placing

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


# What appears at a destination between a pull's checks and its renames into place. A pull's progress
# callback is finished once every byte is written, before anything takes its final name: there,
# ``act`` does what another program (a user's `mkdir`, another pull) does at that moment.
class _MeanwhileProgress:
    def __init__(self, act) -> None:
        self.act = act

    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def finish(self) -> None:
        self.act()


def _nested(d: Path) -> Path:
    """A model folder with a subfolder (the files placed in a folder that must be made first)."""
    _folder(d, 1.0)
    (d / "tok").mkdir()
    (d / "tok" / "tokenizer.json").write_text('{"vocab": 3}')
    return d


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# The narrowest seams: glibc's renameat2 answering as on a filesystem without RENAME_NOREPLACE
# (NFS, some FUSE filesystems: EINVAL), a kernel without the call (ENOSYS), or a libc without it
# (None); and hard links refused, as some FUSE filesystems refuse them. Every filesystem this
# machine has (ext4, tmpfs) does both; the rest of each pull runs as it does anywhere.
def _renameat2_refused(err: int | None):
    if err is None:
        return None

    def renameat2(*args: object) -> int:
        ctypes.set_errno(err)
        return -1
    return renameat2


def _links_refused(monkeypatch) -> None:
    """Every hard link refused from here on (the store's own too: push first)."""
    def link(src, dst, **kw):
        raise PermissionError(errno.EPERM, "Operation not permitted", src, None, dst)
    monkeypatch.setattr(os, "link", link)


@pytest.mark.parametrize("renameat2", ["real", errno.EINVAL, errno.ENOSYS, None], ids=["real", "EINVAL", "ENOSYS", "absent"])
def test_an_empty_folder_made_where_a_pull_renames_its_folder_is_written_into_never_replaced(store, tmp_path, monkeypatch, renameat2):
    """A directory checkpoint pulled to a new path is built beside it and renamed into place; rename(2)
    silently replaces an EMPTY folder, so one a user (or another program) made there meanwhile was
    swapped for the pull's own: theirs gone, a shell in it left in a deleted folder. Now the pull writes
    into that folder, as into one found empty at the check: it stays the same folder (inode, mode),
    holding the checkpoint byte for byte. Where renameat2 is refused, a look just before rename(2)
    sees it (the gap left there is between that look and the rename)."""
    if renameat2 != "real":
        monkeypatch.setattr(placing, "_renameat2", _renameat2_refused(renameat2))
    x = _nested(tmp_path / "x")
    store.push(x, "x")
    dest, made = tmp_path / "dest", []

    def mkdir() -> None:
        dest.mkdir(mode=0o750)
        made.append(os.stat(dest))

    assert store.pull("x", dest, progress=_MeanwhileProgress(mkdir)) == str(dest)
    now = os.stat(dest)
    assert made and (now.st_dev, now.st_ino, now.st_mode) == (made[0].st_dev, made[0].st_ino, made[0].st_mode)
    assert _files(dest) == _files(x)
    assert _ckpt_names(tmp_path) == []


@pytest.mark.parametrize("renameat2", ["real", errno.EINVAL], ids=["real", "EINVAL"])
def test_a_folder_made_and_filled_where_a_pull_renames_its_folder_ends_the_pull(store, tmp_path, monkeypatch, renameat2):
    """A folder made at a new path meanwhile and holding something of the user's: the pull without
    --force refuses as it would have at the check (not empty), saying so; the folder is as the user left it."""
    if renameat2 != "real":
        monkeypatch.setattr(placing, "_renameat2", _renameat2_refused(renameat2))
    x = _nested(tmp_path / "x")
    store.push(x, "x")
    dest = tmp_path / "dest"

    def users() -> None:
        (dest / "tok").mkdir(parents=True)
        (dest / "tok" / "tokenizer.json").write_text("the user's")
        (dest / "notes.txt").write_text("the user's notes")

    with pytest.raises(DestinationExistsError, match="dest exists and is not empty .*: made so while this pull ran"):
        store.pull("x", dest, progress=_MeanwhileProgress(users))
    assert _files(dest) == {"notes.txt": b"the user's notes", "tok/tokenizer.json": b"the user's"}
    assert _ckpt_names(tmp_path) == []


@pytest.mark.parametrize("force", [False, True], ids=["", "force"])
def test_a_link_in_a_folder_made_where_a_pull_renames_its_folder_is_refused_before_anything_goes_through_it(
        store, tmp_path, monkeypatch, force):
    """A folder made at a new path meanwhile holds a link (tok -> a folder of the user's elsewhere). The pull
    wrote into it as into one found at the check, but moved its files beside their targets first: its
    tokenizer went through the link into the user's folder before the rule was checked again (review
    rev22d), there until refused, or for good if the pull was killed then; across filesystems the refusal
    was a cross-device error naming a temporary. Now the rule is checked first: the link is refused by
    name and nothing was ever written where it leads (seen as the placing starts, and after)."""
    from ckpt.errors import DestinationError
    from ckpt.store import atomic_files

    x = _nested(tmp_path / "x")
    store.push(x, "x")
    dest = tmp_path / "dest"
    for elsewhere in [tmp_path / "elsewhere"] + ([Path(f"/dev/shm/ckpt-test-{os.getpid()}")] if os.path.isdir("/dev/shm") else []):
        elsewhere.mkdir()
        try:
            (elsewhere / "mine.txt").write_text("the user's")
            seen: list[list[str]] = []
            real_place = atomic_files._place

            def place(*args, _real=real_place, _where=elsewhere, _seen=seen):
                _seen.append(sorted(os.listdir(_where)))
                return _real(*args)
            monkeypatch.setattr(atomic_files, "_place", place)

            def made(_where=elsewhere) -> None:
                dest.mkdir()
                os.symlink(_where, dest / "tok")
            with pytest.raises(DestinationError, match="tok is a symbolic link; a pull does not write through links"):
                store.pull("x", dest, overwrite=force, progress=_MeanwhileProgress(made))
            assert all(names == ["mine.txt"] for names in seen), seen
            assert sorted(os.listdir(elsewhere)) == ["mine.txt"] and (elsewhere / "mine.txt").read_text() == "the user's"
            assert sorted(os.listdir(dest)) == ["tok"] and os.readlink(dest / "tok") == str(elsewhere)
            assert _ckpt_names(tmp_path) == []
        finally:
            monkeypatch.undo()
            if dest.is_symlink() or dest.exists():
                os.unlink(dest / "tok")
                dest.rmdir()
            for f in elsewhere.iterdir():
                f.unlink()
            elsewhere.rmdir()


def test_a_folder_a_killed_pull_built_beside_a_destination_made_meanwhile_is_swept_by_the_next_pull(store, tmp_path):
    """A pull killed while it wrote into a folder made at its new path meanwhile leaves the folder it built
    beside it (emptied or not) under a hidden name; the next pulls found the path a folder, wrote into it,
    and never swept beside it (review rev22d): it stayed for good. Now a pull into an existing folder sweeps
    what killed pulls of its name left beside it too (only temporaries no live pull holds, as ever)."""
    x = _nested(tmp_path / "x")
    store.push(x, "x")
    dest = tmp_path / "dest"
    dest.mkdir()
    left = Path(placing.temp_name(str(dest)))
    (left / "tok").mkdir(parents=True)
    (left / "tok" / "tokenizer.json").write_text('{"vocab": 3}')
    old = time.time() - 3600
    os.utime(left, (old, old))
    assert store.pull("x", dest) == str(dest)
    assert not left.exists() and _files(dest) == _files(x)
    assert _ckpt_names(tmp_path) == []


def test_a_file_made_where_a_pull_renames_its_folder_ends_the_pull(store, tmp_path):
    """A file made at the new path meanwhile is never replaced: the pull refuses, the file is as it was."""
    x = _nested(tmp_path / "x")
    store.push(x, "x")
    dest = tmp_path / "dest"
    with pytest.raises(DestinationExistsError, match="exists \\(made while this pull ran\\)"):
        store.pull("x", dest, progress=_MeanwhileProgress(lambda: dest.write_bytes(b"the user's")))
    assert dest.read_bytes() == b"the user's"
    assert _ckpt_names(tmp_path) == []


def _after_first_placed(monkeypatch, dest: Path, act, links: bool) -> None:
    """Run ``act`` once, right after the first of a pull's files takes its final name in ``dest``, by
    whichever call places it (renameat2, a link, a rename): what another program does at that moment.
    ``links=False``: every hard link refused from here on (the store's own too: push first)."""
    fired: list[int] = []
    real_replace, real_link, real_renameat2 = os.replace, os.link, getattr(placing, "_renameat2", None)

    def placed(dst) -> None:
        dst = os.fsdecode(dst)
        if not fired and os.path.dirname(dst) == str(dest) and ".ckpt-" not in os.path.basename(dst):
            fired.append(1)
            act()

    def replace(src, dst, *a, **kw):
        real_replace(src, dst, *a, **kw)
        placed(dst)

    def link(src, dst, *a, **kw):
        if not links:
            raise PermissionError(errno.EPERM, "Operation not permitted", src, None, dst)
        real_link(src, dst, *a, **kw)
        placed(dst)

    def renameat2(fd1, src, fd2, dst, flags):
        done = real_renameat2(fd1, src, fd2, dst, flags)
        if done == 0:
            placed(dst)
        return done

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    if real_renameat2 is not None:
        monkeypatch.setattr(placing, "_renameat2", renameat2)


@pytest.mark.parametrize("renameat2", ["real", errno.EINVAL], ids=["real", "EINVAL"])
def test_a_file_made_where_a_pull_places_its_next_file_is_kept(store, tmp_path, monkeypatch, renameat2):
    """Without --force a new file takes its name with a hard link, which fails if the name is taken; where
    the filesystem refuses links, with rename(2), which replaced a file another program made at that name
    after the checks (here: as the pull's first file took its name). Now renameat2 (RENAME_NOREPLACE)
    places it: the pull refuses, saying so, puts back what it placed, and the user's files are kept byte
    for byte. Where renameat2 is refused the link is what refuses (the gap left: a filesystem with neither)."""
    names = ("a.json", "b.json", "model.safetensors")
    x = tmp_path / "x"
    x.mkdir()
    save_file({"w": torch.arange(16, dtype=torch.float32)}, x / "model.safetensors")
    for name in names[:2]:
        (x / name).write_text(f'{{"{name}": 1}}')
    store.push(x, "x")
    dest = tmp_path / "dest"
    dest.mkdir()
    if renameat2 != "real":
        monkeypatch.setattr(placing, "_renameat2", _renameat2_refused(renameat2))

    def users() -> None:
        for name in names:
            if not (dest / name).exists():
                (dest / name).write_bytes(b"the user's " + name.encode())

    _after_first_placed(monkeypatch, dest, users, links=renameat2 != "real")
    with pytest.raises(DestinationExistsError, match="exists \\(made while this pull ran\\)"):
        store.pull("x", dest)
    got = _files(dest)
    assert len(got) == 2 and all(v == b"the user's " + k.encode() for k, v in got.items()), got  # the pull's one undone
    assert _ckpt_names(tmp_path) == []


@pytest.mark.parametrize("renameat2", [errno.EINVAL, None], ids=["EINVAL", "absent"])
def test_pulls_where_renameat2_is_refused_place_their_files_as_before(store, tmp_path, monkeypatch, renameat2):
    """The fallbacks where renameat2 is refused (a rename for a new folder, a link for a new file; and
    where links are refused too, a rename) place a checkpoint whole."""
    monkeypatch.setattr(placing, "_renameat2", _renameat2_refused(renameat2))
    x = _nested(tmp_path / "x")
    store.push(x, "x")
    store.pull("x", tmp_path / "new")
    (tmp_path / "empty").mkdir()
    store.pull("x", tmp_path / "empty")
    _links_refused(monkeypatch)
    (tmp_path / "nolinks").mkdir()
    store.pull("x", tmp_path / "nolinks")
    for d in ("new", "empty", "nolinks"):
        assert _files(tmp_path / d) == _files(x), d
    assert _ckpt_names(tmp_path) == []
