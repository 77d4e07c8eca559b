"""`ckpt tiers` and `ckpt tiers rm`: the local tiers real managers left under a tmp $CKPT_LOCAL_DIR, listed and
freed; a tier a live manager in another process holds; what is never removed (a folder without a marker, a link,
a tier holding steps the durable store lacks, without --force)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
import ckpt  # noqa: E402
from ckpt_store.cli.main import main  # noqa: E402


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``ckpt ARGS`` run as the console script runs it: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    got = capsys.readouterr()
    assert "Traceback" not in got.err, got.err
    return e.value.code, got.out, got.err


def _fresh():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    return model, {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "step": 0}


def _train(store, run: str, steps: list[int]) -> tuple[str, dict[str, bytes]]:
    """A real model and AdamW saved at each of ``steps`` into a local tier (every step) and the durable store (even
    steps), the manager closed; the tier's path and the parameters' bytes at each step."""
    model, state = _fresh()
    seen = {}
    with ckpt.CheckpointManager(store, run, every_n_steps=2, local=True, local_every_n_steps=1, local_keep=2) as mgr:
        for step in steps:
            model(torch.randn(4, 16)).sum().backward()
            state["optim"].step()
            state["optim"].zero_grad()
            state["step"] = step
            mgr.save(step, state)
            mgr.wait()
            seen[step] = {k: v.numpy().tobytes() for k, v in model.state_dict().items()}
        path = mgr.local_tier.path
    return path, seen


def _files(path) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, n), path): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(path) for n in names}


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Two finished runs of one store: "done" (steps 1, 2; 2 persisted) and "fresh" (steps 2, 3 in its tier; 3 only
    there). No default store ($CKPT_STORE unset, $XDG_DATA_HOME empty)."""
    monkeypatch.setenv("CKPT_LOCAL_DIR", str(tmp_path / "shm"))
    monkeypatch.delenv("CKPT_STORE", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    store = ckpt.Store.init(tmp_path / "store")
    done, done_bytes = _train(store, "done", [1, 2])
    fresh, _ = _train(store, "fresh", [1, 2, 3])
    return {"store": str(tmp_path / "store"), "done": done, "fresh": fresh, "done_bytes": done_bytes,
            "user": str(tmp_path / "shm" / f"ckpt-local-{os.getuid()}")}


def _mine(doc, runs):
    return {r["path"]: r for r in doc["tiers"] if r["path"].startswith(runs["user"])}


def test_tiers_lists_steps_bytes_held_and_what_is_not_persisted(runs, capsys):
    code, out, _ = cli(capsys, "--store", runs["store"], "tiers", "--json")
    doc = json.loads(out)
    assert code == 0 and runs["user"] in doc["dirs"] and doc["store"] == runs["store"]
    rows = _mine(doc, runs)
    assert set(rows) == {runs["done"], runs["fresh"]}
    done, fresh = rows[runs["done"]], rows[runs["fresh"]]
    assert (done["kind"], done["run"], done["steps"], done["held"], done["durable_step"], done["persisted"],
            done["unpersisted_steps"]) == ("tier", "done", [1, 2], False, 2, True, [])
    assert (fresh["run"], fresh["steps"], fresh["durable_step"], fresh["persisted"], fresh["unpersisted_steps"]) == \
        ("fresh", [2, 3], 2, False, [3])
    for r in (done, fresh):  # du's count of the folder, in bytes
        assert r["bytes"] == int(subprocess.run(["du", "-s", "-B1", r["path"]], capture_output=True, text=True,
                                                check=True).stdout.split()[0])
        assert r["store_id"] == ckpt.Store.open(runs["store"]).config.store_id and r["error"] is None

    # Without the run's store (none named, no default store): listed, persisted not known.
    code, out, _ = cli(capsys, "tiers", "--json")
    rows = _mine(json.loads(out), runs)
    assert code == 0 and rows[runs["fresh"]]["persisted"] is None and rows[runs["fresh"]]["steps"] == [2, 3]
    assert rows[runs["fresh"]]["durable_step"] is None
    code, out, _ = cli(capsys, "--store", runs["store"], "tiers")
    line = next(line for line in out.splitlines() if line.startswith(runs["fresh"]))
    assert code == 0 and "fresh" in line and "NO: 3" in line and " no " in line  # (not held)
    # --dir: the parent of a local=PATH, and a root holding ckpt-local-UID.
    for d in (runs["user"], os.path.dirname(runs["user"])):
        code, out, _ = cli(capsys, "tiers", "--dir", d, "--json")
        assert code == 0 and {r["path"] for r in json.loads(out)["tiers"]} == {runs["done"], runs["fresh"]}


def test_rm_frees_a_persisted_tier_and_the_next_manager_restores_from_the_store(runs, capsys):
    code, out, _ = cli(capsys, "--store", runs["store"], "tiers", "rm", runs["done"], "--json")
    doc = json.loads(out)
    assert code == 0 and doc["refused"] == [] and "error" not in doc
    assert [(r["path"], r["run"], r["steps"], r["persisted"]) for r in doc["removed"]] == [(runs["done"], "done", [1, 2], True)]
    assert doc["removed"][0]["bytes"] > 0 and not os.path.lexists(runs["done"]) and os.path.isdir(runs["fresh"])
    code, out, _ = cli(capsys, "tiers", "--json")
    assert set(_mine(json.loads(out), runs)) == {runs["fresh"]}

    with ckpt.CheckpointManager(ckpt.Store.open(runs["store"]), "done", every_n_steps=2, local=True) as mgr:
        assert mgr.local_tier.path == runs["done"] and mgr.local_tier.steps == []
        model, state = _fresh()
        assert mgr.restore_latest(state) == 2
        assert mgr.last_restore["local"] == 0 and mgr.last_restore["store"] > 0
        assert {k: v.numpy().tobytes() for k, v in model.state_dict().items()} == runs["done_bytes"][2]


def test_rm_refuses_a_tier_not_persisted_unless_forced(runs, capsys):
    before = _files(runs["fresh"])
    code, out, err = cli(capsys, "--store", runs["store"], "tiers", "rm", runs["fresh"])
    assert code == 1 and out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert "step(s) 3" in err and "not persisted" in err and "--force" in err
    code, out, err = cli(capsys, "tiers", "rm", runs["fresh"], "--json")  # no store given: cannot be told
    doc = json.loads(out)
    assert code == 1 and doc["removed"] == [] and "--store" in doc["error"] and doc["refused"][0]["path"] == runs["fresh"]
    assert _files(runs["fresh"]) == before  # intact

    code, out, _ = cli(capsys, "--store", runs["store"], "tiers", "rm", "--force", runs["fresh"])
    assert code == 0 and out.startswith(f"removed {runs['fresh']}") and not os.path.lexists(runs["fresh"])


def test_rm_never_removes_a_folder_that_is_not_a_tier_nor_follows_a_link(runs, tmp_path, capsys):
    user = runs["user"]
    mine = os.path.join(user, "mine")
    os.makedirs(os.path.join(mine, "sub"))
    with open(os.path.join(mine, "sub", "notes.txt"), "w") as f:
        f.write("mine")
    damaged = os.path.join(user, "damaged")
    os.makedirs(damaged)
    with open(os.path.join(damaged, "ckpt-local-tier.json"), "w") as f:
        f.write('{"run": 1')
    to_tier, to_mine = os.path.join(user, "to-tier"), str(tmp_path / "to-mine")
    os.symlink(runs["done"], to_tier)
    os.symlink(mine, to_mine)
    before = {p: _files(p) for p in (mine, damaged, runs["done"])}

    code, out, _ = cli(capsys, "--store", runs["store"], "tiers", "--json")
    kinds = {r["path"]: r["kind"] for r in _mine(json.loads(out), runs).values()}
    assert kinds == {runs["done"]: "tier", runs["fresh"]: "tier", mine: "unmarked", damaged: "damaged", to_tier: "link"}
    for path, why in ((mine, "holds no ckpt-local-tier.json"), (damaged, "is damaged"), (to_tier, "is a link"),
                      (to_mine, "is a link"), (to_mine + "/", "is a link")):
        code, out, err = cli(capsys, "--store", runs["store"], "tiers", "rm", "--force", path)
        assert code == 1 and out == "" and why in err and err.count("\n") == 1, err
    for p, files in before.items():
        assert _files(p) == files
    assert os.path.islink(to_tier) and os.path.islink(to_mine)
    # --all removes tiers only (the persisted one; the other is refused), never what is not one.
    code, out, err = cli(capsys, "--store", runs["store"], "tiers", "rm", "--all", "--dir", user, "--json")
    doc = json.loads(out)
    assert code == 1 and [r["path"] for r in doc["removed"]] == [runs["done"]]
    assert [r["path"] for r in doc["refused"]] == [runs["fresh"]] and "not persisted" in err
    assert _files(mine) == before[mine] and _files(damaged) == before[damaged] and os.path.islink(to_tier)


HOLDER = textwrap.dedent("""
    import sys, torch, ckpt
    store = ckpt.Store.open(sys.argv[1])
    mgr = ckpt.CheckpointManager(store, "live", every_n_steps=1, local=True)
    mgr.save(1, {"w": torch.arange(8.0)})
    mgr.wait()
    print(mgr.local_tier.path, flush=True)
    sys.stdin.read()  # held until the test closes stdin
    mgr.close()
""")


def test_rm_refuses_a_tier_a_live_manager_holds(runs, capsys):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, runs["store"]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=os.environ.copy())
    try:
        path = p.stdout.readline().strip()
        assert path.startswith(runs["user"]), path
        before = _files(path)
        code, out, _ = cli(capsys, "--store", runs["store"], "tiers", "--json")
        row = _mine(json.loads(out), runs)[path]
        assert (row["run"], row["steps"], row["held"], row["persisted"]) == ("live", [1], True, True)
        code, out, err = cli(capsys, "--store", runs["store"], "tiers", "rm", "--force", path)
        assert code == 1 and "in use by a CheckpointManager" in err and err.count("\n") == 1
        assert _files(path) == before
    finally:
        p.stdin.close()
        assert p.wait(timeout=60) == 0
    code, out, _ = cli(capsys, "--store", runs["store"], "tiers", "rm", path)
    assert code == 0 and not os.path.lexists(path)


def test_rm_without_a_tier_named_is_a_usage_error(runs, capsys):
    code, out, err = cli(capsys, "tiers", "rm", "--json")
    assert code == 2 and "--all" in json.loads(out)["error"]
    code, out, err = cli(capsys, "tiers", "rm", "--all", runs["done"])
    assert code == 2 and "not both" in err and os.path.isdir(runs["done"])


def test_a_tier_whose_steps_cannot_be_read_is_named_and_removed_only_with_force(runs, capsys):
    marker = os.path.join(runs["done"], "ckpt-local-tier.json")
    with open(marker) as f:
        have = json.load(f)
    with open(marker, "w") as f:
        json.dump({**have, "run": "no//such run\x1b[2J"}, f)  # (no ref name: its steps cannot be listed)
    code, out, err = cli(capsys, "--store", runs["store"], "tiers")
    assert code == 1 and "\x1b" not in out + err and runs["done"] in err  # named on stderr, as ls names damage
    code, out, _ = cli(capsys, "--store", runs["store"], "tiers", "--json")
    row = _mine(json.loads(out), runs)[runs["done"]]
    assert code == 1 and row["kind"] == "tier" and row["error"] and row["persisted"] is None
    code, out, err = cli(capsys, "--store", runs["store"], "tiers", "rm", runs["done"])
    assert code == 1 and "cannot be told" in err and os.path.isdir(runs["done"])
    code, out, _ = cli(capsys, "--store", runs["store"], "tiers", "rm", "--force", runs["done"])
    assert code == 0 and not os.path.lexists(runs["done"])
