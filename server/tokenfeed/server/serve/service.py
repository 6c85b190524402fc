"""The gRPC servicer: proto -> domain -> proto, and domain errors -> status codes, once, here."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import grpc
from tokenfeed.client import wire
from tokenfeed.server import errors
from tokenfeed.server.jobs.explain import explain
from tokenfeed.server.jobs.job import READY, Job
from tokenfeed.server.sampling.planner import RowPlan
from tokenfeed.server.serve.batchmsg import batch_message, serialized
from tokenfeed.server.serve.describe import job_info, num_sources
from tokenfeed.server.serve.planmsg import amendment, plan_info
from tokenfeed.server.serve.statuses import abort, parse_request, shown, status_for, well_formed
from tokenfeed.server.serve.waits import count as count_waits
from tokenfeed.server.serve.waits import report_of
from tokenfeed.server.telemetry import metrics
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tokenfeed.server.indexing.index import DatasetIndex

# Steps a stream assembles in one pass: small batches pay their fixed costs (numpy calls, pins,
# the plan's split) once per group: 8 [8, 2048] batches cost 80-87 us of CPU each against
# 96-144 us in groups of 4 (bench/, wire section). An assembled group holds at most
# GROUP_TOKENS tokens, one [32, 4096] batch, so the event loop is never held for more than one
# large batch's work and a stalled stream holds at most that much in its group: larger batches
# go one at a time.
STREAM_GROUP = 8
GROUP_TOKENS = 32 * 4096
# Steps a stream plans in one pass, up to PLAN_ROWS rows of a rank: planning is order
# arithmetic over row indexes, vectorised, so 16 steps cost little more than one and far less
# than assembling one batch.
PLAN_STEPS = 16
PLAN_ROWS = 512


def stream_group(rows: int, seq_len: int) -> int:
    """Steps of `rows` rows a stream assembles in one pass: up to STREAM_GROUP, while the group
    holds at most GROUP_TOKENS tokens; at least one."""
    return max(1, min(STREAM_GROUP, GROUP_TOKENS // max(rows * seq_len, 1)))


def plan_group(rows: int) -> int:
    """Steps of `rows` rows of a rank a stream plans in one pass: up to PLAN_STEPS, while they
    hold at most PLAN_ROWS rows; at least one."""
    return max(1, min(PLAN_STEPS, PLAN_ROWS // max(rows, 1)))


def register(servicer: TokenFeedServicer, server: grpc.aio.Server) -> None:
    """The TokenFeed service on `server`, with request parsers that turn undecodable bytes into
    INVALID_ARGUMENT (grpc's own would answer UNKNOWN or INTERNAL)."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "GetBatch": unary(servicer.GetBatch, parse_request(pb.GetBatchRequest), serialized),
        "StreamBatches": stream(
            servicer.StreamBatches, parse_request(pb.StreamBatchesRequest), serialized
        ),
        "DescribeJob": unary(
            servicer.DescribeJob, parse_request(pb.DescribeJobRequest), pb.JobInfo.SerializeToString
        ),
        "ListJobs": unary(
            servicer.ListJobs,
            parse_request(pb.ListJobsRequest),
            pb.ListJobsResponse.SerializeToString,
        ),
        "Explain": unary(
            servicer.Explain, parse_request(pb.GetBatchRequest), pb.Explanation.SerializeToString
        ),
        "GetPlan": unary(
            servicer.GetPlan, parse_request(pb.GetPlanRequest), pb.PlanInfo.SerializeToString
        ),
        "AmendPlan": unary(
            servicer.AmendPlan, parse_request(pb.AmendPlanRequest), pb.PlanInfo.SerializeToString
        ),
    }
    name = pb.DESCRIPTOR.services_by_name["TokenFeed"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def _unary(method):
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context):
        started = time.perf_counter()
        try:
            well_formed(request)
            reply = await method(self, request, context)
        except Exception as exc:  # every failure becomes a status; none reaches grpc raw
            metrics.REQUESTS.labels(name, status_for(exc).name).inc()
            await abort(context, exc, name)
        metrics.REQUEST_SECONDS.labels(name).observe(time.perf_counter() - started)
        metrics.REQUESTS.labels(name, "OK").inc()
        return reply

    return wrapper


class TokenFeedServicer(pb_grpc.TokenFeedServicer):
    def __init__(
        self, jobs: dict[str, Job], max_wait_seconds: float, io: Executor, stream_ahead: int = 2
    ):
        self.jobs = jobs
        self.max_wait = max_wait_seconds
        self.stream_ahead = stream_ahead
        self.io = io  # opens, verifies and rebuilds chunks off the event loop
        # DescribeJob's answers of ready jobs, and each dataset's count of sources (a walk over
        # its chunks, made once per planned chunk list): no request walks the chunks once a
        # job serves, whatever the corpus size.
        self._described: dict[str, tuple[tuple, pb.JobInfo]] = {}
        self._sources: dict[DatasetIndex, tuple[list, int]] = {}
        self._served: dict[str, tuple[Any, Any]] = {}

    def _job(self, name: str) -> Job:
        if not name:
            raise errors.RequestError("job is required; ListJobs names the jobs of this server")
        job = self.jobs.get(name)
        if job is None:
            known = sorted(self.jobs)
            listed = ", ".join(map(shown, known[:20])) + (" …" if len(known) > 20 else "")
            raise errors.UnknownJobError(f"unknown job {shown(name)}; this server has {listed}")
        return job

    def _wait(self, context) -> float:
        """Seconds a request may wait for its chunks to be built: up to its deadline."""
        remaining = context.time_remaining()
        if remaining is None:
            return self.max_wait
        # Answer before the client's deadline does, so it hears UNAVAILABLE and why.
        return max(0.0, min(self.max_wait, remaining - min(0.5, remaining / 10)))

    async def _checked_job(self, name: str, step: int, rank: int, world_size: int) -> Job:
        job = self._job(name)
        # Requests carry 64-bit integers: refuse what no batch could mean, never cut it.
        if not 1 <= world_size < 2**31:
            raise errors.RequestError(f"world_size must be in [1, 2**31), got {world_size}")
        if not 0 <= rank < world_size:
            raise errors.RequestError(f"rank must be in [0, {world_size}), got {rank}")
        if 0 <= step < job.step_limit:  # the final plan for the step first: it may batch it
            await job.plans.through(step, self.io)  # otherwise than this server's copy did
        job.check_request(step, rank, world_size)
        return job

    async def _plan(
        self, job: Job, steps: list[int], rank: int, world_size: int, context
    ) -> RowPlan:
        """The plan of several steps of one rank (of one phase of the data plan)."""
        await job.plans.through(steps[-1], self.io)  # never planned from a plan not final
        return await job.plan_when_built(steps, rank, world_size, self._wait(context))

    async def _built(self, job: Job, plan: RowPlan, steps: int) -> list[tuple[int, wire.Compact]]:
        """(epoch, compact batch) of each of a plan's `steps` steps, assembled in one pass."""
        with job.pinned(plan):  # its chunks stay in the cache until the batches are built
            await job.open_chunks(plan, self.io)  # disk work, off the event loop
            return job.assemble_steps(plan, steps)

    async def _open_ahead(self, job: Job, plan: RowPlan) -> None:
        """A plan's chunks opened and its row buffers laid out before it is served; a failure
        is left for serving it to meet and report."""
        try:
            with job.pinned(plan):
                await job.open_chunks(plan, self.io)
        except Exception:  # noqa: BLE001 - serving the plan opens it again and reports
            return

    async def _batches(
        self, job: Job, plan: RowPlan, steps: list[int], rank: int, world_size: int
    ) -> list[bytes]:
        """A plan's batches of one rank, as serialized messages. Only these training requests
        (not Explain) move the job's progress, which prefetch and eviction follow: a step
        counts once its batch is being built, not when it is planned."""
        for step in steps:
            job.note_request(step, rank, world_size)
        built = await self._built(job, plan, len(steps))
        out, tokens, sent = [], 0, 0
        for step, (epoch, compact) in zip(steps, built, strict=True):
            message, payload = batch_message(job, step, rank, world_size, epoch, compact)
            out.append(message)
            tokens += compact.rows * compact.seq_len
            sent += payload
        job.note_served(tokens)
        served_tokens, served_bytes = self._served_metrics(job.name)
        served_tokens.inc(tokens)
        served_bytes.inc(sent)
        return out

    def _served_metrics(self, name: str) -> tuple[Any, Any]:
        """A job's served tokens and bytes counters (labels looked up once per job)."""
        found = self._served.get(name)
        if found is None:
            found = self._served[name] = (
                metrics.SERVED_TOKENS.labels(name),
                metrics.SERVED_BYTES.labels(name),
            )
        return found

    @_unary
    async def GetBatch(self, request: pb.GetBatchRequest, context) -> bytes:
        ws = request.world_size or 1
        job = await self._checked_job(request.job, request.step, request.rank, ws)
        plan = await self._plan(job, [request.step], request.rank, ws, context)
        [message] = await self._batches(job, plan, [request.step], request.rank, ws)
        count_waits(job.name, report_of(context))  # the trainer's data waits (serve/waits.py)
        return message

    async def StreamBatches(self, request: pb.StreamBatchesRequest, context):
        try:
            well_formed(request)
            ws = request.world_size or 1
            job = await self._checked_job(request.job, request.start_step, request.rank, ws)
            end = request.end_step or job.step_limit
            if end <= request.start_step:
                raise errors.RequestError(
                    f"end_step {request.end_step} must be after start_step {request.start_step} "
                    "(or 0 to stream until cancelled)"
                )
            report = report_of(context)  # the trainer's data waits (serve/waits.py)
            async for batch in self._ahead(job, request.start_step, end, request.rank, ws, context):
                yield batch
                count_waits(job.name, report)  # once the first batch is delivered
                report = None
        except asyncio.CancelledError:  # the client went away
            metrics.REQUESTS.labels("StreamBatches", "CANCELLED").inc()
            raise
        except Exception as exc:
            metrics.REQUESTS.labels("StreamBatches", status_for(exc).name).inc()
            await abort(context, exc, "StreamBatches")
        else:
            metrics.REQUESTS.labels("StreamBatches", "OK").inc()

    async def _ahead(self, job: Job, start: int, end: int, rank: int, world_size: int, context):
        """The stream's batches, built while the ones before them are sent: at most
        `stream_ahead` built and waiting, and one group being built (`stream_group`: up to
        STREAM_GROUP batches of at most GROUP_TOKENS tokens in all, or one larger batch), so a
        reader that stalls holds `stream_ahead` batches, one group, and the one gRPC is sending
        with its flow-control window. Up to PLAN_STEPS steps are planned in one pass (`plan_group`),
        and assembled a group at a time on the event loop, each group in one stretch between
        awaits: other streams wait at most one large batch's work (measured faster than
        threads, whose GIL contention with the loop cost more than the overlap gained)."""
        ready: asyncio.Queue = asyncio.Queue(maxsize=self.stream_ahead)
        seconds = metrics.REQUEST_SECONDS.labels("StreamBatches")
        plans = job.plans

        async def block(first: int) -> list[int]:
            """The steps planned in one pass from `first`: up to plan_group, never across a
            phase of the data plan (another batch size or seq_len), one at a time while the
            job builds (each step goes as soon as its own rows are built). The plan is made
            final through the steps the pass may take first."""
            await plans.through(min(first + PLAN_STEPS, end) - 1, self.io)
            steps, most = [first], plan_group(job.schedule.batch_size(first) // world_size)
            if job.state != READY:
                most = 1
            while len(steps) < most and steps[-1] + 1 < end:
                if not plans.same_phase(first, steps[-1] + 1):
                    break
                steps.append(steps[-1] + 1)
            return steps

        async def produce() -> None:
            ahead: asyncio.Task | None = None
            try:
                steps = await block(start)
                plan = await self._plan(job, steps, rank, world_size, context)
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
                        later = (nxt, await self._plan(job, nxt, rank, world_size, context))
                        ahead = asyncio.create_task(self._open_ahead(job, later[1]))
                    size, seq_len = job.schedule.batch_size(steps[0]), plans.seq_len(steps[0])
                    per = stream_group(size // world_size, seq_len)
                    for i, part in enumerate(job.split_plan(plan, len(steps), per)):
                        group = steps[i * per : (i + 1) * per]
                        batches = await self._batches(job, part, group, rank, world_size)
                        per_batch = (time.perf_counter() - started) / len(group)
                        for batch in batches:
                            seconds.observe(per_batch)
                            await ready.put(batch)
                        started = time.perf_counter()
                    if following >= end:
                        break
                    if later is None:
                        steps = await block(following)
                        plan = await self._plan(job, steps, rank, world_size, context)
                    else:
                        steps, plan = later
                        if ahead is not None:
                            await ahead
                await ready.put(None)
            except Exception as exc:  # handed to the sender, which aborts the stream with it
                await ready.put(exc)
            finally:
                if ahead is not None:
                    ahead.cancel()

        producer = asyncio.create_task(produce())
        try:
            while (item := await ready.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            producer.cancel()

    @_unary
    async def Explain(self, request: pb.GetBatchRequest, context) -> pb.Explanation:
        ws = request.world_size or 1
        job = await self._checked_job(request.job, request.step, request.rank, ws)
        plan = await self._plan(job, [request.step], request.rank, ws, context)
        [(_, compact)] = await self._built(job, plan, 1)
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(self.io, explain, job, request.step, request.rank, ws)
        return pb.Explanation(
            job=job.name,
            step=request.step,
            rank=request.rank,
            world_size=ws,
            fingerprint=wire.fingerprint(compact),
            rows=[
                pb.RowExplanation(
                    row=r["row"],
                    dataset=r["dataset"],
                    epoch=r["epoch"],
                    dataset_row=r["dataset_row"],
                    pieces=[
                        pb.Piece(
                            source=src,
                            record=rec,
                            token_start=ts,
                            token_end=te,
                            row_start=rs,
                            row_end=re,
                        )
                        for src, rec, ts, te, rs, re in r["pieces"]
                    ],
                )
                for r in rows
            ],
        )

    @_unary
    async def DescribeJob(self, request: pb.DescribeJobRequest, context) -> pb.JobInfo:
        job = self._job(request.job)
        self._check_step(job, request.step)
        info = pb.JobInfo()
        info.CopyFrom(self._info(job))  # the cached part, and the plan as it is now
        info.plan.CopyFrom(plan_info(job, request.step))
        return info

    @_unary
    async def GetPlan(self, request: pb.GetPlanRequest, context) -> pb.PlanInfo:
        job = self._job(request.job)
        self._check_step(job, request.step)
        return plan_info(job, request.step)

    @_unary
    async def AmendPlan(self, request: pb.AmendPlanRequest, context) -> pb.PlanInfo:
        """Append a phase (admin scope: auth.py); the keeper writes the log conditionally."""
        job = self._job(request.job)
        keeper = job.plans.keeper
        if keeper is None:
            raise errors.JobFailedError(f"job {job.name} has no plan log on this server")
        change = amendment(request)
        who = context.peer() or "a client"
        loop = asyncio.get_running_loop()
        _, replaced = await loop.run_in_executor(
            self.io, keeper.append, change, who, request.expected_version
        )
        return plan_info(job, 0, replaced)

    @staticmethod
    def _check_step(job: Job, step: int) -> None:
        if not 0 <= step < job.step_limit:
            raise errors.RequestError(f"step must be in [0, {job.step_limit}), got {step}")

    @_unary
    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[self._info(self.jobs[n]) for n in sorted(self.jobs)])

    def _info(self, job: Job) -> pb.JobInfo:
        """The job's description: made once when it is ready (nothing in it changes then), and
        per call while it indexes (numpy sums over the chunks, the sources counted once)."""
        key = (job.state, job.error, job.fingerprint)
        cached = self._described.get(job.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        info = job_info(job, self._num_sources)
        if job.state == READY:
            self._described[job.name] = (key, info)
        return info

    def _num_sources(self, idx: DatasetIndex) -> int:
        cached = self._sources.get(idx)
        if cached is None or cached[0] is not idx.chunks:  # planned since
            cached = self._sources[idx] = (idx.chunks, num_sources(idx))
        return cached[1]
