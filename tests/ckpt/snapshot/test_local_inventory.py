"""ckpt/snapshot/local_inventory.py: listing and removing local tiers, with real managers and tiers. (The command
line over it: tests/cli/test_cli_tiers.py.)"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

import ckpt
from ckpt.snapshot.local_inventory import local_tiers, remove_tier
from ckpt.snapshot.local_lock import held, taken
from ckpt.snapshot.local_tier import LocalTier


def test_a_manager_waiting_while_its_tier_is_removed_holds_the_folder_made_anew(tmp_path, caplog):
    """`ckpt tiers rm` holds the tier's lock while it removes the folder; a manager started meanwhile waits. It then
    took the lock on the removed folder and wrote into a new one made at the path, unlocked: a second manager
    could take that one beside it (two managers collecting each other's snapshots). It holds the new one now."""
    store = ckpt.Store.init(tmp_path / "store")
    path = str(tmp_path / "tiers" / "run")
    with ckpt.CheckpointManager(store, "run", every_n_steps=1, local=path) as mgr:
        mgr.save(1, {"w": torch.arange(8.0)})
    started: dict[str, object] = {}

    def start() -> None:
        try:
            started["mgr"] = ckpt.CheckpointManager(store, "run", every_n_steps=1, local=path)
        except BaseException as e:  # (said by the assertion below)
            started["error"] = e

    with caplog.at_level(logging.WARNING, logger="ckpt.snapshot.local_lock"), taken(path):
        waiting = threading.Thread(target=start)
        waiting.start()
        deadline = time.monotonic() + 20
        while "waiting for local tier" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "waiting for local tier" in caplog.text
        import shutil

        shutil.rmtree(path)  # as remove_tier does, under the lock
    waiting.join()
    assert "error" not in started, started
    with started["mgr"] as mgr:
        assert held(path) is True  # the folder at the path is the one it holds
        assert mgr.local_tier.steps == []
        mgr.save(2, {"w": torch.ones(8)})
        mgr.wait()
        assert mgr.local_tier.steps == [2]
        with pytest.raises(ckpt.CkptError, match="in use by a CheckpointManager"):
            remove_tier(path, store, force=True)
    assert held(path) is False


def test_a_groups_rank_tiers_are_listed_and_removed_one_by_one_then_their_key_folder(tmp_path):
    """A process group's key folder holds a tier per rank (``KEY/rank-R``): each is listed and removed as one; the
    default key's folder goes with the last (not a folder of the user's holding a rank-0 tier, a local=PATH: review
    rev23l). Tiers that hold no snapshot lose nothing: removed with no store to check."""
    from ckpt.snapshot.local_inventory import user_folder_name

    store = ckpt.Store.init(tmp_path / "store")
    key = tmp_path / "shm" / user_folder_name() / "3f2a9c01b7d4"
    for rank in (0, 1):
        LocalTier(key / f"rank-{rank}", "run", durable=store).close()
    tiers = local_tiers([tmp_path / "shm" / user_folder_name()])
    assert [(t.path, t.kind, t.run, t.steps, t.held) for t in tiers] == [
        (str(key / f"rank-{r}"), "tier", "run", [], False) for r in (0, 1)]
    assert [t.path for t in local_tiers([key])] == [str(key / "rank-0"), str(key / "rank-1")]
    assert [t.path for t in local_tiers([key / "rank-1"])] == [str(key / "rank-1")]  # a tier named itself
    with pytest.raises(ckpt.CkptError, match="one per rank: nothing removed"):
        remove_tier(key, None, force=True)
    assert remove_tier(key / "rank-0", None).path == str(key / "rank-0")
    assert sorted(os.listdir(key)) == ["rank-1"]
    remove_tier(key / "rank-1", None)
    assert not key.exists() and (tmp_path / "shm" / user_folder_name()).is_dir()
    mine = tmp_path / "experiments"  # a local=PATH of a group of one: PATH is the user's, kept (empty)
    LocalTier(mine / "rank-0", "run", durable=store).close()
    remove_tier(mine / "rank-0", None)
    assert mine.is_dir() and not os.listdir(mine)


def test_a_step_is_persisted_only_where_the_durable_store_names_the_same_snapshot(tmp_path):
    """The durable store's newest step NUMBER was taken as the line: a run taken back to step 5 and saving 8 and 9 to
    its tier again (the store still naming the 8 and 9 of the timeline it left, other snapshots) had them counted
    persisted, and `ckpt tiers rm` without --force removed the only copies (review rev23l). A step is persisted where
    the store names the same checkpoint; an older one is superseded there."""
    store = ckpt.Store.init(tmp_path / "store")
    tier = str(tmp_path / "tiers" / "run")
    with ckpt.CheckpointManager(store, "run", every_n_steps=1, local=tier) as mgr:  # 1..10, every one durable
        for step in range(1, 11):
            mgr.save(step, {"w": torch.full((4,), 100.0 + step)})
    [t] = local_tiers([tmp_path / "tiers"], store)
    assert (t.steps, t.unpersisted) == ([9, 10], [])  # (the same snapshots in both)
    with ckpt.CheckpointManager(store, "run", every_n_steps=100, local=tier) as mgr:  # taken back to 5
        for step in (5, 6, 7, 8, 9):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    [t] = local_tiers([tmp_path / "tiers"], store)
    assert (t.steps, t.durable_step, t.unpersisted) == ([8, 9], 10, [8, 9])
    with pytest.raises(ckpt.CkptError, match=r"holds step\(s\) 8, 9 .* not persisted"):
        remove_tier(tier, store)
    assert os.path.isdir(tier)


def test_a_tier_holding_other_checkpoints_or_damaged_refs_is_not_removed_without_force(tmp_path):
    """A checkpoint pushed into a tier while no manager held it, and a damaged step ref (the step may be the tier's
    alone), were dropped silently: listed "persisted", removed without --force (review rev23l)."""
    store = ckpt.Store.init(tmp_path / "store")
    tier = tmp_path / "tiers" / "run"
    with ckpt.CheckpointManager(store, "run", every_n_steps=1, local=str(tier)) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    ckpt.Store.open(str(tier)).push({"w": torch.zeros(4)}, "me/notes")
    [t] = local_tiers([tmp_path / "tiers"], store)
    assert t.others == ["me/notes"] and t.to_json()["persisted"] is False
    with pytest.raises(ckpt.CkptError, match="no snapshot of run 'run': me/notes"):
        remove_tier(tier, store)
    ckpt.Store.open(str(tier)).remove("me/notes")
    [entry] = (tier / "refs" / "run" / "step-1").iterdir()
    entry.chmod(0o644)
    entry.write_bytes(b"{not json")
    [t] = local_tiers([tmp_path / "tiers"], store)
    assert t.error is not None and "run/step-1" in t.error and t.to_json()["persisted"] is None
    with pytest.raises(ckpt.CkptError, match="cannot be told"):
        remove_tier(tier, store)
    assert remove_tier(tier, store, force=True).path == str(tier) and not tier.exists()


def test_a_step_the_durable_store_held_before_retention_pruned_it_is_persisted(tmp_path):
    """Node A's tier keeps steps 9 and 10, both persisted; the job goes on on node B to step 20 and the durable store's
    retention (keep_last=2) prunes step 10 there. Counted by the refs alive, the tier was refused as the only copy
    (review rev23n); the ref's history still names that checkpoint."""
    store = ckpt.Store.init(tmp_path / "d")
    model = torch.nn.Linear(8, 8)
    for node, steps in (("a", range(1, 11)), ("b", range(11, 21))):
        with ckpt.CheckpointManager(store, "run", every_n_steps=5, keep_last=2, local=str(tmp_path / node / "t"),
                                    local_every_n_steps=1) as mgr:
            for step in steps:
                with torch.no_grad():
                    model.weight.add_(1)
                mgr.save(step, {"model": model})
    assert "run/step-10" not in ckpt.Store.open(str(tmp_path / "d")).refs()
    [t] = local_tiers([tmp_path / "a"], store)
    assert (t.steps, t.durable_step, t.unpersisted) == ([9, 10], 20, [])
    assert remove_tier(tmp_path / "a" / "t", store).steps == [9, 10]


def test_the_tiers_latest_below_a_persisted_step_is_not_superseded(tmp_path, monkeypatch):
    """A run persisting step 10 saves step 6 again (a new timeline) and is killed once step 10's persist published,
    before the tier dropped step 10: the tier names 6 (its latest, the tier's alone) and 10 (persisted). Step 6 was
    counted superseded by step 10 and the tier removed without --force (review rev23n). The tier's RUN/latest is
    never superseded; here the state is made as the kill leaves it."""
    store = ckpt.Store.init(tmp_path / "d")
    tier = str(tmp_path / "tiers" / "t")
    model = torch.nn.Linear(8, 8)
    with ckpt.CheckpointManager(store, "run", every_n_steps=5, local=tier, local_every_n_steps=1, local_keep=3) as mgr:
        for step in range(1, 11):
            with torch.no_grad():
                model.weight.add_(1)
            mgr.save(step, {"model": model})
    t = ckpt.Store.open(tier)
    with torch.no_grad():
        model.weight.mul_(-1)
    mid = t.push({"model.weight": model.weight.detach().clone(), "model.bias": model.bias.detach().clone()}, "scratch")
    t.refs_db.set("run/step-6", mid)  # (the new timeline's step 6, and the tier's latest: as the killed run left them)
    t.refs_db.set("run/latest", mid, alias=True)
    t.remove("scratch")
    [info] = local_tiers([tmp_path / "tiers"], store)
    assert 6 in info.unpersisted and 10 not in info.unpersisted
    with pytest.raises(ckpt.CkptError, match=r"holds step\(s\) 6 "):
        remove_tier(tier, store)
