"""ckpt.integrations.transformers: a real Trainer run stopped and resumed from the store continues exactly."""

from __future__ import annotations

import os
import signal

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install 'ckpt-store[transformers]'")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate: pip install 'ckpt-store[transformers]'")

from integration_util import assert_same_bits, load_script, run_script

import ckpt

N = 14  # 4 optimizer steps per epoch; snapshots every 2


@pytest.fixture(scope="module")
def script():
    return load_script("hf_script")


@pytest.fixture(scope="module")
def uninterrupted(script, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-full")
    return script.train(str(d / "store"), str(d), "full", N)


def _check(store: str, k: int, full: tuple[dict, dict], resumed: tuple[dict, dict]) -> None:
    losses, tensors = resumed
    assert losses.pop("restored") == k
    assert losses == {s: v for s, v in full[0].items() if s > k}  # every loss after k, bit for bit
    assert_same_bits(full[1], tensors)  # parameters, AdamW moments, scheduler position, global step
    s = ckpt.Store.open(store)
    assert sorted(s.refs()) == ["hf/latest", f"hf/step-{N - 2}", f"hf/step-{N}"]  # keep_last=2
    assert s.verify().ok


@pytest.mark.parametrize(("k", "overlap"), [(6, False), (8, False), (6, True)],
                         ids=["mid-epoch", "epoch-boundary", "mid-epoch-overlap-copy"])
def test_fresh_trainer_resumes_exactly(script, uninterrupted, tmp_path, k, overlap):
    """Snapshot at step k, train one more step (no snapshot) and drop the Trainer; a new one resumes.
    With ``overlap_copy`` the snapshot is still being read when that step runs: the
    optimizer's step (behind accelerate's wrapper) waits for what it would overwrite."""
    store = str(tmp_path / "store")
    script.train(store, str(tmp_path / "stop"), "stop", N, k, overlap=overlap)
    _check(store, k, uninterrupted, script.train(store, str(tmp_path / "resume"), "resume", N, overlap=overlap))


def test_no_snapshot_means_a_fresh_start(script, tmp_path):
    from transformers import Trainer, TrainingArguments

    cb = script.CkptCallback(str(tmp_path / "store"), "hf", every_n_steps=2)
    trainer = Trainer(model=script.GPT2LMHeadModel(script.GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=16)),
                      args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True), callbacks=[cb])
    assert cb.resume_dir(trainer) is None and cb.restored_step is None


def test_resume_dir_without_resume_from_checkpoint_is_refused(script, tmp_path):
    """The Trainer must be told to resume, or it would start at step 0 with the restored weights."""
    from transformers import Trainer, TrainingArguments

    from ckpt.snapshot.manager import SnapshotError

    store = str(tmp_path / "store")
    script.train(store, str(tmp_path / "stop"), "stop", N, 2)
    model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    cb = script.CkptCallback(store, "hf", every_n_steps=2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (4, 12))]
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True,
                                                          max_steps=1, disable_tqdm=True, per_device_train_batch_size=4),
                      train_dataset=data, callbacks=[cb])
    assert cb.resume_dir(trainer) == str(tmp_path / "out" / "ckpt-resume") and cb.restored_step == 2
    snap = ckpt.Store.open(store).load("hf/step-2", include=["model/*"])
    assert all(torch.equal(v, snap[f"model/{k}"]) for k, v in model.state_dict().items())  # restored in place
    with pytest.raises(SnapshotError, match="resume_from_checkpoint"):
        trainer.train()


@pytest.mark.slow
def test_resume_after_sigkill(uninterrupted, tmp_path):
    """The same across processes: the training process is SIGKILLed one step after a durable snapshot."""
    store = str(tmp_path / "store")
    run_script("hf_script", store, tmp_path / "crash", "crash", N, 6, expect=-signal.SIGKILL)
    _check(store, 6, uninterrupted, run_script("hf_script", store, tmp_path / "resume", "resume", N))


@pytest.mark.slow  # a real trainer in a subprocess, SIGTERMed: ~10 s each (CI runs it in its slow pass)
def test_preemption_snapshots_the_step_it_came_in_and_exits_143(uninterrupted, tmp_path):
    """The Trainer installs no signal handler: a SIGTERM killed the process, losing every step since
    the last periodic snapshot. With handle_signals=True the step it came in (7: off the every-2
    schedule) is snapshotted once its logging ran, the process exits 143, and a resume is exact."""
    store = str(tmp_path / "store")
    run_script("hf_script", store, tmp_path / "preempt", "preempt", N, 7, expect=143)
    assert "hf/step-7" in ckpt.Store.open(store).refs()
    _check(store, 7, uninterrupted, run_script("hf_script", store, tmp_path / "resume", "resume", N))


@pytest.mark.slow  # a real trainer in a subprocess, SIGTERMed: ~10 s each (CI runs it in its slow pass)
def test_preempted_again_before_the_first_resumed_step_keeps_the_snapshot(uninterrupted, tmp_path):
    """A SIGTERM that came before the first step of a resumed run took the final snapshot of the step
    just restored again, with this process's RNG state (restored only as that step begins): step 6's
    snapshot was replaced by one whose resume was no longer exact. It is kept as it is, and the process
    still exits 143."""
    store = str(tmp_path / "store")
    run_script("hf_script", store, tmp_path / "crash", "crash", N, 6, expect=-signal.SIGKILL)  # 6: mid-epoch
    s = ckpt.Store.open(store)
    before = s.resolve("hf/step-6")
    run_script("hf_script", store, tmp_path / "again", "resume-preempt", N, expect=143)
    assert s.resolve("hf/step-6") == before == s.resolve("hf/latest")
    _check(store, 6, uninterrupted, run_script("hf_script", store, tmp_path / "resume", "resume", N))


def test_evaluation_between_snapshots_resumes_exactly(script, tmp_path):
    """The Trainer logs and evaluates a step after ``on_step_end``: the eval dataloader draws its seed
    from the torch RNG and the eval loss is what ``keep_best`` records. A snapshot taken in
    ``on_step_end`` resumed one RNG draw behind (other dropout masks from there on) and recorded
    the previous evaluation's loss with each step."""
    d = tmp_path / "full"
    full = script.train(str(d / "store"), str(d), "full", N, evaluate=True)
    store = str(tmp_path / "store")
    script.train(store, str(tmp_path / "stop"), "stop", N, 6, evaluate=True)
    losses, tensors = script.train(store, str(tmp_path / "resume"), "resume", N, evaluate=True)
    assert losses.pop("restored") == 6
    assert losses == {s: v for s, v in full[0].items() if s > 6}
    assert_same_bits(full[1], tensors)
    manager = script.CkptCallback(store, "hf", every_n_steps=2).manager
    for step in manager.steps():
        values = {"trainer_state": None}
        manager.restore(values, step)
        (logged,) = [h["eval_loss"] for h in values["trainer_state"]["log_history"] if h.get("step") == step and "eval_loss" in h]
        recorded = ckpt.Store.open(store).manifest(f"hf/step-{step}").extra["snapshot"]["metrics"]
        assert recorded == {"eval_loss": logged}
    manager.close()


def test_resume_with_another_batch_size_is_refused(script, tmp_path):
    """The Trainer places a resumed run in its data by counting steps in batches of today's size: with
    another batch size it skipped to another place (a whole epoch later here) and trained on, with no
    error. Refused before the model is touched."""
    from transformers import Trainer, TrainingArguments

    from ckpt.snapshot.manager import SnapshotError

    store = str(tmp_path / "store")
    script.train(store, str(tmp_path / "stop"), "stop", N, 6)  # batch size 4
    model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = script.CkptCallback(store, "hf", every_n_steps=2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 12))]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=N,
                             per_device_train_batch_size=8, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    with pytest.raises(SnapshotError, match="batch size 4") as e:
        cb.resume_dir(trainer)
    assert "per_device_train_batch_size=4" in str(e.value.hint)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    assert cb.restored_step is None and not (tmp_path / "out" / "ckpt-resume").exists()
    cb.close()


def test_resume_with_another_accumulation_or_dataset_is_refused(script, tmp_path):
    """The Trainer skips global_step * gradient_accumulation_steps batches of an epoch of today's
    length: resumed with another accumulation (or a dataset of another number of batches) it went on
    at another place in the data (here at the start of the fourth epoch, not 2 batches into the second),
    with no error. Refused: another accumulation before the model is touched, another dataset when
    ``train`` starts, before the first step; ``ignore_data_skip=True`` (skip nothing) lets both change."""
    from transformers import Trainer, TrainingArguments

    from ckpt.snapshot.manager import SnapshotError

    store = str(tmp_path / "store")
    script.train(store, str(tmp_path / "stop"), "stop", N, 6)  # 16 samples, batches of 4, no accumulation

    def trainer_for(samples, **kw):
        model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
        cb = script.CkptCallback(store, "hf", every_n_steps=2)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (samples, 12))]
        args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=N,
                                 per_device_train_batch_size=4, disable_tqdm=True, save_strategy="no", **kw)
        return Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]), cb, model

    trainer, cb, model = trainer_for(16, gradient_accumulation_steps=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SnapshotError, match="gradient_accumulation_steps=1, this Trainer's is 2") as e:
        cb.resume_dir(trainer)
    assert "gradient_accumulation_steps=1" in e.value.hint
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    assert cb.restored_step is None and not (tmp_path / "out" / "ckpt-resume").exists()
    cb.close()

    trainer, cb, _ = trainer_for(24)  # 6 batches an epoch, not 4
    with pytest.raises(SnapshotError, match="4 batches an epoch, this Trainer's dataset makes 6"):
        trainer.train(resume_from_checkpoint=cb.resume_dir(trainer))
    assert trainer.state.global_step == 6  # not one step trained
    cb.close()

    trainer, cb, _ = trainer_for(16, gradient_accumulation_steps=2, ignore_data_skip=True)
    assert cb.resume_dir(trainer) is not None and cb.restored_step == 6
    cb.close()


def test_callback_states_need_the_trainer(script, tmp_path):
    """No callback hook is given the Trainer: a run started with ``trainer.train()`` (no resume_dir)
    snapshotted the other callbacks' states as they were when training began (early stopping's
    patience counter 0 where it had counted 2), so a resume stopped later than the run would have.
    Refused before the first step; with resume_dir (None on a first run) the live states are saved."""
    from transformers import EarlyStoppingCallback, Trainer, TrainingArguments

    from ckpt.snapshot.manager import SnapshotError

    def run(out, first_resume_dir):
        torch.manual_seed(0)
        model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=16, n_positions=16))
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 16, (16, 8))]
        args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, report_to=[],
                                 use_cpu=True, eval_strategy="steps", eval_steps=2, save_strategy="no", disable_tqdm=True,
                                 metric_for_best_model="eval_loss", greater_is_better=True)  # every eval is "worse"
        cb = script.CkptCallback(str(out / "store"), "hf", every_n_steps=2)
        stopper = EarlyStoppingCallback(early_stopping_patience=10)
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4], callbacks=[cb, stopper])
        try:
            trainer.train(resume_from_checkpoint=cb.resume_dir(trainer) if first_resume_dir else None)
        finally:
            cb.close()
        return cb, stopper, trainer

    with pytest.raises(SnapshotError, match="cannot snapshot the states of EarlyStoppingCallback") as e:
        run(tmp_path / "a", False)
    assert "resume_dir(trainer)" in e.value.hint
    assert not ckpt.Store.open(str(tmp_path / "a" / "store")).refs()

    _, stopper, trainer = run(tmp_path / "b", True)
    assert stopper.early_stopping_patience_counter == 2 and trainer.state.global_step == 6
    values = {"trainer_state": None}
    with ckpt.CheckpointManager(str(tmp_path / "b" / "store"), "hf") as manager:
        manager.restore(values, 6)
    assert values["trainer_state"]["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == \
        {"early_stopping_patience_counter": 2}


def test_two_stateful_callbacks_of_one_class_keep_both_states(script, tmp_path):
    """The Trainer records several stateful callbacks of one class as a list of their states; the snapshot
    kept one (the last, by class name), so a resume gave both stoppers the second one's patience and count."""
    from transformers import EarlyStoppingCallback, Trainer, TrainingArguments

    def run(steps):
        torch.manual_seed(0)
        model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=16, n_positions=16))
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 16, (16, 8))]
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, eval_strategy="steps", eval_steps=2, save_strategy="no",
                                 disable_tqdm=True, metric_for_best_model="eval_loss", greater_is_better=True,
                                 restore_callback_states_from_checkpoint=True)
        cb = script.CkptCallback(str(tmp_path / "store"), "hf", every_n_steps=2)
        stoppers = [EarlyStoppingCallback(early_stopping_patience=10), EarlyStoppingCallback(early_stopping_patience=20)]
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4], callbacks=[cb, *stoppers])
        try:
            trainer.train(resume_from_checkpoint=cb.resume_dir(trainer))
        finally:
            cb.close()
        return sorted((c.early_stopping_patience, c.early_stopping_patience_counter)
                      for c in trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback))

    assert run(4) == [(10, 1), (20, 1)]
    values = {"trainer_state": None}
    with ckpt.CheckpointManager(str(tmp_path / "store"), "hf") as manager:
        manager.restore(values, 4)
    saved = values["trainer_state"]["stateful_callbacks"]["EarlyStoppingCallback"]
    assert [(s["args"]["early_stopping_patience"], s["attributes"]["early_stopping_patience_counter"]) for s in saved] == \
        [(10, 1), (20, 1)]
    assert run(6) == [(10, 2), (20, 2)]  # resumed from step 4: each stopper its own patience and count


@pytest.mark.parametrize(("trainer_state", "data", "error"), [
    ([1, 2], None, "is malformed"), ({"global_step": 2}, ["x"], "is malformed"),
    ({"global_step": 2, "no_such_field": 1}, None, "fields this transformers does not know: no_such_field")],
    ids=["state-not-a-record", "data-not-a-record", "unknown-field"])
def test_a_malformed_snapshot_is_refused_before_the_model_is_touched(script, tmp_path, trainer_state, data, error):
    """A snapshot read from a store is outside data: a trainer state that is not a record raised a raw
    AttributeError, and one with a field TrainerState lacks a TypeError inside ``train`` (the model
    already overwritten)."""
    from transformers import Trainer, TrainingArguments

    from ckpt.snapshot.manager import SnapshotError

    store = str(tmp_path / "store")
    model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=64, n_positions=16))
    with ckpt.CheckpointManager(store, "hf", save_mode="sync") as mgr:
        mgr.save(2, {"model": model, "trainer_state": trainer_state, "data": data})
    torch.nn.init.zeros_(model.transformer.wte.weight)
    cb = script.CkptCallback(store, "hf", every_n_steps=2)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=4,
                             per_device_train_batch_size=4, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=[], callbacks=[cb])
    with pytest.raises(SnapshotError, match=error):
        cb.resume_dir(trainer)
    assert not model.transformer.wte.weight.any() and cb.restored_step is None
    cb.close()


@pytest.mark.parametrize("step", ["2", None, 2.5, -1, True], ids=["text", "null", "float", "negative", "bool"])
def test_a_latest_snapshot_whose_step_is_no_step_is_refused(script, tmp_path, step):
    """resume_dir read RUN/latest's step with int(): text raised a raw ValueError, null a TypeError, and
    2.5 resumed as step 2. SnapshotError, the model untouched."""
    import copy
    import dataclasses

    from transformers import Trainer, TrainingArguments

    from ckpt.snapshot.manager import SnapshotError
    from ckpt_store.storage.commit import commit

    store = str(tmp_path / "store")
    model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=64, n_positions=16))
    with ckpt.CheckpointManager(store, "hf", save_mode="sync") as mgr:
        mgr.save(2, {"model": model, "trainer_state": {"global_step": 2}, "data": {}})
    s = ckpt.Store.open(store)
    m = s.manifest("hf/latest")
    snap = {**copy.deepcopy(m.extra["snapshot"]), "step": step}
    commit(s.objects, s.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "hf/latest")
    torch.nn.init.zeros_(model.transformer.wte.weight)
    cb = script.CkptCallback(store, "hf", every_n_steps=2)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=4,
                             per_device_train_batch_size=4, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=[], callbacks=[cb])
    with pytest.raises(SnapshotError, match="hf/latest is not a snapshot"):
        cb.resume_dir(trainer)
    assert not model.transformer.wte.weight.any() and cb.restored_step is None
    cb.close()


def test_following_save_strategy_no_is_refused(script, tmp_path):
    """``every_n_steps=None`` follows ``save_strategy``; with the README's ``save_strategy="no"`` the run
    trained to the end with no snapshot at all, and no word about it."""
    from transformers import Trainer, TrainingArguments

    from ckpt.snapshot.manager import SnapshotError

    cb = script.CkptCallback(str(tmp_path / "store"), "hf")
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 12))]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=4, save_strategy="no",
                             per_device_train_batch_size=4, disable_tqdm=True)
    model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=64, n_positions=16))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    with pytest.raises(SnapshotError, match="save_strategy") as e:
        trainer.train()
    assert "every_n_steps=N" in str(e.value.hint) and trainer.state.global_step == 0
    cb.close()


@pytest.mark.parametrize("strategy", ["epoch", "best"])
def test_following_an_epoch_or_best_save_strategy_snapshots_where_the_trainer_saves(script, tmp_path, strategy):
    """``every_n_steps=None`` read ``control.should_save`` in on_step_end, but the Trainer decides an
    "epoch" save in on_epoch_end and a "best" one after evaluating, both later: such a run wrote its own
    checkpoint-N folders and not one snapshot. A snapshot is now taken wherever the Trainer saves."""
    from transformers import Trainer, TrainingArguments

    cb = script.CkptCallback(str(tmp_path / "store"), "hf")
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 12))]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=10,
                             save_strategy=strategy, eval_strategy="epoch", metric_for_best_model="loss",
                             per_device_train_batch_size=4, disable_tqdm=True)
    model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=64, n_positions=16))
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4], callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_dir(trainer))
    cb.close()
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert saved and cb.manager.steps() == saved  # the Trainer's own checkpoints: 4, 8 (epoch ends or new bests), 10


def _a_trained_run(script, tmp_path):
    """A store under ``tmp_path`` holding N steps of the script's run, and a fresh model (with its bits before
    anything is restored), a callback on that store and a Trainer around them: what resume_dir is given."""
    from transformers import Trainer, TrainingArguments

    store = str(tmp_path / "store")
    script.train(store, str(tmp_path / "stop"), "stop", N, 2)
    model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = script.CkptCallback(store, "hf", every_n_steps=2)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=N,
                             per_device_train_batch_size=4, disable_tqdm=True)
    return model, before, cb, Trainer(model=model, args=args, train_dataset=[], callbacks=[cb])


def test_resume_dir_into_a_folder_of_other_files_is_refused(script, tmp_path):
    """``save_pretrained`` deleted model-0000i-of-0000n shards it found in ``dest`` (a model the user
    kept there), and the Trainer would unpickle an optimizer.pt or rng_state.pth found there. A folder
    resume_dir wrote itself is reused."""
    from ckpt.snapshot.manager import SnapshotError

    model, before, cb, trainer = _a_trained_run(script, tmp_path)
    dest = tmp_path / "my-model"
    dest.mkdir()
    shard = dest / "model-00001-of-00002.safetensors"
    shard.write_bytes(b"precious")
    with pytest.raises(SnapshotError, match="did not write"):
        cb.resume_dir(trainer, dest)
    assert shard.read_bytes() == b"precious" and sorted(p.name for p in dest.iterdir()) == [shard.name]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and cb.restored_step is None
    for path in (tmp_path / "a-file", tmp_path / "dangling"):  # a raw FileExistsError came after the model was restored
        path.write_bytes(b"precious") if path.name == "a-file" else path.symlink_to(tmp_path / "nowhere")
        with pytest.raises(SnapshotError, match="exists and is not a directory"):
            cb.resume_dir(trainer, path)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and cb.restored_step is None
    assert (tmp_path / "a-file").read_bytes() == b"precious" and not (tmp_path / "nowhere").exists()
    out = cb.resume_dir(trainer)
    assert cb.resume_dir(trainer) == out and cb.restored_step == 2  # its own folder again
    cb.close()


def test_resume_dir_never_writes_through_a_link_in_its_own_folder(script, tmp_path):
    """A folder resume_dir wrote is reused, and its files were written with open() and save_pretrained:
    a symbolic link at one of their names (trainer_state.json, model.safetensors) had the file it leads
    to, a user's, overwritten. Refused now, before the model is touched; the links and their targets
    stay as they were."""
    from ckpt.snapshot.manager import SnapshotError

    model, before, cb, trainer = _a_trained_run(script, tmp_path)
    out = cb.resume_dir(trainer)
    cb.restored_step = None
    model.load_state_dict(before)
    theirs = {"trainer_state.json": tmp_path / "notes.json", "model.safetensors": tmp_path / "weights.safetensors"}
    for name, target in theirs.items():
        target.write_bytes(b"precious " + name.encode())
        os.unlink(os.path.join(out, name))
        os.symlink(target, os.path.join(out, name))
    with pytest.raises(SnapshotError, match="symbolic link"):
        cb.resume_dir(trainer)
    for name, target in theirs.items():
        assert target.read_bytes() == b"precious " + name.encode() and os.readlink(os.path.join(out, name)) == str(target)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and cb.restored_step is None
    cb.close()


def test_resume_dir_inside_the_store_is_refused(script, tmp_path):
    """resume_dir wrote its folder (the model, trainer_state.json) wherever ``dest`` was: inside the store
    (``dest`` below it, or the Trainer's output_dir being the store) it put files there that are none of the
    store's. Refused as a pull there is, before the model is touched; the store is left as it was."""
    from transformers import Trainer, TrainingArguments

    from ckpt.errors import DestinationError

    store = tmp_path / "store"
    script.train(str(store), str(tmp_path / "stop"), "stop", N, 2)
    before_store = sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    model = script.GPT2LMHeadModel(script.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = script.CkptCallback(str(store), "hf", every_n_steps=2)
    (tmp_path / "link").symlink_to(store / "refs")
    for out_dir, dest in ((tmp_path / "out", store / "resume"), (tmp_path / "out", tmp_path / "link" / "resume"),
                          (store, None)):
        args = TrainingArguments(output_dir=str(out_dir), report_to=[], use_cpu=True, max_steps=N,
                                 per_device_train_batch_size=4, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=[], callbacks=[cb])
        with pytest.raises(DestinationError, match="inside the store"):
            cb.resume_dir(trainer, dest)
        assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == before_store
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and cb.restored_step is None
    assert ckpt.Store.open(str(store)).verify().ok


def test_resume_dir_through_a_link_into_dev_is_refused_and_dev_shm_is_yours(script, tmp_path):
    """resume_dir checked only its folder's parent against the system's folders: a ``dest`` that is itself a
    link into /dev passed (refused later, if at all, by what it found there), while /dev/shm itself was refused
    though /dev/shm is a folder of the user's. Its files are what is checked now, as a pull's are; and a
    resume into a folder in /dev/shm works (that part passed on the code before too)."""
    import shutil
    import tempfile

    from ckpt.errors import DestinationError

    model, before, cb, trainer = _a_trained_run(script, tmp_path)
    (tmp_path / "link").symlink_to("/dev")
    for dest in (tmp_path / "link", "/dev"):
        with pytest.raises(DestinationError, match="is in /dev, the system's"):
            cb.resume_dir(trainer, dest)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and cb.restored_step is None
    if not os.path.isdir("/dev/shm"):
        cb.close()
        pytest.skip("no /dev/shm here")
    shm = tempfile.mkdtemp(dir="/dev/shm")
    try:
        out = cb.resume_dir(trainer, os.path.join(shm, "resume"))
        assert out == os.path.join(shm, "resume") and cb.restored_step == 2
        assert os.path.isfile(os.path.join(out, "trainer_state.json"))
    finally:
        cb.close()
        shutil.rmtree(shm)
