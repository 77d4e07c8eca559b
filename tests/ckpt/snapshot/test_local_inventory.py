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
    key's folder goes with the last. Tiers that hold no snapshot lose nothing: removed with no store to check."""
    store = ckpt.Store.init(tmp_path / "store")
    key = tmp_path / "shm" / "3f2a9c01b7d4"
    for rank in (0, 1):
        LocalTier(key / f"rank-{rank}", "run", durable=store).close()
    tiers = local_tiers([tmp_path / "shm"])
    assert [(t.path, t.kind, t.run, t.steps, t.held) for t in tiers] == [
        (str(key / f"rank-{r}"), "tier", "run", [], False) for r in (0, 1)]
    assert [t.path for t in local_tiers([key])] == [str(key / "rank-0"), str(key / "rank-1")]
    assert [t.path for t in local_tiers([key / "rank-1"])] == [str(key / "rank-1")]  # a tier named itself
    with pytest.raises(ckpt.CkptError, match="one per rank: nothing removed"):
        remove_tier(key, None, force=True)
    assert remove_tier(key / "rank-0", None).path == str(key / "rank-0")
    assert sorted(os.listdir(key)) == ["rank-1"]
    remove_tier(key / "rank-1", None)
    assert not key.exists() and (tmp_path / "shm").is_dir()
