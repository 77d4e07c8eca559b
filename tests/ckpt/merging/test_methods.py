"""The merge math against hand computations and worked examples, and the method registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from safetensors.torch import save_file

import ckpt
from ckpt.errors import InvalidMergeError
from ckpt.merging.combine import merge_state_dicts
from ckpt.merging.formulas import dare_mask, dare_seed, ties_combine, trim_
from ckpt.merging.methods import (
    BUILTIN_METHODS,
    LINEAR,
    MergeMethod,
    MethodRegistry,
    Param,
    default_registry,
    describe,
)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def run(method: str, xs, base=None, **params):
    """One tensor named "w" merged with ``method`` (inputs are not modified)."""
    sds = [{"w": torch.as_tensor(x)} for x in xs]
    b = {"w": torch.as_tensor(base)} if base is not None else None
    return merge_state_dicts(sds, method, params=params, base=b)["w"]


RNG = np.random.default_rng(1234)
X = [RNG.standard_normal(1000).astype(np.float32) for _ in range(3)]
B = RNG.standard_normal(1000).astype(np.float32)


# -- linear and task arithmetic: bit-exact against numpy, in the documented order -------------


def test_linear_is_bit_exact_against_a_hand_computation():
    w = [1.0, 2.0, 0.5]
    total = math.fsum(w)
    w32 = [np.float32(x / total) for x in w]  # normalised in float64, then rounded to float32
    expected = (X[0] * w32[0] + X[1] * w32[1]) + X[2] * w32[2]
    got = run("linear", X, weights=w)
    assert got.dtype == torch.float32
    assert got.numpy().tobytes() == expected.tobytes()


def test_linear_unnormalised_and_float64():
    x64 = [x.astype(np.float64) for x in X[:2]]
    got = run("linear", x64, weights="0.25,0.5", normalize="false")
    assert got.dtype == torch.float64  # float64 inputs are merged in float64
    assert got.numpy().tobytes() == (x64[0] * 0.25 + x64[1] * 0.5).tobytes()


def test_linear_bf16_computes_in_float32_and_casts_back():
    xs = [torch.from_numpy(x).to(torch.bfloat16) for x in X[:2]]
    got = run("linear", xs)
    assert got.dtype == torch.bfloat16
    f = [x.float().numpy() for x in xs]
    expected = torch.from_numpy(f[0] * np.float32(0.5) + f[1] * np.float32(0.5)).to(torch.bfloat16)
    assert bits(got) == bits(expected)


def test_task_arithmetic_is_bit_exact_against_a_hand_computation():
    lam = [0.5, 1.25, -0.75]
    d = [(x - B) * np.float32(w) for x, w in zip(X, lam)]
    expected = ((d[0] + d[1]) + d[2]) + B
    got = run("task-arithmetic", X, base=B, weights=lam)
    assert got.numpy().tobytes() == expected.tobytes()


def test_inputs_are_left_untouched_by_merge_state_dicts():
    xs = [torch.from_numpy(x.copy()) for x in X]
    before = [bits(x) for x in xs]
    merge_state_dicts([{"w": x} for x in xs], "ties", base={"w": torch.from_numpy(B.copy())})
    assert [bits(x) for x in xs] == before


# -- TIES: worked example -----------------------------------------------------------------------

BASE5 = np.array([10.0, 20.0, 30.0, 40.0, 50.0], dtype=np.float32)
TAUS5 = np.array([
    [1.0, -2.0, 0.5, 0.0, 3.0],
    [-1.5, -1.0, 0.25, 2.0, -0.5],
    [0.5, 3.0, -0.125, 1.0, 2.0],
], dtype=np.float32)


def test_ties_worked_example():
    # density 0.6 of 5 elements: k = 3 largest magnitudes kept per task vector:
    #   t1 -> [ 1, -2, 0, 0, 3]   t2 -> [-1.5, -1, 0, 2, 0]   t3 -> [0, 3, 0, 1, 2]
    # sum [-0.5, 0, 0, 3, 5] elects signs [-, none, none, +, +]; the mean of the agreeing entries:
    #   [-1.5 (t2 only), 0 (no sign), 0, (2 + 1) / 2, (3 + 2) / 2] = [-1.5, 0, 0, 1.5, 2.5]
    got = run("ties", BASE5 + TAUS5, base=BASE5, density=0.6)
    assert got.tolist() == [8.5, 20.0, 30.0, 41.5, 52.5]
    # lambda scales the merged task vector; normalize=false sums instead of averaging
    assert run("ties", BASE5 + TAUS5, base=BASE5, density=0.6, **{"lambda": 2.0}).tolist() == [7.0, 20.0, 30.0, 43.0, 55.0]
    assert run("ties", BASE5 + TAUS5, base=BASE5, density=0.6, normalize=False).tolist() == [8.5, 20.0, 30.0, 43.0, 55.0]


def test_ties_weighted_mean():
    # weights 1, 3, 1 with density 1: weighted sum elects signs, the mean is weighted too
    got = run("ties", BASE5 + TAUS5, base=BASE5, density=1.0, weights=[1, 3, 1])
    w = np.array([1.0, 3.0, 1.0], dtype=np.float32)[:, None]
    d = TAUS5 * w
    sign = np.sign(d.sum(0))
    agree = np.sign(d) == sign
    agree &= d != 0
    expected = BASE5 + np.where(agree.any(0), (d * agree).sum(0) / np.maximum((w * agree).sum(0), 1), 0)
    np.testing.assert_array_equal(got.numpy(), expected.astype(np.float32))


def test_ties_gives_nan_where_a_task_vector_is_nan_and_trims_the_rest_as_before():
    """A fine-tune with NaN entries (a diverged run) merged with ties came out as the base at those
    entries, NaN gone without a trace (no sign to elect from a NaN sum: treated as no change), where
    linear, task-arithmetic and dare give NaN; and where NaN were more than the density keeps, the
    trim's threshold was NaN, so nothing was trimmed: every other element merged untrimmed. NaN now
    counts as the largest magnitude in the trim (as it did while fewer than k) and stays NaN in the
    result; the other elements are those of a NaN standing for a magnitude above every other."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1000, generator=g)
    a, b = base + torch.randn(1000, generator=g), base + torch.randn(1000, generator=g)
    bad = torch.zeros(1000, dtype=torch.bool)
    bad[::4] = True  # 250 entries
    a_nan, a_big = a.clone(), a.clone()
    a_nan[bad], a_big[bad] = math.nan, 1e30
    for density in (0.1, 0.5):  # keeps 100 (fewer than the NaN: the threshold was NaN) or 500
        out = merge_state_dicts([{"w": a_nan}, {"w": b}], "ties", params={"density": density}, base={"w": base})["w"]
        want = merge_state_dicts([{"w": a_big}, {"w": b}], "ties", params={"density": density}, base={"w": base})["w"]
        assert out[bad].isnan().all() and torch.equal(out[~bad], want[~bad])
    # +inf against -inf: no sign either (task-arithmetic's sum is NaN there too); dare's ties combine alike
    x, y, z = torch.tensor([1.0, 2.0]), torch.tensor([math.inf, 3.0]), torch.tensor([-math.inf, 3.0])
    for method, params in (("ties", {"density": 1.0}), ("dare", {"density": 1.0, "combine": "ties"})):
        out = merge_state_dicts([{"w": y}, {"w": z}], method, params=params, base={"w": x})["w"]
        assert out[0].isnan() and out[1] == 3.0


def test_trim_keeps_the_largest_and_every_tie_at_the_threshold():
    d = torch.tensor([0.1, -3.0, 2.0, -0.5, 2.0])
    assert trim_(d.clone(), 0.4).tolist() == [0.0, -3.0, 2.0, 0.0, 2.0]  # k = 2; both 2.0s tie at the threshold
    assert trim_(d.clone(), 0.2).tolist() == [0.0, -3.0, 0.0, 0.0, 0.0]
    assert trim_(d.clone(), 1.0).tolist() == d.tolist()


# -- DARE: worked example with the documented masks --------------------------------------------


def test_dare_masks_are_pinned():
    """The mask recipe (seed -> generator -> rand < density) is part of the result: pin it."""
    assert dare_seed(0, "w", 0) == dare_seed(0, "w", 0) != dare_seed(0, "w", 1) != dare_seed(1, "w", 1)
    m0 = dare_mask((8,), 0.5, dare_seed(7, "w", 0)).tolist()
    m1 = dare_mask((8,), 0.5, dare_seed(7, "w", 1)).tolist()
    assert m0 == MASK0 and m1 == MASK1


MASK0 = [True, True, False, False, True, False, True, True]
MASK1 = [True, True, True, True, False, True, True, True]


def test_dare_worked_example():
    base = np.arange(8, dtype=np.float32)
    t0 = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.float32) * 0.25
    t1 = np.array([-1, 1, -1, 1, -1, 1, -1, 1], dtype=np.float32) * 0.5
    # density 0.5: kept entries are doubled, dropped ones are 0; linear combine sums them.
    kept0 = np.where(MASK0, t0 * 2, 0)
    kept1 = np.where(MASK1, t1 * 2, 0)
    got = run("dare", [base + t0, base + t1], base=base, density=0.5, seed=7)
    np.testing.assert_array_equal(got.numpy(), base + (kept0 + kept1))
    # ties combine: the sign election and mean run on the rescaled entries
    got = run("dare", [base + t0, base + t1], base=base, density=0.5, seed=7, combine="ties")
    both = np.stack([kept0, kept1])
    sign = np.sign(both.sum(0))
    agree = (np.sign(both) == sign) & (both != 0)
    mean = np.where(agree.any(0), (both * agree).sum(0) / np.maximum(agree.sum(0), 1), 0)
    np.testing.assert_array_equal(got.numpy(), base + mean.astype(np.float32))


def test_dare_is_deterministic_per_seed_and_unbiased():
    base = np.zeros(4000, dtype=np.float32)
    tau = RNG.standard_normal(4000).astype(np.float32)
    a = run("dare", [tau], base=base, density=0.3, seed=1)
    assert bits(a) == bits(run("dare", [tau], base=base, density=0.3, seed=1))
    assert bits(a) != bits(run("dare", [tau], base=base, density=0.3, seed=2))
    kept = (a != 0).float().mean().item()
    assert 0.27 < kept < 0.33
    # E[mask / density * tau] = tau: over 200 seeds each element's ratio to tau averages
    # to 1 (per-element std 1/sqrt(200) = 0.07; over 4000 elements the mean is within ~0.001)
    mean = torch.stack([run("dare", [tau], base=base, density=0.5, seed=s) for s in range(200)]).mean(0)
    ratio = mean / torch.from_numpy(tau)
    assert abs(ratio.mean().item() - 1.0) < 0.01
    assert 0.05 < ratio.std().item() < 0.09


# -- SLERP ---------------------------------------------------------------------------------------


def test_slerp():
    a, b = np.array([1.0, 0.0], dtype=np.float32), np.array([0.0, 1.0], dtype=np.float32)
    mid = run("slerp", [a, b])
    assert torch.allclose(mid, torch.tensor([math.sqrt(0.5)] * 2))  # on the arc: norm 1, not 0.707
    assert bits(run("slerp", [X[0], X[1]], t=0.0)) == bits(torch.from_numpy(X[0]))
    assert bits(run("slerp", [X[0], X[1]], t=1)) == bits(torch.from_numpy(X[1]))
    # parallel inputs: plain linear interpolation
    assert run("slerp", [a, a * 3], t=0.25).tolist() == [1.5, 0.0]


# -- properties ----------------------------------------------------------------------------------

floats = arrays(np.float32, st.integers(1, 64), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False))


def test_slerp_of_float64_values_whose_squares_overflow_is_slerp():
    """slerp's angle comes from dot products in float64, which overflow past 1.3e154: for finite
    float64 inputs of 1e200 the angle was NaN and slerp silently fell back to a linear
    interpolation (another result), and where each block's dot product was in range but not their
    sum, math.fsum raised a bare OverflowError. The dots are then taken of the inputs scaled by a
    power of two (the angle is the same): the result is that of the scaled inputs, scaled back, exactly."""
    x, y = torch.tensor([1e200, 1e200], dtype=torch.float64), torch.tensor([1e200, 0.0], dtype=torch.float64)
    k = 2.0**-600
    for t in (0.5, 0.3):
        big = merge_state_dicts([{"w": x}, {"w": y}], "slerp", params={"t": t})["w"]
        small = merge_state_dicts([{"w": x * k}, {"w": y * k}], "slerp", params={"t": t})["w"]
        assert big.equal(small / k) and not big.equal(x * (1 - t) + y * t)
    a = torch.full((2**16 * 5,), 2.5e151, dtype=torch.float64)  # 5 blocks of 2**16, a·a 4.1e307 each
    b = a.clone()
    b[::2] = 1.25e151
    big = merge_state_dicts([{"w": a}, {"w": b}], "slerp")["w"]
    assert big.equal(merge_state_dicts([{"w": a * k}, {"w": b * k}], "slerp")["w"] / k)


def test_slerp_of_an_input_holding_nan_or_inf_is_slerp_elsewhere_and_nan_or_inf_there():
    """A NaN (or inf) in an input made slerp's angle NaN, and every other element of the tensor came
    out a linear interpolation instead, silently (another result). Linear, task-arithmetic, ties and
    dare keep a NaN to its element; slerp now does too: the angle is that of the elements finite in
    both inputs, so the rest is what slerp gives with those elements zero in both (bit for bit)."""
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(200_000, generator=g).to(dtype), torch.randn(200_000, generator=g).to(dtype)
        bad = torch.zeros(200_000, dtype=torch.bool)
        bad[[7, 70_000, 150_001]] = True  # (in three blocks of the dot products)
        a_odd, b_odd = a.clone(), b.clone()
        a_odd[7], b_odd[70_000], a_odd[150_001], b_odd[150_001] = math.nan, math.inf, -math.inf, math.nan
        zeroed = [a.masked_fill(bad, 0), b.masked_fill(bad, 0)]
        for t in (0.3, 0.5):
            out = merge_state_dicts([{"w": a_odd}, {"w": b_odd}], "slerp", params={"t": t})["w"]
            want = merge_state_dicts([{"w": zeroed[0]}, {"w": zeroed[1]}], "slerp", params={"t": t})["w"]
            linear = merge_state_dicts([{"w": a}, {"w": b}], "linear", params={"weights": [1 - t, t]})["w"]
            assert bits(out[~bad]) == bits(want[~bad]) and bits(out[~bad]) != bits(linear[~bad])
            assert out[7].isnan() and out[150_001].isnan() and out[70_000] == math.inf


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_linear_is_a_convex_combination(data):
    n = data.draw(st.integers(1, 4))
    first = data.draw(floats)
    xs = [first] + [data.draw(arrays(np.float32, first.shape, elements=st.floats(-1e3, 1e3, width=32))) for _ in range(n - 1)]
    ws = data.draw(st.lists(st.floats(0.01, 10), min_size=n, max_size=n))
    got = run("linear", xs, weights=ws).numpy()
    lo, hi = np.min(xs, axis=0), np.max(xs, axis=0)
    slack = 1e-5 * np.maximum(np.abs(lo), np.abs(hi)) + 1e-30
    assert np.all(got >= lo - slack) and np.all(got <= hi + slack)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_single_input_ties_and_dare_at_full_density_are_task_arithmetic(data):
    x = data.draw(floats)
    b = data.draw(arrays(np.float32, x.shape, elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)))
    ta = bits(run("task-arithmetic", [x], base=b))
    assert bits(run("ties", [x], base=b, density=1.0)) == ta
    assert bits(run("dare", [x], base=b, density=1.0)) == ta


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_ties_combine_in_blocks_is_bit_exact(data):
    """The block-at-a-time combine gives, bit for bit, what one pass over whole tensors gives,
    whatever the block size (sizes not a multiple of it, one block, transposed inputs)."""
    n = data.draw(st.integers(1, 4))
    rows, cols = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    elems = st.floats(-8, 8, width=32).map(lambda v: float(np.float32(round(v))))  # many ties and zeros
    ds = [data.draw(arrays(np.float32, (rows, cols), elements=elems)) for _ in range(n)]
    ws = data.draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 3.0]), min_size=n, max_size=n))
    normalize = data.draw(st.booleans())
    block = data.draw(st.integers(1, rows * cols + 2))

    def combine(block: int, transpose: bool) -> bytes:
        ts = [torch.from_numpy(d.copy()) for d in ds]
        if transpose:  # non-contiguous inputs: combined through a copy, the result transposed back
            return bits(ties_combine([t.t() for t in ts], ws, normalize, block=block).t().reshape(-1))
        return bits(ties_combine(ts, ws, normalize, block=block).reshape(-1))

    whole = combine(rows * cols, False)
    assert combine(block, False) == whole
    assert combine(block, True) == whole


@settings(max_examples=60, deadline=None)
@given(floats, st.integers(2, 4))
def test_property_merging_a_tensor_with_itself(x, n):
    # power-of-two shares are exact: x/2 + x/2 and x/4 * 4 give x back bit for bit
    if n in (2, 4):
        assert bits(run("linear", [x] * n)) == bits(torch.from_numpy(x))
    else:
        np.testing.assert_allclose(run("linear", [x] * n).numpy(), x, rtol=1e-6)
    for method in ("task-arithmetic", "ties", "dare"):
        assert torch.equal(run(method, [x] * n, base=x), torch.from_numpy(x))
    assert torch.equal(run("slerp", [x, x]), torch.from_numpy(x))


@settings(max_examples=80, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_property_density_range_is_enforced(v):
    ties = default_registry().get("ties")
    if 0 < v <= 1:
        assert ties.bind({"density": v}, 2, True)["density"] == v
    else:
        with pytest.raises(InvalidMergeError, match="density"):
            ties.bind({"density": v}, 2, True)


# -- registry and parameters --------------------------------------------------------------------


def test_registry_refuses_duplicates_and_builds_fresh():
    reg = default_registry()
    assert reg.names() == [m.name for m in BUILTIN_METHODS]
    with pytest.raises(InvalidMergeError, match="already registered"):
        reg.register(LINEAR)
    custom = MergeMethod("max", "elementwise max", (), lambda xs, b, p, n: torch.stack(xs).amax(0), identity=lambda p: True)
    reg.register(custom)
    assert "max" in reg and "max" not in default_registry()  # no global state
    assert run_with(reg, "max") == [3.0, 5.0]
    with pytest.raises(InvalidMergeError, match="unknown merge method 'nope'; known: linear"):
        reg.get("nope")


def run_with(reg: MethodRegistry, name: str) -> list[float]:
    sds = [{"w": torch.tensor([1.0, 5.0])}, {"w": torch.tensor([3.0, 2.0])}]
    return merge_state_dicts(sds, name, registry=reg)["w"].tolist()


@pytest.mark.parametrize("method, params, n, base, match", [
    ("linear", {"wieghts": "1,2"}, 2, False, "no parameter wieghts; it takes normalize, weights"),
    ("linear", {"weights": "1,2,3"}, 2, False, "3 values for 2 inputs"),
    ("linear", {"weights": "1,x"}, 2, False, "must be a number"),
    ("linear", {"weights": [1, -1]}, 2, False, "sum to 0"),
    ("linear", {"normalize": "maybe"}, 2, False, "true or false"),
    ("ties", {"density": "0"}, 2, True, r"density must be in \(0, 1\], got 0"),
    ("ties", {"density": 0.2}, 2, False, "needs a base"),
    ("ties", {"weights": "1,0"}, 2, True, "must be in"),
    ("dare", {"combine": "mean"}, 2, True, "one of linear, ties"),
    ("dare", {"seed": 1.5}, 2, True, "an integer"),
    ("dare", {"combine": "ties", "weights": "1,-1"}, 2, True, "weights > 0"),
    ("slerp", {}, 3, False, "takes 2 inputs, got 3"),
    ("slerp", {"t": "1.5"}, 2, False, r"t must be in \[0, 1\]"),
    ("task-arithmetic", {"weights": "nan,1"}, 2, True, "finite"),
    # integers past any float: float() and math.isfinite() raised OverflowError (a traceback)
    ("linear", {"weights": [10**400, 1]}, 2, False, "weights must be finite, got a number too large for a float"),
    ("slerp", {"t": 10**400}, 2, False, "t must be finite"),
    ("dare", {"seed": -(10**400)}, 2, True, r"seed must be in \[0, inf\), got -1000"),
    # past float32's range: ties raised torch's bare RuntimeError, task-arithmetic and dare returned inf and NaN
    ("ties", {"weights": "1e39,1e39"}, 2, True, r"weights' magnitudes add up to 2e\+39, beyond float32's largest number \(3.4e\+38\)"),
    ("ties", {"lambda": "1e39"}, 2, True, r"lambda 1e\+39 is beyond float32's largest"),
    ("task-arithmetic", {"weights": "1,-1e39"}, 2, True, r"add up to 1e\+39"),
    ("dare", {"weights": "1e39,1", "combine": "ties"}, 2, True, "add up to 1e\\+39"),
    ("dare", {"lambda": "1e39"}, 2, True, "lambda 1e\\+39 is beyond"),
    # 1/density past float32's range: every element of the merge came out NaN (0/0 where 1e-320 rounds to 0)
    ("dare", {"density": "1e-320"}, 2, True, r"density 1e-320 scales the entries it keeps by 1/density, beyond float32's largest"),
    ("dare", {"density": "2.9e-39", "combine": "ties"}, 2, True, r"give a density of at least 2.94e-39"),
])
def test_bad_parameters_are_rejected(method, params, n, base, match):
    with pytest.raises(InvalidMergeError, match=match):
        default_registry().get(method).bind(params, n, base)


def test_parameters_parse_cli_strings_and_fill_defaults():
    dare = default_registry().get("dare")
    p = dare.bind({"density": "0.3", "seed": "4", "combine": "ties", "weights": "1, 0.5"}, 2, True)
    assert p == {"density": 0.3, "combine": "ties", "weights": [1.0, 0.5], "lambda": 1.0, "seed": 4}
    assert dare.bind({"seed": "1" + "0" * 400}, 2, True)["seed"] == 10**400  # any integer seeds (isfinite() of it overflowed)
    text = describe(dare)
    assert "density (float, (0, 1]; default 0.5)" in text and "seed (int, [0, inf); default 0)" in text
    assert Param("x", "floats", None, "").default_text() == "1.0 each"


def test_weights_past_float32_are_refused_not_merged_into_inf():
    """What test_bad_parameters_are_rejected checks of bind(), through merge_state_dicts: the
    merge gave inf and NaN (task-arithmetic, dare) or a RuntimeError (ties) for weights within
    float64's range but past float32's, the compute dtype."""
    torch.manual_seed(0)
    base = {k: v.detach().clone() for k, v in torch.nn.Linear(4, 3).state_dict().items()}
    fts = [{k: v + 0.01 * torch.randn(v.shape) for k, v in base.items()} for _ in range(2)]
    for method in ("task-arithmetic", "ties", "dare"):
        with pytest.raises(InvalidMergeError, match="beyond float32's largest"):
            merge_state_dicts(fts, method, params={"weights": [3.5e38, 3.5e38]}, base=base)
    # each weight within range, their sum (ties divides by it) not: every task vector came out 0, the base itself
    with pytest.raises(InvalidMergeError, match="add up to 6e\\+38"):
        merge_state_dicts(fts, "ties", params={"weights": [3e38, 3e38], "density": 1.0}, base=base)
    with pytest.raises(InvalidMergeError, match="density 1e-320"):  # (it returned NaN for every element)
        merge_state_dicts(fts, "dare", params={"density": 1e-320}, base=base)
    assert all(torch.isfinite(v).all() for v in merge_state_dicts(fts, "dare", params={"density": 3e-39}, base=base).values())
    tied = merge_state_dicts(fts, "ties", params={"weights": [1e38, 1e38], "density": 1.0}, base=base)  # within range
    assert all(not torch.equal(tied[k], base[k]) for k in base) and all(torch.isfinite(v).all() for v in tied.values())


def test_merge_state_dicts_refuses_a_base_or_inputs_that_do_not_line_up():
    """merge_state_dicts with the base of another model (nn.Linear(4, 1) for fine-tunes of
    nn.Linear(4, 3)) broadcast the base's [1, 4] weight and [1] bias into every input and returned
    a result; a tensor of the second input only was dropped without a word, and one of the first
    input only raised a bare KeyError. ckpt.merge refuses all three (its plan compares the base
    too); so does merge_state_dicts now, before any math."""
    torch.manual_seed(0)
    fts = [{k: v.detach().clone() for k, v in torch.nn.Linear(4, 3).state_dict().items()} for _ in range(2)]
    other = {k: v.detach().clone() for k, v in torch.nn.Linear(4, 1).state_dict().items()}
    for method in ("task-arithmetic", "ties", "dare"):
        with pytest.raises(InvalidMergeError, match=r"weight differs in dtype/shape between the inputs \(torch.float32\[3, 4\]\) "
                                                    r"and the base \(torch.float32\[1, 4\]\)"):
            merge_state_dicts(fts, method, base=other)
    with pytest.raises(InvalidMergeError, match="differs in dtype/shape between the inputs"):
        merge_state_dicts(fts, "task-arithmetic", base={k: v.double() for k, v in fts[0].items()})
    head = torch.ones(2)
    with pytest.raises(InvalidMergeError, match="head is in input 1 and not in input 0"):
        merge_state_dicts([fts[0], {**fts[1], "head": head}])
    with pytest.raises(InvalidMergeError, match="head is in input 0 and not in input 1"):
        merge_state_dicts([{**fts[0], "head": head}, fts[1]])
    base = {k: v.detach().clone() for k, v in torch.nn.Linear(4, 3).state_dict().items()}
    out = merge_state_dicts(fts, "task-arithmetic", base=base)  # lined up: as before
    want = (fts[0]["weight"] - base["weight"]).mul(1.0).add((fts[1]["weight"] - base["weight"]).mul(1.0)).add(base["weight"])
    assert torch.equal(out["weight"], want)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_merge_state_dicts_merges_the_dtypes_a_stored_merge_does(store, tmp_path):
    """merge_state_dicts decided by torch's is_floating_point what ckpt.merge decides by its own list
    (planning.FLOAT_DTYPES): it averaged E8M0 tensors (MX block scales, powers of two: an average of
    exponents is no scale) that a merge of the same tensors pushed to a store refuses; compared
    non-float tensors with torch.equal, so that a complex tensor holding a NaN differed from its
    own copy; and two float4 tensors (or two identical complex32 ones) ended in torch's bare
    NotImplementedError. Both now go by the one list and compare bits."""
    scale = torch.tensor([1.0, 2.0, 4.0]).to(torch.float8_e8m0fnu)
    other = torch.tensor([1.0, 2.0, 8.0]).to(torch.float8_e8m0fnu)
    for i, t in enumerate((scale, other)):
        save_file({"s": t, "w": torch.full((3,), float(i))}, tmp_path / f"{i}.safetensors")
        store.push(str(tmp_path / f"{i}.safetensors"), f"e8/{i}")
    with pytest.raises(InvalidMergeError, match="s is F8_E8M0 and differs between inputs: only floating-point"):
        ckpt.merge(["e8/0", "e8/1"], name="e8/m", store=store)
    with pytest.raises(InvalidMergeError, match="s is F8_E8M0 and differs between inputs: only floating-point"):
        merge_state_dicts([{"s": scale, "w": torch.zeros(3)}, {"s": other, "w": torch.ones(3)}])
    same = merge_state_dicts([{"s": scale, "w": torch.zeros(3)}, {"s": scale.clone(), "w": torch.ones(3)}])
    assert same["s"].view(torch.uint8).equal(scale.view(torch.uint8)) and same["w"].equal(torch.full((3,), 0.5))
    z = torch.tensor([complex(math.nan, 1.0), 2 + 0j])
    assert merge_state_dicts([{"z": z}, {"z": z.clone()}])["z"].view(torch.uint8).equal(z.view(torch.uint8))
    f4 = torch.tensor([1, 2], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(InvalidMergeError, match="f is float4_e2m1fn_x2 and differs between inputs"):
        merge_state_dicts([{"f": f4}, {"f": torch.tensor([1, 3], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}])
    half = torch.ones(2, dtype=torch.complex32)
    assert merge_state_dicts([{"h": half}, {"h": half.clone()}])["h"].view(torch.uint8).equal(half.view(torch.uint8))

