"""The asyncio client: the same calls, policy and failover as `Client`, on grpc.aio.

`iter_batches` is an async generator; a task reads the server stream ahead into a bounded
asyncio.Queue of `prefetch` decoded batches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from tokenfeed.client._client import _to_dict
from tokenfeed.client._credentials import Credentials
from tokenfeed.client._session import ClientBase, channel_options
from tokenfeed.client.batch import Batch
from tokenfeed.client.errors import DeadlineExceeded, TokenfeedClientError, from_rpc_error
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

_END = object()


class AsyncClient(ClientBase):
    """`async with AsyncClient(target, job=...) as feed: batch = await feed.get_batch(step)`."""

    def __init__(self, target: str, job: str | None = None, **options):
        """Options and credentials as for `Client` (docs/client.md)."""
        self.credentials = Credentials.from_options(target, options)
        super().__init__(target, job, **options)
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.TokenFeedStub]] = {}

    def stub(self, addr: str) -> pb_grpc.TokenFeedStub:
        if addr not in self._stubs:
            options = channel_options(self.session.policy)
            channel = self.credentials.aio_channel(addr, options)
            self._stubs[addr] = (channel, pb_grpc.TokenFeedStub(channel))
        return self._stubs[addr][1]

    async def close(self) -> None:
        channels = [c for c, _ in self._stubs.values()]
        self._stubs.clear()
        await asyncio.gather(*(c.close() for c in channels))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, method: str, request, job: str, rank: int, timeout: float | None):
        deadline = time.monotonic() + (timeout or self.session.policy.timeout)
        last: TokenfeedClientError | None = None
        for servers in self.session.rounds(job, rank, deadline):
            if isinstance(servers, float):
                await asyncio.sleep(servers)
                continue
            for addr in servers:
                await asyncio.sleep(self.session.pause_before(addr, deadline))
                if time.monotonic() >= deadline:
                    break
                try:
                    call = getattr(self.stub(addr), method)
                    return addr, await call(
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

    async def get_batch(
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
        addr, msg = await self._unary("GetBatch", request, name, rank, timeout)
        return self.session.batch(msg, addr, expected_step=step)

    async def describe(self, job: str | None = None) -> dict:
        name = self._job(job)
        _, info = await self._unary("DescribeJob", pb.DescribeJobRequest(job=name), name, 0, None)
        return _to_dict(info)

    async def iter_batches(
        self,
        start_step: int = 0,
        end_step: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        *,
        job: str | None = None,
        prefetch: int | None = None,
    ) -> AsyncIterator[Batch]:
        """Steps [start_step, end_step) in order, read ahead by a background task."""
        out: asyncio.Queue = asyncio.Queue(maxsize=prefetch or self.prefetch)
        task = asyncio.create_task(
            self._pump(out, self._job(job), start_step, end_step, rank, world_size)
        )
        try:
            while (item := await out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()

    async def _pump(
        self, out: asyncio.Queue, job: str, step: int, end: int | None, rank: int, world: int
    ) -> None:
        """Fill `out` with batches from `step` on, failing over like the sync prefetcher."""
        try:
            while end is None or step < end:
                deadline = time.monotonic() + self.session.policy.timeout
                last, before = None, step
                for servers in self.session.rounds(job, rank, deadline):
                    if isinstance(servers, float):
                        await asyncio.sleep(servers)
                        continue
                    for addr in servers:
                        await asyncio.sleep(self.session.pause_before(addr, deadline))
                        step, last = await self._stream(out, addr, job, step, end, rank, world)
                        if last is None or step > before:
                            break
                    if last is None or step > before:
                        break
                if last is not None and step == before:
                    raise self.session.give_up(job, last)
            await out.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, raised there
            await out.put(e)

    async def _stream(
        self,
        out: asyncio.Queue,
        addr: str,
        job: str,
        step: int,
        end: int | None,
        rank: int,
        world: int,
    ):
        """(next step, None) after a clean end, or (next step, error) after a retryable one."""
        call = self.stub(addr).StreamBatches(
            self.session.stream_request(job, step, end, rank, world),
            metadata=self.credentials.metadata(),
        )
        limit = self.session.silence_limit
        try:
            while (msg := await asyncio.wait_for(call.read(), limit)) is not grpc.aio.EOF:
                await out.put(self.session.batch(msg, addr, expected_step=step))
                step = msg.step + 1
            return step, None
        except TimeoutError:  # silent past the limit: taken for hung (see _client.py)
            call.cancel()
            self.session.mark_failed(addr)
            return step, DeadlineExceeded(f"{addr} sent nothing for {limit:.1f}s")
        except grpc.RpcError as e:
            err = from_rpc_error(e, addr)
            # A stream we did not cancel was cut by the server: draining, or dying.
            if not (err.retryable or e.code() == grpc.StatusCode.CANCELLED):
                raise err from None
            self.session.mark_failed(addr, err)
            return step, err
