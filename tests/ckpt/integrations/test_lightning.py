"""ckpt.integrations.lightning: a real Lightning run stopped and resumed from the store continues exactly."""

from __future__ import annotations

import signal

import pytest

pytest.importorskip("pytorch_lightning", reason="needs PyTorch Lightning: pip install 'ckpt-store[lightning]'")

from integration_util import assert_same_bits, assert_same_tree, load_script, run_script, state_bits

import ckpt

N = 14


@pytest.fixture(scope="module")
def script():
    return load_script("lightning_script")


@pytest.fixture(scope="module")
def uninterrupted(script, tmp_path_factory):
    d = tmp_path_factory.mktemp("lightning-full")
    return script.train(str(d / "store"), str(d), "full", N)


def _check(store: str, k: int, full: tuple[dict, dict], resumed: tuple[dict, dict]) -> None:
    losses, tensors = resumed
    assert losses.pop("restored") == k
    assert losses == {s: v for s, v in full[0].items() if s > k}  # every loss after k, bit for bit
    assert_same_bits(full[1], tensors)  # parameters, optimizer moments, scheduler and loop position
    s = ckpt.Store.open(store)
    assert sorted(s.refs()) == ["lit/latest", "lit/step-12", "lit/step-8"]  # keep_last=2; 12 saved after resuming
    assert s.verify().ok


def test_fresh_trainer_resumes_exactly(script, uninterrupted, tmp_path):
    """Snapshot at step 8 (an epoch boundary), train on to 10 and drop the Trainer; a new one resumes."""
    store = str(tmp_path / "store")
    script.train(store, str(tmp_path / "stop"), "stop", N, 8)
    _check(store, 8, uninterrupted, script.train(store, str(tmp_path / "resume"), "resume", N))


def test_resume_false_starts_over(script, tmp_path):
    store = str(tmp_path / "store")
    script.train(store, str(tmp_path / "stop"), "stop", N, 4)
    cb = script.CkptCallback(store, "lit", every_n_steps=100, resume=False)
    trainer = script.pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb])
    import torch

    data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    trainer.fit(script.TinyModule(), torch.utils.data.DataLoader(data, batch_size=8))
    assert cb.restored_step is None and trainer.global_step == 1


def test_save_outside_fit_is_a_clear_error(script, tmp_path):
    """The callback's public save() before fit set it up failed with a bare AssertionError."""
    from ckpt.snapshot.manager import SnapshotError

    cb = script.CkptCallback(str(tmp_path / "store"), "lit", every_n_steps=1)
    trainer = script.pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb])
    with pytest.raises(SnapshotError, match="from within trainer.fit"):
        cb.save(trainer, script.TinyModule())


@pytest.mark.slow
def test_resume_after_sigkill(uninterrupted, tmp_path):
    """The same across processes: the training process is SIGKILLed two steps after a durable snapshot."""
    store = str(tmp_path / "store")
    run_script("lightning_script", store, tmp_path / "crash", "crash", N, 8, expect=-signal.SIGKILL)
    _check(store, 8, uninterrupted, run_script("lightning_script", store, tmp_path / "resume", "resume", N))


@pytest.mark.slow  # a real trainer in a subprocess, SIGTERMed: ~10 s each (CI runs it in its slow pass)
def test_sigterm_saves_the_step_it_came_in(script, tmp_path):
    """Lightning turns SIGTERM into the end of ``fit`` after the current batch: the callback saved
    nothing then, and a preempted run lost every step since the last multiple of every_n_steps.
    The process then exited with status 0 (Lightning's SIGTERMException), which a scheduler reads
    as "finished": the job was never requeued. The script does nothing about it: the callback
    makes it 143 once the final snapshot is durable."""
    store = str(tmp_path / "store")
    run_script("lightning_script", store, tmp_path / "term", "term", N, 10, expect=143)
    s = ckpt.Store.open(store)
    assert s.resolve("lit/latest") == s.resolve("lit/step-10") and s.verify().ok
    _, at10 = script.train(str(tmp_path / "full-store"), str(tmp_path / "full"), "full", 10)
    snap = s.load("lit/step-10", include=["model/*"])
    assert_same_bits({k: v for k, v in at10.items() if k.startswith("model.")},
                     {f"model.{k[len('model/'):]}": v for k, v in snap.items()})
    losses, tensors = run_script("lightning_script", store, tmp_path / "resume", "resume", N)
    assert losses["restored"] == 10 and int(tensors["global_step"]) == N


@pytest.mark.slow  # a real trainer in a subprocess, SIGTERMed: ~10 s each (CI runs it in its slow pass)
def test_sigterm_during_validation_saves_the_step_before_it(script, tmp_path):
    """A SIGTERM during the validation that follows a training step came after that step's
    on_train_batch_end: Lightning ended fit from the validation loop and the callback saved nothing, so the
    steps since the last periodic snapshot were lost (here step 8, snapshots every 3 steps: the run went
    back to 6). The step is saved as fit ends, and the run resumed from it goes on bit for bit as the
    uninterrupted one (Lightning skips the rest of that validation on resuming)."""
    store = str(tmp_path / "store")
    run_script("lightning_script", store, tmp_path / "term", "val-term", N, 8, expect=143)
    s = ckpt.Store.open(store)
    assert s.resolve("lit/latest") == s.resolve("lit/step-8") and s.verify().ok
    full = script.train(str(tmp_path / "full-store"), str(tmp_path / "full"), "val-full", N)
    losses, tensors = run_script("lightning_script", store, tmp_path / "resume", "val-resume", N)
    assert losses.pop("restored") == 8
    assert losses == {k: v for k, v in full[0].items() if k > 8}  # every loss after step 8, bit for bit
    assert_same_bits(full[1], tensors)


def test_fit_that_raises_finishes_the_snapshot_in_flight(script, tmp_path):
    """Lightning calls no teardown hook when ``fit`` raises: the manager was left open, its in-flight
    snapshot unwaited (an error in it never reported). on_exception finishes and closes it."""
    import torch

    class Boom(script.pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 6:
                raise RuntimeError("boom")

    store = str(tmp_path / "store")
    cb = script.CkptCallback(store, "lit", every_n_steps=4, save_mode="async")
    trainer = script.pl.Trainer(max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb, Boom()])
    data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(script.TinyModule(), torch.utils.data.DataLoader(data, batch_size=8))
    assert cb.manager is None  # closed: the snapshot of step 4 is durable
    s = ckpt.Store.open(store)
    assert s.resolve("lit/latest") == s.resolve("lit/step-4") and s.verify().ok


def _fit(script, store, tmp_path, batch_size, max_steps, stop_at=None, ckpt_path=None, resume=True, module=None):
    """A Trainer over 32 samples in batches of ``batch_size``, snapshots every 2 steps, stopped at ``stop_at``."""
    import torch

    class Stop(script.pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.should_stop = trainer.global_step == stop_at

    cb = script.CkptCallback(store, "lit", every_n_steps=2, resume=resume)
    trainer = script.pl.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb, Stop()])
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
    module = script.TinyModule() if module is None else module
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=batch_size), ckpt_path=ckpt_path)
    return cb, trainer


def test_resume_mid_epoch_with_another_batch_size_is_refused(script, tmp_path):
    """Lightning finds its place in an epoch by counting batches: a snapshot taken 2 batches of 8 into an
    epoch, resumed with batches of 4, went on from sample 8 instead of 16 (with a resumable dataloader;
    a plain one restarts the epoch anyway), with no error. Refused before the first batch; at an epoch's
    end the batch size may change where the new epochs are no longer."""
    from ckpt.snapshot.manager import SnapshotError

    store = str(tmp_path / "store")
    _fit(script, store, tmp_path, 8, 20, stop_at=6)  # 4 batches an epoch: step 6 is 2 batches into the second
    with pytest.raises(SnapshotError, match="2 batches into an epoch of 4 batches of size 8; this trainer's epochs "
                                            "are 8 batches of size 4") as e:
        _fit(script, store, tmp_path, 4, 20)
    assert "batch size" in e.value.hint
    cb, trainer = _fit(script, store, tmp_path, 8, 8)  # the same batches: resumed
    assert cb.restored_step == 6 and trainer.global_step == 8
    # From step 8, the end of an epoch of 4 batches: in batches of 4 (8 an epoch) Lightning went on with that
    # epoch from its 5th batch, where the run would have begun a new one. In batches of 16 the epoch has ended.
    with pytest.raises(SnapshotError, match="4 batches into an epoch of 4 batches of size 8; this trainer's epochs "
                                            "are 8 batches of size 4"):
        _fit(script, store, tmp_path, 4, 10)
    cb, trainer = _fit(script, store, tmp_path, 16, 10)
    assert cb.restored_step == 8 and trainer.global_step == 10


def test_fit_from_a_lightning_checkpoint_and_a_snapshot_is_refused(script, tmp_path):
    """``trainer.fit(ckpt_path=...)`` restores the module before on_fit_start and the optimizers and loop
    position after it: with a snapshot resumed too, the run went on from step 4's loop and optimizer with
    step 6's weights, silently. Refused; resume=False resumes from the Lightning checkpoint, and a run
    with no snapshot yet (moving to ckpt) starts from it. The refusal came after the snapshot had been
    restored into the module and the RNG: refused first, the module holds what Lightning restored."""
    import torch
    from integration_util import tensor_bits

    from ckpt.snapshot.manager import SnapshotError

    lightning_ckpt = str(tmp_path / "step4.ckpt")
    _, trainer = _fit(script, str(tmp_path / "other"), tmp_path, 8, 4)
    trainer.save_checkpoint(lightning_ckpt)
    at4 = {k: tensor_bits(v) for k, v in trainer.lightning_module.state_dict().items()}
    store = str(tmp_path / "store")
    cb, trainer = _fit(script, store, tmp_path, 8, 5, ckpt_path=lightning_ckpt)  # no snapshot yet: Lightning's
    assert cb.restored_step is None and trainer.global_step == 5
    _fit(script, store, tmp_path, 8, 6)  # snapshot of step 6
    module = script.TinyModule()
    rng = torch.get_rng_state()
    with pytest.raises(SnapshotError, match="resumes from that checkpoint, and this callback from step 6") as e:
        _fit(script, store, tmp_path, 8, 8, ckpt_path=lightning_ckpt, module=module)
    assert "resume=False" in e.value.hint
    assert {k: tensor_bits(v) for k, v in module.state_dict().items()} == at4  # Lightning's step 4, not step 6
    assert torch.equal(torch.get_rng_state(), rng)  # the snapshot's RNG state was not restored either
    cb, trainer = _fit(script, store, tmp_path, 8, 5, ckpt_path=lightning_ckpt, resume=False)
    assert cb.restored_step is None and trainer.global_step == 5


def test_fit_from_a_lightning_checkpoint_beside_a_snapshot_only_in_the_local_tier_is_refused(script, tmp_path):
    """The refusal above looked only at the durable store's RUN/latest, while restore_latest takes the
    newest snapshot of every tier: a snapshot in the local tier alone (not persisted yet) was resumed
    on top of Lightning's checkpoint, the mix the refusal is there to stop (found in review)."""
    import torch

    from ckpt.errors import RefNotFoundError
    from ckpt.snapshot.manager import SnapshotError

    def fit(steps, ckpt_path=None):
        cb = script.CkptCallback(str(tmp_path / "store"), "lit", every_n_steps=1, local=str(tmp_path / "local"))
        trainer = script.pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb])
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
        trainer.fit(script.TinyModule(), torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
        return trainer

    fit(1).save_checkpoint(tmp_path / "l.ckpt")  # step 1: a snapshot in the local tier only
    with pytest.raises(RefNotFoundError):
        ckpt.Store.open(str(tmp_path / "store")).resolve("lit/latest")
    with pytest.raises(SnapshotError, match="resumes from that checkpoint, and this callback from step 1"):
        fit(3, ckpt_path=str(tmp_path / "l.ckpt"))


def test_a_loader_whose_batch_size_is_not_a_number_still_snapshots(script, tmp_path):
    """Any iterable trains under Lightning: one whose ``batch_size`` is not an int (here an object JSON cannot
    hold) is recorded as of unknown batch size, not refused by the snapshot's data position."""
    import torch

    class Batches:
        batch_size = object()

        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]

        def __iter__(self):
            return iter(self.data)

        def __len__(self):
            return len(self.data)

    cb = script.CkptCallback(str(tmp_path / "store"), "lit", every_n_steps=2)
    trainer = script.pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb])
    trainer.fit(script.TinyModule(), Batches())
    assert cb.manager is None and sorted(ckpt.Store.open(str(tmp_path / "store")).refs()) == ["lit/latest", "lit/step-2"]


@pytest.mark.parametrize("recorded", [{"batch_in_epoch": "2", "batches_per_epoch": 4, "batch_sizes": [8]},
                                      {"batch_in_epoch": 2, "batches_per_epoch": [4], "batch_sizes": [8]}, ["not", "a", "record"]],
                         ids=["position", "epoch-length", "not-a-record"])
def test_a_malformed_data_position_is_refused(script, tmp_path, monkeypatch, recorded):
    """A snapshot read from a store is outside data: a data position of the wrong types raised a raw TypeError
    (comparing them) or AttributeError at on_train_start."""
    import ckpt.integrations.lightning as integration
    from ckpt.snapshot.manager import SnapshotError

    store = str(tmp_path / "store")
    with monkeypatch.context() as m:
        m.setattr(integration, "_data_position", lambda trainer: recorded)
        _fit(script, store, tmp_path, 8, 20, stop_at=6)
    with pytest.raises(SnapshotError, match="is malformed"):
        _fit(script, store, tmp_path, 8, 20)


def test_a_pulled_checkpoint_resumes_fit_as_the_original(script, tmp_path):
    """`ckpt push run.ckpt` then `ckpt pull REF back.ckpt` wrote a flat dict (``state_dict.net.0.weight``,
    ``optimizer_states.0.state.0.exp_avg``...) that ``Trainer.fit(ckpt_path=...)`` cannot resume from.
    The pulled file is now the checkpoint as Lightning saved it, and fit resumes from it exactly as from
    the original: the same weights, optimizer moments and scheduler restored, the same run after them."""
    import torch

    pl = script.pl

    class Restored(pl.Callback):
        def on_train_start(self, trainer, pl_module):  # what fit restored, before any step
            self.state = (state_bits(pl_module, trainer.optimizers[0]), trainer.global_step,
                          trainer.lr_scheduler_configs[0].scheduler.state_dict())

    def fit(steps: int, ckpt_path: str | None = None) -> tuple[object, ...]:
        torch.manual_seed(99 if ckpt_path else 0)  # resumed: the weights must come from the file
        module = script.TinyModule()
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
        restored = Restored()
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                             callbacks=[restored])
        torch.manual_seed(1234)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
        if ckpt_path is None:
            trainer.save_checkpoint(tmp_path / "run.ckpt")
        return restored.state, state_bits(module, trainer.optimizers[0]), trainer.global_step

    fit(6)
    store = ckpt.Store.init(str(tmp_path / "store"))
    store.push(str(tmp_path / "run.ckpt"), "run")
    pulled = store.pull("run", str(tmp_path / "pulled.ckpt"))
    original = torch.load(tmp_path / "run.ckpt", weights_only=True)
    assert_same_tree(original, torch.load(pulled, weights_only=True))
    from_original, from_pulled = fit(10, str(tmp_path / "run.ckpt")), fit(10, pulled)
    assert from_pulled == from_original
    (weights, moments), step, _ = from_pulled[0]
    assert step == 6 and from_pulled[2] == 10
    assert weights == {k: bytes(v.reshape(-1).view(torch.uint8).numpy()) for k, v in original["state_dict"].items()}
    assert moments and moments.keys() == original["optimizer_states"][0]["state"].keys()
