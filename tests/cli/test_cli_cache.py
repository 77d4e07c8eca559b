"""`ckpt cache`, `ckpt cache clear` and `--no-cache` on an S3 store (a real server on loopback)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("botocore")
torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from ckpt_store.cli.main import app  # noqa: E402


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_cache_show_clear_and_no_cache(s3_main_url, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(256, 256), "b": torch.zeros(256)}, src)
    invoke("--store", s3_main_url, "push", str(src), "m")
    assert json.loads(invoke("cache", "--json"))["entries"] == 0  # a push does not fill it

    invoke("--store", s3_main_url, "--no-cache", "pull", "m", str(tmp_path / "a.safetensors"))
    assert json.loads(invoke("cache", "--json"))["entries"] == 0

    invoke("--store", s3_main_url, "pull", "m", str(tmp_path / "b.safetensors"))
    shown = json.loads(invoke("cache", "--json"))
    assert shown["entries"] >= 2 and shown["bytes"] > 256 * 256 * 4 * 0.8 and len(shown["stores"]) == 1
    assert "chunks" in invoke("cache")

    assert "cleared" in invoke("cache", "clear")
    assert json.loads(invoke("cache", "--json"))["entries"] == 0
    assert (tmp_path / "b.safetensors").read_bytes() == src.read_bytes()


def test_json_given_before_cache_clear_is_json(tmp_path, monkeypatch, capsys):
    """`ckpt cache --json clear`: the --json before the subcommand was read by `cache` and dropped,
    and `clear` printed its text to the script that asked for one JSON document."""
    from ckpt_store.cli.main import main

    cache = tmp_path / "cache"
    entry = cache / ("ab" * 16) / "cd" / ("cd" + "0" * 62)
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"x" * 10)
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    for args in (["cache", "--json", "clear"], ["cache", "clear", "--json"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        out = capsys.readouterr().out
        assert e.value.code == 0 and json.loads(out)["dir"] == str(cache), out
    assert not entry.exists()
    with pytest.raises(SystemExit):
        main(["cache", "clear"])
    assert capsys.readouterr().out.startswith("cleared")  # (and without it, text)
