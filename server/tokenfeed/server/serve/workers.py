"""Every core of a data node: a supervisor and `server.workers` serving processes on one port.

    supervisor (this module's `supervise`)            worker i (`worker_main`), i = 0..N-1
    ├── owns the cache: plans, tokenizes, evicts,     ├── gRPC on the shared port (SO_REUSEPORT:
    │   prefetches, answers for the budget           │   the kernel spreads connections)
    ├── the control socket (control.py) ◄────────────┼── chunks / ensure / progress / metrics
    ├── the HTTP port: /metrics (its own metrics     ├── reads the token store (TokenStoreView),
    │   plus the workers', summed), status page      │   never writes it
    └── restarts a worker that dies; SIGTERM: every  └── exits when the supervisor is gone
        worker drains, then the supervisor stops

Why one owner: the budget, eviction and single-flight tokenizing stay where they are (one
process, cache.py), so no chunk is tokenized twice and the directory stays under its budget;
workers map bodies read-only, and an evicted body they still map is dropped within
FORGET_SECONDS (the kernel frees its space then). The supervisor reserves the port (a bound,
not listening, SO_REUSEPORT socket), so `listen: host:0` gives every worker the same port. The
kernel spreads connections by a hash, not by load: a worker that serves more streams than
another sends a new one elsewhere, and tokenfeed's client reconnects (serve/spread.py).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import uvloop
from tokenfeed.client.memory import keep_freed_memory
from tokenfeed.server.errors import SupervisorUnavailable
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.jobs.stack import check_budget, open_server, open_worker
from tokenfeed.server.operate.httpstatus import start_http
from tokenfeed.server.pack import arenaformat
from tokenfeed.server.serve import spread
from tokenfeed.server.serve.background import (
    refresh_plan,
    settle_heap,
    start_builds,
    write_ready,
)
from tokenfeed.server.serve.control import Supervised, SupervisorLink
from tokenfeed.server.serve.front import Front
from tokenfeed.server.serve.workermetrics import METRICS_SECONDS, WorkerMetrics, snapshot
from tokenfeed.server.settings.config import Config
from tokenfeed.server.telemetry import logs, metrics

log = logging.getLogger(__name__)

START_SECONDS = 60.0  # a worker that has not written its ready file by then failed to start
RESTART_PAUSE_SECONDS = 1.0  # between a worker's death and its replacement
FORGET_SECONDS = 1.0  # how often a worker drops its mappings of evicted bodies


def reserve(listen: str) -> tuple[socket.socket, str]:
    """A bound SO_REUSEPORT socket holding the port of `listen` (host:port, port 0 picks
    one), and the address with that port."""
    host, _, port = listen.rpartition(":")
    bare = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((bare, int(port)))
    return sock, f"{host}:{sock.getsockname()[1]}"


# ------------------------------------------------------------------------ the supervisor


@dataclass
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    pid: int
    ready_file: Path
    started: float


class WorkerPool:
    def __init__(
        self,
        config: Config,
        listen: str,
        health_listen: str,
        control: Supervised,
        counted: WorkerMetrics,
    ):
        self.config, self.listen, self.health_listen = config, listen, health_listen
        self.control, self.counted = control, counted
        self.run_dir = Path(config.server.cache_dir) / "workers"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[int, _Worker] = {}
        self.restarts = 0
        self._context = multiprocessing.get_context("spawn")  # no fork of a threaded process

    def start(self, index: int) -> None:
        ready = self.run_dir / f"worker-{index}.ready.json"
        ready.unlink(missing_ok=True)
        process = self._context.Process(
            target=worker_main,
            name=f"tokenfeed-worker-{index}",
            daemon=False,
            args=(
                self.config,
                index,
                self.listen,
                self.health_listen,
                str(self.control.path),
                self.control.authkey,
                str(ready),
            ),
        )
        process.start()
        if process.pid is None:  # start() returns once the child exists: never None here
            raise RuntimeError(f"worker {index} has no process id after it started")
        self.workers[index] = _Worker(index, process, process.pid, ready, time.monotonic())
        log.info("worker %d started (pid %d)", index, process.pid)

    async def wait_ready(self) -> None:
        while not all(w.ready_file.exists() for w in self.workers.values()):
            for w in self.workers.values():
                if w.process.exitcode is not None or time.monotonic() - w.started > START_SECONDS:
                    code = w.process.exitcode
                    raise RuntimeError(
                        f"worker {w.index} failed to start (exit code {code}); "
                        "its log lines are above"
                    )
            await asyncio.sleep(0.02)

    async def keep_alive(self) -> None:
        """Replace a worker that exits (a crash, SIGKILL, out of memory) until cancelled."""
        while True:
            await asyncio.sleep(0.1)
            for w in list(self.workers.values()):
                if w.process.exitcode is not None:
                    log.warning(
                        "worker %d (pid %d) exited with %s; restarting it",
                        w.index,
                        w.pid,
                        w.process.exitcode,
                    )
                    self.counted.retire(w.pid)
                    self.restarts += 1
                    await asyncio.sleep(RESTART_PAUSE_SECONDS)
                    self.start(w.index)

    async def stop(self) -> None:
        """SIGTERM to every worker (each drains for grace_seconds), SIGKILL to stragglers."""
        for w in self.workers.values():
            if w.process.exitcode is None:
                os.kill(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.server.grace_seconds + 10.0
        while any(w.process.exitcode is None for w in self.workers.values()):
            if time.monotonic() > deadline:
                for w in self.workers.values():
                    if w.process.exitcode is None:
                        log.warning("worker %d did not drain in time; killing it", w.index)
                        w.process.kill()
                break
            await asyncio.sleep(0.05)
        for w in self.workers.values():
            w.process.join(5.0)


async def supervise(config: Config, ready_file: str | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    check_budget(config)
    jobs = open_server(config, shared_rows=True).jobs
    held, listen = reserve(config.server.listen)
    held_health, health_listen = (
        reserve(config.server.health_listen) if config.server.health_listen else (None, "")
    )
    counted = WorkerMetrics()
    control = Supervised(
        Path(config.server.cache_dir) / "control.sock", jobs, loop, on_metrics=counted.update
    )
    tokenize, tasks = start_builds(config, jobs)
    http = (
        start_http(config.server.metrics_listen, jobs, registry=counted)
        if config.server.metrics_listen
        else None
    )
    # The workers' shared row buffers: an earlier run's were removed by open_server. Beside
    # them, the table of each worker's streams (serve/spread.py).
    rows = arenaformat.node_dir(config.server.cache_dir)
    spread.create(rows, config.server.workers)
    pool = WorkerPool(config, listen, health_listen, control, counted)
    for i in range(config.server.workers):
        pool.start(i)
    try:
        await pool.wait_ready()
        log.info(
            "serving %d job(s) %s on %s with %d workers",
            len(jobs),
            sorted(jobs),
            listen,
            len(pool.workers),
        )
        pids = [w.pid for w in pool.workers.values()]
        write_ready(
            ready_file,
            {
                "address": listen,
                "pid": os.getpid(),
                "workers": pids,
                "metrics": http.address if http is not None else "",
                "health": health_listen,
            },
        )
        tasks.append(asyncio.create_task(pool.keep_alive()))
        tasks.append(asyncio.create_task(_serving(jobs, stop)))
        tasks.append(asyncio.create_task(_let_go_of_old_rows(jobs)))
        tasks.append(asyncio.create_task(settle_heap(jobs)))
        await stop.wait()
    finally:
        metrics.SERVING.set(0)  # draining
        for task in tasks:
            task.cancel()
        await pool.stop()
        arenaformat.remove(rows)
        for job in jobs.values():
            job.cancel()
        tokenize.shutdown(wait=True, cancel_futures=True)
        control.close()
        held.close()
        if held_health is not None:
            held_health.close()
        if http is not None:
            http.shutdown()
    log.info("stopped")


async def _serving(jobs: dict[str, Job], stop: asyncio.Event) -> None:
    """The supervisor's `tokenfeed_serving`: 1 once its workers are up and every job can
    serve its first step, the rule each worker's health follows (front.py)."""
    await asyncio.gather(*(job.servable() for job in jobs.values()))
    if not stop.is_set():
        metrics.SERVING.set(1)


# ------------------------------------------------------------------------ a worker


async def _let_go_of_old_rows(jobs: dict[str, Job]) -> None:
    """Every FORGET_SECONDS, what each job holds in the arena's next segments let go."""
    while True:
        await asyncio.sleep(FORGET_SECONDS)
        for job in jobs.values():
            job.assembler.let_go(every=True)


def worker_main(
    config: Config,
    index: int,
    listen: str,
    health_listen: str,
    control: str,
    authkey: bytes,
    ready_file: str,
) -> None:
    logs.configure(config.server.log_format)
    keep_freed_memory()  # a spawned process: its own allocator (client/memory.py)
    uvloop.run(
        _worker(config, index, listen, health_listen, SupervisorLink(control, authkey), ready_file)
    )


async def _worker(
    config: Config,
    index: int,
    listen: str,
    health_listen: str,
    link: SupervisorLink,
    ready_file: str,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    jobs = open_worker(config, link).jobs
    io = ThreadPoolExecutor(4, thread_name_prefix="chunk-io")
    streams = spread.StreamSpread(
        arenaformat.node_dir(config.server.cache_dir) / spread.TABLE, index
    )
    front = Front(config, jobs, io, listen, health_listen or None, reuse_port=True, spread=streams)
    await front.start()

    def run(call, *args):
        return loop.run_in_executor(io, call, *args)

    async def every(seconds: float, call) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                call()
            except SupervisorUnavailable:
                pass
            if os.getppid() != parent:  # the supervisor is gone: so is this worker's cache
                log.error("worker %d: the supervisor exited; stopping", index)
                stop.set()

    async def push_metrics() -> None:
        pid = os.getpid()
        while True:
            await asyncio.sleep(METRICS_SECONDS)
            try:
                await run(link.call, "metrics", pid, snapshot())
            except SupervisorUnavailable:
                pass

    tasks = [asyncio.create_task(job.build_index(io, 2)) for job in jobs.values()]
    if config.server.plan_refresh_seconds:
        seconds = config.server.plan_refresh_seconds
        tasks += [asyncio.create_task(refresh_plan(j, io, seconds)) for j in jobs.values()]
    tasks += [
        asyncio.create_task(link.flush_forever(run)),
        asyncio.create_task(push_metrics()),
        asyncio.create_task(
            every(FORGET_SECONDS, lambda: [j.assembler.forget_gone() for j in jobs.values()])
        ),
        asyncio.create_task(_let_go_of_old_rows(jobs)),
        asyncio.create_task(front.serving(stop)),
        asyncio.create_task(settle_heap(jobs)),
    ]
    write_ready(ready_file, {"pid": os.getpid(), "address": front.address})
    log.info("worker %d serving on %s", index, front.address)
    await stop.wait()
    await front.drain()
    for task in tasks:
        task.cancel()
    io.shutdown(wait=False, cancel_futures=True)
    log.info("worker %d stopped", index)
