"""rename_new (ckpt/store/placing.py): a rename that never replaces what has the new name, on each
filesystem here (ext4 under the test's folder, tmpfs under /dev/shm, where local tiers live)."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.store import placing
from ckpt.store.placing import rename_new


@pytest.fixture(params=["disk", "shm"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "disk":
        yield tmp_path
        return
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here")
    d = Path("/dev/shm") / f"ckpt-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _there(folder: Path, kind: str) -> Path:
    """Something a user has at ``folder/dst``: a file, an empty folder, a link (dangling too)."""
    dst = folder / "dst"
    if kind == "file":
        dst.write_bytes(b"the user's")
    elif kind == "empty folder":
        dst.mkdir()
    elif kind == "link":
        dst.symlink_to(folder / "nowhere")
    return dst


@pytest.mark.parametrize("kind", ["file", "empty folder", "link"])
@pytest.mark.parametrize("src_kind", ["file", "folder"])
def test_what_has_the_name_is_never_replaced(folder, kind, src_kind):
    """rename(2) replaces a file with a file and an empty folder with a folder; rename_new refuses
    (FileExistsError) and leaves both as they were."""
    src = folder / "src"
    if src_kind == "file":
        src.write_bytes(b"new")
    else:
        src.mkdir()
        (src / "inside").write_bytes(b"new")
    dst = _there(folder, kind)
    before = os.lstat(dst)
    with pytest.raises(FileExistsError):
        rename_new(str(src), str(dst))
    after = os.lstat(dst)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    if kind == "file":
        assert dst.read_bytes() == b"the user's"
    if kind == "empty folder":
        assert os.listdir(dst) == []
    assert (src.read_bytes() if src_kind == "file" else (src / "inside").read_bytes()) == b"new"


def test_a_free_name_is_taken(folder):
    (folder / "src").write_bytes(b"new")
    assert rename_new(str(folder / "src"), str(folder / "dst")) is True
    assert (folder / "dst").read_bytes() == b"new" and not (folder / "src").exists()


def test_other_refusals_are_errors_of_their_own(folder):
    with pytest.raises(FileNotFoundError):
        rename_new(str(folder / "absent"), str(folder / "dst"))


def test_a_path_with_a_nul_is_refused_not_cut_short(folder):
    """C ends a path at its first NUL: 'dst\\0.bak' was taken as 'dst', 'a\\0zzz' renamed the file 'a' (review
    rev22d); os.rename refuses both, and so does this now, with nothing renamed."""
    (folder / "a").write_bytes(b"a's")
    for src, dst in ((folder / "a", f"{folder}/dst\0.bak"), (f"{folder}/a\0zzz", folder / "b")):
        with pytest.raises(ValueError, match="null byte"):
            rename_new(str(src), str(dst))
    assert sorted(os.listdir(folder)) == ["a"] and (folder / "a").read_bytes() == b"a's"

# The narrowest seam: glibc's renameat2 answering as it does on a filesystem without RENAME_NOREPLACE
# (EINVAL), a kernel without the call (ENOSYS), in a sandbox that refuses it (EPERM); or no renameat2 (None).
@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOSYS, errno.EPERM, None], ids=["EINVAL", "ENOSYS", "EPERM", "absent"])
def test_where_it_cannot_be_done_nothing_is_done_and_the_caller_is_told(folder, monkeypatch, err):
    def refused(*args: object) -> int:
        ctypes.set_errno(err or 0)
        return -1

    monkeypatch.setattr(placing, "_renameat2", None if err is None else refused)
    (folder / "src").write_bytes(b"new")
    assert rename_new(str(folder / "src"), str(folder / "dst")) is False
    assert (folder / "src").read_bytes() == b"new" and not os.path.lexists(folder / "dst")
