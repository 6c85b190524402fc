"""The trainer's data wait: measured by the client where the trainer blocks, reported with its
next requests (metadata, no extra RPC), exported per job by the server; and warm starts that
fetch the resume step before the trainer asks. A real server behind a delaying gRPC proxy (the
proxy forwards the request metadata, as a load balancer would)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from support import ServerProcess, job_spec, metric, scrape, write_config
from tokenfeed.client import AsyncClient, Client
from tokenfeed.client.waits import METADATA_KEY
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

SERVER_PING_POLICY = [
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
]


class SlowFront(pb_grpc.TokenFeedServicer):
    """Forwards to `upstream`, holding each streamed batch `per_batch` seconds and the first
    message of each call `first` seconds more (a server that is slow to start a step)."""

    def __init__(self, upstream: str, per_batch: float = 0.0, first: float = 0.0):
        self.per_batch, self.first = per_batch, first
        self.calls: list[tuple[str, float]] = []  # (method, when) of each call
        self._channel = grpc.insecure_channel(upstream)
        self._stub = pb_grpc.TokenFeedStub(self._channel)
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=SERVER_PING_POLICY)
        pb_grpc.add_TokenFeedServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def GetBatch(self, request, context):
        self.calls.append(("GetBatch", time.monotonic()))
        time.sleep(self.first + self.per_batch)
        return self._stub.GetBatch(request, metadata=context.invocation_metadata())

    def StreamBatches(self, request, context):
        self.calls.append(("StreamBatches", time.monotonic()))
        time.sleep(self.first)
        for msg in self._stub.StreamBatches(request, metadata=context.invocation_metadata()):
            time.sleep(self.per_batch)
            yield msg

    def DescribeJob(self, request, context):
        return self._stub.DescribeJob(request)

    def stop(self) -> None:
        self.server.stop(None)
        self._channel.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-workers"])
def server(request, tmp_path_factory, corpus):
    """One server with job `main` and a metrics port; with 2 serving workers, the supervisor
    sums their wait metrics (serve/workermetrics.py WORKER_METRICS)."""
    tmp = tmp_path_factory.mktemp("waits")
    jobs = {"main": job_spec([corpus / "*"])}
    extra = {"workers": request.param} if request.param > 1 else {}
    cfg = write_config(tmp / "tf.yaml", jobs, tmp / "cache", metrics_listen="127.0.0.1:0", **extra)
    proc = ServerProcess(cfg, tmp / "server.log")
    assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
    yield proc
    assert proc.stop() == 0, proc.log()


def waits(server) -> tuple[float, float, float]:
    """(waited seconds, reported seconds, waits) of job main, from a real scrape."""
    samples = scrape(server.metrics)
    return (
        metric(samples, "tokenfeed_trainer_wait_seconds_sum", tokenfeed_job="main"),
        metric(samples, "tokenfeed_trainer_reported_seconds_total", tokenfeed_job="main"),
        metric(samples, "tokenfeed_trainer_wait_seconds_count", tokenfeed_job="main"),
    )


def waits_since(server, before, count: int) -> tuple[float, float, float]:
    """What was reported since `before`, once `count` waits are in (workers send their
    counters to the supervisor every second)."""
    deadline = time.monotonic() + 10
    while True:
        delta = tuple(a - b for a, b in zip(waits(server), before, strict=True))
        if delta[2] >= count or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def test_reported_wait_matches_what_the_trainer_measured(server):
    """A trainer computing 10 ms per step on a feed that delivers a batch every 30 ms waits
    about two thirds of the time; the server's figures agree with the trainer's own clock."""
    front = SlowFront(server.address, per_batch=0.03)
    before = waits(server)
    measured, steps = 0.0, 40
    try:
        with Client(front.address, job="main", prefetch=2, report_seconds=0.3) as c:
            batches = c.iter_batches(0, steps, rank=1, world_size=2)
            started = time.perf_counter()
            for _ in range(steps):
                asked = time.perf_counter()
                next(batches)
                measured += time.perf_counter() - asked
                time.sleep(0.01)  # the training step
            batches.close()
            # One more call carries what the stream's last segment could not report.
            asked = time.perf_counter()
            c.get_batch(steps, rank=1, world_size=2)
            wall = asked - started
    finally:
        front.stop()
    waited, reported, count = waits_since(server, before, steps)
    print(
        f"\ndata wait: trainer measured {measured:.3f} s of {wall:.3f} s "
        f"({measured / wall:.1%}); server reported {waited:.3f} s of {reported:.3f} s "
        f"({waited / reported:.1%}) over {count:.0f} waits"
    )
    assert count == steps
    assert waited == pytest.approx(measured, rel=0.05, abs=0.01)
    assert reported == pytest.approx(wall, rel=0.05, abs=0.05)
    assert 0.4 < waited / reported < 0.9  # 20 of every 30 ms


def test_a_fast_feed_reports_next_to_no_wait(server):
    before = waits(server)
    with Client(server.address, job="main", prefetch=4, report_seconds=0.2) as c:
        batches = c.iter_batches(0, 30, rank=0, world_size=4)
        for _ in batches:
            time.sleep(0.02)  # slower than the server: batches are always waiting
        c.get_batch(30, rank=0, world_size=4)
    waited, reported, count = waits_since(server, before, 30)
    assert count == 30 and reported > 0.5
    assert waited / reported < 0.1, (waited, reported)


def test_a_malformed_report_is_counted_and_the_batch_served(server):
    name = "tokenfeed_wait_reports_total"
    bad = metric(scrape(server.metrics), name, outcome="malformed")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TokenFeedStub(channel)
        request = pb.GetBatchRequest(job="main", step=3, rank=0, world_size=1)
        msg = stub.GetBatch(request, metadata=((METADATA_KEY, "e=1;w=oops"),))
    assert msg.step == 3
    deadline = time.monotonic() + 10
    while (now := metric(scrape(server.metrics), name, outcome="malformed")) == bad:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert now == bad + 1


@pytest.mark.parametrize("warm", [True, False])
def test_warm_start_hides_the_first_batch_behind_the_checkpoint_restore(server, warm):
    """A server 0.6 s slow to start a call; the trainer restores its checkpoint for 0.8 s.
    Warmed, its first batch is there when it asks; cold, it waits the 0.6 s."""
    front = SlowFront(server.address, first=0.6)
    try:
        with Client(front.address, job="main", prefetch=2) as c:
            expected = [c.get_batch(s, 1, 2).fingerprint for s in range(7, 12)]
            if warm:
                c.warm(7, rank=1, world_size=2)
            time.sleep(0.8)  # restoring the checkpoint
            batches = c.iter_batches(7, 12, rank=1, world_size=2)
            asked = time.perf_counter()
            first = next(batches)
            first_wait = time.perf_counter() - asked
            got = [first.fingerprint] + [b.fingerprint for b in batches]
    finally:
        front.stop()
    assert got == expected
    if warm:
        assert first_wait < 0.2, first_wait
    else:
        assert first_wait >= 0.55, first_wait


def test_async_warm_then_get_batch_takes_the_warm_batches(server):
    async def main():
        async with AsyncClient(server.address, job="main") as c:
            expected = [(await c.get_batch(s)).fingerprint for s in range(20, 26)]
            c.warm(20, steps=3)
            got = [(await c.get_batch(s)).fingerprint for s in range(20, 22)]
            got += [b.fingerprint async for b in c.iter_batches(22, 26)]
            return expected, got

    import asyncio

    expected, got = asyncio.run(main())
    assert got == expected


def test_sync_warm_at_another_step_is_dropped(server):
    with Client(server.address, job="main") as c:
        expected = c.get_batch(40).fingerprint
        c.warm(10)
        time.sleep(0.1)
        assert c.get_batch(40).fingerprint == expected  # the trainer went elsewhere
        assert not c._warm
        assert threading.active_count() < 50


def test_sync_warm_then_get_batch_takes_the_warm_batches(server):
    with Client(server.address, job="main") as c:
        expected = [c.get_batch(s, 2, 4).fingerprint for s in range(50, 56)]
    front = SlowFront(server.address)
    try:
        with Client(front.address, job="main") as c:
            c.warm(50, rank=2, world_size=4, steps=3)
            got = [c.get_batch(s, 2, 4).fingerprint for s in range(50, 56)]
    finally:
        front.stop()
    assert got == expected
    methods = [m for m, _ in front.calls]
    # Steps 50-52 came from the one warm stream, 53-55 from unary calls.
    assert methods.count("StreamBatches") == 1 and methods.count("GetBatch") == 3, methods
