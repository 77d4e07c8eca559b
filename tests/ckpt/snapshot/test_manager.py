"""CheckpointManager: exact resume after SIGKILL, async errors, incremental saves, retention."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import threading
import warnings

import pytest
import torch
from integration_util import start_process
from integration_util import state_bits as _state_bits
from integration_util import tensor_bits as _bits
from integration_util import wait_process as _wait

import ckpt
from ckpt.errors import CkptError, TensorMismatchError
from ckpt.snapshot.manager import SnapshotError

SCRIPT = pathlib.Path(__file__).with_name("train_script.py")


def _start(*args, overlap=False) -> subprocess.Popen[str]:
    return start_process(SCRIPT, *args, CKPT_TEST_OVERLAP="1" if overlap else "0")


def _run(*args, expect=0, overlap=False):
    return _wait(_start(*args, overlap=overlap), expect)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted 30-step run the resumed ones are compared with (it saves nothing, so it is
    the same for every save mode): run once, beside the first crash run, and waited for when read."""
    out = tmp_path_factory.mktemp("full")
    p = _start(out / "s-full", out / "full", "full", 30)
    yield lambda: (_wait(p), out)[1]
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.mark.slow  # (3-5 s: CI time, run by .ci/run's slow pass)
@pytest.mark.parametrize("overlap", [False, True], ids=["copy", "overlap_copy"])
def test_exact_resume_after_sigkill(tmp_path, overlap, full_run):
    """overlap_copy: every snapshot is read while the next steps' forward/backward run."""
    n, k = 30, 15
    _run(tmp_path / "s", tmp_path / "crash", "crash", n, k, expect=-signal.SIGKILL, overlap=overlap)
    store = ckpt.Store.open(str(tmp_path / "s"))
    assert store.resolve("run/latest") == store.resolve(f"run/step-{k}")
    assert store.verify().ok
    _run(tmp_path / "s", tmp_path / "resumed", "resume", n, overlap=overlap)
    full_dir = full_run()
    full = json.loads((full_dir / "full.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert sorted(map(int, resumed)) == list(range(k + 1, n + 1))
    assert all(resumed[s] == full[s] for s in resumed)  # losses bit-identical (float.hex)
    a = (full_dir / "full.safetensors").read_bytes()
    b = (tmp_path / "resumed.safetensors").read_bytes()
    assert a == b  # parameters and optimizer state, byte for byte


def test_preemption_takes_a_final_snapshot(tmp_path):
    """The process ends with 143 (128 + SIGTERM): a scheduler requeues it instead of marking it done."""
    _run(tmp_path / "s", tmp_path / "out", "preempt", 30, 12, expect=143)
    store = ckpt.Store.open(str(tmp_path / "s"))
    m = store.manifest("run/latest")
    assert m.extra["snapshot"]["step"] == 12
    assert store.resolve("run/step-12") == store.resolve("run/latest")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))


def _train(model, opt, steps=1):
    for _ in range(steps):
        loss = model(torch.randn(4, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_frozen_weights_cost_nothing_after_the_first_save(tmp_path):
    model = _model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "ft") as mgr:
        _train(model, opt)
        mgr.save(1, {"model": model, "optim": opt})
        mgr.wait()
        first = mgr.last_save
        _train(model, opt)
        mgr.save(2, {"model": model, "optim": opt})
        mgr.wait()
        second = mgr.last_save
    assert first.reused_tensors == 0
    assert second.reused_tensors == 2  # model.0.weight and model.0.bias: not even read
    assert second.written_bytes < first.written_bytes


def test_restore_in_place_and_subset(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 3)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
        mgr.save(3, {"model": model, "optim": opt, "epoch": 1, "pos": {"shard": 2, "offsets": (1, 2)}})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = _model()
    ptr = fresh[0].weight.data_ptr()
    state = {"model": fresh}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        assert mgr.restore_latest(state) == 3  # a subset: only the model
        assert fresh[0].weight.data_ptr() == ptr
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
        full = {"model": _model(), "optim": torch.optim.AdamW(_model().parameters()), "epoch": 0, "pos": None}
        mgr.restore(full, 3)
        assert full["epoch"] == 1 and full["pos"] == {"shard": 2, "offsets": (1, 2)}
        assert full["optim"].state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)
        with pytest.raises(TensorMismatchError, match="not in snapshot"):
            mgr.restore({"model": torch.nn.Sequential(torch.nn.Linear(64, 64))}, 3)
        with pytest.raises(TensorMismatchError, match="has no"):
            mgr.restore({"other": model}, 3)
        assert mgr.restore_latest({}) == 3


def test_a_snapshot_holding_a_dtype_or_device_is_refused_by_readers_before_those_tags(tmp_path):
    """A torch.dtype or torch.device among plain values is a tag that a ckpt reading snapshot format 1
    would hand out as the dict {"__dtype__": ...}: such a snapshot is format 2, which that reader refuses
    ("not a snapshot of this ckpt version"); one without keeps format 1."""
    model = _model()
    cfg = {"dtype": torch.bfloat16, "device": torch.device("cpu"), "plain": {"__dtype__": "x", "n": 1}}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
        mgr.save(1, {"model": model, "cfg": cfg})
        mgr.save(2, {"model": model, "cfg": {"dtype": "bfloat16", "plain": {"__dtype__": "x", "n": 1}}})
    store = ckpt.Store.open(str(tmp_path / "s"))
    assert [store.manifest(f"r/step-{s}").extra["snapshot"]["format"] for s in (1, 2)] == [2, 1]
    state = {"model": _model(), "cfg": None}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.restore(state, 1)
        assert state["cfg"] == cfg and state["cfg"]["dtype"] is torch.bfloat16
        mgr.restore(state, 2)
        assert state["cfg"] == {"dtype": "bfloat16", "plain": {"__dtype__": "x", "n": 1}}


def test_optimizer_state_is_restored_into_its_own_tensors(tmp_path):
    """A live optimizer with state keeps its tensor objects; they receive the snapshot's bytes."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 3)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "o", save_mode="sync") as mgr:
        mgr.save(3, {"model": model, "optim": opt})
    want = {id_: {k: _bits(v) for k, v in st.items()} for id_, st in opt.state_dict()["state"].items()}
    _train(model, opt, 2)  # the live state moves on
    before = {id(p): opt.state[p]["exp_avg"] for p in model.parameters()}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "o") as mgr:
        mgr.restore_latest({"model": model, "optim": opt})
    assert all(opt.state[p]["exp_avg"] is before[id(p)] for p in model.parameters())  # written in place
    got = {id_: {k: _bits(v) for k, v in st.items()} for id_, st in opt.state_dict()["state"].items()}
    assert got == want
    fresh_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no state yet: new tensors are made
    with ckpt.CheckpointManager(str(tmp_path / "s"), "o") as mgr:
        mgr.restore_latest({"optim": fresh_opt})
    assert {i: {k: _bits(v) for k, v in st.items()} for i, st in fresh_opt.state_dict()["state"].items()} == want


def test_no_snapshot_yet(tmp_path):
    with ckpt.CheckpointManager(str(tmp_path / "s"), "empty") as mgr:
        assert mgr.restore_latest({"model": _model()}) is None


def test_background_error_is_raised_not_lost(tmp_path):
    model = _model()
    store_dir = tmp_path / "s"
    mgr = ckpt.CheckpointManager(str(store_dir), "e")
    mgr.save(1, {"model": model})
    mgr.wait()
    # Break the store for real: chunk writes now fail in the background.
    import shutil

    shutil.rmtree(store_dir / "objects" / "chunks")
    (store_dir / "objects" / "chunks").write_text("not a directory")
    with torch.no_grad():
        model[0].weight.add_(1.0)
    mgr.save(2, {"model": model})  # returns: the failure happens in the background
    with pytest.raises(CkptError):
        mgr.wait()
    with pytest.raises(CkptError):  # the next save starts over, and fails the same way
        mgr.save(3, {"model": model})
        mgr.wait()
    mgr._pool.shutdown()


@pytest.mark.slow  # (3-5 s: CI time, run by .ci/run's slow pass)
def test_ctrl_c_in_wait_is_acted_on_before_the_save_ends(tmp_path):
    """Ctrl-C while a training script waits for its background save: a signal another thread takes
    (a pool starting threads unblocks signals; Python runs the handler in the main thread only once
    that thread runs) left the main thread asleep in ``Future.result()`` until the whole save had
    been written. ``_thread.interrupt_main`` is that case: the handler's flag set, the main thread
    not woken."""
    import _thread
    import time

    model = _model()
    mgr = ckpt.CheckpointManager(str(tmp_path / "s"), "c")
    backend = mgr.store.objects.backend
    real = backend.create_exclusive
    waiting, written = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow(path, blob):  # the save's first write: Ctrl-C once the main thread waits, then a slow disk
        calls.append(path)
        if len(calls) == 1:
            assert waiting.wait(30)
            time.sleep(0.2)  # (the main thread is asleep in wait() by now)
            _thread.interrupt_main()
            time.sleep(3)
            written.set()
        return real(path, blob)

    backend.create_exclusive = slow
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background runner ignores it)
    try:
        mgr.save(1, {"model": model})
        waiting.set()
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
        assert not written.is_set()  # acted on at once, not once the save had been written (3 s later)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        mgr.save(2, {"model": model})  # (a script's final save after Ctrl-C)
        assert written.is_set()  # it waited for the save still in flight, whose staging buffers it reuses
        mgr.wait()
    finally:
        signal.signal(signal.SIGINT, before)
        mgr.close()
        backend.create_exclusive = real
    store = ckpt.Store.open(str(tmp_path / "s"))
    assert store.load("c/step-1")["model/0.weight"].add(1.0).equal(store.load("c/step-2")["model/0.weight"])


def test_a_checkpoint_pushed_under_a_run_step_is_no_snapshot(tmp_path, caplog):
    """A user's .pt with a top-level entry named "snapshot", pushed as run/step-N: retention counted it
    as one of the run's snapshots and removed it (a user's checkpoint lost), and with keep_best its
    "metrics" were read off its entry (an int: AttributeError out of save()). Restoring it said "not
    a snapshot of this ckpt version". Retention now neither counts nor removes it, with a warning;
    restoring it is refused as a pushed checkpoint."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    torch.save({"w": torch.arange(4.0), "snapshot": 7}, tmp_path / "user.pt")
    for step in (0, 9):
        store.push(str(tmp_path / "user.pt"), f"run/step-{step}")
    pushed = [store.resolve("run/step-0"), store.resolve("run/step-9")]
    model = _model()
    with ckpt.CheckpointManager(store, "run", keep_last=1, keep_best=ckpt.KeepBest("loss", "min"), save_mode="sync") as mgr:
        for step, loss in ((1, 0.5), (2, 0.4), (3, 0.3)):
            mgr.save(step, {"model": model}, metrics={"loss": loss})
        with pytest.raises(SnapshotError, match="not a snapshot: it was pushed"):
            mgr.restore({"model": model}, 0)
    assert sorted(store.refs()) == ["run/latest", "run/step-0", "run/step-3", "run/step-9"]
    assert [store.resolve("run/step-0"), store.resolve("run/step-9")] == pushed
    assert "run/step-0 is not a snapshot" in caplog.text
    assert store.verify().ok


@pytest.mark.parametrize("save_mode,tier", [("sync", False), ("async", False), ("async", True)])
def test_a_save_over_a_checkpoint_pushed_as_run_latest_warns_once(tmp_path, save_mode, tier):
    """A user's checkpoint pushed as run/latest while the run trains: the next save moved run/latest to its
    snapshot without a word, and the user's restart resumed the run, not their checkpoint. The save now warns
    (once, naming it and where it stays: run/latest's history), as does the persist that moves it with a local
    tier; saves over the run's own snapshots never do."""
    from ckpt.snapshot.run import TierWarning

    store = ckpt.Store.init(str(tmp_path / "s"))
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kw = {"local": str(tmp_path / "local"), "every_n_steps": 1} if tier else {}
        with ckpt.CheckpointManager(store, "run", save_mode=save_mode, **kw) as mgr:
            for step in (1, 2):
                mgr.save(step, {"model": model, "optim": opt})
            mgr.wait()
            pushed = store.push({"w": torch.arange(4.0)}, "run/latest")
            for step in (3, 4, 5):
                mgr.save(step, {"model": model, "optim": opt})
                mgr.wait()  # (with a tier: each persisted, none superseded in its slot)
        with ckpt.CheckpointManager(store, "run", save_mode=save_mode, **kw) as mgr:  # a restart: its own latest
            assert mgr.restore_latest({"model": model, "optim": opt}) == 5
            mgr.save(6, {"model": model, "optim": opt})
    warned = [str(w.message) for w in caught if issubclass(w.category, TierWarning)]
    assert len(warned) == 1 and f"run/latest names checkpoint {pushed[:12]}, pushed there" in warned[0], warned
    assert store.manifest(store.resolve("run/latest")).extra["snapshot"]["step"] == 6
    assert store.resolve("run/latest@4") == pushed  # (5, 4, 3 moved it since)


@pytest.mark.parametrize("index", ["1", "0"], ids=["index", "no-index"])
def test_a_run_gone_back_whose_latest_is_missing_resumes_its_new_timeline_not_the_highest_step(tmp_path, monkeypatch, index):
    """Saved at 2, 4, 6, 8; taken back to step 4 and saved on at 6 (run/step-6 now of the new timeline), while
    step 8 of the timeline it left stays; then run/latest is removed. The fallback took the highest step, the
    abandoned 8, for run/latest. It takes the snapshot made last now (what run/latest named): the new step 6,
    bit for bit, with the index's summaries or the manifests telling when each was made."""
    monkeypatch.setenv("CKPT_INDEX", index)
    url = str(tmp_path / "s")
    model = _model()
    opt = torch.optim.AdamW(model.parameters())

    def train(mgr, steps):
        for step in steps:
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.maybe_save(step, {"model": model, "optim": opt})

    with ckpt.CheckpointManager(url, "run", every_n_steps=2, save_mode="sync") as mgr:
        train(mgr, range(1, 9))
    with ckpt.CheckpointManager(url, "run", every_n_steps=2, save_mode="sync") as mgr:
        assert mgr.restore({"model": model, "optim": opt}, 4) == 4
        train(mgr, (5, 6))
    want = _state_bits(model, opt)
    store = ckpt.Store.open(url)
    store.remove("run/latest")
    assert sorted(store.refs()) == ["run/step-2", "run/step-4", "run/step-6", "run/step-8"]
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with ckpt.CheckpointManager(url, "run", every_n_steps=2, save_mode="sync") as mgr:
        with pytest.warns(ckpt.TierWarning, match="run/latest is missing .* step 6 "):
            assert mgr.latest_step() == 6
            assert mgr.restore_latest({"model": fresh, "optim": fresh_opt}) == 6
    assert _state_bits(fresh, fresh_opt) == want


def test_steps_and_a_missing_latest_load_the_index_once_on_s3(s3_main_url):
    """steps() and the fallback for a missing run/latest listed refs/ and loaded the metadata index twice: once for
    the run's step refs, once more for which of them are snapshots. The view that told the refs answers both now:
    one GET of the index's snapshot each (the same steps, the same choice)."""
    from s3support import gets_of

    store = ckpt.Store.init(s3_main_url)
    model = _model()
    with ckpt.CheckpointManager(store, "run", save_mode="sync") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": model})
        store.remove("run/latest")
        assert mgr.steps() == [1, 2, 3]  # (the index's snapshot written: what follows reads it)
        with gets_of(store) as gets:
            assert mgr.steps() == [1, 2, 3]
        assert len([g for g in gets if g.endswith(".snap")]) == 1, gets
        with gets_of(store) as gets, pytest.warns(ckpt.TierWarning, match="step 3 "):
            assert mgr.latest_step() == 3
        assert len([g for g in gets if g.endswith(".snap")]) == 1, gets


@pytest.mark.parametrize("index", ["1", "0"], ids=["index", "no-index"])
def test_steps_leave_out_a_checkpoint_pushed_under_the_run(tmp_path, monkeypatch, index):
    """steps() listed every ref RUN/step-N, a user's checkpoint pushed under the name too: restore(N) of
    a step it listed was then refused as "not a snapshot". It tells them by the manifest's source, from
    the metadata index's summaries (no manifest parsed each) where the store has one."""
    monkeypatch.setenv("CKPT_INDEX", index)
    store = ckpt.Store.init(str(tmp_path / "s"))
    torch.save({"w": torch.arange(4.0), "snapshot": {"step": 5}}, tmp_path / "user.pt")
    store.push(str(tmp_path / "user.pt"), "run/step-5")
    store.push({"w": torch.arange(2.0)}, "run/step-7")
    with ckpt.CheckpointManager(store, "run", save_mode="sync") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.ones(2)})
        parsed = []
        real = ckpt.Store.manifest
        monkeypatch.setattr(ckpt.Store, "manifest", lambda self, ref: parsed.append(ref) or real(self, ref))
        assert mgr.steps() == [1, 2]
        assert mgr.steps() == [1, 2]
    assert parsed == ([] if index == "1" else [store.resolve(f"run/step-{s}") for s in (1, 2, 5, 7)] * 2)
    assert sorted(store.refs()) == ["run/latest", "run/step-1", "run/step-2", "run/step-5", "run/step-7"]


def test_a_step_ref_spelled_with_leading_zeros_is_no_step(tmp_path):
    """RUN/step-007 (a snapshot set under a second spelling, then RUN/step-7 removed) was listed by steps()
    as step 7, which restore(7) could not find (it reads RUN/step-7), and the web view's run page showed it
    as step 7, one row with RUN/step-7 where both exist. A step's ref is the manager's spelling alone."""
    from ckpt_store.cli.web.data import StoreView
    from ckpt_store.cli.web.runs import run_doc

    url = str(tmp_path / "s")
    with ckpt.CheckpointManager(url, "run", save_mode="sync") as mgr:
        for step in (1, 7):
            mgr.save(step, {"w": torch.full((2,), float(step))})
    store = ckpt.Store.open(url)
    store.refs_db.set("run/step-007", store.resolve("run/step-7"))
    store.refs_db.set("run/step-01", store.resolve("run/step-1"))
    store.remove("run/step-7")
    with ckpt.CheckpointManager(url, "run", save_mode="sync", keep_last=1) as mgr:
        assert mgr.steps() == [1]
        mgr.save(8, {"w": torch.ones(2)})
    rows = run_doc(StoreView(store), "run")["snapshots"]
    assert [(r["step"], r["ref"], r["live"]) for r in rows] == [(1, "run/step-1", False), (7, "run/step-7", False),
                                                               (8, "run/step-8", True)]
    assert sorted(store.refs()) == ["run/latest", "run/step-007", "run/step-01", "run/step-8"]


def test_retention_never_removes_a_checkpoint_pushed_over_a_step_while_it_prunes(tmp_path, monkeypatch, caplog):
    """Retention checked what RUN/step-N named, then removed the ref by name: a user's push over it in
    between (another process) was removed unseen. The removal now names the checkpoint it checked."""
    url = str(tmp_path / "s")
    model = _model()
    real = ckpt.CheckpointManager._snapshot_id
    pushed: list[str] = []

    def checked_then_a_push_lands(self, step, mid):
        known = real(self, step, mid)
        if step == 1 and not pushed:
            pushed.append(ckpt.Store.open(url).push({"w": torch.arange(3.0)}, "run/step-1"))
        return known

    with ckpt.CheckpointManager(url, "run", keep_last=1, save_mode="sync") as mgr:
        mgr.save(1, {"model": model})
        monkeypatch.setattr(ckpt.CheckpointManager, "_snapshot_id", checked_then_a_push_lands)
        mgr.save(2, {"model": model})  # prunes step 1
    store = ckpt.Store.open(url)
    assert pushed and store.resolve("run/step-1") == pushed[0]  # the user's checkpoint is still there
    assert "run/step-1 moved while it was being pruned" in caplog.text and store.verify().ok


@pytest.mark.parametrize(("retention", "kept", "held"), [
    ({}, list(range(1, 41)), 0), ({"keep_last": 2}, [39, 40], 0),
    ({"keep_last": 2, "keep_best": ckpt.KeepBest("loss", "min")}, [2, 39, 40], 3)], ids=["keep-all", "keep-last", "keep-best"])
def test_the_metrics_a_manager_holds_stay_bounded(tmp_path, retention, kept, held):
    """CheckpointManager kept every save's metrics in memory for the life of the process (one dict per
    save, forever), though only keep_best reads them and a step's manifest holds them too. It keeps
    them with keep_best alone, for the steps retention keeps; what retention keeps is unchanged."""
    model = _model()
    losses = [0.5, 0.1, *[0.9 - i / 100 for i in range(38)]]  # the best is step 2
    with ckpt.CheckpointManager(str(tmp_path / "s"), "run", save_mode="sync", **retention) as mgr:
        for step, loss in enumerate(losses, 1):
            mgr.save(step, {"model": model}, metrics={"loss": loss})
            assert len(mgr._metrics) <= held
        assert mgr.steps() == kept


def test_retention(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "ret", keep_last=2, keep_every=10, keep_best=ckpt.KeepBest("loss", "min")) as mgr:
        for step, loss in zip((5, 10, 15, 20, 25, 30), (0.9, 0.8, 0.1, 0.7, 0.6, 0.5)):
            _train(model, opt)
            mgr.save(step, {"model": model}, metrics={"loss": loss})
        mgr.wait()
        assert mgr.steps() == [10, 15, 20, 25, 30]
        store = mgr.store
    store.gc(grace_s=0)
    assert store.verify().ok
    assert sorted(store.refs()) == ["ret/latest", "ret/step-10", "ret/step-15", "ret/step-20", "ret/step-25", "ret/step-30"]
    with pytest.raises(CkptError):
        store.load("ret/step-5")


@pytest.fixture(params=["local", "s3"])
def durable_url(request, tmp_path):
    return str(tmp_path / "s") if request.param == "local" else request.getfixturevalue("s3_main_url")


@pytest.mark.slow  # (3-5 s: CI time, run by .ci/run's slow pass)
def test_retention_costs_requests_per_step_kept_not_a_listing_of_every_step_saved(durable_url):
    """Every save's retention listed every ref of the store, the run's removed RUN/step-N ones (an
    entry each, and their removal) included: on S3 a LIST page per 1,000 entries, about 30 at 10,000
    saves. It now checks the steps it knows of (listed once, then each saved) against the store: a
    few requests per step kept. Another process's removal of a kept step is seen (counted, the step
    would take the place of one to keep)."""
    model = torch.nn.Linear(4, 4)
    with ckpt.CheckpointManager(durable_url, "run", keep_last=2, save_mode="sync") as mgr:
        for step in range(1, 25):
            mgr.save(step, {"model": model})
        backend = mgr.store.backend
        listed = []
        for op in ("list", "folders", "children"):
            real = getattr(backend, op)
            setattr(backend, op, lambda prefix, *a, real=real: listed.append(prefix.rstrip("/")) or real(prefix, *a))
        mgr.save(25, {"model": model})
        refs_listed = [p for p in listed if p.startswith("refs")]
        assert "refs" not in refs_listed and "refs/run" not in refs_listed
        assert set(refs_listed) <= {"refs/run/latest", "refs/run/step-23", "refs/run/step-24", "refs/run/step-25"}
        ckpt.Store.open(durable_url).remove("run/step-25")  # another process
        mgr.save(26, {"model": model})
        assert mgr.steps() == [24, 26]
        assert ckpt.Store.open(durable_url).verify().ok
        assert _bits(ckpt.Store.open(durable_url).load("run/step-24")["model/weight"]) == _bits(model.weight)


def test_a_delta_snapshot_to_s3_reads_the_previous_ones_small_chunks_from_its_bundle(s3_main_url):
    """With delta_vs_previous each snapshot is delta-encoded against the previous one, whose small
    chunks (norms, biases) the push read one GET each (120 here), though the previous snapshot's
    bundle holds them all. The save reads them from the bundle; the snapshot restores exact."""
    from s3support import chunk_gets

    settings = ckpt.Settings.from_env(workers=2, io_workers=2, cache=False)  # every read a request
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.LayerNorm(64) for _ in range(60)], torch.nn.Linear(512, 512))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))  # (fresh norms are all alike: one chunk)
    with ckpt.CheckpointManager(s3_main_url, "run", delta_vs_previous=True, save_mode="sync", settings=settings) as mgr:
        mgr.save(1, {"model": model})
        m1 = mgr.store.manifest("run/step-1")
        (bundle,) = m1.bundles
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        gets = chunk_gets(mgr.store.objects)
        mgr.save(2, {"model": model})
        m = mgr.store.manifest("run/step-2")
        header = {c for f in m1.files for c in f.chunks} & {c for f in m.files for c in f.chunks}  # its chain read
        assert gets[0] == 1 + len(bundle.chunks) + len(header), gets[0]  # the weight's base, the bundle (was 121 more)
        assert sum(1 for t in m.tensors if any(t.chains())) >= 60  # small chunks are deltas against step 1's
    fresh = torch.nn.Sequential(*[torch.nn.LayerNorm(64) for _ in range(60)], torch.nn.Linear(512, 512))
    with ckpt.CheckpointManager(s3_main_url, "run", settings=settings) as mgr:
        assert mgr.restore_latest({"model": fresh}) == 2
    assert {k: _bits(v) for k, v in fresh.state_dict().items()} == {k: _bits(v) for k, v in model.state_dict().items()}

@pytest.mark.parametrize("index", ["1", "0"])
def test_a_damaged_ref_of_someone_else_does_not_stop_a_runs_saves(tmp_path, monkeypatch, index):
    """Retention lists the run's snapshots through every live ref of the store: one damaged ref
    entry of another run or person in a shared store (here: other/x) made every save of this run
    fail ('ref entry refs/other/x/... is not valid JSON'). A damaged snapshot ref of the run itself
    is kept, not pruned (whether it is live is unknown)."""
    monkeypatch.setenv("CKPT_INDEX", index)
    model = _model()
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push({"w": torch.ones(3)}, "other/x")
    with ckpt.CheckpointManager(store, "ret", keep_last=1, save_mode="sync") as mgr:
        mgr.save(1, {"model": model})
        mgr.save(2, {"model": model})
        (tmp_path / "s" / "refs" / "other" / "x" / "0000000001.ref").write_bytes(b"{")
        (tmp_path / "s" / "refs" / "ret" / "step-2" / "0000000001.ref").write_bytes(b"{")
        for step in (3, 4):
            mgr.save(step, {"model": model})
        assert mgr.steps() == [4]
    assert sorted(os.listdir(tmp_path / "s" / "refs" / "ret" / "step-2")) == ["0000000001.ref"]  # not removed


@pytest.mark.parametrize("local", [False, True], ids=["store", "local_tier"])
def test_retention_after_going_back_keeps_the_new_timeline(tmp_path, local):
    """Saved to 12 (keep_last=2, keep_every=4), taken back to 4 and saved 6 and 8 (a new timeline): the
    last 2 are 6 and 8, the snapshot RUN/latest names and the one before it; the abandoned 10 and 12 are
    left alone. Before, "the last 2" were the abandoned 10 and 12: the ref of the new 6 was removed as
    soon as it was saved (mgr.restore(state, 6) failed; ckpt ls listed only the abandoned timeline)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tier = {"local": str(tmp_path / "local"), "every_n_steps": 2} if local else {}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "back", keep_last=2, keep_every=4, **tier) as mgr:
        for step in (2, 4, 6, 8, 10, 12):
            _train(model, opt)
            mgr.save(step, {"model": model, "optim": opt})
            mgr.wait()  # (each persisted: none superseded by the next)
        mgr.restore({"model": model, "optim": opt}, 4)
        _train(model, opt)
        mgr.save(6, {"model": model, "optim": opt})
        mgr.wait()
        want = _state_bits(model, opt)
        _train(model, opt)
        mgr.save(8, {"model": model, "optim": opt})
        mgr.wait()
        assert mgr.steps() == [4, 6, 8, 10, 12]
        fresh = _model()
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        assert mgr.restore({"model": fresh, "optim": fresh_opt}, 6) == 6 and _state_bits(fresh, fresh_opt) == want


def _weights(store, ref):
    return store.load(ref)


def test_fused_optimizer_never_yields_stale_snapshots(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "f", save_mode="sync") as mgr:
        _train(model, opt)
        mgr.save(1, {"model": model, "optim": opt})
        _train(model, opt)
        mgr.save(2, {"model": model, "optim": opt})
        got = mgr.store.load("f/step-2")
    for k, v in model.state_dict().items():
        assert torch.equal(got[f"model/{k}"], v), k


def test_save_after_restore_stores_the_restored_state(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
        _train(model, opt)
        mgr.save(10, state)
        at10 = {k: v.clone() for k, v in model.state_dict().items()}
        _train(model, opt)
        mgr.save(20, state)
        mgr.restore(state, 10)
        mgr.save(30, state)
        got = mgr.store.load("r/step-30")
    for k, v in at10.items():
        assert torch.equal(got[f"model/{k}"], v), k


def test_fresh_tensors_at_a_reused_address_are_not_mistaken_for_unchanged(tmp_path):
    """torch.get_rng_state() returns a new tensor per call, often at the old one's address."""
    with ckpt.CheckpointManager(str(tmp_path / "s"), "rng", save_mode="sync") as mgr:
        states = []
        for step in range(4):
            torch.rand(10)  # advance the generator
            rng = ckpt.RNGState()
            states.append(torch.get_rng_state().clone())
            mgr.save(step, {"rng": rng})
        for step, expected in enumerate(states):
            assert torch.equal(mgr.store.load(f"rng/step-{step}")["rng/torch"], expected)


def _gate_reads(monkeypatch, after: int) -> tuple[threading.Event, threading.Event]:
    """Holds the save thread's in-place reads after the first ``after`` of them until the
    returned gate opens (the second event: those ``after`` reads are done): the race between
    the background and the optimizer, made deterministic."""
    from ckpt.snapshot.live import LiveTensors

    gate, done, count, original = threading.Event(), threading.Event(), [0], LiveTensors.read

    def read(self, name, offset, length):
        count[0] += 1
        if count[0] > after:
            done.set()
            assert gate.wait(30)
        return original(self, name, offset, length)

    monkeypatch.setattr(LiveTensors, "read", read)
    return gate, done


@pytest.mark.parametrize("read_before_step", [0, 5, 10_000])
def test_overlapped_save_reads_in_place_and_the_step_copies_only_the_rest(tmp_path, monkeypatch, read_before_step):
    """Parameters and moments are read in place by the save thread; the optimizer step copies
    whatever it has not read yet (none of it, part, all) and the snapshot is the state at save()."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    extra = torch.zeros(8)  # not the optimizer's: copied before save() returns
    want, want_opt = _state_bits(model, opt)
    want["extra"] = _bits(extra)
    gate, first_reads_done = _gate_reads(monkeypatch, read_before_step)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "ov", save_mode="overlap") as mgr:
        mgr.save(2, {"model": model, "optim": opt, "extra": extra})
        if read_before_step == 5:
            assert first_reads_done.wait(30)  # five tensors read in place, the next read held
        elif read_before_step > 5:
            mgr.wait()  # the save read (and wrote) everything before the step
        loss = model(torch.randn(4, 64)).pow(2).mean()  # forward/backward while the save reads
        opt.zero_grad()
        loss.backward()
        extra.add_(1)
        opt.step()  # copies what is left, then modifies the parameters
        gate.set()
        mgr.wait()
        assert mgr.last_save.step == 2
        copied = mgr.last_save.copied_at_step_bytes
        deferred = sum(p.nbytes for p in model.parameters()) * 3 + 4 * len(list(model.parameters()))  # + moments, steps
        if read_before_step == 0:
            assert copied == deferred  # nothing read before the step: it copied all of it
        elif read_before_step == 5:
            assert 0 < copied < deferred
        else:
            assert copied == 0  # the save read everything first: no copy at all
        assert _bits(model[0].weight) != want["0.weight"]  # the state moved on
        fresh = _model()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        into = {"model": fresh, "optim": fresh_opt, "extra": torch.full((8,), 5.0)}
        assert mgr.restore_latest(into) == 2
    got, got_opt = _state_bits(fresh, fresh_opt)
    got["extra"] = _bits(into["extra"])
    assert got == want and got_opt == want_opt  # the state as it was when save() was called, bit for bit


def test_overlapped_save_refuses_a_tensor_changed_under_it(tmp_path, monkeypatch):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "ov", save_mode="overlap") as mgr:
        mgr.save(1, {"model": model, "optim": opt})
        mgr.wait()
        _train(model, opt)
        gate, _ = _gate_reads(monkeypatch, 0)
        mgr.save(2, {"model": model, "optim": opt})
        with torch.no_grad():
            model[0].weight.mul_(2)  # not through the optimizer: the snapshot would mix two states
        gate.set()
        with pytest.raises(SnapshotError, match=r"model/0\.weight was modified in place"):
            mgr.wait()
    store = ckpt.Store.open(str(tmp_path / "s"))
    assert store.resolve("ov/latest") == store.resolve("ov/step-1")  # nothing half-read was published
    with pytest.raises(ckpt.errors.RefNotFoundError):
        store.resolve("ov/step-2")


def test_overlapped_save_fails_not_the_step_when_a_tensor_changed_before_it(tmp_path, monkeypatch):
    """A tensor changed before any of it was read: the step still runs; the save fails, unpublished."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "ov", save_mode="overlap") as mgr:
        gate, _ = _gate_reads(monkeypatch, 0)
        mgr.save(1, {"model": model, "optim": opt})
        with torch.no_grad():
            model[2].bias.add_(1)
        _train(model, opt)  # its step copies what is left, and does not raise
        gate.set()
        with pytest.raises(SnapshotError, match=r"model/2\.bias was modified in place"):
            mgr.wait()
    with pytest.raises(ckpt.errors.RefNotFoundError):
        ckpt.Store.open(str(tmp_path / "s")).resolve("ov/latest")


def test_overlap_copy_needs_async_save(tmp_path):
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="needs async_save"):
        ckpt.CheckpointManager(str(tmp_path / "s"), "r", async_save=False, overlap_copy=True)
    assert not (tmp_path / "s").exists()  # refused before anything was created


@pytest.mark.parametrize("old, new", [
    ({"async_save": False}, {"save_mode": "sync"}), ({"overlap_copy": True}, {"save_mode": "overlap"}),
    ({"trust_version": False}, {"unchanged_by": "hash"}), ({"delta": True}, {"delta_vs_previous": True}),
    ({"keep_best": ("loss", "max", 2)}, {"keep_best": ckpt.KeepBest("loss", "max", 2)}),
], ids=lambda d: next(iter(d)))
def test_old_spellings_still_work_with_a_warning(tmp_path, old, new):
    with pytest.warns(DeprecationWarning, match=next(iter(old))):
        a = ckpt.CheckpointManager(str(tmp_path / "a"), "r", **old)
    b = ckpt.CheckpointManager(str(tmp_path / "b"), "r", **new)
    with a, b:
        assert (a.save_mode, a._path.__class__, a.retention, a._target.delta) == \
            (b.save_mode, b._path.__class__, b.retention, b._target.delta)
        assert getattr(a._path, "trust_version", None) == getattr(b._path, "trust_version", None)
        a.save(1, {"w": torch.ones(2)})
        a.wait()
        with pytest.warns(DeprecationWarning, match="last_save"):
            assert a.last_save_stats["step"] == 1 == a.last_save.step


def test_settings_that_belong_to_another_are_refused(tmp_path):
    with pytest.raises(ValueError, match="with process_group"):
        ckpt.CheckpointManager(str(tmp_path / "s"), "r", timeout_s=60)
    with pytest.raises(ValueError, match="save_mode"):
        ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="background")
    with pytest.raises(ValueError, match="unchanged_by"):
        ckpt.CheckpointManager(str(tmp_path / "s"), "r", unchanged_by="data_ptr")
    with pytest.raises(TypeError, match="keep_lats"):
        ckpt.CheckpointManager(str(tmp_path / "s"), "r", keep_lats=3)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("setting", [
    {"every_n_steps": 0}, {"every_n_steps": -5}, {"every_n_steps": 1.5}, {"every_n_steps": True}, {"every_n_steps": "5"},
    {"keep_last": 0}, {"keep_last": -2}, {"keep_last": 2.0}, {"keep_last": False},
    {"keep_every": 0}, {"keep_every": -10}, {"keep_every": 1.5}, {"keep_every": True},
    {"keep_best": ("loss", "min", "x")}, {"keep_best": ("loss", "min", -1)}, {"keep_best": ("loss", "min", 0)},
    {"keep_best": ("loss", "min", True)}, {"keep_best": ("loss", "min", 1.0)}, {"keep_best": ("loss",)},
    {"keep_best": ("loss", "low")}, {"keep_best": (3, "min")}, {"keep_best": ("", "min")}, {"keep_best": "loss"},
    {"keep_best": ("loss", "min", 1, 2)},
    {"timeout_s": 0}, {"timeout_s": -1.0}, {"timeout_s": float("nan")}, {"timeout_s": float("inf")}, {"timeout_s": True},
    {"timeout_s": "60"},
    {"preempt_exit_code": -1}, {"preempt_exit_code": 256}, {"preempt_exit_code": True}, {"preempt_exit_code": 1.0},
], ids=lambda s: "-".join(f"{k}={v!r}" for k, v in s.items()))
@pytest.mark.filterwarnings("ignore:keep_best=:DeprecationWarning")
def test_invalid_settings_are_refused_at_construction(tmp_path, setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        ckpt.CheckpointManager(str(tmp_path / "s"), "r", **setting)
    assert not (tmp_path / "s").exists()  # refused before anything was created


@pytest.mark.parametrize("local", [False, True], ids=["store", "local-tier"])
def test_a_run_name_too_long_for_its_snapshot_refs_is_refused_at_construction(tmp_path, local):
    """A run name of 250 characters is a valid ref name, but RUN/step-N is not: every save failed (with a
    local tier only with a warning each, so training ran on without a single snapshot)."""
    kw = {"local": str(tmp_path / "l")} if local else {}
    with pytest.raises(CkptError, match="run name is 230 characters long; the limit is 229"):
        ckpt.CheckpointManager(str(tmp_path / "s"), "r" * 230, **kw)
    assert not (tmp_path / "s").exists()
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r" * 229, **kw) as mgr:
        mgr.save(2**64 - 1, {"model": _model()}, persist=True if local else None)
    assert ckpt.Store.open(str(tmp_path / "s")).resolve(f"{'r' * 229}/step-{2**64 - 1}")


@pytest.mark.parametrize("local", [False, True], ids=["store", "local-tier"])
@pytest.mark.parametrize("tensor", [torch.zeros(3, dtype=torch.complex128), torch.eye(3).to_sparse()], ids=["complex128", "sparse"])
def test_a_tensor_that_cannot_be_stored_is_refused_by_save_itself(tmp_path, local, tensor):
    """Before, a dtype ckpt cannot store failed each save in the background (with a local tier only with a
    TierWarning: training ran on without a snapshot), and a sparse tensor raised a RuntimeError from torch."""
    kw = {"local": str(tmp_path / "l")} if local else {}
    model = _model()
    model.register_buffer("odd", tensor)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", every_n_steps=1, **kw) as mgr:
        with pytest.raises(CkptError, match="'model/odd': (has dtype torch.complex128|is a sparse_coo)"):
            mgr.save(1, {"model": model})
    assert not ckpt.Store.open(str(tmp_path / "s")).refs()


@pytest.mark.parametrize("local", [False, True], ids=["store", "local-tier"])
def test_dicts_come_back_in_their_key_order(tmp_path, local):
    """A data loader's sources iterated in dict order: restored in sorted order (the records are
    canonical JSON), a round-robin over them drew from another source than the run before the
    restart. Every dict, nested too, keeps its order; a sorted one keeps the plain form."""
    kw = {"local": str(tmp_path / "l")} if local else {}
    sources = {"wiki": 3, "books": {"shard": 2, "offset": 7}, "arxiv": [{"z": 1, "a": (2, 3)}], "c": {"a": 1, "b": 2}}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", **kw) as mgr:
        mgr.save(1, {"model": _model(), "sources": sources}, persist=True if local else None)
        state = {"model": _model(), "sources": None}
        assert mgr.restore_latest(state) == 1
    got = state["sources"]
    assert got == sources and list(got) == ["wiki", "books", "arxiv", "c"]
    assert list(got["books"]) == ["shard", "offset"] and list(got["arxiv"][0]) == ["z", "a"]
    assert type(got["arxiv"][0]["a"]) is tuple


class _Temperature:
    """A Stateful whose state_dict hands out its learnable tensor itself (restored in place when it can be)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd):
        self.t = sd["t"]


@pytest.mark.parametrize("local", [False, True], ids=["store", "local-tier"])
def test_plain_value_tensors_keep_requires_grad_and_parameter(tmp_path, local):
    """A learnable temperature kept as a plain value (not a module's parameter) came back as a tensor
    that no longer required grad (and an nn.Parameter as a plain tensor): the resumed run stopped
    training it, silently. Restore gives back the flags and the class, bit for bit, as saved."""
    kw = {"local": str(tmp_path / "l")} if local else {}
    saved = {"temp": torch.tensor([0.25, -1.5], requires_grad=True), "scale": torch.nn.Parameter(torch.tensor(3.0)),
             "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False), "plain": torch.arange(3.0)}
    learnable = _Temperature(torch.tensor([0.5], requires_grad=True))
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", **kw) as mgr:
        mgr.save(1, {"model": _model(), "extra": saved, "stateful": learnable}, persist=True if local else None)
        # the stateful's own tensor is written in place where it matches; not one of another shape, or without grad
        for live in (torch.zeros(1, requires_grad=True), torch.zeros(2, requires_grad=True), torch.zeros(1)):
            into = _Temperature(live)
            state = {"model": _model(), "extra": None, "stateful": into}
            assert mgr.restore_latest(state) == 1
            assert into.t.requires_grad and into.t.is_leaf and _bits(into.t) == _bits(learnable.t)
    got = state["extra"]
    assert got["temp"].requires_grad and got["temp"].is_leaf and type(got["temp"]) is torch.Tensor
    assert type(got["scale"]) is torch.nn.Parameter and got["scale"].requires_grad
    assert type(got["frozen"]) is torch.nn.Parameter and not got["frozen"].requires_grad
    assert type(got["plain"]) is torch.Tensor and not got["plain"].requires_grad
    assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in saved.items()}
    (got["temp"] * 2).sum().backward()  # a leaf of the resumed graph, as before the restart
    assert got["temp"].grad.tolist() == [2.0, 2.0]


class _Views:
    """A Stateful whose state_dict hands out views of one storage: one broadcast (every element the same
    memory), one transposed, and one that overlaps the transposed one."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base

    def state_dict(self):
        return {"bias": self.base[:1].expand(6), "grid": self.base[:12].view(3, 4).t(), "tail": self.base[8:]}

    def load_state_dict(self, sd):
        self.loaded = sd


def test_a_stateful_of_overlapping_views_restores(tmp_path):
    """The restore wrote a Stateful's own tensors in place where shape and dtype matched: into a broadcast
    view (an expanded tensor, whose elements share one memory location) torch refuses to copy, and the
    restore failed with its RuntimeError once the model had been written. Only contiguous tensors are
    written in place; the others get new ones, bit for bit."""
    saved = _Views(torch.arange(16.0))
    model = _model()
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
        mgr.save(1, {"model": model, "views": saved})
        into = _Views(torch.zeros(16))
        assert mgr.restore_latest({"model": _model(), "views": into}) == 1
    assert {k: _bits(v) for k, v in into.loaded.items()} == {k: _bits(v) for k, v in saved.state_dict().items()}


def test_a_module_with_a_broadcast_buffer_is_refused_before_anything_is_written(tmp_path):
    """A module whose buffer is a broadcast view (``expand()``: every element one memory location) cannot be
    restored into, by torch's load_state_dict either: the restore raised torch's RuntimeError once the other
    tensors had been written. Refused first, naming the buffer."""

    class Broadcast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.ones(1).expand(8))

    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
        mgr.save(1, {"model": _model(), "broadcast": Broadcast()})
        model = _model()
        torch.nn.init.zeros_(model[0].weight)
        with pytest.raises(TensorMismatchError, match="broadcast/scale is a view whose elements share memory"):
            mgr.restore_latest({"model": model, "broadcast": Broadcast()})
    assert not model[0].weight.any()


def test_the_autograd_flags_of_many_tensors_are_looked_up_in_sets(tmp_path, monkeypatch):
    """A plain value holding many parameters (an EMA copy, say) is recorded with the names that
    require grad and are parameters, which a restore looks up for each tensor: in the record's
    lists, a restore grew as tensors times parameters (20,000 parameters: 6.8 s against 2.1 s).
    They are sets once read; what comes back is as saved, flags and class included."""
    import ckpt.snapshot.local_restore as local_path

    saved = [torch.nn.Parameter(torch.randn(3)) for _ in range(2000)] + [torch.randn(2, requires_grad=True)]
    saved[7].requires_grad_(False)
    looked_up = []
    real = local_path.with_autograd_flags

    def recording(name, t, flags):
        looked_up.append({type(v) for v in flags.values()})
        return real(name, t, flags)

    monkeypatch.setattr(local_path, "with_autograd_flags", recording)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
        mgr.save(1, {"ema": saved})
        state = {"ema": None}
        assert mgr.restore_latest(state) == 1
    got = state["ema"]
    assert len(looked_up) == len(saved) and all(kinds == {frozenset} for kinds in looked_up)
    assert [(type(t), t.requires_grad, _bits(t)) for t in got] == [(type(t), t.requires_grad, _bits(t)) for t in saved]


def test_a_restore_walks_each_record_once_before_writing_and_once_with_the_tensors(tmp_path, monkeypatch):
    """A restore read each key's record four or five times: the tensor names, the structure (to refuse
    a malformed record before anything is written), the names again, an optimizer's structure again
    for its parameter groups, then the value with its tensors. The names are noted while the structure
    is decoded, and the structure serves the parameter groups' check: two walks, the checks as they were."""
    import ckpt.snapshot.local_restore as local_path

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt)
    walks: list[int] = []
    real = local_path.unflatten
    monkeypatch.setattr(local_path, "unflatten", lambda value, tensors, **kw: walks.append(1) or real(value, tensors, **kw))
    if hasattr(local_path, "tensor_refs"):
        real_refs = local_path.tensor_refs
        monkeypatch.setattr(local_path, "tensor_refs", lambda tree: walks.append(1) or real_refs(tree))
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
        mgr.save(1, {"model": model, "optim": opt, "extra": {"lr": 0.5, "ema": [torch.ones(2)]}})
        model2 = _model()
        opt2 = torch.optim.AdamW(model2.parameters())
        walks.clear()
        state = {"model": model2, "optim": opt2, "extra": None}
        assert mgr.restore_latest(state) == 1
    assert len(walks) == 1 + 2 + 2  # the module's record once (its tensors go straight in), the others twice
    assert _state_bits(model2, opt2) == _state_bits(model, opt) and state["extra"]["lr"] == 0.5


@pytest.mark.parametrize("flags", [{"requires_grad": ["extra/steps"]}, {"requires_grad": "extra/temp"},
                                   {"parameters": [["extra/temp"]]}], ids=["int-tensor", "not-a-list", "not-a-name"])
def test_a_malformed_record_of_autograd_flags_is_refused_before_anything_is_written(tmp_path, flags):
    """The flags come from a store (outside data): an integer tensor marked as requiring grad made the restore
    fail with torch's RuntimeError once every tensor was written, and flags of the wrong types with a TypeError."""
    import copy
    import dataclasses

    from ckpt_store.storage.commit import commit

    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"model": _model(), "extra": {"temp": torch.ones(2, requires_grad=True), "steps": torch.arange(3)}})
    store = ckpt.Store.open(str(tmp_path / "s"))
    m = store.manifest("r/latest")
    snap = copy.deepcopy(m.extra["snapshot"])
    assert snap["autograd"] == {"requires_grad": ["extra/temp"]}
    snap["autograd"] = flags
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "r/latest")
    model = _model()
    before = {k: _bits(v) for k, v in model.state_dict().items()}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(SnapshotError, match="record of autograd flags is malformed"):
            mgr.restore_latest({"model": model, "extra": None})
    assert {k: _bits(v) for k, v in model.state_dict().items()} == before


@pytest.mark.parametrize("recorded", ["absent", "malformed", "not-a-device"])
def test_a_tensor_from_a_device_this_machine_lacks_is_refused_before_anything_is_written(tmp_path, recorded):
    """A plain-value tensor that lived on a GPU came back on the CPU (its device was not recorded), and the
    resumed run mixed devices. Its device is recorded (CPU tensors are not: such a record has none) and the
    restore makes it there; a device this machine lacks (here cuda:N, N its GPU count) is refused with a
    SnapshotError naming it, as is a malformed record, before the model is touched."""
    import copy
    import dataclasses

    from ckpt_store.storage.commit import commit

    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"model": _model(), "extra": {"t": torch.arange(4.0), "n": 3}})
    store = ckpt.Store.open(str(tmp_path / "s"))
    m = store.manifest("r/latest")
    snap = copy.deepcopy(m.extra["snapshot"])
    assert "devices" not in snap
    lacking = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    snap["devices"] = {"absent": {lacking: ["extra/t"]}, "malformed": {lacking: "extra/t"},
                       "not-a-device": {"no such device": ["extra/t"]}}[recorded]
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "r/latest")
    model = _model()
    torch.nn.init.zeros_(model[0].weight)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(SnapshotError, match=f"extra/t was saved from {lacking}, which this machine lacks"
                           if recorded == "absent" else "record of tensor devices is malformed") as e:
            mgr.restore_latest({"model": model, "extra": None})
    assert not model[0].weight.any()
    if recorded == "absent":
        assert lacking in e.value.hint and "'extra'" in e.value.hint


@pytest.mark.parametrize("value", ["defaultdict", "counter", "nested"])
def test_dicts_with_defaults_are_refused_not_restored_as_plain_dicts(tmp_path, value):
    """A defaultdict (or Counter) in the state came back a plain dict: the resumed loop's
    ``counts[new_key] += 1`` raised KeyError. save() refuses it, naming where it is; an
    OrderedDict (a module's state_dict) is a dict to its reader and still saves."""
    import collections

    made = {"defaultdict": collections.defaultdict(int, a=1), "counter": collections.Counter("aab"),
            "nested": {"seen": [collections.defaultdict(list)]}}[value]
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(CkptError, match="a dict with defaults for missing keys") as e:
            mgr.save(1, {"model": _model(), "counts": made})
        assert "counts" in str(e.value)
        mgr.save(2, {"model": _model(), "order": collections.OrderedDict(b=1, a=2)})
        state = {"model": _model(), "order": None}
        assert mgr.restore_latest(state) == 2 and state["order"] == {"a": 2, "b": 1}
    assert [r for r in ckpt.Store.open(str(tmp_path / "s")).refs() if "step-1" in r] == []


@pytest.mark.parametrize("damage", ["kind", "tensor", "tensor-name", "tag", "step-missing", "step-text", "step-float"])
def test_a_snapshot_record_naming_what_it_lacks_is_refused_before_anything_is_written(tmp_path, damage):
    """A snapshot manifest (content-addressed, so it verifies) whose record is damaged or foreign: a key
    without its kind, or a tensor the manifest does not hold. Before, KeyError tracebacks. Also a tensor
    named by something else than a string (a raw TypeError), a tagged value that does not decode (its
    StoreFormatError came once every tensor was written) and a step that is no int (KeyError, ValueError
    or TypeError once every tensor was written, and 1.5 was restored as step 1)."""
    import copy
    import dataclasses

    from ckpt_store.storage.commit import commit

    model, model2 = _model(), torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                                  torch.nn.LayerNorm(64))
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"model": model, "optim": opt})
    store = ckpt.Store.open(str(tmp_path / "s"))
    m = store.manifest("r/latest")
    snap = copy.deepcopy(m.extra["snapshot"])
    text = json.dumps(snap)
    assert text.count('{"__tensor__": "optim/state/0/exp_avg"}') == 1
    if damage == "kind":
        del snap["tree"]["model"]["kind"]
    elif damage in ("tensor", "tensor-name"):
        other = '"optim/elsewhere"' if damage == "tensor" else '["optim/state/0/exp_avg"]'
        snap = json.loads(text.replace('{"__tensor__": "optim/state/0/exp_avg"}', '{"__tensor__": %s}' % other))
    elif damage == "tag":
        snap["tree"]["optim"]["value"]["param_groups"] = {"__tuple__": 5}
    elif damage == "step-missing":
        del snap["step"]
    else:
        snap["step"] = "1" if damage == "step-text" else 1.5
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "r/latest")
    opt2 = torch.optim.AdamW(model2.parameters())
    before = _state_bits(model2, opt2)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(SnapshotError, match="record of '(model|optim)' (is malformed|names tensors it does not hold)"
                           if not damage.startswith("step") else "the snapshot's step .* is malformed"):
            mgr.restore_latest({"model": model2, "optim": opt2})
    assert _state_bits(model2, opt2) == before and not opt2.state


def test_an_object_given_for_a_value_the_snapshot_holds_is_refused(tmp_path):
    """Saved as ``{"optim": opt.state_dict()}`` (a plain value) and restored into ``{"optim": opt}``: the restore
    replaced the optimizer in the caller's dict with the saved dict and left the optimizer itself fresh, without
    a word (the training loop holds the optimizer, not the dict). Refused before anything is written."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"model": model, "optim": opt.state_dict()})
    model2 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    opt2 = torch.optim.AdamW(model2.parameters())
    before = _state_bits(model2, opt2)
    state = {"model": model2, "optim": opt2}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(TensorMismatchError, match="holds 'optim' as a plain value.*this AdamW would not be restored") as e:
            mgr.restore_latest(state)
        assert "None" in e.value.hint
        assert state["optim"] is opt2 and _state_bits(model2, opt2) == before
        state = {"model": model2, "optim": None}  # the value itself, as the hint says
        assert mgr.restore_latest(state) == 1
    opt2.load_state_dict(state["optim"])
    assert _state_bits(model2, opt2) == _state_bits(model, opt)


def test_a_record_that_an_objects_load_state_dict_rejects_is_a_snapshot_error(tmp_path):
    """A scheduler's record damaged into another JSON value (it decodes, so the pre-check passes it): its
    load_state_dict raised a raw TypeError. A SnapshotError names the key and the object, from the error."""
    import copy
    import dataclasses

    from ckpt_store.storage.commit import commit

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"model": model, "optim": opt, "sched": sched})
    store = ckpt.Store.open(str(tmp_path / "s"))
    m = store.manifest("r/latest")
    snap = copy.deepcopy(m.extra["snapshot"])
    snap["tree"]["sched"]["value"] = [1, 2]
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "r/latest")
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(SnapshotError, match="'sched' \\(StepLR\\) did not take the snapshot's state: its "
                                                "load_state_dict raised TypeError") as e:
            mgr.restore_latest({"model": model, "optim": opt, "sched": sched})
    assert isinstance(e.value.__cause__, TypeError)


def test_valid_settings_are_kept(tmp_path):
    mgr = ckpt.CheckpointManager(str(tmp_path / "s"), "r", every_n_steps=1, keep_last=1, keep_every=1000,
                                 keep_best=ckpt.KeepBest("loss", "max", 2), preempt_exit_code=0)
    with mgr:
        assert mgr.every_n_steps == 1
        assert mgr.retention == ckpt.snapshot.retention.Retention(1, 1000, ckpt.KeepBest("loss", "max", 2))
        assert mgr.preempt_exit_code == 0


@pytest.mark.parametrize("code", [None, 0, 75])
def test_preempted_maybe_save_exits_with_the_configured_code(tmp_path, code):
    """Default 143 (128 + SIGTERM, what the signal itself would have ended the process with)."""
    kw = {} if code is None else {"preempt_exit_code": code}
    model = _model()
    before = signal.getsignal(signal.SIGTERM)
    mgr = ckpt.CheckpointManager(str(tmp_path / "s"), "p", handle_signals=True, **kw)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert mgr.preempted
        with pytest.raises(SystemExit) as e:
            mgr.maybe_save(7, {"model": model})
        assert e.value.code == (143 if code is None else code)
        assert signal.getsignal(signal.SIGTERM) is before  # closed: the handlers are back
        assert mgr.store.resolve("p/latest") == mgr.store.resolve("p/step-7")  # durable before the exit
    finally:
        mgr.close()


def test_an_optimizer_with_other_parameter_groups_is_refused_before_anything_is_written(tmp_path):
    """The snapshot's AdamW optimized the weight only; this one the weight and the bias. torch's
    load_state_dict refuses that, but it ran after the model was already overwritten: now the
    restore says so first, and the state is as it was."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW([m.weight], lr=1e-3)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", save_mode="sync") as mgr:
        mgr.save(1, {"model": m, "optim": opt})
    m2 = torch.nn.Linear(4, 4)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(TensorMismatchError, match="parameter groups"):
            mgr.restore_latest({"model": m2, "optim": opt2})
    assert all(torch.equal(before[k], v) for k, v in m2.state_dict().items()) and not opt2.state


def test_a_nan_metric_neither_stops_the_loop_nor_counts_as_best(tmp_path, caplog):
    # A diverged loss (the Trainer and Lightning callbacks pass the last logged one): save raised
    # a bare ValueError out of the training loop, and that snapshot was lost.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "nan", keep_last=1, keep_best=ckpt.KeepBest("loss", "min")) as mgr:
        for step, loss in ((1, 0.5), (2, 0.1), (3, float("nan")), (4, float("inf")), (5, 0.7)):
            _train(model, opt)
            mgr.save(step, {"model": model}, metrics={"loss": loss, "lr": 0.1})
            mgr.wait()
        assert mgr.steps() == [2, 5]  # the best by a real number, and the latest
        store = mgr.store
    assert store.manifest("nan/step-5").extra["snapshot"]["metrics"] == {"loss": 0.7, "lr": 0.1}
    assert "metric loss is nan" in caplog.text
    with ckpt.CheckpointManager(str(tmp_path / "s"), "nan", keep_best=ckpt.KeepBest("loss", "min")) as mgr:
        mgr.save(6, {"model": model}, metrics={"loss": float("nan")})
        mgr.wait()
        assert mgr.steps() == [2, 6]


@pytest.mark.parametrize("local", [False, True], ids=["store", "local_tier"])
def test_metrics_as_tensors_or_numpy_scalars_are_recorded_and_others_refused_at_once(tmp_path, local):
    """The loss as a 0-dim tensor or a NumPy float32 (what a training loop has at hand) is recorded as a
    number and ranks for keep_best; a metric that is no number is refused by save() itself, before
    anything is saved. Before, the manifest's JSON could not hold them: with no tier the snapshot was
    lost and a bare TypeError came out of the next save; with a local tier every such snapshot, those
    due to the durable store too, was skipped as a tier failure, with a warning: none was ever kept.
    A string metric failed keep_best's ranking after the persist, which then said it had failed."""
    import numpy as np

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tier = {"local": str(tmp_path / "local"), "every_n_steps": 1} if local else {}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "m", keep_last=1, keep_best=ckpt.KeepBest("loss"), **tier) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no TierWarning
            for step, loss in ((1, torch.tensor(0.25)), (2, np.float32(0.125)), (3, torch.tensor(0.5, requires_grad=True))):
                _train(model, opt)
                mgr.save(step, {"model": model}, metrics={"loss": loss, "epoch": np.int64(step)})
                mgr.wait()
        assert mgr.steps() == [2, 3]  # the best and the latest
        assert mgr.store.manifest("m/step-2").extra["snapshot"]["metrics"] == {"loss": 0.125, "epoch": 2}
        for bad in ("0.1", None, torch.ones(2)):
            with pytest.raises(ValueError, match="metric 'loss' of step 4"):
                mgr.save(4, {"model": model}, metrics={"loss": bad})
        mgr.wait()
        assert mgr.steps() == [2, 3]


def test_retention_goes_on_when_the_latest_snapshot_cannot_be_read(tmp_path, monkeypatch):
    """Retention reads RUN/latest's step (the run may have gone back); where that read fails (a
    transient I/O error) it counts every step, as without the read, and the save does not fail."""
    from ckpt_store.storage.errors import StorageIOError

    model = _model()
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r", keep_last=1) as mgr:
        mgr.save(1, {"model": model})
        mgr.wait()
        real = mgr.store.manifest

        def manifest(ref, *args, **kwargs):
            if ref == "r/latest":
                raise StorageIOError("reading r/latest failed (injected)")
            return real(ref, *args, **kwargs)

        monkeypatch.setattr(mgr.store, "manifest", manifest)
        mgr.save(2, {"model": model})
        mgr.wait()
        assert mgr.steps() == [2]


def test_an_optimizer_of_another_class_is_refused_and_old_snapshots_restore_as_before(tmp_path):
    """An AdamW's snapshot restored into an SGD: torch's load_state_dict takes it without a word (the SGD
    keeps AdamW's hyperparameters, its moments ignored). The snapshot records each optimizer's class, as
    text, and a restore into another refuses before anything is written, naming both. A snapshot written
    before the record (the manifest without it) restores as before."""
    import copy
    import dataclasses

    from ckpt_store.storage.commit import commit

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(1, {"model": model, "optim": opt})
    store = ckpt.Store.open(str(tmp_path / "s"))
    m = store.manifest("r/latest")
    assert m.extra["snapshot"]["classes"] == {"optim": "torch.optim.adamw.AdamW"}
    model2 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    sgd = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    before = _state_bits(model2, sgd)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(SnapshotError, match=r"state\['optim'\] is a torch.optim.sgd.SGD, but the snapshot of step 1 "
                                                r"holds the state of a torch.optim.adamw.AdamW") as e:
            mgr.restore_latest({"model": model2, "optim": sgd})
        assert "AdamW" in e.value.hint
        assert _state_bits(model2, sgd) == before and not sgd.state  # nothing written
        adamw = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        assert mgr.restore_latest({"model": model2, "optim": adamw}) == 1
        assert _state_bits(model2, adamw) == _state_bits(model, opt)
    # written by the ckpt before the record: restored into whatever optimizer is given, as torch does
    snap = copy.deepcopy(m.extra["snapshot"])
    del snap["classes"]
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "r/latest")
    adamw = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        assert mgr.restore_latest({"model": model2, "optim": adamw}) == 1
        assert _state_bits(model2, adamw) == _state_bits(model, opt)
        sgd = torch.optim.SGD(model2.parameters(), lr=0.1)
        assert mgr.restore_latest({"model": model2, "optim": sgd}) == 1
    snap["classes"] = ["torch.optim.adamw.AdamW"]  # damaged: refused, not taken for no record
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "r/latest")
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        with pytest.raises(SnapshotError, match="record of its objects. classes is malformed"):
            mgr.restore_latest({"model": model2, "optim": adamw})


def test_the_first_retention_of_a_manager_reads_no_manifest_per_step(tmp_path, monkeypatch):
    """A manager's first retention listed the run's steps, then read each step's manifest to tell the
    snapshots from checkpoints pushed under the run's name: one read per step (a run's thousands). The
    index's summaries, from the view that listed the steps, tell them: a pushed one alone is read (and
    named in a warning), as are the manifests the save itself reads."""
    store = ckpt.Store.init(str(tmp_path / "s"))
    model = _model()
    with ckpt.CheckpointManager(store, "r", save_mode="sync") as mgr:
        for step in range(1, 7):
            mgr.save(step, {"model": model})
    store.push({"w": torch.arange(2.0)}, "r/step-3")  # a user's checkpoint under the run's name: kept, not counted
    ids = {s: store.resolve(f"r/step-{s}") for s in range(1, 7)}
    parsed = []
    real = ckpt.Store.manifest
    monkeypatch.setattr(ckpt.Store, "manifest", lambda self, ref: parsed.append(ref) or real(self, ref))
    with ckpt.CheckpointManager(store, "r", save_mode="sync", keep_last=2) as mgr:
        mgr.save(7, {"model": model})
        assert mgr.steps() == [6, 7]
    assert sorted(store.refs()) == ["r/latest", "r/step-3", "r/step-6", "r/step-7"]
    assert [ref for ref in parsed if ref in {ids[s] for s in (1, 2, 4, 5)}] == [], parsed
    assert parsed.count(ids[3]) == 1


@pytest.mark.parametrize("tier", [False, True], ids=["store", "local_tier"])
def test_a_missing_latest_without_an_index_reads_the_chosen_manifest_once(tmp_path, monkeypatch, tier):
    """RUN/latest missing in a store without a metadata index: the choice of the newest snapshot reads each
    step's manifest, and the restore (and latest_step, and a save's check of the durable store) then read
    the chosen one a second time. The manifests the choice read serve them."""
    monkeypatch.setenv("CKPT_INDEX", "0")
    url = str(tmp_path / "s")
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with ckpt.CheckpointManager(url, "r", save_mode="sync") as mgr:
        for step in (1, 2, 3):
            _train(model, opt)
            mgr.save(step, {"model": model, "optim": opt})
    store = ckpt.Store.open(url)
    store.remove("r/latest")
    chosen = store.resolve("r/step-3")
    want = _state_bits(model, opt)
    parsed = []
    real = ckpt.Store.manifest
    monkeypatch.setattr(ckpt.Store, "manifest", lambda self, ref: parsed.append(ref) or real(self, ref))
    kw = {"local": str(tmp_path / "tier"), "local_every_n_steps": 1, "every_n_steps": 1} if tier else {}
    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters())
    with ckpt.CheckpointManager(url, "r", save_mode="sync", **kw) as mgr, pytest.warns(ckpt.TierWarning, match="step 3 "):
        assert mgr.latest_step() == 3
        assert parsed.count(chosen) == 1, parsed
        parsed.clear()
        assert mgr.restore_latest({"model": model2, "optim": opt2}) == 3
        assert parsed.count(chosen) == 1, parsed
        assert _state_bits(model2, opt2) == want


def test_an_lr_scheduler_of_another_class_is_refused_from_either_tier_and_old_snapshots_restore_as_before(tmp_path):
    """A StepLR's snapshot restored into a CosineAnnealingLR or a OneCycleLR: torch's load_state_dict takes
    it without a word (the scheduler's __dict__ updated with StepLR's fields) and training resumes on
    another schedule. The snapshot records each scheduler's class beside the optimizers' (a SequentialLR's
    with its children's, whose states torch loads into the children at their places), and a restore into
    another refuses before anything is written, naming both: from the local tier and from the durable
    store; so does one into a key saved as another kind of object (a module's state, a grad scaler's),
    which a scheduler's load_state_dict takes too. A snapshot without the record restores as before;
    one with the previous release's record of its optimizers alone has them checked, its schedulers not."""
    import copy
    import dataclasses

    from torch.optim import lr_scheduler as L

    from ckpt_store.storage.commit import commit

    def fresh():
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = L.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        _train(model, opt)
        sched.step()
    saved = copy.deepcopy(sched.state_dict())
    store_url, node = str(tmp_path / "s"), str(tmp_path / "node")
    with ckpt.CheckpointManager(store_url, "r", every_n_steps=2, local=node, local_every_n_steps=1) as mgr:
        mgr.save(2, {"model": model, "optim": opt, "sched": sched, "scaler": torch.amp.GradScaler("cpu")})  # local and durable
    store = ckpt.Store.open(store_url)
    m = store.manifest("r/latest")
    assert m.extra["snapshot"]["classes"] == {"optim": "torch.optim.sgd.SGD", "sched": "torch.optim.lr_scheduler.StepLR"}
    for tier in ("local", "store"):
        with ckpt.CheckpointManager(store_url, "r", **({"local": node} if tier == "local" else {})) as mgr:
            for other in (lambda o: L.CosineAnnealingLR(o, T_max=10), lambda o: L.OneCycleLR(o, max_lr=1.0, total_steps=100)):
                model2, opt2 = fresh()
                sched2 = other(opt2)
                before, sched_before = _state_bits(model2, opt2), copy.deepcopy(sched2.state_dict())
                name = type(sched2).__name__
                with pytest.raises(SnapshotError, match=rf"state\['sched'\] is a torch.optim.lr_scheduler.{name}, but the "
                                                        r"snapshot of step 2 holds the state of a torch.optim.lr_scheduler"
                                                        r".StepLR: its state would be taken as another LR scheduler's") as e:
                    mgr.restore_latest({"model": model2, "optim": opt2, "sched": sched2})
                assert "restore into a StepLR" in e.value.hint
                assert _state_bits(model2, opt2) == before and sched2.state_dict() == sched_before  # nothing written
            model2, opt2 = fresh()
            sched2 = L.StepLR(opt2, step_size=7)
            assert mgr.restore_latest({"model": model2, "optim": opt2, "sched": sched2}) == 2
            assert mgr.last_restore[tier] > 0
            assert _state_bits(model2, opt2) == _state_bits(model, opt) and sched2.state_dict() == saved
            assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # a key saved as no optimizer or scheduler (a module's, a grad scaler's state): a scheduler's __dict__ takes it
    with ckpt.CheckpointManager(store_url, "r") as mgr:
        for key in ("model", "scaler"):
            model2, opt2 = fresh()
            sched2 = L.StepLR(opt2, step_size=2, gamma=0.5)
            sched_before = copy.deepcopy(sched2.state_dict())
            with pytest.raises(SnapshotError, match=rf"state\['{key}'\] is a torch.optim.lr_scheduler.StepLR, but the "
                                                    rf"snapshot of step 2 holds no optimizer's or LR scheduler's state "
                                                    rf"under '{key}'"):
                mgr.restore_latest({key: sched2})
            assert sched2.state_dict() == sched_before
    # A scheduler made of others: SequentialLR's load_state_dict loads each saved child into the child at its place
    def sequential(second):
        model2, opt2 = fresh()
        return L.SequentialLR(opt2, [L.LinearLR(opt2, total_iters=2), second(opt2)], milestones=[2])

    seq = sequential(lambda o: L.CosineAnnealingLR(o, T_max=10))
    for _ in range(3):
        seq.optimizer.step()
        seq.step()
    with ckpt.CheckpointManager(store_url, "q") as mgr:
        mgr.save(3, {"sched": seq})
        mgr.wait()
        assert store.manifest("q/latest").extra["snapshot"]["classes"]["sched"] == (
            "torch.optim.lr_scheduler.SequentialLR[torch.optim.lr_scheduler.LinearLR, torch.optim.lr_scheduler.CosineAnnealingLR]")
        seq2 = sequential(lambda o: L.StepLR(o, step_size=3))
        seq2_before = copy.deepcopy(seq2.state_dict())
        with pytest.raises(SnapshotError, match=r"SequentialLR\[torch.optim.lr_scheduler.LinearLR, torch.optim.lr_scheduler"
                                                r".StepLR\], but .* holds the state of a torch.optim.lr_scheduler.SequentialLR"
                                                r"\[torch.optim.lr_scheduler.LinearLR, torch.optim.lr_scheduler"
                                                r".CosineAnnealingLR\]") as e:
            mgr.restore_latest({"sched": seq2})
        assert "restore into a SequentialLR[LinearLR, CosineAnnealingLR]" in e.value.hint
        assert seq2.state_dict() == seq2_before
        seq3 = sequential(lambda o: L.CosineAnnealingLR(o, T_max=10))
        assert mgr.restore_latest({"sched": seq3}) == 3 and seq3.state_dict() == seq.state_dict()
    # written by the ckpt before the record: restored into whatever scheduler is given, as torch does
    snap = copy.deepcopy(m.extra["snapshot"])
    del snap["classes"]
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "r/latest")
    with ckpt.CheckpointManager(store_url, "r") as mgr:
        model2, opt2 = fresh()
        cosine = L.CosineAnnealingLR(opt2, T_max=10)
        assert mgr.restore_latest({"model": model2, "optim": opt2, "sched": cosine}) == 2
        assert cosine.state_dict()["step_size"] == 2 and _state_bits(model2, opt2) == _state_bits(model, opt)
    # written by the release that recorded its optimizers alone: those checked, the schedulers not
    snap["optimizers"] = {"optim": "torch.optim.sgd.SGD"}
    commit(store.objects, store.refs_db, dataclasses.replace(m, extra={**m.extra, "snapshot": snap}).to_json(), "r/latest")
    with ckpt.CheckpointManager(store_url, "r") as mgr:
        model2, _ = fresh()
        with pytest.raises(SnapshotError, match=r"is a torch.optim.adamw.AdamW, but .* holds the state of a torch.optim.sgd.SGD"):
            mgr.restore_latest({"model": model2, "optim": torch.optim.AdamW(model2.parameters())})
        model2, opt2 = fresh()
        assert mgr.restore_latest({"model": model2, "optim": opt2, "sched": L.CosineAnnealingLR(opt2, T_max=10)}) == 2


def test_a_scheduler_accelerate_wraps_is_checked_as_the_one_it_steps(tmp_path):
    """A transformers Trainer may hold its scheduler wrapped in accelerate's AcceleratedScheduler (not an
    LRScheduler; its state_dict is the wrapped one's): the record names the scheduler it steps, and a
    restore into a wrapper of another scheduler is refused as the scheduler itself would be."""
    accelerate_scheduler = pytest.importorskip("accelerate.scheduler")
    from torch.optim import lr_scheduler as L

    def wrapped(make):
        opt = torch.optim.SGD(_model().parameters(), lr=0.1)
        return accelerate_scheduler.AcceleratedScheduler(make(opt), opt)

    sched = wrapped(lambda o: L.StepLR(o, step_size=2, gamma=0.5))
    for _ in range(3):
        sched.scheduler.optimizer.step()
        sched.scheduler.step()
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        mgr.save(3, {"sched": sched})
        mgr.wait()
        assert ckpt.Store.open(str(tmp_path / "s")).manifest("r/latest").extra["snapshot"]["classes"] == {
            "sched": "torch.optim.lr_scheduler.StepLR"}
        cosine = wrapped(lambda o: L.CosineAnnealingLR(o, T_max=10))
        before = cosine.state_dict()
        with pytest.raises(SnapshotError, match=r"is a torch.optim.lr_scheduler.CosineAnnealingLR, but the snapshot of "
                                                r"step 3 holds the state of a torch.optim.lr_scheduler.StepLR"):
            mgr.restore_latest({"sched": cosine})
        assert cosine.state_dict() == before
        again = wrapped(lambda o: L.StepLR(o, step_size=5))
        assert mgr.restore_latest({"sched": again}) == 3 and again.state_dict() == sched.state_dict()


def test_a_module_whose_state_dict_hands_out_copies_is_restored_through_its_load_state_dict(tmp_path):
    """A module whose state_dict() gives copies of its tensors (a state dict hook's, as wrappers that
    hand out weights in another form install): a restore wrote the snapshot into those copies and reported
    success, the module keeping its own values. Written into the copies, the state is loaded through the
    module's load_state_dict, as torch loads it; a module whose state_dict gives its own tensors is still
    written in place. Saved twice (a change between), the second restore gives the second state."""

    class Copied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.register_state_dict_post_hook(lambda module, sd, prefix, meta: sd.update({k: v.clone() for k, v in sd.items()}))

        def forward(self, x):
            return self.norm(self.lin(x))

    def bits(module):
        return {k: _bits(v) for k, v in module.state_dict().items()}

    torch.manual_seed(0)
    model, plain = Copied(), _model()
    opt = torch.optim.AdamW([*model.parameters(), *plain.parameters()], lr=1e-2)
    with ckpt.CheckpointManager(str(tmp_path / "s"), "r") as mgr:
        for step in (1, 2):
            loss = model(torch.randn(4, 16)).pow(2).mean() + plain(torch.randn(4, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.save(step, {"model": model, "plain": plain})
            mgr.wait()
            want = bits(model), bits(plain)
            torch.manual_seed(1)
            model2, plain2 = Copied(), _model()
            # written in place: never through its load_state_dict (which would also keep the same Parameters)
            plain2.load_state_dict = lambda *a, **k: pytest.fail("a module handing out its own tensors was loaded")
            assert bits(model2) != want[0]
            assert mgr.restore({"model": model2, "plain": plain2}, step) == step
            assert (bits(model2), bits(plain2)) == want


def _frozen_base_run(seed=0, fused=False):
    """A frozen base, a trained head and AdamW over the head: 10 tensors, 8 of which each step changes."""
    torch.manual_seed(seed)
    base, head = torch.nn.Linear(256, 256).requires_grad_(False), torch.nn.Linear(256, 8)
    return {"base": base, "head": head, "optim": torch.optim.AdamW(head.parameters(), lr=1e-2, fused=fused), "step": 0}


def _head_step(state, step):
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step))  # the same batch for a step in every run
    state["head"](state["base"](x)).square().mean().backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["step"] = step


def _run_bytes(state):
    from ckpt.snapshot.state import flatten

    return {n: t.detach().numpy().tobytes() for n, t in flatten(state)[0].items()}


def test_the_first_save_after_a_restore_stages_only_what_changed(tmp_path):
    """A restore writes tensors without bumping their version counters and recorded none: the first save after it
    copied every tensor into staging (a frozen base too) and counted none as changed for a local tier's room. It
    records what it wrote now, as a save does: a step after it stages the head and its optimizer state only (into
    tensors the restore made anew at a restart, or wrote into in the same process), a save with no step between
    stages nothing and names the restored snapshot's chunks; the run stays bit-identical to one never interrupted.
    A fused optimizer (versions not trusted) still stages everything."""
    whole = _frozen_base_run()
    with ckpt.CheckpointManager(str(tmp_path / "a"), "run", save_mode="sync") as mgr:
        for step in (1, 2, 3, 4):
            _head_step(whole, step)
            mgr.save(step, whole)
    state = _frozen_base_run()
    with ckpt.CheckpointManager(str(tmp_path / "b"), "run", save_mode="sync") as mgr:
        for step in (1, 2):
            _head_step(state, step)
            mgr.save(step, state)
    state = _frozen_base_run(seed=1)  # a restart: other values, an optimizer without state
    with ckpt.CheckpointManager(str(tmp_path / "b"), "run", save_mode="sync") as mgr:
        assert mgr.restore_latest(state) == 2
        staged = []
        for step in (3, 3, 4):  # (the second 3: after going back to 2 in this process, written into its tensors)
            if step == 3 and staged:
                assert mgr.restore(state, 2) == 2
            _head_step(state, step)
            mgr.save(step, state)
            staged.append((mgr.last_save.staged_tensors, mgr.last_save.reused_tensors))
        assert staged == [(8, 2)] * 3  # (it was (10, 0) after each restore)
        assert _run_bytes(state) == _run_bytes(whole)
        stored = mgr.store.load("run/step-4")
        assert {n: t.numpy().tobytes() for n, t in stored.items()} == _run_bytes(whole)
    state = _frozen_base_run(seed=2)
    with ckpt.CheckpointManager(str(tmp_path / "b"), "run", save_mode="sync") as mgr:
        assert mgr.restore_latest(state) == 4
        state["step"] = 5
        mgr.save(5, state)  # nothing changed since the restore
        assert (mgr.last_save.staged_tensors, mgr.last_save.reused_tensors, mgr.last_save.written_bytes) == (0, 10, 0)
        four, five = mgr.store.manifest("run/step-4"), mgr.store.manifest("run/step-5")
        assert [t.chunks for t in five.tensors] == [t.chunks for t in four.tensors]
    fused = _frozen_base_run(fused=True)
    with ckpt.CheckpointManager(str(tmp_path / "c"), "run", save_mode="sync") as mgr:
        _head_step(fused, 1)
        mgr.save(1, fused)
        assert mgr.restore_latest(fused) == 1
        _head_step(fused, 2)
        mgr.save(2, fused)
        assert mgr.last_save.staged_tensors == 10
        assert {n: t.numpy().tobytes() for n, t in mgr.store.load("run/step-2").items()} == _run_bytes(fused)


class _TinyLM(torch.nn.Module):
    """An embedding and an output layer over one vocabulary, tied (one tensor under both names) or not."""

    def __init__(self, tied):
        super().__init__()
        self.embed, self.out = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False)
        if tied:
            self.out.weight = self.embed.weight


def test_a_restore_into_tied_tensors_records_no_version_for_them(tmp_path):
    """A snapshot of an untied model restored into a tied one (and one module's weight restored into another
    module sharing it): the fill writes both entries into the one memory, the last one wins, and the restore recorded
    the same version for both names. The next save reused both entries' chunks: the stored step said the embedding
    was its old bytes, not the live tensor's. Tensors sharing memory are staged and hashed now; what is stored is
    the live state, byte for byte, after a save with no step and after a training step."""
    torch.manual_seed(0)
    untied = _TinyLM(tied=False)
    lone = torch.nn.Linear(32, 64, bias=False)
    with ckpt.CheckpointManager(str(tmp_path), "run", save_mode="sync") as mgr:
        mgr.save(1, {"model": untied, "other": lone})
    torch.manual_seed(1)
    model = _TinyLM(tied=True)
    other = torch.nn.Linear(32, 64, bias=False)
    other.weight = model.embed.weight  # (another key's module holding the same tensor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "other": other}
    with ckpt.CheckpointManager(str(tmp_path), "run", save_mode="sync") as mgr:
        assert mgr.restore_latest(state) == 1
        for step in (2, 3):
            if step == 3:
                model.out(model.embed(torch.tensor([[1, 2, 3]]))).square().mean().backward()
                opt.step()
            mgr.save(step, state)
            stored = mgr.store.load(f"run/step-{step}")
            assert {n: t.numpy().tobytes() for n, t in stored.items()} == _run_bytes(state)


class _Transposed(torch.nn.Module):
    """``b`` is ``a`` transposed (tied=True: one memory, ``b`` a non-contiguous view of it), or its own tensor."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4, 6))
        self.b = torch.nn.Parameter(self.a.data.t() if tied else torch.randn(6, 4))


def test_a_restore_into_a_transposed_tie_records_no_version_for_the_contiguous_side(tmp_path):
    """An untied snapshot restored into a model whose ``b`` is ``a`` transposed: the fill writes ``b`` (a
    non-contiguous view) over ``a``'s bytes. The guard against ties counted only contiguous tensors' memory, so
    ``a`` looked alone and was recorded unchanged: the next save reused step 1's chunk for ``a``, not the bytes
    it holds. Now a non-contiguous tensor's whole storage counts as written by it: ``a`` is staged and hashed."""
    torch.manual_seed(0)
    with ckpt.CheckpointManager(str(tmp_path), "run", save_mode="sync") as mgr:
        mgr.save(1, {"model": _Transposed(tied=False)})
    model = _Transposed(tied=True)
    with ckpt.CheckpointManager(str(tmp_path), "run", save_mode="sync") as mgr:
        assert mgr.restore_latest({"model": model}) == 1
        mgr.save(2, {"model": model})
        stored = mgr.store.load("run/step-2")
    assert {n: t.numpy().tobytes() for n, t in stored.items()} == _run_bytes({"model": model})


@pytest.mark.parametrize("save_mode", ["async", "overlap"])
@pytest.mark.parametrize("local", [False, True], ids=["store", "local-tier"])
def test_batch_norm_statistics_are_saved_at_every_snapshot(tmp_path, save_mode, local):
    """torch.batch_norm updates a BatchNorm's running statistics in place without bumping their version
    counters: every snapshot after the first reused the statistics of the first (found with a killed and
    resumed run whose losses were bit-identical, training mode using the batch's statistics, and whose
    running_mean and running_var were not). A module's buffers are read at every save: the snapshot of
    step 3 restores the statistics as they were at step 3, bit for bit, and an eval gives the same output."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kw = {"local": str(tmp_path / "l"), "every_n_steps": 1} if local else {}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "run", save_mode=save_mode, **kw) as mgr:
        for step in (1, 2, 3):
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model, "optim": opt})
        mgr.wait()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)
    expected = model.eval()(x)
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    with ckpt.CheckpointManager(str(tmp_path / "s"), "run", **kw) as mgr:
        assert mgr.restore_latest({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)}) == 3
    assert {k: _bits(v) for k, v in fresh.state_dict().items()} == {k: _bits(v) for k, v in want.items()}
    assert _bits(fresh.eval()(x).detach()) == _bits(expected.detach())


class _AppState:
    """The wrapper torch.distributed.checkpoint's docs recommend (a trainer handing out its model's state)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "nested": [{"bn": self.model[1].running_var}]}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])


class _DataAliases:
    """Hands out ``.data`` aliases of the parameters (older code does): a version counter of their own, which the
    optimizer's step does not bump."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {"p": [p.data for p in self.model.parameters()], "b": [b for b in self.model.buffers()]}

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            for t, v in zip([*self.model.parameters(), *self.model.buffers()], [*sd["p"], *sd["b"]]):
                t.copy_(v)


class _Stats:
    """Running statistics kept as plain tensors, updated by F.batch_norm (which bumps no version counter)."""

    def __init__(self) -> None:
        self.mean, self.var = torch.zeros(8), torch.ones(8)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var}

    def load_state_dict(self, sd: dict) -> None:
        self.mean.copy_(sd["mean"])
        self.var.copy_(sd["var"])


@pytest.mark.parametrize("wrap", ["appstate", "perrank", "state_dict", "functional", "data_aliases"])
@pytest.mark.parametrize("local", [False, True], ids=["store", "local-tier"])
def test_tensors_a_state_dict_hands_out_are_read_at_every_save(tmp_path, wrap, local):
    """Version counters are trusted only for parameters and optimizer state: BatchNorm statistics reached through a
    Stateful wrapper (DCP's AppState, also nested in a list), PerRank(model), a module's state_dict() passed as a plain
    value, or plain tensors F.batch_norm updates (their _version stays 0) were reused from the first snapshot in every
    later one (only a module's own buffers were read again); so were the parameters a Stateful handed out as ``.data``
    aliases (trusted by their memory alone): step 3's snapshot restores step 3's bytes."""
    from ckpt.snapshot.state import PerRank

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stats = _Stats()
    wrapped = {"appstate": lambda: _AppState(model), "perrank": lambda: PerRank(model),
               "state_dict": lambda: model.state_dict(), "functional": lambda: stats,
               "data_aliases": lambda: _DataAliases(model)}[wrap]
    kw = {"local": str(tmp_path / "l"), "every_n_steps": 1} if local else {}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "run", save_mode="async", **kw) as mgr:
        for step in (1, 2, 3):
            x = torch.randn(16, 4)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            torch.nn.functional.batch_norm(torch.randn(16, 8), stats.mean, stats.var, training=True)
            mgr.save(step, {"m": wrapped(), "optim": opt})
        mgr.wait()
    assert stats.mean._version == 0  # (what made it stale)
    want = {k: _bits(v) for k, v in {**model.state_dict(), "mean": stats.mean, "var": stats.var}.items()}
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stats = _Stats()
    state = {"m": wrapped(), "optim": opt}
    with ckpt.CheckpointManager(str(tmp_path / "s"), "run", **kw) as mgr:
        assert mgr.restore_latest(state) == 3
    if wrap == "state_dict":  # (a plain value: restored as new tensors)
        model.load_state_dict(state["m"])
    got = {k: _bits(v) for k, v in {**model.state_dict(), "mean": stats.mean, "var": stats.var}.items()}
    if wrap == "functional":
        assert (got["mean"], got["var"]) == (want["mean"], want["var"])
    else:
        assert got == {**want, "mean": got["mean"], "var": got["var"]}


def test_a_buffer_without_a_storage_of_its_own_does_not_break_a_save(tmp_path):
    """A non-persistent buffer that is a wrapper tensor subclass (no storage: state_dict leaves it out) made every save
    raise 'Attempted to access the data pointer on an invalid python storage' since buffers' storages were looked up
    for every module; it saves, and the module's parameters restore bit for bit."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2)
    m.register_buffer("cache", TwoTensor(torch.zeros(2), torch.zeros(2)), persistent=False)
    with ckpt.CheckpointManager(str(tmp_path), "run", save_mode="sync") as mgr:
        mgr.save(1, {"m": m})
        mgr.save(2, {"m": m})
    fresh = torch.nn.Linear(2, 2)
    with ckpt.CheckpointManager(str(tmp_path), "run") as mgr:
        assert mgr.restore_latest({"m": fresh}) == 2
    assert {k: _bits(v) for k, v in fresh.state_dict().items()} == {k: _bits(v) for k, v in m.state_dict().items()}


def test_common_writes_outside_an_optimizer_step_reach_every_snapshot(tmp_path):
    """Writes a training loop makes outside optimizer.step, checked for what they do to version counters (torch 2.x):
    swa_utils' EMA update_parameters and load_state_dict bump them, parametrize's original is a parameter the step
    bumps, vector_to_parameters (and model averaging) give parameters new storage (a new key), update_bn and
    functional_call run batch norm on buffers (no bump: read at every save). Each state's step-3 bytes come back."""
    from torch.nn.utils import parametrize, vector_to_parameters
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

    class _Sym(torch.nn.Module):
        def forward(self, x):
            return x.triu() + x.triu(1).T

    def net():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))

    torch.manual_seed(0)
    model, vec, func = net(), net(), net()
    parametrize.register_parametrization(model[0], "weight", _Sym())
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model, "ema": ema, "vec": vec, "func": func, "optim": opt}
    with ckpt.CheckpointManager(str(tmp_path), "run", save_mode="async") as mgr:
        for step in (1, 2, 3):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
            update_bn([torch.randn(8, 4)], ema)
            vector_to_parameters(torch.randn(28), vec.parameters())
            torch.func.functional_call(func, {**dict(func.named_parameters()), **dict(func.named_buffers())}, (torch.randn(8, 4),))
            mgr.save(step, state)
        mgr.wait()
    want = {k: {n: _bits(t) for n, t in m.state_dict().items()} for k, m in state.items() if k != "optim"}
    torch.manual_seed(1)
    model2, vec2, func2 = net(), net(), net()
    parametrize.register_parametrization(model2[0], "weight", _Sym())
    fresh = {"model": model2, "ema": AveragedModel(model2, multi_avg_fn=get_ema_multi_avg_fn(0.9)), "vec": vec2,
             "func": func2, "optim": torch.optim.AdamW(model2.parameters(), lr=0.1)}
    with ckpt.CheckpointManager(str(tmp_path), "run") as mgr:
        assert mgr.restore_latest(fresh) == 3
    assert {k: {n: _bits(t) for n, t in m.state_dict().items()} for k, m in fresh.items() if k != "optim"} == want


def _fused_run_bytes(model: torch.nn.Module) -> dict[str, bytes]:
    return {n: t.detach().numpy().tobytes() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("end", ["live", "collected"])
def test_a_fused_optimizer_kept_out_of_the_state_turns_version_counters_off(tmp_path, end):
    """A fused optimizer bumps no version counter, and one kept out of the state (the model saved alone) was not seen:
    every snapshot after the first held the first's bytes (hunt21-v4). Any fused optimizer stepping in the process
    while the manager lives turns version counters off for good: also once it is collected before a save (a watch
    that forgot it believed the keys recorded meanwhile, and that save held step 1's bytes: review rev22v)."""
    import gc

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    with ckpt.CheckpointManager(str(tmp_path), "run", save_mode="sync") as mgr:
        for step in (1, 2, 3):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 3 and end == "collected":
                del opt
                gc.collect()
            mgr.save(step, {"model": model})
            assert {n: t.numpy().tobytes() for n, t in mgr.store.load(f"run/step-{step}").items()} == \
                {f"model/{n}": b for n, b in _fused_run_bytes(model).items()}, step


def test_the_fused_optimizer_watch_never_fails_a_step_and_goes_with_its_manager(tmp_path):
    """The watch is a process-wide step pre-hook: an optimizer it cannot hash or read must still step (review rev22v:
    an unhashable fused subclass failed its step while a manager was open), and a manager closed, or dropped unclosed,
    leaves no hook behind (50 dropped managers left 50 hooks running at every step of every optimizer)."""
    import gc

    from torch.optim.optimizer import _global_optimizer_pre_hooks

    class Unhashable(torch.optim.AdamW):
        def __eq__(self, other: object) -> bool:  # (makes it unhashable)
            return self is other

    before = len(_global_optimizer_pre_hooks)
    model = torch.nn.Linear(4, 2)
    opt = Unhashable(model.parameters(), fused=True)
    mgr = ckpt.CheckpointManager(str(tmp_path), "run", save_mode="sync")
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    mgr.close()
    assert len(_global_optimizer_pre_hooks) == before
    for i in range(5):
        ckpt.CheckpointManager(str(tmp_path), f"run{i}", save_mode="sync")  # (never closed)
    gc.collect()
    assert len(_global_optimizer_pre_hooks) == before
