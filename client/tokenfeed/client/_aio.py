"""The asyncio client: the same calls, policy (_attempts.py) and failover as `Client`, on
grpc.aio.

`iter_batches` is an async generator that reads the server stream on the trainer's own task as
it asks for each batch (by default), or with `prefetch` >= 1 in a task ahead into a bounded
asyncio.Queue of that many decoded batches; in segments and pieces like the sync client's
(_aiostream.py), so the trainer's wait report travels with each segment's request. `warm`
starts such a task before the trainer asks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from tokenfeed.client._aiostream import AsyncStream as _Stream
from tokenfeed.client._attempts import Attempts
from tokenfeed.client._base import ClientBase
from tokenfeed.client._client import _to_dict
from tokenfeed.client._comeback import apause
from tokenfeed.client._plans import check_agreed, check_resume, held, held_too_long, links_of
from tokenfeed.client._prefetch import WARM_STEPS
from tokenfeed.client._session import batch_stub, channel_options
from tokenfeed.client.batch import Batch
from tokenfeed.client.moves import retire
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc


class AsyncClient(ClientBase):
    """`async with AsyncClient(target, job=...) as feed: batch = await feed.get_batch(step)`
    (options as for `Client`)."""

    def _open(self) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.TokenFeedStub]] = {}
        self._retired: list[tuple[float, grpc.aio.Channel]] = []  # replaced by `reconnect`
        self._warm: dict[tuple[str, int, int], _Stream] = {}

    def stub(self, addr: str) -> pb_grpc.TokenFeedStub:
        if addr not in self._stubs:
            options = channel_options(self.session.policy)
            channel = self.credentials.aio_channel(addr, options)
            self._stubs[addr] = (channel, batch_stub(channel))
        return self._stubs[addr][1]

    async def pause(self, seconds: float, wake_on: tuple[str, ...]) -> None:
        """A retry's pause, ended early once one of `wake_on`'s channels comes back
        (_comeback.py)."""
        await apause([self._stubs[a][0] for a in wake_on if a in self._stubs], seconds)

    async def reconnect(self, addr: str, stub: pb_grpc.TokenFeedStub) -> None:
        """A new channel to `addr` where `stub` is still its stub (as `Client.reconnect`):
        the old one is closed RETIRE_SECONDS later, or with the client."""
        found = self._stubs.get(addr)
        if found is None or found[1] is not stub:
            return
        channel = self.credentials.aio_channel(addr, channel_options(self.session.policy))
        self._stubs[addr] = (channel, batch_stub(channel))
        old = retire(self._retired, found[0], time.monotonic())
        await asyncio.gather(*(c.close() for c in old))

    async def close(self) -> None:
        for stream in self._warm.values():
            stream.close()
        self._warm.clear()
        channels = [c for c, _ in self._stubs.values()] + [c for _, c in self._retired]
        self._stubs.clear()
        self._retired.clear()
        await asyncio.gather(*(c.close() for c in channels))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(
        self,
        method: str,
        request: Any,
        job: str,
        rank: int,
        timeout: float | None,
        waits: bool = False,
    ) -> tuple[str, Any]:
        metadata = self.credentials.metadata
        attempts = Attempts(self.session, job, rank, metadata, timeout=timeout, waits=waits)
        for action in attempts:
            if isinstance(action, float):
                await self.pause(action, attempts.wake_on)
                continue
            try:
                call = getattr(self.stub(action.addr), method)
                return action.addr, await call(
                    request, timeout=action.timeout, metadata=action.metadata
                )
            except grpc.RpcError as e:
                attempts.failed(action, e)
        raise attempts.error()

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
        warmed = self._warmed(name, rank, world_size, step)
        if warmed is not None:
            try:
                batch = await warmed.next()
            except Exception:  # the warm stream failed: the call's own retries decide
                warmed.close()
            else:
                if batch is not None:
                    if warmed.step < (warmed.end or 0):
                        self._warm.setdefault((name, rank, world_size), warmed)
                    else:
                        warmed.close()
                    return await self._admit(batch)
        await self._hold(name, step)
        asked = time.perf_counter()
        request = pb.GetBatchRequest(job=name, step=step, rank=rank, world_size=world_size)
        addr, msg = await self._unary("GetBatch", request, name, rank, timeout, waits=True)
        batch = await self._admit(self.session.batch(msg, addr, expected_step=step))
        if self.session.report_waits:
            self.session.waits(name, rank).record(time.perf_counter() - asked)
        return batch

    # ---------------------------------------------------------------- the data plan

    async def plan(self, *, job: str | None = None, step: int = 0) -> dict:
        """See `Client.plan`."""
        name = self._job(job)
        request = pb.GetPlanRequest(job=name, step=step)
        _, info = await self._unary("GetPlan", request, name, 0, None)
        return _to_dict(info)

    async def amend_plan(
        self,
        start_step: int,
        *,
        weights: Mapping[str, object] | None = None,
        global_batch_size: int | None = None,
        seq_len: int | None = None,
        add: Sequence[Mapping[str, Any]] | None = None,
        expected_version: int = 0,
        job: str | None = None,
        packing: str | None = None,
    ) -> dict:
        """See `Client.amend_plan`."""
        name = self._job(job)
        request = self._amend_request(
            name, start_step, weights, global_batch_size, seq_len, add, expected_version, packing
        )
        _, info = await self._unary("AmendPlan", request, name, 0, None)
        return _to_dict(info)

    async def check_plan(
        self, links: Sequence[tuple[int, str]], next_step: int, *, job: str | None = None
    ) -> None:
        """See `Client.check_plan`."""
        name = self._job(job)
        info = await self.plan(job=name)
        server = tuple((p["start_step"], p["fingerprint"]) for p in info["phases"])
        check_resume(name, tuple(links), next_step, server)

    async def _chains(self, job: str) -> dict[str, tuple[tuple[int, str], ...]]:
        """The plan of each log the servers keep (servers sharing a store keep one: its
        freshest copy speaks for it, a lagging copy is a stale read, not another plan);
        servers that do not answer are left out."""
        newest: dict[str, tuple[int, tuple[tuple[int, str], ...]]] = {}
        for addr in self.session.fleet.addresses():
            try:
                info = await self.stub(addr).GetPlan(
                    pb.GetPlanRequest(job=job),
                    timeout=self.session.silence_limit,
                    metadata=self.credentials.metadata(),
                )
            except grpc.RpcError:
                continue
            key = info.log or addr
            if key not in newest or info.version > newest[key][0]:
                newest[key] = (info.version, links_of(info.phases))
        out = {key: chain for key, (_, chain) in newest.items()}
        return out

    async def _admit(self, batch: Batch) -> Batch:
        """See `Client._admit`."""
        job = batch.job
        if self.session.plan_check_due(job, self.plan_check_seconds):
            self.session.plans.compare(job, await self._chains(job))
        await self._hold(job, batch.step, batch)
        return batch

    async def _hold(self, job: str, step: int, batch: Batch | None = None) -> None:
        """See `Client._hold`."""
        watch, deadline = self.session.plans, time.monotonic() + self.session.policy.timeout
        while (conflict := held(watch, job, step)) is not None:
            if time.monotonic() >= deadline or conflict[0] == 0:  # step 0: not a rolling change
                raise held_too_long(job, step, conflict)
            await asyncio.sleep(min(1.0, self.session.policy.max_backoff))
            chains = await self._chains(job)
            if watch.compare(job, chains) is None and batch is not None:
                check_agreed(job, step, batch.plan_fingerprint, batch.server, chains)

    async def describe(self, job: str | None = None) -> dict:
        name = self._job(job)
        _, info = await self._unary("DescribeJob", pb.DescribeJobRequest(job=name), name, 0, None)
        return _to_dict(info)

    def warm(
        self,
        step: int,
        rank: int = 0,
        world_size: int = 1,
        *,
        job: str | None = None,
        steps: int | None = None,
    ) -> None:
        """Start fetching steps [step, step + steps) in a task and return at once (see
        `Client.warm`); call it from the event loop's thread."""
        name, count = self._job(job), steps or self.prefetch or WARM_STEPS
        if count < 1:
            raise ValueError(f"steps must be >= 1, got {count}")
        old = self._warm.pop((name, rank, world_size), None)
        self._warm[(name, rank, world_size)] = _Stream(
            self, name, step, step + count, rank, world_size, count
        )
        if old is not None:
            old.close()

    def _warmed(self, job: str, rank: int, world: int, step: int) -> _Stream | None:
        warmed = self._warm.pop((job, rank, world), None)
        if warmed is not None and warmed.step != step:
            warmed.close()
            return None
        return warmed

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
        """Steps [start_step, end_step) in order: read on this task as they are asked for, or
        with `prefetch` >= 1 ahead by a background task (_aiostream.py)."""
        name, depth = self._job(job), prefetch if prefetch is not None else self.prefetch
        depth = depth or 0
        step = start_step
        warmed = self._warmed(name, rank, world_size, step)
        stream = None
        try:
            if warmed is not None:
                warm_end = warmed.end or step
                if end_step is None or warm_end < end_step:
                    stream = _Stream(self, name, warm_end, end_step, rank, world_size, depth)
                while step < warm_end and (end_step is None or step < end_step):
                    try:
                        batch = await warmed.next()
                    except Exception:  # the warm stream failed: a stream of our own goes on
                        if stream is not None:
                            await stream.aclose()
                        stream = None
                        break
                    if batch is None:
                        break
                    yield await self._admit(batch)
                    step += 1
                warmed.close()
            if end_step is not None and step >= end_step:
                return
            if stream is None:
                stream = _Stream(self, name, step, end_step, rank, world_size, depth)
            while (batch := await stream.next()) is not None:
                yield await self._admit(batch)
        finally:
            if warmed is not None:
                warmed.close()
            if stream is not None:
                await stream.aclose()
