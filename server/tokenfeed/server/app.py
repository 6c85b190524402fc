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
from tokenfeed.server import auth, metrics
from tokenfeed.server.cache import BlockFiles, DiskCache
from tokenfeed.server.config import Config
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.eviction import FutureUse
from tokenfeed.server.httpstatus import start_http
from tokenfeed.server.job import Job
from tokenfeed.server.service import TokenFeedServicer
from tokenfeed.server.sharedstore import SharedStore
from tokenfeed.server.storage import Storage
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
    """The jobs of a config over one disk cache, with the eviction policy that knows them."""
    cache = DiskCache(config.server.cache_dir, config.server.cache_bytes)
    storage = Storage(config.object_store, BlockFiles(cache))
    store = TokenStore(cache.root, cache)
    shared = SharedStore(config.store, storage) if config.store.uri else None
    jobs = {spec.name: Job(spec, store, storage, shared) for spec in config.jobs}
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


def _listen(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None = None,
            key: str = "server.listen") -> str:  # fmt: skip
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError as e:  # grpc's way of saying the address is taken or invalid
        raise ConfigError(f"{key}: cannot listen on {listen!r}: {e}") from None
    return f"{listen.rsplit(':', 1)[0]}:{port}"


def _security(config: Config) -> tuple[grpc.ServerCredentials | None, list]:
    """The gRPC port's credentials and interceptors, from files read (and checked) now."""
    s = config.server
    credentials = auth.server_credentials(s.tls, config.origin) if s.tls.enabled else None
    tokens = auth.TokenSet(s.auth, os.environ, config.origin) if s.auth.enabled else None
    mode = ("mTLS" if s.tls.client_ca_file else "TLS") if credentials is not None else "plaintext"
    log.info("gRPC port: %s, %s", mode,
             f"{len(tokens)} bearer token(s)" if tokens else "no authentication")  # fmt: skip
    return credentials, [auth.AuthInterceptor(tokens)] if tokens else []


async def serve(config: Config, ready_file: str | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before anything can be told we serve
        loop.add_signal_handler(sig, stop.set)
    check_budget(config)
    credentials, interceptors = _security(config)
    jobs = build_jobs(config)
    threads = config.server.tokenize_threads
    tokenize = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
    io = ThreadPoolExecutor(2, thread_name_prefix="chunk-io")
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
    servicer = TokenFeedServicer(jobs, config.server.max_wait_seconds, io)
    pb_grpc.add_TokenFeedServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server,
    )  # fmt: skip
    address = _listen(server, config.server.listen, credentials)
    # Health alone, in plaintext, on its own port: the kubelet's gRPC probes cannot speak TLS.
    health_server, health_address = None, ""
    if config.server.health_listen:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_address = _listen(health_server, config.server.health_listen,
                                 key="server.health_listen")  # fmt: skip
    http = start_http(config.server.metrics_listen, jobs) if config.server.metrics_listen else None
    await server.start()
    if health_server is not None:
        await health_server.start()
    # Health says SERVING once every job can serve its first step (the windows it needs are
    # built; the rest is built in sample order while serving) or has failed: before that a
    # request could only wait or be told UNAVAILABLE, so probes and load balancers look elsewhere.
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("serving %d job(s) %s on %s", len(jobs), sorted(jobs), address)
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        ready = {"address": address, "pid": os.getpid(),
                 "metrics": http.address if http is not None else "",
                 "health": health_address}  # fmt: skip
        tmp.write_text(json.dumps(ready))
        tmp.replace(ready_file)

    builds = [asyncio.create_task(job.build_index(tokenize, threads)) for job in jobs.values()]
    builds += [asyncio.create_task(job.prefetch(tokenize, config.server.prefetch_steps))
               for job in jobs.values()]  # fmt: skip

    async def serving() -> None:
        await asyncio.gather(*(job.servable() for job in jobs.values()))
        if not stop.is_set():
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            metrics.SERVING.set(1)
            log.info("health: SERVING")

    builds.append(asyncio.create_task(serving()))
    await stop.wait()
    metrics.SERVING.set(0)

    log.info("draining: health NOT_SERVING, %.1fs grace for in-flight calls",
             config.server.grace_seconds)  # fmt: skip
    await health_servicer.enter_graceful_shutdown()
    for job in jobs.values():
        job.cancel()  # tokenizing threads stop at their next encode batch
    await server.stop(config.server.grace_seconds)
    if health_server is not None:  # answered NOT_SERVING through the drain
        await health_server.stop(None)
    for task in builds:
        task.cancel()
    tokenize.shutdown(wait=True, cancel_futures=True)
    io.shutdown(wait=False, cancel_futures=True)
    if http is not None:
        http.shutdown()
    log.info("stopped")


def run(config: Config, ready_file: str | None = None) -> None:
    uvloop.run(serve(config, ready_file))
