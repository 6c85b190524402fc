"""A job's build, from start to ready: its tokenizer fetched and its plan log opened (each
retried with backoff while storage is unreachable), every dataset's index built (and those a
plan change adds, while the job runs), the job's claim on the cache once all are built, and what
requests wait on meanwhile (step 0 servable, the build ended, more rows built).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

import numpy as np
from tokenfeed.server.errors import (
    CacheTooSmallError,
    JobFailedError,
    NotBuiltError,
    NotReadyError,
    RequestError,
)
from tokenfeed.server.indexing.index import FAILED, READY, DatasetIndex, JobState
from tokenfeed.server.jobs.backoff import with_backoff

if TYPE_CHECKING:
    from tokenfeed.server.jobs.jobplan import JobPlan
    from tokenfeed.server.sampling.planner import RowPlan
    from tokenfeed.server.settings.config import JobSpec
    from tokenfeed.server.store.tokstore import TokenStore
    from tokenfeed.server.tokenizer.tokenize import TextTokenizer

log = logging.getLogger(__name__)


class BuildTarget(Protocol):
    """What the build reads and calls of its job (jobs/job.py's Job)."""

    name: str
    spec: JobSpec
    store: TokenStore
    plans: JobPlan
    indexes: list[DatasetIndex]
    tokenizer: TextTokenizer | None

    @property
    def refused(self) -> str: ...
    @property
    def state(self) -> JobState: ...
    @property
    def error(self) -> str: ...

    def load_tokenizer(self) -> TextTokenizer: ...

    def fail(self, error: str) -> None: ...

    def plan(self, step: int, rank: int, world_size: int) -> RowPlan: ...

    def plan_steps(self, steps: list[int], rank: int, world_size: int) -> RowPlan: ...

    def count_shapes(self) -> None: ...


class JobBuild:
    def __init__(self, job: BuildTarget):
        self.job = job
        self.tokenizer_error = ""  # why the tokenizer is not loaded yet (retrying)
        self.plan_error = ""  # why the plan log cannot be opened yet (retrying)
        # Once the build runs: its loop, executor, parallelism and retry (datasets a plan adds
        # later are built with them).
        self.running: tuple[asyncio.AbstractEventLoop, Executor, int, bool] | None = None
        self._ready = asyncio.Event()
        self._built_more = asyncio.Event()  # set (and replaced) whenever more rows are built
        self._added: set[asyncio.Future] = set()

    async def build_index(self, executor: Executor, parallel: int, retry: bool = True) -> None:
        job = self.job
        if not await self._fetch_tokenizer(executor, retry):
            self._ready.set()
            return
        if not await self._open_plan(executor, retry):
            self._ready.set()
            return
        self.running = (asyncio.get_running_loop(), executor, parallel, retry)
        await asyncio.gather(*(i.build(executor, parallel, retry) for i in list(job.indexes)))
        if job.tokenizer is not None:  # built: the engine's per-thread memory goes
            job.tokenizer.release_engine()
        self._claim(parallel)
        self._ready.set()

    def add(self, idx: DatasetIndex) -> None:
        """From any thread: a dataset the plan added while the job runs is built (once the
        build runs; before, build_index builds it with the others)."""
        if self.running is not None:
            loop, executor, parallel, retry = self.running
            loop.call_soon_threadsafe(self._build_added, idx, executor, parallel, retry)

    def _build_added(
        self, idx: DatasetIndex, executor: Executor, parallel: int, retry: bool
    ) -> None:
        """On the loop: build a dataset the plan added while the job runs."""
        log.info(
            "job %s: dataset %s added by the plan; building its index", self.job.name, idx.name
        )
        self.wake()
        task = asyncio.ensure_future(self._build_one(idx, executor, parallel, retry))
        self._added.add(task)
        task.add_done_callback(self._added.discard)

    async def _build_one(
        self, idx: DatasetIndex, executor: Executor, parallel: int, retry: bool
    ) -> None:
        await idx.build(executor, parallel, retry)
        self._claim(parallel)

    async def _fetch_tokenizer(self, executor: Executor, retry: bool) -> bool:
        """Load the tokenizer, retrying fetch failures with backoff until it loads, or the job
        fails (the file is not a tokenizer) or is cancelled."""
        job = self.job
        if job.tokenizer is not None:
            return not job.refused
        loop = asyncio.get_running_loop()

        def note(error: str) -> None:
            self.tokenizer_error = error

        return await with_backoff(
            lambda: loop.run_in_executor(executor, job.load_tokenizer),
            job=job.name,
            what="tokenizer",
            retrying=f"tokenizer {job.spec.tokenizer.path}",
            retry=retry,
            note=note,
            fail=job.fail,
            wake=self.wake,
            stopped=lambda: bool(job.refused),
        )

    async def _open_plan(self, executor: Executor, retry: bool) -> bool:
        """Open the job's plan log (its datasets may be more than the config's), retrying a
        log that cannot be reached while requests get UNAVAILABLE."""
        job = self.job

        def note(error: str) -> None:
            self.plan_error = error

        return await with_backoff(
            lambda: job.plans.open(executor),
            job=job.name,
            what="data plan",
            retrying="data plan",
            retry=retry,
            note=note,
            fail=job.fail,
            wake=self.wake,
            stopped=lambda: bool(job.refused),
        )

    def _claim(self, parallel: int) -> None:
        """Once every dataset is built: the job's claim on the cache (its working set)."""
        job = self.job
        if all(i.state == READY for i in job.indexes):
            for idx in job.indexes:  # the job's claim covers its raw data too
                job.store.cache.release(idx.raw_claim)
            try:
                job.store.cache.claim(job.name, self.working_set(parallel), f"job {job.name}")
            except CacheTooSmallError as e:
                job.fail(str(e))
            job.count_shapes()

    def working_set(self, parallel: int) -> int:
        """Cache bytes the job needs to make progress: its largest window of token chunks in
        each dataset (plus one chunk being rebuilt, and the next window's first chunk, which a
        window's last row reads into), and the raw data of the chunks being tokenized at once."""
        total, raw = 0, 0
        for idx in self.job.indexes:
            sizes = np.sort(idx.body_bytes)[::-1]
            total += int(sizes[: self.job.spec.window_chunks + 2].sum())
            raw = max(raw, idx.raw_working_set(parallel))
        return total + raw

    # ---------------------------------------------------------------- what requests wait on

    def wake(self) -> None:
        """On the loop: more rows are built (or a wait's reason is gone): waiters look again."""
        self._built_more.set()
        self._built_more = asyncio.Event()

    def wake_from_thread(self) -> None:
        running = self.running
        if running is not None:
            running[0].call_soon_threadsafe(self.wake)

    async def servable(self) -> None:
        """Returns once step 0 can be served (its windows are built), or the build has ended."""
        while not self._ready.is_set():
            try:
                self.job.plan(0, 0, 1)
                return
            except (NotBuiltError, NotReadyError):
                pass
            except (JobFailedError, RequestError):
                return
            more = asyncio.ensure_future(self._built_more.wait())
            ready = asyncio.ensure_future(self._ready.wait())
            await asyncio.wait([more, ready], return_when=asyncio.FIRST_COMPLETED)
            more.cancel()
            ready.cancel()

    async def built(self) -> None:
        """Returns once the index build has ended, READY or FAILED."""
        await self._ready.wait()

    async def plan_when_built(
        self, steps: list[int], rank: int, world_size: int, timeout: float
    ) -> RowPlan:
        """The plan of one rank's batches of `steps` (plan_steps), waiting up to `timeout`
        seconds for the chunks they need to be built (serving while building: steps are
        served as soon as their windows are tokenized, in sample order, never from a partial
        window)."""
        job = self.job
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if job.state == FAILED:
                raise JobFailedError(job.error)
            try:
                return job.plan_steps(steps, rank, world_size)
            except NotBuiltError as e:
                remaining = deadline - loop.time()
                if not self._ready.is_set() and any(i.error for i in job.indexes):
                    # The build failed here and waits to retry: another server can serve sooner.
                    raise NotReadyError(
                        f"job {job.name} cannot be indexed on this server "
                        f"right now ({job.error}); retry on another server",
                        retry_after=1.0,
                    ) from None
                if remaining <= 0:
                    raise NotReadyError(
                        f"{e}; retry in about {e.retry_after:.0f}s", retry_after=e.retry_after
                    ) from None
                event = self._built_more
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    pass
