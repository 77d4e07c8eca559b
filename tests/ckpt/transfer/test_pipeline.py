"""The read pipeline (ckpt.transfer.pipeline.get_chunks): reads run ahead of the decoding threads,
hinted to a local disk or handed to reading threads elsewhere, within a memory bound,
and the first error ends the load without leaving reads behind."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from integration_util import tensor_bits as _bits

import ckpt
from ckpt.codecs import buffers
from ckpt.codecs.chunk import GSUB, MAX_HEADER
from ckpt.progress import NullProgress
from ckpt.settings import Settings
from ckpt.transfer import fetch, pipeline, reading
from ckpt_store.storage.errors import ObjectNotFoundError


def _state(n: int = 24) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"t{i}": torch.randn(4096 + i, generator=g) for i in range(n)}


def test_local_store_hints_the_reads_ahead(tmp_path):
    store = ckpt.Store.init(str(tmp_path / "s"), settings=Settings.from_env(workers=2, io_workers=3))
    state = _state()
    store.push(state, "a")
    hinted: list[str] = []
    backend = store.objects.backend
    real = backend.prefetch
    backend.prefetch = lambda path: (hinted.append(path), real(path))[1]  # type: ignore[method-assign]
    got = store.load("a")
    assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in state.items()}
    m = store.manifest("a")
    heads = [c for f in m.files if f.kind == "safetensors" for c in f.chunks]  # read too: each entry is checked against its header
    chunks = [store.objects.path("chunks", c) for c in [*heads, *(c for t in m.tensors for c in t.chunks)]]
    assert sorted(hinted) == sorted(chunks)  # every chunk hinted, each once


def test_reads_handed_off_stay_within_the_bound(monkeypatch):
    store = ckpt.Store.init(f"memory://pipeline-{uuid.uuid4().hex}", settings=Settings.from_env(workers=2, io_workers=2))
    assert not store.objects.backend.prefetches
    state = _state(40)
    store.push(state, "a")
    backend = store.objects.backend
    lock = threading.Lock()
    held = {"now": 0, "max": 0}
    real_read = backend.read

    def read(path: str, limit: int | None = None) -> bytes:
        data = real_read(path, limit)
        if "/chunks/" in path:
            with lock:
                held["now"] += 1
                held["max"] = max(held["max"], held["now"])
        return data

    monkeypatch.setattr(backend, "read", read)
    real_decode = reading.decode_read

    def decode(*a, **k):
        time.sleep(0.005)  # decoding slower than reading: the reads run ahead up to the bound
        try:
            return real_decode(*a, **k)
        finally:
            with lock:
                held["now"] -= 1

    monkeypatch.setattr(reading, "decode_read", decode)
    got = store.load("a")
    assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in state.items()}
    # blobs read and not yet decoded: the read-ahead window (2 x io_workers) plus one per decoder
    assert 2 < held["max"] <= 2 * 2 + 2


@pytest.mark.parametrize("where", ["local", "memory"])
def test_missing_chunk_mid_load_is_an_error_and_leaves_no_reads(tmp_path, where):
    url = str(tmp_path / "s") if where == "local" else f"memory://pipeline-{uuid.uuid4().hex}"
    store = ckpt.Store.init(url, settings=Settings.from_env(workers=2, io_workers=2))
    store.push(_state(30), "a")
    cid = store.manifest("a").tensors[15].chunks[0]
    store.objects.backend.delete(store.objects.path("chunks", cid))
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ObjectNotFoundError, match=cid):
        store.load("a")
    after = {t.name for t in threading.enumerate() if t.name.startswith("ckpt")}
    assert after <= before  # the pool's threads are gone: nothing reads on behind the error


@pytest.mark.parametrize("batch", [0, 5, 64, 10**9])
def test_run_parallel_batches_small_items_and_keeps_order(batch):
    from ckpt.progress import NullProgress

    weights = [1, 3, 70, 2, 2, 2, 1, 90, 4, 4, 4, 4, 4, 4, 1]
    threads: dict[int, str] = {}

    def fn(i: int) -> int:
        threads[i] = threading.current_thread().name
        return i * i

    assert pipeline.run_parallel(fn, list(range(len(weights))), 2, NullProgress(), lambda i: weights[i], batch=batch) \
        == [i * i for i in range(len(weights))]
    if batch == 10**9:  # everything in one hand-off: one thread ran it all
        assert len(set(threads.values())) == 1


def test_little_work_runs_in_the_calling_thread_not_a_pool_per_call(tmp_path, monkeypatch):
    """run_parallel started (and joined) a pool thread for every call, however little its work: a
    diff of 10,000 small tensors calls it three times per tensor (each side's read, the estimate),
    and those threads were most of its 16 s. The results stay exact."""
    store = ckpt.Store.init(str(tmp_path / "s"), settings=Settings.from_env(workers=2))
    g = torch.Generator().manual_seed(5)
    a = {f"experts.{i}.w": torch.randn(16, generator=g) for i in range(300)}
    b = {k: v + 0.01 for k, v in a.items()}
    store.push(a, "a")
    store.push(b, "b")
    started = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), start(self))[1])
    report = ckpt.diff("a", "b", store=store)
    loaded = store.load("b")
    assert len(started) < 10, started[:5]  # was 3 per tensor
    assert report.summary.changed == 300 and report.summary.changed_elements == 300 * 16
    assert all(_bits(loaded[k]) == _bits(v) for k, v in b.items())
    assert pipeline.run_parallel(lambda i: threading.current_thread(), [1, 2], 2, NullProgress(),
                                 lambda i: 1, batch=2) == [threading.current_thread()] * 2


def test_run_parallel_raises_the_first_error():
    from ckpt.progress import NullProgress

    def fn(i: int) -> int:
        if i == 7:
            raise ValueError("seven")
        return i

    with pytest.raises(ValueError, match="seven"):
        pipeline.run_parallel(fn, list(range(20)), 2, NullProgress(), lambda i: 1, batch=3)


def test_run_parallel_stops_the_groups_under_way_at_the_first_error():
    """An error (or Ctrl-C) left the other groups under way to run to their last item: a group of
    small chunks (up to BATCH_BYTES of them) went on after the push had stopped."""
    from ckpt.progress import NullProgress

    second = threading.Event()
    ran: list[int] = []

    def fn(i: int) -> int:
        if i == 0:
            assert second.wait(30)
            raise ValueError("first")
        ran.append(i)
        second.set()
        time.sleep(0.2)
        return i

    with pytest.raises(ValueError, match="first"):
        pipeline.run_parallel(fn, list(range(40)), 2, NullProgress(), lambda i: 1, batch=20)  # two groups of 20
    assert 1 <= len(ran) <= 3, ran  # the item under way when it came (and the next, on a busy machine): was all 20


def _tuned_pair(url: str, settings: Settings, tensors: int = 3, numel: int = 200_000, seed: int = 11,
                ) -> tuple[ckpt.Store, dict[str, torch.Tensor]]:
    """A store with ``base`` and ``tuned``, a fine-tune stored as deltas against it."""
    store = ckpt.Store.init(url, settings=settings)
    g = torch.Generator().manual_seed(seed)
    base = {f"w{i}": torch.randn(numel, generator=g) for i in range(tensors)}
    tuned = {k: v + torch.randn(v.shape, generator=g) * 1e-4 for k, v in base.items()}
    store.push(base, "base")
    store.push(tuned, "tuned", base="base")
    return store, tuned


def test_remote_reads_fetch_the_delta_chains_too(monkeypatch):
    """On a store without prefetch the reading threads also fetch the blobs of each chunk's
    delta chain, so no decoding thread waits on those requests one by one."""
    url = f"memory://pipeline-{uuid.uuid4().hex}"
    store, tuned = _tuned_pair(url, Settings.from_env(workers=2, io_workers=2), tensors=6, numel=100_000, seed=5)
    chunks = {c for t in store.manifest("tuned").tensors for c in t.chunks}
    assert all(store.objects.backend.read_range(store.objects.path("chunks", c), 0, 9)[4] == GSUB for c in chunks)
    reopened = ckpt.Store.open(url, settings=Settings.from_env(workers=2, io_workers=2))  # an empty base cache
    backend = reopened.objects.backend
    readers: list[str] = []
    real_read = backend.read

    def read(path: str, limit: int | None = None) -> bytes:
        if "/chunks/" in path:
            readers.append(threading.current_thread().name)
        return real_read(path, limit)

    monkeypatch.setattr(backend, "read", read)
    got = reopened.load("tuned")
    assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in tuned.items()}
    heads = {c for f in store.manifest("tuned").files if f.kind == "safetensors" for c in f.chunks}
    assert len(readers) == 2 * len(chunks) + len(heads)  # each delta and its base, each read once (and the header checked)
    assert all(name.startswith("ckpt-read") for name in readers)


def test_blob_buffers_are_reused_and_bounded():
    size = 1 << 20
    pool = pipeline.BlobBuffers(size, keep=2)
    a = pool.take(size - 100)
    assert len(a) == size - 100
    first = a.obj
    pool.give(a)
    b = pool.take(size // 2)
    assert b.obj is first and len(b) == size // 2  # the same memory again, no new allocation
    big = pool.take(2 * size)
    assert len(big) == 2 * size
    pool.give(big)  # larger than the pool's buffers: not kept
    small = pool.take(1000)
    assert len(small.obj) == 1000  # a small blob gets memory of its own size
    pool.give(b"a blob from elsewhere")  # not the pool's: ignored
    views = [pool.take(size) for _ in range(4)]
    for v in views:
        pool.give(v)
    again = [pool.take(size).obj for _ in range(3)]
    assert again[0] is views[1].obj and again[1] is views[0].obj and all(again[2] is not v.obj for v in views)  # two kept, then a new one


def test_a_sink_gets_each_chunk_right_while_buffers_are_reused(tmp_path):
    """Decoded chunks reach a sink from one reused buffer per thread: every call sees its own bytes."""
    store = ckpt.Store.init(str(tmp_path / "s"), settings=Settings(chunk_size=64 * 1024))
    g = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randn(64 * 1024, generator=g) * 0.02 for i in range(6)}  # compressible: decoded, not raw
    store.push(tensors, "m")
    m = store.manifest("m")
    got: dict[int, bytes] = {}
    lock = threading.Lock()

    def sink_at(off):
        def sink(data):
            with lock:
                got[off] = bytes(data)  # the bytes are valid during the call only
        return sink

    tasks = []
    pos = 0
    want = b""
    for t in m.tensors:
        tasks += [pipeline.GetTask(cid, n, sink_at(p)) for cid, n, p in pipeline.spans(t.chunks, t.nbytes, m.chunk_size, pos)]
        pos += t.nbytes
        want += _bits(tensors[t.name])
    pipeline.get_chunks(store.objects, tasks, store.settings)
    assert b"".join(got[k] for k in sorted(got)) == want


def test_a_deltas_base_is_checked_through_the_deltas_result(tmp_path, monkeypatch):
    """A delta's result is hashed; its base, only an input, is not hashed once more (it
    cannot give the right result unless it is right): each chunk of the load is hashed once."""
    store, tuned = _tuned_pair(str(tmp_path / "s"), Settings.from_env(workers=2, base_cache_mb=0))
    hashed: list[int] = []
    real = fetch.object_id

    def counting(data):
        hashed.append(len(data))
        return real(data)

    import ckpt.codecs.chunk as chunk_mod

    monkeypatch.setattr(fetch, "object_id", counting)
    monkeypatch.setattr(chunk_mod, "object_id", counting)
    got = ckpt.Store.open(str(tmp_path / "s"), settings=Settings.from_env(workers=2, base_cache_mb=0)).load("tuned")
    assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in tuned.items()}
    head = sum(f.head_size for f in store.manifest("tuned").files if f.kind == "safetensors")  # each entry checked against it
    assert head and sum(hashed) == sum(v.numel() * v.element_size() for v in tuned.values()) + head


def test_a_wrong_base_that_decodes_is_found_and_named(tmp_path):
    """A base replaced by a valid blob of other bytes decodes without error, so only the
    delta's hash shows something is wrong: the base is then read again, verified, and the
    error names it (not the delta, which is intact)."""
    from ckpt.codecs.chunk import raw_header
    from ckpt_store.storage.errors import CorruptObjectError

    store, _ = _tuned_pair(str(tmp_path / "s"), Settings.from_env(workers=2, base_cache_mb=0))
    m = store.manifest("tuned")
    delta, base = m.tensors[0].chunks[0], m.tensors[0].chains()[0][0]
    length = m.chunk_lengths()[base]
    path = tmp_path / "s" / store.objects.path("chunks", base)
    path.chmod(0o644)
    path.write_bytes(raw_header(4, length) + torch.randn(length // 4).numpy().tobytes())
    reopened = ckpt.Store.open(str(tmp_path / "s"), settings=Settings.from_env(workers=2, base_cache_mb=0))
    with pytest.raises(CorruptObjectError) as exc:
        reopened.load("tuned")
    assert base[:12] in str(exc.value) and delta[:12] not in str(exc.value)


def test_a_chunk_claimed_larger_than_any_chunk_is_refused_before_anything_is_allocated(tmp_path):
    """A manifest is outside data: a chunk it says holds 40 TB (a chunk_size and a tensor to match)
    is refused by the reader before a buffer of that size is asked for."""
    from ckpt.transfer.pipeline import GetTask, fetch_chunk, get_chunks
    from ckpt_store.storage.errors import CorruptObjectError

    store = ckpt.Store.init(str(tmp_path / "s"))
    store.push({"w": torch.randn(1000)}, "m")
    cid = store.manifest("m").tensors[0].chunks[0]
    with pytest.raises(CorruptObjectError, match="more than any chunk"):
        get_chunks(store.objects, [GetTask(cid, 40 << 40, sink=lambda b: None)], store.settings)
    with pytest.raises(CorruptObjectError, match="more than any chunk"):
        fetch_chunk(store.objects, cid, 40 << 40, store.settings)


def test_a_raw_chunk_read_from_a_local_store_is_hashed_as_it_is_read(tmp_path, monkeypatch):
    """A raw chunk read into its tensor from a local store is hashed block by block as the read fills
    it (each block still in the CPU's caches), not read back from memory and hashed after: the load
    hashes no chunk a second time. A byte flipped in its last block is still found."""
    from ckpt_store.storage.errors import CorruptObjectError

    settings = Settings.from_env(workers=2, min_saving=1.0)  # stored raw, as a local tier stores them
    store = ckpt.Store.init(str(tmp_path / "s"), settings=settings)
    w = torch.randn(3 << 18, generator=torch.Generator().manual_seed(3))  # 3 MiB: one chunk, 12 blocks
    store.push({"w": w}, "a")
    hashed: list[int] = []
    real = fetch.object_id
    monkeypatch.setattr(fetch, "object_id", lambda data: (hashed.append(len(data)), real(data))[1])
    out = {"w": torch.empty_like(w)}
    store.load_into("a", out)
    assert _bits(out["w"]) == _bits(w) and hashed == []

    (cid,) = store.manifest("a").tensors[0].chunks
    path = tmp_path / "s" / store.objects.path("chunks", cid)
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x10
    path.chmod(0o644)
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptObjectError, match=cid[:12]):
        store.load_into("a", {"w": torch.empty_like(w)})


def test_ctrl_c_in_a_push_stops_its_writes_at_once(tmp_path):
    """Ctrl-C while a push writes (here: raised in the main thread as a signal handler raises it, by
    another thread, while the first writes are under way): the main thread, asleep until every chunk
    was done, raised it only then, having written every chunk; and the writes queued (2 per I/O
    thread) went on after it. Now only the writes already under way end, and no other starts."""
    import _thread
    import signal

    running = set(threading.enumerate())  # (an earlier test's, such as an S3 backend's watchdog)
    settings = Settings.from_env(workers=2, io_workers=2, chunk_size=1 << 16)
    store = ckpt.Store.init(str(tmp_path / "s"), settings=settings)
    data = torch.randn(40 << 14, generator=torch.Generator().manual_seed(3))  # 40 chunks
    tasks = pipeline.put_tasks(lambda p, n: memoryview(data.numpy()).cast("B")[p:p + n], 0, data.nbytes, 1 << 16, 4)
    backend = store.objects.backend
    real = backend.create_exclusive
    started: list[str] = []

    def slow(path, blob):  # a slow disk: a write takes a second
        started.append(path)
        if len(started) == 1:
            _thread.interrupt_main()  # what Ctrl-C does (the handler runs in the main thread)
        time.sleep(1)
        return real(path, blob)

    backend.create_exclusive = slow
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background runner ignores it)
    try:
        with pytest.raises(KeyboardInterrupt):
            pipeline.put_chunks(store.objects, tasks, settings)
    finally:
        signal.signal(signal.SIGINT, before)
        backend.create_exclusive = real
    # The writes under way when it came (one per I/O thread), no more: it was every chunk (40).
    assert 1 <= len(started) <= settings.io_workers, started
    assert sorted(o.id for o in store.objects.list("chunks")) == sorted(p.rsplit("/", 1)[-1] for p in started)
    assert not [t for t in threading.enumerate() if t.name.startswith("ckpt") and t not in running]  # none left writing


def test_a_push_keeps_no_event_or_future_per_chunk_it_has_stored(tmp_path):
    """put_chunks kept, for the whole push, an Event (with its Condition, lock and deque) per chunk
    id (so that a later task of the same id waits for the first) and the Future of every write:
    about 2 KB a chunk, 200 MB for a merge of 100,000 tiny tensors. What is done drops both: near
    the end only the chunks under way hold one, and a repeated chunk is still stored once."""
    import gc
    from concurrent.futures import Future

    settings = Settings.from_env(workers=2, io_workers=2, fsync=False)  # (tiny chunks: a tensor each, as in a merge)
    store = ckpt.Store.init(str(tmp_path / "s"), settings=settings)
    n = 2000  # 4 KiB chunks: 8 MB, past the batch run_parallel runs in the calling thread (its threads wait here)
    data = torch.randn(n * 1024, generator=torch.Generator().manual_seed(5))
    data[-1024:] = data[:1024]  # the last chunk repeats the first: stored once, its result taken
    raw = memoryview(data.numpy()).cast("B")
    held: list[int] = []
    reads = [0]
    gc.collect()
    before = sum(type(o) in (threading.Event, Future) for o in gc.get_objects())

    def read(p: int, length: int) -> memoryview:
        reads[0] += 1
        if reads[0] in (n - 100, n - 50, n):  # near the end: what the push holds of what it did
            held.append(sum(type(o) in (threading.Event, Future) for o in gc.get_objects()))
        return raw[p:p + length].toreadonly()

    tasks = pipeline.put_tasks(read, 0, data.nbytes, 4096, 4)
    results = pipeline.put_chunks(store.objects, tasks, settings)
    assert len(held) == 3 and max(held) - before < 100, (before, held)  # was 1,900 to 2,000 Events, and as many Futures
    assert results[-1].id == results[0].id and results[-1].stored == 0
    assert len(list(store.objects.list("chunks"))) == n - 1


def test_reads_from_s3_reuse_the_blob_buffers_the_last_read_left(s3_main_url, monkeypatch):
    """Loads of one checkpoint from S3 in a row: each reads its chunks into the buffers the one before
    left (ckpt.codecs.buffers.SpareBuffers), not into fresh memory: all of them together take no more
    fresh buffers than one read keeps (one request and one decoding thread: 2 read ahead, 1 decoded),
    where each took fresh ones before. Every load bit-exact."""
    monkeypatch.setattr(buffers, "SPARE_IDLE_S", 60.0)  # (however slow the machine is between the loads)
    gen = torch.Generator().manual_seed(7)
    # Chunks of 1 MiB that do not compress to a raw blob: each is a GET into a blob buffer.
    tensors = {f"w{i}": (torch.randn(1 << 18, generator=gen) * 0.02) for i in range(6)}
    settings = Settings.from_env(cache=False, chunk_size=1 << 20, workers=1, io_workers=1, transfer_concurrency=1)
    store = ckpt.Store.init(s3_main_url, settings=settings)
    store.push(tensors, "m")
    size = settings.chunk_size + MAX_HEADER
    fresh: list[int] = []
    real = fetch.empty_buffer

    def counting(n: int) -> memoryview:
        if n == size:
            fresh.append(n)
        return real(n)

    monkeypatch.setattr(fetch, "empty_buffer", counting)
    for _ in range(5):
        got = store.load("m")
        assert all(_bits(got[k]) == _bits(v) for k, v in tensors.items())
    assert 1 <= len(fresh) <= 3
