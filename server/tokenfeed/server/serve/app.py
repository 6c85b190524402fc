"""The daemon: builds jobs from the config, serves them over grpc.aio, drains on SIGTERM.

With `server.workers: 1` one process owns the cache and serves; with more, a supervisor owns
the cache and that many worker processes serve on one port (workers.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop
from tokenfeed.server.diskcache.cache import DiskCache
from tokenfeed.server.diskcache.diskfiles import lock_directory
from tokenfeed.server.diskcache.eviction import FutureUse
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.objstore.blockfiles import BlockFiles
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.operate.httpstatus import start_http
from tokenfeed.server.serve.front import Front
from tokenfeed.server.settings.config import Config
from tokenfeed.server.store.sharedstore import SharedStore
from tokenfeed.server.store.tokstore import TokenStore

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 10.0  # between progress lines of the startup index builds


def build_jobs(config: Config) -> dict[str, Job]:
    """The jobs of a config over one disk cache, with the eviction policy that knows them."""
    # The directory is this process's alone while it lives (its rescan removes partial writes).
    lock_directory(Path(config.server.cache_dir), "this process")
    cache = DiskCache(config.server.cache_dir, config.server.cache_bytes)
    storage = ObjectStorage(config.object_store, BlockFiles(cache))
    store = TokenStore(cache.root, cache)
    shared = SharedStore(config.store, storage) if config.store.uri else None
    jobs = {
        spec.name: Job(
            spec, store, storage, shared, stream_cache_bytes=config.server.stream_cache_bytes
        )
        for spec in config.jobs
    }
    cache.set_policy(FutureUse(list(jobs.values())))
    return jobs


def check_budget(config: Config) -> None:
    """Refuse to start when the cache cannot hold the raw chunks tokenized at once (the token
    working set is checked per job once its chunk sizes are known: Job.working_set)."""
    s = config.server
    for job in config.jobs:
        for d in job.datasets:
            if any(src.pattern.startswith("s3://") for src in d.sources):
                need = s.tokenize_threads * (d.chunk_bytes + 2 * config.object_store.block_bytes)
                if need > s.cache_bytes:
                    raise ConfigError(
                        f"server.cache_bytes: {s.cache_bytes} bytes cannot hold the raw data of "
                        f"{s.tokenize_threads} chunks of job {job.name} tokenized at once "
                        f"(chunk_bytes {d.chunk_bytes} plus two blocks each); it needs at "
                        f"least {need} bytes"
                    )


async def serve(config: Config, ready_file: str | None = None) -> None:
    """One process that owns the cache and serves (server.workers: 1)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before anything can be told we serve
        loop.add_signal_handler(sig, stop.set)
    check_budget(config)
    jobs = build_jobs(config)
    tokenize, tasks = start_builds(config, jobs)
    io = ThreadPoolExecutor(2, thread_name_prefix="chunk-io")
    front = Front(config, jobs, io)
    http = start_http(config.server.metrics_listen, jobs) if config.server.metrics_listen else None
    await front.start()
    log.info("serving %d job(s) %s on %s", len(jobs), sorted(jobs), front.address)
    write_ready(
        ready_file,
        {
            "address": front.address,
            "pid": os.getpid(),
            "metrics": http.address if http is not None else "",
            "health": front.health_address,
        },
    )
    tasks.append(asyncio.create_task(front.serving(stop)))
    await stop.wait()
    await front.drain()
    for task in tasks:
        task.cancel()
    tokenize.shutdown(wait=True, cancel_futures=True)
    io.shutdown(wait=False, cancel_futures=True)
    if http is not None:
        http.shutdown()
    log.info("stopped")


def start_builds(config: Config, jobs: dict[str, Job]) -> tuple[ThreadPoolExecutor, list]:
    """Index builds (tokenizing in sample order) and prefetch, as tasks of the running loop."""
    threads = config.server.tokenize_threads
    tokenize = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
    tasks = [asyncio.create_task(job.build_index(tokenize, threads)) for job in jobs.values()]
    tasks += [
        asyncio.create_task(job.prefetch(tokenize, config.server.prefetch_steps))
        for job in jobs.values()
    ]
    if jobs:
        tasks.append(asyncio.create_task(release_old_manifests(jobs)))
        tasks.append(asyncio.create_task(report_builds(jobs)))
    return tokenize, tasks


async def report_builds(jobs: dict[str, Job], every: float = PROGRESS_SECONDS) -> None:
    """A progress line per indexing job every `every` seconds until every job has ended its
    build (a cold start over a large corpus takes minutes to hours: the log says how far)."""
    started, last = time.monotonic(), {name: 0 for name in jobs}
    while True:
        await asyncio.sleep(every)
        building = [job for job in jobs.values() if job.state == "indexing"]
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
        if any(job.state == "failed" for job in jobs.values()):
            return
        await asyncio.sleep(0.5)
    indexes = [idx for job in jobs.values() for idx in job.indexes]
    cache = next(iter(jobs.values())).store.cache

    def referenced(key: str) -> bool:
        return any(idx.keys.get(key) is not None for idx in indexes)

    released = cache.release_unreferenced("manifest", referenced)
    if released:
        log.info("cache: %d manifests of chunks no job reads are evictable now", released)


def write_ready(ready_file: str | None, ready: dict) -> None:
    """The ready file (tests and tools wait for it): written whole, then renamed."""
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.replace(ready_file)


def run(config: Config, ready_file: str | None = None) -> None:
    if config.server.workers > 1:
        from tokenfeed.server.serve import workers

        uvloop.run(workers.supervise(config, ready_file))
    else:
        uvloop.run(serve(config, ready_file))
