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
