"""The asyncio client's stream: a task that reads StreamBatches ahead into a bounded
asyncio.Queue, in segments and pieces as the sync client reads them (_prefetch.py,
_pieces.py), failing over with the same policy (_attempts.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import grpc
from tokenfeed.client._attempts import Attempts, Try
from tokenfeed.client._credentials import Credentials
from tokenfeed.client._pieces import Piece, Pieces, later_metadata
from tokenfeed.client._prefetch import FIRST_SEGMENT, next_segment
from tokenfeed.client._session import Session
from tokenfeed.client.batch import Batch
from tokenfeed.client.errors import DeadlineExceeded
from tokenfeed.client.moves import with_moves
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

_END = object()


class AsyncSource(Protocol):
    """What a stream needs of its client (_aio.AsyncClient): its session, credentials, stubs,
    a new connection where a serving worker asks a stream to move, and how long a segment
    runs."""

    session: Session
    credentials: Credentials
    report_seconds: float

    def stub(self, addr: str) -> pb_grpc.TokenFeedStub: ...

    async def reconnect(self, addr: str, stub: pb_grpc.TokenFeedStub) -> None: ...

    async def pause(self, seconds: float, wake_on: tuple[str, ...]) -> None: ...


class AsyncStream:
    """Steps [start, end) of one (job, rank, world size), read ahead by a task."""

    def __init__(
        self,
        client: AsyncSource,
        job: str,
        start: int,
        end: int | None,
        rank: int,
        world: int,
        depth: int,
    ):
        self.client, self.session = client, client.session
        self.job, self.rank, self.world = job, rank, world
        self.step, self.end = start, end  # the next step handed over; the end
        self._fetched = start  # the next step to fetch
        self._segment, self._pieces = FIRST_SEGMENT, Pieces()
        self._meter = self.session.waits(job, rank) if self.session.report_waits else None
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=depth)
        self._task = asyncio.create_task(self._pump())

    async def next(self) -> Batch | None:
        """The next batch (None after the last one)."""
        asked = time.perf_counter()
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # and again to a caller that asks once more
            return None
        if isinstance(item, BaseException):
            raise item
        if self._meter is not None:
            self._meter.record(time.perf_counter() - asked)
        self.step = item.step + 1
        return item

    def close(self) -> None:
        self._task.cancel()

    def _done(self) -> bool:
        return self.end is not None and self._fetched >= self.end

    async def _pump(self) -> None:
        """Fill the queue from the next step on, failing over like the sync prefetcher."""
        try:
            attempts = Attempts(
                self.session, self.job, self.rank, self.client.credentials.metadata, waits=True
            )
            for action in attempts:
                if isinstance(action, float):
                    await self.client.pause(action, attempts.wake_on)
                    continue
                before = self._fetched
                stub = self.client.stub(action.addr)
                try:
                    await self._read(action, stub, attempts.moves)
                except grpc.RpcError as e:
                    if attempts.moving(action, e, progressed=self._fetched > before):
                        await self.client.reconnect(action.addr, stub)
                        continue
                    attempts.failed(action, e, stream=True, progressed=self._fetched > before)
                    continue
                except TimeoutError:  # silent past the limit: taken for hung (see _prefetch)
                    limit = self.session.silence_limit
                    err = DeadlineExceeded(f"{action.addr} sent nothing for {limit:.1f}s")
                    attempts.give_up_on(action.addr, err)
                    if self._fetched > before:
                        attempts.delivered()
                    continue
                if self._done():
                    await self._queue.put(_END)
                    return
                attempts.delivered()  # a segment ended: the next one, from the top
            raise attempts.error()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, raised there
            await self._queue.put(e)

    async def _read(self, action: Try, stub: pb_grpc.TokenFeedStub, moves: int) -> None:
        """One segment, read in pieces as the sync client reads it (_pieces.py)."""
        end = self._fetched + self._segment
        if self.end is not None:
            end = min(end, self.end)
        first, started = self._fetched, time.monotonic()
        later = later_metadata(action.metadata)
        current: Piece | None = self._open(
            stub, self._fetched, end, with_moves(action.metadata, moves)
        )
        ahead: Piece | None = None
        silence, loop = self.session.silence_limit, asyncio.get_running_loop()
        try:
            while current is not None:
                call, start, stop = current
                reading = time.monotonic()
                try:
                    # The server's silence is timed while a message is awaited, never while the
                    # queue is full (the trainer's time): one timeout rescheduled around each
                    # read, where asyncio.wait_for made a task a message (eight consumers of
                    # [8, 2048] ranks: 0.0087-0.0089 CPU s per M tokens against 0.0101-0.0103,
                    # docs/client.md). TimeoutError when it expires.
                    async with asyncio.timeout(None) as quiet:
                        while True:
                            quiet.reschedule(loop.time() + silence)
                            msg = await call.read()
                            quiet.reschedule(None)
                            if msg is grpc.aio.EOF:
                                break
                            batch = self.session.batch(
                                msg, action.addr, expected_step=self._fetched
                            )
                            if ahead is None and self._pieces.open_next(batch, stop, end):
                                ahead = self._open(stub, stop, end, later)
                            await self._queue.put(batch)
                            self._fetched = batch.step + 1
                except grpc.RpcError as e:
                    if not self._pieces.refused(e, start, first, self._fetched):
                        raise
                    current = self._open(stub, self._fetched, end, later)  # one at a time now
                    continue
                if self._fetched != stop or ahead is None:
                    break  # the segment's end, or a piece the server ended early
                self._pieces.read(start, stop, time.monotonic() - reading)
                current, ahead = ahead, None
        finally:
            for piece in (current, ahead):
                if piece is not None:
                    piece[0].cancel()
        if self._fetched == end:
            target = self.client.report_seconds
            self._segment = next_segment(end - first, time.monotonic() - started, target)

    def _open(self, stub: pb_grpc.TokenFeedStub, start: int, end: int, metadata) -> Piece:
        """(the call, its first step, its end) of the piece from `start` (up to `end`)."""
        stop = self._pieces.stop(start, end)
        request = self.session.stream_request(self.job, start, stop, self.rank, self.world)
        return stub.StreamBatches(request, metadata=metadata), start, stop
