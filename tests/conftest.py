from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator

import pytest

# Nothing in the tests may reach an address other than 127.0.0.1: no instance-metadata
# lookups for credentials, no AWS config or credentials from the developer's home.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["AWS_CONFIG_FILE"] = os.devnull
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
for _var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
    os.environ.pop(_var, None)
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# An S3 call made without a test server's endpoint fails here, at once, instead of
# looking for AWS (port 9 is "discard": nothing listens on it).
os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"

# S3 servers the S3 conformance tests run on: moto by default; CI adds seaweedfs
# (S3_TEST_SERVERS=moto,seaweedfs) when its binary is installed. Heavier S3 tests
# (CLI, concurrency, faults) use the first one only.
from s3support import S3_SERVERS  # noqa: E402  (tests/ is on sys.path: this file's folder)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run only when asked for (``-m slow``, or CKPT_SLOW_TESTS=1)."""
    if config.getoption("markexpr") or os.environ.get("CKPT_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


class UnexpectedErrors(logging.Handler):
    """Records of an error caught where it must not stop training but of a type no failure there raises (a bug:
    ``ckpt.snapshot.tiers.caught`` logs it with its traceback, marked ``unexpected``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "unexpected", False):
            self.records.append(record)


@pytest.fixture(autouse=True)
def unexpected_errors() -> Iterator[UnexpectedErrors]:
    """Fails a test in which ckpt caught and logged an unexpected error (a refill beside training swallows every
    error: a TypeError there would else pass as a one-line warning). A test that causes one on purpose empties
    ``records`` once it has checked them."""
    handler, logger = UnexpectedErrors(), logging.getLogger("ckpt")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
    if handler.records:
        pytest.fail("unexpected error(s) caught and logged:\n" + "\n".join(map(handler.format, handler.records)), pytrace=False)


class S3Servers:
    """S3 test servers by kind, each started on first use and stopped (by PID) at session end."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.running: dict[str, object] = {}

    def get(self, kind: str) -> object:
        if kind not in self.running:
            pytest.importorskip("s3fs")
            pytest.importorskip("moto" if kind == "moto" else "boto3")
            from s3support import start_server

            self.running[kind] = start_server(kind, self.factory.mktemp(f"s3-{kind}"))
        return self.running[kind]

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()  # type: ignore[attr-defined]


@pytest.fixture
def advised(monkeypatch) -> list[int]:
    """The lengths ckpt's local reads and chunk decodes ask the kernel to fault in (``madvise``) from here on;
    skips the test where there is no madvise."""
    from ckpt_store.storage.backends import local_reads

    real = local_reads._madvise()
    if real is None:
        pytest.skip("no madvise here")
    calls: list[int] = []

    def counting(addr: int, n: int, advice: int) -> int:
        calls.append(n)
        return real(addr, n, advice)

    monkeypatch.setattr(local_reads, "_madvise", lambda: counting)
    return calls


@pytest.fixture(scope="session", autouse=True)
def _chunk_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Remote stores cache chunks locally (storage/cache.py): in a temporary directory, never the user's."""
    old = os.environ.get("CKPT_CACHE_DIR")
    os.environ["CKPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("chunk-cache"))
    yield
    if old is None:
        os.environ.pop("CKPT_CACHE_DIR", None)
    else:
        os.environ["CKPT_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def s3_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Servers]:
    servers = S3Servers(tmp_path_factory)
    try:
        yield servers
    finally:
        servers.stop()


def new_s3_store_url(servers: S3Servers, kind: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<fresh bucket>/store`` on server ``kind``; credentials and endpoint the standard
    way, in AWS environment variables."""
    from s3support import KEY, SECRET

    server = servers.get(kind)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)  # type: ignore[attr-defined]
    monkeypatch.setenv("CKPT_RETRY_DELAY", "0.02")  # failures in tests should be quick
    return f"s3://{server.new_bucket()}/store"  # type: ignore[attr-defined]


@pytest.fixture(params=S3_SERVERS)
def s3_server(request: pytest.FixtureRequest, s3_servers: S3Servers) -> object:
    """Each S3 server in S3_TEST_SERVERS."""
    return s3_servers.get(request.param)


@pytest.fixture
def s3_url(request: pytest.FixtureRequest, s3_server: object, s3_servers: S3Servers, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh S3 store URL on each server in S3_TEST_SERVERS (credentials in the environment)."""
    return new_s3_store_url(s3_servers, s3_server.kind, monkeypatch)  # type: ignore[attr-defined]


@pytest.fixture
def s3_main(s3_servers: S3Servers) -> object:
    """The first S3 test server only, for the heavier tests."""
    return s3_servers.get(S3_SERVERS[0])


@pytest.fixture
def s3_main_url(s3_servers: S3Servers, monkeypatch: pytest.MonkeyPatch) -> str:
    return new_s3_store_url(s3_servers, S3_SERVERS[0], monkeypatch)


@pytest.fixture
def proxy(s3_main: object) -> Iterator[object]:
    """A :class:`s3support.FaultProxy` in front of the first S3 test server (faults injected per test)."""
    from s3support import FaultProxy

    host, port = s3_main.endpoint.removeprefix("http://").split(":")  # type: ignore[attr-defined]
    p = FaultProxy((host, int(port))).start()
    yield p
    p.stop()


BACKENDS = ["local", "memory", *(f"s3-{k}" for k in S3_SERVERS)]


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh store URL on each backend the conformance tests cover."""
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param.startswith("s3-"):
        return new_s3_store_url(request.getfixturevalue("s3_servers"), request.param[3:],
                                request.getfixturevalue("monkeypatch"))
    return f"memory://ckpt-test-{uuid.uuid4().hex}"


@pytest.fixture
def store(tmp_path):
    import ckpt

    return ckpt.Store.init(str(tmp_path / "store"))


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one thread; on a busy machine more threads spin (100x slower here)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tmpfs() -> Iterator[Callable[[os.PathLike[str] | str, str], str]]:
    """Mount a real tmpfs: ``tmpfs(path, "1m")`` (created if need be), unmounted after the test; a
    store on it fills up with ENOSPC. Skips the test where this process may not mount."""
    import subprocess

    mounted: list[str] = []

    def mount(path: os.PathLike[str] | str, size: str) -> str:
        os.makedirs(path, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"ckpt-test-{uuid.uuid4().hex[:8]}", str(path)],
                           capture_output=True, text=True, check=False)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(str(path))
        return str(path)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", path], check=False)


class ServiceError(Exception):
    """An error type a filesystem library defines itself (gcsfs's HttpError, Azure's HttpResponseError for adlfs)."""


@pytest.fixture
def failing_fs() -> Iterator[type]:
    """A real fsspec filesystem under ``ckpt-test-failing://`` (fsspec's memory filesystem, files of its own) whose
    calls the store makes raise its class's ``raising`` once that is set (``ServiceError(...)``, say)."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class FailingFileSystem(MemoryFileSystem):
        protocol = "ckpt-test-failing"
        store: dict = {}  # noqa: RUF012 - (fsspec's layout: its files, by path, for the process)
        pseudo_dirs = [""]  # noqa: RUF012
        raising: Exception | None = None
        only: str | None = None  # a pattern: only calls on the paths it matches (re.search) raise

        def _fail(self, path: object = "") -> None:
            if FailingFileSystem.raising is not None and (self.only is None or re.search(self.only, str(path))):
                raise FailingFileSystem.raising

    def failing(name: str):
        def call(self, *args, **kwargs):
            self._fail(args[0] if args else "")
            return getattr(MemoryFileSystem, name)(self, *args, **kwargs)

        return call

    for name in ("cat_file", "pipe_file", "exists", "isfile", "size", "modified", "find", "rm_file"):  # the store's calls
        setattr(FailingFileSystem, name, failing(name))

    fsspec.register_implementation(FailingFileSystem.protocol, FailingFileSystem, clobber=True)
    yield FailingFileSystem
    FailingFileSystem.raising = FailingFileSystem.only = None
    FailingFileSystem.store.clear()


# Stores shared by the web view's API and browser tests (tests/cli/test_web_*.py; built once per session: they take seconds).
@pytest.fixture(scope="session")
def web_store(tmp_path_factory):
    from webstore import build

    return build(str(tmp_path_factory.mktemp("web") / "store"))


@pytest.fixture(scope="session")
def wide_store(tmp_path_factory):
    from webstore import build_wide

    return build_wide(str(tmp_path_factory.mktemp("wide") / "store"))
