"""What the owner of the cache runs beside serving: every job's index build (tokenizing in sample
order) and prefetch, a progress line while jobs index, the release of manifests no job reads;
the ready file that tells tests and tools a process serves; and, in every serving process, its
start-up's objects moved out of the garbage collector's way (`settle_heap`). Used by a lone
server (single.py), by a supervisor of serving workers and by its workers (workers.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

from tokenfeed.server.errors import TokenfeedError
from tokenfeed.server.indexing.index import JobState
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.jobs.prefetch import keep_ahead
from tokenfeed.server.settings.config import Config

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 10.0  # between progress lines of the startup index builds


def start_builds(config: Config, jobs: dict[str, Job]) -> tuple[ThreadPoolExecutor, list]:
    """Index builds (tokenizing in sample order) and prefetch, as tasks of the running loop."""
    threads = config.server.tokenize_threads
    tokenize = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
    tasks = [asyncio.create_task(job.build_index(tokenize, threads)) for job in jobs.values()]
    tasks += [
        asyncio.create_task(
            keep_ahead(
                job, tokenize, config.server.prefetch_steps, config.server.stream_cache_bytes
            )
        )
        for job in jobs.values()
    ]
    if config.server.plan_refresh_seconds:
        tasks += [
            asyncio.create_task(refresh_plan(job, tokenize, config.server.plan_refresh_seconds))
            for job in jobs.values()
        ]
    if jobs:
        tasks.append(asyncio.create_task(release_old_manifests(jobs)))
        tasks.append(asyncio.create_task(report_builds(jobs)))
    return tokenize, tasks


async def refresh_plan(job: Job, executor: Executor, every: float) -> None:
    """Read the job's plan log every `every` seconds, so this process learns of changes made
    elsewhere (its status, prefetch and eviction follow the newest plan; serving never waits
    for this: it reads the log itself before it serves a step past the frozen ones)."""
    keeper = job.plans.keeper
    if keeper is None:
        return
    await job.plans.opened()
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every)
        try:
            await loop.run_in_executor(executor, keeper.refresh)
        except TokenfeedError as e:
            log.debug("job %s: plan log not read now: %s", job.name, e)


async def report_builds(jobs: dict[str, Job], every: float = PROGRESS_SECONDS) -> None:
    """A progress line per indexing job every `every` seconds until every job has ended its
    build (a cold start over a large corpus takes minutes to hours: the log says how far)."""
    started, last = time.monotonic(), {name: 0 for name in jobs}
    while True:
        await asyncio.sleep(every)
        building = [job for job in jobs.values() if job.state == JobState.INDEXING]
        if not building:
            return
        elapsed = time.monotonic() - started
        for job in building:
            done, total = job.chunks_indexed, job.num_chunks
            rate = (done - last[job.name]) / every
            last[job.name] = done
            log.info(
                "job %s: indexing, %d/%d chunks after %.0fs (%.1f chunks/s)%s",
                job.name,
                done,
                total,
                elapsed,
                rate,
                f"; {job.error}" if job.error else "",
            )


async def release_old_manifests(jobs: dict[str, Job]) -> None:
    """Once every job is planned: manifests of chunks no job reads any more (an object's old
    version, a job removed from the config) stop counting as kept and become evictable. Not
    when a job failed before planning: its chunks are unknown, so nothing is released."""
    while any(not idx.chunks for job in jobs.values() for idx in job.indexes):
        if any(job.state == JobState.FAILED for job in jobs.values()):
            return
        await asyncio.sleep(0.5)
    indexes = [idx for job in jobs.values() for idx in job.indexes]
    cache = next(iter(jobs.values())).store.cache

    def referenced(key: str) -> bool:
        return any(idx.keys.get(key) is not None for idx in indexes)

    released = cache.release_unreferenced("manifest", referenced)
    if released:
        log.info("cache: %d manifests of chunks no job reads are evictable now", released)


async def settle_heap(jobs: dict[str, Job]) -> None:
    """The objects a serving process made to start (its modules, gRPC's, the jobs' specs and
    indexes) frozen out of the garbage collector's full collections (`gc.freeze`), once at
    start-up and again once every job's index build has ended: a full collection of a lone
    server walked 70-80 thousand of them in 20-50 ms on 2 cores, a stall of every stream and
    request on its event loop, where after the freeze it walks only what serving made since
    (under a millisecond; docs/deployment.md). Cycles among them are collected first, so
    freezing keeps no garbage; a frozen object whose last reference goes is freed as ever."""
    freeze_heap()
    for job in jobs.values():
        await job.built()  # READY or FAILED: its index's objects made either way
    if jobs:
        freeze_heap()


def freeze_heap() -> None:
    """Collect every generation, then freeze what is left (`settle_heap`)."""
    gc.collect()
    gc.freeze()
    log.debug("%d objects frozen out of full garbage collections", gc.get_freeze_count())


def write_ready(ready_file: str | None, ready: dict) -> None:
    """The ready file (tests and tools wait for it): written whole, then renamed."""
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.replace(ready_file)
