"""Streams spread evenly over a node's serving workers (serve/spread.py, client/moves.py): the
kernel hands connections to workers by a hash, so a worker serving more streams than another
refuses a new one that says it can move (UNAVAILABLE with a trailer), and tokenfeed's clients
open a new connection and ask again, getting the same batches. A call that cannot move (another
client), or has moved 3 times the workers, is served where it lands."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from support import metric, scrape, workers_server
from tokenfeed.client import AsyncClient, Client
from tokenfeed.client.moves import MOVE_TRAILER, MOVES_KEY
from tokenfeed.server.pack import arenaformat
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

STEPS = 40
OWN = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own, hashed anew


class Held:
    """A raw StreamBatches call on a connection of its own, held open after its first batch
    (the server then waits on flow control: the call stays among its worker's streams)."""

    def __init__(self, address: str, moves: int | None):
        self.channel = grpc.insecure_channel(address, options=OWN)
        stub = pb_grpc.TokenFeedStub(self.channel)
        request = pb.StreamBatchesRequest(job="main", start_step=0, end_step=100_000)
        metadata = None if moves is None else ((MOVES_KEY, str(moves)),)
        self.call = stub.StreamBatches(request, metadata=metadata, timeout=60)
        self.error: grpc.RpcError | None = None
        try:
            next(self.call)
        except grpc.RpcError as e:
            self.error = e

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def _counts(proc, tmp_path) -> list[int]:
    table = arenaformat.node_dir(tmp_path / "cache") / "streams"
    return np.fromfile(table, dtype=np.int64).tolist()


def _settled(proc, tmp_path, want: int) -> list[int]:
    """The table once it counts `want` streams (a cancelled call leaves its worker soon after)."""
    deadline = time.monotonic() + 10
    while sum(counts := _counts(proc, tmp_path)) != want:
        assert time.monotonic() < deadline, counts
        time.sleep(0.02)
    return counts


@pytest.fixture
def two_workers(tmp_path, corpus):
    proc = workers_server(tmp_path, corpus)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_worker_refuses_a_stream_that_can_move_while_another_serves_fewer(tmp_path, two_workers):
    proc, held = two_workers, []
    try:
        refused = None
        while refused is None:  # until a call lands on the busier worker (the kernel's hash)
            assert len(held) < 40, "no call ever landed on the busier worker"
            call = Held(proc.address, moves=0)
            if call.error is not None:
                refused = call
                break
            held.append(call)
            counts = _counts(proc, tmp_path)
            assert sum(counts) == len(held) and max(counts) - min(counts) <= 1, counts
        err = refused.error
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "serves more streams than another" in err.details()
        assert (MOVE_TRAILER, "1") in tuple(err.trailing_metadata())
        refused.close()
        # Never refused: a call that cannot move (no MOVES_KEY: another client's), and one
        # that has moved 3 times the workers already. Both land where the kernel puts them.
        for moves in (None, 6):
            for _ in range(100):  # until one lands on the busier worker (half of them do)
                call = Held(proc.address, moves=moves)
                assert call.error is None, call.error
                counts = _counts(proc, tmp_path)
                held.append(call)
                if max(counts) - min(counts) >= 2:  # landed on the busier worker: served
                    break
                call.close()
                held.pop()
                _settled(proc, tmp_path, len(held))
            else:
                raise AssertionError(f"no call landed on the busier worker: {counts}")
        time.sleep(1.5)  # the workers send their counters every second
        moved = metric(scrape(proc.metrics), "tokenfeed_streams_moved_total")
        assert moved >= 1
    finally:
        for call in held:
            call.close()
    assert _settled(proc, tmp_path, 0) == [0, 0]  # every stream left its worker's count


def _crowd(proc, tmp_path) -> list[Held]:
    """Streams that cannot move, held on one worker only: [2, 0] in the table."""
    held: list[Held] = []
    for _ in range(200):
        call = Held(proc.address, moves=None)
        assert call.error is None, call.error
        counts = _counts(proc, tmp_path)
        if counts[0] > 0 and counts[1] == 0 or counts[1] > 0 and counts[0] == 0:
            held.append(call)
            if max(counts) == 2:
                return held
            continue
        call.close()
        _settled(proc, tmp_path, len(held))
    raise AssertionError(f"no two connections on one worker in 200: {_counts(proc, tmp_path)}")


def test_clients_move_off_a_crowded_worker_and_read_the_same_batches(tmp_path, two_workers):
    proc = two_workers
    with Client(proc.address, job="main") as c:
        expected = [b.fingerprint for b in c.iter_batches(0, STEPS)]
    held = _crowd(proc, tmp_path)
    try:
        moved_before = metric(scrape(proc.metrics), "tokenfeed_streams_moved_total")
        moved_clients = 0
        for _ in range(40):  # until one client's stream landed on the crowded worker
            with Client(proc.address, job="main") as c:
                assert [b.fingerprint for b in c.iter_batches(0, STEPS)] == expected
                moved_clients += bool(c._retired)  # it opened a new connection
            if moved_clients >= 2:
                break
        assert moved_clients >= 2

        async def read() -> tuple[list[str], bool]:
            async with AsyncClient(proc.address, job="main") as a:
                got = [b.fingerprint async for b in a.iter_batches(0, STEPS)]
                return got, bool(a._retired)

        moved_async = 0
        for _ in range(40):
            got, moved = asyncio.run(read())
            assert got == expected
            moved_async += moved
            if moved_async:
                break
        assert moved_async
        time.sleep(1.5)  # the workers send their counters every second
        moved = metric(scrape(proc.metrics), "tokenfeed_streams_moved_total") - moved_before
        assert moved >= moved_clients + moved_async
    finally:
        for call in held:
            call.close()
