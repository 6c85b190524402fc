"""The gRPC side of a serving process: the TokenFeed service, health, reflection, TLS and
bearer tokens, the plaintext health port, SERVING once every job can serve, and the drain.

Used by the single-process daemon (app.py) and by each serving worker (workers.py), which
share one port through SO_REUSEPORT.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import Executor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.serve import auth
from tokenfeed.server.serve.service import TokenFeedServicer, register
from tokenfeed.server.serve.spread import StreamSpread
from tokenfeed.server.settings.config import Config
from tokenfeed.server.telemetry import metrics
from tokenfeed.v1 import tokenfeed_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TokenFeed"].full_name
# Batches can be large (rows x seq_len x 4 tensors x 4 bytes); the default 4 MiB is too small.
MAX_MESSAGE_BYTES = 1 << 30
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def server_options(config: Config, reuse_port: bool) -> list[tuple[str, int]]:
    """The gRPC core options of the serving port: server.limits (docs/configuration.md)."""
    lim = config.server.limits
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", lim.max_request_bytes),
        ("grpc.max_concurrent_streams", lim.max_streams_per_connection),
        ("grpc.keepalive_time_ms", int(lim.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(lim.keepalive_timeout_seconds * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(lim.min_ping_seconds * 1000)),
        ("grpc.http2.max_ping_strikes", 0),  # clients' pings within the limits never refused
        ("grpc.max_connection_idle_ms", int(lim.idle_seconds * 1000)),
        ("grpc.so_reuseport", int(reuse_port)),
    ]


def _listen(
    server: grpc.aio.Server,
    listen: str,
    credentials: grpc.ServerCredentials | None = None,
    key: str = "server.listen",
) -> str:
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
    log.info(
        "gRPC port: %s, %s",
        mode,
        f"{len(tokens)} bearer token(s)" if tokens else "no authentication",
    )
    return credentials, [auth.AuthInterceptor(tokens)] if tokens else []


class Front:
    """One process's gRPC servers. `listen`/`health_listen` override the config's addresses
    (a worker binds the port its supervisor reserved); `reuse_port` shares them; `spread`: a
    worker's view of its node's streams (serve/spread.py)."""

    def __init__(
        self,
        config: Config,
        jobs: dict[str, Job],
        io: Executor,
        listen: str | None = None,
        health_listen: str | None = None,
        reuse_port: bool = False,
        spread: StreamSpread | None = None,
    ):
        self.config, self.jobs = config, jobs
        credentials, interceptors = _security(config)
        self.server = grpc.aio.server(
            options=server_options(config, reuse_port),
            interceptors=interceptors,
            maximum_concurrent_rpcs=config.server.limits.max_concurrent_rpcs,
        )
        servicer = TokenFeedServicer(
            jobs, config.server.max_wait_seconds, io, config.server.stream_ahead, spread
        )
        register(servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.address = _listen(self.server, listen or config.server.listen, credentials)
        # Health alone, in plaintext, on its own port: the kubelet's gRPC probes cannot speak TLS.
        self.health_server, self.health_address = None, ""
        health_listen = health_listen or config.server.health_listen
        if health_listen:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", int(reuse_port))])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_address = _listen(
                self.health_server, health_listen, key="server.health_listen"
            )

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        # Health says SERVING once every job can serve its first step (the windows it needs
        # are built; the rest is built in sample order while serving) or has failed: before
        # that a request could only wait or be told UNAVAILABLE, so probes and load balancers
        # look elsewhere.
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def serving(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(job.servable() for job in self.jobs.values()))
        if not stop.is_set():
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            metrics.SERVING.set(1)
            log.info("health: SERVING")

    async def drain(self) -> None:
        """Health NOT_SERVING, then `grace_seconds` for the calls in flight."""
        metrics.SERVING.set(0)
        grace = self.config.server.grace_seconds
        log.info("draining: health NOT_SERVING, %.1fs grace for in-flight calls", grace)
        await self.health.enter_graceful_shutdown()
        for job in self.jobs.values():
            job.cancel()  # tokenizing threads stop at their next encode batch
        await self.server.stop(grace)
        if self.health_server is not None:  # answered NOT_SERVING through the drain
            await self.health_server.stop(None)
