"""A stream of small batches is read in pieces, two calls open at once (client/_pieces.py): a
real server behind a recording gRPC proxy (it forwards each call and notes its steps, when it
opened and ended, and which request metadata it carried), with both clients.

The batches are those GetBatch gives, in order; the pieces of a segment follow one another
without a gap or an overlap of steps; the next piece's call opens before the one being read
ends; only a segment's first piece carries the trainer's wait report and a move count; large
batches keep one call a segment; and a server with no room for the piece opened ahead has the
stream read one call at a time, every batch delivered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import pytest
from support import ServerProcess, job_spec, write_config
from tokenfeed.client import AsyncClient, Client, _pieces
from tokenfeed.client._prefetch import FIRST_SEGMENT
from tokenfeed.client.moves import MOVES_KEY
from tokenfeed.client.waits import METADATA_KEY
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

STEPS = 2000  # a first segment (16 steps), then segments of several pieces


class RecordingFront(pb_grpc.TokenFeedServicer):
    """Forwards every call to `upstream` and records each StreamBatches call: [start, end,
    opened, ended, metadata keys, the upstream's error code or None]."""

    def __init__(self, upstream: str):
        self.calls: list[list] = []
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(upstream)
        self._stub = pb_grpc.TokenFeedStub(self._channel)
        self.server = grpc.server(futures.ThreadPoolExecutor(16))
        pb_grpc.add_TokenFeedServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def GetBatch(self, request, context):
        return self._stub.GetBatch(request, metadata=context.invocation_metadata())

    def DescribeJob(self, request, context):
        return self._stub.DescribeJob(request)

    def GetPlan(self, request, context):
        return self._stub.GetPlan(request)

    def StreamBatches(self, request, context):
        metadata = context.invocation_metadata()
        record = [request.start_step, request.end_step, time.monotonic(), None]
        record += [{k for k, _ in metadata}, None]  # metadata keys, the upstream's error
        with self._lock:
            self.calls.append(record)
        try:
            yield from self._stub.StreamBatches(request, metadata=metadata)
        except grpc.RpcError as e:
            record[5] = e.code()
            context.abort(e.code(), e.details())
        finally:
            record[3] = time.monotonic()

    def stop(self) -> None:
        self.server.stop(None)
        self._channel.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("pieces")
    cfg = write_config(tmp / "tf.yaml", {"main": job_spec([corpus / "*"])}, tmp / "cache")
    proc = ServerProcess(cfg, tmp / "server.log")
    assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def front(server):
    f = RecordingFront(server.address)
    yield f
    f.stop()


def expected(server) -> list[str]:
    with Client(server.address, job="main") as c:
        return [c.get_batch(s).fingerprint for s in range(STEPS)]


def read_sync(address: str) -> list[tuple[int, str]]:
    with Client(address, job="main") as c:
        return [(b.step, b.fingerprint) for b in c.iter_batches(0, STEPS)]


def read_async(address: str) -> list[tuple[int, str]]:
    async def run() -> list[tuple[int, str]]:
        async with AsyncClient(address, job="main") as c:
            return [(b.step, b.fingerprint) async for b in c.iter_batches(0, STEPS)]

    return asyncio.run(run())


@pytest.mark.parametrize("read", [read_sync, read_async], ids=["sync", "async"])
def test_small_batches_are_read_in_pieces_two_calls_open_at_once(server, front, read, monkeypatch):
    monkeypatch.setattr(_pieces, "PIECE_SECONDS", 0.0)  # pieces of FIRST_PIECE steps
    assert read(front.address) == list(enumerate(expected(server)))
    calls = sorted(front.calls)
    # The calls cover the steps once, one after another.
    assert [c[0] for c in calls] == [0] + [c[1] for c in calls[:-1]]
    assert calls[-1][1] == STEPS
    # Segments of 16 steps, then each 8 times the one before (the client's pace allows more),
    # each begun by a call that says it may move; the segments after the first are read in
    # pieces of FIRST_PIECE steps or more (the last one of a segment ends with it), which
    # never move and carry no wait report.
    starts, step, size = [], 0, FIRST_SEGMENT
    while step < STEPS:
        starts.append(step)
        step, size = step + size, size * 8
    assert [c[0] for c in calls if MOVES_KEY in c[4]] == starts, calls
    later = [c for c in calls if MOVES_KEY not in c[4]]
    assert len(later) >= 3 and all(METADATA_KEY not in c[4] for c in later)
    ends = {*starts[1:], STEPS}  # where segments end
    assert all(c[1] - c[0] >= _pieces.FIRST_PIECE for c in calls if c[1] not in ends), calls
    # The next piece's call opened before the one being read ended.
    assert any(b[2] < a[3] for a, b in zip(calls[1:], calls[2:], strict=False)), calls


@pytest.mark.parametrize("read", [read_sync, read_async], ids=["sync", "async"])
def test_large_batches_keep_one_call_a_segment(server, front, read, monkeypatch):
    monkeypatch.setattr(_pieces, "PIECE_BATCH_BYTES", 0)  # every batch counts as large
    assert read(front.address) == list(enumerate(expected(server)))
    calls = sorted(front.calls)
    assert [c[0] for c in calls] == [0] + [c[1] for c in calls[:-1]]
    assert all(MOVES_KEY in c[4] for c in calls[:1])
    # No two calls open at once: each opened once the one before it had ended.
    assert all(b[2] >= a[3] for a, b in zip(calls, calls[1:], strict=False)), calls
    # Segments (16, then 8 times longer each), but for one piece that ended
    # before the client saw that the batches are large.
    assert len(calls) <= 6, calls


@pytest.fixture(scope="module")
def crowded(tmp_path_factory, corpus):
    """A server that takes one call at a time (limits.max_concurrent_rpcs: 1)."""
    tmp = tmp_path_factory.mktemp("crowded")
    jobs = {"main": job_spec([corpus / "*"])}
    cfg = write_config(tmp / "tf.yaml", jobs, tmp / "cache", limits={"max_concurrent_rpcs": 1})
    proc = ServerProcess(cfg, tmp / "server.log")
    assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("read", [read_sync, read_async], ids=["sync", "async"])
def test_no_room_for_the_piece_ahead_reads_one_call_at_a_time(server, crowded, read):
    """The piece opened ahead gets RESOURCE_EXHAUSTED while the one before it is read: it is
    opened again once that one has ended, and every batch comes, in order."""
    front = RecordingFront(crowded.address)
    try:
        assert read(front.address) == list(enumerate(expected(server)))
    finally:
        front.stop()
    refused = [c for c in front.calls if c[5] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused, front.calls
    served = sorted(c for c in front.calls if c[5] is None)
    assert [c[0] for c in served] == [0] + [c[1] for c in served[:-1]]
    assert served[-1][1] == STEPS
