"""The synchronous client.

`get_batch` is one unary call; `iter_batches` keeps up to `prefetch` decoded batches ready in a
background thread that reads a server stream (StreamBatches), so the trainer never waits while
the servers keep up. Both fail over along the rendezvous ranking on UNAVAILABLE or
DEADLINE_EXCEEDED and continue from the same step: batches are a pure function of the step, so
the sequence is the same whichever server sends it.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Iterator

import grpc
from google.protobuf import json_format
from tokenfeed.client._credentials import Credentials
from tokenfeed.client._session import ClientBase, channel_options
from tokenfeed.client.batch import Batch
from tokenfeed.client.errors import TokenfeedClientError, from_rpc_error
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

_END = object()


class Client(ClientBase):
    """`Client("host:port" | "h1:p,h2:p" | "dns:///name:port", job="name")`."""

    def __init__(self, target: str, job: str | None = None, **options):
        """Options: timeout, attempt_timeout, prefetch, verify, backoff, max_backoff,
        suspect_seconds, max_pushback, keepalive_seconds, keepalive_timeout_seconds;
        credentials: tls, tls_root_certs, tls_client_cert, tls_client_key, tls_server_name,
        token, token_file (docs/client.md)."""
        self.credentials = Credentials.from_options(target, options)
        super().__init__(target, job, **options)
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.TokenFeedStub]] = {}
        self._streams: weakref.WeakSet[_Prefetcher] = weakref.WeakSet()
        self._closed = False
        self._lock = threading.Lock()
        self._channel_options = channel_options(self.session.policy)

    def stub(self, addr: str) -> pb_grpc.TokenFeedStub:
        with self._lock:
            if self._closed:
                raise ValueError("this Client is closed")
            if addr not in self._stubs:
                channel = self.credentials.channel(addr, self._channel_options)
                self._stubs[addr] = (channel, pb_grpc.TokenFeedStub(channel))
            return self._stubs[addr][1]

    def close(self) -> None:
        """Stop every open `iter_batches` stream and close the channels."""
        with self._lock:
            self._closed = True
            streams = list(self._streams)
        for stream in streams:
            stream.close()
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, method: str, request, job: str, rank: int, timeout: float | None):
        deadline = time.monotonic() + (timeout or self.session.policy.timeout)
        last: TokenfeedClientError | None = None
        for servers in self.session.rounds(job, rank, deadline):
            if isinstance(servers, float):
                time.sleep(servers)
                continue
            for addr in servers:
                time.sleep(self.session.pause_before(addr, deadline))
                if time.monotonic() >= deadline:
                    break
                try:
                    call = getattr(self.stub(addr), method)
                    return addr, call(
                        request,
                        timeout=self.session.attempt_timeout(deadline),
                        metadata=self.credentials.metadata(),
                    )
                except grpc.RpcError as e:
                    last = from_rpc_error(e, addr)
                    if not last.retryable:
                        raise last from None
                    self.session.mark_failed(addr, last)
        raise self.session.give_up(job, last)

    def get_batch(
        self,
        step: int,
        rank: int = 0,
        world_size: int = 1,
        *,
        job: str | None = None,
        timeout: float | None = None,
    ) -> Batch:
        name = self._job(job)
        request = pb.GetBatchRequest(job=name, step=step, rank=rank, world_size=world_size)
        addr, msg = self._unary("GetBatch", request, name, rank, timeout)
        return self.session.batch(msg, addr, expected_step=step)

    def iter_batches(
        self,
        start_step: int = 0,
        end_step: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        *,
        job: str | None = None,
        prefetch: int | None = None,
    ) -> Iterator[Batch]:
        """Steps [start_step, end_step) in order (end None: until the caller stops)."""
        stream = _Prefetcher(
            self, self._job(job), start_step, end_step, rank, world_size, prefetch or self.prefetch
        )
        with self._lock:
            self._streams.add(stream)
        try:
            yield from stream
        finally:
            stream.close()

    def describe(self, job: str | None = None) -> dict:
        name = self._job(job)
        _, info = self._unary("DescribeJob", pb.DescribeJobRequest(job=name), name, 0, None)
        return _to_dict(info)

    def explain(
        self, step: int, rank: int = 0, world_size: int = 1, *, job: str | None = None
    ) -> dict:
        """Where each row of the batch comes from: dataset, source, record, token ranges."""
        name = self._job(job)
        request = pb.GetBatchRequest(job=name, step=step, rank=rank, world_size=world_size)
        _, explanation = self._unary("Explain", request, name, rank, None)
        return _to_dict(explanation)

    def list_jobs(self) -> list[dict]:
        _, resp = self._unary("ListJobs", pb.ListJobsRequest(), "", 0, None)
        return [_to_dict(j) for j in resp.jobs]


class _Prefetcher:
    """A thread that reads StreamBatches into a bounded queue, failing over between servers.

    The bounded queue is the flow control: when the trainer falls behind, the thread stops
    reading, HTTP/2 windows fill, and the server stops producing."""

    def __init__(
        self,
        client: Client,
        job: str,
        start: int,
        end: int | None,
        rank: int,
        world: int,
        depth: int,
    ):
        self.client, self.session = client, client.session
        self.job, self.step, self.end, self.rank, self.world = job, start, end, rank, world
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._call = None
        self._watchdog = _Watchdog(self.session.silence_limit, self._stop)
        self._thread = threading.Thread(target=self._run, name="tokenfeed-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[Batch]:
        while True:
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set() and not self._thread.is_alive():
                    return  # closed: what was queued has been delivered
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            self._pump()
            self._put(_END)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def _pump(self) -> None:
        while self.end is None or self.step < self.end:
            progressed = self._one_pass()
            if self._stop.is_set() or (self.end is not None and self.step >= self.end):
                return
            if not progressed:
                raise self._failure

    def _one_pass(self) -> bool:
        """Try servers until one stream ends cleanly or fails after progress. True if any
        batch was delivered (the deadline renews with progress)."""
        deadline = time.monotonic() + self.session.policy.timeout
        last: Exception | None = None
        for servers in self.session.rounds(self.job, self.rank, deadline):
            if isinstance(servers, float):
                if self._stop.wait(servers):
                    return True
                continue
            for addr in servers:
                if self._stop.wait(self.session.pause_before(addr, deadline)):
                    return True
                before = self.step
                try:
                    self._stream(addr)
                    return True
                except grpc.RpcError as e:
                    if self._stop.is_set():
                        return True
                    err = from_rpc_error(e, addr)
                    # A stream we did not cancel was cut by the server: draining, or dying.
                    if not (err.retryable or e.code() == grpc.StatusCode.CANCELLED):
                        raise err from None
                    last = err
                    self.session.mark_failed(addr, err)
                    if self.step > before:
                        return True
        self._failure = self.session.give_up(self.job, last)
        return False

    def _stream(self, addr: str) -> None:
        request = self.session.stream_request(self.job, self.step, self.end, self.rank, self.world)
        metadata = self.client.credentials.metadata()
        call = self._call = self.client.stub(addr).StreamBatches(request, metadata=metadata)
        self._watchdog.watch(call)
        try:
            for msg in call:
                self._watchdog.pause()  # a full queue is the trainer's doing, not the server's
                batch = self.session.batch(msg, addr, expected_step=self.step)
                if not self._put(batch):
                    return
                self.step = msg.step + 1
                self._watchdog.watch(call)
        finally:
            self._watchdog.pause()
            call.cancel()

    def close(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(timeout=5)


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


def _to_dict(msg) -> dict:
    """The message as a dict, with 64-bit integers as ints (JSON mapping makes them strings)."""
    out = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for field in msg.DESCRIPTOR.fields:
        value = out.get(field.name)
        if field.message_type is not None and value is not None:
            items = getattr(msg, field.name)
            if field.is_repeated:
                out[field.name] = [_to_dict(m) for m in items]
            else:
                out[field.name] = _to_dict(items)
        elif field.cpp_type in (field.CPPTYPE_INT64, field.CPPTYPE_UINT64) and value is not None:
            out[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return out
