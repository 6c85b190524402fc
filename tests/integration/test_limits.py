"""Bounded under abuse: oversized requests and headers, huge names, 64-bit values, calls past
server.limits.max_concurrent_rpcs and hundreds of streams that never read get a clear status or
a bounded cost, and other clients are served meanwhile."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from support import ServerProcess, job_spec, write_config
from tokenfeed.client import Client
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

STALLED = 300
# [32, 4096] batches (about 256 KiB each on the wire): big enough that what a stalled stream
# holds shows in RSS.
SEQ_LEN, BATCH = 4096, 32
# What one stalled stream may hold (serve/streaming.py `Ahead`, stream_ahead 2): the group being
# sent and the serialized copy of its message in gRPC, fewer than stream_ahead batches and a
# group queued; a group is four of these batches (GROUP_TOKENS): docs/configuration.md.
BATCHES_PER_STALLED_STREAM = 4 + 1 + (2 - 1) + 4
# Allocator and gRPC bookkeeping besides the batches.
SLACK_MB = 64
# The server keeps freed memory (docs/deployment.md: its RSS is its heap's high-water mark), and
# where 300 streams' batches were freed in between decides how high that mark stands: 7.0-7.3
# batches a stream in 17 runs on one machine, 9.2 in a CI run and 9.4 in a run before (about one
# in ten). A quarter more than what the streams hold covers that; a stream that held batches
# without bound grows far past it.
FRAGMENTATION = 1.25


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def steady_rss_mb(pid: int, seconds: float = 40) -> float:
    """RSS once it stops growing (under 4 MB in 3 s), or after `seconds`."""
    deadline, last = time.monotonic() + seconds, rss_mb(pid)
    while time.monotonic() < deadline:
        time.sleep(3)
        now = rss_mb(pid)
        if now - last < 4:
            return now
        last = now
    return last


@pytest.fixture(scope="module")
def server(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("limits")
    jobs = {"main": job_spec([corpus / "*"], seq_len=SEQ_LEN, global_batch_size=BATCH)}
    cfg = write_config(tmp / "tf.yaml", jobs, tmp / "cache")
    proc = ServerProcess(cfg, tmp / "server.log")
    assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
    yield proc
    assert proc.stop() == 0, proc.log()


def test_an_oversized_request_is_refused_and_the_server_serves_on(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TokenFeedStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetBatch(pb.GetBatchRequest(job="x" * (1 << 20), step=0), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with Client(server.address, job="main") as c:
        assert c.get_batch(0)["input_ids"].shape == (BATCH, SEQ_LEN)


def test_a_huge_unknown_job_name_gets_a_short_not_found(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TokenFeedStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetBatch(pb.GetBatchRequest(job="j" * 16000, step=0), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "(16000 characters)" in err.value.details()
        assert len(err.value.details()) < 400


def test_a_64_bit_world_size_is_refused_not_cut(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TokenFeedStub(channel)
        for request in (
            pb.GetBatchRequest(job="main", step=0, world_size=2**32 + 1),
            pb.GetBatchRequest(job="main", step=0, world_size=2**40),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.GetBatch(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "world_size must be in [1, 2**31)" in err.value.details()


def test_undecodable_requests_get_invalid_argument(server):
    valid = pb.GetBatchRequest(job="main", step=3).SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_unary("/tokenfeed.v1.TokenFeed/GetBatch")
        for data in (valid[:-1], b"\x0a\x02\xff\xfe", b"\xff" * 7):
            with pytest.raises(grpc.RpcError) as err:
                raw(data, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, data
            assert "malformed GetBatchRequest" in err.value.details()


def test_streams_that_never_read_cost_bounded_memory(server):
    with grpc.insecure_channel(server.address) as channel:
        wire = pb_grpc.TokenFeedStub(channel).GetBatch(pb.GetBatchRequest(job="main", step=0))
    batch_mb = wire.ByteSize() / 2**20
    bound = STALLED * BATCHES_PER_STALLED_STREAM * batch_mb * FRAGMENTATION + SLACK_MB
    before = rss_mb(server.proc.pid)
    channels = [grpc.insecure_channel(server.address) for _ in range(STALLED // 10)]
    calls = []
    try:
        # Ten streams per connection, none ever read. A step of this job is about one epoch of
        # the small corpus: streams start within the first few so that the epochs laid out
        # (server.stream_cache_bytes, shared by all streams) stay few and what grows is what
        # the streams themselves hold.
        for i in range(STALLED):
            stub = pb_grpc.TokenFeedStub(channels[i % len(channels)])
            request = pb.StreamBatchesRequest(job="main", start_step=i % 4, end_step=0)
            calls.append(stub.StreamBatches(request, timeout=120))
        grown = steady_rss_mb(server.proc.pid) - before  # every stream built what it may
        # Another client is served promptly meanwhile.
        started = time.monotonic()
        with Client(server.address, job="main") as c:
            assert c.get_batch(7)["input_ids"].shape == (BATCH, SEQ_LEN)
        waited = time.monotonic() - started
        print(
            f"\n{STALLED} stalled streams of {batch_mb:.2f} MB batches: server RSS "
            f"{before:.0f} MB -> +{grown:.0f} MB ({grown / STALLED / batch_mb:.1f} batches "
            f"each; bound {bound:.0f} MB); another client's batch in {waited:.2f}s"
        )
        assert waited < 10
        assert grown < bound, f"{STALLED} stalled streams grew the server {grown:.0f} MB"
    finally:
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()
    # After the streams are cancelled the server serves on.
    with Client(server.address, job="main") as c:
        assert c.get_batch(9)["input_ids"].shape == (BATCH, SEQ_LEN)


def test_oversized_metadata_is_refused_and_the_server_serves_on(server):
    # grpc core's own bound on a call's headers (grpc.max_metadata_size 8 KiB soft,
    # grpc.absolute_max_metadata_size 16 KiB hard): past the hard limit every call is refused.
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TokenFeedStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ListJobs(pb.ListJobsRequest(), metadata=[("x-pad", "a" * 20000)], timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server serves on. Asked on a new connection: a call sent at once on the refused
    # call's connection was once itself refused by the transport (UNAVAILABLE, RST_STREAM
    # REFUSED_STREAM; seen once in CI), which says nothing of the server, and the Client
    # retries that status anyway.
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TokenFeedStub(channel)
        assert stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs[0].name == "main"


def test_calls_past_max_concurrent_rpcs_get_resource_exhausted(tmp_path, corpus):
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"main": job_spec([corpus / "*"])},
        tmp_path / "cache",
        limits={"max_concurrent_rpcs": 4},
    )
    proc = ServerProcess(cfg, tmp_path / "server.log")
    try:
        assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
        with grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.TokenFeedStub(channel)
            request = pb.StreamBatchesRequest(job="main", start_step=0, end_step=0)
            streams = [stub.StreamBatches(request, timeout=60) for _ in range(4)]
            for stream in streams:  # each is open and in flight
                assert next(stream).step == 0
            with pytest.raises(grpc.RpcError) as err:
                stub.GetBatch(pb.GetBatchRequest(job="main", step=0), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for stream in streams:
                stream.cancel()
            deadline = time.monotonic() + 10  # the server sees the cancellations
            while True:
                try:
                    assert stub.GetBatch(pb.GetBatchRequest(job="main", step=0), timeout=10).rows
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() < deadline, "cancelled streams still counted"
                    time.sleep(0.2)
    finally:
        assert proc.stop() == 0, proc.log()
