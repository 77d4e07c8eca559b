"""Every ``ckpt`` command on an S3 store, through the real console script, against a local S3 server.

Credentials and endpoint come the standard way (AWS_* environment variables), or from
``--storage-option``; the secret must never appear in anything ckpt prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")
torch = pytest.importorskip("torch")
from s3support import KEY, SECRET  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

EXE = Path(sys.executable).parent / "ckpt"
CMD = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "cli.main"]


class Cli:
    """Runs ``ckpt`` in this process (main(), fast) or as the console script in a subprocess (slow)."""

    def __init__(self, mode: str, env: dict[str, str], capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
        self.mode, self.env, self.capsys, self.monkeypatch = mode, env, capsys, monkeypatch

    def __call__(self, *args: str | Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        env = self.env if env is None else env
        argv = [str(a) for a in args]
        if self.mode == "subprocess":
            r = subprocess.run([*CMD, *argv], capture_output=True, text=True, env=env, timeout=180)
            code, out, err = r.returncode, r.stdout, r.stderr
        else:
            from ckpt_store.cli.main import main

            with self.monkeypatch.context() as m:
                for k in [k for k in os.environ if k not in env]:
                    m.delenv(k)
                for k, v in env.items():
                    m.setenv(k, v)
                self.capsys.readouterr()
                try:
                    main(argv)
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
                out, err = self.capsys.readouterr()
        assert SECRET not in out and SECRET not in err, "the secret leaked into the output"
        return code, out, err

    def ok(self, *args: str | Path, env: dict[str, str] | None = None) -> str:
        code, out, err = self(*args, env=env)
        assert code == 0, f"ckpt {' '.join(map(str, args))} exited {code}\n{out}\n{err}"
        assert "Traceback" not in err, err
        return out

    def json(self, *args: str | Path, env: dict[str, str] | None = None) -> Any:
        return json.loads(self.ok(*args, "--json", env=env))

    def fails(self, *args: str | Path, env: dict[str, str] | None = None) -> str:
        code, out, err = self(*args, env=env)
        assert code != 0, out
        assert "Traceback" not in err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), err
        return lines[0]


@pytest.fixture
def env(s3_main, tmp_path) -> dict[str, str]:
    e = dict(os.environ)
    e.pop("CKPT_STORE", None)
    e.update(HOME=str(tmp_path / "home"), AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
             AWS_ENDPOINT_URL=s3_main.endpoint, CKPT_RETRY_DELAY="0.02", COLUMNS="200")
    return e


@pytest.fixture(params=["in-process", pytest.param("subprocess", marks=pytest.mark.slow)])
def ckpt_cli(request, env, capsys, monkeypatch) -> Cli:
    return Cli(request.param, env, capsys, monkeypatch)


@pytest.fixture
def files(tmp_path) -> tuple[Path, Path, Path]:
    g = torch.Generator().manual_seed(0)
    base = {"embed.weight": torch.randn(256, 256, generator=g), "layers.0.weight": torch.randn(256, 256, generator=g).bfloat16()}
    ft = {k: (v.float() + 1e-3 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in base.items()}
    save_file(base, str(tmp_path / "base.safetensors"), metadata={"format": "pt"})
    save_file(ft, str(tmp_path / "ft.safetensors"), metadata={"format": "pt"})
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"lm_head.weight": torch.randn(64, 32, generator=g)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"hidden_size": 32}))
    return tmp_path / "base.safetensors", tmp_path / "ft.safetensors", hf


def test_every_command_on_s3(s3_main, ckpt_cli, files, tmp_path):
    c = ckpt_cli
    base, ft, hf = files
    url = f"s3://{s3_main.new_bucket()}/team/store"
    s = ["--store", url]
    assert url in c.ok(*s, "init")
    p1 = c.json(*s, "push", base, "m/base", "-m", "base")
    p2 = c.json(*s, "push", ft, "m/ft", "-m", "ft")
    assert 0 < p2["written_bytes"] < p1["written_bytes"]  # stored as a delta against m/base
    c.json(*s, "push", hf, "m/hf")
    assert {r["ref"] for r in c.json(*s, "ls")} == {"m/base", "m/ft", "m/hf"}
    assert c.json(*s, "log", "m/ft")[0]["message"] == "ft"
    assert c.json(*s, "show", "m/ft")["lineage"]["base"] == p1["id"]
    assert c.json(*s, "du")["logical_bytes"] > 0
    assert c.json(*s, "verify")["ok"] is True
    c.ok(*s, "pull", "m/ft", tmp_path / "ft-out.safetensors")
    assert (tmp_path / "ft-out.safetensors").read_bytes() == ft.read_bytes()
    c.ok(*s, "pull", "m/hf", tmp_path / "hf-out")
    assert (tmp_path / "hf-out" / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    c.ok(*s, "rm", "m/hf")
    gc = c.json(*s, "gc", "--grace", "0s")
    assert gc["deleted"] > 0 and gc["live_manifests"] == 2
    assert c.json(*s, "verify")["ok"] is True
    assert "m/hf" in c.fails(*s, "pull", "m/hf", tmp_path / "gone.safetensors")

    # copy S3 -> local; then a fine-tune of a base already there costs about its delta
    local = tmp_path / "local"
    c1 = c.json(*s, "copy", "m/base", "--to", local)
    assert c1["refs"] == {"m/base": p1["id"]} and c1["chunks_sent"] > 0
    c2 = c.json("copy", "m/ft", "--from", url, "--to", local)
    assert c2["chunks_present"] > 0 and c2["bytes_sent"] < c1["bytes_sent"]
    assert c.json("copy", "m/ft", "m/base", "--from", url, "--to", local)["objects_sent"] == 0
    assert "sent 0 chunks" in c.ok("copy", "m/ft", "--from", url, "--to", local)
    # local -> S3 under another name, and push/pull between stores
    other = f"s3://{s3_main.new_bucket()}/x"
    c3 = c.json("--store", local, "push", "m/ft", "copied/ft", "--to", other)
    assert c3["refs"] == {"copied/ft": p2["id"]}
    c.ok("--store", tmp_path / "laptop", "pull", "copied/ft", tmp_path / "via-pull.safetensors", "--from", other)
    assert (tmp_path / "via-pull.safetensors").read_bytes() == ft.read_bytes()
    assert c.json("--store", tmp_path / "laptop", "verify")["ok"] is True
    c.ok("--store", tmp_path / "laptop2", "pull", "copied/ft", "--from", other)  # no DEST: only the copy
    assert c.json("--store", tmp_path / "laptop2", "ls")[0]["ref"] == "copied/ft"


def test_storage_options_on_the_command_line(s3_main, ckpt_cli, env, files):
    base, _, _ = files
    e = {k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_EC2_METADATA_DISABLED"}
    url = f"s3://{s3_main.new_bucket()}/s"
    opts = ["--storage-option", f"endpoint_url={s3_main.endpoint}", "--storage-option", f"key={KEY}", "--storage-option", f"secret={SECRET}",
            "--storage-option", "config_kwargs.connect_timeout=3"]
    ckpt_cli.ok("--store", url, *opts, "push", base, "m/base", env=e)
    assert [r["ref"] for r in ckpt_cli.json("--store", url, *opts, "ls", env=e)] == ["m/base"]


@pytest.fixture
def second_s3(tmp_path):
    """A second S3 server (moto, on its own port): another site's, with its own endpoint."""
    from s3support import start_server

    (tmp_path / "second-s3").mkdir()
    server = start_server("moto", tmp_path / "second-s3")
    yield server
    server.stop()


def test_copy_between_two_s3_servers(s3_main, second_s3, ckpt_cli, env, files, tmp_path):
    """A copy between stores on two S3 servers could not be said: --storage-option (or
    AWS_ENDPOINT_URL) applies to both stores, so the destination's endpoint was the source's.
    --from-option and --to-option give each store its own, over --storage-option; and one URL
    on two servers is two stores, not "the same store"."""
    from s3support import client

    base, ft, _ = files
    e = {k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"}  # keys in the environment, endpoints per store
    url = f"s3://{s3_main.new_bucket()}/s"
    client(second_s3.endpoint).create_bucket(Bucket=url[5:].split("/")[0])  # the same bucket name there
    here, there = [f"endpoint_url={s3_main.endpoint}"], [f"endpoint_url={second_s3.endpoint}"]
    common = ["--storage-option", "config_kwargs.connect_timeout=3"]
    ckpt_cli.ok("--store", url, "--storage-option", here[0], "push", base, "m/base", env=e)
    ckpt_cli.ok("--store", url, "--storage-option", here[0], "push", ft, "m/ft", env=e)
    doc = ckpt_cli.json(*common, "copy", "m/ft", "m/base:mirror/base", "--from", url, "--from-option", here[0],
                        "--to", url, "--to-option", there[0], env=e)
    assert doc["refs_set"] == 2 and doc["chunks_sent"] > 0
    s = ["--store", url, "--storage-option", there[0]]
    assert sorted(r["ref"] for r in ckpt_cli.json(*s, "ls", env=e)) == ["m/ft", "mirror/base"]
    assert ckpt_cli.json(*s, "verify", env=e)["ok"] is True
    out = tmp_path / "ft-there.safetensors"
    ckpt_cli.ok(*s, "pull", "m/ft", out, env=e)
    assert out.read_bytes() == ft.read_bytes()
    # A per-store option on a local folder is refused, as --storage-option is where it would be dropped.
    code, _, err = ckpt_cli("copy", "m/ft", "--from", url, "--from-option", here[0], "--to", tmp_path / "local",
                            "--to-option", there[0], env=e)
    assert code == 2 and "--to-option" in err and "local" in err and not (tmp_path / "local").exists(), err


def test_copy_to_the_same_s3_store_spelled_with_a_trailing_slash_is_refused(s3_main, ckpt_cli, env, files):
    """`ckpt copy --from s3://bkt/st --to s3://bkt/st/` (or `s3://bkt//st`): the check compared the URLs as
    typed, so one store was copied onto itself. The stores' URLs, as opened, are compared."""
    base, _, _ = files
    url = f"s3://{s3_main.new_bucket()}/st"
    ckpt_cli.ok("--store", url, "push", base, "m/base")
    bucket, prefix = url[5:].split("/")
    for to in (url + "/", url + "//", f"s3://{bucket}//{prefix}"):
        code, _, err = ckpt_cli("copy", "m/base:m/again", "--from", url, "--to", to)
        assert code == 2 and "same store" in err, (to, code, err)
    assert [r["ref"] for r in ckpt_cli.json("--store", url, "ls")] == ["m/base"]


def test_push_to_and_pull_from_a_second_s3_server(s3_main, second_s3, ckpt_cli, env, files, tmp_path):
    """`ckpt push REF --to URL` and `ckpt pull REF --from URL` took no options of their own, so the
    other store was opened with --store's (--storage-option, AWS_ENDPOINT_URL): a second S3 server
    could not be named. --to-option and --from-option are copy's, for the one store they name."""
    from s3support import client

    base, ft, _ = files
    e = {k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"}  # keys in the environment, endpoints per store
    url = f"s3://{s3_main.new_bucket()}/s"
    client(second_s3.endpoint).create_bucket(Bucket=url[5:].split("/")[0])  # the same bucket name there
    here, there = f"endpoint_url={s3_main.endpoint}", f"endpoint_url={second_s3.endpoint}"
    s = ["--store", url, "--storage-option", here]
    ckpt_cli.ok(*s, "push", ft, "m/ft", env=e)
    doc = ckpt_cli.json(*s, "push", "m/ft", "mirror/ft", "--to", url, "--to-option", there, env=e)
    assert doc["refs_set"] == 1 and doc["chunks_sent"] > 0
    assert [r["ref"] for r in ckpt_cli.json("--store", url, "--storage-option", there, "ls", env=e)] == ["mirror/ft"]
    laptop = tmp_path / "laptop"
    out = tmp_path / "ft-pulled.safetensors"
    ckpt_cli.ok("--store", laptop, "pull", "mirror/ft", out, "--from", url, "--from-option", there, env=e)
    assert out.read_bytes() == ft.read_bytes()
    assert ckpt_cli.json("--store", laptop, "verify", env=e)["ok"] is True
    # Without the URL they are for, the options would be dropped: a usage error, nothing done.
    code, _, err = ckpt_cli(*s, "push", base, "m/base", "--to-option", there, env=e)
    assert code == 2 and "--to-option" in err, err
    code, _, err = ckpt_cli(*s, "pull", "m/ft", tmp_path / "x.safetensors", "--from-option", there, env=e)
    assert code == 2 and "--from-option" in err and not (tmp_path / "x.safetensors").exists(), err
    assert [r["ref"] for r in ckpt_cli.json(*s, "ls", env=e)] == ["m/ft"]


def test_verify_repair_from_s3_honours_storage_options(s3_main, ckpt_cli, env, files, tmp_path):
    """`verify --repair-from s3://...` opened the source without --storage-option: with the endpoint
    and credentials given only that way (as the docs show for every command), the repair failed
    ("no S3 credentials found") and the damaged store stayed damaged."""
    base, _, _ = files
    e = {k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_EC2_METADATA_DISABLED"}
    url = f"s3://{s3_main.new_bucket()}/s"
    opts = ["--storage-option", f"endpoint_url={s3_main.endpoint}", "--storage-option", f"key={KEY}",
            "--storage-option", f"secret={SECRET}"]
    ckpt_cli.ok("--store", url, *opts, "push", base, "m", env=e)
    local = tmp_path / "local"
    ckpt_cli.ok("--store", local, "push", base, "m", env=e)
    chunks = sorted((local / "objects" / "chunks").rglob("*"))
    victim = next(p for p in chunks if p.is_file())
    victim.unlink()
    ckpt_cli("--store", local, "verify", env=e)
    doc = ckpt_cli.json("--store", local, *opts, "verify", "--repair-from", url, env=e)
    assert doc["ok"] is True and victim.exists()


def test_verify_repairs_from_a_mirror_on_a_second_s3_server(s3_main, second_s3, ckpt_cli, env, files, tmp_path):
    """`verify --repair-from URL` opened the mirror with --store's options: a mirror on another S3
    server (another endpoint) could not be named, and the damaged store stayed damaged.
    --repair-option gives the mirror's own options, as --from-option does for copy."""
    from s3support import client

    base, _, _ = files
    e = {k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"}
    url = f"s3://{s3_main.new_bucket()}/s"
    client(second_s3.endpoint).create_bucket(Bucket=url[5:].split("/")[0])  # the same bucket name there
    there = f"endpoint_url={second_s3.endpoint}"
    ckpt_cli.ok("--store", url, "--storage-option", there, "push", base, "m", env=e)  # the mirror
    local = tmp_path / "local"
    ckpt_cli.ok("--store", local, "push", base, "m", env=e)
    victim = next(p for p in sorted((local / "objects" / "chunks").rglob("*")) if p.is_file())
    victim.unlink()
    code, _, err = ckpt_cli("--store", local, "verify", "--repair-option", there, env=e)
    assert code == 2 and "--repair-option" in err and not victim.exists(), err  # no mirror named: nothing done
    doc = ckpt_cli.json("--store", local, "verify", "--repair-from", url, "--repair-option", there, env=e)
    assert doc["ok"] is True and victim.exists()
    assert ckpt_cli.json("--store", local, "verify", env=e)["ok"] is True


def test_storage_options_for_a_command_on_local_stores_only_are_refused(s3_main, ckpt_cli, env, files, tmp_path,
                                                                          monkeypatch):
    """`--store team/store --storage-option endpoint_url=...` (s3:// forgotten) pushed into a local
    folder ./team/store and said nothing of the options it dropped: the team's store never saw the
    checkpoint. Options where every store a command names is a local folder are a usage error,
    and nothing is created; with an S3 store among them (copy, pull --from) they apply as before."""
    base, _, _ = files
    monkeypatch.chdir(tmp_path)
    e = {k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_EC2_METADATA_DISABLED"}
    opts = ["--storage-option", f"endpoint_url={s3_main.endpoint}", "--storage-option", f"key={KEY}",
            "--storage-option", f"secret={SECRET}"]
    for before, after in ((["--store", "team/store"], ["push", base, "m"]), (["--store", "team/store"], ["init"]),
                          ([], ["copy", "m", "--from", tmp_path / "a", "--to", tmp_path / "b"])):
        code, _, err = ckpt_cli(*before, *opts, *after, env=e)
        assert code == 2 and "--storage-option" in err and "local" in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in files[:2]) + ["hf"]
    url = f"s3://{s3_main.new_bucket()}/s"
    ckpt_cli.ok("--store", url, *opts, "push", base, "m", env=e)
    ckpt_cli.ok("--store", tmp_path / "laptop", *opts, "pull", "m", tmp_path / "out.safetensors", "--from", url, env=e)
    assert (tmp_path / "out.safetensors").read_bytes() == base.read_bytes()


def test_init_honours_storage_options(s3_main, ckpt_cli, env):
    """`init` opens the store with --storage-option like every other command (it ignored them before)."""
    e = {k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_EC2_METADATA_DISABLED"}
    url = f"s3://{s3_main.new_bucket()}/fresh"
    opts = ["--storage-option", f"endpoint_url={s3_main.endpoint}", "--storage-option", f"key={KEY}",
            "--storage-option", f"secret={SECRET}"]
    assert ckpt_cli.json("--store", url, *opts, "init", env=e) == {"url": url, "created": True}
    assert ckpt_cli.json("--store", url, *opts, "init", env=e) == {"url": url, "created": False}
    assert ckpt_cli.json("--store", url, *opts, "ls", env=e) == []


def test_bad_endpoint_error_never_shows_the_secret(ckpt_cli, env):
    e = {k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"}
    e["CKPT_RETRIES"] = "1"
    t = time.monotonic()
    line = ckpt_cli.fails("--store", "s3://bucket/x", "--storage-option", "endpoint_url=http://127.0.0.1:1",
                          "--storage-option", f"secret={SECRET}", "--storage-option", f"key={KEY}", "ls", env=e)
    assert time.monotonic() - t < 30
    assert "127.0.0.1:1" in line and "failed 2 times" in line
    # with the secret in the environment instead
    line = ckpt_cli.fails("--store", "s3://bucket/x", "ls", env={**e, "AWS_ENDPOINT_URL": "http://127.0.0.1:1"})
    assert "127.0.0.1:1" in line


def test_an_endpoint_that_is_no_s3_server_is_one_line(ckpt_cli, env, files):
    """AWS_ENDPOINT_URL naming a web server (404 and HTML to everything): `init` and `push` ended in
    a traceback (FileNotFoundError from the listing of the store's prefix). One answering 200 with
    a page to everything: "store config ckpt-store.json is not valid JSON", naming neither the
    store nor the endpoint, as if the store were damaged."""
    from s3support import web_server

    base, _, _ = files
    with web_server(404) as url:
        e = {**env, "AWS_ENDPOINT_URL": url, "CKPT_RETRIES": "1"}
        for args in (["init"], ["push", base, "m"]):
            line = ckpt_cli.fails("--store", "s3://bucket/s", *args, env=e)
            assert "404" in line and url in line and "s3://bucket/s" in line
    with web_server(200) as url:  # a page for every request: its HTML is read as the store's config
        e = {**env, "AWS_ENDPOINT_URL": url, "CKPT_RETRIES": "1"}
        for args in (["init"], ["ls"], ["push", base, "m"]):
            line = ckpt_cli.fails("--store", "s3://bucket/s", *args, env=e)
            assert "s3://bucket/s" in line and "endpoint" in line, line  # not only "ckpt-store.json is not valid JSON"


def test_a_profile_that_does_not_exist_is_one_line(ckpt_cli, env):
    """AWS_PROFILE or --storage-option profile= naming no profile: a ProfileNotFound traceback."""
    assert "nosuch" in ckpt_cli.fails("--store", "s3://bucket/s", "ls", env={**env, "AWS_PROFILE": "nosuch"})
    assert "nosuch" in ckpt_cli.fails("--store", "s3://bucket/s", "--storage-option", "profile=nosuch", "ls")


def test_credentials_in_the_store_url_are_never_shown(ckpt_cli, env, files):
    """s3://KEY:SECRET@bucket/x (as some tools take them) was echoed in botocore's "Invalid bucket name
    ..." message, the secret twice; it is refused, naming what to use instead, the secret unshown
    (Cli checks that it appears in no output)."""
    for args in (["ls"], ["push", files[0], "m"], ["init", "--json"]):
        line = ckpt_cli.fails("--store", f"s3://{KEY}:{SECRET}@bucket/x", *args)
        assert "no credentials" in line and "AWS_ACCESS_KEY_ID" in line and KEY not in line
    assert "not a bucket name" in ckpt_cli.fails("--store", "s3://my bucket/x", "ls")


def test_bad_storage_option_is_a_usage_error(ckpt_cli):
    code, _, err = ckpt_cli("--store", "s3://b/x", "--storage-option", f"no-equals-sign-{SECRET}", "ls")
    assert code == 2 and "KEY=VALUE" in err and SECRET not in err


@pytest.mark.parametrize("pairs", [["config_kwargs.connect_timeout=5", "config_kwargs=3"],
                                   ["config_kwargs=3", "config_kwargs.connect_timeout=5"]])
def test_an_option_given_as_a_group_and_as_a_value_is_a_usage_error_in_either_order(ckpt_cli, pairs):
    """`--storage-option config_kwargs.connect_timeout=5 --storage-option config_kwargs=3`: the value
    silently replaced the group, and the store failed to open with "'int' object is not iterable";
    the other order was already refused as a usage error naming the option."""
    args = [a for p in pairs for a in ("--storage-option", p)]
    code, _, err = ckpt_cli("--store", "s3://b/x", *args, "ls")
    assert code == 2 and "config_kwargs is both a value and a group" in err, err


@pytest.mark.slow  # (3-5 s: CI time, run by .ci/run's slow pass)
def test_a_second_interrupt_ends_a_pull_that_a_stalled_server_holds(s3_main, env, tmp_path):
    """The server stops answering in the middle of a `pull --force` (its connections open). The first
    Ctrl-C waits for the requests in flight, which read timeouts and retries hold for minutes (a pull
    was still running 600 s after Ctrl-C). A second Ctrl-C ends it at once: 130, a line saying so, the
    file it would have replaced as it was and no temporary left beside it."""
    import signal

    from s3support import FaultProxy

    g = torch.Generator().manual_seed(3)
    src = tmp_path / "src.safetensors"
    save_file({f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}, str(src))  # 24 MB: 6 chunks
    url = f"s3://{s3_main.new_bucket()}/s"
    cli = [sys.executable, "-c", "from ckpt_store.cli.main import main; main()", "--store", url]
    subprocess.run([*cli, "push", str(src), "m"], env=env, check=True, capture_output=True, timeout=120)
    host, port = s3_main.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port))).start()
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "model.safetensors").write_bytes(b"precious")
    proc = None
    try:
        proxy.stall_after = 300_000  # the ref and manifest come, then a few chunk bytes, then nothing
        proc = subprocess.Popen([*cli, "pull", "m", str(dest / "model.safetensors"), "--force"], text=True,
                                env={**env, "AWS_ENDPOINT_URL": proxy.endpoint, "CKPT_CACHE": "0"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while proxy.bytes_down < proxy.stall_after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        time.sleep(1.5)
        assert proc.poll() is None  # the first interrupt waits for the stalled requests
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 10
        assert proc.returncode == 130 and out == "" and "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith("interrupted again: stopped at once"), err
        assert os.listdir(dest) == ["model.safetensors"] and (dest / "model.safetensors").read_bytes() == b"precious"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        proxy.stop()
