"""The daemon: builds jobs from the config, serves them over grpc.aio, drains on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tokenfeed.server.config import Config
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.job import Job
from tokenfeed.server.service import TokenFeedServicer
from tokenfeed.server.tokstore import TokenStore
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TokenFeed"].full_name
# Batches can be large (rows x seq_len x 4 tensors x 4 bytes); the default 4 MiB is too small.
MAX_MESSAGE_BYTES = 1 << 30
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def build_jobs(config: Config) -> dict[str, Job]:
    store = TokenStore(config.server.cache_dir)
    return {spec.name: Job(spec, store) for spec in config.jobs}


def _listen(server: grpc.aio.Server, listen: str) -> str:
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as e:  # grpc's way of saying the address is taken or invalid
        raise ConfigError(f"server.listen: cannot listen on {listen!r}: {e}") from None
    return f"{listen.rsplit(':', 1)[0]}:{port}"


async def serve(config: Config, ready_file: str | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before anything can be told we serve
        loop.add_signal_handler(sig, stop.set)
    jobs = build_jobs(config)
    threads = config.server.tokenize_threads
    tokenize = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
    io = ThreadPoolExecutor(2, thread_name_prefix="chunk-io")
    server = grpc.aio.server(options=GRPC_OPTIONS)
    servicer = TokenFeedServicer(jobs, config.server.max_wait_seconds, io)
    pb_grpc.add_TokenFeedServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server,
    )  # fmt: skip
    address = _listen(server, config.server.listen)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %d job(s) %s on %s", len(jobs), sorted(jobs), address)
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
        tmp.replace(ready_file)

    builds = [asyncio.create_task(job.build_index(tokenize, threads)) for job in jobs.values()]
    await stop.wait()

    log.info("draining: health NOT_SERVING, %.1fs grace for in-flight calls",
             config.server.grace_seconds)  # fmt: skip
    await health_servicer.enter_graceful_shutdown()
    for job in jobs.values():
        job.cancel()  # tokenizing threads stop at their next encode batch
    await server.stop(config.server.grace_seconds)
    for task in builds:
        task.cancel()
    tokenize.shutdown(wait=True, cancel_futures=True)
    io.shutdown(wait=False, cancel_futures=True)
    log.info("stopped")


def run(config: Config, ready_file: str | None = None) -> None:
    uvloop.run(serve(config, ready_file))
