"""ckpt.remix: choosing the best past fine-tunes and averaging them (the README example runs in tests/test_readme.py)."""

from __future__ import annotations

import pathlib

import pytest
import torch

import ckpt
from ckpt.errors import InvalidMergeError
from ckpt.merging.remixing import choose, remix_scores

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_choose():
    assert choose({"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.9}, 2) == (["b", "d"], [1.0, 1.0])  # ties: candidate order
    assert choose({"a": 0.1, "b": 0.9}, 5) == (["b", "a"], [1.0, 1.0])  # fewer candidates than k: all of them
    assert choose({"a": 3.0, "b": 1.0, "c": 2.0}, 2, higher_is_better=False) == (["b", "c"], [1.0, 1.0])
    assert choose({"a": 0.2, "b": 0.6}, 2, weights="proportional") == (["b", "a"], [0.6, 0.2])
    # {"a": 10**400}: a JSON integer past any float (isfinite() of it raised OverflowError, a traceback)
    for bad, match in (({"a": float("nan")}, "finite"), ({"a": "high"}, "finite"), ({}, "no candidates"),
                       ({"a": 10**400, "b": 0.5}, "score of a is 1000.* not a finite number")):
        with pytest.raises(InvalidMergeError, match=match):
            choose(bad, 1)
    with pytest.raises(InvalidMergeError, match="positive"):
        choose({"a": -1.0, "b": 2.0}, 2, weights="proportional")
    with pytest.raises(InvalidMergeError, match="k must be"):
        choose({"a": 1.0}, 0)
    with pytest.raises(InvalidMergeError, match="weights must be one of"):
        choose({"a": 1.0}, 1, weights="softmax")


@pytest.fixture
def past(store):
    values = {"ft/a": 1.0, "ft/b": 4.0, "ft/c": 2.0, "ft/d": 8.0}
    for ref, v in values.items():
        store.push({"w": torch.full((3,), v), "step": torch.tensor(7)}, ref)
    return values


def test_remix_scores_each_candidate_and_averages_the_best(store, past):
    seen = []

    def score(sd):
        seen.append(sorted(sd))
        return -abs(float(sd["w"][0]) - 3.0)  # closest to 3 is best: b (4) and c (2)

    cid = ckpt.remix(list(past), score, k=2, name="new/start", store=store)
    assert seen == [["step", "w"]] * 4
    assert store.resolve("new/start") == cid
    assert store.load("new/start")["w"].tolist() == [3.0, 3.0, 3.0]
    rec = store.manifest(cid).lineage["merge"]
    assert rec["method"] == "linear" and rec["input_refs"] == ["ft/b", "ft/c"]
    assert rec["remix"] == {"k": 2, "weights": "equal", "higher_is_better": True, "chosen": ["ft/b", "ft/c"],
                            "scores": {"ft/a": -2.0, "ft/b": -1.0, "ft/c": -1.0, "ft/d": -5.0}}


def test_remix_lower_is_better_and_proportional(store, past):
    # losses: a (1.0) and c (2.0) are best; weights 1/1 and 1/2 -> (1 * 1 + 0.5 * 2) / 1.5
    cid = remix_scores({"ft/a": 1.0, "ft/b": 4.0, "ft/c": 2.0}, 2, weights="proportional",
                       higher_is_better=False, name="new/p", store=store)
    assert store.load(cid)["w"].tolist() == pytest.approx([4 / 3] * 3)
    assert store.manifest(cid).lineage["merge"]["params"]["weights"] == [1.0, 0.5]


def test_remix_checks_before_scoring(store, past):
    calls = []
    with pytest.raises(InvalidMergeError, match="k must be"):
        ckpt.remix(list(past), lambda sd: calls.append(1) or 0.0, k=0, store=store)
    with pytest.raises(InvalidMergeError, match="weights must be"):
        ckpt.remix(list(past), lambda sd: calls.append(1) or 0.0, weights="best", store=store)
    assert calls == []
    with pytest.raises(InvalidMergeError, match="not a number"):
        ckpt.remix(list(past), lambda sd: "good", store=store)
    with pytest.raises(InvalidMergeError, match="too large for a float for ft/a"):  # was float()'s bare OverflowError
        ckpt.remix(list(past), lambda sd: 10**400, store=store)


def test_remix_averages_what_it_scored_when_a_ref_moves_meanwhile(store, past):
    # A training job pushes a new ft/b while remix scores the others: remix loaded refs to
    # score them and merged the refs again, averaging a checkpoint nobody scored.
    scored_ids = {ref: store.resolve(ref) for ref in past}

    def score(sd):
        v = float(sd["w"][0])
        if v == 8.0:  # the last candidate, after ft/b was scored
            store.push({"w": torch.full((3,), -100.0), "step": torch.tensor(9)}, "ft/b")
        return v

    cid = ckpt.remix(list(past), score, k=2, name="new/start", store=store)
    assert store.load(cid)["w"].tolist() == [6.0, 6.0, 6.0]  # ft/d (8) and the scored ft/b (4)
    rec = store.manifest(cid).lineage["merge"]
    assert rec["inputs"] == [scored_ids["ft/d"], scored_ids["ft/b"]] and rec["input_refs"] == ["ft/d", "ft/b"]
