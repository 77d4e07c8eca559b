"""The CLI in-process: typer's CliRunner for the commands, main() for the error contract."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpt_store.cli.main import app, main


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_STORE", str(tmp_path / "store"))
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(64, 64), "b": torch.zeros(64)}, src, metadata={"k": "v"})
    return tmp_path, src


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout  # (stderr apart: a warning there is not part of --json output)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
        raise SystemExit(0)
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def test_push_ls_show_du_pull(env):
    tmp, src = env
    invoke("push", str(src), "demo/a", "-m", "first")
    invoke("push", str(src), "demo/b")
    rows = json.loads(invoke("ls", "--json"))
    assert [r["ref"] for r in rows] == ["demo/a", "demo/b"] and rows[0]["message"] == "first"
    shown = json.loads(invoke("show", "demo/a", "--json"))
    assert {t["name"] for t in shown["tensors"]} == {"w", "b"}
    assert shown["files"][0]["metadata"] == {"k": "v"}
    du = json.loads(invoke("du", "--json"))
    assert du["dedup_saved_bytes"] >= src.stat().st_size  # the second push stored nothing new
    assert "dedup saved" in invoke("du")
    invoke("pull", "demo/b", str(tmp / "out.safetensors"))
    assert (tmp / "out.safetensors").read_bytes() == src.read_bytes()
    assert "demo/a" in invoke("ls") and "TENSOR" in invoke("show", "demo/a")


def test_log_rm_gc_verify(env):
    tmp, src = env
    invoke("push", str(src), "x", "-m", "one")
    save_file({"w": torch.ones(3)}, tmp / "two.safetensors")
    invoke("push", str(tmp / "two.safetensors"), "x", "-m", "two")
    log = json.loads(invoke("log", "x", "--json"))
    assert [r["message"] for r in log] == ["two", "one"] and [r["version"] for r in log] == [0, 1]
    invoke("rm", "x")
    assert json.loads(invoke("ls", "--json")) == []
    plan = json.loads(invoke("gc", "--dry-run", "--grace", "0s", "--json"))
    assert plan["dry_run"] and plan["deleted"] > 0
    done = json.loads(invoke("gc", "--grace", "0", "--json"))
    assert done["deleted"] == plan["deleted"]
    assert json.loads(invoke("verify", "--json"))["ok"]


def test_help_teaches():
    out = invoke("--help")
    for word in ("push", "pull", "CKPT_STORE", "NAME@N", "gc", "verify"):
        assert word in out
    assert "weights_only" in invoke("push", "--help")


def test_readme_names_every_command_that_takes_json():
    """The README's list of the commands that take --json left out `cache` and `cache clear`, which
    do: a script writer reading it could not know their output has a contract."""
    import re
    from pathlib import Path

    import typer.main

    def with_json(group, prefix=""):
        cmd = typer.main.get_command(group) if not hasattr(group, "commands") else group
        for name, sub in cmd.commands.items():
            if any(p.name == "as_json" for p in sub.params):
                yield prefix + name
            if hasattr(sub, "commands"):
                yield from with_json(sub, prefix + name + " ")

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    listed = re.search(r"Every command that reports something \(([^)]*)\) takes `--json`", readme)
    assert listed is not None
    assert set(re.findall(r"`([a-z ]+)`", listed.group(1))) == set(with_json(app))


def test_errors_are_one_line(env, capsys):
    tmp, src = env
    code, _, err = run_main(capsys, "pull", "x", str(tmp / "o"))
    assert code == 1 and "no ckpt store" in err and "ckpt init" in err
    run_main(capsys, "init")
    code, _, err = run_main(capsys, "pull", "nope", str(tmp / "o"))
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and "nope" in err
    code, _, err = run_main(capsys, "push", str(src), "../evil")
    assert code == 1 and "invalid ref name" in err
    code, _, err = run_main(capsys, "gc", "--grace", "soon")
    assert code == 2 and "duration" in err


def test_a_name_that_names_nothing_gets_the_names_near_it(env, capsys):
    """A typo or a folder of refs given as a ref: the error names the refs the user likely meant."""
    tmp, src = env
    for name in ("minilm/base", "minilm/ft-top", "minilm/ft-x", "minilm/v2"):
        invoke("push", str(src), name)
    code, _, err = run_main(capsys, "pull", "minilm/ft-tpo", str(tmp / "o"))
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("error: no ref or checkpoint named 'minilm/ft-tpo' (did you mean 'minilm/ft-top'")
    code, _, err = run_main(capsys, "show", "minilm")
    assert code == 1 and "(refs below it: 'minilm/base', 'minilm/ft-top', 'minilm/ft-x' and 1 more; see `ckpt ls`)" in err
    # A damaged store's folder under refs/ whose name no command can name is not offered.
    bad = tmp / "store" / "refs" / "minilm" / "ft-\x1b[31m"
    bad.mkdir()
    (bad / "0000000001.ref").write_bytes(next((tmp / "store" / "refs" / "minilm" / "v2").iterdir()).read_bytes())
    code, _, err = run_main(capsys, "show", "minilm/ft-x1b-31m")
    assert code == 1 and "(did you mean 'minilm/ft-x'? see `ckpt ls`)" in err and "x1b[" not in err
    code, _, err = run_main(capsys, "show", "zzz")
    assert code == 1 and err == "error: no ref or checkpoint named 'zzz' (see `ckpt ls`)\n"
    code, _, err = run_main(capsys, "log", "minilm/ft-tp")
    assert code == 1 and "no ref named 'minilm/ft-tp' (did you mean 'minilm/ft-top' or 'minilm/ft-x'?" in err
    invoke("rm", "minilm/v2")
    code, _, err = run_main(capsys, "rm", "minilm/v2")  # removed already: not offered as its own correction
    assert code == 1 and err == "error: no ref named 'minilm/v2' (see `ckpt ls`)\n"
    invoke("rm", "minilm/ft-x")  # a removed ref is offered neither as a spelling nor below a folder
    code, _, err = run_main(capsys, "log", "minilm/ft-tp")
    assert code == 1 and "(did you mean 'minilm/ft-top'? see `ckpt ls`)" in err
    code, _, err = run_main(capsys, "show", "minilm")
    assert code == 1 and "(refs below it: 'minilm/base', 'minilm/ft-top'; see `ckpt ls`)" in err
    code, _, err = run_main(capsys, "show", "minilm/base@1")
    assert code == 1 and "minilm/base has 1 version; minilm/base@1 does not exist" in err
    assert not (tmp / "o").exists()


def test_verify_exit_code_on_damage(env, capsys):
    import os

    tmp, src = env
    run_main(capsys, "push", str(src), "a")
    chunks = tmp / "store" / "objects" / "chunks"
    victim = next(p for p in chunks.rglob("*") if p.is_file())
    victim.write_bytes(victim.read_bytes()[:-1])
    code, out, err = run_main(capsys, "verify")
    assert code == 1 and "DAMAGED a" in err
    code, out, _ = run_main(capsys, "verify", "--json")
    assert code == 1 and json.loads(out)["damaged_refs"].keys() == {"a"}
    assert os.path.exists(victim)  # verify never repairs or deletes


def test_push_base_and_show_codecs(env):
    tmp, src = env
    invoke("push", str(src), "m/base")
    from safetensors.torch import load_file

    ft = {k: v + 1e-4 if v.is_floating_point() else v for k, v in load_file(src).items()}
    save_file(ft, tmp / "ft.safetensors", metadata={"k": "v"})
    r = json.loads(invoke("push", str(tmp / "ft.safetensors"), "m/ft", "--base", "m/base", "--json"))
    shown = json.loads(invoke("show", "m/ft", "--json"))
    assert shown["lineage"]["base"] == json.loads(invoke("ls", "--json"))[0]["id"]
    w = next(t for t in shown["tensors"] if t["name"] == "w")
    assert set(w["codecs"]) & {"gsub", "sub", "xor"} and w["delta_depth"] == 1
    assert "depth 1" in invoke("show", "m/ft")
    assert r["written_bytes"] < r["logical_bytes"] / 2
    invoke("push", str(tmp / "ft.safetensors"), "m/ft2", "--no-delta")
    assert json.loads(invoke("show", "m/ft2", "--json"))["lineage"]["base"] is None
    du = json.loads(invoke("du", "--json"))
    assert {"planes"} <= set(du["codecs"]) and any(c in du["codecs"] for c in ("gsub", "sub", "xor"))
    # Each codec's line says what share of its input it saved (it said the share it kept, after "saved").
    text = invoke("du")
    for codec, c in du["codecs"].items():
        saved = 100.0 * (c["decoded_bytes"] - c["stored_bytes"]) / c["decoded_bytes"]
        line = next(x for x in text.splitlines() if x.strip().startswith(codec + " "))
        assert line.endswith(f", {saved:.1f}% of its input)"), line


def test_verify_repair_from(env, capsys):
    tmp, src = env
    import shutil

    import ckpt

    invoke("push", str(src), "m")
    shutil.copytree(tmp / "store", tmp / "mirror")
    store = ckpt.Store.open(str(tmp / "store"))
    cid = store.manifest("m").tensors[0].chunks[0]
    path = tmp / "store" / store.objects.path("chunks", cid)
    path.write_bytes(path.read_bytes()[:-3])
    code, out, err = run_main(capsys, "verify")
    assert code == 1 and "DAMAGED m" in err
    code, out, err = run_main(capsys, "verify", "--repair-from", str(tmp / "mirror"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["repaired"] == [{"kind": "chunk", "id": cid}]
    code, out, err = run_main(capsys, "verify")
    assert code == 0


def test_hostile_push_sources_are_one_line_errors(env, capsys):
    """Issue 15: each is exit code 1 and one line naming the problem, never a traceback or
    a push that silently stored less (or more) than the source holds."""
    import os

    tmp, _ = env
    torch.save({"a": {"b": torch.ones(3)}, "a.b": torch.zeros(3)}, tmp / "collide.pt")
    torch.save({"w": torch.eye(3).to_sparse()}, tmp / "sparse.pt")
    torch.save({"w": torch.empty(3, device="meta")}, tmp / "meta.pt")
    model = tmp / "model"
    model.mkdir()
    save_file({"w": torch.zeros(2)}, model / "model.safetensors")
    os.symlink("/etc/passwd", model / "passwd_link")
    looped = tmp / "looped"
    looped.mkdir()
    save_file({"w": torch.zeros(2)}, looped / "model.safetensors")
    os.symlink("..", looped / "up")
    os.symlink("nowhere", looped / "dangling")
    cases = [
        (tmp / "collide.pt", ("['a']['b']", "['a.b']", "both")),
        (tmp / "sparse.pt", ("'w'", "sparse", "to_dense")),
        (tmp / "meta.pt", ("'w'", "meta")),
        (model, ("passwd_link", "outside the folder")),
        (looped, ("up", "dangling", "broken")),
    ]
    if os.path.exists("/dev/zero"):
        cases.append(("/dev/zero", ("character device",)))
    for src, words in cases:
        code, _, err = run_main(capsys, "push", str(src), "x")
        assert code == 1 and err.startswith("error: ") and err.count("\n") == 1, (src, err)
        assert "Traceback" not in err and all(w in err for w in words), (src, err)
    assert json.loads(invoke("ls", "--json")) == []


def test_gc_with_a_short_grace_warns_on_stderr(env):
    """`gc --grace 0` deletes what a push or copy running elsewhere has written and not yet named:
    it still runs (a user cleaning a store no one else writes), and says so on stderr."""
    tmp, src = env
    invoke("push", str(src), "g/x")
    invoke("rm", "g/x")
    result = CliRunner().invoke(app, ["gc", "--grace", "0", "--json"], catch_exceptions=False)
    assert result.exit_code == 0 and json.loads(result.stdout)["deleted"] > 0
    assert "warning: --grace 0" in result.stderr
    quiet = CliRunner().invoke(app, ["gc", "--grace", "1h", "--json"], catch_exceptions=False)
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_rm_interrupted_between_names_says_so_in_its_json(env, capsys, monkeypatch):
    """Ctrl-C during `ckpt rm a b c --json`, after a was removed: the document rm prints (the names
    it removed) had no "error", as if the command had done all it was asked, while it exited 130;
    every other interrupted command's document says it was interrupted."""
    import ckpt

    tmp, src = env
    for name in ("a", "b", "c"):
        invoke("push", str(src), name)
    real = ckpt.Store.remove

    def remove(self, name):
        if name == "b":
            raise KeyboardInterrupt  # the signal lands here (the handler of cli/interrupts.py raises it)
        return real(self, name)

    monkeypatch.setattr(ckpt.Store, "remove", remove)
    code, out, err = run_main(capsys, "rm", "a", "b", "c", "--json")
    doc = json.loads(out)
    assert code == 130 and [r["ref"] for r in doc["removed"]] == ["a"], (code, out, err)
    assert doc["error"] == err.strip() and err.startswith("interrupted") and err.count("\n") == 1
    assert [r["ref"] for r in json.loads(invoke("ls", "--json"))] == ["b", "c"]
