"""How the servicer makes batches: a rank's steps planned, their chunks opened off the event
loop, assembled and serialized (GetBatch), and a stream's steps planned many at a time,
assembled a group at a time and built ahead of the one being sent (StreamBatches)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from tokenfeed.client import wire
from tokenfeed.server.jobs.job import READY, Job
from tokenfeed.server.pack.assembly import GroupRows
from tokenfeed.server.sampling.planner import RowPlan
from tokenfeed.server.serve.batchmsg import group_messages
from tokenfeed.server.telemetry import metrics

# Steps a stream assembles in one pass: small batches pay their fixed costs (numpy calls, pins,
# the plan's split, the hand-over to the sender) once per group. Measured on a lone server, one
# consumer reading each [8, 2048] row once: the serving thread spent 160-185 us a batch in
# groups of 24 (48 planned at once) against 250-270 us in groups of 8 (16 planned), and the
# stream ran 52-59 against 41-44 M tokens/s (3 alternating rounds; bench/, wire section). Groups
# of 32 (64 planned) against 24: eight ranks of [8, 2048] in process 1.63-1.78 against
# 1.70-1.84 ms of CPU per M tokens (5 alternating runs of 3 rounds), one [32, 4096] stream
# 1.03-1.38 against 1.13-1.48, and a lone server with eight consumer processes 3.9-4.2 against
# 4.2-4.9 (2 alternating runs of 3 rounds; docs/deployment.md). A group holds at most
# GROUP_TOKENS tokens, four [32, 4096] batches, so another stream waits at most that long
# (a third more than three batches' 2 ms of the event loop, measured before) and a stalled
# stream holds at most two groups (see `Ahead`: docs/configuration.md, limits); larger batches
# go one at a time.
STREAM_GROUP = 32
GROUP_TOKENS = 4 * 32 * 4096
# Steps a stream plans in one pass, up to PLAN_ROWS rows of a rank: planning is order
# arithmetic over row indexes, vectorised, so 64 steps cost little more than one and far less
# than assembling one batch. Two groups of the largest size fit a pass.
PLAN_STEPS = 2 * STREAM_GROUP
PLAN_ROWS = 768


def stream_group(rows: int, seq_len: int) -> int:
    """Steps of `rows` rows a stream assembles in one pass: up to STREAM_GROUP, while the group
    holds at most GROUP_TOKENS tokens; at least one."""
    return max(1, min(STREAM_GROUP, GROUP_TOKENS // max(rows * seq_len, 1)))


def plan_group(rows: int) -> int:
    """Steps of `rows` rows of a rank a stream plans in one pass: up to PLAN_STEPS, while they
    hold at most PLAN_ROWS rows; at least one."""
    return max(1, min(PLAN_STEPS, PLAN_ROWS // max(rows, 1)))


class Ahead:
    """A stream's built batches between the task that builds them and the sender, a group at a
    time. The builder waits for room (fewer than `limit` batches queued) before it builds a
    group, and queues it whole; the sender takes a group whole, so the two tasks meet once per
    group, not once per batch (each meeting is a task switch of the event loop). A reader that
    stalls therefore holds the group being sent, fewer than `limit` batches queued and one
    group more: never a third group built and waiting."""

    def __init__(self, limit: int):
        self.limit = limit
        self._groups: collections.deque[list] = collections.deque()
        self._waiting = 0  # batches queued
        self._getter: asyncio.Future | None = None
        self._putter: asyncio.Future | None = None

    async def room(self) -> None:
        """Returns once fewer than `limit` batches are queued."""
        while self._waiting >= self.limit:
            self._putter = asyncio.get_running_loop().create_future()
            await self._putter

    async def put(self, group: list) -> None:
        await self.room()
        self._groups.append(group)
        self._waiting += len(group)
        _wake(self._getter)

    async def get(self) -> list:
        while not self._groups:
            self._getter = asyncio.get_running_loop().create_future()
            await self._getter
        group = self._groups.popleft()
        self._waiting -= len(group)
        _wake(self._putter)
        return group


def _wake(waiter: asyncio.Future | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class BatchMaker:
    """The batches of the servicer's jobs. `wait(context)`: how long a call may wait for its
    chunks to be built (up to its deadline)."""

    def __init__(self, io: Executor, stream_ahead: int, wait: Callable[[Any], float]):
        self.io = io  # opens, verifies and rebuilds chunks off the event loop
        self.stream_ahead = stream_ahead
        self.wait = wait
        self._served: dict[str, tuple[Any, Any]] = {}

    async def plan(
        self, job: Job, steps: list[int], rank: int, world_size: int, context
    ) -> RowPlan:
        """The plan of several steps of one rank (of one phase of the data plan)."""
        await job.plans.through(steps[-1], self.io)  # never planned from a plan not final
        return await job.plan_when_built(steps, rank, world_size, self.wait(context))

    async def built(
        self, job: Job, plan: RowPlan, steps: int
    ) -> tuple[list[int], wire.Compact | GroupRows]:
        """(epoch of each step's first row, the batches of a plan's `steps` steps, one after
        another), assembled in one pass: concat rows left to be copied into their messages
        (`Job.group`). Those rows are read from row buffers, which the group holds, never from
        the chunks pinned here."""
        with job.pinned(plan):  # its chunks stay in the cache until the batches are built
            await job.open_chunks(plan, self.io)  # disk work, off the event loop
            return job.group(plan, steps)

    async def open_ahead(self, job: Job, plan: RowPlan) -> None:
        """A plan's chunks opened and its row buffers laid out before it is served; a failure
        is left for serving it to meet and report."""
        try:
            with job.pinned(plan):
                await job.open_chunks(plan, self.io)
        except Exception:  # noqa: BLE001 - serving the plan opens it again and reports
            return

    async def serialized(
        self, job: Job, plan: RowPlan, steps: list[int], rank: int, world_size: int
    ) -> list[bytes]:
        """A plan's batches of one rank, as serialized messages. Only these training requests
        (not Explain) move the job's progress, which prefetch and eviction follow: a step
        counts once its batch is being built, not when it is planned. A group's steps ascend
        and are built together: its last step is noted for all of them (a rank's progress is
        its latest step; a worker's notes to its supervisor keep only that one too)."""
        job.note_request(steps[-1], rank, world_size)
        epochs, whole = await self.built(job, plan, len(steps))
        out, sent = [], 0
        for message, payload in group_messages(job, steps, rank, world_size, epochs, whole):
            out.append(message)
            sent += payload
        tokens = whole.rows * whole.seq_len
        job.note_served(tokens)
        served_tokens, served_bytes = self.served_metrics(job.name)
        served_tokens.inc(tokens)
        served_bytes.inc(sent)
        return out

    def served_metrics(self, name: str) -> tuple[Any, Any]:
        """A job's served tokens and bytes counters (labels looked up once per job)."""
        found = self._served.get(name)
        if found is None:
            found = self._served[name] = (
                metrics.SERVED_TOKENS.labels(name),
                metrics.SERVED_BYTES.labels(name),
            )
        return found

    async def stream(self, job: Job, start: int, end: int, rank: int, world_size: int, context):
        """The stream's batches, built while the ones before them are sent, a group at a time
        (`stream_group`: up to STREAM_GROUP batches of at most GROUP_TOKENS tokens in all, or
        one larger batch): a group is built once fewer than `stream_ahead` batches wait and is
        queued whole (`Ahead`), so a reader that stalls holds the group being sent (with gRPC's
        flow-control window), fewer than `stream_ahead` batches and one group queued. Up to
        PLAN_STEPS steps are planned in one pass (`plan_group`), and assembled a group at a
        time on the event loop, each group in one stretch between awaits: other streams wait at
        most one group's work (measured faster than threads, whose GIL contention with the loop
        cost more than the overlap gained)."""
        ready = Ahead(self.stream_ahead)
        seconds = metrics.REQUEST_SECONDS.labels("StreamBatches")
        plans = job.plans

        async def block(first: int) -> list[int]:
            """The steps planned in one pass from `first`: up to plan_group, never across a
            phase of the data plan (another batch size or seq_len), one at a time while the
            job builds (each step goes as soon as its own rows are built). The plan is made
            final through the steps the pass may take first."""
            await plans.through(min(first + PLAN_STEPS, end) - 1, self.io)
            most = plan_group(job.schedule.batch_size(first) // world_size)
            if job.state != READY:
                most = 1
            phase_end = plans.phase_end(first)
            stop = min(first + most, end)
            return list(range(first, stop if phase_end is None else min(stop, phase_end)))

        async def produce() -> None:
            ahead: asyncio.Task | None = None
            try:
                steps = await block(start)
                plan = await self.plan(job, steps, rank, world_size, context)
                while True:
                    started = time.perf_counter()
                    following = steps[-1] + 1
                    later: tuple[list[int], RowPlan] | None = None
                    if following < end and job.state == READY:
                        # The next block's row buffers are laid out (in a chunk-io thread) while
                        # this block's batches are assembled and sent: an epoch's first read of
                        # a chunk costs the stream no wait where the work overlaps (bench/,
                        # wire section). Its errors are the next block's own to raise.
                        nxt = await block(following)
                        later = (nxt, await self.plan(job, nxt, rank, world_size, context))
                        ahead = asyncio.create_task(self.open_ahead(job, later[1]))
                    size, seq_len = job.schedule.batch_size(steps[0]), plans.seq_len(steps[0])
                    per = stream_group(size // world_size, seq_len)
                    for i, part in enumerate(job.split_plan(plan, len(steps), per)):
                        group = steps[i * per : (i + 1) * per]
                        waited = time.perf_counter()
                        await ready.room()  # built only when it may be queued at once
                        started += time.perf_counter() - waited  # (the reader's time)
                        batches = await self.serialized(job, part, group, rank, world_size)
                        per_batch = (time.perf_counter() - started) / len(group)
                        seconds.observe(per_batch, len(batches))  # each batch's share
                        await ready.put(batches)
                        started = time.perf_counter()
                    if following >= end:
                        break
                    if later is None:
                        steps = await block(following)
                        plan = await self.plan(job, steps, rank, world_size, context)
                    else:
                        steps, plan = later
                        if ahead is not None:
                            await ahead
                await ready.put([None])
            except Exception as exc:  # handed to the sender, which aborts the stream with it
                await ready.put([exc])
            finally:
                if ahead is not None:
                    ahead.cancel()

        producer = asyncio.create_task(produce())
        try:
            while True:
                for item in await ready.get():
                    if item is None:
                        return
                    if isinstance(item, Exception):
                        raise item
                    yield item
        finally:
            producer.cancel()
