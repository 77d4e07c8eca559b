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
    stored as it was. Refused now, as in every float dtype, where no input held an inf there; an input's inf
    in the same tensor stays inf (also when averaged: new_tensors="average")."""
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
    # head, which the base lacks, averaged: big + big overflows float32; the input's inf stays, not refused
    with pytest.raises(InvalidMergeError, match=r"^head: 1 merged value past F32's range"):
        ckpt.merge(["f32/ft", "f32/ft2"], "task-arithmetic", name="f32/out", base="f32/base", store=store,
                   params={"weights": [0.0, 0.0]}, new_tensors="average")
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
