"""The issue reproductions of `ckpt pull` and `ckpt init` that used to lose data, run
through the CLI's entry point: each must end in one line on stderr (or succeed safely)
with everything that was there before still there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_store.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def sandbox(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    """``sb/keep.txt`` beside a store at ``sb/store`` holding a model folder pushed as ``two``."""
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.randn(6, 6)}, model / "model.safetensors")
    (model / "config.json").write_text("{}")
    sb = tmp_path / "sb"
    sb.mkdir()
    (sb / "keep.txt").write_text("precious")
    store = str(sb / "store")
    code, _, err = run(capsys, "--store", store, "push", str(model), "two")
    assert code == 0, err
    return sb, store


def test_force_pull_into_the_folder_holding_the_store_is_refused(sandbox, capsys):
    sb, store = sandbox
    before = tree(sb)
    code, _, err = run(capsys, "--store", store, "pull", "two", str(sb), "--force")
    one_line_error(code, err, "holds the store")
    assert tree(sb) == before  # keep.txt and the store, untouched
    code, out, err = run(capsys, "--store", store, "verify")
    assert code == 0, err


def test_force_pull_into_a_folder_keeps_what_is_not_the_checkpoints(sandbox, capsys, tmp_path):
    _, store = sandbox
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    code, _, err = run(capsys, "--store", store, "pull", "two", str(dest))
    one_line_error(code, err, "keep.txt", "--force")
    code, _, err = run(capsys, "--store", store, "pull", "two", str(dest), "--force")
    assert code == 0, err
    assert sorted(os.listdir(dest)) == ["config.json", "keep.txt", "model.safetensors"]
    assert (dest / "keep.txt").read_text() == "mine"


def test_pull_dot_force(sandbox, capsys, tmp_path, monkeypatch):
    sb, store = sandbox
    before = tree(sb)
    monkeypatch.chdir(sb)  # the current directory holds the store
    code, _, err = run(capsys, "--store", store, "pull", "two", ".", "--force")
    one_line_error(code, err, "store")
    assert tree(sb) == before
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    code, _, err = run(capsys, "--store", store, "pull", "two", ".", "--force")
    assert code == 0, err
    assert sorted(os.listdir(work)) == ["config.json", "model.safetensors", "notes.txt"]


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_pull_to_dash_is_refused_not_written_as_a_file_named_dash(sandbox, capsys, tmp_path, monkeypatch, force):
    """`ckpt pull REF - | consumer` (the usual word for standard output) wrote the checkpoint to a
    file named "-" in the current folder, reported it as written ("path": "-") and sent the
    consumer nothing: "-" is refused, naming the way to write a file of that name."""
    _, store = sandbox
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for args in (["pull", "two", "-", "--include", "*", *force], ["pull", "two", "-", *force], ["pull", "two", "-", "--json", *force]):
        code, out, err = run(capsys, "--store", store, *args)
        one_line_error(code, err, "standard output", "./-")
        assert os.listdir(work) == []
    assert out.startswith("{") and "standard output" in __import__("json").loads(out)["error"]
    assert run(capsys, "--store", store, "pull", "two", "./-", "--include", "*")[0] == 0  # a file named "-", asked for so
    assert os.listdir(work) == ["-"]


@pytest.mark.parametrize("args", [["one", "store"], ["one", "store/ckpt-store.json"], ["one", "store/refs", "-i", "w"]])
def test_file_pull_into_the_store_is_refused(tmp_path, capsys, args):
    save_file({"w": torch.randn(3)}, tmp_path / "one.safetensors")
    store = str(tmp_path / "store")
    assert run(capsys, "--store", store, "push", str(tmp_path / "one.safetensors"), "one")[0] == 0
    before = tree(tmp_path / "store")
    args = [args[0], str(tmp_path / args[1]), *args[2:]]
    code, _, err = run(capsys, "--store", store, "pull", *args, "--force")
    one_line_error(code, err, "inside the store")
    assert tree(tmp_path / "store") == before


def test_pull_to_pt_writes_a_torch_file_with_the_values(tmp_path, capsys):
    sd = {"model": {"w": torch.randn(4, 3), "n": torch.tensor(7)}, "step": 12, "opt": {"lr": 0.5}}
    torch.save(sd, tmp_path / "sd.pt")
    store = str(tmp_path / "store")
    assert run(capsys, "--store", store, "push", str(tmp_path / "sd.pt"), "sd")[0] == 0
    code, _, err = run(capsys, "--store", store, "pull", "sd", str(tmp_path / "out.pt"))
    assert code == 0, err
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(got) == ["model", "step", "opt"] and list(got["model"]) == ["w", "n"]  # as pushed: nested, in order
    assert got["step"] == 12 and got["opt"] == {"lr": 0.5}
    assert torch.equal(got["model"]["w"].view(torch.int32), sd["model"]["w"].view(torch.int32))
    assert got["model"]["n"].dtype == torch.int64 and int(got["model"]["n"]) == 7


def test_include_and_diff_refuse_one_name_in_two_files(tmp_path, capsys):
    d = tmp_path / "dup"
    d.mkdir()
    save_file({"x": torch.randn(4)}, d / "a.safetensors")
    save_file({"x": torch.randn(8)}, d / "b.safetensors")
    store = str(tmp_path / "store")
    assert run(capsys, "--store", store, "push", str(d), "dup")[0] == 0
    code, _, err = run(capsys, "--store", store, "pull", "dup", str(tmp_path / "sel.safetensors"), "-i", "x")
    one_line_error(code, err, "'x' appears in two files")
    assert not (tmp_path / "sel.safetensors").exists()
    code, _, err = run(capsys, "--store", store, "diff", "dup", "dup")
    one_line_error(code, err, "'x' appears in two files")
    code, _, err = run(capsys, "--store", store, "diff", str(d), str(d / "a.safetensors"))
    one_line_error(code, err, "'x' appears in two files")


def test_init_refuses_a_store_inside_a_store(tmp_path, capsys):
    st = tmp_path / "st"
    save_file({"w": torch.randn(3)}, tmp_path / "one.safetensors")
    assert run(capsys, "--store", str(st), "push", str(tmp_path / "one.safetensors"), "one")[0] == 0
    for inner in (st / "refs", st / "objects" / "deep" / "er"):
        code, _, err = run(capsys, "--store", str(inner), "init")
        one_line_error(code, err, "inside the store at", str(st))
        code, _, err = run(capsys, "--store", str(inner), "push", str(tmp_path / "one.safetensors"), "x")
        one_line_error(code, err, "inside the store at")
    assert not list(st.rglob("ckpt-store.json"))[1:]  # only the outer store's own config
    for args in (["ls"], ["du"], ["gc", "--dry-run"], ["verify"], ["rm", "one"]):
        code, _, err = run(capsys, "--store", str(st), *args)
        assert code == 0, (args, err)


def test_init_and_push_refuse_a_folder_of_other_files(tmp_path, capsys):
    """`ckpt --store DIR init` (or a push creating the store) in a folder of someone's work wrote
    the store's config and folders among its files; a new store needs a new or empty folder."""
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    save_file({"w": torch.randn(3)}, work / "one.safetensors")
    before = tree(work)
    for args in (["init"], ["push", str(work / "one.safetensors"), "one"]):
        code, _, err = run(capsys, "--store", str(work), *args)
        one_line_error(code, err, "not empty", "new or empty folder")
        assert tree(work) == before and sorted(os.listdir(work)) == ["notes.txt", "one.safetensors", "src"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".tmp-config-left-by-a-crash").write_bytes(b"")
    for st in (tmp_path / "empty", tmp_path / "new"):  # empty, or not there yet: created
        assert run(capsys, "--store", str(st), "init")[0] == 0
        assert run(capsys, "--store", str(st), "init")[0] == 0  # a store already: a no-op
        assert (st / "ckpt-store.json").is_file()


def test_store_path_that_is_a_file_or_empty(tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("mine")
    for cmd in ("init", "ls"):
        code, _, err = run(capsys, "--store", str(tmp_path / "afile"), cmd)
        one_line_error(code, err, "afile is a file, not a store directory")
    assert (tmp_path / "afile").read_text() == "mine"
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "--store", "", "init")
    one_line_error(code, err, "empty store URL")
    assert not (tmp_path / "ckpt-store.json").exists()


def test_an_empty_store_url_in_an_option_is_refused_not_taken_for_the_default_store(sandbox, capsys, tmp_path, monkeypatch):
    """`ckpt copy m --from "$MIRROR" --to s3://team/store` with MIRROR unset copied from the default
    store ($CKPT_STORE, --store) instead; `verify --repair-from ""` "repaired" a store from itself and
    `serve --store ""` served the default store. An empty --from, --to, --repair-from, --store or
    --local-tier is refused as an empty --store is, before anything is written."""
    _, store = sandbox
    monkeypatch.setenv("CKPT_STORE", store)
    dest = tmp_path / "dest"
    for args in (["copy", "two", "--from", "", "--to", str(dest)], ["copy", "two", "--to", ""], ["pull", "two", "--from", ""],
                 ["push", "two", "--to", ""], ["verify", "--repair-from", ""], ["serve", "--store", "", "--port", "0"],
                 ["serve", "--local-tier", "", "--port", "0"]):
        code, _, err = run(capsys, *args)
        one_line_error(code, err, "empty store URL")
    assert not dest.exists()
    assert run(capsys, "copy", "two", "--to", str(dest))[0] == 0  # (the store is as it was)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_folder_made_at_dest_while_a_folder_pull_runs_is_named_and_kept(sandbox, capsys, tmp_path, monkeypatch, force):
    """Two pulls of a model folder to one new DEST at once (two terminals, a retried job): the one
    that came second failed with "cannot write .../.dest.ckpt-tmp-1a2b3c4d: Directory not empty
    (check the destination's permissions and free space)", naming a temporary that was gone and a
    cause that was not. It says DEST was made while it ran (and what is in it), as a one-file pull does; what the
    other made is kept, and nothing of this one is left. With --force it writes into DEST as into
    any folder that was there, replacing the other's file of the same name."""
    import ckpt.store.pull as pull_module

    _, store = sandbox
    dest = tmp_path / "dest"
    real = pull_module.get_chunks

    def other_pull_lands_meanwhile(*args, **kwargs):
        out = real(*args, **kwargs)
        if not dest.exists():
            dest.mkdir()
            (dest / "model.safetensors").write_bytes(b"the other pull's")
        return out

    monkeypatch.setattr(pull_module, "get_chunks", other_pull_lands_meanwhile)
    code, _, err = run(capsys, "--store", store, "pull", "two", str(dest), *force)
    if force:
        assert code == 0, err
        assert tree(dest) == tree(tmp_path / "model")
    else:
        one_line_error(code, err, f"{dest} exists and is not empty (model.safetensors is in the way)", "made so while this pull ran",
                       "pass --force")
        assert "ckpt-tmp" not in err and tree(dest) == {"model.safetensors": b"the other pull's"}
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # (no temporary folder left beside it)


def test_pull_to_names_as_long_as_the_filesystem_allows(tmp_path, capsys):
    """A file name of 255 bytes (the most a filesystem allows) is a valid destination: the
    temporary and backup names beside it, which added 19 bytes to the whole name, failed with
    'File name too long'. Multi-byte names are cut at bytes, and still land under their name."""
    src = tmp_path / "one.safetensors"
    save_file({"w": torch.randn(3)}, src)
    store = str(tmp_path / "store")
    assert run(capsys, "--store", store, "push", str(src), "one")[0] == 0
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a" * 243 + ".safetensors", "é" * 121 + ".safetensors"):  # 255 and 254 bytes
        dest = out / name
        code, _, err = run(capsys, "--store", store, "pull", "one", str(dest))
        assert code == 0, err
        dest.write_bytes(b"old")
        code, _, err = run(capsys, "--store", store, "pull", "one", str(dest), "--force")  # replaced: a backup beside it
        assert code == 0, err
        assert dest.read_bytes() == src.read_bytes()
    assert sorted(os.listdir(out)) == sorted(["a" * 243 + ".safetensors", "é" * 121 + ".safetensors"])


def test_a_trailing_slash_means_a_directory(tmp_path, capsys):
    """DEST was a pathlib.Path, which drops a trailing slash: `pull one new/` wrote a file named
    `new`, and `pull one notes.txt/ --force` replaced the file notes.txt. A single-file checkpoint
    pulled to a slash-ended path that is not a directory is refused, as the library does."""
    save_file({"w": torch.randn(3)}, tmp_path / "one.safetensors")
    store = str(tmp_path / "store")
    assert run(capsys, "--store", store, "push", str(tmp_path / "one.safetensors"), "one")[0] == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for dest in (str(out / "new") + os.sep, str(out / "notes.txt") + os.sep):
        code, _, err = run(capsys, "--store", store, "pull", "one", dest, "--force")
        one_line_error(code, err, "is not a directory")
    assert tree(out) == {"notes.txt": b"mine"}
    code, _, err = run(capsys, "--store", store, "pull", "one", str(out) + os.sep)  # a directory: the file goes in it
    assert code == 0, err
    assert tree(out) == {"notes.txt": b"mine", "one.safetensors": (tmp_path / "one.safetensors").read_bytes()}


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt", "weights.BIN"])
def test_a_folder_pulled_to_a_file_name_is_refused(sandbox, capsys, tmp_path, name):
    """A model folder pulled to DEST named like one tensor file made a *directory* of that name
    (`out.safetensors/config.json`), which no loader of that name reads. It is refused with the
    two ways to get what was meant; `--include '*'` writes the tensors as that one file, and an
    existing directory of that name is a directory the user chose."""
    _, store = sandbox
    dest = tmp_path / name
    code, _, err = run(capsys, "--store", store, "pull", "two", str(dest))
    one_line_error(code, err, "two is a folder of 2 files", "named like one file", "--include '*'")
    assert not dest.exists()
    code, _, err = run(capsys, "--store", store, "pull", "two", str(dest), "--include", "*")
    assert code == 0 and dest.is_file(), err
    dest.unlink()
    dest.mkdir()
    code, _, err = run(capsys, "--store", store, "pull", "two", str(dest))
    assert code == 0 and sorted(os.listdir(dest)) == ["config.json", "model.safetensors"], err


def test_force_pull_beside_weights_that_are_not_the_checkpoints_is_refused(tmp_path, capsys):
    """A single-file model pulled into DIR, then a sharded one over it with --force: the old
    model.safetensors stayed beside the new shards and index (a pull removes nothing of the user's),
    and transformers, which prefers model.safetensors, loaded the old weights silently. Such a pull
    is refused, touching nothing; weights in folders the checkpoint writes no weights to, and other
    files, do not count."""
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    one.mkdir()
    sharded.mkdir()
    save_file({"w": torch.zeros(4)}, one / "model.safetensors")
    (one / "config.json").write_text("{}")
    save_file({"w": torch.ones(4)}, sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    (sharded / "config.json").write_text('{"v": 2}')
    store = str(tmp_path / "store")
    for src, name in ((one, "m/one"), (sharded, "m/sharded")):
        code, _, err = run(capsys, "--store", store, "push", str(src), name)
        assert code == 0, err
    dest = tmp_path / "dest"
    assert run(capsys, "--store", store, "pull", "m/one", str(dest))[0] == 0
    (dest / "notes.txt").write_text("mine")
    before = tree(dest)
    code, _, err = run(capsys, "--store", store, "pull", "m/sharded", str(dest), "--force")
    one_line_error(code, err, "holds weights this checkpoint does not have (model.safetensors)", "pull into a new directory")
    assert tree(dest) == before
    (dest / "model.safetensors").unlink()
    code, _, err = run(capsys, "--store", store, "pull", "m/sharded", str(dest), "--force")
    assert code == 0, err
    assert sorted(os.listdir(dest)) == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "notes.txt"]
    # The same pull again over itself (its own files only): still fine.
    assert run(capsys, "--store", store, "pull", "m/sharded", str(dest), "--force")[0] == 0


@pytest.mark.parametrize("dest", ["/dev/stdout", "/dev/null", "/proc/self/fd/1", "/dev/shm/../stdout"])
def test_pull_into_the_systems_folders_is_refused(sandbox, capsys, dest):
    """`ckpt pull REF /dev/stdout --force` (to stream it, say) replaced the link /dev/stdout with a
    file, as root (a pull replaces a link at a file's name, never writing through it): the system's
    folders are refused, whatever the flags. (A pull's temporary would be made there first.)"""
    from ckpt.store.placing import is_temp_name

    def entries() -> set[str]:  # (names only: other processes on this machine, a local tier's tests, use /dev/shm too)
        return {os.path.join(d, n) for d in ("/dev", "/dev/shm") if os.path.isdir(d) for n in os.listdir(d)}

    _, store = sandbox
    before = entries()
    for force in ([], ["--force"]):
        code, _, err = run(capsys, "--store", store, "pull", "two", dest, "--include", "*", *force)
        one_line_error(code, err, "the system's", "a folder of yours")
    assert os.path.islink("/dev/stdout") or not os.path.exists("/dev/stdout")
    assert not [p for p in entries() - before if is_temp_name(os.path.basename(p))]  # no temporary made there either


def test_pull_into_dev_shm_is_a_folder_of_yours(sandbox, capsys, tmp_path):
    """/dev/shm is a folder of files in memory (where a model is put to load fast, and ckpt's own
    local tier may live), not the system's: a pull there was refused as one into /dev."""
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    _, store = sandbox
    model = tmp_path / "model"  # what the sandbox pushed as `two`
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        code, _, err = run(capsys, "--store", store, "pull", "two", str(shm / "two"))
        assert code == 0, err
        assert tree(shm / "two") == tree(model)
        code, _, err = run(capsys, "--store", store, "pull", "two", str(shm / "w.safetensors"), "--include", "*")
        assert code == 0, err
        got, want = load_file(shm / "w.safetensors")["w"], load_file(model / "model.safetensors")["w"]
        assert got.dtype == want.dtype and torch.equal(got, want)
        code, _, err = run(capsys, "--store", store, "pull", "two", "/dev/shm/../stdout", "--include", "*")
        one_line_error(code, err, "the system's", "a folder of yours")
    finally:
        shutil.rmtree(shm)


def test_pull_json_names_the_checkpoint_it_wrote_when_the_ref_moves_meanwhile(tmp_path, capsys, monkeypatch):
    """`pull REF --json` resolved REF for the document's "id" and the pull resolved it again: a push
    moving REF in between (a run's `latest`, updated at every save) wrote one checkpoint and named
    another. The push is staged right after the CLI's resolve, as a concurrent saver would land it."""
    import json

    import ckpt
    from ckpt.store.store import Store

    store_url = str(tmp_path / "store")
    store = ckpt.Store.init(store_url)
    first = store.push({"w": torch.full((4,), 1.0)}, "run/latest")
    resolve = Store.resolve
    moved: list[str] = []

    def resolve_then_a_save_lands(self, ref):
        got = resolve(self, ref)
        if not moved and ref == "run/latest":
            moved.append(ckpt.Store.open(store_url).push({"w": torch.full((4,), 2.0)}, "run/latest"))
        return got

    monkeypatch.setattr(Store, "resolve", resolve_then_a_save_lands)
    code, out, err = run(capsys, "--store", store_url, "pull", "run/latest", str(tmp_path / "out.safetensors"), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert moved and moved[0] != first and doc["id"] == first
    from safetensors.torch import load_file

    assert load_file(tmp_path / "out.safetensors")["w"].tolist() == [1.0] * 4  # the checkpoint the document names
