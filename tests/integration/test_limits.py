"""Bounded under abuse: oversized requests, huge names, 64-bit values and hundreds of streams that
never read get a clear status or a bounded cost, and other clients are served meanwhile."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from support import ServerProcess, job_spec, write_config
from tokenfeed.client import Client
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

STALLED = 300
# What the server may grow by while STALLED streams sit unread (each holds at most
# stream_ahead built batches plus its HTTP/2 window); documented in docs/configuration.md.
STALLED_GROWTH_MB = 150


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("limits")
    jobs = {"main": job_spec([corpus / "*"], seq_len=1024, global_batch_size=8)}
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
        assert c.get_batch(0)["input_ids"].shape == (8, 1024)


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
        for request in (pb.GetBatchRequest(job="main", step=0, world_size=2**32 + 1),
                        pb.GetBatchRequest(job="main", step=0, world_size=2**40)):  # fmt: skip
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
    before = rss_mb(server.proc.pid)
    channels = [grpc.insecure_channel(server.address) for _ in range(STALLED // 10)]
    calls = []
    try:
        for i in range(STALLED):  # ten streams per connection, none ever read
            stub = pb_grpc.TokenFeedStub(channels[i % len(channels)])
            request = pb.StreamBatchesRequest(job="main", start_step=i, end_step=0)
            calls.append(stub.StreamBatches(request, timeout=120))
        time.sleep(5)  # every stream has built what it may build ahead
        grown = rss_mb(server.proc.pid) - before
        # Another client is served promptly meanwhile.
        started = time.monotonic()
        with Client(server.address, job="main") as c:
            assert c.get_batch(7)["input_ids"].shape == (8, 1024)
        assert time.monotonic() - started < 10
        print(f"\n{STALLED} stalled streams: server RSS {before:.0f} MB -> +{grown:.0f} MB")
        assert grown < STALLED_GROWTH_MB, f"{STALLED} stalled streams grew the server {grown} MB"
    finally:
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()
    # After the streams are cancelled the server serves on.
    done = threading.Event()
    with Client(server.address, job="main") as c:
        assert c.get_batch(9)["input_ids"].shape == (8, 1024)
        done.set()
    assert done.is_set()
