"""The S3 backend against real S3 servers on 127.0.0.1: conditional creates, retries, faults, secrets.

Faults are injected by a TCP proxy between s3fs and the server (tests/s3support.py):
delays, connections reset mid-upload or mid-download, and a create whose success
response is lost. Nothing is lost or corrupted, and when retries run out the error is
clear and retryable.
"""

from __future__ import annotations

import errno
import os
import time
import uuid

import pytest

pytest.importorskip("s3fs")
from s3support import KEY, SECRET  # noqa: E402

from ckpt_store.storage.backends import open_backend  # noqa: E402
from ckpt_store.storage.backends.s3 import S3Backend  # noqa: E402
from ckpt_store.storage.backends.s3_errors import is_precondition_failed, transient  # noqa: E402
from ckpt_store.storage.errors import StorageIOError  # noqa: E402
from ckpt_store.storage.refs import Refs  # noqa: E402
from ckpt_store.storage.retry import RetryPolicy, call_with_retries  # noqa: E402

FAST = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_precondition_failed_in_both_shapes():
    assert is_precondition_failed(FileExistsError("exists"))  # moto: s3fs maps it
    wrapped = OSError(errno.EINVAL, "At least one of the pre-conditions you specified did not hold")
    wrapped.__cause__ = _client_error("PreconditionFailed", 412)  # SeaweedFS: no <Condition> in the XML
    assert is_precondition_failed(wrapped)
    other = OSError(errno.EINVAL, "bad")
    other.__cause__ = _client_error("InvalidArgument", 400)
    assert not is_precondition_failed(other)


@pytest.mark.parametrize("code, status, retry", [
    ("SlowDown", 503, True), ("InternalError", 500, True), ("ServiceUnavailable", 503, True),
    ("Throttling", 400, True), ("TooManyRequests", 429, True), ("AccessDenied", 403, False),
    ("NoSuchKey", 404, False), ("InvalidArgument", 400, False)])
def test_what_is_retried(code, status, retry):
    e = OSError(errno.EIO, "x")
    e.__cause__ = _client_error(code, status)
    assert (transient(e) is not None) is retry


@pytest.mark.parametrize("code", ["\u00b2", "\u0663", "412x", ""])
def test_an_odd_error_code_without_a_status_is_not_a_crash(code):
    """A server's error code decides the status only where the response has none, and only where
    it is a plain ASCII number: "\u00b2".isdigit() is True and int() of it raised ValueError."""
    from botocore.exceptions import ClientError

    from ckpt_store.storage.backends.s3_errors import client_error

    e = ClientError({"Error": {"Code": code, "Message": "m"}}, "GetObject")
    assert client_error(e) == (code, 0)
    assert transient(e) is None and not is_precondition_failed(e)
    assert client_error(ClientError({"Error": {"Code": "503"}}, "GetObject")) == ("503", 503)


def test_network_errors_are_retried():
    import aiohttp
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    assert transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert transient(ConnectionClosedError(endpoint_url="http://127.0.0.1:1"))
    assert transient(aiohttp.ClientPayloadError("reset"))
    assert transient(ConnectionResetError())
    assert transient(FileNotFoundError()) is None


def test_a_request_retried_more_than_a_thousand_times_still_waits_and_succeeds():
    """CKPT_RETRIES=5000 with a long CKPT_REQUEST_DEADLINE (a job told to ride out an outage): retry
    1025 computed its wait as base_delay * 2**1024, an int no float holds, and the request failed with
    "int too large to convert to float" (shown as `cannot read ...ckpt-store.json: int too large...`)
    once the server was back. Past the doublings that reach max_delay, every wait is at most max_delay."""
    calls, waits = [0], []

    def fn() -> str:
        calls[0] += 1
        if calls[0] <= 1100:
            raise ConnectionResetError("reset")
        return "answer"

    policy = RetryPolicy(attempts=5001, base_delay=0.2, max_delay=10.0)
    assert call_with_retries(fn, what="GET x", policy=policy, transient=transient, sleep=waits.append) == "answer"
    assert len(waits) == 1100 and all(0.0 <= w <= 10.0 for w in waits)
    assert 0.0 <= RetryPolicy(base_delay=1e308, max_delay=10.0).delay(2000) <= 10.0


def test_settings_reach_the_backend(s3_main_url, monkeypatch):
    import ckpt

    monkeypatch.setenv("CKPT_TRANSFER_CONCURRENCY", "5")
    monkeypatch.setenv("CKPT_RETRIES", "2")
    store = ckpt.Store.init(s3_main_url)
    assert isinstance(store.backend, S3Backend)
    assert store.backend.concurrency == 5 and store.backend.retry.attempts == 3
    cfg = store.backend.client.meta.config
    assert cfg.max_pool_connections == 10
    assert cfg.retries["total_max_attempts"] == 1  # our layer retries, not botocore


def test_storage_options_and_prefix(s3_main):
    bucket = s3_main.new_bucket()
    b = open_backend(f"s3://{bucket}/deep/prefix", storage_options=s3_main.options())
    b.write("x/y", b"1")
    plain = open_backend(f"s3://{bucket}", storage_options=s3_main.options())
    assert plain.read("deep/prefix/x/y") == b"1"
    assert [e.path for e in b.list("")] == ["x/y"]


def test_large_objects_go_multipart_and_round_trip(s3_main_url):
    from ckpt_store.storage.backends.s3 import MULTIPART_THRESHOLD

    b = open_backend(s3_main_url)
    data = os.urandom(MULTIPART_THRESHOLD + 3 * 1024 * 1024)
    b.write("big", data)
    assert b.read("big") == data
    head = b._head("big")
    assert head is not None and "-" in head["ETag"]  # a multipart ETag is "<md5>-<parts>"


def _count_requests(b, monkeypatch):
    heads, lists = [], []
    real_head, real_list = b._head, b._list_page
    monkeypatch.setattr(b, "_head", lambda p: heads.append(p) or real_head(p))
    monkeypatch.setattr(b, "_list_page", lambda *a: lists.append(a) or real_list(*a))
    return heads, lists


def test_exists_many_lists_instead_of_heading(s3_main_url, monkeypatch):
    b = open_backend(s3_main_url)
    many = [f"objects/chunks/aa/{i:064x}" for i in range(12)]
    for p in many[:8]:
        b.write(p, b"x")
    lonely = ["objects/chunks/bb/" + "b" * 64, "objects/chunks/cc/" + "c" * 64]
    heads, lists = _count_requests(b, monkeypatch)
    assert b.exists_many(many + lonely) == set(many[:8])
    assert len(lists) == 1 and heads == []  # a small store: one listing answers all 14

    monkeypatch.setattr(b, "list_all", lambda prefix, lookups: None)  # as if the store were too big to list
    heads.clear(), lists.clear()
    assert b.exists_many(many + lonely) == set(many[:8])
    assert len(lists) == 1 and sorted(heads) == sorted(lonely)  # one LIST for the 12 in aa/, a HEAD for each lonely one
    heads.clear(), lists.clear()
    assert b.exists_many(lonely) == set() and lists == [] and len(heads) == 2  # few paths: HEADs


def test_push_lists_once_instead_of_a_head_per_chunk(s3_main_url, monkeypatch):
    import ckpt

    np = pytest.importorskip("numpy")
    store = ckpt.Store.init(s3_main_url, settings=ckpt.Settings.from_env(chunk_size=64 * 1024))
    heads, lists = _count_requests(store.backend, monkeypatch)
    data = {"w": np.random.default_rng(0).standard_normal(256 * 1024, dtype=np.float32)}  # 16 chunks
    import tempfile

    from safetensors.numpy import save_file

    with tempfile.TemporaryDirectory() as d:
        save_file(data, f"{d}/m.safetensors")
        r = store.push(f"{d}/m.safetensors", "m/x", delta=False)
    assert r.new_chunks == r.chunks >= 16
    assert len(heads) <= 1  # the manifest's own check, not one per chunk


def test_no_such_bucket_is_clear(s3_main):
    b = open_backend(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", storage_options=s3_main.options())
    with pytest.raises(FileNotFoundError):
        b.read("ckpt-store.json")
    if s3_main.kind == "seaweedfs":
        pytest.skip("SeaweedFS creates a missing bucket on the first PUT into it")
    with pytest.raises(StorageIOError, match="does not exist") as e:
        b.write("a", b"1")
    assert not e.value.retryable


def test_an_endpoint_that_is_no_s3_server_is_a_clear_error():
    """An endpoint that is a plain web server (a typo in the port, a proxy's page) answers a LIST
    with 404 and HTML: that came out as FileNotFoundError ("no such object: 's/'"), a traceback
    from `ckpt init` and `ckpt push`. It is an error saying what the server answered, naming the
    store (once: "s3://b/s/s/" named the prefix twice)."""
    from s3support import web_server

    with web_server(404) as url:
        b = S3Backend("s3://bucket/s", {"endpoint_url": url, "key": "k", "secret": "s"}, retry=FAST)
        with pytest.raises(StorageIOError, match="404") as e:
            list(b.list(""))
        assert "s3://bucket/s:" in str(e.value) and "endpoint" in str(e.value.hint) and not e.value.retryable
        with pytest.raises(StorageIOError, match="s3://bucket/s/objects:"):
            b.list_all("objects", 100)
        with pytest.raises(FileNotFoundError):
            b.read("ckpt-store.json")  # (an object: its 404 is a missing object, as on S3)


@pytest.mark.parametrize("env, opts, says", [
    ({"AWS_PROFILE": "no-such-profile"}, {}, "no-such-profile"),
    ({"AWS_CONFIG_FILE": "GARBAGE"}, {}, "parse config file"),
    ({"AWS_SHARED_CREDENTIALS_FILE": "GARBAGE"}, {}, "parse config file"),
    ({}, {"profile": "no-such-profile"}, "no-such-profile"),
    ({}, {"key": "only-a-key"}, "missing: aws_secret_access_key"),
    ({}, {"config_kwargs": {"retries": 3}}, "bad storage options"),
])
def test_a_broken_aws_configuration_is_a_clear_error(env, opts, says, tmp_path, monkeypatch):
    """A profile that does not exist (AWS_PROFILE, --storage-option profile=), an AWS config or
    credentials file that does not parse, a key without its secret, config_kwargs.retries=3: each
    ended every command in a botocore traceback (ProfileNotFound, ConfigParseError,
    PartialCredentialsError, AttributeError) raised while the client was made."""
    garbage = tmp_path / "aws-config"
    garbage.write_bytes(b"\x00\xff not an ini file [[[\n= =\n")
    for k, v in env.items():
        monkeypatch.setenv(k, str(garbage) if v == "GARBAGE" else v)
    with pytest.raises(StorageIOError, match=says) as e:
        S3Backend("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:1", **opts}, retry=FAST)
    assert "s3://bucket/x" in str(e.value) and not e.value.retryable


@pytest.mark.parametrize("tail", ["/a//b", "/a/./b", "/a/../b", "/..", "/.", "/a\nb", "/a\x00b", "/a\x7fb"])
def test_a_prefix_that_servers_read_differently_is_refused(s3_server, tail):
    """S3 keys are not paths: SeaweedFS folds ``a//b`` into ``a/b`` and refuses ``.`` and ``..``
    segments, AWS and moto keep them as they are. A push to s3://b/a//b on SeaweedFS wrote its
    config and chunks under a/b/, then listed its own lock under a/b/ and failed ("vanished while
    it was held"), leaving chunks and a store without refs; ``.``, ``..`` and control characters
    ended in "400 Bad Request". Such a prefix is refused before any request, saying how to write it."""
    import ckpt
    from ckpt_store.storage.errors import StoreLocationError

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}{tail}"
    with pytest.raises(StoreLocationError, match="prefix") as e:
        ckpt.Store.init(url, storage_options=s3_server.options())
    assert "s3://" in str(e.value.hint)
    assert not list(open_backend(f"s3://{bucket}", storage_options=s3_server.options()).list(""))  # nothing written


@pytest.mark.parametrize("opts, says", [
    ({"anon": "maybe"}, "anon must be true or false"),
    ({"anon": "false"}, "anon must be true or false"),
    ({"key": 12345, "secret": "s" * 8}, "key must be text"),
    ({"key": "k" * 8, "secret": 100000.0}, "secret must be text"),
    ({"endpoint_url": 8333}, "endpoint_url must be text"),
])
def test_storage_options_of_the_wrong_type_are_refused(opts, says):
    """--storage-option values are JSON where they parse: anon=maybe (a typo) and anon="false" were
    truthy, so the store was read anonymously; secret=1e5 arrived as 100000.0 and key=12345 as a
    number, and the first request failed with "sequence item 0: expected str instance, int found"."""
    with pytest.raises(StorageIOError, match=says) as e:
        S3Backend("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:1", **opts}, retry=FAST)
    assert "100000" not in str(e.value) and "12345" not in str(e.value)  # a credential's value is never shown
    assert S3Backend("s3://bucket/x", {"anon": True}).client.meta.config.signature_version is not None


@pytest.mark.parametrize("inner", ["refs/m/inner", "objects/x", "ckpt-store.json", "a/b/c"])
def test_a_store_is_not_created_inside_another_on_s3(s3_server, inner, tmp_path):
    """As on a local disk, a store cannot hold another: `ckpt push FILE n --store s3://b/team/refs/m/x`
    created a store whose objects the outer one read as its own (a ref "m/x/refs/n" that names no
    checkpoint: every `ls`, `verify` and `gc` of the team's store failed until someone removed keys
    by hand). Creating one anywhere below a store's prefix is refused; nothing is written."""
    import ckpt
    from ckpt_store.storage.errors import StoreLocationError

    where = s3_server.new_bucket()
    outer = ckpt.Store.init(f"s3://{where}/team", storage_options=s3_server.options())
    src = tmp_path / "w.safetensors"
    _save_small(src)
    outer.push(str(src), "m")
    before = sorted(e.path for e in outer.backend.list(""))
    with pytest.raises(StoreLocationError, match=f"inside the store at s3://{where}/team"):
        ckpt.Store.init(f"s3://{where}/team/{inner}", storage_options=s3_server.options())
    assert sorted(e.path for e in outer.backend.list("")) == before
    listing = outer.ls()
    assert [r.name for r in listing.refs] == ["m"] and not listing.damaged and outer.verify().ok
    ckpt.Store.init(f"s3://{where}/elsewhere", storage_options=s3_server.options())  # a sibling is fine


def test_a_store_is_not_created_at_a_prefix_that_is_an_object(s3_server, tmp_path):
    """`--store s3://b/models/w.safetensors` naming an object (a file someone uploaded): push and init
    made a store under "models/w.safetensors/", beside the object, where a local path that is a file
    is refused ("is a file, not a store directory"). Refused alike, nothing written; a store that
    already lives at such a prefix still opens."""
    import ckpt
    from ckpt_store.storage.errors import StoreLocationError

    where = s3_server.new_bucket()
    top = open_backend(f"s3://{where}", storage_options=s3_server.options())
    top.write("models/w.safetensors", b"a file")
    with pytest.raises(StoreLocationError, match="is an object"):
        ckpt.Store.init(f"s3://{where}/models/w.safetensors", storage_options=s3_server.options())
    assert [e.path for e in top.list("")] == ["models/w.safetensors"]
    config = ckpt.Store.init(f"s3://{where}/other", storage_options=s3_server.options()).backend.read("ckpt-store.json")
    top.write("s", b"an object")
    top.write("s/ckpt-store.json", config)  # a store made beside an object before this check
    for connect in (ckpt.Store.open, ckpt.Store.init):
        connect(f"s3://{where}/s", storage_options=s3_server.options())


def test_prefixes_a_user_may_not_look_at_hold_no_store_for_them():
    """A user allowed only below their own prefix is denied the HEADs above it: that is no store
    around theirs (refusing would keep them from creating any store)."""
    from s3support import web_server

    with web_server(403) as url:
        b = S3Backend("s3://bucket/team/me", {"endpoint_url": url, "key": "k", "secret": "s"}, retry=FAST)
        assert b.outer_store("ckpt-store.json") is None and not b.root_is_object()


def _save_small(path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.arange(64, dtype=np.float32)}, str(path))


def test_missing_store_on_s3(s3_main_url):
    import ckpt
    from ckpt.errors import StoreNotFoundError

    with pytest.raises(StoreNotFoundError, match="ckpt init"):
        ckpt.Store.open(s3_main_url)


def test_conditional_writes_off_still_creates_once(s3_main_url):
    b = S3Backend(s3_main_url, conditional_writes=False)
    assert b.create_exclusive("r/1", b"one")
    assert not b.create_exclusive("r/1", b"two")
    assert b.read("r/1") == b"one"


# -- secrets -----------------------------------------------------------------------------


def test_secret_never_in_errors(s3_main, caplog):
    """A bad endpoint with credentials in the options and the environment: the error names the
    endpoint and what failed, never the secret."""
    import logging

    caplog.set_level(logging.DEBUG)
    opts = {"key": KEY, "secret": SECRET, "endpoint_url": "http://127.0.0.1:1"}
    b = S3Backend("s3://bucket/x", opts, retry=FAST)
    with pytest.raises(StorageIOError) as e:
        b.read("ckpt-store.json")
    msg = str(e.value)
    assert "failed 4 times" in msg and "127.0.0.1:1" in msg and e.value.retryable
    assert SECRET not in msg and SECRET not in repr(e.value)
    assert SECRET not in caplog.text


def test_wrong_secret_is_access_denied_not_retried(s3_server):
    if not s3_server.checks_signatures:
        pytest.skip(f"{s3_server.kind} does not check signatures")
    bucket = s3_server.new_bucket()
    bad = "Wrong-secret-Z9z9z9"
    b = S3Backend(f"s3://{bucket}/x", {"key": KEY, "secret": bad, "endpoint_url": s3_server.endpoint}, retry=FAST)
    t = time.monotonic()
    with pytest.raises(StorageIOError, match="access denied") as e:
        b.write("a", b"1")
    assert time.monotonic() - t < 5 and not e.value.retryable
    assert bad not in str(e.value)


# -- faults ------------------------------------------------------------------------------


@pytest.fixture
def faulty(proxy, s3_main):
    """An S3 backend that talks to the server through the fault proxy, with quick retries."""
    bucket = s3_main.new_bucket()
    return S3Backend(f"s3://{bucket}/store", s3_main.options(endpoint=proxy.endpoint), retry=FAST)


def test_lost_success_response_of_a_create_is_recognised(faulty, proxy):
    """The PUT lands, its 200 is reset on the way back, the retry gets 412: still our create."""
    proxy.reset_dir, proxy.reset_match, proxy.reset_conns = "down", b"HTTP/1.1 200", 1
    assert faulty.create_exclusive("refs/x/0000000001.ref", b"mine-" + uuid.uuid4().hex.encode())
    assert proxy.resets_fired == 1
    # ...and someone else's entry under the same name is still told apart
    assert not faulty.create_exclusive("refs/x/0000000001.ref", b"theirs")


def test_ref_update_with_lost_response_writes_one_entry(faulty, proxy):
    refs = Refs(faulty)
    target = "a" * 64
    proxy.reset_dir, proxy.reset_match, proxy.reset_conns = "down", b"HTTP/1.1 200", 1
    refs.set("run/latest", target)
    proxy.clear()
    history = refs.history("run/latest")
    assert [(e.seq, e.target) for e in history] == [(1, target)]  # not two entries, not a conflict


def test_reset_mid_upload_is_retried(faulty, proxy):
    data = os.urandom(3 * 1024 * 1024)
    proxy.reset_dir, proxy.reset_after, proxy.reset_conns = "up", 1024 * 1024, 1
    faulty.write("objects/big", data)
    assert proxy.resets_fired == 1
    proxy.clear()
    assert faulty.read("objects/big") == data


def test_reset_mid_download_is_retried(faulty, proxy):
    data = os.urandom(3 * 1024 * 1024)
    faulty.write("objects/big", data)
    proxy.drop_all()
    proxy.reset_dir, proxy.reset_after, proxy.reset_conns = "down", 512 * 1024, 2
    assert faulty.read("objects/big") == data
    assert proxy.resets_fired == 2


def test_reads_into_a_buffer_survive_resets_and_keep_their_connection(faulty, proxy, s3_main):
    """Bodies read off the socket straight into the caller's buffer (not through urllib3's
    copies): a reset mid-body is retried, whole bodies leave the connection for the next GET."""
    data = os.urandom(3 * 1024 * 1024)
    faulty.write("objects/big", data)
    proxy.drop_all()
    proxy.reset_dir, proxy.reset_after, proxy.reset_conns = "down", 512 * 1024, 2
    buf = bytearray(len(data))
    assert faulty.read_into("objects/big", 0, memoryview(buf)) == len(data)
    assert proxy.resets_fired == 2 and buf == data
    proxy.reset_conns = 1
    got = bytearray(len(data))
    head = faulty.read_split("objects/big", 100, lambda first, n: memoryview(got)[len(first):n])
    assert proxy.resets_fired == 3 and head + got[100:] == data
    proxy.clear()
    before = proxy.connections
    for start in (0, 1, 4096):
        buf = bytearray(len(data) - start)
        faulty.read_into("objects/big", start, memoryview(buf))
        assert buf == data[start:]
    if s3_main.kind == "seaweedfs":  # moto's server closes every connection after its response
        assert proxy.connections == before  # each body was read to its end and its connection pooled


def test_delays_are_tolerated(faulty, proxy):
    proxy.delay_s = 0.02
    faulty.write("a", b"1")
    assert faulty.read("a") == b"1" and faulty.exists("a")


def test_retries_run_out_with_a_clear_error(faulty, proxy):
    faulty.write("a", b"1")
    proxy.refuse = True
    proxy.drop_all()
    t = time.monotonic()
    with pytest.raises(StorageIOError) as e:
        faulty.read("a")
    assert time.monotonic() - t < 10
    assert e.value.retryable and "failed 4 times" in str(e.value) and "retry" in str(e.value)
    proxy.clear()
    assert faulty.read("a") == b"1"  # nothing was lost


def test_push_and_pull_through_a_flaky_connection(s3_main, proxy, tmp_path):
    """A whole push and pull while connections keep being reset: the result is bit-identical."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    import ckpt

    src = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(512, 1024), "b": torch.randn(300)}, str(src))
    settings = ckpt.Settings.from_env(chunk_size=256 * 1024, retries=8, retry_delay=0.01)
    store = ckpt.Store.init(f"s3://{s3_main.new_bucket()}/s", storage_options=s3_main.options(endpoint=proxy.endpoint),
                            settings=settings)
    proxy.reset_dir, proxy.reset_after, proxy.reset_conns = "up", 100 * 1024, 3
    store.push(str(src), "m/x")
    proxy.reset_dir, proxy.reset_after, proxy.reset_conns = "down", 64 * 1024, 3
    store.pull("m/x", str(tmp_path / "out.safetensors"))
    assert proxy.resets_fired == 6
    proxy.clear()
    assert (tmp_path / "out.safetensors").read_bytes() == src.read_bytes()
    assert store.verify().ok


def test_a_response_checksum_asked_for_is_still_checked(s3_main):
    """With response checksums on (config_kwargs), bodies go through botocore, which checks them."""
    bucket = s3_main.new_bucket()
    on = S3Backend(f"s3://{bucket}/store", s3_main.options(config_kwargs={
        "response_checksum_validation": "when_supported", "request_checksum_calculation": "when_supported"}))
    data = os.urandom(300 * 1024)
    on.write("x", data)
    body, _, _ = on._get("x")
    body.close()
    assert type(body).__name__ == "StreamingChecksumBody"  # the server returns a checksum botocore checks
    buf = bytearray(len(data))
    assert on.read_into("x", 0, memoryview(buf)) == len(data) and buf == data
    head = on.read_split("x", 64, lambda first, n: memoryview(buf)[len(first):n])
    assert head + buf[64:] == data
    assert on._direct.sent["GetObject"] == 0  # never directly: botocore learned to ask for a checksum, which direct GETs do not check


# -- direct GETs (storage/backends/s3_direct.py) ----------------------------------------------

# Keys that botocore must quote: the direct GETs quote and sign them the same way, or a
# server that checks signatures (SeaweedFS) refuses them.
AWKWARD = ["plain/key", "sp ace/ü-ñ+~/x", "odd/!$'()*,;=@&/y", "pct/%25/%2F/z"]


def test_gets_after_the_first_go_out_directly_signed_as_botocore_signs_them(s3_server, monkeypatch):
    bucket = s3_server.new_bucket()
    b = S3Backend(f"s3://{bucket}/store", s3_server.options(), retry=FAST)
    data = {k: os.urandom(70_000 + i) for i, k in enumerate(AWKWARD)}
    for k, v in data.items():
        b.write(k, v)
    through_client = []
    real = b.client.get_object
    monkeypatch.setattr(b.client, "get_object", lambda **kw: through_client.append(kw["Key"]) or real(**kw))
    assert b.read(AWKWARD[0]) == data[AWKWARD[0]]  # the first GET goes through botocore and teaches the rest
    assert through_client == [b._key(AWKWARD[0])] and b._direct.ready("GetObject")
    for k, v in data.items():
        assert b.read(k) == v
        assert b.read_range(k, 1000, 5000) == v[1000:6000]
        buf = bytearray(300)
        assert b.read_into(k, len(v) - 100, memoryview(buf)) == len(v) and buf[:100] == v[-100:]
        assert b.read_range(k, len(v) + 10, 5) == b""  # a range past the end: 416, nothing there
        reader = b.open_read(k)
        whole = bytearray(reader.size)
        assert reader.readinto(memoryview(whole)) == len(v) and whole == v
        reader.close()
    with pytest.raises(FileNotFoundError):
        b.read("no/such/object")  # refused directly, then asked of botocore: NoSuchKey
    assert through_client == [b._key(AWKWARD[0]), b._key("no/such/object")]
    assert b._direct.ready("GetObject") and b._direct.sent["GetObject"] == 5 * len(AWKWARD) + 1


def test_a_direct_get_refused_where_botocore_succeeds_switches_direct_gets_off(s3_main, monkeypatch):
    bucket = s3_main.new_bucket()
    b = S3Backend(f"s3://{bucket}/store", s3_main.options(), retry=FAST)
    b.write("a", b"1" * 1000)
    b.write("b", b"2" * 1000)
    assert b.read("a") == b"1" * 1000 and b._direct.ready("GetObject")
    how = b._direct._learned["GetObject"]
    b._direct._learned["GetObject"] = how._replace(url=how.url.replace(bucket.split("/")[0], "no-such-bucket-" + uuid.uuid4().hex[:8], 1))
    assert b.read("b") == b"2" * 1000  # refused directly (no such bucket), answered through botocore
    sent = b._direct.sent["GetObject"]
    assert not b._direct.ready("GetObject")
    assert b.read("a") == b"1" * 1000 and b._direct.sent["GetObject"] == sent  # from now on, every GET through botocore


def test_a_throttled_direct_request_is_retried_directly(faulty, proxy, monkeypatch):
    """503 SlowDown on a direct GET: retried with backoff, directly again; not a reason to
    leave direct GETs (the server refused nothing it would have served through botocore)."""
    data = os.urandom(100_000)
    faulty.write("objects/x", data)
    assert faulty.read("objects/x") == data and faulty._direct.ready("GetObject")  # learned
    through_client = []
    real = faulty.client.get_object
    monkeypatch.setattr(faulty.client, "get_object", lambda **kw: through_client.append(kw["Key"]) or real(**kw))
    sent = faulty._direct.sent["GetObject"]
    proxy.busy = 2
    assert faulty.read("objects/x") == data
    assert proxy.busy == 0 and faulty._direct.sent["GetObject"] == sent + 3 and through_client == [] and faulty._direct.ready("GetObject")
    proxy.busy = 10  # more than the retries: a clear, retryable error that names the throttling
    with pytest.raises(StorageIOError, match="SlowDown") as e:
        faulty.read("objects/x")
    assert e.value.retryable and faulty._direct.ready("GetObject")
    proxy.busy = 0
    assert [e.path for e in faulty.list("objects")] == ["objects/x"] and faulty._direct.ready("ListObjectsV2")
    listed = faulty._direct.sent["ListObjectsV2"]
    proxy.busy = 1  # LISTs too: retried, directly
    assert [e.path for e in faulty.list("objects")] == ["objects/x"]
    assert proxy.busy == 0 and faulty._direct.sent["ListObjectsV2"] == listed + 2


def _botocore_listing(b, prefix: str, delimiter: str = "") -> tuple[list, list]:
    """Every key (with size and time) and common prefix under ``prefix``, as botocore's own LIST reads them."""
    keys, prefixes, token = [], [], None
    while True:
        kw = {"Bucket": b.bucket, "Prefix": b._key(prefix), "Delimiter": delimiter, "MaxKeys": 2}
        page = b.client.list_objects_v2(**kw, **({"ContinuationToken": token} if token else {}))
        keys += [(o["Key"], o["Size"], o["LastModified"]) for o in page.get("Contents", [])]
        prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated"):
            return keys, prefixes


def test_the_first_listing_learns_from_a_one_key_page_and_sends_every_page_directly(s3_server, monkeypatch):
    """botocore reads a LIST answer at ~0.13 ms of CPU per key, and the first LIST of a backend went
    through it to teach direct requests: in a new process (the CLI) ``du`` and ``gc`` listed every
    object first, 1,000 keys a page, ~130 ms of CPU on that page alone. The request that teaches now
    asks for one key, and every page of the listing itself goes out directly."""
    bucket = s3_server.new_bucket()
    b = S3Backend(f"s3://{bucket}/store", s3_server.options(), retry=FAST)
    b.page_keys = 2
    for i in range(5):
        b.write(f"objects/k{i}", b"x")
    asked = []
    real = b.client.list_objects_v2
    monkeypatch.setattr(b.client, "list_objects_v2", lambda **kw: asked.append(kw.get("MaxKeys")) or real(**kw))
    assert sorted(e.path for e in b.list("objects")) == [f"objects/k{i}" for i in range(5)]
    assert asked == [1] and b._direct.sent["ListObjectsV2"] == 3  # its three pages of two keys, directly


def test_listings_after_the_first_go_out_directly_and_read_as_botocore_reads_them(s3_server, monkeypatch):
    bucket = s3_server.new_bucket()
    b = S3Backend(f"s3://{bucket}/store", s3_server.options(), retry=FAST)
    b.page_keys = 2  # several pages, each continued with the token of the one before
    names = [*AWKWARD, "d/a", "d/b", "d/e/f", "d/e/g", "dd/x"]
    for i, k in enumerate(names):
        b.write(k, b"x" * (i + 1))
    through_client = []
    real = b.client.list_objects_v2
    monkeypatch.setattr(b.client, "list_objects_v2", lambda **kw: through_client.append(kw["Prefix"]) or real(**kw))
    assert sorted(e.path for e in b.list("")) == sorted(names)  # the first page through botocore, the rest direct
    assert len(through_client) == 1 and b._direct.ready("ListObjectsV2")
    monkeypatch.setattr(b.client, "list_objects_v2", real)
    for prefix in ("", "d", "sp ace", "odd/!$'()*,;=@&", "pct/%25"):
        entries = list(b.list(prefix))
        keys, _ = _botocore_listing(b, prefix.rstrip("/") + "/" if prefix else "")
        assert [(b._key(e.path), e.size, e.mtime) for e in entries] == [(k, n, t.timestamp()) for k, n, t in keys]
    assert {e.path for e in b._list_keys("d", delimiter="/")} == {"d/a", "d/b"}
    assert b.list_all("d", 100) == {"d/a", "d/b", "d/e/f", "d/e/g"}
    assert b._direct.sent["ListObjectsV2"] > 10 and len(through_client) == 1


def test_a_list_answer_is_read_defensively():
    from ckpt_store.storage.backends.s3_direct import parse_list

    ns = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
    page = parse_list(f"""<?xml version="1.0" encoding="UTF-8"?><ListBucketResult {ns}><Name>b</Name>
        <EncodingType>url</EncodingType><IsTruncated>true</IsTruncated><NextContinuationToken>t+1</NextContinuationToken>
        <Contents><Key>a%20b/c%2Bd+e</Key><LastModified>2026-12-05T01:02:03.456Z</LastModified><Size>7</Size></Contents>
        <CommonPrefixes><Prefix>p%2F/</Prefix></CommonPrefixes></ListBucketResult>""".encode())
    assert page["IsTruncated"] and page["NextContinuationToken"] == "t+1"
    (entry,) = page["Contents"]
    assert entry["Key"] == "a b/c+d e" and entry["Size"] == 7 and entry["LastModified"].timestamp() == 1796432523.456
    assert page["CommonPrefixes"] == [{"Prefix": "p//"}]
    for bad in (b"not xml", b"<Error><Code>x</Code></Error>",
                f"<ListBucketResult {ns}><Contents><Size>1</Size></Contents></ListBucketResult>".encode(),
                f"<ListBucketResult {ns}><Contents><Key>k</Key><Size>huge</Size></Contents></ListBucketResult>".encode()):
        with pytest.raises(ValueError):
            parse_list(bad)


def test_puts_after_the_first_go_out_directly_their_payload_signed(s3_server, monkeypatch):
    """SeaweedFS checks a PUT's signature (a direct PUT signed wrongly is refused), though not
    its payload hash: that is checked here, against the bytes sent."""
    import hashlib

    bucket = s3_server.new_bucket()
    b = S3Backend(f"s3://{bucket}/store", s3_server.options(), retry=FAST)
    through_client = []
    real = b.client.put_object
    monkeypatch.setattr(b.client, "put_object", lambda **kw: through_client.append(kw["Key"]) or real(**kw))
    sent = []
    http = b._direct._http

    class Recording:
        def send(self, request):
            sent.append(request)
            return http.send(request)

    b._direct._http = Recording()
    data = {k: os.urandom(50_000 + i) for i, k in enumerate(AWKWARD)}
    for k, v in data.items():
        b.write(k, (v[:1000], memoryview(v)[1000:]))  # Data: a tuple of buffers
    assert through_client == [b._key(AWKWARD[0])] and b._direct.sent["PutObject"] == len(AWKWARD) - 1
    assert [r.headers["X-Amz-Content-SHA256"] for r in sent] == [hashlib.sha256(v).hexdigest() for v in list(data.values())[1:]]
    # a conditional create (a new chunk, a ref entry) goes directly too, its 412 read here
    assert b.create_exclusive("refs/r/0000000001.ref", b"mine")
    assert not b.create_exclusive("refs/r/0000000001.ref", b"theirs")
    assert b.read("refs/r/0000000001.ref") == b"mine"
    assert through_client == [b._key(AWKWARD[0])] and b._direct.sent["PutObject"] == len(AWKWARD) + 1
    puts = [r for r in sent if r.method == "PUT"]
    assert [r.headers.get("If-None-Match") for r in puts] == [None] * (len(AWKWARD) - 1) + ["*", "*"]
    for k, v in data.items():  # read back through botocore itself
        assert b.client.get_object(Bucket=b.bucket, Key=b._key(k))["Body"].read() == v


def test_a_throttled_direct_put_is_retried(faulty, proxy):
    faulty.write("objects/a", b"1" * 1000)
    assert faulty._direct.ready("PutObject")
    proxy.busy_method, proxy.busy = b"PUT", 2
    data = os.urandom(200_000)
    faulty.write("objects/b", data)
    assert proxy.busy == 0 and faulty._direct.ready("PutObject") and faulty.read("objects/b") == data


def test_direct_requests_can_be_switched_off(s3_main_url, monkeypatch):
    import ckpt

    monkeypatch.setenv("CKPT_S3_DIRECT", "0")
    store = ckpt.Store.init(s3_main_url)
    w = __import__("torch").arange(10.0)
    store.push({"w": w}, "m")
    assert not store.backend._direct.on and store.load("m")["w"].numpy().tobytes() == w.numpy().tobytes()
    monkeypatch.delenv("CKPT_S3_DIRECT")
    on = ckpt.Store.open(s3_main_url)
    assert on.load("m")["w"].numpy().tobytes() == w.numpy().tobytes() and on.backend._direct.sent["GetObject"] > 0


def test_heads_after_the_first_go_out_directly_and_a_404_is_an_answer(s3_server, monkeypatch):
    """Most HEADs ask about chunks a push is about to write: a missing object is answered
    directly, not asked again through botocore."""
    bucket = s3_server.new_bucket()
    b = S3Backend(f"s3://{bucket}/store", s3_server.options(), retry=FAST)
    for k in AWKWARD:
        b.write(k, b"x" * 1234)
    through_client = []
    real = b.client.head_object
    monkeypatch.setattr(b.client, "head_object", lambda **kw: through_client.append(kw["Key"]) or real(**kw))
    assert b.exists(AWKWARD[0]) and b._direct.ready("HeadObject")  # learned from botocore's
    for k in AWKWARD:
        assert b.exists(k) and b.size(k) == 1234
        assert b.mtime(k) == real(Bucket=b.bucket, Key=b._key(k))["LastModified"].timestamp()
        assert not b.exists(k + ".missing")
    assert through_client == [b._key(AWKWARD[0])] and b._direct.sent["HeadObject"] == 4 * len(AWKWARD)
    with pytest.raises(FileNotFoundError):
        b.size("no/such/object")


@pytest.mark.parametrize("direct", [True, False])
def test_the_servers_clock_is_read_without_a_write_through_the_client_and_directly(s3_server, direct):
    """A gc --dry-run writes nothing, so it cannot stamp a marker to learn the server's time: it
    reads the Date of a HEAD's answer (200 or 404), the clock that stamps LastModified."""
    b = S3Backend(f"s3://{s3_server.new_bucket()}/store", s3_server.options(), retry=FAST, direct=direct)
    b.write("there", b"x")
    times = [b.clock("there")]  # through the client, which teaches the direct path HEADs
    stamped = b.mtime("there")
    times += [b.clock(path) for path in ("missing", "there", "missing")]
    assert all(stamped - 1 <= t <= time.time() + 1 for t in times), (stamped, times)  # (whole seconds; server here)
    assert b._direct.sent["HeadObject"] == (4 if direct else 0)
    assert [e.path for e in b.list("")] == ["there"]  # nothing written


def test_a_botocore_without_the_insides_direct_requests_use_falls_back_to_the_client():
    from ckpt_store.storage.backends.s3 import _direct_requests
    from ckpt_store.storage.backends.s3_direct import ClientOnly

    class Client:  # a client of another botocore: no _endpoint, no _request_signer
        pass

    assert isinstance(_direct_requests(Client(), True), ClientOnly)
    assert _direct_requests(Client(), True).call("GetObject", "k", lambda: 1 / 0, (200,), lambda: "answer") == (None, "answer")


def test_a_listing_is_checked_like_any_outside_data(s3_main_url, monkeypatch):
    """What a LIST answers is the server's word (a proxy, a broken server): keys outside the
    store's prefix, or with ``..`` in them, are not the store's objects (a server ignoring the
    prefix made a push take another store's chunks for its own); a continuation token given
    twice ends in an error (the listing went on forever, growing memory)."""
    import datetime

    backend = open_backend(s3_main_url)
    backend.write("objects/chunks/aa/" + "a" * 64, b"x")
    real = backend._list_page
    when = datetime.datetime.now(datetime.timezone.utc)

    def foreign(prefix, token, delimiter, *rest):
        page = real(prefix, token, delimiter, *rest)
        other = backend.prefix.replace("store", "other") if backend.prefix else "other"
        page["Contents"] = [*page.get("Contents", []),
                            {"Key": f"{other}/objects/chunks/bb/{'b' * 64}", "Size": 1, "LastModified": when},
                            {"Key": f"{prefix}../../x/y", "Size": 1, "LastModified": when}]
        return page

    monkeypatch.setattr(backend, "_list_page", foreign)
    assert [e.path for e in backend.list("objects")] == ["objects/chunks/aa/" + "a" * 64]
    assert backend.list_all("objects", 10_000) == {"objects/chunks/aa/" + "a" * 64}
    pages = []

    def endless(prefix, token, delimiter, *rest):
        pages.append(token)
        return {"Contents": [], "IsTruncated": True, "NextContinuationToken": "again"}

    monkeypatch.setattr(backend, "_list_page", endless)
    with pytest.raises(StorageIOError, match="never end"):
        list(backend.list("objects"))
    assert len(pages) == 2


def test_children_from_a_server_that_ignores_the_delimiter_are_the_same(s3_main_url, monkeypatch):
    """``children`` asks for the names directly below a folder (the "/" delimiter): a server that
    ignores it lists every key below, and a name with keys below it is still a folder, not left out
    (a folder in place of a ref's newest entry is damage that must be seen: storage/refs.py)."""
    backend = open_backend(s3_main_url)
    for p in ("d/01", "d/02/x", "d/03", "d/03/y/z", "d/04"):
        backend.write(p, b"x")
    want = [("01", True), ("02", False), ("03", False), ("04", True)]
    assert [n for page, _ in backend.children("d") for n in page] == want
    real = backend._list_page
    monkeypatch.setattr(backend, "_list_page", lambda prefix, token, delimiter, *rest: real(prefix, token, "", *rest))
    assert [n for page, _ in backend.children("d") for n in page] == want


@pytest.mark.parametrize("length, content_range", [(None, None), ("12", "bytes 0-11/garbage"), ("x", None), ("-5", None)])
def test_a_get_answer_without_usable_sizes_is_a_clear_error(length, content_range):
    """A GET answered with chunked encoding (no Content-Length) or a Content-Range that is not
    numbers ended in "cannot read ...: 'content-length'" or int()'s message."""
    from ckpt_store.storage.backends.s3_reads import _sizes

    with pytest.raises(StorageIOError, match="usable Content-Length|negative size"):
        _sizes("objects/chunks/aa/x", length, content_range)
    assert _sizes("p", "12", "bytes 0-11/40") == (12, 40) and _sizes("p", 7, None) == (7, 7)


class _Server:
    """An HTTP server on a real loopback socket that answers request *n* (counted from 1) with
    ``answer(n)``: None never answers (the connection stays open, silent); else (status line and
    headers, the body bytes to send, whether to stall after them instead of going on)."""

    def __init__(self, answer):
        import socket
        import threading

        self.answer, self.requests, self.connections, self._held = answer, 0, 0, []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import threading

        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            self._held.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        data = b""
        try:
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                data = data.partition(b"\r\n\r\n")[2]  # (no request here has a body)
                self.requests += 1
                reply = self.answer(self.requests)
                if reply is None:
                    return  # silent: held open until close()
                head, body, stall = reply
                conn.sendall(head + body)
                if stall:
                    return
        except OSError:
            return

    def close(self):
        self._sock.close()
        for c in self._held:
            c.close()


def _backend(server, deadline, **config):
    opts = {"endpoint_url": server.url, "key": "k", "secret": "s", "config_kwargs": config}
    return S3Backend("s3://bucket/x", opts, retry=RetryPolicy(attempts=6, base_delay=0.01, max_delay=0.05, deadline=deadline))


def test_a_server_that_never_answers_fails_a_request_at_its_deadline_not_after_every_retry():
    """An endpoint that accepts connections and never answers held `ckpt ls` for its six attempts of
    a 60 s read timeout each (about 6 minutes). A request now fails once it has gone its deadline
    (CKPT_REQUEST_DEADLINE) without an answer, saying so; the read timeout defaults to no more than
    the deadline."""
    server = _Server(lambda n: None)
    try:
        b = _backend(server, 1.0, read_timeout=1, connect_timeout=1)
        # (the seconds it says are those it waited: 1 s of read timeout, more on a busy machine; one attempt)
        with pytest.raises(StorageIOError, match="no answer in [0-9]+ s \\(1 attempt\\)") as e:
            b.exists("objects/x")
        assert e.value.retryable and "CKPT_REQUEST_DEADLINE" in str(e.value.hint)
        assert server.connections == 1  # not one per retry
        assert _backend(server, 5.0).client.meta.config.read_timeout == 5.0
        assert _backend(server, None).client.meta.config.read_timeout == 60
        from ckpt.settings import Settings
        from ckpt.store.store import remote_options

        assert remote_options(Settings(request_deadline=7.0))["retry"].deadline == 7.0  # CKPT_REQUEST_DEADLINE
    finally:
        server.close()


@pytest.mark.parametrize("how", ["read", "read_into"])
def test_an_answer_that_stalls_midway_is_retried_past_the_deadline(how):
    """The deadline counts attempts that got nothing: a GET whose answer began and then stalled (a
    connection dropped mid-body) made progress, and is retried as before, however long it took."""
    body = bytes(range(256)) * 64

    def answer(n):
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                b"Content-Length: %d\r\nLast-Modified: Sun, 06 Dec 2026 00:00:00 GMT\r\nETag: \"e\"\r\n\r\n" % len(body))
        return (head, body[:1000], True) if n <= 2 else (head, body, False)

    server = _Server(answer)
    try:
        b = _backend(server, 1.0)
        if how == "read":
            assert b.read("objects/x") == body
        else:
            buf = bytearray(len(body))
            assert b.read_into("objects/x", 0, memoryview(buf)) == len(body) and bytes(buf) == body
        assert server.requests == 3
    finally:
        server.close()
