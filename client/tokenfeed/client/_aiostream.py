"""The asyncio client's stream: StreamBatches read on the trainer's own task as it asks (the
default), or by a task ahead into a bounded asyncio.Queue, in segments and pieces as the sync
client reads them (_prefetch.py, _pieces.py), failing over with the same policy
(_attempts.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
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
    """Steps [start, end) of one (job, rank, world size), read on the caller's task as it asks
    for them (`depth` 0), or ahead by a task into a queue of `depth` batches."""

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
        self._batches = self._stream()
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        if depth:
            self._queue = asyncio.Queue(maxsize=depth)
            self._task = asyncio.create_task(self._pump())

    async def next(self) -> Batch | None:
        """The next batch (None after the last one)."""
        asked = time.perf_counter()
        if self._queue is None:
            try:
                item = await anext(self._batches)
            except StopAsyncIteration:  # ended, failed before or closed: it stays so
                return None
        else:
            got = await self._queue.get()
            if got is _END:
                self._queue.put_nowait(_END)  # and again to a caller that asks once more
                return None
            if isinstance(got, BaseException):
                raise got
            item = got
        if self._meter is not None:
            self._meter.record(time.perf_counter() - asked)
        self.step = item.step + 1
        return item

    def close(self) -> None:
        """Stop a stream read ahead by its task (a warm start's); `aclose` stops either."""
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        """Stop the stream: its task cancelled, or its calls cancelled where it is read on the
        caller's task."""
        if self._task is not None:
            self._task.cancel()
        elif not getattr(self._batches, "ag_running", False):  # else its reader ends it
            await self._batches.aclose()

    def _done(self) -> bool:
        return self.end is not None and self._fetched >= self.end

    async def _pump(self) -> None:
        """The read-ahead task: the batches into the queue, then the end or the error."""
        assert self._queue is not None
        try:
            async with contextlib.aclosing(self._batches) as batches:  # cancelled: calls too
                async for batch in batches:
                    await self._queue.put(batch)
            await self._queue.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, raised there
            await self._queue.put(e)

    async def _stream(self) -> AsyncGenerator[Batch, None]:
        """The batches from the next step on, failing over like the sync prefetcher."""
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
                # Closed with the stream: the segment's calls are cancelled at once.
                async with contextlib.aclosing(self._read(action, stub, attempts.moves)) as read:
                    async for batch in read:
                        yield batch
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
                return
            attempts.delivered()  # a segment ended: the next one, from the top
        raise attempts.error()

    async def _read(
        self, action: Try, stub: pb_grpc.TokenFeedStub, moves: int
    ) -> AsyncGenerator[Batch, None]:
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
        silence = self.session.silence_limit
        try:
            while current is not None:
                call, start, stop = current
                reading = time.monotonic()
                try:
                    while True:
                        # The server's silence is timed while a message is awaited, never while
                        # the trainer holds the stream (TimeoutError when it expires): a timeout
                        # a read, on whichever task reads (asyncio.wait_for made a task a
                        # message: eight consumers of [8, 2048] ranks 0.0101-0.0103 CPU s per M
                        # tokens against 0.0087-0.0089, docs/client.md).
                        async with asyncio.timeout(silence):
                            msg = await call.read()
                        if msg is grpc.aio.EOF:
                            break
                        batch = self.session.batch(msg, action.addr, expected_step=self._fetched)
                        if ahead is None and self._pieces.open_next(batch, stop, end):
                            ahead = self._open(stub, stop, end, later)
                        yield batch
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
