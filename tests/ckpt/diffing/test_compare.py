"""ckpt.diff: statistics against hand computations, statuses, unread identical tensors, delta estimate, plot."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from safetensors.torch import load_file, save_file

import ckpt
from ckpt.diffing.compare import STATUSES, tensor_stats
from ckpt.errors import ObjectNotFoundError


def test_stats_against_a_hand_computation():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = torch.tensor([1.0, 2.5, 3.0, 2.0])
    s = tensor_stats(a, b)
    # b - a = [0, 0.5, 0, -2]: |b-a| = sqrt(4.25), |a| = sqrt(30), a.b = 1 + 5 + 9 + 8 = 23, |b| = sqrt(20.25)
    assert s.changed_elements == 2
    assert s.relative_change == pytest.approx(math.sqrt(4.25 / 30), rel=1e-15)
    assert s.max_abs_diff == 2.0
    assert s.cosine == pytest.approx(23 / math.sqrt(30 * 20.25), rel=1e-15)


def test_stats_edge_cases():
    z = torch.zeros(3)
    s = tensor_stats(z, z)
    assert (s.changed_elements, s.relative_change, s.max_abs_diff, s.cosine) == (0, 0.0, 0.0, None)
    s = tensor_stats(z, torch.ones(3))
    assert s.relative_change is None and s.cosine is None and s.changed_elements == 3  # undefined: |A| = 0
    # changed means different bits: -0.0 vs 0.0 counts, NaN vs the same NaN does not
    assert tensor_stats(torch.tensor([0.0, float("nan")]), torch.tensor([-0.0, float("nan")])).changed_elements == 1
    assert math.isnan(tensor_stats(torch.tensor([1.0]), torch.tensor([float("nan")])).relative_change)  # NaN as such
    # different dtypes compare values; empty tensors have nothing to compare
    s = tensor_stats(torch.tensor([1.0, 1.5]), torch.tensor([1.0, 1.5], dtype=torch.bfloat16))
    assert s.changed_elements == 0 and s.relative_change == 0.0
    assert tensor_stats(torch.empty(0, 3), torch.empty(0, 3)).changed_elements == 0
    assert tensor_stats(torch.arange(5), torch.arange(5) * 2).changed_elements == 4  # integers too


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_property_stats_match_numpy(data):
    n = data.draw(st.integers(1, 300))
    elems = st.floats(-1e6, 1e6, width=32)
    a = data.draw(arrays(np.float32, n, elements=elems))
    b = data.draw(arrays(np.float32, n, elements=elems))
    s = tensor_stats(torch.from_numpy(a), torch.from_numpy(b), block=7)  # blocks of 7: the sums run over pieces
    a64, d64 = a.astype(np.float64), b.astype(np.float64) - a.astype(np.float64)
    assert s.changed_elements == int((a.view(np.int32) != b.view(np.int32)).sum())
    assert s.max_abs_diff == float(np.abs(d64).max())
    na, nd = np.linalg.norm(a64), np.linalg.norm(d64)
    if na > 0:
        assert s.relative_change == pytest.approx(nd / na, rel=1e-9, abs=1e-300)
    same = tensor_stats(torch.from_numpy(a), torch.from_numpy(a.copy()))
    assert same.changed_elements == 0 and same.relative_change == 0.0
    if na > 0:
        assert same.cosine == pytest.approx(1.0, abs=1e-12)


def test_a_real_tensor_retyped_as_complex_compares_by_value_both_ways_round(store):
    """F32 against C64 of the same shape ("dtype_changed"): the statistics lined up the complex tensor's
    real view (two numbers per element) against the real one and raised RuntimeError ("The size of
    tensor a (8) must match the size of tensor b (4)"), either way round. Both compare as complex now."""
    real = torch.tensor([1.0, 2.0, 3.0, 4.0])
    cplx = torch.tensor([1 + 0j, 2 + 1j, 3 + 0j, 4 + 0j], dtype=torch.complex64)
    s = tensor_stats(real, cplx)
    assert (s.changed_elements, s.max_abs_diff, s.norm_diff) == (1, 1.0, 1.0)
    assert s.norm_a == math.sqrt(30) and s.norm_b == math.sqrt(31)
    assert tensor_stats(cplx, real).changed_elements == 1
    for x, y in ((real, cplx), (cplx, real)):
        (row,) = ckpt.diff({"t": x}, {"t": y}, store=store).tensors
        assert (row.status, row.changed_elements, row.max_abs_diff) == ("dtype_changed", 1, 1.0)
    (row,) = ckpt.diff({"t": real}, {"t": real.to(torch.complex64)}, store=store).tensors
    assert (row.status, row.changed_elements) == ("dtype_changed", 0)


def test_float64_values_whose_squares_overflow_give_their_statistics_not_nan():
    """The norms are sums of squares in float64, which overflow past 1.3e154: a float64 tensor of
    finite values such as 1e200 read relative change NaN, cosine none, and was flagged as a
    diverged tensor ("changed to or from NaN/inf", sorted first), its norms inf; the summary's
    overall change NaN too (and norm**2 of a finite norm past 1.3e154 would raise OverflowError).
    Such blocks sum squares scaled by a power of two: every statistic is that of the same tensors
    scaled down, exactly (blocks of 2 here: small and huge blocks in one tensor)."""
    a = torch.tensor([1e100, -2e100, 1e200, -3e200, 5e150, 1.0], dtype=torch.float64)
    b = torch.tensor([1e100, -1e100, 2e200, -3e200, 5e150, 1.0], dtype=torch.float64)
    k = 2.0**-600
    for block in (2, 1 << 20):
        big, small = tensor_stats(a, b, block=block), tensor_stats(a * k, b * k, block=block)
        assert math.isfinite(big.relative_change) and big.relative_change == small.relative_change
        assert big.cosine is not None and big.cosine == small.cosine and big.changed_elements == 2
        assert (big.norm_a, big.norm_b, big.norm_diff, big.max_abs_diff) == tuple(
            math.ldexp(v, 600) for v in (small.norm_a, small.norm_b, small.norm_diff, small.max_abs_diff))
    # every block's sums within range, their total not: math.fsum raised OverflowError (a traceback)
    a5 = torch.full((5,), 0.6e154, dtype=torch.float64)
    b5 = a5.clone()
    b5[1] = 0.6000001e154
    big, small = tensor_stats(a5, b5, block=1), tensor_stats(a5 * k, b5 * k, block=1)
    assert (big.relative_change, big.cosine, big.norm_a) == (small.relative_change, small.cosine, math.ldexp(small.norm_a, 600))
    big = tensor_stats(a, b)
    report = ckpt.diff({"w": a, "v": torch.ones(3)}, {"w": b, "v": torch.full((3,), 2.0)})
    row = {t.name: t for t in report.tensors}["w"]
    assert not row.nonfinite and report.summary.nonfinite == 0 and row.relative_change == big.relative_change
    assert report.summary.relative_change == math.hypot(big.norm_diff, 3**0.5) / math.hypot(big.norm_a, 3**0.5)


def test_stats_leave_float64_inputs_as_they_were():
    """The statistics pass took b's float64 copy as scratch and subtracted into it; for a float64 b
    that "copy" was b itself (``.to`` returns the tensor when the dtype is already float64), so
    tensor_stats overwrote the caller's tensor with b - a."""
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    b = torch.tensor([1.5, 2.0, -4.0], dtype=torch.float64)
    before_a, before_b = a.clone(), b.clone()
    s = tensor_stats(a, b)
    assert (s.changed_elements, s.max_abs_diff) == (2, 7.0)
    assert a.view(torch.uint8).equal(before_a.view(torch.uint8)) and b.view(torch.uint8).equal(before_b.view(torch.uint8))
    assert tensor_stats(a, b) == s


def test_integers_past_2_53_compare_exactly(store):
    """float64 holds integers exactly only to 2**53: a change of 1 in a larger int64 was counted
    (bit patterns) but read as max diff 0.0, and int64 2**53 + 1 against float64 2.0**53 read as no
    change at all. Integers now differ in int64, and against floats only where the float is whole."""
    big = 2**53
    s = tensor_stats(torch.tensor([big + 1, 5, 2**60]), torch.tensor([big, 5, 2**60 + 7]))
    assert (s.changed_elements, s.max_abs_diff, s.norm_diff) == (2, 7.0, math.sqrt(50))
    as_float = torch.tensor([2.0**53, 5.0, 2.5, math.nan], dtype=torch.float64)
    as_int = torch.tensor([big + 1, 5, 2, 0])
    for x, y in ((as_int, as_float), (as_float, as_int)):
        assert tensor_stats(x, y).changed_elements == 3  # 2**53+1, 2 against 2.5, 0 against NaN
    assert tensor_stats(torch.tensor([big, 5]), torch.tensor([2.0**53, 5.0], dtype=torch.float64)).changed_elements == 0
    assert tensor_stats(torch.tensor([3, -4], dtype=torch.int8), torch.tensor([3, -4], dtype=torch.int64)).changed_elements == 0
    for x, y in ((torch.tensor([big + 1]), torch.tensor([float(big)], dtype=torch.float64)),
                 (torch.tensor([float(big)], dtype=torch.float64), torch.tensor([big + 1]))):
        (row,) = ckpt.diff({"t": x}, {"t": y}, store=store).tensors
        assert (row.status, row.changed_elements) == ("dtype_changed", 1)
    (row,) = ckpt.diff({"t": torch.tensor([big + 1])}, {"t": torch.tensor([big])}, store=store).tensors
    assert (row.status, row.changed_elements, row.max_abs_diff) == ("changed", 1, 1.0)


def test_integers_against_floats_or_uint64_show_the_change_they_count(store):
    """Mixed dtypes: int64 2**53 + 1 against float64 2.0**53 was counted as changed (values compared
    as integers) but its difference taken in float64, so max diff, norm of the change and relative
    change read 0; int64 against a uint64 compared in float64 and counted 2**53 + 1 against 2**53 as
    no change; a change of 1 in a uint64 past 2**53 read max diff 0. Each now reads its change exactly."""
    big = 2**53
    ints, floats = torch.tensor([big + 1, -big - 3, 7, 2**62 + 1]), torch.tensor([2.0**53, -(2.0**53), 7.5, 2.0**62], dtype=torch.float64)
    for x, y in ((ints, floats), (floats, ints)):
        s = tensor_stats(x, y)
        assert (s.changed_elements, s.max_abs_diff, s.norm_diff) == (4, 3.0, math.sqrt(1 + 9 + 0.25 + 1)), s
        assert s.relative_change > 0
    u = torch.tensor([big, 5, 2**60], dtype=torch.uint64)
    for x, y in ((torch.tensor([big + 1, 5, 2**60]), u), (u, torch.tensor([big + 1, 5, 2**60]))):
        s = tensor_stats(x, y)
        assert (s.changed_elements, s.max_abs_diff) == (1, 1.0), s
    s = tensor_stats(u, torch.tensor([big, 5, 2**60 + 1], dtype=torch.uint64))
    assert (s.changed_elements, s.max_abs_diff) == (1, 1.0), s
    extremes = torch.tensor([-(2**63), 2**63 - 1, -(2**63), 2**62])  # no overflow where signs differ
    s = tensor_stats(extremes, torch.tensor([2**63 - 1, -(2**63), -(2**63) + 1, -(2**62)]))
    assert (s.changed_elements, s.max_abs_diff) == (4, 2.0**64 - 1), s
    (row,) = ckpt.diff({"t": torch.tensor([big + 1])}, {"t": torch.tensor([2.0**53], dtype=torch.float64)}, store=store).tensors
    assert (row.status, row.changed_elements, row.max_abs_diff) == ("dtype_changed", 1, 1.0)


_INT_RANGES = {torch.int64: (-(2**63), 2**63 - 1), torch.uint64: (0, 2**64 - 1), torch.int32: (-(2**31), 2**31 - 1),
               torch.uint8: (0, 255)}


def _value(draw, dtype):
    if dtype in _INT_RANGES:
        lo, hi = _INT_RANGES[dtype]
        v = draw(st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, lo + 1, hi - 1, 0, 2**53 + 1, 2**63 - 1, 2**63, 2**63 + 1])
                           .filter(lambda x: lo <= x <= hi)))
        return torch.tensor([v], dtype=dtype), v
    v = draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([2.0**53, 2.0**63, -(2.0**63), 2.0**64, 2.0**64 - 2048, 0.5, -0.0])))
    return torch.tensor([v], dtype=torch.float64), v


@given(st.data())
@settings(max_examples=600, deadline=None)
def test_one_element_of_any_two_dtypes_compares_exactly(data):
    """Each element's change (counted, and its size: max diff) against exact arithmetic, for integers
    of every width, uint64 past int64, whole floats near 2**53, 2**63 and 2**64, fractions, inf, NaN."""
    from fractions import Fraction

    dtypes = [*_INT_RANGES, torch.float64]
    (ta, a), (tb, b) = (_value(data.draw, data.draw(st.sampled_from(dtypes))) for _ in range(2))
    s = tensor_stats(ta, tb)
    if ta.dtype == tb.dtype:
        assert s.changed_elements == int(not ta.view(torch.uint8).equal(tb.view(torch.uint8)))
        if ta.dtype.is_floating_point:
            return  # (bit patterns: -0.0 against 0.0, NaN payloads; tested elsewhere)
    nan = [isinstance(x, float) and math.isnan(x) for x in (a, b)]
    if any(nan):
        assert s.changed_elements == int(not all(nan))
        return
    changed = a != b
    assert s.changed_elements == int(changed), (a, b, s)
    if changed and not any(isinstance(x, float) and math.isinf(x) for x in (a, b)):
        exact = float(abs(Fraction(b) - Fraction(a)))
        if all(float(x).is_integer() for x in (a, b)) and all(-(2**63) <= x < 2**63 for x in (a, b)):
            assert s.max_abs_diff == exact, (a, b, s)  # two integers within int64: their difference rounded once
        elif all(float(x).is_integer() for x in (a, b)):  # past int64 (uint64 against a whole float64): taken in
            # float64, rounded twice, within an ulp (uint64 2**64-1024 against -5.578679835571096e19 read
            # 7.423354242942052e19 for 7.42335424294205e19; found by hunt9-h); the count above stays exact
            assert s.max_abs_diff > 0 and math.isclose(s.max_abs_diff, exact, rel_tol=2**-51), (a, b, s)
        else:  # a fraction: float64 arithmetic, never 0
            assert s.max_abs_diff > 0 and math.isclose(s.max_abs_diff, exact, rel_tol=1e-15), (a, b, s)


def test_nan_and_inf_changes_are_reported_as_such():
    """Issue 15 item 6: max(0.0, nan) made a weight turned NaN look unchanged (0.0), and inf printed as '-'."""
    a = torch.linspace(-1, 1, 10)
    for bad, check in ((float("nan"), math.isnan), (float("inf"), math.isinf), (float("-inf"), math.isinf)):
        for block in (3, 1 << 20):  # the NaN in the first, a middle, or the only block
            b = a.clone()
            b[4] = bad
            s = tensor_stats(a, b, block=block)
            assert s.changed_elements == 1 and s.nonfinite == 1
            assert check(s.max_abs_diff) and check(s.relative_change) and s.cosine is None
            assert check(tensor_stats(b, a, block=block).max_abs_diff)  # from NaN/inf back to a number: a change too
    # A NaN or inf that stays where it was is no change; one that appears elsewhere is.
    a2 = a.clone()
    a2[0], a2[1] = float("nan"), float("inf")
    s = tensor_stats(a2, a2.clone(), block=3)
    assert (s.changed_elements, s.max_abs_diff, s.relative_change, s.nonfinite) == (0, 0.0, 0.0, 0)
    b2 = a2.clone()
    b2[9] = 5.0
    s = tensor_stats(a2, b2, block=3)
    assert s.changed_elements == 1 and s.max_abs_diff == 4.0 and s.nonfinite == 0
    # Different dtypes compare values: bf16 NaN against fp32 NaN is no change either.
    s = tensor_stats(a2, a2.to(torch.bfloat16).float().to(torch.bfloat16), block=3)
    assert s.nonfinite == 0 and math.isfinite(s.max_abs_diff)


def test_a_diverged_tensor_sorts_first_and_reads_nan_in_text_and_json(store, tmp_path, monkeypatch, capsys):
    import json

    from ckpt_store.cli.main import main

    g = torch.Generator().manual_seed(0)
    a = {f"l{i}": torch.randn(64, generator=g) for i in range(4)}
    b = {k: v + (10.0 if k == "l0" else 0.0) for k, v in a.items()}  # l0: a large finite change
    b["l2"] = a["l2"].clone()
    b["l2"][5] = float("nan")  # l2: one element diverged
    b["l3"] = a["l3"].clone()
    b["l3"][7] = float("inf")
    store.push(a, "d/a")
    store.push(b, "d/b")
    report = ckpt.diff("d/a", "d/b", store=store)
    for key in ("max_abs_diff", "relative_change", "changed_elements", "cosine", "delta_bytes"):
        assert [t.name for t in report.select(key)][:2] == ["l2", "l3"], key  # NaN first, then inf
    assert report.summary.nonfinite == 2 and math.isnan(report.summary.relative_change)
    doc = report.to_json("max_abs_diff")
    json.dumps(doc, allow_nan=False)  # still plain JSON
    rows = {t["name"]: t for t in doc["tensors"]}
    assert (rows["l2"]["max_abs_diff"], rows["l2"]["relative_change"], rows["l2"]["nonfinite"]) == ("nan", "nan", True)
    assert (rows["l3"]["max_abs_diff"], rows["l3"]["nonfinite_elements"]) == ("inf", 1)
    assert rows["l0"]["nonfinite"] is False and rows["l0"]["max_abs_diff"] == pytest.approx(10.0)
    assert doc["summary"]["nonfinite"] == 2 and doc["summary"]["relative_change"] == "nan"
    monkeypatch.setenv("CKPT_STORE", store.url)
    with pytest.raises(SystemExit):
        main(["diff", "d/a", "d/b", "--sort", "max_abs_diff"])
    text = capsys.readouterr().out
    lines = [line.split() for line in text.splitlines() if line.startswith("l")]
    assert [(r[0], r[4]) for r in lines[:2]] == [("l2", "nan"), ("l3", "inf")]
    assert "2 tensor(s) changed to or from NaN/inf" in text


def two_checkpoints():
    g = torch.Generator().manual_seed(0)
    a = {
        "emb.weight": torch.randn(300, 64, generator=g),
        "layers.0.w": torch.randn(64, 64, generator=g),
        "layers.1.w": torch.randn(64, 64, generator=g),
        "layers.1.b": torch.randn(64, generator=g),
        "gone": torch.randn(8, generator=g),
        "reshaped": torch.randn(4, 4, generator=g),
        "retyped": torch.randn(16, generator=g),
    }
    b = dict(a)
    b["layers.1.w"] = a["layers.1.w"].clone()
    b["layers.1.w"][0, :10] += 1.0
    del b["gone"]
    b["new"] = torch.randn(5, generator=g)
    b["reshaped"] = a["reshaped"].reshape(16)
    b["retyped"] = a["retyped"].to(torch.bfloat16)
    return a, b


def test_statuses_and_json_schema(store):
    a, b = two_checkpoints()
    store.push(a, "x/a")
    store.push(b, "x/b")
    report = ckpt.diff("x/a", "x/b", store=store)
    status = {t.name: t.status for t in report.tensors}
    assert status == {"emb.weight": "identical", "layers.0.w": "identical", "layers.1.w": "changed", "layers.1.b": "identical",
                      "gone": "removed", "reshaped": "shape_changed", "retyped": "dtype_changed", "new": "added"}
    changed = next(t for t in report.tensors if t.name == "layers.1.w")
    ref = tensor_stats(a["layers.1.w"], b["layers.1.w"])
    assert (changed.changed_elements, changed.relative_change, changed.max_abs_diff, changed.cosine) == (
        10, ref.relative_change, ref.max_abs_diff, ref.cosine)
    s = report.summary
    assert (s.tensors, s.identical, s.identical_unread, s.changed, s.added, s.removed, s.shape_changed, s.dtype_changed) == (
        8, 3, 3, 1, 1, 1, 1, 1)
    doc = report.to_json()
    assert set(doc) >= {"tensors", "summary"}
    for rec in doc["tensors"]:
        assert {"name", "status", "changed_elements", "relative_change", "max_abs_diff", "cosine"} <= set(rec)
        assert rec["status"] in STATUSES
    import json

    json.dumps(doc, allow_nan=False)  # plain JSON: no NaN or Infinity


def test_include_exclude_sort_top(store):
    a, b = two_checkpoints()
    store.push(a, "x/a")
    store.push(b, "x/b")
    r = ckpt.diff("x/a", "x/b", store=store, include=["layers.*"], exclude=["*.b"])
    assert [t.name for t in r.tensors] == ["layers.0.w", "layers.1.w"] and r.summary.tensors == 2
    full = ckpt.diff("x/a", "x/b", store=store)
    assert full.select("relative_change", top=1)[0].name == "layers.1.w"
    assert [t.name for t in full.select("name", top=3)] == ["emb.weight", "gone", "layers.0.w"]
    least = min((t for t in full.tensors if t.cosine is not None), key=lambda t: t.cosine)
    assert full.select("cosine")[0] == least and full.select("cosine")[-1].cosine is None  # None sorts last
    with pytest.raises(ValueError, match="unknown sort key"):
        full.select("size")


def test_identical_tensors_are_not_read(tmp_path):
    """Delete the chunks of the identical tensors from a copy of the store: the diff still works."""
    a, b = two_checkpoints()
    store = ckpt.Store.init(str(tmp_path / "store"))
    store.push(a, "x/a")
    store.push(b, "x/b")
    m = store.manifest("x/b")
    identical = {"emb.weight", "layers.0.w", "layers.1.b"}
    doomed = {c for t in m.tensors if t.name in identical for c in t.chunks}
    others = {c for mm in (m, store.manifest("x/a")) for t in mm.tensors if t.name not in identical for c in t.chunks}
    assert doomed and not doomed & others  # only the identical tensors' chunks go
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    for c in doomed:
        (tmp_path / "copy" / "objects" / "chunks" / c[:2] / c).unlink()
    copy = ckpt.Store.open(str(tmp_path / "copy"))
    with pytest.raises(ObjectNotFoundError):
        copy.reader("x/b").get_tensor("emb.weight")  # the data really is gone
    report = ckpt.diff("x/a", "x/b", store=copy)
    assert report.summary.identical_unread == 3
    assert {t.name for t in report.tensors if t.status == "identical" and not t.read} == identical
    # a local file against a ref: its tensors are hashed, the ref's identical chunks never fetched
    save_file(b, str(tmp_path / "b.safetensors"))
    report = ckpt.diff("x/a", str(tmp_path / "b.safetensors"), store=copy)
    assert report.summary.identical_unread == 3 and report.summary.changed == 1


def test_without_the_estimate_added_and_reshaped_tensors_are_not_read(tmp_path):
    """An added or reshaped tensor has no statistics: its data serves only the delta estimate. Without
    the estimate a diff read it anyway (the whole tensor, from a remote store too), and failed where it
    could not. Delete their chunks from the store: the diff without the estimate works, unread."""
    a, b = two_checkpoints()
    store = ckpt.Store.init(str(tmp_path / "store"))
    store.push(a, "x/a")
    store.push(b, "x/b")
    unread = {"new", "reshaped"}
    doomed = {c for mm in (store.manifest("x/a"), store.manifest("x/b")) for t in mm.tensors if t.name in unread for c in t.chunks}
    others = {c for mm in (store.manifest("x/a"), store.manifest("x/b")) for t in mm.tensors if t.name not in unread for c in t.chunks}
    assert doomed and not doomed & others
    for c in doomed:
        (tmp_path / "store" / "objects" / "chunks" / c[:2] / c).unlink()
    report = ckpt.diff("x/a", "x/b", store=store, estimate_delta=False)
    rows = {t.name: t for t in report.tensors}
    assert (rows["new"].status, rows["new"].read, rows["reshaped"].status, rows["reshaped"].read) == ("added", False, "shape_changed", False)
    assert report.summary.changed == 1 and report.summary.delta_bytes is None
    with pytest.raises(ObjectNotFoundError):  # the estimate does read them
        ckpt.diff("x/a", "x/b", store=store)


def test_delta_estimate_from_a_local_side_counts_its_chunks_as_a_stored_side_does(store, tmp_path):
    """A Hugging Face folder (tied lm_head written once) against its .pt export, where lm_head.weight
    is the embedding's bytes under a second name: from the stored folder the added tensor costs
    nothing (its chunks are A's); from the folder on disk it was counted whole, as if new. Both
    estimates now agree with what pushing the .pt on top of the folder writes."""
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(300, 64, generator=g)
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"wte.weight": emb, "h.0.weight": torch.randn(64, 64, generator=g)}, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    export = {"wte.weight": emb, "h.0.weight": load_file(folder / "model.safetensors")["h.0.weight"], "lm_head.weight": emb}
    torch.save(export, tmp_path / "model.pt")
    store.push(folder, "m/hf")
    from_ref = ckpt.diff("m/hf", str(tmp_path / "model.pt"), store=store)
    from_disk = ckpt.diff(str(folder), str(tmp_path / "model.pt"), store=store)
    assert [r.status for r in from_disk.tensors] == ["identical", "identical", "added"]
    assert from_ref.summary.delta_bytes == from_disk.summary.delta_bytes == 0
    assert store.push(tmp_path / "model.pt", "m/pt").new_chunks == 1  # its safetensors header alone


def test_delta_estimate_is_what_a_push_writes(store):
    g = torch.Generator().manual_seed(3)
    a = {f"w{i}": torch.randn(512, 512, generator=g) for i in range(3)}
    b = {k: v + 1e-4 * torch.randn(v.shape, generator=g) if k != "w0" else v for k, v in a.items()}
    b["extra"] = torch.randn(1000, generator=g)
    store.push(a, "x/a")
    estimate = ckpt.diff("x/a", b, store=store).summary.delta_bytes
    pushed = store.push(b, "x/b", base="x/a")
    # the push also wrote the new safetensors header (one small chunk): the rest is tensor data
    head = store.manifest("x/b").files[0].chunks[0]
    head_blob = store.objects.backend.size(store.objects.path("chunks", head))
    assert estimate is not None and 0 < estimate < pushed.logical_bytes / 2
    assert estimate + head_blob == pushed.written_bytes
    assert ckpt.diff("x/a", b, store=store, estimate_delta=False).summary.delta_bytes is None


def test_thousands_of_small_tensors_are_read_in_batches_with_each_record_exact(tmp_path, monkeypatch):
    """A mixture-of-experts model has 10^4-10^5 tensors. Each was read on its own, one pass of the
    read pipeline per side and tensor (20,000 for 10,000 changed tensors; on S3 one request waited
    for at a time). They are read in batches now; every record is what the tensors give alone, a
    large tensor among them included, and those the chunk ids decide are still not read."""
    from ckpt.diffing.compare import delta_bytes
    from ckpt.store import reader

    g = torch.Generator().manual_seed(9)
    a = {f"experts.{i}.w": torch.randn(16, generator=g) for i in range(1000)}
    a["experts.700.big"] = torch.randn(400_000, generator=g)  # over a batch's bytes: alone
    a["gone"] = torch.randn(4, generator=g)
    b = {k: (v + 0.01 if i % 3 == 0 else v) for i, (k, v) in enumerate(a.items()) if k != "gone"}
    b["experts.5.w"] = torch.randn(4, 4, generator=g)  # reshaped
    b["new"] = torch.randn(8, generator=g)
    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push(a, "a")
    store.push(b, "b")
    calls = []
    real = reader.get_chunks  # (where a diff's reads look it up)
    monkeypatch.setattr(reader, "get_chunks", lambda objects, tasks, *x, **k: (calls.append(len(tasks)), real(objects, tasks, *x, **k))[1])
    report = ckpt.diff("a", "b", store=store)
    assert 0 < len(calls) <= 12, len(calls)  # was one per side and tensor read: 671
    rows = {t.name: t for t in report.tensors}
    assert [t.name for t in report.tensors] == [t.name for t in store.manifest("a").tensors] + ["new"]
    changed = [k for i, k in enumerate(a) if i % 3 == 0 and k != "experts.5.w"]
    for k in changed:
        s = tensor_stats(a[k], b[k])
        r = rows[k]
        assert (r.status, r.changed_elements, r.relative_change, r.max_abs_diff, r.cosine, r.read) == (
            "changed", s.changed_elements, s.relative_change, s.max_abs_diff, s.cosine, True), k
        assert r.delta_bytes == delta_bytes(a[k].numpy().tobytes(), b[k].numpy().tobytes(), chunk_size=store.settings.chunk_size,
                                            elem=4, level=store.settings.zstd_level, min_saving=store.settings.min_saving), k
    assert {k for k, r in rows.items() if r.status == "identical" and not r.read} == {
        k for i, k in enumerate(a) if i % 3 and k not in ("experts.5.w", "gone")}
    assert (rows["gone"].status, rows["new"].status, rows["experts.5.w"].status) == ("removed", "added", "shape_changed")
    assert rows["new"].delta_bytes > 0 and rows["experts.5.w"].delta_bytes > 0
    assert report.summary.changed == len(changed) and report.summary.delta_bytes == sum(r.delta_bytes for r in report.tensors)


def test_two_local_files_need_no_store(tmp_path):
    a, b = two_checkpoints()
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    r = ckpt.diff(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    assert r.summary.changed == 1 and r.summary.identical_unread == 3 and r.a_id is None


def _safetensors(path, tensors):
    """A safetensors file written by hand: ``(name, dtype, shape, raw bytes)``, any dtype name."""
    import json
    import struct

    head, pos = {}, 0
    for name, dtype, shape, raw in tensors:
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(t[3] for t in tensors))
    return str(path)


def test_a_dtype_ckpt_does_not_know_compares_by_bytes_both_ways_round(store, tmp_path):
    """F4 (4-bit floats, stored as opaque bytes): a diff read it through torch and failed ("no torch
    equivalent") wherever it had to read it, so a tensor only B held failed as 'added' and passed as
    'removed' the other way round. Now both ways agree: same or changed by its bytes, no statistics."""
    one = ("y", "F32", [1], torch.ones(1).numpy().tobytes())
    a = _safetensors(tmp_path / "a.safetensors", [("x", "F4", [8], bytes(range(4))), one])
    b = _safetensors(tmp_path / "b.safetensors", [("x", "F4", [8], bytes([0, 1, 2, 9])), one, ("only_b", "F4", [2], b"\x01"),
                                                  ("typed", "F4", [4], b"\x01\x02")])
    a2 = _safetensors(tmp_path / "a2.safetensors", [("x", "F4", [8], bytes(range(4))), one, ("typed", "U8", [4], b"\x01\x02\x03\x04")])
    store.push(a, "u/a")
    store.push(b, "u/b")
    store.push(a2, "u/a2")
    for x, y, b_second, typed in (("u/a", "u/b", True, "added"), ("u/b", "u/a", False, "removed"), (a, b, True, "added"),
                                  (b, a, False, "removed"), (a, "u/b", True, "added"), ("u/b", a, False, "removed"),
                                  ("u/a2", "u/b", True, "dtype_changed"), ("u/b", a2, False, "dtype_changed")):
        rows = {t.name: t for t in ckpt.diff(x, y, store=store).tensors}
        assert rows["x"].status == "changed" and rows["x"].read and rows["x"].changed_elements is None, (x, y)
        assert rows["x"].relative_change is None and rows["x"].delta_bytes and rows["y"].status == "identical"
        assert rows["only_b"].status == ("added" if b_second else "removed")
        assert rows["typed"].status == typed and rows["typed"].changed_elements is None
    same = ckpt.diff(b, "u/b", store=store)  # read (a local file): identical by bytes
    assert {t.name: t.status for t in same.tensors} == dict.fromkeys(["x", "y", "only_b", "typed"], "identical")


def test_plot(store, tmp_path):
    pytest.importorskip("matplotlib")
    a, b = two_checkpoints()
    store.push(a, "x/a")
    store.push(b, "x/b")
    from ckpt.diffing.compare import plot

    out = plot(ckpt.diff("x/a", "x/b", store=store), tmp_path / "d.png")
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_of_names_with_odd_digits_draws_every_tensor(store, tmp_path):
    """A name segment "²" is a digit to str.isdigit() that int() refuses: --plot raised ValueError. And
    "layer.03.w" or "layer.٣.w" took layer 3's cell beside "layer.3.w", one tensor drawn over the other.
    Only a number as int() writes it is a layer index now; the others are drawn as tensors of their own."""
    pytest.importorskip("matplotlib")
    from ckpt.diffing.plot import layer_key

    assert layer_key("layer.3.w") == ("layer", 3, "w")
    assert [layer_key(n)[1] for n in ("layer.².w", "layer.03.w", "layer.٣.w", "layer.0.w")] == [None, None, None, 0]
    a = {n: torch.ones(4) for n in ("layer.3.w", "layer.03.w", "layer.².w", "layer.٣.w")}
    b = {n: t * (i + 2) for i, (n, t) in enumerate(a.items())}
    from ckpt.diffing.compare import plot

    out = plot(ckpt.diff(a, b, store=store), tmp_path / "odd.png")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_names_and_paths_as_written_never_as_mathtext(store, tmp_path, monkeypatch):
    """matplotlib reads text between two '$' as a formula: a tensor name 'blocks.0.$\\x$' (safetensors
    and push take any printable name) ended ckpt diff --plot in a ValueError traceback from the mathtext
    parser, and 'blocks.$a$.w' or a path 'run$1$/a.safetensors' was drawn as a formula, not as its name.
    Every label that holds a name, a ref or a path is drawn as it is written."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from ckpt.diffing import plot as plot_module

    folder = tmp_path / "run$1$"
    folder.mkdir()
    names = ["blocks.0.$\\x$", "blocks.1.$\\x$", "$s^$.0.w", "head.$a$", "norm.$\\frac$"]
    a = {n: torch.ones(4) for n in names}
    save_file(a, folder / "a.safetensors")
    save_file({n: t * (i + 2) for i, (n, t) in enumerate(a.items())}, folder / "b.safetensors")
    drawn: list[Text] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (drawn.extend(fig.findobj(Text)), close(fig)))
    report = ckpt.diff(str(folder / "a.safetensors"), str(folder / "b.safetensors"), store=store)
    out = plot_module.plot_report(report, tmp_path / "names.png")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    texts = {t.get_text() for t in drawn}
    ours = ["blocks.*.$\\x$", "$s^$.*.w", "head.$a$", "norm.$\\frac$"]  # rows of two stacks, then flat tensors
    ours += [t for t in texts if str(folder) in t]  # the title: both sides' paths
    assert set(ours) <= texts and len(ours) == 5
    assert all(not t.get_parse_math() for t in drawn if t.get_text() in ours)


def test_a_plot_with_too_many_cells_is_refused_before_drawing(store, tmp_path, monkeypatch):
    """Each tensor drawn costs a cell (names that gave each tensor a layer and a module type of its own,
    "s.7.m7", once made the grid tensors x tensors: 300 took three minutes; cells are now drawn only
    where a tensor is, see the next test). Past MAX_CELLS tensors (lowered here, so that the test stays
    small) a chart is refused at once, saying how to plot fewer, with nothing written."""
    pytest.importorskip("matplotlib")
    from ckpt.diffing import plot as plot_module

    monkeypatch.setattr(plot_module, "MAX_CELLS", 100)
    a = {f"s.{i}.m{i}": torch.ones(2) for i in range(150)}
    report = ckpt.diff(a, {k: v * 2 for k, v in a.items()}, store=store)
    with pytest.raises(ckpt.CkptError, match="too many tensors for one chart: 150 ") as e:
        plot_module.plot_report(report, tmp_path / "big.png")
    assert "--include" in e.value.hint and not (tmp_path / "big.png").exists()


def test_plot_without_matplotlib(store, tmp_path, monkeypatch):
    import sys

    from ckpt.errors import MissingDependencyError

    store.push({"w": torch.ones(3)}, "x/a")
    report = ckpt.diff("x/a", "x/a", store=store)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    from ckpt.diffing.compare import plot

    with pytest.raises(MissingDependencyError, match=r"pip install 'ckpt-store\[plot\]'"):
        plot(report, tmp_path / "d.png")


def _png_size(path) -> tuple[int, int]:
    import struct

    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_plot_draws_a_cell_per_tensor_not_per_module_type_and_layer(store, tmp_path, monkeypatch):
    """--plot built a rows x layers grid (a NumPy array, a list of labels and one ax.text per cell, empty
    ones included): where module names differ from layer to layer (block.{i}.proj{i}.weight) that is the
    square of the tensors (120: 14,400 cells; 10,000: 10^8, many GB), and a figure of 0.8 inch per layer
    (10,000: 8,000 inches, past what Agg draws). Only the cells holding a tensor are drawn now, each
    with its value, and the figure's sides are bounded; a normal model's plot shows what it showed."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from ckpt.diffing.compare import plot

    written: list[str] = []
    real = Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **k: written.append(s) or real(self, x, y, s, *a, **k))

    def report(names):
        g = torch.Generator().manual_seed(0)
        a = {n: torch.randn(4, generator=g) for n in names}
        return ckpt.diff(a, {n: t * (1 + i % 5) for i, (n, t) in enumerate(a.items())}, store=store)

    normal = report([f"layers.{i}.{m}" for i in range(3) for m in ("attn.weight", "mlp.weight")] + ["head.weight"])
    plot(normal, tmp_path / "normal.png")
    assert sorted(written) == sorted(["0", "1.0e0", "2.0e0", "3.0e0", "4.0e0", "0", "1.0e0"])  # six cells, one bar
    written.clear()
    plot(report([f"block.{i}.proj{i}.weight" for i in range(120)]), tmp_path / "spread.png")
    assert len(written) == 120  # one cell per tensor, each with its value (14,400 before)
    written.clear()
    from ckpt.diffing.plot import MAX_INCHES

    width, height = _png_size(plot(report([f"block.{i}.proj{i}.weight" for i in range(330)]), tmp_path / "many.png"))
    assert height <= MAX_INCHES * 110 + 200 and width <= (MAX_INCHES + 3.5) * 110 + 200, (width, height)
    assert not written  # rows too thin for a value: none written over each other


STATS_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from ckpt.diffing.compare import tensor_stats

    def status(key):  # kB -> bytes, from this process's own memory map
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

    block = 1 << 17  # 32 blocks of 128 Ki elements: the bound is in blocks, the tensor many of them
    a = torch.randint(-128, 127, (4 << 20,), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b[::3] += 1
    other = b.to(torch.int16)  # the same values in another dtype
    tensor_stats(a[: 8 * block], b[: 8 * block], block=block)  # warm torch's allocator and thread pool before the baseline
    peaks = []
    for x, y in ((a, b), (a, other)):
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
        before = status("VmRSS:")
        s = tensor_stats(x, y, block=block)
        assert s.changed_elements == len(range(0, 4 << 20, 3)), s
        peaks.append(status("VmHWM:") - before)
    print(json.dumps(peaks))
""")


def test_stats_scratch_memory_is_a_few_blocks_whatever_the_tensor_size():
    """Counting the changed elements held a bool tensor summed through an int64 copy (8 bytes per
    element: 32 MiB for the 4 MiB int8 tensor here) and, across dtypes, float64 copies of both sides."""
    out = subprocess.run([sys.executable, "-c", STATS_MEMORY_SCRIPT], capture_output=True, text=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "524288", "OMP_NUM_THREADS": "1"}, check=True, timeout=300)
    for peak in json.loads(out.stdout):
        # blocks of 128 Ki elements: the 1 MiB float64/int64 scratch arrays of one block (integers take
        # a dozen, _integer_difference); measured 12.4 MiB here, the old code (whole-tensor) 115 and 364 MiB
        assert peak < 24 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_a_diff_of_stored_refs_keeps_one_pool_of_reading_threads_per_side(monkeypatch):
    """Each batch of small tensors a stored side read started (and joined) a pool of reading threads
    on a remote store (memory://, like S3): 600 changed tensors, 3 batches per side, started 6 pools.
    A side reads through its reader's one pool, ended when the diff returns, an error included."""
    import threading
    import uuid

    settings = ckpt.Settings.from_env(workers=2, io_workers=2)
    store = ckpt.Store.init(f"memory://diff-pool-{uuid.uuid4().hex}", settings=settings)
    g = torch.Generator().manual_seed(7)
    a = {f"t{i}": torch.randn(64, generator=g) for i in range(600)}
    b = {k: v + 1 for k, v in a.items()}
    store.push(a, "a")
    store.push(b, "b")
    want = ckpt.diff("a", "b", store=store)  # (threads started lazily: count the second run's only)
    started: list[str] = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), start(self))[1])
    got = ckpt.diff("a", "b", store=store)
    readers = [n for n in started if n.startswith("ckpt-read")]
    assert 0 < len(readers) <= 2 * max(settings.io_workers, store.objects.backend.concurrency), len(readers)
    assert not [t for t in threading.enumerate() if t.name.startswith("ckpt-read")]
    monkeypatch.undo()
    assert got.summary.changed == 600 and got.tensors == want.tensors and got.summary == want.summary
    lost = next(t for t in store.manifest("b").tensors if t.name == "t500").chunks[0]
    store.objects.backend.delete(store.objects.path("chunks", lost))
    with pytest.raises(ObjectNotFoundError, match=lost):
        ckpt.diff("a", "b", store=store)
    assert not [t for t in threading.enumerate() if t.name.startswith("ckpt-read")]  # nothing reads on behind the error


@pytest.mark.slow  # (run by .ci/run's slow step)
def test_a_diff_from_s3_reads_small_chunks_from_the_bundles_once(s3_main_url):
    """Each side read its changed small tensors one GET per chunk, though the push stored them in a
    bundle too: 600 small tensors per side, 1,200 GETs. A side's reader fetches its bundle once for
    the whole diff (3 batches here) and serves the members from it, each checked against its id."""
    from s3support import gets_of

    settings = ckpt.Settings.from_env(workers=2, io_workers=2, cache=False)  # every read a request
    store = ckpt.Store.init(s3_main_url, settings=settings)
    g = torch.Generator().manual_seed(9)
    a = {f"big.{i}": torch.randn(300_000, generator=g) for i in range(4)}
    a |= {f"small.{i}": torch.randn(100, generator=g) for i in range(600)}
    b = {k: v + 1 if k.startswith("small") else v for k, v in a.items()}
    store.push(a, "a")
    store.push(b, "b")
    bundles = [bd for r in ("a", "b") for bd in store.manifest(r).bundles]
    members = {cid for bd in bundles for cid, _, _ in bd.members}
    assert len(bundles) == 2 and len(members) >= 1200
    with gets_of(store, "ckpt-read") as gets:
        got = ckpt.diff("a", "b", store=store)
    assert not members & set(gets), len(members & set(gets))  # was 1,200
    assert all(gets.count(c) == 1 for bd in bundles for c in bd.chunks), [gets.count(c) for bd in bundles for c in bd.chunks]
    assert got.summary.changed == 600 and got.summary.identical == 4
    local = ckpt.diff(a, b, store=store)  # the same tensors, read from memory
    rows = [(r.name, r.status, r.changed_elements, r.max_abs_diff, r.relative_change, r.cosine) for r in got.tensors]
    assert rows == [(r.name, r.status, r.changed_elements, r.max_abs_diff, r.relative_change, r.cosine) for r in local.tensors]
