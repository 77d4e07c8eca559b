"""`ckpt diff`, `ckpt merge` and `ckpt remix` in-process (typer's CliRunner) and their error contract (main())."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli_runner import invoke, run_main  # the same in-process helpers (tests/cli is on sys.path)

from ckpt.merging.combine import merge_state_dicts


@pytest.fixture
def fam(tmp_path, monkeypatch):
    """A base and two fine-tunes in a store, and the fine-tunes as files."""
    monkeypatch.setenv("CKPT_STORE", str(tmp_path / "store"))
    g = torch.Generator().manual_seed(0)
    base = {f"layers.{i}.{p}": torch.randn(32, 32, generator=g) for i in range(3) for p in ("w", "v")}
    base["emb"] = torch.randn(100, 32, generator=g)
    fts = []
    for j in range(2):
        ft = {k: v + 0.01 * torch.randn(v.shape, generator=g) if k.startswith("layers.2") or k == f"layers.{j}.w" else v
              for k, v in base.items()}
        save_file(ft, tmp_path / f"ft{j}.safetensors", metadata={"format": "pt"})
        fts.append(ft)
    save_file(base, tmp_path / "base.safetensors", metadata={"format": "pt"})
    invoke("push", str(tmp_path / "base.safetensors"), "m/base")
    for j in range(2):
        invoke("push", str(tmp_path / f"ft{j}.safetensors"), f"m/ft{j}")
    return tmp_path, base, fts


def test_diff_json_table_and_plot(fam):
    tmp, base, fts = fam
    doc = json.loads(invoke("diff", "m/base", "m/ft0", "--json"))
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert {n for n, t in by_name.items() if t["status"] == "changed"} == {"layers.0.w", "layers.2.w", "layers.2.v"}
    assert by_name["emb"]["status"] == "identical" and by_name["emb"]["read"] is False
    assert doc["summary"]["changed"] == 3 and doc["summary"]["identical_unread"] == 4
    assert doc["summary"]["delta_bytes"] > 0
    top = json.loads(invoke("diff", "m/base", "m/ft0", "--json", "--sort", "relative_change", "--top", "2"))
    assert len(top["tensors"]) == 2 and top["summary"]["tensors"] == 7
    assert top["tensors"][0]["relative_change"] >= top["tensors"][1]["relative_change"]
    # a ref against a local file, filtered
    doc = json.loads(invoke("diff", "m/base", str(tmp / "ft1.safetensors"), "--json", "-i", "layers.*", "-x", "*.v"))
    assert [t["name"] for t in doc["tensors"]] == ["layers.0.w", "layers.1.w", "layers.2.w"]
    text = invoke("diff", "m/base", "m/ft0")
    assert "changed" in text and "B as a delta against A stores about" in text
    pytest.importorskip("matplotlib")
    assert "plot written" in invoke("diff", "m/base", "m/ft0", "--plot", str(tmp / "d.png"))
    assert (tmp / "d.png").read_bytes()[:4] == b"\x89PNG"
    # Through the library, a name without a suffix is a PNG, as savefig made it (the temporary
    # written first has no suffix to go by); the CLI asks for one.
    from ckpt.diffing.compare import diff
    from ckpt.diffing.plot import plot_report

    plot_report(diff(str(tmp / "base.safetensors"), str(tmp / "ft0.safetensors")), tmp / "chart")
    assert (tmp / "chart").read_bytes()[:4] == b"\x89PNG"


def test_plot_replaces_a_link_at_its_name_and_never_writes_through_it(fam):
    """--plot NAME where NAME is a symbolic link: savefig opened the link and overwrote the file it
    pointed to (a file anywhere). Now the plot is written like a pulled file, beside the name and
    renamed over it: the link is replaced, the file it named is as it was."""
    pytest.importorskip("matplotlib")
    tmp = fam[0]
    precious = tmp / "precious.pdf"
    precious.write_bytes(b"mine")
    link = tmp / "change.pdf"
    link.symlink_to(precious)
    assert "plot written" in invoke("diff", "m/base", "m/ft0", "--plot", str(link))
    assert precious.read_bytes() == b"mine"
    assert not link.is_symlink() and link.read_bytes()[:5] == b"%PDF-"
    assert not [p for p in tmp.iterdir() if ".ckpt-" in p.name]  # no temporary left


@pytest.mark.parametrize("where", ["objects/x.png", "refs/m/base/plot.png", "index", "other"])
def test_a_plot_is_never_written_inside_a_store(where, fam, capsys):
    """--plot PATH inside a local store's folder (objects/, refs/, ...) wrote the image there: garbage
    to gc, or, under a name the store reads, damage. It is refused before the diff runs, in one line
    (here inside the store diffed from, or inside any other), and the library refuses it too."""
    pytest.importorskip("matplotlib")
    from ckpt.diffing.compare import diff
    from ckpt.diffing.plot import plot_report
    from ckpt.errors import DestinationError

    tmp = fam[0]
    if where == "other":
        invoke("--store", str(tmp / "other"), "init")
        target = tmp / "other" / "x.png"
    else:
        target = tmp / "store" / (where if where != "index" else "index/x.svg")
    before = sorted(p for p in tmp.rglob("*"))
    code, out, err = run_main(capsys, "diff", "m/base", "m/ft0", "--plot", str(target))
    assert code == 1 and "inside the store at" in err and "Traceback" not in err and out == "", err
    with pytest.raises(DestinationError, match="inside the store"):
        plot_report(diff(str(tmp / "base.safetensors"), str(tmp / "ft0.safetensors")), target)
    assert sorted(p for p in tmp.rglob("*")) == before
    assert json.loads(invoke("verify", "--json"))["ok"]


def test_a_plot_never_replaces_a_file_it_diffs(fam, capsys):
    """A weights file may have any name (diff reads it by its content): `ckpt diff A b.png --plot
    b.png` read b.png, then renamed the chart over it, the fine-tune gone. The plot's name is
    refused when it is one of the files diffed (by another spelling or through a link too), before
    the diff runs from the CLI and in the library, and nothing is written; a link at the plot's
    name to an input is still replaced, not the input (test_plot_replaces_a_link...)."""
    pytest.importorskip("matplotlib")
    from ckpt.diffing.compare import diff
    from ckpt.diffing.plot import plot_report
    from ckpt.errors import DestinationError

    tmp = fam[0]
    weights = tmp / "ft1.png"
    weights.write_bytes((tmp / "ft1.safetensors").read_bytes())
    (tmp / "sub").mkdir()
    (tmp / "link.safetensors").symlink_to(weights)
    before = weights.read_bytes()
    for a, b, plot in (("m/base", str(weights), str(weights)), (str(weights), "m/ft0", str(tmp / "sub" / ".." / "ft1.png")),
                       (str(tmp / "link.safetensors"), "m/base", str(weights))):
        code, out, err = run_main(capsys, "diff", a, b, "--plot", plot)
        assert code == 1 and "a checkpoint diffed; a plot never replaces it" in err and "Traceback" not in err and out == "", err
    report = diff(str(tmp / "base.safetensors"), str(weights))
    with pytest.raises(DestinationError, match="a plot never replaces it"):
        plot_report(report, weights)
    assert weights.read_bytes() == before and not [p for p in tmp.iterdir() if ".ckpt-" in p.name]
    link = tmp / "chart.png"
    link.symlink_to(weights)
    assert "plot written" in invoke("diff", "m/base", str(weights), "--plot", str(link))
    assert weights.read_bytes() == before and not link.is_symlink()


def test_merge_show_and_pull(fam):
    tmp, base, fts = fam
    r = json.loads(invoke("merge", "m/ft0", "m/ft1", "--method", "ties", "-b", "m/base", "-p", "density=0.5",
                          "-w", "1,2", "-o", "m/ties", "--json"))
    assert r["method"] == "ties" and r["params"]["density"] == 0.5 and r["params"]["weights"] == [1.0, 2.0]
    assert r["reused_tensors"] == 3 and r["merged_tensors"] == 4  # emb, layers.1.v, layers.0.v were never touched
    shown = invoke("show", "m/ties")
    assert "merged     ties (density=0.5, lambda=1.0, normalize=true, weights=[1.0, 2.0])" in shown  # values as JSON
    assert "(m/ft0)" in shown and "(m/base)" in shown
    assert json.loads(invoke("show", "m/ties", "--json"))["lineage"]["merge"]["input_refs"] == ["m/ft0", "m/ft1"]
    invoke("pull", "m/ties", str(tmp / "out.safetensors"))
    pulled = load_file(tmp / "out.safetensors")
    expected = merge_state_dicts(fts, "ties", params={"density": 0.5, "weights": [1, 2]}, base=base)
    assert all(torch.equal(pulled[k].view(torch.int32), v.view(torch.int32)) for k, v in expected.items())


def test_list_methods_and_help():
    text = invoke("merge", "--list-methods")
    for word in ("linear", "task-arithmetic", "ties", "dare", "slerp", "density (float, (0, 1]; default 0.2)", "seed", "t (float, [0, 1]"):
        assert word in text
    methods = json.loads(invoke("merge", "--list-methods", "--json"))
    dare = next(m for m in methods if m["name"] == "dare")
    assert {p["name"] for p in dare["params"]} == {"density", "combine", "weights", "lambda", "seed"} and dare["needs_base"]
    assert "task-arithmetic" in invoke("merge", "--help")


def test_merge_errors_are_one_line(fam, capsys):
    cases = [
        (["merge", "m/ft0", "m/ft1", "--method", "ties", "-b", "m/base", "-p", "density=1.5", "-o", "x"], "density must be in (0, 1]"),
        (["merge", "m/ft0", "m/ft1", "--method", "mean", "-o", "x"], "unknown merge method 'mean'"),
        (["merge", "m/ft0", "m/ft1", "-w", "1,2,3", "-o", "x"], "3 values for 2 inputs"),
        (["merge", "m/ft0", "m/ft1", "--method", "ties", "-o", "x"], "needs a base"),
        (["merge", "m/ft0", "m/nope", "-o", "x"], "no ref or checkpoint named 'm/nope'"),
        (["merge", "m/ft0", "m/ft1", "-p", "oops", "-o", "x"], "KEY=VALUE"),
        (["merge", "m/ft0", "m/ft1"], "--output"),
    ]
    for args, message in cases:
        code, _, err = run_main(capsys, *args)
        assert code != 0 and message in err, (args, err)
        assert "Traceback" not in err
        if code == 1:
            assert err.startswith("error: ") and err.count("\n") == 1


def test_remix_from_scores(fam, capsys):
    tmp, base, fts = fam
    (tmp / "scores.json").write_text(json.dumps({"m/ft0": 0.9, "m/ft1": 0.7, "m/base": 0.1}))
    r = json.loads(invoke("remix", "--scores", str(tmp / "scores.json"), "-k", "2", "-o", "m/start", "--json"))
    assert r["chosen"] == ["m/ft0", "m/ft1"]
    assert "remix    best 2 by score (higher is better)" in invoke("show", "m/start")
    (tmp / "losses.json").write_text(json.dumps([{"ref": "m/ft0", "score": 0.9}, {"ref": "m/base", "score": 0.1}]))
    r = json.loads(invoke("remix", "--scores", str(tmp / "losses.json"), "-k", "1", "--lower-is-better", "-o", "m/s2", "--json"))
    assert r["chosen"] == ["m/base"]
    (tmp / "bad.json").write_text("[1, 2]")
    code, _, err = run_main(capsys, "remix", "--scores", str(tmp / "bad.json"), "-o", "m/s3")
    assert code == 1 and "ref" in err and err.count("\n") == 1
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)  # nested past Python's stack: was a RecursionError traceback
    code, _, err = run_main(capsys, "remix", "--scores", str(tmp / "deep.json"), "-o", "m/s3")
    assert code == 1 and "cannot read scores" in err and err.count("\n") == 1


def test_remix_reads_a_bounded_amount_of_a_scores_file(fam, capsys):
    """--scores naming something that is not a scores file -- a model, /dev/zero, a pipe that
    never ends -- was read whole into memory (/dev/zero: until MemoryError, as a traceback, or the
    OOM killer). It is refused after 16 MiB, before any merge."""
    tmp, _, _ = fam
    big = tmp / "big.json"
    with open(big, "w") as f:  # valid JSON, and far larger than any table of scores
        f.write(" " * (17 << 20) + json.dumps({"m/ft0": 0.9, "m/ft1": 0.7}))
    code, out, err = run_main(capsys, "remix", "--scores", str(big), "-k", "2", "-o", "m/start")
    assert code == 1 and err.count("\n") == 1 and "too large to be a scores file" in err, err
    assert run_main(capsys, "show", "m/start")[0] == 1  # nothing was stored
    if os.path.exists("/dev/zero"):
        code, out, err = run_main(capsys, "remix", "--scores", "/dev/zero", "-k", "2", "-o", "m/start")
        assert code == 1 and "too large to be a scores file" in err, err


def test_diff_top_below_one_is_rejected(fam, capsys):
    """Issue 15 item 14: --top 0 / --top -1 printed an empty table and exited 0."""
    for bad in ("0", "-1"):
        code, out, err = run_main(capsys, "diff", "m/base", "m/ft0", "--top", bad)
        assert code == 2 and "TENSOR" not in out
        assert "--top" in err and "greater than or equal to 1" in err
    from ckpt.diffing.compare import diff

    with pytest.raises(ValueError, match="top must be an int >= 1"):
        diff("m/base", "m/ft0").select("relative_change", 0)


@pytest.mark.parametrize("text", [
    '{"m/ft0": 0.9, "m/ft1": 0.5, "m/ft0": 0.1}',  # a repeated JSON key: the last used to win silently
    '[{"ref": "m/ft0", "score": 0.9}, {"ref": "m/ft1", "score": 0.5}, {"ref": "m/ft0", "score": 0.1}]',
])
def test_remix_refuses_a_ref_scored_twice(fam, capsys, text):
    """Issue 15 item 14: a scores file naming one ref twice is refused, naming it, before any merge."""
    tmp, _, _ = fam
    (tmp / "scores.json").write_text(text)
    code, out, err = run_main(capsys, "remix", "--scores", str(tmp / "scores.json"), "-k", "1", "-o", "m/start")
    assert code == 1 and err.count("\n") == 1
    assert "m/ft0 is given 2 times" in err
    assert run_main(capsys, "show", "m/start")[0] == 1  # nothing was stored


def test_remix_refuses_two_refs_of_one_checkpoint(fam, capsys):
    tmp, _, _ = fam
    (tmp / "scores.json").write_text('{"m/ft0": 0.9, "m/ft0@0": 0.8, "m/ft1": 0.5}')
    code, out, err = run_main(capsys, "remix", "--scores", str(tmp / "scores.json"), "-k", "2", "-o", "m/start")
    assert code == 1 and "m/ft0@0 and m/ft0 name the same checkpoint" in err
