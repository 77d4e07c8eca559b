"""Hostile input: fuzz every parser of store and user bytes (see tests/fuzz_targets.py).

Per target, hypothesis feeds random bytes and mutations of valid seeds (bit flips,
truncations, insertions, splices). Accepted outcomes: a normal return or a
``CkptError``. The budget per target is ``CKPT_FUZZ_EXAMPLES`` (default 300); the
long mode used for benchmarks/results/hardening.md sets it to thousands. When atheris
is installed, each target also gets a coverage-guided run in a subprocess (marked
slow: ``python -m pytest -m slow tests/test_fuzz.py``; ``CKPT_ATHERIS_RUNS`` sets the
number of inputs per target).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import fuzz_targets  # noqa: E402

EXAMPLES = int(os.environ.get("CKPT_FUZZ_EXAMPLES", "300"))
TARGETS = sorted(fuzz_targets.TARGETS)


@st.composite
def mutated(draw: st.DrawFn, target: str) -> bytes:
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=512))
    data = bytearray(draw(st.sampled_from(fuzz_targets.seeds(target))))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "splice"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 16))]
        else:  # a chunk of the input repeated: long runs of nesting, huge numbers
            data[i:i] = bytes(data[i : i + draw(st.integers(1, 32))]) * draw(st.integers(2, 64))
    return bytes(data)


@pytest.mark.parametrize("target", TARGETS)
def test_parser_raises_only_ckpt_errors(target: str) -> None:
    seen = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated(target))
    def fuzz(data: bytes) -> None:
        seen.append(len(data))
        fuzz_targets.run(target, data)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fuzz()
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert len(seen) >= min(EXAMPLES, 50)
    assert grown_mb < 256, f"{target}: peak memory grew {grown_mb:.0f} MB while parsing inputs of <= {max(seen)} bytes"


@pytest.mark.parametrize("target", TARGETS)
def test_seeds_are_valid(target: str) -> None:
    """The seeds parse cleanly (else mutation fuzzing would only explore error paths)."""
    if target in ("ref-name", "tensor-name"):
        return  # seeds there include hostile names on purpose
    for s in fuzz_targets.seeds(target):
        if target == "chunk":  # the target names every blob "000...": a seed decodes fully, then fails its hash
            with pytest.raises(fuzz_targets.CkptError, match="do not match"):
                fuzz_targets.TARGETS[target](s)
            continue
        fuzz_targets.TARGETS[target](s)


def test_huge_claims_are_refused_before_allocating() -> None:
    """Size fields far beyond the input are rejected without allocating them."""
    import struct

    from ckpt.codecs.chunk import decode_chunk
    from ckpt.format.safetensors_header import parse_header
    from ckpt_store.storage.errors import CkptError

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    header = b'{"x":{"dtype":"F32","shape":[274877906944],"data_offsets":[0,1099511627776]}}'
    with pytest.raises(CkptError, match="truncated"):
        parse_header(struct.pack("<Q", len(header)), lambda n: header, 8 + len(header) + 16, "tb.safetensors")
    with pytest.raises(CkptError):
        parse_header(struct.pack("<Q", 1 << 40), lambda n: b"", 100, "claims-a-1tb-header.safetensors")
    blob = struct.pack("<4sBBBBQ", b"CKc1", 1, 1, 0, 0, 1 << 40) + b"\x28\xb5\x2f\xfd" + bytes(20)
    with pytest.raises(CkptError):
        decode_chunk(blob, "0" * 64, 1 << 40, max_length=1 << 28)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 64


def test_a_manifest_claiming_a_terabyte_is_refused_before_allocating(tmp_path: Path) -> None:
    """One real 40-byte chunk referenced as a 1 TB tensor: load and the lazy reader refuse up front."""
    import json

    import torch

    import ckpt
    from ckpt.errors import ResourceLimitError
    from ckpt_store.storage.records import canonical_json

    store = ckpt.Store.init(str(tmp_path / "s"))
    mid = store.push({"w": torch.ones(10)}, "a")
    m = json.loads(store.objects.get_manifest(mid))
    t = m["tensors"][0]
    m["chunk_size"] = 1 << 40
    t["shape"], t["nbytes"] = [1 << 38], 1 << 40
    m["files"][0]["size"] = m["files"][0]["head_size"] + (1 << 40)  # consistent: its file says so too
    store.refs_db.set("bomb", store.objects.put_manifest(canonical_json(m)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ResourceLimitError, match="needs 1,099,511,627,776 bytes"):
        store.load("bomb")
    with pytest.raises(ckpt.CkptError):  # (the reader checks the file's stored header first: it holds 40 bytes)
        store.reader("bomb").get_tensor("w")
    with pytest.raises(ckpt.CkptError):
        store.pull("bomb", tmp_path / "out.safetensors")
    assert not store.verify(["bomb"]).ok
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 64


ATHERIS_RUNS = int(os.environ.get("CKPT_ATHERIS_RUNS", "2000"))


@pytest.mark.slow  # about a minute per target here (instrumented imports); run with -m slow
@pytest.mark.parametrize("target", TARGETS)
def test_atheris_coverage_guided(target: str) -> None:
    pytest.importorskip("atheris", reason="atheris is not installed (optional: pip install atheris)")
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "fuzz_targets.py"), target, f"-runs={ATHERIS_RUNS}",
                        "-max_len=4096", "-rss_limit_mb=2048", "-timeout=10"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Done" in r.stderr, r.stderr[-1000:]
