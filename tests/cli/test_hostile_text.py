"""Hostile text through every command that prints it (issue 15 item 8, issue 16 items 5-6).

Anyone who can push to a shared store chooses commit messages, metadata, tensor and
file names; whoever lists the store must not get their screen cleared (CSI), their
clipboard written (OSC 52), their layout broken (newlines) or a crash (rich markup such
as ``fix [/b] typo``). Text output shows such text inert, escaped by ``render.safe``;
``--json`` keeps it exactly. In-process (typer's CliRunner, or ``main()`` for the error
contract), one store built once for the module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import ckpt
from ckpt_store.cli.main import app, main
from ckpt_store.cli.render import safe

# One piece per class of hostile input; HOSTILE has them all.
PIECES = {
    "markup": "fix [/b] typo [red]x[/red] [bold",
    "emoji code": ":smile:",
    "csi": "\x1b[2J\x1b[H",
    "osc52": "\x1b]52;c;aGk=\x07",
    "c1 csi": "\x9b31m",
    "del": "del\x7f",
    "newlines": "two\nlines\r\nthree\ttab",
    "bidi": "\u202eevil\u2066",
    "non-ascii": "ünïcødé 日本 🙂",
}
HOSTILE = " | ".join(PIECES.values())
# What may never reach a terminal: C0 controls except the newline between output lines,
# DEL, C1, line/paragraph separators, bidi overrides and isolates.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# Names push accepts (it refuses control characters in them) but hostile to rich: a tensor
# name, and a file name (no "/" there).
NAME = "[red]x[/red] [/b] é 日本"
FNAME = "[red]x [b] é 日本"  # (":" is refused in a first path component)


def assert_inert(text: str) -> None:
    assert not RAW.search(text), f"raw control character in output: {text!r}"


def assert_shows_hostile(text: str) -> None:
    """The whole hostile text is there, escaped, on one line, with brackets and non-ASCII as typed."""
    assert_inert(text)
    assert safe(HOSTILE) in text
    assert "\\x1b[2J" in text and "\\x1b]52;c;aGk=\\x07" in text and "\\x9b31m" in text and "\\n" in text


def cli(*args: str) -> str:
    r = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def cli_json(*args: str):
    return json.loads(cli(*args, "--json"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    mp = pytest.MonkeyPatch()
    mp.setenv("CKPT_STORE", str(tmp / "store"))
    mp.setenv("CKPT_FSYNC", "0")
    g = torch.Generator().manual_seed(0)
    a = {NAME: torch.randn(16, 16, generator=g), "plain": torch.randn(8, generator=g)}
    b = {NAME: a[NAME] + 1, "plain": a["plain"]}
    single = tmp / f"{FNAME}.safetensors"
    save_file(a, single, metadata={"note": HOSTILE, "[key]": HOSTILE})
    save_file(b, tmp / "b.safetensors")
    model = tmp / "model"
    model.mkdir()
    save_file(b, model / "model.safetensors")
    (model / f"{FNAME}.json").write_text("{}")
    cli("push", str(single), "h/a", "-m", HOSTILE)
    cli("push", str(tmp / "b.safetensors"), "h/a", "-m", HOSTILE)
    cli("push", str(model), "h/dir", "-m", HOSTILE)
    s = ckpt.Store.open(str(tmp / "store"))
    s.push(a, "h/api", HOSTILE, metadata={"note": HOSTILE, "nested": {"list": [HOSTILE, 1.5, None]}})
    cli("merge", "h/a@1", "h/a", "-w", "1,3", "-o", "h/merged", "-m", HOSTILE)
    (tmp / "scores.json").write_text(json.dumps({"h/a@1": 0.4, "h/a": 0.6, "h/api": 0.1}))
    cli("remix", "--scores", str(tmp / "scores.json"), "-k", "2", "-o", "h/remix", "-m", HOSTILE)
    yield tmp
    mp.undo()


@pytest.mark.parametrize("args", [["ls"], ["log", "h/a"], ["show", "h/a"], ["show", "h/api"], ["show", "h/merged"], ["show", "h/remix"]])
def test_messages_and_metadata_are_inert_in_text(store, args):
    out = cli(*args)
    if args == ["ls"]:  # the table cuts a long message at the console width
        assert_inert(out)
        assert safe(HOSTILE)[:60] in out
        return
    assert_shows_hostile(out)
    assert "fix [/b] typo [red]x[/red] [bold" in out and ":smile:" in out and "ünïcødé 日本 🙂" in out


@pytest.mark.parametrize("args", [["ls"], ["log", "h/a"], ["show", "h/a"], ["show", "h/dir"], ["show", "h/merged"], ["show", "h/remix"]])
def test_json_keeps_the_exact_text(store, args):
    doc = cli_json(*args)
    rows = doc if isinstance(doc, list) else [doc]
    assert [r["message"] for r in rows if r.get("message") is not None] and all(r["message"] == HOSTILE for r in rows if r.get("message"))


def test_show_json_round_trips_names_and_metadata(store):
    a = cli_json("show", "h/a@1")
    assert {t["name"] for t in a["tensors"]} == {NAME, "plain"}
    assert a["files"][0]["path"] == f"{FNAME}.safetensors" and a["files"][0]["metadata"] == {"note": HOSTILE, "[key]": HOSTILE}
    d = cli_json("show", "h/dir")
    assert f"{FNAME}.json" in {f["path"] for f in d["files"]}
    api = cli_json("show", "h/api")
    assert api["metadata"] == {"note": HOSTILE, "nested": {"list": [HOSTILE, 1.5, None]}}


def test_show_renders_names_and_nested_values_as_json_not_reprs(store):
    out = cli("show", "h/api")
    assert_inert(out)
    assert f"meta       nested = {safe(json.dumps({'list': [HOSTILE, 1.5, None]}, ensure_ascii=False))}" in out
    assert "None" not in out and "'list'" not in out  # no Python repr
    out = cli("show", "h/a@1")
    assert NAME in out and f"{FNAME}.safetensors" in out and "[key]" in out
    dir_out = cli("show", "h/dir")
    assert f"other files: {FNAME}.json" in dir_out
    assert "merged     linear (normalize=true, weights=[1.0, 3.0])" in cli("show", "h/merged")  # JSON values, not True
    assert "remix    best 2 by score (higher is better): h/a=0.6, h/a@1=0.4" in cli("show", "h/remix")
    assert "lineage    {\"" in cli("show", "h/a") and "'base'" not in cli("show", "h/a")


@pytest.mark.parametrize("args", [["du"], ["verify"], ["gc", "--dry-run"], ["diff", "h/a@1", "h/a"], ["diff", "h/a@1", "h/a", "--sort", "name"]])
def test_names_in_tables_are_inert(store, args):
    out = cli(*args)
    assert_inert(out)
    if args[0] == "diff":
        assert NAME in out
        assert NAME in {t["name"] for t in cli_json(*args)["tensors"]}


def test_diff_of_local_files_with_hostile_names(store):
    out = cli("diff", str(store / f"{FNAME}.safetensors"), str(store / "b.safetensors"), "--no-estimate")
    assert_inert(out)
    assert NAME in out


def test_pull_push_copy_outputs_are_inert(store, tmp_path):
    dest = tmp_path / "out \x1b[2J\x9b [b].safetensors"
    out = cli("pull", "h/a", str(dest))
    assert_inert(out)
    assert "\\x1b[2J\\x9b [b].safetensors" in out
    doc = cli_json("pull", "h/a", str(dest), "--force")
    assert doc["path"] == str(dest) and doc["ref"] == "h/a" and len(doc["id"]) == 64
    out = cli("push", str(store / "b.safetensors"), "h/pushed", "-m", HOSTILE)
    assert_inert(out)
    out = cli("copy", "h/a", "--to", str(tmp_path / "other"))
    assert_inert(out)
    assert cli_json("--store", str(tmp_path / "other"), "ls")[0]["message"] == HOSTILE


def test_errors_naming_hostile_text_are_one_inert_line(store, capsys):
    for args in (["show", HOSTILE], ["log", "\x1b]52;c;aGk=\x07"], ["push", str(store / f"gone {HOSTILE}.safetensors"), "h/x"],
                 ["pull", HOSTILE, str(store / "x.safetensors")], ["rm", "h/\x1b[2J"], ["diff", "h/a", "\x9b31m"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        cap = capsys.readouterr()
        assert e.value.code != 0, args
        assert_inert(cap.err)
        assert cap.err.count("\n") == 1 and cap.err.startswith("error: "), cap.err


def test_push_refuses_control_characters_in_tensor_and_ref_names(store, tmp_path, capsys):
    """Names the ref and manifest grammars forbid are refused with an inert line (so ls/show never meet them)."""
    save_file({"w\x1b[2J": torch.ones(2)}, tmp_path / "bad.safetensors")
    for args in (["push", str(tmp_path / "bad.safetensors"), "h/bad"], ["push", str(store / "b.safetensors"), "h/\x1b[2J"],
                 ["push", str(store / "b.safetensors"), "[red]x"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        cap = capsys.readouterr()
        assert e.value.code == 1 and cap.err.startswith("error: ") and cap.err.count("\n") == 1, cap.err
        assert_inert(cap.err)


def test_usage_errors_echo_arguments_inertly(capsys):
    with pytest.raises(SystemExit) as e:
        main(["\x1b]52;c;aGk=\x07"])
    cap = capsys.readouterr()
    assert e.value.code == 2 and "\\x1b]52;c;aGk=\\x07" in cap.err
    assert_inert(cap.err)


def test_the_installed_command_end_to_end(store):
    """The two crashes of issue 16's report, through the real console script: a markup message made
    `ckpt ls`/`ckpt log` raise MarkupError, and CKPT_WORKERS=abc printed a traceback."""
    exe = Path(sys.executable).parent / "ckpt"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt_store.cli.main"]
    env = {**os.environ, "CKPT_STORE": str(store / "store")}
    r = subprocess.run([*cmd, "log", "h/a"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert_shows_hostile(r.stdout)
    r = subprocess.run([*cmd, "ls"], capture_output=True, text=True, env={**env, "CKPT_WORKERS": "abc"}, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: CKPT_WORKERS='abc' is not a whole number") and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("name, text", PIECES.items())
def test_safe_makes_each_class_inert(name, text):
    shown = safe(text)
    assert not RAW.search(shown) and "\n" not in shown
    if name in ("markup", "emoji code", "non-ascii"):
        assert shown == text  # printable text is left alone


def test_safe_shows_undecodable_bytes_as_bytes():
    assert safe(b"a\x9bb\x1b".decode("utf-8", "surrogateescape")) == "a\\x9bb\\x1b"
    assert safe(None) == "" and safe(3) == "3"


def _lone_surrogates(doc) -> list[str]:
    """Every string in ``doc`` (keys too) that a strict parser rejects: one with a lone surrogate."""
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in _lone_surrogates(k) + _lone_surrogates(v)]
    if isinstance(doc, list):
        return [s for x in doc for s in _lone_surrogates(x)]
    return [doc] if isinstance(doc, str) and re.search("[\ud800-\udfff]", doc) else []


def test_names_that_are_not_utf8_are_strict_json_with_their_exact_bytes(tmp_path):
    """A tensor name from a hostile safetensors header ("\\udcff" escapes), a file name in a model
    folder and a path given in bytes that are not UTF-8 came out of --json as lone surrogate escapes,
    which jq, Go and serde reject, and made the web view's /api/ answer 500. Now every document is
    valid UTF-8: such a name has U+FFFD in place of each bad byte and its exact bytes in NAME_b64."""
    import base64
    import struct

    def header_file(path: bytes, names: list[str]) -> None:
        head = json.dumps({n: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]}
                           for i, n in enumerate(names)}).encode()  # ensure_ascii: "\udcff" escapes
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head + torch.arange(2 * len(names), dtype=torch.float32).numpy().tobytes())

    root = os.fsencode(tmp_path)
    header_file(root + b"/a.safetensors", ["w\udcff", "ok", "x\ud800y"])
    header_file(root + b"/b\xff.safetensors", ["w\udcff", "ok", "x\ud800y"])
    os.mkdir(root + b"/hf")
    header_file(root + b"/hf/model.safetensors", ["k"])
    (tmp_path / "hf/config.json").write_text("{}")
    with open(root + b"/hf/notes\xff.txt", "wb") as f:
        f.write(b"mine")
    env = {**os.environ, "CKPT_STORE": str(tmp_path / "s"), "CKPT_CACHE_DIR": str(tmp_path / "cache")}

    def ckpt_json(*args: bytes | str) -> object:
        exe = Path(sys.executable).parent / "ckpt"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt_store.cli.main"]
        r = subprocess.run([*cmd, *args, "--json"], capture_output=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout.decode("utf-8"))  # strict: raises on bytes that are not UTF-8
        assert _lone_surrogates(doc) == [], _lone_surrogates(doc)
        return doc

    ckpt_json("init")
    ckpt_json("push", root + b"/a.safetensors", "a")
    ckpt_json("push", root + b"/hf", "hf")
    tensors = {t["name"]: t.get("name_b64") for t in ckpt_json("show", "a")["tensors"]}
    assert tensors == {"w\ufffd": base64.b64encode(b"w\xff").decode(), "ok": None,
                       "x\ufffdy": base64.b64encode(b"x\xed\xa0\x80y").decode()}
    files = {f["path"]: f.get("path_b64") for f in ckpt_json("show", "hf")["files"]}
    assert base64.b64decode(files["notes\ufffd.txt"]) == b"notes\xff.txt"
    d = ckpt_json("diff", root + b"/a.safetensors", root + b"/b\xff.safetensors")
    assert base64.b64decode(d["b"]["ref_b64"]) == root + b"/b\xff.safetensors" and "ref_b64" not in d["a"], d
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    client = TestClient(create_app(ckpt.Store.open(str(tmp_path / "s"))))
    for url in ("/api/checkpoint/a", "/api/checkpoint/hf", "/api/diff?a=a&b=hf", "/checkpoint/a"):
        r = client.get(url)
        assert r.status_code == 200, (url, r.text)
        if url.startswith("/api/"):
            assert _lone_surrogates(json.loads(r.content.decode("utf-8"))) == []
    assert [t.get("name_b64") for t in client.get("/api/checkpoint/a").json()["tensors"]] == list(tensors.values())
