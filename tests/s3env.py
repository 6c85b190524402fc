"""Real S3 on loopback for tests: moto's S3 server in a child process, and a fault-injecting proxy.

Why not mock boto3: the behaviour worth testing lives in the HTTP layer (connection reuse, ranged
reads, retries of 503s, bodies cut short, resets), and a mock replaces exactly that layer. So tests
talk real HTTP to moto's standalone server, directly or through `FaultProxy`, which injects
failures at a seeded, controllable rate and counts what the clients actually received.

Fixtures (`moto_server`, `fault_proxy`, `faults`, `s3_bucket`) are defined here and imported into
tests/conftest.py so that every test can use them.
"""

from __future__ import annotations

import functools
import http.client
import logging
import random
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import unquote, urlsplit
from xml.sax.saxutils import escape

import boto3
import pytest
from botocore.config import Config

log = logging.getLogger(__name__)

FAULT_KINDS = ("503", "500", "429", "delay", "reset", "truncate")

# kind -> (status, S3 error code, message). Distinct codes let a test tell the kinds apart from
# the ClientError alone; botocore retries all three statuses by default.
_ERROR_FAULTS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "429": (429, "TooManyRequests", "Too many requests."),
}

# Headers that describe one hop's connection, not the message; a proxy must not relay them.
# Expect is here because the proxy answers `Expect: 100-continue` itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)

_RELAY_CHUNK = 64 * 1024


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (another process could still take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs moto's CLI entry point (`python -m moto.server`) after starting a thread that exits the
# process as soon as its stdin reaches EOF. The parent holds the only write end of that pipe, and
# the kernel closes it however the parent dies (even SIGKILL), so the server cannot outlive it.
_MOTO_CHILD = """\
import os, sys, threading

def _exit_with_parent():
    while os.read(0, 4096):  # the raw fd: sys.stdin's lock would abort interpreter shutdown
        pass
    os._exit(0)

threading.Thread(target=_exit_with_parent, daemon=True).start()
from moto.server import main
main(sys.argv[1:])
"""


class MotoServer:
    """moto's standalone S3 server in a child process on a free loopback port.

    A child process rather than moto's in-process `ThreadedMotoServer`: the server then has its
    own interpreter and GIL, so a test that hogs the GIL or deadlocks cannot stall S3, and the
    clients see a genuinely separate server. Output goes to `log_path` (in `log_dir`, by default
    a fresh temporary directory that is kept for post-mortems), a file rather than a pipe that
    nobody drains and that would eventually block the server when full.
    """

    def __init__(self, log_dir: Path | None = None, startup_timeout: float = 30.0):
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="moto-"))
        self.log_path = log_dir / "moto.log"
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-u", "-c", _MOTO_CHILD, "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            self._wait_until_answering(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_until_answering(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}:\n{self.log()}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", "/")
                conn.getresponse().read()
                return  # any HTTP answer at all means it is serving
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server not answering:\n{self.log()}") from None
                time.sleep(0.05)
            finally:
                conn.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Terminate the server (kill it if it ignores SIGTERM for 10 s). Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._log.close()

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def s3_client(endpoint: str, **config_kwargs: Any) -> Any:
    """A boto3 S3 client for `endpoint` with dummy credentials and path-style addressing.

    Path-style because virtual-hosted style would put the bucket into the host name, which does
    not resolve on loopback. `config_kwargs` go to botocore's `Config`, e.g.
    `retries={"total_max_attempts": 1}` or `read_timeout=2`; an `s3` dict is merged with the
    path-style setting.
    """
    s3_options = {"addressing_style": "path", **config_kwargs.pop("s3", {})}
    with _SESSION_LOCK:
        return _session().client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(s3=s3_options, **config_kwargs),
        )


# One session for all clients: a fresh session loads botocore's service model again (~100 ms a
# client instead of ~15 ms). Sessions are not thread-safe, hence the lock; clients are.
_SESSION_LOCK = threading.Lock()


@functools.cache
def _session() -> boto3.session.Session:
    return boto3.session.Session()


class ProxyStats(TypedDict):
    """A snapshot of what a `FaultProxy` saw. Paths are URL paths, unquoted, without the query."""

    requests: Counter[str]  # requests received, by HTTP method
    gets: Counter[str]  # GET requests, by path
    bytes_sent: Counter[str]  # response body bytes written to clients (errors included), by path
    bytes_sent_total: int  # sum of bytes_sent
    faults: Counter[str]  # faults injected, by kind
    ranges: list[tuple[str, str]]  # (path, Range header) of each GET that had one, in order


def _empty_stats() -> ProxyStats:
    return ProxyStats(
        requests=Counter(),
        gets=Counter(),
        bytes_sent=Counter(),
        bytes_sent_total=0,
        faults=Counter(),
        ranges=[],
    )


@dataclass
class _FaultPlan:
    rate: float
    kinds: tuple[str, ...]
    rng: random.Random
    methods: frozenset[str]
    delay_seconds: float
    key_filter: str | None


@dataclass(frozen=True)
class _Fault:
    kind: str
    delay_seconds: float


class FaultProxy:
    """A threaded HTTP/1.1 reverse proxy on loopback that relays to `upstream` and injects faults.

    Clients use `.endpoint` as their endpoint_url. Client connections are kept alive across
    requests (botocore pools them) and each is served by its own thread; every request is relayed
    over a fresh upstream connection. Faults are off until `set_faults`.

    Fault kinds:
      "503", "500", "429": an S3-style XML error (codes SlowDown, InternalError, TooManyRequests)
          instead of forwarding; the connection stays usable.
      "delay": sleep `delay_seconds`, then forward normally.
      "reset": read the whole request, then close the socket with SO_LINGER 0 so the client gets
          a TCP reset instead of a response.
      "truncate": forward, send the status and headers with the true Content-Length but only the
          first half of the body, then close the connection. HEAD responses, having no body, are
          relayed intact.
    """

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self._plan: _FaultPlan | None = None
        self._stats = _empty_stats()
        self._connections: set[socket.socket] = set()
        self._stopped = False
        self._server = _ProxyServer(self)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"fault-proxy-{self.port}", daemon=True
        )
        self._thread.start()

    def set_faults(
        self,
        rate: float,
        kinds: tuple[str, ...],
        seed: int = 0,
        methods: tuple[str, ...] = ("GET",),
        delay_seconds: float = 0.5,
        key_filter: str | None = None,
    ) -> None:
        """Inject a fault into each eligible request with probability `rate`.

        A request is eligible if its method is in `methods` and, when `key_filter` is given, that
        string occurs in its (unquoted) path. For each eligible request, in arrival order, an RNG
        seeded with `seed` decides whether it gets a fault and then picks the kind uniformly from
        `kinds`. So a sequential client sees the same faults on every run.
        """
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        unknown = set(kinds) - set(FAULT_KINDS)
        if not kinds or unknown:
            raise ValueError(f"kinds must be a non-empty subset of {FAULT_KINDS}, got {kinds}")
        if delay_seconds < 0:
            raise ValueError(f"delay_seconds must be >= 0, got {delay_seconds}")
        plan = _FaultPlan(
            rate=rate,
            kinds=tuple(kinds),
            rng=random.Random(seed),
            methods=frozenset(m.upper() for m in methods),
            delay_seconds=delay_seconds,
            key_filter=key_filter,
        )
        with self._lock:
            self._plan = plan

    def clear_faults(self) -> None:
        with self._lock:
            self._plan = None

    def stats(self) -> ProxyStats:
        """A consistent copy of the counters; later traffic does not change it."""
        with self._lock:
            s = self._stats
            return ProxyStats(
                requests=Counter(s["requests"]),
                gets=Counter(s["gets"]),
                bytes_sent=Counter(s["bytes_sent"]),
                bytes_sent_total=s["bytes_sent_total"],
                faults=Counter(s["faults"]),
                ranges=list(s["ranges"]),
            )

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = _empty_stats()

    def stop(self) -> None:
        """Stop accepting, then shut down open client connections so that their threads end.

        Idempotent.
        """
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the client closed it meanwhile

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # Called from handler threads.

    def _on_request(self, method: str, path: str, range_header: str | None) -> _Fault | None:
        """Count the request and decide whether it gets a fault."""
        with self._lock:
            s = self._stats
            s["requests"][method] += 1
            if method == "GET":
                s["gets"][path] += 1
                if range_header is not None:
                    s["ranges"].append((path, range_header))
            plan = self._plan
            if (
                plan is None
                or method not in plan.methods
                or (plan.key_filter is not None and plan.key_filter not in path)
                or plan.rng.random() >= plan.rate
            ):
                return None
            kind = plan.rng.choice(plan.kinds)
            s["faults"][kind] += 1
            return _Fault(kind, plan.delay_seconds)

    def _on_sent(self, path: str, n: int) -> None:
        with self._lock:
            self._stats["bytes_sent"][path] += n
            self._stats["bytes_sent_total"] += n

    def _track(self, conn: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)


class _ProxyServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    # TCPServer rather than http.server.HTTPServer: the latter resolves a host name at bind time.
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, proxy: FaultProxy):
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(BaseHTTPRequestHandler):
    """One client connection: parses requests in a keep-alive loop and relays each one."""

    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; with Nagle on, the body would wait for the
        # client's delayed ACK of the headers, adding ~40 ms to every response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.proxy._track(self.connection, open_=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.proxy._track(self.connection, open_=False)

    def handle(self) -> None:
        try:
            super().handle()
        except ConnectionError:
            pass  # the client reset the connection while we waited for its next request

    def __getattr__(self, name: str) -> Any:
        # BaseHTTPRequestHandler dispatches to do_<METHOD>; relay every method alike.
        if name.startswith("do_"):
            return self._relay
        raise AttributeError(name)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _relay(self) -> None:
        path = unquote(urlsplit(self.path).path)
        try:
            body = self._read_body()
            fault = self.server.proxy._on_request(self.command, path, self.headers.get("Range"))
            kind = fault.kind if fault else None
            if kind == "reset":
                self._reset()
                return
            if kind in _ERROR_FAULTS:
                self._send_s3_error(*_ERROR_FAULTS[kind], path)
                return
            if fault is not None and kind == "delay":
                time.sleep(fault.delay_seconds)
            upstream = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=60)
            try:
                try:
                    response = self._forward(upstream, body)
                except (OSError, http.client.HTTPException) as exc:
                    self._send_s3_error(502, "BadGateway", f"upstream failed: {exc!r}", path)
                    return
                if kind == "truncate" and self.command != "HEAD":
                    self._send_truncated(response, path)
                else:
                    self._send_response(response, path)
            finally:
                upstream.close()
        except (OSError, http.client.HTTPException) as exc:
            # The client went away, or upstream broke mid-body after the headers were relayed:
            # dropping the connection is the only honest signal left.
            log.debug("fault proxy: dropping connection after %r", exc)
            self.close_connection = True

    def _read_body(self) -> bytes:
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            parts.append(self.rfile.read(size))
            self.rfile.readline()  # CRLF after the chunk
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass  # trailer fields
        return b"".join(parts)

    def _forward(
        self, upstream: http.client.HTTPConnection, body: bytes
    ) -> http.client.HTTPResponse:
        # skip_host: relay the client's Host header untouched; SigV4 signs it.
        upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                upstream.putheader(name, value)
        if "Content-Length" not in self.headers and body:
            upstream.putheader("Content-Length", str(len(body)))  # was chunked; now de-chunked
        upstream.putheader("Connection", "close")
        upstream.endheaders(body or None)
        return upstream.getresponse()

    def _send_headers_from(self, response: http.client.HTTPResponse, *, skip: str = "") -> None:
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != skip:
                self.send_header(name, value)

    def _send_response(self, response: http.client.HTTPResponse, path: str) -> None:
        # http.client leaves `length` None only when upstream sent no Content-Length (chunked or
        # close-delimited); then re-chunk for HTTP/1.1 clients, or delimit by closing.
        chunked = response.length is None and self.request_version != "HTTP/1.0"
        if response.length is None and not chunked:
            self.close_connection = True
        self._send_headers_from(response)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        while data := response.read(_RELAY_CHUNK):
            self._write_body(path, data, b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        elif response.length:
            self.close_connection = True  # upstream ended short; let the client see it too

    def _send_truncated(self, response: http.client.HTTPResponse, path: str) -> None:
        data = response.read()
        self._send_headers_from(response, skip="content-length")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self._write_body(path, data[: len(data) // 2])
        self.close_connection = True

    def _send_s3_error(self, status: int, code: str, message: str, path: str) -> None:
        request_id = uuid.uuid4().hex[:16].upper()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
            f"<Resource>{escape(path)}</Resource><RequestId>{request_id}</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amz-request-id", request_id)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self._write_body(path, body)

    def _write_body(self, path: str, data: bytes, framed: bytes | None = None) -> None:
        """Write `data` (or its chunked framing) to the client and count it as sent.

        Counted before writing, so that a client which already holds the bytes finds them in the
        stats; taken back if the write fails, since the client then did not get them all.
        """
        self.server.proxy._on_sent(path, len(data))
        try:
            self.wfile.write(data if framed is None else framed)
        except OSError:
            self.server.proxy._on_sent(path, -len(data))
            raise

    def _reset(self) -> None:
        # SO_LINGER 0 makes close() send RST instead of FIN. The fd only closes once the
        # makefile() reader is closed too, and it must close here: socketserver would otherwise
        # call shutdown(SHUT_WR) first, which sends a FIN and the client would see a clean EOF.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()
        self.connection.close()
        self.close_connection = True


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server for the session; its log is in the session's temp directory."""
    with MotoServer(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="session")
def fault_proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    """One FaultProxy in front of `moto_server` for the session. Prefer `faults` in tests."""
    with FaultProxy(moto_server.endpoint) as proxy:
        yield proxy


@pytest.fixture
def faults(fault_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """The session's proxy with no faults and zeroed stats, and left that way for the next test."""
    fault_proxy.clear_faults()
    fault_proxy.reset_stats()
    yield fault_proxy
    fault_proxy.clear_faults()
    fault_proxy.reset_stats()


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> Iterator[str]:
    """A fresh, uniquely named bucket created directly on moto; emptied and deleted afterwards.

    Deleting keeps the session's moto from accumulating every test's objects in memory.
    """
    client = s3_client(moto_server.endpoint)
    name = f"test-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    yield name
    # Versions rather than objects, so that a test that enabled versioning is cleaned up too.
    for page in client.get_paginator("list_object_versions").paginate(Bucket=name):
        victims = [
            {"Key": v["Key"], "VersionId": v["VersionId"]}
            for v in page.get("Versions", []) + page.get("DeleteMarkers", [])
        ]
        if victims:
            client.delete_objects(Bucket=name, Delete={"Objects": victims, "Quiet": True})
    client.delete_bucket(Bucket=name)
