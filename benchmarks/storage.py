"""Stored/raw ratio and codec speed of ckpt against the lossless alternatives, on real data.

Run from the repository root (builds or reuses ./bench-data first; about 10 minutes here)::

    . .venv/bin/activate
    pip install zipnn              # the ZipNN columns (optional; skipped if missing)
    python benchmarks/data.py      # once: MiniLM fine-tunes and a GPT training run
    python benchmarks/storage.py   # prints the tables, writes benchmarks/results/storage.md

Families (from ``benchmarks/data.py``): all-MiniLM-L6-v2 and its fine-tunes in fp32 and
bf16 (deltas against the base), and a GPT trained from scratch with AdamW state (each
checkpoint against the previous one). Held-out fine-tunes are reported on their own rows.

Every column stores the same files and is checked to decode bit-exactly:

* zstd-3: each file compressed whole with zstd level 3.
* ZipNN: each file's tensor data with ZipNN (its dtype), the header with zstd.
* tensor dedup: every distinct tensor stored once, uncompressed.
* XOR+zstd-3, XOR+planes+zstd-3 (the ZipLLM recipe), XOR+ZipNN: each tensor XORed
  with the same-named tensor of the file's base, then compressed; a file without base
  is compressed without the XOR.
* ckpt: ``Store.push`` of the files in order into a fresh store (the default settings;
  the base is found by ckpt itself), stored bytes = every object in the store.

Speeds are MB/s of raw bytes, medians of 3, on both cores (``workers=2``) and one
(``workers=1``); ckpt is measured end to end (read, hash, encode, write into a store in
``/dev/shm``; fetch, decode, verify into tensors), the others as bare codec calls. ckpt's
codecs are also timed as bare calls (``ckpt codec`` columns: every distinct chunk, bases
decoded beforehand, decode including the hash check), on one thread and two. Each family
runs in a fresh process (``--family NAME --json PATH`` is that child's command line).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.data import build, families  # noqa: E402
from ckpt.format.safetensors_header import parse_header  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "storage.md"
ELEM = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "F64": 8, "I32": 4}


# -- reading the files ----------------------------------------------------------
class File:
    """A safetensors file: its header bytes and each tensor's raw bytes."""

    def __init__(self, path: str, name: str, base: str | None, heldout: bool) -> None:
        self.path, self.name, self.base, self.heldout = path, name, base, heldout
        raw = Path(path).read_bytes()
        self.raw = raw
        h = parse_header(raw[:8], lambda n: raw[8 : 8 + n], len(raw), path)
        self.head = raw[: h.head_size]
        self.tensors = {t.name: (t.dtype, raw[h.head_size + t.begin : h.head_size + t.end]) for t in h.tensors}

    @property
    def size(self) -> int:
        return len(self.raw)


def load_families(only: str | None = None) -> dict[str, list[File]]:
    out = build(os.environ.get("CKPT_BENCH_DATA"))
    fams = {}
    for fam, entries in families(out).items():
        if only is None or fam == only:
            fams[fam] = [File(e["file"], Path(e["path"]).stem, e["base"], e["heldout"]) for e in entries]
    return fams


# -- the alternatives, as (encode, decode) over one file ------------------------
def _zstd(level: int = 3) -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]:
    c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    return c.compress, d.decompress


def _planes(data: bytes, elem: int) -> list[bytes]:
    n = len(data) // elem * elem
    arr = np.frombuffer(data, dtype=np.uint8, count=n).reshape(-1, elem)
    return [np.ascontiguousarray(arr[:, k]).tobytes() for k in range(elem)] + [data[n:]]


def _unplanes(planes: list[bytes], elem: int) -> bytes:
    arr = np.stack([np.frombuffer(p, dtype=np.uint8) for p in planes[:elem]], axis=1)
    return arr.tobytes() + planes[elem]


def _xor(a: bytes, b: bytes) -> bytes:
    n = len(a) // 8 * 8
    x = np.bitwise_xor(np.frombuffer(a, np.uint64, count=n // 8), np.frombuffer(b, np.uint64, count=n // 8)).tobytes()
    return x + bytes(p ^ q for p, q in zip(a[n:], b[n:]))


def _zipnn(dtype: str, threads: int):
    from zipnn import ZipNN

    kind = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(dtype, "float32")
    z = ZipNN(input_format="byte", bytearray_dtype=kind, threads=threads)

    def enc(data: bytes) -> bytes:
        # ZipNN 0.5.4 writes into its input and needs whole elements: hand it a private, aligned copy.
        return bytes(z.compress(bytearray(data)))

    return enc, lambda blob: bytes(z.decompress(blob))


def delta_data(f: File, base: File | None, use_xor: bool) -> list[tuple[str, bytes]]:
    """Per tensor (dtype, bytes), XORed with the base's same-named tensor where there is one."""
    out = []
    for name, (dtype, data) in f.tensors.items():
        b = base.tensors.get(name) if (base is not None and use_xor) else None
        out.append((dtype, _xor(data, b[1]) if b is not None and len(b[1]) == len(data) else data))
    return out


def method_sizes(method: str, f: File, base: File | None, threads: int = 1) -> tuple[int, float, float]:
    """(stored bytes, encode s, decode s) of one file under ``method``; checked bit-exact."""
    zc, zd = _zstd(3)
    if method == "zstd-3":
        t0 = time.perf_counter(); blob = zc(f.raw); t1 = time.perf_counter()
        assert zd(blob) == f.raw
        t2 = time.perf_counter(); zd(blob); t3 = time.perf_counter()
        return len(blob), t1 - t0, t3 - t2
    use_xor = method.startswith("xor")
    parts = delta_data(f, base, use_xor)
    enc_s = dec_s = 0.0
    total = len(zc(f.head))
    by_dtype: dict[str, list[bytes]] = {}
    for dtype, data in parts:
        by_dtype.setdefault(dtype, []).append(data)
    for dtype, chunks in by_dtype.items():
        data = b"".join(chunks)
        elem = ELEM.get(dtype, 1)
        t0 = time.perf_counter()
        if method in ("zipnn", "xor+zipnn") and dtype in ("F32", "BF16", "F16"):
            enc, dec = _zipnn(dtype, threads)
            blob = enc(data); t1 = time.perf_counter()
            back = dec(blob); t2 = time.perf_counter()
            size = len(blob)
        elif method == "xor+planes+zstd-3":
            blobs = [zc(p) for p in _planes(data, elem)]; t1 = time.perf_counter()
            back = _unplanes([zd(b) for b in blobs], elem); t2 = time.perf_counter()
            size = sum(len(b) for b in blobs)
        else:  # xor+zstd-3, and non-float data of the zipnn columns
            blob = zc(data); t1 = time.perf_counter()
            back = zd(blob); t2 = time.perf_counter()
            size = len(blob)
        assert back == data, (method, f.name, dtype)
        total += size
        enc_s += t1 - t0
        dec_s += t2 - t1
    return total, enc_s, dec_s


def dedup_size(files: list[File]) -> int:
    seen: set[bytes] = set()
    total = 0
    for f in files:
        total += len(f.head)
        for _, data in f.tensors.values():
            h = hashlib.blake2b(data, digest_size=16).digest()
            if h not in seen:
                seen.add(h)
                total += len(data)
    return total


# -- ckpt ------------------------------------------------------------------------
def ckpt_run(files: list[File], workers: int = 2, chained: bool = False, codec_speed: bool = False,
             **settings: object) -> dict[str, object]:
    """Push ``files`` in order into a fresh store and load them back.

    ``chained``: each file is pushed with the previous one as ``--base`` (a training
    run's snapshots); otherwise ckpt finds each file's base itself (fine-tunes)."""
    import torch

    import ckpt
    from ckpt.settings import Settings

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        store = ckpt.Store.init(os.path.join(tmp, "s"), settings=Settings.from_env(workers=workers, fsync=False, **settings))
        t0 = time.perf_counter()
        previous = None
        for f in files:
            store.push(f.path, f.name, base=previous if chained else None)
            previous = f.name
        enc = time.perf_counter() - t0
        stored = sum(e.size for e in store.backend.list(""))
        t0 = time.perf_counter()
        loaded = {f.name: store.load(f.name) for f in files}
        dec = time.perf_counter() - t0
        for f in files:  # bit-exact, tensor by tensor
            got = loaded[f.name]
            for name, (_, data) in f.tensors.items():
                t = got[name].reshape(-1)
                assert (t.view(torch.uint8).numpy().tobytes() if t.numel() else b"") == data, (f.name, name)
        out = {"stored": stored, "enc": enc, "dec": dec, "codecs": store.du().by_codec}
        if codec_speed:
            del loaded
            out["codec"] = ckpt_codec_speed(store)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ckpt_codec_speed(store: object, reps: int = 3) -> dict[str, tuple[float, float]]:
    """ckpt's codecs as bare calls, like the other columns: ``encode_chunk`` and
    ``decode_chunk`` over every distinct chunk in ``store``, bases decoded beforehand
    (no chains, cache, file or store I/O), on 1 and 2 threads. MB/s of decoded bytes,
    best of ``reps``. Encoding tries the delta codecs only for the chunks stored as
    deltas (the base a push tried for the others is not recorded)."""
    from concurrent.futures import ThreadPoolExecutor

    from ckpt.codecs.chunk import decode_chunk, encode_chunk, parse_header
    from ckpt.transfer.pipeline import fetch_chunk

    objs, st = store.objects, store.settings  # type: ignore[attr-defined]
    ids = [e.path.rsplit("/", 1)[-1] for e in store.backend.list("") if "/chunks/" in e.path]  # type: ignore[attr-defined]
    blobs = {cid: objs.get("chunks", cid) for cid in ids}
    heads = {cid: parse_header(b, cid) for cid, b in blobs.items()}
    data = {cid: bytes(fetch_chunk(objs, cid, heads[cid].length, st)[0]) for cid in ids}
    total = sum(h.length for h in heads.values())

    def dec(cid: str) -> None:
        h = heads[cid]
        decode_chunk(blobs[cid], cid, h.length, max_length=st.max_chunk_size, base=data[h.base] if h.base else None)

    def enc(cid: str) -> None:
        h = heads[cid]
        encode_chunk(data[cid], elem=h.elem, level=st.zstd_level, min_saving=st.min_saving,
                     base=data[h.base] if h.base else None, base_id=h.base)

    speed = {}
    for threads in (1, 2):
        best = {}
        for name, fn in (("enc", enc), ("dec", dec)):
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(fn, ids))
                times.append(time.perf_counter() - t0)
            best[name] = total / min(times) / 1e6
        speed[str(threads)] = (best["enc"], best["dec"])
    return speed


# -- running ---------------------------------------------------------------------
METHODS = ["zstd-3", "zipnn", "xor+zstd-3", "xor+planes+zstd-3", "xor+zipnn"]


def has_zipnn() -> bool:
    try:
        import zipnn  # noqa: F401
    except ImportError:
        return False
    return True


def run_family(fam: str, files: list[File]) -> dict[str, object]:
    print(f"{fam}: {len(files)} files", flush=True)
    by_name = {f.name: f for f in files}
    main = [f for f in files if not f.heldout]
    held = [f for f in files if f.heldout]
    raw = sum(f.size for f in main)
    methods = [m for m in METHODS if "zipnn" not in m or has_zipnn()]
    res: dict[str, object] = {"raw": raw, "files": len(main)}
    for m in methods:
        sizes = enc = dec = 0.0
        for f in main:
            s, e, d = method_sizes(m, f, by_name.get(f.base) if f.base else None)
            sizes += s; enc += e; dec += d
        res[m] = (sizes / raw, raw / enc / 1e6, raw / dec / 1e6)
        print(f"  {fam} {m}: {sizes / raw:.3f}", flush=True)
    res["dedup"] = dedup_size(main) / raw
    # GPT checkpoints delta against the previous one; fine-tunes find their base.
    chained = fam == "gpt"
    # The three configurations take turns, after one untimed run: a process's first
    # gigabytes of fresh memory cost page faults that later runs reuse, and measured
    # one after another the last configuration would get the cheapest memory.
    # "nocache": each file pulled on its own (no base decoded twice to reuse).
    configs = {1: {"workers": 1}, 2: {"workers": 2}, "nocache": {"workers": 2, "base_cache_mb": 0}}
    ckpt_run(main, 2, chained)
    runs: dict[object, list[dict[str, object]]] = {c: [] for c in configs}
    for i in range(3):
        for c, kw in configs.items():
            runs[c].append(ckpt_run(main, chained=chained, codec_speed=i == 0 and c == 2, **kw))  # type: ignore[arg-type]
    best = runs[2][0]
    res["codec"] = best["codec"]
    res["ckpt"] = (best["stored"] / raw,  # speeds by worker count, as strings (the results travel as JSON)
                   {str(w): raw / statistics.median(r["enc"] for r in runs[w]) / 1e6 for w in (1, 2)},
                   {str(w): raw / statistics.median(r["dec"] for r in runs[w]) / 1e6 for w in (1, 2)})
    res["codecs"] = best["codecs"]
    nocache = runs["nocache"]
    res["nocache"] = (raw / statistics.median(r["enc"] for r in nocache) / 1e6,
                      raw / statistics.median(r["dec"] for r in nocache) / 1e6)
    print(f"  {fam} ckpt: {best['stored'] / raw:.3f}", flush=True)
    if held:
        hraw = sum(f.size for f in held)
        hres = {}
        for m in methods:
            hres[m] = sum(method_sizes(m, f, by_name.get(f.base))[0] for f in held) / hraw
        with_held = ckpt_run([by_name[held[0].base], *held], 2, False)
        base_only = ckpt_run([by_name[held[0].base]], 2, False)
        hres["ckpt"] = (with_held["stored"] - base_only["stored"]) / hraw
        res["heldout"] = hres
    return res


def fmt_table(results: dict[str, dict[str, object]]) -> str:
    methods = [m for m in METHODS if "zipnn" not in m or has_zipnn()]
    head = ["set", "raw MB"] + methods + ["tensor dedup", "**ckpt**", "ckpt vs best other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fam, r in results.items():
        ratios = [r[m][0] for m in methods]  # type: ignore[index]
        best = min(ratios + [r["dedup"]])  # type: ignore[list-item]
        ck = r["ckpt"][0]  # type: ignore[index]
        lines.append(f"| {fam} ({r['files']} files) | {r['raw'] / 1e6:,.0f} | " + " | ".join(f"{x:.3f}" for x in ratios)
                     + f" | {r['dedup']:.3f} | **{ck:.3f}** | {ck / best:.2f}x |")
        if "heldout" in r:
            h = r["heldout"]
            best_h = min(h[m] for m in methods)  # type: ignore[index]
            lines.append(f"| {fam} held-out (delta only) | | " + " | ".join(f"{h[m]:.3f}" for m in methods)  # type: ignore[index]
                         + f" | | **{h['ckpt']:.3f}** | {h['ckpt'] / best_h:.2f}x |")  # type: ignore[index]
    return "\n".join(lines)


def fmt_speed(results: dict[str, dict[str, object]]) -> str:
    methods = [m for m in METHODS if "zipnn" not in m or has_zipnn()]
    head = ["set"] + [f"{m} enc/dec (1 thread)" for m in methods] + [
        "ckpt codec enc/dec (1 thread)", "ckpt codec enc/dec (2 threads)",
        "ckpt enc/dec workers=1", "**ckpt enc/dec workers=2**", "ckpt enc/dec workers=2, no base cache"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fam, r in results.items():
        cells = [f"{r[m][1]:,.0f} / {r[m][2]:,.0f}" for m in methods]  # type: ignore[index]
        _, enc, dec = r["ckpt"]  # type: ignore[misc]
        nenc, ndec = r["nocache"]  # type: ignore[misc]
        codec = r["codec"]  # type: ignore[index]
        cells += [f"{codec[t][0]:,.0f} / {codec[t][1]:,.0f}" for t in ("1", "2")]
        lines.append(f"| {fam} | " + " | ".join(cells) + f" | {enc['1']:,.0f} / {dec['1']:,.0f} | **{enc['2']:,.0f} / {dec['2']:,.0f}** "
                     f"| {nenc:,.0f} / {ndec:,.0f} |")
    return "\n".join(lines)


def fmt_codecs(results: dict[str, dict[str, object]]) -> str:
    lines = ["| set | codec | input MB | stored MB | stored/input |", "|---|---|---|---|---|"]
    for fam, r in results.items():
        for codec, (dec, st) in r["codecs"].items():  # type: ignore[union-attr]
            lines.append(f"| {fam} | {codec} | {dec / 1e6:,.1f} | {st / 1e6:,.1f} | {st / dec if dec else 0:.3f} |")
    return "\n".join(lines)


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", help="measure this family only and write its results to --json (what main runs per family)")
    p.add_argument("--json", help="with --family: where its results go")
    args = p.parse_args()
    if args.family:
        fams = load_families(args.family)
        res = run_family(args.family, fams[args.family])
        Path(args.json).write_text(json.dumps(res))
        return
    started = time.time()
    # Each family in a process of its own: a process's memory after one family (what
    # malloc kept, what it gave back) changed the next family's end-to-end times by up
    # to 25%.
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in families(build(os.environ.get("CKPT_BENCH_DATA"))):
            out = os.path.join(tmp, f"{fam}.json")
            subprocess.run([sys.executable, __file__, "--family", fam, "--json", out], check=True)
            results[fam] = json.loads(Path(out).read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    import torch

    report = "\n\n".join([
        "# Storage: stored/raw and codec speed, ckpt vs the alternatives",
        f"Command: `python benchmarks/storage.py` (data: `python benchmarks/data.py`)  \n"
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; run took {time.time() - started:.0f} s; "
        f"ckpt commit {commit}; {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
        f"numpy {np.__version__}, zstandard {zstandard.__version__}"
        + (f", zipnn {__import__('zipnn').__version__ if hasattr(__import__('zipnn'), '__version__') else '0.5.4'}" if has_zipnn() else ""),
        "## Stored bytes / raw bytes (lower is better)",
        fmt_table(results),
        "Held-out rows: the fine-tune not used while choosing ckpt's codecs, stored against the base "
        "(delta bytes only: the base's own bytes are excluded from both sides).",
        "## Speed, MB/s of raw bytes, encode / decode",
        fmt_speed(results),
        "The alternatives' columns are bare single-thread codec calls on data in memory. \"ckpt codec\" is the "
        "same for ckpt: `encode_chunk` / `decode_chunk` over every distinct chunk, bases decoded beforehand, the "
        "decode checking each chunk's hash, on one thread and on two. The last three columns are end to end: "
        "push = read file, hash, choose and encode, write objects (store in /dev/shm, no fsync); "
        "decode = load into new tensors: fetch, decode (following delta chains), verify every hash. The files are "
        "pushed and loaded in one process, so from the third fine-tune on the base chunks under the deltas come "
        "from the store's decoded-base cache (`base_cache_mb`, default 256); the last column turns it off: "
        "what pulling each file on its own costs. The three end-to-end configurations take turns, after one "
        "untimed run (a process's first fresh memory costs page faults that later runs reuse).",
        "## What each ckpt codec stored (distinct chunks, workers=2 run)",
        fmt_codecs(results),
    ])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
