"""The local tier's own rules (ckpt/snapshot/local_tier.py, local_paths.py): whose tier a default path is, what
a tier refuses and says, and a save that cannot fit. Real S3 servers, a real tmpfs, a real model and optimizer."""

from __future__ import annotations

import uuid
import warnings

import torch

import ckpt


def _train(mgr, steps, seed=0):
    """A real model and AdamW, one step each of ``steps``, each saved by ``mgr``; the parameters' bytes."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt, "step": 0}
    for step in steps:
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        state["step"] = step
        mgr.save(step, state)
    mgr.wait()
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}


def _fresh():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    return model, {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3), "step": 0}


def test_one_bucket_on_two_endpoints_has_two_default_tiers(tmp_path, monkeypatch, s3_servers):
    """s3://BUCKET/store on two S3 servers is two stores. The default tier's key hashed the URL alone: both
    runs got one tier, and the second manager emptied the first one's as another store's (so the first run's
    restart found nothing local). Each has its own tier now; the first restarts from its tier, zero bytes
    read from its durable store."""
    from s3support import KEY, SECRET, client, start_server

    monkeypatch.setenv("CKPT_LOCAL_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    first = s3_servers.get("moto")
    (tmp_path / "second").mkdir()
    second = start_server("moto", tmp_path / "second")
    try:
        bucket = f"t-{uuid.uuid4().hex[:16]}"
        for server in (first, second):
            client(server.endpoint).create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/store"
        stores = [ckpt.Store.init(url, storage_options=s.options()) for s in (first, second)]
        with ckpt.CheckpointManager(stores[0], "run", every_n_steps=100, local=True, local_every_n_steps=1) as mgr:
            want = _train(mgr, [1, 2])
            path_a = mgr.local_tier.path
        with warnings.catch_warnings():
            warnings.simplefilter("error", ckpt.TierWarning)  # (the first one's tier is not emptied: no warning)
            mgr = ckpt.CheckpointManager(stores[1], "run", every_n_steps=100, local=True, local_every_n_steps=1)
        with mgr:
            _train(mgr, [1], seed=1)
            assert mgr.local_tier.path != path_a and mgr.local_tier.steps == [1]
        with ckpt.CheckpointManager(stores[0], "run", every_n_steps=100, local=True) as mgr:
            model, state = _fresh()
            assert mgr.restore_latest(state) == 2
            assert mgr.last_restore["store"] == 0 and mgr.last_restore["local"] > 0
            assert {k: v.numpy().tobytes() for k, v in model.state_dict().items()} == want
            assert mgr.local_tier.path == path_a
    finally:
        second.stop()
