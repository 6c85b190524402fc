"""A lone server: one process owns the cache, builds every job's index and serves them over
grpc.aio (`server.workers: 1`); SIGTERM drains."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

from tokenfeed.server.jobs.stack import check_budget, open_server
from tokenfeed.server.operate.httpstatus import start_http
from tokenfeed.server.serve.background import settle_heap, start_builds, write_ready
from tokenfeed.server.serve.front import Front
from tokenfeed.server.settings.config import Config

log = logging.getLogger(__name__)


async def serve(config: Config, ready_file: str | None = None) -> None:
    """One process that owns the cache and serves (server.workers: 1)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before anything can be told we serve
        loop.add_signal_handler(sig, stop.set)
    check_budget(config)
    jobs = open_server(config).jobs
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
    tasks.append(asyncio.create_task(settle_heap(jobs)))
    await stop.wait()
    await front.drain()
    for task in tasks:
        task.cancel()
    tokenize.shutdown(wait=True, cancel_futures=True)
    io.shutdown(wait=False, cancel_futures=True)
    if http is not None:
        http.shutdown()
    log.info("stopped")
