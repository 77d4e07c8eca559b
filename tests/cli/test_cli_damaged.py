"""Damaged and collected checkpoints through the CLI: every command tells the same story.

Issue 15 items 5 and 15: `verify` checks what `gc` keeps (history included), one
corrupt manifest does not stop `ls`/`du` for the other refs, and the labels `log`
prints are the names `pull` accepts, with hints that point at something that helps.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from test_cli_runner import run_main

import ckpt


@pytest.fixture
def damaged(tmp_path, monkeypatch):
    """Refs a (two versions, a@1's manifest corrupt), b (current manifest corrupt) and c (fine)."""
    path = tmp_path / "store"
    monkeypatch.setenv("CKPT_STORE", str(path))
    store = ckpt.Store.init(str(path))
    store.push({"w": torch.ones(3)}, "a")
    store.push({"w": torch.zeros(3)}, "a")
    store.push({"w": torch.ones(5)}, "b")
    store.push({"w": torch.ones(6)}, "c")
    for ref in ("a@1", "b"):
        with open(path / store.objects.path("manifests", store.resolve(ref)), "r+b") as f:
            f.write(b"XX")
    return store


def test_verify_names_a_damaged_earlier_version(damaged, capsys):
    code, out, err = run_main(capsys, "verify")
    assert code == 1
    assert "DAMAGED a@1: manifest" in err and "DAMAGED b: manifest" in err
    assert "verified 3 refs (+1 earlier versions)" in out
    code, out, _ = run_main(capsys, "verify", "--json")
    doc = json.loads(out)
    assert code == 1 and set(doc["damaged_refs"]) == {"a@1", "b"} and doc["versions_checked"] == 1


def test_ls_and_du_go_on_past_a_damaged_ref(damaged, capsys, monkeypatch):
    """Without the metadata index, ls and du read every manifest: a damaged one is named
    and the others are listed (exit 1)."""
    monkeypatch.setenv("CKPT_INDEX", "0")
    code, out, err = run_main(capsys, "ls")
    assert code == 1
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["a", "c"]
    assert err.startswith("DAMAGED b: manifest") and err.count("\n") == 1
    code, out, err = run_main(capsys, "ls", "--json")
    rows = json.loads(out)
    assert code == 1 and [r["ref"] for r in rows] == ["a", "b", "c"] and "corrupt" in rows[1]["error"]
    code, out, err = run_main(capsys, "du")
    assert code == 1 and "2 refs" in out and err.startswith("DAMAGED b: manifest")
    code, out, err = run_main(capsys, "du", "--json")
    doc = json.loads(out)
    assert code == 1 and [r["ref"] for r in doc["refs"]] == ["a", "c"] and list(doc["damaged"]) == ["b"]


def test_log_labels_are_what_pull_accepts_after_rm_and_gc(tmp_path, monkeypatch, capsys):
    path = tmp_path / "store"
    monkeypatch.setenv("CKPT_STORE", str(path))
    store = ckpt.Store.init(str(path))
    last = {"w": torch.zeros(3)}
    store.push({"w": torch.ones(3)}, "x")
    store.push(last, "x")
    assert run_main(capsys, "rm", "x")[0] == 0
    code, out, _ = run_main(capsys, "log", "x")
    labels = [w for line in out.splitlines() for w in line.split() if w.startswith("x@")]
    assert labels == ["x@0", "x@1"]
    for label in labels:  # every label log prints, pull accepts
        assert run_main(capsys, "pull", label, str(tmp_path / f"{label}.safetensors"))[0] == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "x@0.safetensors")["w"], last["w"])
    code, _, err = run_main(capsys, "pull", "x", str(tmp_path / "o.safetensors"))
    assert code == 1 and "ref x was removed (its last version is x@0" in err
    t = time.time() - 100
    for root, _, files in os.walk(path / "objects"):
        for f in files:
            os.utime(os.path.join(root, f), (t, t))
    assert run_main(capsys, "gc", "--grace", "0s")[0] == 0
    code, out, _ = run_main(capsys, "log", "x")
    assert out.count("no longer in the store: freed by `ckpt gc`") == 2
    code, _, err = run_main(capsys, "pull", "x@0", str(tmp_path / "o.safetensors"))
    assert code == 1 and "x@0 (checkpoint" in err and "`ckpt gc` freed it (x was removed)" in err
    assert "ckpt verify" not in err  # verify would (rightly) say ok: it must not be the hint


def test_gc_after_no_history_and_its_hint(tmp_path, monkeypatch, capsys):
    path = tmp_path / "store"
    monkeypatch.setenv("CKPT_STORE", str(path))
    store = ckpt.Store.init(str(path))
    store.push({"w": torch.ones(3)}, "y")
    store.push({"w": torch.zeros(3)}, "y")
    t = time.time() - 100
    for root, _, files in os.walk(path / "objects"):
        for f in files:
            os.utime(os.path.join(root, f), (t, t))
    assert run_main(capsys, "gc", "--grace", "0s", "--no-history")[0] == 0
    code, out, err = run_main(capsys, "gc", "--grace", "0s")  # used to fail: "manifest ... missing (run `ckpt verify`)"
    assert code == 0, err
    code, out, err = run_main(capsys, "verify")
    assert code == 0 and "y@1" in out and "gc --no-history" in out
    code, _, err = run_main(capsys, "pull", "y@1", str(tmp_path / "o.safetensors"))
    assert code == 1 and "freed it (gc --no-history frees earlier versions)" in err


def test_with_the_index_ls_and_du_list_every_ref_and_verify_names_the_damage(damaged, capsys):
    """With the metadata index, ls and du read the summaries recorded (from verified
    manifests) at push time, so a manifest damaged since does not hide any ref; verify
    reads the manifests and names it."""
    code, out, _ = run_main(capsys, "ls", "--json")
    assert code == 0 and [r["ref"] for r in json.loads(out)] == ["a", "b", "c"]
    code, out, _ = run_main(capsys, "du", "--json")
    assert code == 0 and [r["ref"] for r in json.loads(out)["refs"]] == ["a", "b", "c"]
    code, _, err = run_main(capsys, "verify")
    assert code == 1 and "DAMAGED b: manifest" in err


@pytest.mark.parametrize("index", ["1", "0"])
def test_a_folder_in_place_of_the_newest_ref_entry_is_damage(tmp_path, monkeypatch, capsys, index):
    """An empty folder named like a ref's newest entry made the ref silently name its previous
    version: ls listed it, pull wrote the old checkpoint, and push retried that entry's name for
    seconds, then failed saying other writers kept updating the ref."""
    from safetensors.torch import save_file

    path = tmp_path / "store"
    monkeypatch.setenv("CKPT_STORE", str(path))
    monkeypatch.setenv("CKPT_INDEX", index)
    store = ckpt.Store.init(str(path))
    store.push({"w": torch.ones(3)}, "m")
    store.push({"w": torch.zeros(3)}, "m")
    store.push({"w": torch.ones(4)}, "other")
    entry = path / "refs" / "m" / "0000000002.ref"
    entry.unlink()
    entry.mkdir()
    code, out, err = run_main(capsys, "ls")
    assert code == 1 and "DAMAGED m: ref entry refs/m/0000000002.ref is not a file" in err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["other"]
    code, _, err = run_main(capsys, "pull", "m", str(tmp_path / "o.safetensors"))
    assert code == 1 and "is not a file" in err and not (tmp_path / "o.safetensors").exists()
    save_file({"w": torch.ones(5)}, tmp_path / "new.safetensors")
    code, _, err = run_main(capsys, "push", str(tmp_path / "new.safetensors"), "m")
    assert code == 1 and "is not a file" in err and "other writers" not in err
    assert sorted(os.listdir(path / "refs" / "m")) == ["0000000001.ref", "0000000002.ref"]
    assert run_main(capsys, "verify")[0] == 1 and run_main(capsys, "gc", "--dry-run")[0] == 1


@pytest.mark.parametrize("damage", ["entry", "folder", "manifest", "current manifest missing"])
def test_log_lists_every_readable_entry_past_damage(tmp_path, monkeypatch, capsys, damage):
    """One damaged old entry made `ckpt log NAME` fail as a whole (the error, nothing listed), and a
    damaged checkpoint was listed with exit 0 (a missing current one as 'freed by `ckpt gc`'). Now
    every readable entry is listed, the damage is a row with "error", named on stderr, exit 1."""
    path = tmp_path / "store"
    monkeypatch.setenv("CKPT_STORE", str(path))
    store = ckpt.Store.init(str(path))
    ids = [store.push({"w": torch.full((3,), float(i))}, "m", message=f"v{i}") for i in range(3)]
    entry = path / "refs" / "m" / "0000000002.ref"
    if damage == "entry":
        entry.write_bytes(b"x")
    elif damage == "folder":
        entry.unlink()
        entry.mkdir()
    elif damage == "manifest":
        (path / store.objects.path("manifests", ids[1])).write_bytes(b"x")
    else:
        os.remove(path / store.objects.path("manifests", ids[2]))
    code, out, err = run_main(capsys, "log", "m")
    lines = out.splitlines()
    assert code == 1 and len(lines) == 3 and err.count("\n") == 1 and err.startswith("DAMAGED m")
    code, out, json_err = run_main(capsys, "log", "m", "--json")
    rows = json.loads(out)
    assert code == 1 and json_err == "" and [r["seq"] for r in rows] == [3, 2, 1]
    assert [("error" in r) for r in rows] == [damage == "current manifest missing", damage != "current manifest missing", False]
    if damage in ("entry", "folder"):
        assert "m entry #2" in err and "DAMAGED entry" in lines[1] and "m@?" in lines[2]
        assert rows[1]["id"] is None and [r["version"] for r in rows] == [0, None, None]
        assert [r["id"] for r in (rows[0], rows[2])] == [ids[2], ids[0]] and rows[2]["message"] == "v0"
    else:
        version = 1 if damage == "manifest" else 0
        assert f"DAMAGED m@{version}: manifest" in err and "ckpt verify --repair-from URL" in lines[version]
        assert "freed" not in out and [r["version"] for r in rows] == [0, 1, 2]


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_gc_stopped_by_a_damaged_checkpoint_names_the_versions_and_the_way_on(damaged, capsys, dry_run):
    """A damaged root manifest stops gc (what it keeps alive is unknown); the error said only
    "manifest ... is corrupt (run `ckpt verify` ...)", not which ref or version needs it, nor how to
    get gc running again. Following what it says must work. A dry run previews from the metadata
    index, which summarised these manifests at push time and does not read them again (docs/format.md:
    the real gc reads every root manifest): it finds the damage where the index has to read them."""
    root = damaged.backend.local_path(".")
    if dry_run:
        shutil.rmtree(os.path.join(root, "index"))
    before = {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if "index" not in d}
    code, _, err = run_main(capsys, "gc", "--grace", "0s", *dry_run)
    if not dry_run:  # a deleting gc with a short grace warns first
        assert err.startswith("warning: --grace 0s")
        err = err.split("\n", 1)[1]
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: gc deleted nothing: the checkpoint of ")
    assert ("of a@1 cannot" in err) != ("of b cannot" in err)  # the first one found, named as commands accept it
    assert "`ckpt verify --repair-from URL`" in err
    assert ("`ckpt gc --no-history`" in err) if "a@1" in err else ("`ckpt rm b`" in err)
    assert before <= {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}
    assert run_main(capsys, "rm", "b")[0] == 0
    code, _, err = run_main(capsys, "gc", "--grace", "0s", *dry_run)
    assert code == 1 and "of a@1 cannot be read" in err and "`ckpt gc --no-history`" in err and "ckpt rm" not in err
    code, _, err = run_main(capsys, "gc", "--grace", "0s", "--no-history", *dry_run)
    assert code == 0, err


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_gc_stopped_by_a_damaged_ref_entry_says_how_to_go_on(tmp_path, monkeypatch, capsys, dry_run):
    """A damaged ref entry stops gc (what it keeps alive is unknown) with only the parse error: no
    word that nothing was deleted, nor of what gets gc running again (no command rewrites an entry)."""
    path = tmp_path / "store"
    monkeypatch.setenv("CKPT_STORE", str(path))
    store = ckpt.Store.init(str(path))
    for i in range(3):
        store.push({"w": torch.full((3,), float(i))}, "m")
    assert run_main(capsys, "ls")[0] == 0  # with an index snapshot, as a store in use has
    entry = path / "refs" / "m" / "0000000002.ref"
    entry.write_bytes(b"{")
    code, _, err = run_main(capsys, "gc", "--grace", "1h", *dry_run)
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: gc deleted nothing: ")
    assert "refs/m/0000000002.ref" in err and "`ckpt gc --no-history`" in err
    assert "move it and the entries older than it out of the store folder" in err
    assert run_main(capsys, "gc", "--grace", "1h", "--no-history", *dry_run)[0] == 0  # needs only m's newest entry
    entry.rename(tmp_path / "aside.ref")  # a gap: it must not renumber m@1 (entry 1 is m@2), nor free what 2 named
    code, _, err = run_main(capsys, "gc", "--grace", "1h", *dry_run)
    assert code == 1 and "0000000002.ref is missing" in err and "move the entries older than it out" in err
    code, _, err = run_main(capsys, "show", "m@1")
    assert code != 0 and "0000000002.ref is missing" in err
    (path / "refs" / "m" / "0000000001.ref").rename(tmp_path / "aside-1.ref")
    assert run_main(capsys, "gc", "--grace", "1h", *dry_run)[0] == 0
    (path / "refs" / "m" / "0000000003.ref").write_bytes(b"{")  # the newest: m's current version is unknown
    for args in ([], ["--no-history"]):
        code, _, err = run_main(capsys, "gc", "--grace", "1h", *args, *dry_run)
        assert code == 1 and "gc deleted nothing" in err and "0000000003.ref" in err and "--no-history" not in err
