"""The CLI's one result per command (cli/main.py builds it, cli/views.py draws it): --json on
every command that reports something, one spelling per key, -o meaning one thing, settings
errors as one line, and show sizing a checkpoint from its own chunks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpt_store.cli.main import app, main
from ckpt_store.storage.objects import ObjectStore


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("CKPT_FSYNC", "0")
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(128, 128, generator=g), "b": torch.randn(128, generator=g)}
    save_file(base, tmp_path / "a.safetensors")
    save_file({k: v + 1e-3 for k, v in base.items()}, tmp_path / "b.safetensors")
    return tmp_path


def invoke(*args: str) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout  # (stderr apart: a warning there is not part of --json output)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
        raise SystemExit(0)
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def test_init_json_says_whether_it_created(env):
    assert json.loads(invoke("init", "--json")) == {"url": str(env / "store"), "created": True}
    assert json.loads(invoke("init", "--json")) == {"url": str(env / "store"), "created": False}
    assert "store ready at" in invoke("init")


def test_pull_and_rm_report_as_json(env):
    pushed = json.loads(invoke("push", env / "a.safetensors", "m/a", "--json"))
    doc = json.loads(invoke("pull", "m/a", env / "out.safetensors", "--json"))
    assert doc == {"ref": "m/a", "id": pushed["id"], "path": str(env / "out.safetensors"), "copy": None}
    assert (env / "out.safetensors").read_bytes() == (env / "a.safetensors").read_bytes()
    invoke("push", env / "b.safetensors", "m/b")
    doc = json.loads(invoke("rm", "m/a", "m/b", "--json"))
    assert [r["ref"] for r in doc["removed"]] == ["m/a", "m/b"] and all(isinstance(r["seq"], int) for r in doc["removed"])
    assert json.loads(invoke("ls", "--json")) == []


def test_pull_from_another_store_as_json(env):
    other = env / "other"
    invoke("--store", other, "push", env / "a.safetensors", "m/a")
    doc = json.loads(invoke("pull", "m/a", "--from", other, "--json"))
    assert doc["path"] is None and doc["copy"]["refs"] == {"m/a": doc["id"]} and doc["copy"]["chunks_sent"] > 0


def test_pull_from_that_copies_then_cannot_write_says_both(env, capsys):
    """`pull REF DEST --from URL --json` whose copy landed and whose pull then failed (DEST there,
    no --force) printed only {"error"}: a script could not tell that REF is now in this store."""
    other = env / "other"
    invoke("--store", other, "push", env / "a.safetensors", "m/a")
    (env / "out.safetensors").write_text("mine")
    code, out, err = run_main(capsys, "pull", "m/a", str(env / "out.safetensors"), "--from", str(other), "--json")
    doc = json.loads(out)
    assert code == 1 and "exists" in doc["error"] and doc["path"] is None and doc["copy"]["refs"] == {"m/a": doc["id"]}
    assert err.startswith("error: ") and (env / "out.safetensors").read_text() == "mine"
    assert json.loads(invoke("ls", "--json"))[0]["ref"] == "m/a"


def test_rm_reports_what_it_removed_before_a_failure(env, capsys):
    invoke("push", env / "a.safetensors", "m/a")
    code, out, err = run_main(capsys, "rm", "m/a", "m/nope")
    assert code == 1 and out == "removed m/a\n" and err.startswith("error: no ref named 'm/nope'")


def test_one_spelling_for_logical_bytes(env):
    size = (env / "a.safetensors").stat().st_size
    assert json.loads(invoke("push", env / "a.safetensors", "m/a", "--json"))["logical_bytes"] == size
    row = json.loads(invoke("ls", "--json"))[0]
    assert row["logical_bytes"] == size and row["bytes"] == size  # "bytes": old spelling, kept one release
    shown = json.loads(invoke("show", "m/a", "--json"))
    assert shown["logical_bytes"] == shown["bytes"] == size
    assert all(t["logical_bytes"] == t["bytes"] == 4 * t["shape"][0] * (t["shape"][1] if len(t["shape"]) > 1 else 1)
               for t in shown["tensors"])
    assert json.loads(invoke("du", "--json"))["logical_bytes"] == size
    gc = json.loads(invoke("gc", "--json", "--grace", "0s"))
    assert gc["deleted_bytes"] == gc["bytes"]


def test_show_sizes_its_own_chunks_without_listing_the_store(env, monkeypatch, capsys):
    invoke("push", env / "a.safetensors", "m/a")
    invoke("push", env / "b.safetensors", "m/b")  # delta-coded against m/a: its stored size counts its bases too
    du = {r["ref"]: r for r in json.loads(invoke("du", "--json"))["refs"]}

    def no_listing(self, kind):
        raise AssertionError(f"show listed every {kind} object of the store")

    monkeypatch.setattr(ObjectStore, "list", no_listing)
    for ref in ("m/a", "m/b"):
        shown = json.loads(invoke("show", ref, "--json"))
        assert shown["stored_bytes"] == du[ref]["stored_bytes"] and shown["missing_chunks"] == 0
        assert 0 < sum(t["stored_bytes"] for t in shown["tensors"]) <= shown["stored_bytes"]
        assert shown["files"][0]["stored_bytes"] > 0
    text = invoke("show", "m/b")
    assert "lineage    {\"base\": \"" in text and "'base'" not in text  # JSON, not a Python repr
    assert "delta base" in text and "(depth 1)" in text and "missing" not in text
    # a lost chunk: show still answers, and says so
    shown = json.loads(invoke("show", "m/a", "--json"))
    lost = next(p for p in (env / "store" / "objects" / "chunks").rglob("*") if p.is_file() and p.name == shown_chunk(env, "m/a"))
    lost.unlink()
    # ... and, as ls, du and log do for damage they list, exits 1 (it exited 0: a script's
    # `ckpt show REF --json && use REF` went on with a checkpoint that cannot be pulled)
    code, out, err = run_main(capsys, "show", "m/a", "--json")
    after = json.loads(out)
    assert code == 1 and after["missing_chunks"] == 1 and after["stored_bytes"] < shown["stored_bytes"] and err == ""
    code, out, err = run_main(capsys, "show", "m/a")
    assert code == 1 and "missing    1 of its chunks are not in the store" in out
    assert err == "DAMAGED m/a: 1 of its chunks are not in the store (`ckpt verify` says more)\n"


def shown_chunk(env, ref: str) -> str:
    """The first chunk of ``ref``'s first tensor, from the public API."""
    import ckpt

    return ckpt.Store.open(str(env / "store")).manifest(ref).tensors[0].chunks[0]


def test_o_means_output_and_the_old_global_o_warns(env, capsys):
    invoke("push", env / "a.safetensors", "m/a")
    invoke("push", env / "b.safetensors", "m/b")
    assert json.loads(invoke("merge", "m/a", "m/b", "-o", "m/avg", "--json"))["ref"] == "m/avg"
    (env / "s.json").write_text(json.dumps({"m/a": 1.0, "m/b": 2.0}))
    assert json.loads(invoke("remix", "--scores", env / "s.json", "-k", "2", "-o", "m/rx", "--json"))["ref"] == "m/rx"
    # -o before the command is the old spelling of --storage-option: still read as one, with a warning
    # (storage options on a command whose stores are all local folders are refused: s3:// forgotten?)
    code, out, err = run_main(capsys, "-o", "anon=true", "ls", "--json")
    assert "deprecated" in err and "--storage-option" in err
    assert code == 2 and "storage options are for remote stores" in err
    code, out, err = run_main(capsys, "--storage-option", "anon=true", "ls")
    assert code == 2 and "deprecated" not in err and "storage options are for remote stores" in err
    assert "--storage-option" in invoke("--help") and "-o, --output" in invoke("merge", "--help")


@pytest.mark.parametrize("var, value", [("CKPT_WORKERS", "abc"), ("CKPT_WORKERS", "-4"), ("CKPT_IO_WORKERS", "0"),
                                        ("CKPT_FSYNC", "sometimes"), ("CKPT_CHUNK_SIZE", "12k")])
def test_bad_settings_in_the_environment_are_one_line(env, capsys, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    for args in (["ls"], ["push", env / "a.safetensors", "m/a"], ["diff", env / "a.safetensors", env / "b.safetensors"]):
        code, out, err = run_main(capsys, *args)
        assert code == 1 and out == "", (args, out)
        assert err.count("\n") == 1 and err.startswith(f"error: {var}=") and "Traceback" not in err, err


def test_tables_align_in_terminal_cells_and_draw_user_text_safely(env):
    """Tables are aligned columns: in ls every row's SIZE ends where the header's does, and in
    show every BYTES cell too, with wide-character tensor names (2 cells a character); user text
    with control characters is drawn escaped."""
    from rich.cells import cell_len

    save_file({"模型.weight": torch.ones(64, 64), "b": torch.ones(3), "層/偏置": torch.ones(2, 2)}, env / "wide.safetensors")
    for name, msg in (("a", "plain"), ("wide", "bell\x07 and\x1b[2J escape"), ("a-much-longer-ref-name", "")):
        invoke("push", env / ("wide.safetensors" if name == "wide" else "a.safetensors"), name, "-m", msg)

    def right_edges(text, column, cells):
        lines = [line for line in text.splitlines() if line.strip()]
        head = next(i for i, line in enumerate(lines) if line.split()[:1] == [column[0]])
        edge = cell_len(lines[head][: lines[head].index(column[1]) + len(column[1])])
        rows = lines[head + 1 : head + 1 + cells]
        return edge, rows

    edge, rows = right_edges(invoke("ls"), ("REF", "SIZE"), 3)
    assert {r.split()[0] for r in rows} == {"a", "wide", "a-much-longer-ref-name"}
    for row in rows:
        size = " ".join(row.split()[2:4])  # e.g. "64.6 KiB"
        assert cell_len(row[: row.index(size) + len(size)]) == edge
    wide = next(r for r in rows if r.startswith("wide"))
    assert "\x07" not in wide and "\x1b" not in wide and "\\x07" in wide
    edge, rows = right_edges(invoke("show", "wide"), ("TENSOR", "BYTES"), 3)
    assert {r.split()[0] for r in rows} == {"模型.weight", "b", "層/偏置"}
    for row in rows:
        nbytes = " ".join(row.split()[3:5])
        assert cell_len(row[: row.index(nbytes) + len(nbytes)]) == edge, row


def test_show_says_which_file_each_tensor_is_in_when_a_folder_holds_several_models(env):
    """A diffusers-style folder: unet/ and vae/ each hold 'w' and 'b'. show listed 'b', 'w', 'b', 'w'
    with nothing to tell them apart; a FILE column now says which file each is in. A one-folder
    model (shards included) keeps the table it had."""
    pipe = env / "pipe"
    for part, n in (("unet", 2), ("vae", 3)):
        (pipe / part).mkdir(parents=True)
        save_file({"w": torch.ones(n, n), "b": torch.ones(n)}, pipe / part / "diffusion_pytorch_model.safetensors")
    invoke("push", pipe, "sd")
    lines = invoke("show", "sd").splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("TENSOR"))
    assert lines[head].split() == ["TENSOR", "FILE", "DTYPE", "SHAPE", "BYTES", "STORED", "CODEC"]
    assert [line.split()[:3] for line in lines[head + 1 : head + 5]] == [
        ["b", "unet/diffusion_pytorch_model.safetensors", "F32"], ["w", "unet/diffusion_pytorch_model.safetensors", "F32"],
        ["b", "vae/diffusion_pytorch_model.safetensors", "F32"], ["w", "vae/diffusion_pytorch_model.safetensors", "F32"]]
    invoke("push", env / "a.safetensors", "one")
    assert "FILE" not in invoke("show", "one")
