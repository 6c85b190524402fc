"""The sync client's streams: StreamBatches read on the trainer's own thread, or by a
read-ahead thread into a bounded queue.

Read on the trainer's thread (the default), a batch is decoded when the trainer asks for it,
while gRPC's transport keeps receiving the next messages up to its HTTP/2 window: no thread
hand-off, about 30 us less client CPU per [8, 2048] batch (bench/, wire section). A read-ahead
thread (`prefetch` >= 1) also decodes ahead; its bounded queue is the flow control: when the
trainer falls behind, the thread stops reading, HTTP/2 windows fill, and the server stops
producing. Either way the stream is read in segments (`end_step` set about `report_seconds`
ahead) so each new segment's request carries the trainer's wait report (waits.py) and lands
on the (job, rank)'s current home server, which moves when the fleet grows or shrinks; a
segment of small batches is read as several short calls, the next one opened ahead
(_pieces.py). Failover between servers is `Attempts`' policy.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Generator, Iterator
from typing import Protocol, cast

import grpc
from tokenfeed.client._attempts import Attempts, Try
from tokenfeed.client._credentials import Credentials
from tokenfeed.client._pieces import Piece, Pieces, later_metadata
from tokenfeed.client._session import Session
from tokenfeed.client.batch import Batch
from tokenfeed.client.moves import with_moves
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc


class StreamSource(Protocol):
    """What a prefetcher needs of its client (_client.Client): its session, credentials,
    stubs (and a new connection where a serving worker asks a stream to move) and how long a
    stream segment runs."""

    session: Session
    credentials: Credentials
    report_seconds: float

    def stub(self, addr: str) -> pb_grpc.TokenFeedStub: ...

    def reconnect(self, addr: str, stub: pb_grpc.TokenFeedStub) -> None: ...

    def pause(self, seconds: float, wake_on: tuple[str, ...], stop: threading.Event) -> bool: ...


_END = object()
# Steps of a stream's first segment, and the bounds of later ones (sized to last about
# `report_seconds` at the rate the last one ran).
FIRST_SEGMENT, MAX_SEGMENT = 16, 1 << 16
# Steps a warm start fetches when the client reads no batch ahead (`prefetch=0`).
WARM_STEPS = 4


def next_segment(steps: int, seconds: float, target: float) -> int:
    """Steps of the next segment: `target` seconds at the rate of the last one, growing at
    most 8-fold per segment (a fast start, e.g. warm batches, is not the trainer's pace)."""
    rate = steps / max(seconds, 1e-6)
    return max(FIRST_SEGMENT, min(MAX_SEGMENT, steps * 8, int(rate * target)))


class Handoff:
    """The bounded queue from the read-ahead thread to the consumer, of two C-implemented
    SimpleQueues (the items, and a token per free place): a batch passes with no Python-level
    lock or condition, which cost the client more per batch than decoding it (bench/, wire
    section)."""

    def __init__(self, depth: int):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(depth):
            self._free.put(None)

    def put(self, item: object, timeout: float) -> bool:
        """Queue `item` once a place is free; False if none freed within `timeout` seconds."""
        try:
            self._free.get(timeout=timeout)
        except queue.Empty:
            return False
        self._items.put(item)
        return True

    def get(self, timeout: float) -> object:
        """The next item (queue.Empty if none came within `timeout` seconds)."""
        item = self._items.get(timeout=timeout)
        self._free.put(None)
        return item


class Prefetcher:
    """Steps [start, end) of one (job, rank, world size), read on the caller's thread (`depth`
    0) or ahead by a thread into a queue of `depth` batches."""

    def __init__(
        self,
        client: StreamSource,
        job: str,
        start: int,
        end: int | None,
        rank: int,
        world: int,
        depth: int,
    ):
        self.client, self.session = client, client.session
        self.job, self.step, self.end, self.rank, self.world = job, start, end, rank, world
        self.queue = Handoff(depth)
        self._stop = threading.Event()
        self._calls: list[grpc.Call] = []  # the calls open (a segment's piece and the next)
        self._segment, self._pieces = FIRST_SEGMENT, Pieces()
        self._watchdog = _Watchdog(self.session.silence_limit, self._stop)
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(
                target=self._run, name="tokenfeed-prefetch", daemon=True
            )
            self._thread.start()

    def __iter__(self) -> Iterator[Batch]:
        meter = self.session.waits(self.job, self.rank) if self.session.report_waits else None
        if self._thread is None:
            yield from self._inline(meter)
            return
        while True:
            # What the trainer waits for: the time from asking for a batch to having it.
            asked = time.perf_counter()
            item = self._get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            if meter is not None:
                meter.record(time.perf_counter() - asked)
            yield cast(Batch, item)

    def _inline(self, meter) -> Iterator[Batch]:
        """The batches read on this thread, as the trainer asks for them."""
        pump = self._pump()
        try:
            while True:
                asked = time.perf_counter()
                try:
                    batch = next(pump)
                except StopIteration:
                    return
                if meter is not None:
                    meter.record(time.perf_counter() - asked)
                yield batch
        finally:
            pump.close()

    def _get(self) -> object:
        assert self._thread is not None
        while True:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set() and not self._thread.is_alive():
                    return _END  # closed: what was queued has been delivered

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            if self.queue.put(item, timeout=0.1):
                return True
        return False

    def _run(self) -> None:
        """The read-ahead thread: the batches into the queue, then the end or the error."""
        pump = self._pump()
        try:
            while True:
                try:
                    batch = next(pump)
                except StopIteration as end:
                    if end.value:
                        self._put(_END)
                    return
                if not self._put(batch):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)
        finally:
            pump.close()

    def _done(self) -> bool:
        return self._stop.is_set() or (self.end is not None and self.step >= self.end)

    def _pump(self) -> Generator[Batch, None, bool]:
        """The batches, streamed until the end, failing over; returns False if stopped."""
        attempts = Attempts(
            self.session, self.job, self.rank, self.client.credentials.metadata, waits=True
        )
        for action in attempts:
            if isinstance(action, float):
                if self.client.pause(action, attempts.wake_on, self._stop):
                    return False
                continue
            before = self.step
            stub = self.client.stub(action.addr)
            try:
                yield from self._stream(action, stub, attempts.moves)
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return False
                if attempts.moving(action, e, progressed=self.step > before):
                    self.client.reconnect(action.addr, stub)
                    continue
                attempts.failed(action, e, stream=True, progressed=self.step > before)
                continue
            if self._done():
                return not self._stop.is_set()
            attempts.delivered()  # a segment ended: the next one, from the top of the ranking
        raise attempts.error()

    def _stream(self, action: Try, stub: pb_grpc.TokenFeedStub, moves: int) -> Iterator[Batch]:
        """One segment, read in pieces (_pieces.py): the next piece's call opened once the one
        being read delivers its first batch."""
        end = self.step + self._segment
        if self.end is not None:
            end = min(end, self.end)
        first, started = self.step, time.monotonic()
        later = later_metadata(action.metadata)
        current: Piece | None = self._open(stub, self.step, end, with_moves(action.metadata, moves))
        ahead: Piece | None = None
        try:
            while current is not None:
                call, start, stop = current
                reading = time.monotonic()
                self._watchdog.watch(call)
                try:
                    for msg in call:
                        self._watchdog.pause()  # the trainer's time is not the server's silence
                        batch = self.session.batch(msg, action.addr, expected_step=self.step)
                        if ahead is None and self._pieces.open_next(batch, stop, end):
                            ahead = self._open(stub, stop, end, later)
                        yield batch
                        if self._stop.is_set():
                            return
                        self.step = batch.step + 1
                        self._watchdog.watch(call)
                except grpc.RpcError as e:
                    if not self._pieces.refused(e, start, first, self.step):
                        raise
                    self._calls.remove(call)  # no room for it ahead: again now, one at a time
                    current = self._open(stub, self.step, end, later)
                    continue
                if self.step != stop or ahead is None:
                    break  # the segment's end, or a piece the server ended early
                self._pieces.read(start, stop, time.monotonic() - reading)
                self._calls.remove(call)
                current, ahead = ahead, None
        finally:
            self._watchdog.pause()
            for piece in (current, ahead):
                if piece is not None:
                    piece[0].cancel()
            self._calls.clear()
        if self.step == end:
            target = self.client.report_seconds
            self._segment = next_segment(end - first, time.monotonic() - started, target)

    def _open(self, stub: pb_grpc.TokenFeedStub, start: int, end: int, metadata) -> Piece:
        """The call of the piece from `start` (up to `end`, the segment's)."""
        stop = self._pieces.stop(start, end)
        request = self.session.stream_request(self.job, start, stop, self.rank, self.world)
        call = stub.StreamBatches(request, metadata=metadata)
        self._calls.append(call)
        return call, start, stop

    def close(self) -> None:
        self._stop.set()
        for call in list(self._calls):
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)


class Warmed:
    """A warm start's batches [step, end), handed to the first call that asks for `step`."""

    def __init__(self, stream: Prefetcher, step: int, end: int):
        self.stream, self.next_step, self.end = stream, step, end
        self._batches = iter(stream)

    def take(self) -> Batch:
        batch = next(self._batches)
        self.next_step = batch.step + 1
        return batch

    @property
    def exhausted(self) -> bool:
        return self.next_step >= self.end

    def close(self) -> None:
        self.stream.close()


class _Watchdog:
    """Cancels a stream whose server has been silent for `limit` seconds while we wait on it.

    A hung server keeps its connection open and sends nothing; the cancel surfaces as
    CANCELLED in the reading thread, which fails over. One checker thread per stream: arming
    is two assignments per message."""

    def __init__(self, limit: float, stop: threading.Event):
        self.limit, self._stop = limit, stop
        self._call: grpc.Call | None = None
        self._since: float | None = None
        threading.Thread(target=self._run, name="tokenfeed-watchdog", daemon=True).start()

    def watch(self, call: grpc.Call) -> None:
        self._call, self._since = call, time.monotonic()

    def pause(self) -> None:
        self._since = None

    def _run(self) -> None:
        while not self._stop.wait(min(self.limit / 4, 0.5)):
            since, call = self._since, self._call
            if since is not None and call is not None and time.monotonic() - since > self.limit:
                self._since = None
                call.cancel()
