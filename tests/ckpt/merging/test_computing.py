"""Merged values cast back to the inputs' dtype (ckpt/merging/computing.py's cast_back): past the dtype's
range, a merge stops or saturates, in every float dtype; an input's inf or NaN stays what the method makes of it.
(float8 dtypes without an infinity: tests/ckpt/merging/test_combine.py.)"""

from __future__ import annotations

import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt
from ckpt.errors import InvalidMergeError, RefNotFoundError
from ckpt.merging.combine import merge_state_dicts
from ckpt.merging.computing import cast_back
from ckpt.merging.formulas import dare_mask, dare_seed

INF, NAN = math.inf, math.nan
WITH_INFINITY = [(torch.float16, "F16"), (torch.bfloat16, "BF16"), (torch.float8_e5m2, "F8_E5M2")]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype, st", WITH_INFINITY)
def test_a_merge_past_the_range_is_refused_or_saturated_not_made_inf(dtype, st, store, tmp_path, monkeypatch, capsys, caplog):
    """A fine-tune merged with lambda 3 into F16, BF16 or F8_E5M2 got inf weights, silently (torch's cast; in
    bfloat16, whose range is nearly float32's, the float32 math itself overflowed to inf). The merge now
    stops, naming the tensor and the count, before any ref is written, unless overflow="saturate" clips
    them; the inf and NaN of an input (elements 5 to 7) stay as the method makes them, and are not counted."""
    from ckpt_store.cli.main import main

    top = torch.finfo(dtype).max
    b = torch.tensor([0.0, 1.0, top / 2, -top / 2, 2.0, 1.0, -1.0, 1.0]).to(dtype)
    f = torch.tensor([0.0, 1.5, top * 0.75, -top * 0.75, 2.0, INF, -INF, NAN]).to(dtype)
    save_file({"w": b}, tmp_path / "base.safetensors")
    save_file({"w": f}, tmp_path / "ft.safetensors")
    store.push(str(tmp_path / "base.safetensors"), "o/base")
    store.push(str(tmp_path / "ft.safetensors"), "o/ft")
    kw = {"base": "o/base", "store": store}
    with pytest.raises(InvalidMergeError, match=rf"^w: 2 merged values past {st}'s range \(±{re.escape(f'{top:g}')}\): they would be stored as inf") as e:
        ckpt.merge(["o/ft"], "task-arithmetic", name="o/out", params={"weights": [3.0]}, **kw)
    assert "--overflow saturate" in (e.value.hint or "")
    with pytest.raises(RefNotFoundError):
        store.resolve("o/out")

    with caplog.at_level("WARNING", logger="ckpt.merging.computing"):
        ckpt.merge(["o/ft"], "task-arithmetic", name="o/out", params={"weights": [3.0]}, overflow="saturate", **kw)
    assert [r.getMessage() for r in caplog.records] == [f"w: 2 merged values past {st}'s range (±{top:g}): clipped to ±{top:g} (overflow=saturate)"]
    got = store.load("o/out")["w"]
    # base + 3 x (ft - base) in float32, the two past the range clipped (in bfloat16 the float32 sum was inf already)
    x = b.float() + (f.float() - b.float()) * 3
    assert x[2] > top and x[3] < -top and x[5:7].tolist() == [INF, -INF] and x[7].isnan()
    x[2], x[3] = top, -top
    assert bits(got) == bits(x.to(dtype)) and bits(got[:7]) == bits(torch.tensor([0.0, 2.5, top, -top, 2.0, INF, -INF]).to(dtype))
    assert store.manifest("o/out").lineage["merge"]["overflow"] == "saturate"
    sd = merge_state_dicts([{"w": f}], "task-arithmetic", params={"weights": [3.0]}, base={"w": b}, overflow="saturate")
    assert bits(sd["w"]) == bits(got)

    # in range, the input's inf and NaN are merged as ever, by default: not refused
    ckpt.merge(["o/ft"], "task-arithmetic", name="o/in-range", params={"weights": [1.0]}, **kw)
    want = (b.float() + (f.float() - b.float()) * 1).to(dtype)
    assert bits(store.load("o/in-range")["w"]) == bits(want) and want[5:7].float().tolist() == [INF, -INF]

    monkeypatch.setenv("CKPT_STORE", store.url)
    for extra, code in (((), 1), (("--overflow", "saturate"), 0)):
        with pytest.raises(SystemExit) as e:
            main(["merge", "o/ft", "--method", "task-arithmetic", "-b", "o/base", "-w", "3", "-o", "o/cli", *extra])
        err = capsys.readouterr().err
        assert e.value.code == code, err
        if code:
            assert err.startswith(f"error: w: 2 merged values past {st}'s range") and "--overflow saturate" in err
            assert err.count("\n") <= 2 and "Traceback" not in err
    store.pull("o/cli", tmp_path / "cli.safetensors")
    assert bits(load_file(tmp_path / "cli.safetensors")["w"]) == bits(got)


@pytest.mark.parametrize("dtype, st", WITH_INFINITY)
def test_the_rounding_edge_is_torchs_own(dtype, st, caplog):
    """Half a step past the largest value rounds to inf (round half to even: the largest's last bit is odd):
    a merged value there is refused, one just below it is the largest, stored as torch casts it, unannounced."""
    top = torch.finfo(dtype).max
    tie = (top + 2.0 ** (math.floor(math.log2(top)) + 1)) / 2  # between the largest and the next power of two
    below = torch.nextafter(torch.tensor(tie), torch.tensor(0.0))  # (float32: tie is one, for the three)
    assert float(torch.tensor(tie)) == tie and torch.tensor([tie]).to(dtype).float().tolist() == [INF]  # the premise
    assert torch.stack([below, -below]).to(dtype).float().tolist() == [top, -top]
    with caplog.at_level("WARNING", logger="ckpt.merging.computing"):
        got = cast_back(torch.stack([below, -below]), st, "w", None)
    assert bits(got) == bits(torch.tensor([top, -top]).to(dtype)) and not caplog.records
    for edge in (tie, -tie):
        with pytest.raises(InvalidMergeError, match=rf"^w: 1 merged value past {st}'s range"):
            cast_back(torch.tensor([1.0, edge]), st, "w", None)
    with caplog.at_level("WARNING", logger="ckpt.merging.computing"):
        got = cast_back(torch.tensor([tie, -tie, 1.0]), st, "w", None, "saturate")
    assert bits(got) == bits(torch.tensor([top, -top, 1.0]).to(dtype)) and "w: 2 merged values" in caplog.text
    if dtype == torch.float16:  # the same edge through a merge: 0 + 3 x 21,840 = 65,520, and 4 + 3 x 21,836 = 65,512
        def merged(base):
            return merge_state_dicts([{"w": torch.tensor([21840.0], dtype=dtype)}], "task-arithmetic",
                                     params={"weights": [3.0]}, base={"w": torch.tensor([base], dtype=dtype)})["w"]

        with pytest.raises(InvalidMergeError, match="^w: 1 merged value past F16's range"):
            merged(0.0)
        assert bits(merged(4.0)) == bits(torch.tensor([65504.0], dtype=dtype))


def test_an_inf_the_float32_math_made_is_refused_where_no_input_held_one(store):
    """float32 (and float64) inputs are merged in their own dtype: a merge past their range made inf in the math,
    stored as it was. Refused now, as in every float dtype, where no input held an inf there and the true value
    is past the range; an input's inf in the same tensor stays inf (also when averaged: new_tensors="average")."""
    big = 2.0e38
    b = {"w": torch.tensor([0.0, 1.0, 1.0]), "head": torch.tensor([big, 1.0])}
    f = {"w": torch.tensor([big, 2.0, INF]), "head": torch.tensor([big, INF])}
    f2 = {"w": torch.tensor([big, 3.0, 1.0]), "head": torch.tensor([big, 1.0])}
    with pytest.raises(InvalidMergeError, match=r"^w: 1 merged value past F32's range \(±3.40282e\+38\): they would be stored as inf"):
        merge_state_dicts([f], "task-arithmetic", params={"weights": [3.0]}, base=b)
    sd = merge_state_dicts([f], "task-arithmetic", params={"weights": [3.0]}, base=b, overflow="saturate")
    assert sd["w"].tolist() == [torch.finfo(torch.float32).max, 4.0, INF]
    store.push({"w": b["w"]}, "f32/base")
    store.push(f, "f32/ft")
    store.push(f2, "f32/ft2")
    # head, which the base lacks, averaged: big + big overflows float32's sum, but the average is big (computed
    # again, scaled: see test_an_average_past_the_float32_sum_is_the_average); the input's inf stays, not refused
    ckpt.merge(["f32/ft", "f32/ft2"], "task-arithmetic", name="f32/out", base="f32/base", store=store,
               params={"weights": [0.0, 0.0]}, new_tensors="average")
    assert bits(store.load("f32/out")["head"]) == bits(torch.tensor([big, INF]))
    f2["head"][0] = 1.0
    store.push(f2, "f32/ft2")
    ckpt.merge(["f32/ft", "f32/ft2"], "task-arithmetic", name="f32/out", base="f32/base", store=store,
               params={"weights": [0.0, 0.0]}, new_tensors="average")
    head = store.load("f32/out")["head"]
    assert bits(head) == bits((f["head"] + f2["head"]) / 2) and head[1] == INF


def test_a_merge_reads_each_manifest_once(store, monkeypatch):
    """The merge's push read and parsed its delta base's manifest again (the base, else the first input), though
    the merge held it parsed: for a model of 100,000 tiny tensors, ~55 MiB more at the merge's peak."""
    import collections

    g = torch.Generator().manual_seed(0)
    base = {f"t{i}": torch.randn(4, generator=g) for i in range(50)}
    store.push(base, "r/base")
    for j in range(2):
        store.push({k: v + 0.01 * torch.randn(4, generator=g) for k, v in base.items()}, f"r/ft{j}")
    reads: collections.Counter[str] = collections.Counter()
    get = store.objects.get_manifest
    monkeypatch.setattr(store.objects, "get_manifest", lambda mid, *a, **kw: (reads.update([mid]), get(mid, *a, **kw))[1])
    for b in ("r/base", None):
        reads.clear()
        ckpt.merge(["r/ft0", "r/ft1"], "task-arithmetic" if b else "linear", name=f"r/out{b is None}", base=b, store=store,
                   params={"weights": [0.5, 0.5]})
        assert sorted(reads.values()) == [1] * (3 if b else 2), reads


def fine_tunes(dtype: torch.dtype, n: int = 2) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """A real model (a transformer encoder layer) and ``n`` fine-tunes of it, each a few AdamW steps on its own
    data with a classification head the base lacks, in ``dtype``."""
    torch.manual_seed(0)
    body = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    base = {k: v.detach().clone() for k, v in body.state_dict().items()}
    fts = []
    for i in range(n):
        torch.manual_seed(1 + i)
        body.load_state_dict(base)
        head = torch.nn.Linear(32, 3)
        opt = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-3)
        for _ in range(3):
            x, y = torch.randn(8, 5, 32), torch.randint(0, 3, (8,))
            loss = torch.nn.functional.cross_entropy(head(body(x).mean(1)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sd = {k: v.detach().clone() for k, v in body.state_dict().items()}
        sd.update({f"head.{k}": v.detach().clone() for k, v in head.state_dict().items()})
        fts.append({k: v.to(dtype) for k, v in sd.items()})
    return {k: v.to(dtype) for k, v in base.items()}, fts


@pytest.mark.parametrize("dtype, st", [(torch.bfloat16, "BF16"), (torch.float32, "F32"), (torch.float64, "F64")])
def test_an_average_past_the_float32_sum_is_the_average(dtype, st, store, tmp_path, monkeypatch, capsys):
    """The plain average (new_tensors="average": a head the base lacks) summed the inputs in float32 (float64 for
    float64), then divided: two values near bfloat16's or float32's largest (float64's, in float64) made inf, refused
    though the average is representable, and with overflow="saturate" the largest, not the average. Where the sum
    overflows the elements are computed again, scaled (the average now); everywhere else the bytes are what the
    float32 sum gave, of a real model's fine-tunes."""
    from ckpt_store.cli.main import main

    base, fts = fine_tunes(dtype)
    top = torch.finfo(dtype).max
    planted = {0: (top, top), 1: (top, top / 2), 2: (-top, -top * 0.75), 3: (top, -top)}  # head.weight's first row
    for i, (a, b) in planted.items():
        fts[0]["head.weight"][0, i], fts[1]["head.weight"][0, i] = a, b
    for i, sd in enumerate([base, *fts]):
        save_file(sd, tmp_path / f"m{i}.safetensors")
        store.push(str(tmp_path / f"m{i}.safetensors"), f"avg/m{i}")
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    want = {}
    for k, x in fts[0].items():  # what the code before gave: the heads' sum in the compute dtype, divided by 2; the
        y = fts[1][k].to(cd)  # body's task arithmetic, base + ((x0 − base)·0.5 + (x1 − base)·0.5), in that order
        want[k] = ((x.to(cd) + y) / 2 if k.startswith("head.") else
                   ((x.to(cd) - base[k].to(cd)) * 0.5 + (y - base[k].to(cd)) * 0.5) + base[k].to(cd)).to(dtype)
    assert want["head.weight"][0, :3].isinf().all() and want["head.weight"][0, 3] == 0  # (the premise)
    for i, (a, b) in planted.items():  # the average, exact: each half is
        want["head.weight"][0, i] = float(torch.tensor(a, dtype=dtype)) / 2 + float(torch.tensor(b, dtype=dtype)) / 2
    assert want["head.weight"][0, 0] == top and want["head.weight"][0, :3].isfinite().all()

    kw = {"base": "avg/m0", "store": store, "new_tensors": "average", "params": {"weights": [0.5, 0.5]}}
    for overflow in ("error", "saturate"):
        r = ckpt.merge(["avg/m1", "avg/m2"], "task-arithmetic", name=f"avg/{overflow}", overflow=overflow, **kw)
        assert sorted(r.averaged) == ["head.bias", "head.weight"] and r.merged == len(base)
        store.pull(f"avg/{overflow}", tmp_path / f"{overflow}.safetensors")
        got = load_file(tmp_path / f"{overflow}.safetensors")
        assert {k: bits(v) for k, v in got.items()} == {k: bits(v) for k, v in want.items()}
    sd = merge_state_dicts(fts, "task-arithmetic", params={"weights": [0.5, 0.5]}, base=base, new_tensors="average")
    assert {k: bits(v) for k, v in sd.items()} == {k: bits(v) for k, v in want.items()}
    monkeypatch.setenv("CKPT_STORE", store.url)
    with pytest.raises(SystemExit) as e:
        main(["merge", "avg/m1", "avg/m2", "--method", "task-arithmetic", "-b", "avg/m0", "-w", "0.5,0.5",
              "--new-tensors", "average", "-o", "avg/cli"])
    assert e.value.code == 0, capsys.readouterr().err
    assert bits(store.load("avg/cli")["head.weight"]) == bits(want["head.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_weighted_sum_whose_math_overflows_but_whose_result_fits_is_that_result(dtype, store, tmp_path):
    """Linear and task-arithmetic are weighted sums whose weights sum to 1 (task arithmetic's are 1 − Σλ for the
    base, λ_i for the inputs): 2·a − b, or base + (a − base) − (b − base), can fit though a step overflows float32.
    The result was inf (refused), or NaN stored silently (inf − inf; 0 × inf where λ is 0). Such elements are
    computed again in float64 (float64 inputs: scaled by a power of two), in the same order: the result, not
    refused. A result truly past the range is refused as before."""
    from fractions import Fraction

    top = torch.finfo(dtype).max
    e = 127 if dtype != torch.float64 else 1023
    q, r = 1.5 * 2.0**e, 1.75 * 2.0**e  # (0.75 and 0.875 × 2^128, or 2^1024: the sums below exact in every dtype)
    b = torch.tensor([-q, -q, 1.0, 2.0], dtype=torch.float64).to(dtype)
    x0 = torch.tensor([q, q, 3.0, 5.0], dtype=torch.float64).to(dtype)
    x1 = torch.tensor([r, q, 2.0, 7.0], dtype=torch.float64).to(dtype)
    for i, sd in enumerate(({"w": b}, {"w": x0}, {"w": x1})):
        save_file(sd, tmp_path / f"m{i}.safetensors")
        store.push(str(tmp_path / f"m{i}.safetensors"), f"ws/m{i}")
    a, c, base = ([Fraction(float(v)) for v in t] for t in (x0, x1, b))  # (exact arithmetic)
    cases = [  # method, weights, the merged values, where the math made inf or NaN at the first two elements
        ("linear", [2.0, -1.0], [2 * ai - ci for ai, ci in zip(a, c)]),  # 2q overflows
        ("task-arithmetic", [1.0, -1.0], [bi + (ai - bi) - (ci - bi) for ai, ci, bi in zip(a, c, base)]),  # inf − inf
        ("task-arithmetic", [0.0, 0.5], [bi + (ci - bi) / 2 for ci, bi in zip(c, base)]),  # 0 × inf
    ]
    for method, ws, exact in cases:
        want = torch.tensor([float(v) for v in exact], dtype=torch.float64).to(dtype)
        assert want[:2].isfinite().all()
        params, kw = {"weights": ws, **({"normalize": False} if method == "linear" else {})}, {}
        if method != "linear":
            kw["base"] = "ws/m0"
        for overflow in ("error", "saturate"):
            ckpt.merge(["ws/m1", "ws/m2"], method, name="ws/out", params=params, overflow=overflow, store=store, **kw)
            assert bits(store.load("ws/out")["w"]) == bits(want), (method, ws, store.load("ws/out")["w"])
        sd = merge_state_dicts([{"w": x0}, {"w": x1}], method, params=params, base={"w": b} if kw else None)
        assert bits(sd["w"]) == bits(want)
    # truly past: 3r − 2q, computed again, is past too (refused, or saturated); 3q − 2q is q
    with pytest.raises(InvalidMergeError, match=r"^w: 1 merged value past"):
        ckpt.merge(["ws/m2", "ws/m1"], "linear", name="ws/past", params={"weights": [3.0, -2.0]}, store=store)
    sd = merge_state_dicts([{"w": x1}, {"w": x0}], "linear", params={"weights": [3.0, -2.0]}, overflow="saturate")
    assert bits(sd["w"]) == bits(torch.tensor([top, q, 0.0, 11.0], dtype=torch.float64).to(dtype))


def test_a_nan_the_math_makes_from_finite_inputs_is_refused_in_either_mode(store, tmp_path, monkeypatch, capsys):
    """DARE drops task-vector entries by multiplying them by 0: a task vector that overflowed float32 (x − base past
    its range) became 0 × inf = NaN, stored silently, even with overflow="saturate" (a NaN has nothing to clip to).
    Refused now in either mode, naming the tensor and the count, before any ref is written; an input's NaN stays."""
    from ckpt_store.cli.main import main

    top = torch.finfo(torch.float32).max
    n = 64
    b = torch.full((n,), -top * 0.75)
    x = torch.full((n,), top * 0.75)
    x[-1], b[-1] = NAN, 0.0  # an input's NaN: not the math's
    for i, sd in enumerate(({"w": b}, {"w": x}, {"w": x.clone()})):
        save_file(sd, tmp_path / f"m{i}.safetensors")
        store.push(str(tmp_path / f"m{i}.safetensors"), f"nan/m{i}")
    dropped = int((~dare_mask((n,), 0.5, dare_seed(0, "w", 0))[:-1]).sum())
    assert 0 < dropped < n - 1  # (the premise: some entries dropped, some kept: inf, refused as before)
    for overflow in ("saturate", "error"):  # (saturate stored the NaN; by default the kept entries' inf was refused)
        with pytest.raises(InvalidMergeError, match=rf"^w: {dropped} merged values are NaN where no input holds an inf or NaN "
                           r"\(the math overflowed: inf − inf, 0 × inf\); --overflow saturate cannot clip a NaN"):
            ckpt.merge(["nan/m1"], "dare", name="nan/out", base="nan/m0", params={"density": 0.5}, overflow=overflow, store=store)
        with pytest.raises(RefNotFoundError):
            store.resolve("nan/out")
        with pytest.raises(InvalidMergeError, match=rf"^w: {dropped} merged values are NaN"):
            merge_state_dicts([{"w": x}], "dare", params={"density": 0.5}, base={"w": b}, overflow=overflow)
    monkeypatch.setenv("CKPT_STORE", store.url)
    with pytest.raises(SystemExit) as e:
        main(["merge", "nan/m1", "--method", "dare", "-b", "nan/m0", "-p", "density=0.5", "--overflow", "saturate", "-o", "nan/cli"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith(f"error: w: {dropped} merged values are NaN") and "cannot clip a NaN" in err
    assert err.count("\n") <= 2 and "Traceback" not in err
    # the input's NaN alone (no overflow): merged as ever, NaN at its element
    ckpt.merge(["nan/m2", "nan/m1"], "dare", name="nan/ok", base="nan/m2", params={"density": 0.5}, store=store)
    got = store.load("nan/ok")["w"]
    assert got[-1].isnan() and bool(got[:-1].isfinite().all())


def test_a_float64_term_that_would_lose_bits_once_scaled_is_refused_not_stored_wrong(store):
    """Float64 elements computed again are scaled by 2^-k: a small term (1e-300 beside 2^1000·2^127 − 2^1000·2^127)
    scaled below float64's least normal value lost its bits, and the merge stored 0.0 for 1e-300 with no error. Such
    an element is now not computed: its NaN (inf − inf) is refused. An element whose terms all stay normal is kept."""
    d = torch.float64
    xs = [torch.tensor([2.0**1000, 2.0**1000], dtype=d), torch.tensor([2.0**1000, 2.0**1000], dtype=d),
          torch.tensor([1e-300, 2.0**-500], dtype=d)]
    params = {"weights": [2.0**127, -(2.0**127), 1.0], "normalize": False}
    with pytest.raises(InvalidMergeError, match=r"^w: 1 merged value is NaN"):
        merge_state_dicts([{"w": x} for x in xs], "linear", params=params)
    for i, x in enumerate(xs):
        store.push({"w": x}, f"lost/m{i}")
    with pytest.raises(InvalidMergeError, match=r"^w: 1 merged value is NaN"):
        ckpt.merge([f"lost/m{i}" for i in range(3)], "linear", name="lost/out", params=params, store=store)
    kept = merge_state_dicts([{"w": x[1:]} for x in xs], "linear", params=params)["w"]  # 2^-500 stays normal: exact
    assert bits(kept) == bits(torch.tensor([2.0**-500], dtype=d))
    # a normal input whose product by its weight (2^-800 · 2^-200 = 2^-1000) falls below normal once scaled: was 0.0
    small = [xs[0][:1], xs[1][:1], torch.tensor([2.0**-800], dtype=d)]
    with pytest.raises(InvalidMergeError, match=r"^w: 1 merged value is NaN"):
        merge_state_dicts([{"w": x} for x in small], "linear", params={**params, "weights": [2.0**127, -(2.0**127), 2.0**-200]})


def test_a_float64_product_or_quotient_that_would_lose_bits_once_scaled_is_refused_not_stored_wrong(store):
    """The loss check tested each input alone (``λ_i·x_i``), not what the math multiplies or divides. Task arithmetic
    multiplies ``x_i − base``: with base 1.5·2^-892 and x_2 one ulp above it, ``0.525·(x_2 − base)`` scaled by 2^-128
    (2^126·2^1000 − 2^126·2^1000 overflowed) fell below normal, rounded to a tie, and the merge stored the base where
    float64's math gives the base + 1 ulp. The plain average divides a sum that cancels to 7·2^-1022 + 2^-1060: the
    quotient below normal once scaled by 2^-1 kept fewer bits (0x1.2aaaaaaaab556p-1022, not …555). Both silently.
    Such elements are now not computed (refused, store and API); elements whose products stay normal are kept, exact."""
    d = torch.float64
    b = 1.5 * 2.0**-892
    base = torch.tensor([b, 0.5], dtype=d)
    xs = [torch.tensor([2.0**1000, 2.0**1000], dtype=d), torch.tensor([2.0**1000, 2.0**1000], dtype=d),
          torch.tensor([b + 2.0**-944, 2.5], dtype=d)]
    params = {"weights": [2.0**126, -(2.0**126), 0.525]}
    for i, x in enumerate([base, *xs]):
        store.push({"w": x}, f"prod/m{i}")
    with pytest.raises(InvalidMergeError, match=r"^w: 1 merged value is NaN"):
        merge_state_dicts([{"w": x} for x in xs], "task-arithmetic", params=params, base={"w": base})
    with pytest.raises(InvalidMergeError, match=r"^w: 1 merged value is NaN"):
        ckpt.merge([f"prod/m{i}" for i in (1, 2, 3)], "task-arithmetic", base="prod/m0", name="prod/out", params=params, store=store)
    with pytest.raises(RefNotFoundError):
        store.resolve("prod/out")
    want = torch.tensor([0.5 + 2 * 0.525], dtype=d)  # 0.5 + 0.525·(2.5 − 0.5), the one rounding Python's own
    kept = merge_state_dicts([{"w": x[1:]} for x in xs], "task-arithmetic", params=params, base={"w": base[1:]})["w"]
    assert bits(kept) == bits(want)

    h, a, delta = 1.5 * 2.0**1023, 2.0**-1010, 7 * 2.0**-1022 + 2.0**-1060  # ((h + h) − h − h + a − (a − δ)) / 6
    ys = [torch.tensor([v, w], dtype=d) for v, w in ((h, h), (h, h), (-h, -h), (-h, -h), (a, 3.0), (delta - a, 0.0))]
    store.push({"other": torch.zeros(1, dtype=d)}, "quot/base")
    for i, y in enumerate(ys):
        store.push({"v": y, "other": torch.ones(1, dtype=d)}, f"quot/m{i}")
    kw = {"params": {"weights": [0.1] * 6}, "new_tensors": "average"}
    for overflow in ("error", "saturate"):  # (saturate clipped the math's inf: 1.8e308 for δ/6 ≈ 1.2e-308)
        with pytest.raises(InvalidMergeError, match=r"^v: 1 merged value is NaN") as e:
            merge_state_dicts([{"v": y} for y in ys], "task-arithmetic", base={}, overflow=overflow, **kw)
        assert "without losing bits" in e.value.hint
        with pytest.raises(InvalidMergeError, match=r"^v: 1 merged value is NaN"):
            ckpt.merge([f"quot/m{i}" for i in range(6)], "task-arithmetic", base="quot/base", name="quot/out", store=store,
                       overflow=overflow, **kw)
    kept = merge_state_dicts([{"v": y[1:]} for y in ys], "task-arithmetic", base={}, **kw)["v"]
    assert bits(kept) == bits(torch.tensor([0.5], dtype=d))  # (h + h − h − h + 3 + 0) / 6


def test_elements_computed_again_take_the_weights_the_float32_math_took(store):
    """The float32 math multiplies by each weight rounded to float32 (torch rounds the scalar); the elements computed
    again in float64 took the weights unrounded (after normalize too): thousands of them differed from the same
    operations in the same order. Linear, normalize=true, weights 1 and -0.7 (1/0.3 and -0.7/0.3: not float32)."""
    n = 20000
    g = torch.Generator().manual_seed(0)
    a = (1.0 + 0.45 * torch.rand(n, generator=g, dtype=torch.float64)).float() * 2.0**126
    b = (1.2 + 0.25 * torch.rand(n, generator=g, dtype=torch.float64)).float() * 2.0**126
    ws = [1.0, -0.7]
    w32 = [float(torch.tensor(w / math.fsum(ws), dtype=torch.float64).float()) for w in ws]
    f32 = a.clone().mul_(w32[0]).add_(b.clone().mul_(w32[1]))  # the float32 order
    over = f32.isfinite().logical_not_()
    assert 1000 < int(over.sum()) < n
    want = torch.where(over, (a.double() * w32[0] + b.double() * w32[1]).float(), f32)
    store.push({"w": a}, "w32/a")
    store.push({"w": b}, "w32/b")
    ckpt.merge(["w32/a", "w32/b"], "linear", name="w32/out", params={"weights": ws}, store=store)
    assert bits(store.load("w32/out")["w"]) == bits(want)
    assert bits(merge_state_dicts([{"w": a}, {"w": b}], "linear", params={"weights": ws})["w"]) == bits(want)


@pytest.fixture
def read(monkeypatch) -> list[int]:
    """The bytes of chunks each chunk read asks for from here on (merges' reads and reads again)."""
    import ckpt.store.reader
    import ckpt.transfer.pipeline

    out: list[int] = []
    real = ckpt.transfer.pipeline.get_chunks

    def counting(objects, tasks, *args, **kw):
        tasks = list(tasks)
        out.append(sum(t.length for t in tasks))
        return real(objects, tasks, *args, **kw)

    monkeypatch.setattr(ckpt.transfer.pipeline, "get_chunks", counting)
    monkeypatch.setattr(ckpt.store.reader, "get_chunks", counting)
    return out


def test_elements_computed_again_read_only_the_chunks_that_hold_them(store, read):
    """The store path read every input's whole tensor again to compute a few elements again (N × the tensor's bytes,
    and a whole extra input in memory): now only the chunks holding them. 2 inputs of 2 chunks (4 MiB each), one
    element in the second chunk overflowing: 16 MiB read by the merge, 8 MiB again (24 MiB in all; 32 before)."""
    n = store.settings.chunk_size // 2  # float32: two chunks
    g = torch.Generator().manual_seed(1)
    x0, x1 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    at = n // 2 + 12345
    x0[at], x1[at] = 1.5 * 2.0**127, 1.75 * 2.0**127  # 2·a − b overflows float32's math, fits float32
    store.push({"w": x0}, "rd/a")
    store.push({"w": x1}, "rd/b")
    ckpt.merge(["rd/a", "rd/b"], "linear", name="rd/out", params={"weights": [2.0, -1.0], "normalize": False}, store=store)
    assert sum(read) == 2 * 4 * n + 2 * store.settings.chunk_size, read
    got = store.load("rd/out")["w"]
    assert float(got[at]) == 1.25 * 2.0**127
    want = x0.clone().mul_(2.0).add_(x1.clone().mul_(-1.0))
    want[at] = 1.25 * 2.0**127
    assert bits(got) == bits(want)


def test_elements_computed_again_from_inputs_cut_at_other_chunk_sizes(tmp_path):
    """The chunks read again are found per input: inputs cut at other chunk sizes (one not a multiple of 4 bytes, so
    elements straddle its chunks), elements at chunk edges, first and last."""
    url = str(tmp_path / "store")
    s1 = ckpt.Store.init(url, settings=ckpt.Settings.from_env(fsync=False, chunk_size=1 << 20))
    n = (3 << 20) // 4 + 7
    g = torch.Generator().manual_seed(2)
    x0, x1 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    at = [0, 5, (1 << 18) - 1, 1 << 18, 278528, 700000, n - 1]  # (278528: straddles x1's first two chunks)
    for i in at:
        x0[i], x1[i] = 1.5 * 2.0**127, 1.75 * 2.0**127
    s1.push({"w": x0}, "a")
    ckpt.Store.open(url, settings=ckpt.Settings.from_env(fsync=False, chunk_size=(1 << 20) + (1 << 16) + 2)).push({"w": x1}, "b")
    ckpt.merge(["a", "b"], "linear", name="o", store=s1, params={"weights": [2.0, -1.0], "normalize": False})
    want = x0.clone().mul_(2.0).add_(x1.clone().mul_(-1.0))
    want[at] = 1.25 * 2.0**127
    assert bits(s1.load("o")["w"]) == bits(want)


def test_elements_computed_again_read_each_chunk_once_whichever_input_has_the_smaller_chunks(tmp_path, read):
    """Pieces were sized by the first input's chunk size: where it was the smaller (64 KiB, the other's 1 MiB), the
    other's 1 MiB chunk was read again for each of the 16 pieces inside it. Every 1000th element overflowing in a
    2 MiB tensor: read again once each now (8 MiB in all with the merge's own reads; 38 MiB before)."""
    url = str(tmp_path / "store")
    small = ckpt.Store.init(url, settings=ckpt.Settings.from_env(fsync=False, chunk_size=64 << 10))
    n = (2 << 20) // 4
    g = torch.Generator().manual_seed(4)
    x0, x1 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    at = list(range(0, n, 1000))
    x0[at], x1[at] = 1.5 * 2.0**127, 1.75 * 2.0**127
    small.push({"w": x0}, "a")
    ckpt.Store.open(url, settings=ckpt.Settings.from_env(fsync=False, chunk_size=1 << 20)).push({"w": x1}, "b")
    ckpt.merge(["a", "b"], "linear", name="o", store=small, params={"weights": [2.0, -1.0], "normalize": False})
    assert sum(read) == 4 * 4 * n, read  # each input's 2 MiB read by the merge, then again
    want = x0.clone().mul_(2.0).add_(x1.clone().mul_(-1.0))
    want[at] = 1.25 * 2.0**127
    assert bits(small.load("o")["w"]) == bits(want)


def test_elements_computed_again_from_s3_small_chunks_and_large(s3_main_url):
    """From S3 the chunks read again come as any read's: the small ones from the inputs' bundles, the others by
    their own requests (verified): a model of small tensors and a large one, overflowing elements in each."""
    store = ckpt.Store.init(s3_main_url)
    g = torch.Generator().manual_seed(3)
    sizes = {f"small{i}": 1000 + i for i in range(5)} | {"large": (9 << 20) // 4}
    xs = [{k: torch.randn(n, generator=g) for k, n in sizes.items()} for _ in range(2)]
    for k, n in sizes.items():
        for i in (0, n // 2, n - 1):
            xs[0][k][i], xs[1][k][i] = 1.5 * 2.0**127, 1.75 * 2.0**127
    store.push(xs[0], "s3/a")
    store.push(xs[1], "s3/b")
    ckpt.merge(["s3/a", "s3/b"], "linear", name="s3/o", store=store, params={"weights": [2.0, -1.0], "normalize": False})
    got = store.load("s3/o")
    for k, n in sizes.items():
        want = xs[0][k].clone().mul_(2.0).add_(xs[1][k].clone().mul_(-1.0))
        want[[0, n // 2, n - 1]] = 1.25 * 2.0**127
        assert bits(got[k]) == bits(want), k


def _round53(q):
    """``q`` (a Fraction) rounded to 53 significant bits, ties to even, with no bound on the exponent: float64's
    rounding as if its exponent had none."""
    from fractions import Fraction

    if q == 0:
        return q
    e = abs(q).numerator.bit_length() - abs(q).denominator.bit_length()
    e -= Fraction(2) ** e > abs(q)
    unit = Fraction(2) ** (e - 52)
    n, rest = divmod(abs(q) / unit, 1)
    n += rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2)
    return (1 if q > 0 else -1) * n * unit


def test_float64_task_arithmetic_computed_again_is_its_math_with_an_unbounded_exponent_or_refused():
    """Float64 task arithmetic whose steps overflow (2^126·2^990.. − 2^126·2^990..) beside a third input near a base
    near 2^-890 (its product near float64's least normal value once scaled by 2^-128): every element computed again
    equals the same operations rounded to 53 bits with no bound on the exponent (Fractions), or is left uncomputed
    (refused by the merge). Before, about 2% of those computed were not (a product rounded below normal)."""
    import random
    from fractions import Fraction

    from ckpt.merging.methods import default_registry
    from ckpt.merging.overflowing import masked_pieces, method_again

    rng = random.Random(1)
    n = 3000

    def near(lo, hi):
        return rng.choice([-1, 1]) * rng.uniform(1, 2) * 2.0 ** rng.randint(lo, hi)

    rows = []
    for _ in range(n):
        big, b = 2.0 ** rng.randint(990, 1000), near(-900, -880)
        rows.append((big, big, b + rng.randint(-40, 40) * math.ulp(b) if rng.random() < 0.7 else near(-900, -850), b))
    cols = [torch.tensor(c, dtype=torch.float64) for c in zip(*rows)]
    lam = [2.0**126, -(2.0**126), 0.7]
    x, mask = torch.full((n,), NAN, dtype=torch.float64), torch.ones(n, dtype=torch.bool)
    method_again(default_registry().get("task-arithmetic"), {"weights": lam}, "w", True, torch.float64, masked_pieces(cols))(x, mask)
    done = (~mask).nonzero().squeeze(1).tolist()
    assert 100 < len(done) < n  # (the premise: some computed, some not)
    for i in done:
        *xs, b = (Fraction(v) for v in rows[i])
        acc = None
        for xi, li in zip(xs, lam):
            p = _round53(Fraction(li) * _round53(xi - b))
            acc = p if acc is None else _round53(acc + p)
        assert float(x[i]).hex() == float(_round53(acc + b)).hex(), (i, rows[i])
