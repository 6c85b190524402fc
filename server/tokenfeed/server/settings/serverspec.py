"""The server's spec (ports, cache, workers) and `Config`: the whole file, jobs included.

Each option is declared once on its field (options.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configcheck import Instance, Integer, Number, Rule, Size, Text, fail
from tokenfeed.server.settings.configread import NUMBER, PATH, SIZE, TEXT_OR_NONE
from tokenfeed.server.settings.jobspec import JobSpec
from tokenfeed.server.settings.options import (
    REQUIRED,
    Convert,
    Form,
    Nested,
    Option,
    option,
    validate,
)
from tokenfeed.server.settings.portspec import AuthSpec, LimitsSpec, TlsSpec
from tokenfeed.server.settings.storespec import ObjectStoreSpec, StoreSpec

LOG_FORMATS = ("text", "json")
# More serving processes than this share one port badly (and no data node has the cores).
MAX_WORKERS = 1024


def available_cpus() -> int:
    """CPUs this process may run on, capped by a cgroup v2 CPU quota (a container's limit)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            count = min(count or 1, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, count or 1)


def _workers(value: object, where: str, base: Path) -> object:
    if value == "auto":
        return min(available_cpus(), MAX_WORKERS)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{where}: expected an integer in [1, {MAX_WORKERS}] or 'auto', got {value!r}"
        )
    return value


def _seconds(doc: str, why: str = "") -> dict[str, Option]:
    return option(Number(), read=NUMBER, doc=doc, why=why, accepts="seconds >= 0")


def _port(doc: str) -> dict[str, Option]:
    """A `host:port` that is off when left out ("" in code)."""
    return option(Text(empty=True), read=TEXT_OR_NONE, doc=doc, accepts="`host:port`")


@dataclass(frozen=True)
class ServerSpec:
    listen: str = field(
        default="127.0.0.1:50051",
        metadata=option(
            Text(),
            doc="`host:port` of the gRPC port; port 0 picks a free port (see `--ready-file`)",
            why="loopback: a sidecar serves the trainer beside it; a data node names its address",
        ),
    )
    metrics_listen: str = field(
        default="",
        metadata=_port(
            "Prometheus `/metrics` and the status page; port 0 picks a free port (written to "
            "`--ready-file` as `metrics`). Plain HTTP even with `server.tls` "
            "([why](deployment.md#tls-and-authentication)); `127.0.0.1:9100` keeps it on loopback"
        ),
    )
    cache_dir: str = field(
        default=".tokenfeed-cache",
        metadata=option(
            Text(),
            read=PATH,
            accepts="directory (relative to this file)",
            doc="the token store in `<cache_dir>/tokens`, object blocks in `<cache_dir>/blocks`",
        ),
    )
    cache_bytes: int = field(
        default=20 * 2**30,
        metadata=option(
            Size(),
            read=SIZE,
            doc="the disk cache's budget: raw blocks fetched from object storage plus token "
            "chunks ([storage and cache](storage-and-cache.md)). It must hold each job's largest "
            "window of token chunks plus raw data in flight; refused with the bytes needed "
            "otherwise ([sizing](deployment.md#sizing))",
        ),
    )
    prefetch_steps: int = field(
        default=8,
        metadata=option(
            Integer(minimum=0),
            doc="background prefetch keeps each job's chunks this many steps past its furthest "
            "request; 0 turns prefetch off",
        ),
    )
    plan_freeze_steps: int = field(
        default=64,
        metadata=option(
            Integer(minimum=1),
            doc="a server freezes each job's data plan this many steps past the furthest step it "
            "serves (one conditional write of the plan log per this many steps); a plan change "
            "must start after the frozen steps ([data plan](data-plan.md))",
            why="64: one write per 64 steps costs nothing measurable, and a change made a "
            "minute ahead of a run at one step per second takes effect",
        ),
    )
    plan_refresh_seconds: float = field(
        default=5.0,
        metadata=option(
            Number(minimum=0.0),
            read=NUMBER,
            doc="how often a server reads its jobs' plan logs for changes made elsewhere (for "
            "its status and prefetch; it always reads the log before serving a step past the "
            "frozen ones); 0 turns the reading off",
            why="5 s: a change shows on every server's status within seconds, at one small "
            "GET per job and interval",
        ),
    )
    tokenize_threads: int = field(
        default=2,
        metadata=option(
            Integer(minimum=1), doc="chunks tokenized at once (each call also uses all cores)"
        ),
    )
    log_format: str = field(
        default="text",
        metadata=option(
            Text(LOG_FORMATS), doc="`json`: one object per line, with structured fields"
        ),
    )
    max_wait_seconds: float = field(
        default=30.0,
        metadata=_seconds(
            "how long a request waits for a job that is still indexing, or for its chunks to be "
            "built, before `UNAVAILABLE`"
        ),
    )
    grace_seconds: float = field(
        default=10.0, metadata=_seconds("on SIGTERM, in-flight calls get this long to finish")
    )
    health_listen: str = field(
        default="",
        metadata=_port(
            "a plaintext gRPC port serving only `grpc.health.v1`, for probes that cannot speak "
            "TLS (the kubelet's); written to `--ready-file` as `health`"
        ),
    )
    tls: TlsSpec = field(
        default_factory=TlsSpec,
        metadata=option(
            Instance(TlsSpec),
            read=Nested(TlsSpec, absent="off"),
            doc="TLS on `listen`; left out: plaintext",
        ),
    )
    auth: AuthSpec = field(
        default_factory=AuthSpec,
        metadata=option(
            Instance(AuthSpec),
            read=Nested(AuthSpec, absent="off"),
            accepts="tokens_file, tokens_env or both",
            doc="bearer tokens on every call but health ([tokens file](#tokens-file)); left "
            "out: none",
        ),
    )
    limits: LimitsSpec = field(
        default_factory=LimitsSpec,
        metadata=option(
            Instance(LimitsSpec),
            read=Nested(LimitsSpec),
            doc="what a client may ask of the port ([limits](#limits))",
        ),
    )
    workers: int = field(
        default=1,
        metadata=option(
            Integer(minimum=1, maximum=MAX_WORKERS),
            read=Convert(_workers, f"integer in [1, {MAX_WORKERS}] or `auto`"),
            doc="serving processes sharing `listen` (SO_REUSEPORT): with more than 1, a "
            "supervisor owns the cache (plans, tokenizes, evicts, prefetches, serves "
            "`metrics_listen` with every worker's counters summed) and that many workers serve, "
            "reading the token store ([processes](deployment.md#every-core-serving-workers)). "
            "`auto`: the CPUs the process may use, capped by its cgroup's CPU quota",
            why="a sidecar serves one trainer on localhost; a data node sets `auto` (the fleet "
            "manifest does)",
        ),
    )
    stream_ahead: int = field(
        default=2,
        metadata=option(
            Integer(minimum=1),
            doc="batches each StreamBatches call builds ahead of the ones being sent (a group of "
            "up to 32 small batches, at most four [32, 4096] batches' tokens in all, is "
            "assembled in one pass once fewer than this many batches wait, and queued whole): a "
            "reader that stalls holds the group being sent and its message in gRPC's hands, "
            "fewer than this many batches and a group queued: at most two groups of 512 Ki "
            "tokens and `stream_ahead` batches per stalled stream ([limits](#limits))",
            why="enough to keep the wire busy while the next is built (bench/ serving section), "
            "few enough that a reader that stalls holds little memory",
        ),
    )
    stream_cache_bytes: int = field(
        default=512 * 2**20,
        metadata=option(
            Size(),
            read=SIZE,
            doc="memory (per serving process, for each job) for chunks' row buffers: each concat "
            "stream laid out in its epoch's order with its tail (at most `seq_len` tokens its "
            "last row reads past the chunk's end), so a row is one slice copy; give it a window "
            "of token chunks "
            "and one more chunk (`window_chunks + 1` × token bytes per chunk, "
            "[sizing](deployment.md#sizing)); a smaller value only costs speed. Where it holds "
            "more windows, prefetch lays out up to eight windows ahead of the trainers. With "
            "`workers` "
            "> 1 the workers share the buffers through one arena in `/dev/shm` of at most this "
            "much, each process holding at most a quarter of it in place "
            "([workers](deployment.md#every-core-serving-workers))",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class Config:
    server: ServerSpec = field(
        metadata=option(
            Instance(ServerSpec), read=Nested(ServerSpec), doc="the server (below)", shown="below"
        )
    )
    jobs: tuple[JobSpec, ...] = field(
        default_factory=tuple,
        metadata=option(
            Rule(lambda v: isinstance(v, tuple), "a tuple of JobSpec"),
            read=Form("mapping of job name to job (below)"),
            default=REQUIRED,
            doc="the jobs this server serves, by the name clients ask for",
        ),
    )
    object_store: ObjectStoreSpec = field(
        default_factory=ObjectStoreSpec,
        metadata=option(
            Instance(ObjectStoreSpec),
            read=Nested(ObjectStoreSpec),
            doc="how `s3://` sources, tokenizers and stores are reached (below)",
        ),
    )
    store: StoreSpec = field(
        default_factory=StoreSpec,
        metadata=option(
            Instance(StoreSpec),
            read=Form("`uri` or mapping (below)"),
            shown="none",
            doc="a token store shared by a fleet; a plain string is its `uri`",
        ),
    )
    # The file the config came from, for messages.
    origin: str = field(
        default="<memory>", metadata=option(Text(), key=None, doc="the file, for messages")
    )

    def __post_init__(self) -> None:
        validate(self)
        names: set[str] = set()
        for i, job in enumerate(self.jobs):
            Instance(JobSpec)(f"jobs[{i}]", job)
            # Clients ask for a job by name: two of one name would serve one of them.
            if job.name in names:
                raise fail(f"jobs[{i}].name", "a name no other job has", job.name)
            names.add(job.name)

    def job(self, name: str) -> JobSpec:
        for job in self.jobs:
            if job.name == name:
                return job
        raise ConfigError(f"no job named {name!r} in {self.origin}; jobs: {self.job_names()}")

    def job_names(self) -> list[str]:
        return [j.name for j in self.jobs]
