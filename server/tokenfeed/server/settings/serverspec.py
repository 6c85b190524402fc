"""The server's spec (ports, cache, workers), how it reaches object storage and the fleet's
shared store, and `Config`: the whole file, jobs included.

Checked on construction like every spec (configcheck.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings import configcheck as check
from tokenfeed.server.settings.jobspec import JobSpec
from tokenfeed.server.settings.portspec import AuthSpec, LimitsSpec, TlsSpec

LOG_FORMATS = ("text", "json")
ADDRESSING_STYLES = ("auto", "path", "virtual")
# More serving processes than this share one port badly (and no data node has the cores).
MAX_WORKERS = 1024


@dataclass(frozen=True)
class ServerSpec:
    listen: str = "127.0.0.1:50051"
    # Prometheus metrics and the status page; empty: no HTTP port.
    metrics_listen: str = ""
    cache_dir: str = ".tokenfeed-cache"
    # The disk cache's budget: raw blocks fetched from object storage plus token chunks.
    cache_bytes: int = 20 * 2**30
    # Background prefetch keeps each job's chunks this many steps past its furthest request.
    prefetch_steps: int = 8
    tokenize_threads: int = 2
    log_format: str = "text"
    # How long a request waits for a job that is still indexing before UNAVAILABLE.
    max_wait_seconds: float = 30.0
    grace_seconds: float = 10.0
    # A plaintext gRPC port serving grpc.health.v1 only, for probes that cannot speak TLS (the
    # kubelet's); empty: none.
    health_listen: str = ""
    tls: TlsSpec = field(default_factory=TlsSpec)
    auth: AuthSpec = field(default_factory=AuthSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    # Serving processes on the listen port (workers.py). 1: one process owns the cache and
    # serves, as a sidecar beside one trainer wants. More (or `auto`: the CPUs this process
    # may use, capped by its cgroup's CPU quota): a supervisor owns the cache and that many
    # workers serve, so every core of a data node serves.
    workers: int = 1
    # Batches each StreamBatches call builds ahead of the one being sent: enough to keep the
    # wire busy while the next is built (bench/ serving section), few enough that a reader
    # that stalls holds little memory (this many batches, plus one in gRPC's hands).
    stream_ahead: int = 2
    # Memory for chunks' concat streams laid out in each epoch's order (per process): a row is
    # then a slice copy. It should hold a window of chunks and the next window's first.
    stream_cache_bytes: int = 512 * 2**20

    def __post_init__(self) -> None:
        check.text("listen", self.listen)
        check.text("metrics_listen", self.metrics_listen, empty=True)
        check.text("cache_dir", self.cache_dir)
        check.size("cache_bytes", self.cache_bytes)
        check.integer("prefetch_steps", self.prefetch_steps, minimum=0)
        check.integer("tokenize_threads", self.tokenize_threads, minimum=1)
        check.text("log_format", self.log_format, LOG_FORMATS)
        check.float_field(self, "max_wait_seconds")
        check.float_field(self, "grace_seconds")
        check.text("health_listen", self.health_listen, empty=True)
        check.instance("tls", self.tls, TlsSpec)
        check.instance("auth", self.auth, AuthSpec)
        check.instance("limits", self.limits, LimitsSpec)
        check.integer("workers", self.workers, minimum=1, maximum=MAX_WORKERS)
        check.integer("stream_ahead", self.stream_ahead, minimum=1)
        check.size("stream_cache_bytes", self.stream_cache_bytes)


@dataclass(frozen=True)
class ObjectStoreSpec:
    """How `s3://` URIs are reached. Credentials come from boto3's standard chain (environment,
    shared files, `profile`, instance or pod roles), never from this file."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"
    profile: str | None = None
    # Reads are ranged GETs of aligned blocks of this size, cached on disk.
    block_bytes: int = 8 * 2**20
    max_concurrency: int = 8
    max_attempts: int = 8
    backoff_base_seconds: float = 0.1
    backoff_max_seconds: float = 20.0
    connect_timeout_seconds: float = 10.0
    read_timeout_seconds: float = 60.0

    def __post_init__(self) -> None:
        url = check.optional_text("endpoint_url", self.endpoint_url)
        if url is not None and not re.match(r"https?://", url):
            raise check.fail("endpoint_url", "http:// or https://", url)
        check.optional_text("region", self.region)
        check.text("addressing_style", self.addressing_style, ADDRESSING_STYLES)
        check.optional_text("profile", self.profile)
        check.size("block_bytes", self.block_bytes)
        check.integer("max_concurrency", self.max_concurrency, minimum=1)
        check.integer("max_attempts", self.max_attempts, minimum=1)
        check.float_field(self, "backoff_base_seconds")
        check.float_field(self, "backoff_max_seconds")
        check.float_field(self, "connect_timeout_seconds")
        check.float_field(self, "read_timeout_seconds")


@dataclass(frozen=True)
class StoreSpec:
    """A token store shared by a fleet (sharedstore.py): chunks tokenized by one node are
    published under `uri` and read by the others, so each chunk is tokenized about once."""

    uri: str = ""  # s3://bucket/prefix/ or a directory; empty: no shared store
    # This node's name in the fleet: rendezvous hashing assigns chunks to names. Default:
    # the host name and cache directory (stable across restarts of one node).
    node: str = ""
    # Before building, wait (up to join_seconds) until this many nodes heartbeat, so a fleet
    # started together splits the work from the first chunk.
    min_nodes: int = 1
    join_seconds: float = 60.0
    # A node whose heartbeat is older than this is gone: its chunks are taken over.
    node_ttl_seconds: float = 30.0
    # A chunk assigned to a live node but still missing after this long is tokenized here.
    takeover_seconds: float = 120.0

    def __post_init__(self) -> None:
        uri = check.text("uri", self.uri, empty=True)
        node = check.text("node", self.node, empty=True)
        # Chunks are assigned to node names: a nameless node would own nothing and take over
        # everything.
        if uri and not node:
            raise ConfigError(f"node: required with uri {uri!r}")
        check.integer("min_nodes", self.min_nodes, minimum=1)
        check.float_field(self, "join_seconds")
        check.float_field(self, "node_ttl_seconds", above_zero=True)
        check.float_field(self, "takeover_seconds")


@dataclass(frozen=True)
class Config:
    server: ServerSpec
    jobs: tuple[JobSpec, ...] = field(default_factory=tuple)
    object_store: ObjectStoreSpec = field(default_factory=ObjectStoreSpec)
    store: StoreSpec = field(default_factory=StoreSpec)
    # The file the config came from, for messages.
    origin: str = "<memory>"

    def __post_init__(self) -> None:
        check.instance("server", self.server, ServerSpec)
        if not isinstance(self.jobs, tuple):
            raise check.fail("jobs", "a tuple of JobSpec", self.jobs)
        names: set[str] = set()
        for i, job in enumerate(self.jobs):
            check.instance(f"jobs[{i}]", job, JobSpec)
            # Clients ask for a job by name: two of one name would serve one of them.
            if job.name in names:
                raise check.fail(f"jobs[{i}].name", "a name no other job has", job.name)
            names.add(job.name)
        check.instance("object_store", self.object_store, ObjectStoreSpec)
        check.instance("store", self.store, StoreSpec)
        check.text("origin", self.origin)

    def job(self, name: str) -> JobSpec:
        for job in self.jobs:
            if job.name == name:
                return job
        raise ConfigError(f"no job named {name!r} in {self.origin}; jobs: {self.job_names()}")

    def job_names(self) -> list[str]:
        return [j.name for j in self.jobs]
