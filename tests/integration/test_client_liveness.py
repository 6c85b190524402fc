"""The client's patience, against real servers: it waits out the retry pushback a server sends
(sync, asyncio, streams, fleets), and with its default keepalive pings it leaves a hung server
(SIGSTOP) within seconds while a slow but live one still answers.

A small gRPC server in front of a real tokenfeed server plays the states that are hard to hold
still in a real one (a step still being built: UNAVAILABLE with grpc-retry-pushback-ms; a step
that takes longer than the ping interval), then forwards to the real server."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from concurrent import futures

import grpc
import pytest
from forward import Forwarder
from support import FleetProcesses, job_spec
from tokenfeed.client import AsyncClient, Client, Unavailable
from tokenfeed.client.fleet import rendezvous
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

# Pings are accepted as a tokenfeed server accepts them (server.limits.min_ping_seconds).
SERVER_PING_POLICY = [
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
]


class Front(Forwarder):
    """Answers the first `pushbacks` calls UNAVAILABLE with a pushback of `pushback_ms`, holds
    each later call `busy_seconds` in a busy loop, then forwards it to `upstream`."""

    def __init__(self, upstream: str, pushbacks=0, pushback_ms=0, busy_seconds=0.0):
        super().__init__(upstream)
        self.pushbacks, self.pushback_ms, self.busy_seconds = pushbacks, pushback_ms, busy_seconds
        self.calls: list[float] = []  # when each call arrived (time.monotonic)
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=SERVER_PING_POLICY)
        pb_grpc.add_TokenFeedServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _gate(self, context) -> None:
        with self._lock:
            self.calls.append(time.monotonic())
            push = self.pushbacks > 0
            self.pushbacks -= push
        if push:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(self.pushback_ms)),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "job main: step 0 is still being built")
        end = time.monotonic() + self.busy_seconds
        while time.monotonic() < end:  # CPU-bound, like a server tokenizing
            sum(range(1000))

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.calls, self.calls[1:], strict=False)]

    def stop(self) -> None:
        self.server.stop(None)
        self.close_upstream()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("liveness")
    fleet = FleetProcesses(tmp, {"main": job_spec([corpus / "*"], seq_len=256)}, 2)
    yield fleet
    fleet.stop()


@pytest.fixture
def upstream(fleet):
    return fleet.servers[0].address


def reference(upstream: str, step: int, rank: int = 0, world: int = 1) -> str:
    with Client(upstream, job="main") as c:
        return c.get_batch(step, rank, world).fingerprint


def test_sync_get_batch_waits_out_the_pushback(upstream):
    front = Front(upstream, pushbacks=2, pushback_ms=1200)
    try:
        with Client(front.address, job="main") as c:  # its own backoff starts at 0.05 s
            started = time.monotonic()
            batch = c.get_batch(3)
            took = time.monotonic() - started
    finally:
        front.stop()
    assert batch.fingerprint == reference(upstream, 3)
    assert len(front.calls) == 3
    assert all(gap >= 1.2 for gap in front.gaps()), front.gaps()
    assert took >= 2.4


def test_async_get_batch_and_stream_wait_out_the_pushback(upstream):
    front = Front(upstream, pushbacks=1, pushback_ms=1500)

    async def main():
        async with AsyncClient(front.address, job="main") as c:
            batch = await c.get_batch(2)
            front.pushbacks = 1
            steps = [b.step async for b in c.iter_batches(0, 5)]
        return batch, steps

    try:
        batch, steps = asyncio.run(main())
    finally:
        front.stop()
    assert batch.fingerprint == reference(upstream, 2) and steps == [0, 1, 2, 3, 4]
    assert len(front.calls) == 4
    assert front.gaps()[0] >= 1.5 and front.gaps()[2] >= 1.5, front.gaps()


def test_sync_stream_waits_out_the_pushback(upstream):
    front = Front(upstream, pushbacks=1, pushback_ms=1500)
    try:
        with Client(front.address, job="main") as c:
            steps = [b.step for b in c.iter_batches(4, 8)]
    finally:
        front.stop()
    assert steps == [4, 5, 6, 7]
    assert len(front.calls) == 2 and front.gaps()[0] >= 1.5, front.gaps()


def test_a_fleet_asks_no_server_again_before_its_pushback_ends(upstream):
    fronts = [Front(upstream, pushbacks=1, pushback_ms=1500) for _ in range(2)]
    try:
        target = ",".join(f.address for f in fronts)
        with Client(target, job="main") as c:
            batch = c.get_batch(1)
    finally:
        for f in fronts:
            f.stop()
    assert batch.fingerprint == reference(upstream, 1)
    asked = sorted(t for f in fronts for t in f.calls)
    assert len(asked) == 3, "each server pushed back once; the first one asked again answered"
    assert asked[1] - asked[0] < 1.0, "the second server is asked at once"
    assert asked[2] - asked[0] >= 1.5, "no server is asked again before its pushback ends"


def test_pushback_is_capped_by_max_pushback_and_by_the_deadline(upstream):
    front = Front(upstream, pushbacks=1, pushback_ms=60_000)
    try:
        with Client(front.address, job="main", max_pushback=1.0) as c:
            started = time.monotonic()
            c.get_batch(0)
            assert 1.0 <= time.monotonic() - started < 10
        front.pushbacks = 5
        with Client(front.address, job="main", timeout=2) as c:
            started = time.monotonic()
            with pytest.raises(Unavailable, match="still being built"):
                c.get_batch(0)
            assert time.monotonic() - started < 5
    finally:
        front.stop()


def test_a_stopped_server_is_left_within_seconds(fleet):
    """SIGSTOP keeps the server's sockets open and answers nothing: its unanswered keepalive
    ping closes the connection, well before the 20 s a call's attempt may take by default."""
    addresses = [s.address for s in fleet.servers]
    rank = 0  # its home is whichever server rendezvous gives it (ports differ every run)
    home = fleet.by_address(rendezvous(addresses, "main", rank)[0])
    other = next(a for a in addresses if a != home.address)
    expected = [reference(other, s, rank, 8) for s in range(2)]
    with Client(fleet.target, job="main") as c:
        assert c.get_batch(0, rank, 8).server == home.address
        home.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            batch = c.get_batch(1, rank, 8)
            took = time.monotonic() - started
        finally:
            home.proc.send_signal(signal.SIGCONT)
    assert batch.server == other and batch.fingerprint == expected[1]
    assert took < 12, f"left the stopped server after {took:.1f}s"


def test_a_stopped_server_mid_stream_is_left_within_seconds(fleet):
    addresses = [s.address for s in fleet.servers]
    home = fleet.by_address(rendezvous(addresses, "main", 0)[0])
    arrivals, servers = [], []
    with Client(fleet.target, job="main", prefetch=1) as c:
        try:
            for batch in c.iter_batches(0, 400):
                arrivals.append(time.monotonic())
                servers.append(batch.server)
                if len(arrivals) == 5:
                    home.proc.send_signal(signal.SIGSTOP)
                if batch.server != home.address:
                    break
        finally:
            home.proc.send_signal(signal.SIGCONT)
    assert servers[0] == home.address and servers[-1] != home.address
    gap = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert gap < 12, f"the stream stalled {gap:.1f}s"


def test_a_slow_step_is_not_taken_for_a_hung_server(upstream):
    """A step that keeps the server busy longer than a ping interval plus its timeout: the
    server's gRPC core answers the pings meanwhile, so the one call simply succeeds."""
    front = Front(upstream, busy_seconds=9.0)
    try:
        with Client(front.address, job="main", attempt_timeout=30) as c:
            started = time.monotonic()
            batch = c.get_batch(5)
            took = time.monotonic() - started
    finally:
        front.stop()
    assert batch.fingerprint == reference(upstream, 5)
    assert len(front.calls) == 1, "no retry: the connection was never dropped"
    assert took >= 9.0
