"""Tests of the S3 test environment itself: moto behind FaultProxy, driven by boto3 over real HTTP.

Other S3 tests trust this infrastructure to inject exactly the faults they ask for, to fail the
way a real network fails, and to count what clients actually received; these tests check that.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, ResponseStreamingError
from s3env import FaultProxy, MotoServer, s3_client

DATA = bytes(range(256)) * 16  # 4 KiB: enough to cut in half, small for moto's ranged GETs


def one_shot(proxy: FaultProxy):
    """A client through the proxy that makes a single attempt per call, so calls map to requests.

    `total_max_attempts`, not `max_attempts`: botocore reads the latter as retries after the first
    attempt (see test_max_attempts_counts_retries).
    """
    return s3_client(proxy.endpoint, retries={"total_max_attempts": 1})


def put(moto: MotoServer, bucket: str, key: str, body: bytes = DATA) -> str:
    """Store an object directly on moto, bypassing the proxy's stats; returns the proxy's path."""
    s3_client(moto.endpoint).put_object(Bucket=bucket, Key=key, Body=body)
    return f"/{bucket}/{key}"


def test_roundtrip_is_relayed_and_counted(faults, s3_bucket):
    s3 = one_shot(faults)
    s3.put_object(Bucket=s3_bucket, Key="dir/my obj.bin", Body=DATA)
    assert s3.head_object(Bucket=s3_bucket, Key="dir/my obj.bin")["ContentLength"] == len(DATA)
    assert s3.get_object(Bucket=s3_bucket, Key="dir/my obj.bin")["Body"].read() == DATA
    listing = s3.list_objects_v2(Bucket=s3_bucket)
    assert [o["Key"] for o in listing["Contents"]] == ["dir/my obj.bin"]

    stats = faults.stats()
    path = f"/{s3_bucket}/dir/my obj.bin"  # unquoted, although botocore sent my%20obj.bin
    assert stats["requests"] == {"PUT": 1, "HEAD": 1, "GET": 2}
    assert stats["gets"] == {path: 1, f"/{s3_bucket}": 1}
    assert stats["bytes_sent"][path] == len(DATA)  # the HEAD's Content-Length is not body
    assert stats["bytes_sent"][f"/{s3_bucket}"] > 0
    assert stats["bytes_sent_total"] == sum(stats["bytes_sent"].values())
    assert stats["faults"] == {} and stats["ranges"] == []


def test_ranged_get_returns_and_records_exactly_the_range(faults, s3_bucket, moto_server):
    path = put(moto_server, s3_bucket, "shard")
    response = one_shot(faults).get_object(Bucket=s3_bucket, Key="shard", Range="bytes=1000-1499")
    assert response["Body"].read() == DATA[1000:1500]
    assert response["ContentRange"] == f"bytes 1000-1499/{len(DATA)}"
    stats = faults.stats()
    assert stats["ranges"] == [(path, "bytes=1000-1499")]
    assert stats["bytes_sent"] == {path: 500}


def test_truncate_fails_the_body_read_instead_of_returning_short_data(
    faults, s3_bucket, moto_server
):
    path = put(moto_server, s3_bucket, "shard")
    s3 = one_shot(faults)
    faults.set_faults(1.0, ("truncate",))
    response = s3.get_object(Bucket=s3_bucket, Key="shard")
    assert response["ContentLength"] == len(DATA)  # the headers arrive intact
    with pytest.raises(ResponseStreamingError, match="IncompleteRead"):
        response["Body"].read()
    assert faults.stats()["bytes_sent"] == {path: len(DATA) // 2}
    assert faults.stats()["faults"] == {"truncate": 1}

    faults.clear_faults()  # the client replaces the connection the proxy closed
    assert s3.get_object(Bucket=s3_bucket, Key="shard")["Body"].read() == DATA


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [("503", 503, "SlowDown"), ("500", 500, "InternalError"), ("429", 429, "TooManyRequests")],
)
def test_error_faults_are_s3_errors(faults, s3_bucket, moto_server, kind, status, code):
    put(moto_server, s3_bucket, "shard")
    faults.set_faults(1.0, (kind,))
    with pytest.raises(ClientError) as info:
        one_shot(faults).get_object(Bucket=s3_bucket, Key="shard")
    assert info.value.response["Error"]["Code"] == code
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert faults.stats()["requests"] == {"GET": 1}
    assert faults.stats()["faults"] == {kind: 1}


def test_max_attempts_counts_retries(faults, s3_bucket, moto_server):
    """botocore's `max_attempts=1` means one retry, i.e. two requests; tests must not assume one."""
    put(moto_server, s3_bucket, "shard")
    faults.set_faults(1.0, ("503",))
    s3 = s3_client(faults.endpoint, retries={"max_attempts": 1})
    with pytest.raises(ClientError) as info:
        s3.get_object(Bucket=s3_bucket, Key="shard")
    assert info.value.response["Error"]["Code"] == "SlowDown"
    assert faults.stats()["requests"] == {"GET": 2}


def test_reset_is_a_connection_error_and_the_proxy_survives_it(faults, s3_bucket, moto_server):
    put(moto_server, s3_bucket, "shard")
    s3 = one_shot(faults)
    faults.set_faults(1.0, ("reset",))
    with pytest.raises(ConnectionClosedError) as info:
        s3.get_object(Bucket=s3_bucket, Key="shard")
    # A TCP reset, not an orderly close: botocore raises the same class for both, and http.client's
    # RemoteDisconnected for the latter is a subclass of ConnectionResetError, hence `type is`.
    assert any(type(a) is ConnectionResetError for a in info.value.kwargs["error"].args)
    assert faults.stats()["faults"] == {"reset": 1}
    assert faults.stats()["bytes_sent_total"] == 0

    faults.clear_faults()
    assert s3.get_object(Bucket=s3_bucket, Key="shard")["Body"].read() == DATA


def test_delay_slows_the_request_down_but_completes_it(faults, s3_bucket, moto_server):
    put(moto_server, s3_bucket, "shard")
    s3 = one_shot(faults)

    def timed_get() -> float:
        start = time.monotonic()
        assert s3.get_object(Bucket=s3_bucket, Key="shard")["Body"].read() == DATA
        return time.monotonic() - start

    faults.set_faults(1.0, ("delay",), delay_seconds=0.5)
    assert timed_get() >= 0.5
    faults.clear_faults()
    assert timed_get() < 0.5  # so the delay above came from the fault, not from moto


def test_faults_hit_only_the_filtered_key_and_methods(faults, s3_bucket):
    s3 = one_shot(faults)
    faults.set_faults(1.0, ("503",), key_filter="victim")
    for key in ("victim", "bystander"):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=DATA)  # PUT is not among the methods
    assert s3.get_object(Bucket=s3_bucket, Key="bystander")["Body"].read() == DATA
    with pytest.raises(ClientError, match="SlowDown"):
        s3.get_object(Bucket=s3_bucket, Key="victim")
    assert faults.stats()["faults"] == {"503": 1}


def test_fault_rate_is_plausible_seeded_and_counted(faults, s3_bucket, moto_server):
    """Faults are drawn per request from the seed: sensible counts, the same requests each run."""
    put(moto_server, s3_bucket, "shard")
    s3 = one_shot(faults)
    n = 100

    def run() -> list[str | None]:
        faults.set_faults(0.3, ("503", "500"), seed=1234)
        codes: list[str | None] = []
        for _ in range(n):
            try:
                s3.get_object(Bucket=s3_bucket, Key="shard")["Body"].read()
                codes.append(None)
            except ClientError as exc:
                codes.append(exc.response["Error"]["Code"])
        return codes

    first = run()
    failed = n - first.count(None)
    assert 15 <= failed <= 45  # Binomial(100, 0.3): mean 30, standard deviation 4.6
    stats = faults.stats()
    assert stats["faults"] == {"503": first.count("SlowDown"), "500": first.count("InternalError")}
    assert sum(stats["faults"].values()) == failed
    assert min(stats["faults"].values()) > 0  # both kinds are drawn
    assert stats["requests"] == {"GET": n}

    faults.reset_stats()
    assert run() == first


def test_reset_stats_zeroes_everything_but_keeps_the_faults(faults, s3_bucket, moto_server):
    put(moto_server, s3_bucket, "shard")
    s3 = one_shot(faults)
    faults.set_faults(1.0, ("503",), methods=("HEAD",))
    s3.get_object(Bucket=s3_bucket, Key="shard", Range="bytes=0-9")["Body"].read()
    with pytest.raises(ClientError):
        s3.head_object(Bucket=s3_bucket, Key="shard")
    snapshot = faults.stats()
    assert snapshot["requests"] == {"GET": 1, "HEAD": 1} and snapshot["faults"] == {"503": 1}

    faults.reset_stats()
    assert faults.stats() == {
        "requests": {},
        "gets": {},
        "bytes_sent": {},
        "bytes_sent_total": 0,
        "faults": {},
        "ranges": [],
    }
    assert snapshot["requests"] == {"GET": 1, "HEAD": 1}  # snapshots are copies
    with pytest.raises(ClientError):
        s3.head_object(Bucket=s3_bucket, Key="shard")


def test_client_connections_are_kept_alive_across_requests_and_error_faults(
    faults, s3_bucket, moto_server
):
    """botocore pools connections; the proxy must keep them open, injected S3 errors included."""
    put(moto_server, s3_bucket, "shard")
    s3 = one_shot(faults)
    url = urlsplit(
        s3.generate_presigned_url("get_object", Params={"Bucket": s3_bucket, "Key": "shard"})
    )
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)

    def get(rate: float) -> tuple[int, bytes]:
        faults.set_faults(rate, ("503",))
        conn.request("GET", f"{url.path}?{url.query}")
        response = conn.getresponse()
        return response.status, response.read()

    try:
        assert get(0.0) == (200, DATA)
        sock = conn.sock
        assert get(1.0)[0] == 503
        assert get(0.0) == (200, DATA)
        # http.client reconnects after a `Connection: close` and fails after a silent close.
        assert sock is not None and conn.sock is sock
    finally:
        conn.close()


def test_client_vanishing_mid_response_does_not_break_the_proxy(faults, s3_bucket, moto_server):
    put(moto_server, s3_bucket, "big", DATA * 64)
    s3 = one_shot(faults)
    url = urlsplit(
        s3.generate_presigned_url("get_object", Params={"Bucket": s3_bucket, "Key": "big"})
    )
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", f"{url.path}?{url.query}")
    conn.getresponse().read(100)
    conn.close()  # with most of the body unread
    assert s3.get_object(Bucket=s3_bucket, Key="big")["Body"].read() == DATA * 64


class _ChunkedHandler(BaseHTTPRequestHandler):
    """An upstream that sends its body chunked, a path moto's S3 responses do not exercise."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in (b"hello ", b"chunked ", b"world"):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass  # keep test output clean


def test_chunked_upstream_bodies_are_relayed_chunked_on_a_kept_alive_connection():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _ChunkedHandler)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as proxy:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            for _ in range(2):
                conn.request("GET", "/x")
                response = conn.getresponse()
                assert response.getheader("Transfer-Encoding") == "chunked"
                assert response.read() == b"hello chunked world"
            conn.close()
            assert proxy.stats()["bytes_sent"] == {"/x": 2 * len(b"hello chunked world")}
    finally:
        upstream.shutdown()
        upstream.server_close()


def _alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie does not count (a container's init may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_moto_server_dies_with_a_parent_that_was_killed(tmp_path):
    """The session's finalizers do not run on SIGKILL; the moto child must not be orphaned."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from s3env import MotoServer; "
        "m = MotoServer(sys.argv[2]); print(m.proc.pid, flush=True); sys.stdin.read()"
    )
    tests_dir = str(Path(__file__).parents[1])
    parent = subprocess.Popen(
        [sys.executable, "-c", script, tests_dir, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        moto_pid = int(parent.stdout.readline())
        assert _alive(moto_pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(moto_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(moto_pid):
        os.kill(moto_pid, signal.SIGKILL)
        pytest.fail("moto server outlived its killed parent")
