"""The gRPC servicer: proto -> domain -> proto, and domain errors -> status codes, once, here."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import grpc
from tokenfeed.client import wire
from tokenfeed.client.moves import MOVE_TRAILER
from tokenfeed.server import errors
from tokenfeed.server.jobs.explain import explain
from tokenfeed.server.jobs.job import READY, Job
from tokenfeed.server.pack.assembly import GroupRows
from tokenfeed.server.serve.batchmsg import serialized
from tokenfeed.server.serve.describe import job_info, num_sources
from tokenfeed.server.serve.planmsg import amendment, plan_info
from tokenfeed.server.serve.spread import StreamSpread
from tokenfeed.server.serve.statuses import abort, parse_request, shown, status_for, well_formed
from tokenfeed.server.serve.streaming import BatchMaker
from tokenfeed.server.serve.waits import count as count_waits
from tokenfeed.server.serve.waits import report_of
from tokenfeed.server.telemetry import metrics
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tokenfeed.server.indexing.index import DatasetIndex


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
        self,
        jobs: dict[str, Job],
        max_wait_seconds: float,
        io: Executor,
        stream_ahead: int = 2,
        spread: StreamSpread | None = None,
    ):
        self.jobs = jobs
        self.spread = spread  # a serving worker's streams against its node's (serve/spread.py)
        self.max_wait = max_wait_seconds
        self.stream_ahead = stream_ahead
        self.io = io  # opens, verifies and rebuilds chunks off the event loop
        # DescribeJob's answers of ready jobs, and each dataset's count of sources (a walk over
        # its chunks, made once per planned chunk list): no request walks the chunks once a
        # job serves, whatever the corpus size.
        self._described: dict[str, tuple[tuple, pb.JobInfo]] = {}
        self._sources: dict[DatasetIndex, tuple[list, int]] = {}
        self.make = BatchMaker(io, stream_ahead, self._wait)

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

    @_unary
    async def GetBatch(self, request: pb.GetBatchRequest, context) -> bytes:
        ws = request.world_size or 1
        job = await self._checked_job(request.job, request.step, request.rank, ws)
        plan = await self.make.plan(job, [request.step], request.rank, ws, context)
        [message] = await self.make.serialized(job, plan, [request.step], request.rank, ws)
        count_waits(job.name, report_of(context))  # the trainer's data waits (serve/waits.py)
        return message

    async def StreamBatches(self, request: pb.StreamBatchesRequest, context):
        spread = self.spread
        if spread is not None:
            if spread.should_move(context.invocation_metadata()):
                # Counted as moved (spread.py), not as a failed request: no alert on error
                # rates fires for the moves of a job's ranks starting at once.
                context.set_trailing_metadata(((MOVE_TRAILER, "1"),))
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "this serving worker serves more streams than another of its node: open a "
                    "new connection and ask again (tokenfeed's clients do)",
                )
            spread.enter()
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
            batches = self.make.stream(job, request.start_step, end, request.rank, ws, context)
            async for batch in batches:
                yield batch
                count_waits(job.name, report)  # once the first batch is delivered
                break
            async for batch in batches:  # the rest: nothing more a batch
                yield batch
        except asyncio.CancelledError:  # the client went away
            metrics.REQUESTS.labels("StreamBatches", "CANCELLED").inc()
            raise
        except Exception as exc:
            metrics.REQUESTS.labels("StreamBatches", status_for(exc).name).inc()
            await abort(context, exc, "StreamBatches")
        else:
            metrics.REQUESTS.labels("StreamBatches", "OK").inc()
        finally:
            if spread is not None:
                spread.leave()

    @_unary
    async def Explain(self, request: pb.GetBatchRequest, context) -> pb.Explanation:
        ws = request.world_size or 1
        job = await self._checked_job(request.job, request.step, request.rank, ws)
        plan = await self.make.plan(job, [request.step], request.rank, ws, context)
        _, whole = await self.make.built(job, plan, 1)
        compact = whole.compact() if isinstance(whole, GroupRows) else whole
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
