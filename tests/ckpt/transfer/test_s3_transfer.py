"""Pulls and loads from real S3 servers: the request window's memory bound, the local chunk
cache (hits, misses, damage, a full cache), servers that reset or stall mid-transfer, and
interrupted pulls that leave nothing behind."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

pytest.importorskip("botocore")
np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from s3support import chunk_gets, gets_of  # noqa: E402

import ckpt  # noqa: E402
from ckpt.transfer.pipeline import GetTask, get_chunks  # noqa: E402
from ckpt_store.storage.cache_tally import FILES  # noqa: E402 - (the cache's shared byte count and eviction lock: not entries)
from ckpt_store.storage.errors import CorruptObjectError, StorageIOError  # noqa: E402

CHUNK = 64 * 1024


def _file(tmp_path, n=24, seed=0):
    """A safetensors file of ``n`` 64 KiB-chunked fp32 tensors, noisy enough that some chunks stay raw."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    t = {f"w{i}": rng.standard_normal(CHUNK // 4 * 2, dtype=np.float32) for i in range(n)}
    t["ints"] = rng.integers(0, 2**31, CHUNK // 4, dtype=np.int32)  # random bytes: stored raw, read into place
    path = tmp_path / "m.safetensors"
    save_file(t, str(path))
    return path, t


def _settings(**kw):
    return ckpt.Settings.from_env(chunk_size=CHUNK, **kw)


def _tasks(store, ref, sink=None):
    m = store.manifest(ref)
    tasks = []
    for t in m.tensors:
        left = t.nbytes
        for cid in t.chunks:
            n = min(m.chunk_size, left)
            left -= n
            tasks.append(GetTask(cid, n, sink=sink))
    return tasks


def test_cache_serves_a_second_pull_and_refuses_damage(s3_url, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    src, _ = _file(tmp_path)
    ckpt.Store.init(s3_url, settings=_settings(cache=False)).push(str(src), "m")

    first = ckpt.Store.open(s3_url, settings=_settings())
    gets = chunk_gets(first)
    first.pull("m", str(tmp_path / "a.safetensors"))
    n_chunks = len(first.manifest("m").chunk_lengths())
    assert gets[0] == n_chunks and first.objects.cache.misses == n_chunks  # cold: every chunk fetched once

    second = ckpt.Store.open(s3_url, settings=_settings())
    gets = chunk_gets(second)
    second.pull("m", str(tmp_path / "b.safetensors"))
    assert gets[0] == 0 and second.objects.cache.hits == n_chunks  # warm: nothing fetched
    assert (tmp_path / "b.safetensors").read_bytes() == src.read_bytes()

    # Damage two entries: one bit flipped (caught by the entry's checksum), and one replaced
    # by a well-formed entry holding another chunk's blob (caught when the chunk is decoded).
    entries = sorted(p for p in cache.rglob("*") if p.is_file() and p.name not in FILES)
    raw = bytearray(entries[0].read_bytes())
    raw[len(raw) // 2] ^= 0x10
    entries[0].write_bytes(bytes(raw))
    from ckpt_store.storage.cache import ChunkBlobCache

    other = entries[2].read_bytes()[:-32]
    victim = entries[1].name
    entries[1].unlink()
    ChunkBlobCache(str(cache), entries[1].parent.parent.name, 1 << 30).put(victim, (other,))

    third = ckpt.Store.open(s3_url, settings=_settings())
    gets = chunk_gets(third)
    third.pull("m", str(tmp_path / "c.safetensors"))
    assert (tmp_path / "c.safetensors").read_bytes() == src.read_bytes()  # never served wrong bytes
    assert gets[0] == 2 and third.objects.cache.dropped == 2  # both fetched again, the bad entries replaced
    fourth = ckpt.Store.open(s3_url, settings=_settings())
    gets = chunk_gets(fourth)
    fourth.pull("m", str(tmp_path / "d.safetensors"))
    assert gets[0] == 0

    # --no-cache: nothing read from or written to the cache.
    off = ckpt.Store.open(s3_url, settings=_settings(cache=False))
    assert off.objects.cache is None
    gets = chunk_gets(off)
    off.pull("m", str(tmp_path / "e.safetensors"))
    assert gets[0] == n_chunks


def test_cache_keeps_whole_chunks_decoded_and_serves_them_without_decoding(s3_url, tmp_path, monkeypatch):
    """A whole chunk its codec shrank by less than half is cached decoded (a raw blob): a warm pull
    or load reads and hashes it, decoding nothing; one that shrank more (zeros) and a delta stay as
    stored. A damaged decoded entry read straight into a tensor is dropped and fetched again."""
    from safetensors.numpy import save_file

    import ckpt.codecs.chunk as chunk_codec
    from ckpt.codecs.chunk import RAW, parse_header

    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    rng = np.random.default_rng(3)
    # fp32 weights like a trained model's: the byte-plane codec shrinks them by ~10%.
    tensors = {f"w{i}": (rng.standard_normal(CHUNK // 4, dtype=np.float32) * 0.02) for i in range(6)}
    tensors["zeros"] = np.zeros(CHUNK // 4, dtype=np.float32)
    src = tmp_path / "base.safetensors"
    save_file(tensors, str(src))
    ft = {k: (v + (1e-4 * rng.standard_normal(v.shape)).astype(v.dtype)) if k != "zeros" else v for k, v in tensors.items()}
    ft_path = tmp_path / "ft.safetensors"
    save_file(ft, str(ft_path))
    writer = ckpt.Store.init(s3_url, settings=_settings(cache=False))
    writer.push(str(src), "base")
    writer.push(str(ft_path), "ft", base="base")
    m, m_ft = writer.manifest("base"), writer.manifest("ft")
    stored = {t.name: parse_header(writer.objects.backend.read(writer.objects.path("chunks", t.chunks[0]))) for t in m.tensors}
    assert all(stored[f"w{i}"].codec != RAW for i in range(6)) and stored["zeros"].codec != RAW  # compressed in the store

    first = ckpt.Store.open(s3_url, settings=_settings())
    first.pull("ft", str(tmp_path / "ft-1.safetensors"))  # the fine-tune, and the base's chunks under its deltas
    assert (tmp_path / "ft-1.safetensors").read_bytes() == ft_path.read_bytes()
    entries = {p.name: parse_header(p.read_bytes()[:-32]) for p in cache.rglob("*") if p.is_file() and p.name not in FILES}
    by_name = {t.name: t.chunks[0] for t in m.tensors}
    for i in range(6):
        e = entries[by_name[f"w{i}"]]
        assert e.codec == RAW and e.length == CHUNK  # kept decoded
    deltas = {t.chunks[0] for t in m_ft.tensors if t.delta_bases and t.delta_bases[0]}
    assert deltas and all(entries[c].base is not None for c in deltas)  # deltas as stored
    first.pull("base", str(tmp_path / "b-1.safetensors"))
    entries = {p.name: parse_header(p.read_bytes()[:-32]) for p in cache.rglob("*") if p.is_file() and p.name not in FILES}
    assert entries[by_name["zeros"]].codec != RAW  # shrank to almost nothing: as stored

    decoded = [0]
    real = chunk_codec.planes_decode

    def counting(*a, **k):
        decoded[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(chunk_codec, "planes_decode", counting)
    warm = ckpt.Store.open(s3_url, settings=_settings())
    gets = chunk_gets(warm)
    warm.pull("base", str(tmp_path / "b-2.safetensors"))
    assert (tmp_path / "b-2.safetensors").read_bytes() == src.read_bytes()
    assert gets[0] == 0 and decoded[0] <= 1  # nothing fetched; at most the zeros chunk decoded
    target = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in tensors.items()}
    decoded[0] = 0
    warm.load_into("base", target)
    assert all(target[k].numpy().tobytes() == v.tobytes() for k, v in tensors.items())
    assert gets[0] == 0 and decoded[0] <= 1

    # Damage a decoded entry: loading straight into a tensor catches it by the chunk's id.
    victim = next(p for p in cache.rglob(by_name["w2"]))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    victim.write_bytes(bytes(raw))
    again = ckpt.Store.open(s3_url, settings=_settings())
    gets = chunk_gets(again)
    target = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in tensors.items()}
    again.load_into("base", target)
    assert all(target[k].numpy().tobytes() == v.tobytes() for k, v in tensors.items())
    assert gets[0] == 1 and again.objects.cache.dropped == 1
    assert parse_header(victim.read_bytes()[:-32]).codec == RAW  # fetched again, and kept decoded again
    assert victim.read_bytes()[-32 - CHUNK:-32] == tensors["w2"].tobytes()


def test_full_cache_stays_within_its_limit(s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))
    src, _ = _file(tmp_path, n=40)  # ~5 MB of chunks
    store = ckpt.Store.init(s3_url, settings=_settings(cache_mb=1))
    store.push(str(src), "m")
    store.pull("m", str(tmp_path / "out.safetensors"))
    assert (tmp_path / "out.safetensors").read_bytes() == src.read_bytes()
    from ckpt.store.cache import cache_usage

    u = cache_usage(store.settings)
    assert 0 < u.bytes <= 1 << 20


def test_window_bounds_memory_when_decoding_is_slower(s3_url, tmp_path):
    src, _ = _file(tmp_path, n=40)
    store = ckpt.Store.init(s3_url, settings=_settings(cache=False, inflight_mb=1, transfer_concurrency=16))
    store.push(str(src), "m")
    consumed = []

    def slow_sink(data):  # a consumer slower than the wire (a slow disk, a busy decoder)
        time.sleep(0.01)
        consumed.append(len(data))

    stats = get_chunks(store.objects, _tasks(store, "m", slow_sink), store.settings)
    limit = store.settings.inflight_mb << 20
    # Fetches ran ahead of the consumer, but never past the byte bound (plus the chunk
    # each decoding thread waits for).
    assert 4 * CHUNK < stats.peak_inflight <= limit + store.settings.workers * CHUNK
    assert sum(consumed) == sum(t.length for t in _tasks(store, "m"))


def test_window_bounds_memory_when_fetching_is_slower(s3_main_url, s3_main, tmp_path):
    from s3support import FaultProxy

    src, _ = _file(tmp_path, n=40)
    ckpt.Store.init(s3_main_url, settings=_settings(cache=False)).push(str(src), "m")
    host, port = s3_main.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port))).start()
    try:
        proxy.delay_s = 0.005  # every relayed piece of every response waits: a slow wire
        store = ckpt.Store.open(s3_main_url, storage_options={"endpoint_url": proxy.endpoint},
                                settings=_settings(cache=False, inflight_mb=1, transfer_concurrency=32))
        stats = get_chunks(store.objects, _tasks(store, "m"), store.settings)
        assert stats.peak_inflight <= (1 << 20) + store.settings.workers * CHUNK
    finally:
        proxy.stop()


def _through_proxy(url, server, **kw):
    from s3support import FaultProxy

    host, port = server.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port))).start()
    store = ckpt.Store.open(url, storage_options={"endpoint_url": proxy.endpoint, **kw}, settings=_settings(cache=False))
    return proxy, store


def test_pull_survives_resets_mid_transfer(s3_main_url, s3_main, tmp_path):
    src, _ = _file(tmp_path)
    ckpt.Store.init(s3_main_url, settings=_settings(cache=False)).push(str(src), "m")
    proxy, store = _through_proxy(s3_main_url, s3_main)
    try:
        proxy.reset_dir, proxy.reset_after, proxy.reset_conns = "down", 40_000, 3  # cut three responses mid-body
        out = tmp_path / "out.safetensors"
        store.pull("m", str(out))
        assert proxy.resets_fired == 3
        assert out.read_bytes() == src.read_bytes()
    finally:
        proxy.stop()


def test_pull_survives_a_stalled_server(s3_main_url, s3_main, tmp_path, monkeypatch, caplog):
    """...and says so: a retry after an attempt that waited long is a warning (a command that seems
    to hang on a server that stopped answering says why), a quick one a debug note."""
    import logging

    from ckpt_store.storage import retry

    monkeypatch.setattr(retry, "SLOW_ATTEMPT_S", 0.4)  # the read timeout here is 0.5 s (60 s by default)
    caplog.set_level(logging.INFO, logger=retry.__name__)
    src, _ = _file(tmp_path, n=8)
    ckpt.Store.init(s3_main_url, settings=_settings(cache=False)).push(str(src), "m")
    proxy, store = _through_proxy(s3_main_url, s3_main, config_kwargs={"read_timeout": 0.5, "connect_timeout": 1})
    try:
        proxy.delay_s = 2.0  # the server stops answering for a while: reads time out and are retried
        threading.Timer(1.2, proxy.clear).start()
        out = tmp_path / "out.safetensors"
        store.pull("m", str(out))
        assert out.read_bytes() == src.read_bytes()
        slow = [r.getMessage() for r in caplog.records if r.name == retry.__name__ and r.levelno == logging.WARNING]
        assert slow, caplog.text
        for m in slow:  # each after an attempt that waited (about) its read timeout
            took = re.search(r" after ([0-9.]+) s; retry [0-9]+ of [0-9]+ in ", m)
            assert took and float(took.group(1)) >= 0.4, m
    finally:
        proxy.stop()


@pytest.mark.slow  # (3-5 s: CI time, run by .ci/run's slow pass)
def test_a_server_that_trickles_bodies_times_out_instead_of_hanging(s3_main_url, s3_main, tmp_path, monkeypatch):
    """botocore's read timeout is per read: a server that sends a few bytes every 20 ms never
    trips it, and a pull of 24 chunks at 5 KB/s would take minutes. A body must come at 64 KiB/s
    once the read timeout has passed; slower, the GET times out and is retried, then the pull fails."""
    monkeypatch.setenv("CKPT_RETRIES", "1")
    src, _ = _file(tmp_path, n=4)
    ckpt.Store.init(s3_main_url, settings=_settings(cache=False)).push(str(src), "m")
    proxy, store = _through_proxy(s3_main_url, s3_main, config_kwargs={"read_timeout": 0.5})
    try:
        store.manifest("m")  # resolved before the server turns slow
        dest = tmp_path / "dest"
        dest.mkdir()
        proxy.trickle, proxy.delay_s = 100, 0.02
        done: dict[str, BaseException] = {}

        def pull() -> None:
            try:
                store.pull("m", str(dest / "out.safetensors"))
            except BaseException as e:  # noqa: BLE001 - looked at below
                done["error"] = e

        t = threading.Thread(target=pull, daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive(), "the pull hangs on a trickling server"
        assert isinstance(done.get("error"), StorageIOError) and "timeout" in str(done["error"]), done
        assert done["error"].retryable
        assert os.listdir(dest) == []
    finally:
        proxy.stop()


@pytest.mark.slow  # (3-5 s: CI time, run by .ci/run's slow pass)
def test_a_server_that_trickles_a_listing_times_out_instead_of_hanging(s3_main_url, s3_main, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_RETRIES", "1")
    src, _ = _file(tmp_path, n=1)
    ckpt.Store.init(s3_main_url, settings=_settings(cache=False)).push(str(src), "m")
    proxy, store = _through_proxy(s3_main_url, s3_main, config_kwargs={"read_timeout": 0.5})
    try:
        backend = store.objects.backend
        assert [e.path for e in backend.list("refs")]  # the first LIST teaches the direct path
        proxy.trickle, proxy.delay_s = 20, 0.05  # 400 bytes a second, never a pause of 0.5 s
        t0 = time.monotonic()
        with pytest.raises(StorageIOError, match="timeout"):
            list(backend.list("refs"))
        assert time.monotonic() - t0 < 60
    finally:
        proxy.stop()


def test_interrupted_pull_leaves_nothing(s3_main_url, s3_main, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_RETRIES", "1")
    src, _ = _file(tmp_path)
    ckpt.Store.init(s3_main_url, settings=_settings(cache=False)).push(str(src), "m")
    proxy, store = _through_proxy(s3_main_url, s3_main)
    try:
        store.manifest("m")  # resolved before the wire goes bad
        dest = tmp_path / "dest"
        dest.mkdir()
        proxy.reset_dir, proxy.reset_after, proxy.reset_conns = "down", 20_000, 10_000  # every connection cut after 20 KB
        with pytest.raises(StorageIOError) as e:
            store.pull("m", str(dest / "out.safetensors"))
        assert e.value.retryable
        assert os.listdir(dest) == []  # no partial file, no temporary
    finally:
        proxy.stop()


def test_load_into_streams_from_s3(s3_url, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    store = ckpt.Store.init(s3_url, settings=_settings(cache=False, inflight_mb=1))
    store.push(state, "net")
    fresh = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    store.load_into("net", fresh)
    for k, v in fresh.state_dict().items():
        assert v.numpy().tobytes() == state[k].numpy().tobytes()
    # Strided targets go through bounded staging buffers (several groups of at most inflight_mb).
    target = {k: torch.zeros(tuple(reversed(v.shape))).t() if v.dim() == 2 else torch.zeros_like(v) for k, v in state.items()}
    assert not target["0.weight"].is_contiguous()
    store.load_into("net", target)
    for k, v in target.items():
        assert v.contiguous().numpy().tobytes() == state[k].numpy().tobytes()
    got = store.load("net")
    assert all(got[k].numpy().tobytes() == state[k].numpy().tobytes() for k in state)
    by_url = ckpt.load(s3_url, "net")  # the top-level verbs take a store URL
    assert all(by_url[k].numpy().tobytes() == state[k].numpy().tobytes() for k in state)
    again = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    ckpt.load_into(s3_url, "net", again)
    assert all(v.numpy().tobytes() == state[k].numpy().tobytes() for k, v in again.state_dict().items())


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_pull_interrupted_by_a_signal_leaves_no_partial_file(s3_main_url, s3_main, tmp_path, sig):
    """A `ckpt pull` stopped mid-transfer (Ctrl-C, or killed) never leaves a file under the
    destination's name; after Ctrl-C or SIGTERM (a scheduler ending the job) it leaves nothing
    at all."""
    import signal
    import subprocess
    import sys

    from s3support import FaultProxy

    src, _ = _file(tmp_path, n=40)
    ckpt.Store.init(s3_main_url, settings=_settings(cache=False)).push(str(src), "m")
    host, port = s3_main.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port))).start()
    dest = tmp_path / "dest"
    dest.mkdir()
    try:
        proxy.delay_s = 0.05  # a slow wire, two requests at a time: the pull takes seconds
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint, "CKPT_CACHE": "0", "CKPT_TRANSFER_CONCURRENCY": "2"}
        # Ctrl-C as in a terminal: a runner that started the tests in the background (nohup, &)
        # passes SIGINT on ignored, and the pull would finish instead.
        exe = [sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from ckpt_store.cli.main import main; main()"]
        proc = subprocess.Popen([*exe, "--store", s3_main_url, "pull", "m", str(dest / "out.safetensors")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while not os.listdir(dest) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)  # until the pull has started writing its temporary file
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.3)
        proc.send_signal(getattr(signal, sig))
        proc.communicate(timeout=60)
        assert proc.returncode == {"SIGINT": 130, "SIGTERM": 143, "SIGKILL": -signal.SIGKILL}[sig]
        assert not (dest / "out.safetensors").exists()
        if sig != "SIGKILL":
            assert os.listdir(dest) == []
        else:  # killed: at most its temporary (a dot file) is left, never the destination
            assert all(n.startswith(".") for n in os.listdir(dest))
    finally:
        proxy.stop()


def test_fine_tune_pull_fetches_only_its_own_chunks_and_refetches_a_damaged_base(s3_url, tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    src, tensors = _file(tmp_path)
    rng = np.random.default_rng(7)
    ft = {k: (v + (1e-4 * rng.standard_normal(v.shape)).astype(v.dtype)) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    ft_path = tmp_path / "ft.safetensors"
    save_file(ft, str(ft_path))
    writer = ckpt.Store.init(s3_url, settings=_settings(cache=False))
    writer.push(str(src), "base")
    writer.push(str(ft_path), "ft", base="base")
    m_ft = writer.manifest("ft")
    assert any(t.delta_bases for t in m_ft.tensors)  # stored as deltas against the base

    reader = ckpt.Store.open(s3_url, settings=_settings())
    reader.pull("base", str(tmp_path / "b.safetensors"))  # the base's chunks are now cached
    base_chunks = set(writer.manifest("base").chunk_lengths())
    own = set(m_ft.chunk_lengths()) - base_chunks
    # Damage a cached base chunk that a delta of the fine-tune needs.
    needed = {b for t in m_ft.tensors for chain in t.delta_bases for b in chain}
    victim = sorted(needed & base_chunks)[0]
    entry = next(p for p in cache.rglob(victim))
    raw = bytearray(entry.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    entry.write_bytes(bytes(raw))

    again = ckpt.Store.open(s3_url, settings=_settings())
    gets = chunk_gets(again)
    again.pull("ft", str(tmp_path / "ft-out.safetensors"))
    assert (tmp_path / "ft-out.safetensors").read_bytes() == ft_path.read_bytes()
    assert gets[0] == len(own) + 1  # its own chunks, and the damaged base once more
    assert again.objects.cache.dropped == 1


@pytest.mark.parametrize("loop", ["itself", "two chunks"])
def test_a_delta_chain_that_loops_fails_at_once_with_a_warm_cache(s3_url, tmp_path, monkeypatch, loop):
    """A damaged remote store whose base chunk was overwritten with the blob of a delta against it
    (a chain that names itself), or against its own delta (two chunks naming each other): the load
    fails at once naming a chunk, with the chunk cache warm as cold. (Each of the 64 levels the
    chain was followed retried its cached blob, and the fetch put it back in the cache: ~2**64
    decodes, gigabytes of memory.)"""
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))
    store = ckpt.Store.init(s3_url, settings=_settings(cache=False))
    g = torch.Generator().manual_seed(1)
    w = torch.randn(CHUNK // 4, generator=g)
    store.push({"w": w}, "base")
    store.push({"w": w + torch.randn(CHUNK // 4, generator=g) * 1e-4}, "tuned", base="base")
    store.push({"w": w + torch.randn(CHUNK // 4, generator=g) * 1e-4}, "tuned2", base="tuned")
    d1, b = store.manifest("tuned").tensors[0].chunks[0], store.manifest("tuned").tensors[0].chains()[0][0]
    d2, chain2 = store.manifest("tuned2").tensors[0].chunks[0], store.manifest("tuned2").tensors[0].chains()[0]
    assert chain2 == (d1, b)  # tuned2's chunk: a delta against tuned's, itself one against base's
    backend = store.objects.backend
    # b := a blob that is a delta against b (tuned's), or against d1 (tuned2's), whose base is b
    bad = backend.read(store.objects.path("chunks", d1 if loop == "itself" else d2))
    backend.write(store.objects.path("chunks", b), bad)
    for attempt in ("cold", "warm"):  # the first leaves the bad blob in the cache
        reader = ckpt.Store.open(s3_url, settings=_settings())
        gets = chunk_gets(reader)
        failed: list[BaseException] = []

        def load() -> None:
            try:
                reader.load("tuned")
            except BaseException as e:  # noqa: BLE001 - what the load raised is the test's
                failed.append(e)

        t = threading.Thread(target=load, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), f"{attempt} cache: still loading after 60 s ({gets[0]} GETs)"
        assert len(failed) == 1 and isinstance(failed[0], CorruptObjectError), failed
        assert gets[0] < 200, (attempt, gets[0])  # a GET or two per level of the chain at most


def _chain(store, depth):
    """Refs ``d0`` (a whole chunk) .. ``d{depth}``, each one's chunk a delta against the one before; the chunk ids, top first."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(CHUNK // 4, generator=g)
    store.push({"w": w}, "d0")
    for i in range(1, depth + 1):
        w = w + torch.randn(CHUNK // 4, generator=g) * 1e-4
        store.push({"w": w}, f"d{i}", base=f"d{i - 1}")
    top = store.manifest(f"d{depth}").tensors[0]
    chain = (top.chunks[0], *top.chains()[0])
    assert len(chain) == depth + 1  # stored as one chain, as deep as asked
    return w, chain


def test_a_base_damaged_in_the_store_keeps_the_good_cache_entries_above_it(s3_url, tmp_path, monkeypatch):
    """A chain whose whole-chunk base is damaged in the store, the deltas above it cached and sound:
    the load fails naming the base, having fetched only the base (once) and kept the deltas' entries.
    (Each level above dropped its good entry and fetched it again, and the top chunk's retry walked
    the chain once more: 7 GETs for a chain of four, the entries above all rewritten.)"""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    writer = ckpt.Store.init(s3_url, settings=_settings(cache=False, max_delta_depth=3))
    _, chain = _chain(writer, 3)
    ckpt.Store.open(s3_url, settings=_settings()).load("d3")  # every level cached
    base = chain[-1]
    path = writer.objects.path("chunks", base)
    raw = bytearray(writer.objects.backend.read(path))
    raw[len(raw) // 2] ^= 0x01
    writer.objects.backend.write(path, bytes(raw))
    next(cache.rglob(base)).unlink()  # the base not cached: read from the store, damaged
    entries = {c: next(cache.rglob(c)).stat().st_ino for c in chain[:-1]}

    reader = ckpt.Store.open(s3_url, settings=_settings())
    gets = chunk_gets(reader)
    with pytest.raises(CorruptObjectError) as e:
        reader.load("d3")
    assert e.value.object_id == base
    assert gets[0] == 1 and reader.objects.cache.dropped == 0  # the damaged base only
    assert {c: next(cache.rglob(c)).stat().st_ino for c in chain[:-1]} == entries  # left as they were


@pytest.mark.parametrize("how", ["load", "pull"])
def test_a_cached_delta_against_a_base_this_store_lacks_is_fetched_again(s3_url, tmp_path, monkeypatch, how):
    """The cache's entry of a chunk holds another store's blob of it (two stores of one id: one copied
    with its config), a delta against a base this store does not have: the entry is dropped and the
    chunk fetched again, once. (The load failed with 'chunk ... is missing from the store'.)"""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    g = torch.Generator().manual_seed(9)
    base = torch.randn(CHUNK // 4, generator=g)
    w = base + torch.randn(CHUNK // 4, generator=g) * 1e-4
    store = ckpt.Store.init(s3_url, settings=_settings(cache=False))
    store.push({"w": w}, "m")  # stored whole here
    other = ckpt.Store.init(str(tmp_path / "other"), settings=_settings())
    other.push({"w": base}, "base")
    other.push({"w": w}, "m", base="base")  # and as a delta against a chunk the S3 store lacks there
    (cid,) = store.manifest("m").tensors[0].chunks
    foreign = other.objects.get("chunks", cid)
    from safetensors.torch import load_file

    from ckpt.codecs.chunk import parse_header
    from ckpt_store.storage.cache import ChunkBlobCache

    assert parse_header(foreign).base is not None and not store.objects.has("chunks", parse_header(foreign).base)
    reader = ckpt.Store.open(s3_url, settings=_settings())
    ChunkBlobCache(str(cache), reader.config.store_id, 1 << 30).put(cid, (foreign,))
    with gets_of(reader) as names:
        if how == "load":
            got = reader.load("m")["w"]
        else:
            reader.pull("m", str(tmp_path / "m.safetensors"))
            got = load_file(str(tmp_path / "m.safetensors"))["w"]
    assert got.view(torch.uint8).numpy().tobytes() == w.view(torch.uint8).numpy().tobytes()
    # the chunk fetched again once; the base it named asked for once (read ahead: the decoding thread
    # is told it is missing, where it asked again)
    assert names.count(cid) == 1 and names.count(parse_header(foreign).base) == 1
    assert reader.objects.cache.dropped == 1


@pytest.mark.parametrize("how", ["load", "pull"])
def test_a_delta_whose_base_the_store_lost_fails_once_and_keeps_its_sound_cache_entry(s3_url, tmp_path, monkeypatch,
                                                                                      caplog, how):
    """A delta cached as this store holds it, its base deleted from the store: the load fails naming
    the base, having asked for it once and the delta once (to see whether the cache's copy differs:
    it does not), with the entry kept and no word of damage. (The entry was reported "damaged" and
    dropped, the base asked for twice; a pull decoded the delta once more too.)"""
    import logging

    from ckpt_store.storage.errors import ObjectNotFoundError

    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(9)
    base = torch.randn(CHUNK // 4, generator=g)
    writer = ckpt.Store.init(s3_url, settings=_settings(cache=False))
    writer.push({"w": base}, "base")
    writer.push({"w": base + torch.randn(CHUNK // 4, generator=g) * 1e-4}, "m", base="base")
    (cid,) = writer.manifest("m").tensors[0].chunks
    (bid,) = writer.manifest("base").tensors[0].chunks
    ckpt.Store.open(s3_url, settings=_settings()).load("m")  # the delta (and its base) cached
    writer.objects.backend.delete(writer.objects.path("chunks", bid))
    reader = ckpt.Store.open(s3_url, settings=_settings())
    next((tmp_path / "cache").rglob(bid)).unlink()  # the base in no cache: asked of the store
    entry = next((tmp_path / "cache").rglob(cid))
    inode = entry.stat().st_ino
    caplog.set_level(logging.WARNING)
    with gets_of(reader) as names, pytest.raises(ObjectNotFoundError) as e:
        if how == "load":
            reader.load("m")
        else:
            reader.pull("m", str(tmp_path / "m.safetensors"))
    assert e.value.object_id == bid
    assert names.count(bid) == 1 and names.count(cid) == 1
    assert reader.objects.cache.dropped == 0 and entry.stat().st_ino == inode
    assert "damaged" not in caplog.text


def test_two_pulls_through_one_cache_while_a_third_process_clears_it(s3_main_url, tmp_path, monkeypatch):
    """Two processes pull one checkpoint through one cache, again and again, while a third runs
    `ckpt cache clear` in a loop: every pull is bit-exact, and none warns (the clear removed folders a
    put had just made: 'cannot cache chunk'; an entry gone when opened and put again by the other
    puller before it was looked at was deleted as 'damaged')."""
    import subprocess
    import sys
    import textwrap

    from safetensors.numpy import save_file

    from ckpt.store.cache import clear_cache

    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    src = tmp_path / "m.safetensors"
    save_file({f"w{i}": rng.standard_normal(CHUNK // 4, dtype=np.float32) for i in range(48)}, str(src))
    ckpt.Store.init(s3_main_url, settings=_settings(cache=False)).push(str(src), "m")
    done = tmp_path / "pulled"
    puller = textwrap.dedent(f"""
        import logging, sys, ckpt
        logging.basicConfig(level=logging.WARNING)
        for i in range(10):
            out = sys.argv[1] + f"-{{i}}.safetensors"
            ckpt.Store.open({s3_main_url!r}, settings=ckpt.Settings.from_env(chunk_size={CHUNK})).pull("m", out)
            assert open(out, "rb").read() == open({str(src)!r}, "rb").read(), i
        open(sys.argv[1] + ".done", "w").close()
        """)
    pullers = [subprocess.Popen([sys.executable, "-c", puller, str(done) + str(k)], stderr=subprocess.PIPE) for k in range(2)]
    clears = 0
    while any(p.poll() is None for p in pullers) and clears < 100_000:
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "ckpt"), "cache", "clear"], check=True, capture_output=True) \
            if clears % 50 == 0 else clear_cache()  # the command now and then, the call in between
        clears += 1
    for k, p in enumerate(pullers):
        err = p.communicate(timeout=120)[1].decode()
        assert p.returncode == 0 and os.path.exists(str(done) + f"{k}.done"), err[-3000:]
        assert "WARNING" not in err, err[-3000:]
    assert clears > 20


def test_a_full_disk_under_the_cache_makes_room_for_the_chunks_of_the_next_pull(s3_main_url, tmp_path, monkeypatch, tmpfs, caplog):
    """The cache folder on a 4 MiB tmpfs, its limit the default (far above that): pulling a second 3 MB
    checkpoint after a first deletes the first's least recently used chunks to keep its own, and pulling
    it again fetches nothing. (The disk full, the cache stopped caching with a warning: the re-pull
    fetched every chunk that did not fit.)"""
    import logging

    cache = tmpfs(tmp_path / "cache", "4m")
    monkeypatch.setenv("CKPT_CACHE_DIR", cache)
    writer = ckpt.Store.init(s3_main_url, settings=_settings(cache=False))
    srcs = []
    for name, seed in (("a", 0), ("b", 1)):
        (tmp_path / name).mkdir()
        src, _ = _file(tmp_path / name, seed=seed)
        writer.push(str(src), name)
        srcs.append(src)
    with caplog.at_level(logging.WARNING, logger="ckpt_store.storage.cache"):
        for name, src in (("a", srcs[0]), ("b", srcs[1])):
            ckpt.Store.open(s3_main_url, settings=_settings()).pull(name, str(tmp_path / f"{name}.out"))
            assert (tmp_path / f"{name}.out").read_bytes() == src.read_bytes()
    assert not caplog.records  # (nothing failed to be cached)
    again = ckpt.Store.open(s3_main_url, settings=_settings())
    gets = chunk_gets(again)
    again.pull("b", str(tmp_path / "b2.out"))
    assert gets[0] == 0 and (tmp_path / "b2.out").read_bytes() == srcs[1].read_bytes()
    again = ckpt.Store.open(s3_main_url, settings=_settings())
    gets = chunk_gets(again)
    again.pull("a", str(tmp_path / "a2.out"))
    assert 0 < gets[0] and (tmp_path / "a2.out").read_bytes() == srcs[0].read_bytes()  # some of a's went


def test_cache_entries_rewritten_into_a_loop_by_another_process_are_fetched_again(s3_url, tmp_path, monkeypatch):
    """Another process rewrites a cached delta so that it names, as its base, the delta above it
    (a well-formed entry, its trailer right): the pull and the load find the loop where it closes,
    fetch that entry again and give the right bytes. (The chain was followed 64 levels down, and
    the entry fetched again there had no levels left for its own chain: the pull failed, naming
    a sound chunk.)"""
    import subprocess
    import sys

    from safetensors.torch import load_file

    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    store = ckpt.Store.init(s3_url, settings=_settings(cache=False, max_delta_depth=3))
    w, (top, below, *_) = _chain(store, 3)
    ckpt.Store.open(s3_url, settings=_settings()).load("d3")  # every level cached
    (entry,) = cache.rglob(below)
    writer = ("import sys, blake3\np, base = sys.argv[1], bytes.fromhex(sys.argv[2])\nraw = bytearray(open(p, 'rb').read()[:-32])\n"
              "assert raw[6] & 1\nraw[16:48] = base\nopen(p, 'wb').write(bytes(raw) + blake3.blake3(raw).digest())\n")
    for attempt in ("pull", "load"):
        subprocess.run([sys.executable, "-c", writer, str(entry), top], check=True)  # d2 := a delta against d3
        reader = ckpt.Store.open(s3_url, settings=_settings())
        gets = chunk_gets(reader)
        if attempt == "pull":
            reader.pull("d3", str(tmp_path / "out.safetensors"))
            got = load_file(str(tmp_path / "out.safetensors"))["w"]
        else:
            got = reader.load("d3")["w"]
        assert got.numpy().tobytes() == w.numpy().tobytes()
        assert gets[0] == 1 and reader.objects.cache.dropped == 1  # the looping entry, fetched again
