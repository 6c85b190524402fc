"""Configuration: frozen dataclasses validated on construction, parsed once in `main`.

A config file is YAML (`.yaml`/`.yml`) or TOML (`.toml`). Every error names the key path and the
bad value, and the file it came from, e.g. `jobs.demo.seq_len: expected an integer >= 1, got -3`.
Relative paths are resolved against the directory of the config file.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml
from tokenfeed.server.configparse import Section, parse_size, resolve, to_fraction
from tokenfeed.server.errors import ConfigError

log = logging.getLogger(__name__)

PACKINGS = ("concat", "best_fit")
# Names `format: auto` reads as JSON Lines (chunks.py reads the same suffixes).
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
BAD_RECORD_POLICIES = ("skip", "strict")
FORMATS = ("auto", "jsonl", "parquet", "megatron")
TOKENIZER_BACKENDS = ("auto", "hf", "tiktoken")


@dataclass(frozen=True)
class SourceSpec:
    """One glob (or path) of source objects and how to read them."""

    pattern: str
    format: str = "auto"
    text_field: str = "text"
    # Parquet only: a column of token-id lists read instead of a text column (no tokenizer).
    token_field: str | None = None


@dataclass(frozen=True)
class TokenizerSpec:
    path: str
    # Explicit ids win; otherwise the named tokens are looked up in the tokenizer's vocabulary;
    # otherwise EOS is guessed from common names (see tokenize.py).
    eos_id: int | None = None
    eos_token: str | None = None
    bos_id: int | None = None
    bos_token: str | None = None
    add_bos: bool = False
    # The engine that computes the ids: never changes them (tokenize.py checks at load time),
    # so it is not part of the job's fingerprint.
    backend: str = "auto"


@dataclass(frozen=True)
class DatasetSpec:
    # Keys the dataset's sample order: renaming a job keeps its batches.
    name: str
    sources: tuple[SourceSpec, ...]
    chunk_bytes: int = 64 * 2**20


@dataclass(frozen=True)
class PhaseSpec:
    """From `start_step` on: this global batch size and these weights (one per dataset)."""

    start_step: int
    global_batch_size: int
    weights: tuple[Fraction, ...]


@dataclass(frozen=True)
class JobSpec:
    name: str
    datasets: tuple[DatasetSpec, ...]
    tokenizer: TokenizerSpec
    seq_len: int
    # phases[0] starts at step 0 and carries the job's global_batch_size and weights
    phases: tuple[PhaseSpec, ...]
    seed: int = 0
    packing: str = "concat"
    window_chunks: int = 8
    bad_records: str = "skip"

    @property
    def global_batch_size(self) -> int:
        """The batch size of step 0."""
        return self.phases[0].global_batch_size

    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]


@dataclass(frozen=True)
class TlsSpec:
    """TLS on the gRPC port; auth.py reads and checks the files when the server starts."""

    cert_file: str = ""  # PEM certificate chain; empty: no TLS
    key_file: str = ""  # PEM private key of the certificate, unencrypted
    # PEM CA bundle: when set, every client must present a certificate it signed (mTLS).
    client_ca_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass(frozen=True)
class LimitsSpec:
    """Bounds on what clients may ask of a serving process (docs/configuration.md, limits)."""

    # Requests are a job name and a few integers: tens of bytes. 64 KiB leaves room for any
    # job name while a client can no longer make the server buffer a gigabyte.
    max_request_bytes: int = 64 * 1024
    # RPCs in flight at once (unary calls and open streams together); past it, RESOURCE_
    # EXHAUSTED. 1024: every rank of a large run on one server, with room for retries.
    max_concurrent_rpcs: int = 1024
    # HTTP/2 streams per connection: a client multiplexing more waits for one to finish.
    max_streams_per_connection: int = 256
    # Server pings an idle connection every keepalive_seconds and drops it if no answer comes
    # in keepalive_timeout_seconds; clients may ping as often as every min_ping_seconds.
    keepalive_seconds: float = 60.0
    keepalive_timeout_seconds: float = 20.0
    min_ping_seconds: float = 5.0
    # A connection with no call for this long is closed (the client reconnects when needed).
    idle_seconds: float = 600.0


@dataclass(frozen=True)
class AuthSpec:
    """Bearer tokens every call but the health checks must carry (auth.py). The accepted set is
    the union of the file's tokens and the variable's."""

    tokens_file: str = ""  # one token per line, `#` comments; re-read when it changes
    tokens_env: str = ""  # the name of an environment variable holding tokens, read at start

    @property
    def enabled(self) -> bool:
        return bool(self.tokens_file or self.tokens_env)


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


ADDRESSING_STYLES = ("auto", "path", "virtual")


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


@dataclass(frozen=True)
class Config:
    server: ServerSpec
    jobs: tuple[JobSpec, ...] = field(default_factory=tuple)
    object_store: ObjectStoreSpec = field(default_factory=ObjectStoreSpec)
    store: StoreSpec = field(default_factory=StoreSpec)
    origin: str = "<memory>"

    def job(self, name: str) -> JobSpec:
        for job in self.jobs:
            if job.name == name:
                return job
        raise ConfigError(f"no job named {name!r} in {self.origin}; jobs: {self.job_names()}")

    def job_names(self) -> list[str]:
        return [j.name for j in self.jobs]


def _source(raw: Any, where: str, base: Path, default_field: str) -> SourceSpec:
    if isinstance(raw, str):
        raw = {"path": raw}
    s = Section(raw, where)
    spec = SourceSpec(
        pattern=resolve(s.str("path"), base),
        format=s.str("format", "auto", FORMATS),
        text_field=s.str("text_field", default_field),
        token_field=s.opt_str("token_field"),
    )
    s.done()
    _check_source_fields(spec, s)
    return spec


def _check_source_fields(spec: SourceSpec, s: Section) -> None:
    """Fields that cannot apply to the source's format. A pattern whose name does not tell the
    format (and `format: auto`) is checked per object when its chunks are planned."""
    name = re.sub(r"\.(gz|zst|zstd)$", "", spec.pattern.lower())
    megatron = spec.format == "megatron" or (spec.format == "auto" and name.endswith(".idx"))
    jsonl = spec.format == "jsonl" or (spec.format == "auto" and name.endswith(JSONL_SUFFIXES))
    if spec.token_field is not None and (megatron or jsonl):
        kind = "Megatron datasets hold token ids already" if megatron else "not JSON Lines"
        raise ConfigError(
            f"{s.path('token_field')}: applies to Parquet sources only ({kind}), "
            f"got {spec.token_field!r} for {spec.pattern!r}"
        )
    if spec.token_field is not None and "text_field" in s.raw:
        raise ConfigError(
            f"{s.path('token_field')}: a source reads either a text column or a "
            f"token column, got text_field {s.raw['text_field']!r} and "
            f"token_field {spec.token_field!r}"
        )
    if megatron and "text_field" in s.raw:
        raise ConfigError(
            f"{s.path('text_field')}: a Megatron source has no text field, got "
            f"{s.raw['text_field']!r} for {spec.pattern!r}"
        )


def _tokenizer(raw: Any, where: str, base: Path) -> TokenizerSpec:
    if isinstance(raw, str):
        raw = {"path": raw}
    s = Section(raw, where)
    spec = TokenizerSpec(
        path=resolve(s.str("path"), base),
        eos_id=s.opt_int("eos_id"),
        eos_token=s.opt_str("eos_token"),
        bos_id=s.opt_int("bos_id"),
        bos_token=s.opt_str("bos_token"),
        add_bos=s.bool("add_bos", False),
        backend=s.str("backend", "auto", choices=TOKENIZER_BACKENDS),
    )
    s.done()
    return spec


def _sources(s: Section, base: Path, text_field: str) -> tuple[SourceSpec, ...]:
    raw = s.require("sources")
    if isinstance(raw, (str, dict)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{s.path('sources')}: expected a non-empty list, got {raw!r}")
    return tuple(
        _source(r, f"{s.path('sources')}[{i}]", base, text_field) for i, r in enumerate(raw)
    )


# Under this, per-chunk costs outweigh the bytes read (bench/smallobjects.py, bench/store.py).
SMALL_CHUNK_BYTES = 2**20


def _chunk_bytes(s: Section, default: int) -> int:
    """`chunk_bytes` of a job or dataset; a small one is allowed (tests use it) but said to
    cost what it does, once, where it is given."""
    size = parse_size(s.get("chunk_bytes", default), s.path("chunk_bytes"))
    if "chunk_bytes" in s.raw and size < SMALL_CHUNK_BYTES:
        log.warning(
            "%s: chunk_bytes %d is under 1 MiB: each chunk costs 4 store files, a manifest and "
            "at least one GET; expect slow builds and a large store",
            s.path("chunk_bytes"),
            size,
        )
    return size


def _datasets(s: Section, base: Path, text_field: str, chunk_bytes: int):
    """(datasets, their weights): a `datasets:` mapping, or the job's own `sources:`."""
    if "datasets" not in s.raw:
        name = s.str("dataset", "main")
        return (DatasetSpec(name, _sources(s, base, text_field), chunk_bytes),), (Fraction(1),)
    raw = s.require("datasets")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"{s.path('datasets')}: expected a mapping of name to dataset, got {raw!r}"
        )
    if "sources" in s.raw:
        raise ConfigError(
            f"{s.path('sources')}: give sources inside each dataset of "
            f"{s.path('datasets')}, not beside them"
        )
    datasets, weights = [], []
    for name, body in raw.items():
        d = Section(body, f"{s.path('datasets')}.{name}")
        field = d.str("text_field", text_field)
        size = _chunk_bytes(d, chunk_bytes)
        datasets.append(DatasetSpec(str(name), _sources(d, base, field), size))
        weights.append(d.fraction("weight", 1))
        d.done()
    return tuple(datasets), tuple(weights)


def _weights(raw: Any, where: str, names: list[str], previous: tuple[Fraction, ...]):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of dataset name to weight, got {raw!r}")
    unknown = sorted(set(map(str, raw)) - set(names))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown dataset (datasets: {names})")
    given = {str(k): to_fraction(v, f"{where}.{k}") for k, v in raw.items()}
    return tuple(given.get(n, previous[i]) for i, n in enumerate(names))


def _check_weights(weights: tuple[Fraction, ...], where: str) -> None:
    if sum(weights) <= 0:
        raise ConfigError(
            f"{where}: weights must have a positive sum, got {[str(w) for w in weights]}"
        )


def _phases(s: Section, first: PhaseSpec, names: list[str], multiple: int):
    phases = [first]
    raw = s.get("schedule", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{s.path('schedule')}: expected a list of phases, got {raw!r}")
    for i, body in enumerate(raw):
        p = Section(body, f"{s.path('schedule')}[{i}]")
        prev = phases[-1]
        start = p.int("start_step", minimum=1)
        if start <= prev.start_step:
            raise ConfigError(
                f"{p.path('start_step')}: phases must start in increasing order; "
                f"{start} is not after {prev.start_step}"
            )
        batch = p.int("global_batch_size", prev.global_batch_size, minimum=1)
        weights = prev.weights
        if "weights" in p.raw:
            weights = _weights(p.get("weights"), p.path("weights"), names, prev.weights)
        _check_weights(weights, p.path("weights"))
        p.done()
        phases.append(PhaseSpec(start, batch, weights))
    for i, phase in enumerate(phases):
        if phase.global_batch_size % multiple:
            where = s.path("global_batch_size") if i == 0 else f"{s.path('schedule')}[{i - 1}]"
            raise ConfigError(
                f"{where}: global_batch_size {phase.global_batch_size} is not a "
                f"multiple of batch_multiple_of {multiple}"
            )
    return tuple(phases)


def _job(name: str, raw: Any, where: str, base: Path) -> JobSpec:
    s = Section(raw, where)
    text_field = s.str("text_field", "text")
    chunk_bytes = _chunk_bytes(s, 64 * 2**20)
    datasets, weights = _datasets(s, base, text_field, chunk_bytes)
    names = [d.name for d in datasets]
    if "weights" in s.raw:
        weights = _weights(s.get("weights"), s.path("weights"), names, weights)
    _check_weights(weights, s.path("weights") if "weights" in s.raw else s.path("datasets"))
    multiple = s.int("batch_multiple_of", 1, minimum=1)
    first = PhaseSpec(0, s.int("global_batch_size", minimum=1), weights)
    spec = JobSpec(
        name=name,
        datasets=datasets,
        tokenizer=_tokenizer(s.require("tokenizer"), s.path("tokenizer"), base),
        seq_len=s.int("seq_len", minimum=1),
        phases=_phases(s, first, names, multiple),
        seed=s.int("seed", 0, minimum=0),
        packing=s.str("packing", "concat", PACKINGS),
        window_chunks=s.int("window_chunks", 8, minimum=1),
        bad_records=s.str("bad_records", "skip", BAD_RECORD_POLICIES),
    )
    if spec.seed >= 2**64:
        raise ConfigError(f"{s.path('seed')}: expected an integer < 2**64, got {spec.seed}")
    s.get("dataset")  # consumed by _datasets for the single-dataset form
    s.done()
    return spec


def _server(raw: Any, base: Path) -> ServerSpec:
    s = Section(raw if raw is not None else {}, "server")
    spec = ServerSpec(
        listen=s.str("listen", ServerSpec.listen),
        metrics_listen=s.opt_str("metrics_listen") or "",
        cache_dir=resolve(s.str("cache_dir", ServerSpec.cache_dir), base),
        cache_bytes=parse_size(s.get("cache_bytes", ServerSpec.cache_bytes), s.path("cache_bytes")),
        prefetch_steps=s.int("prefetch_steps", ServerSpec.prefetch_steps, minimum=0),
        tokenize_threads=s.int("tokenize_threads", ServerSpec.tokenize_threads, minimum=1),
        log_format=s.str("log_format", "text", ("text", "json")),
        max_wait_seconds=s.number("max_wait_seconds", ServerSpec.max_wait_seconds),
        grace_seconds=s.number("grace_seconds", ServerSpec.grace_seconds),
        health_listen=s.opt_str("health_listen") or "",
        tls=_tls(s.get("tls"), base),
        auth=_auth(s.get("auth"), base),
        limits=_limits(s.get("limits")),
        workers=_workers(s),
        stream_ahead=s.int("stream_ahead", ServerSpec.stream_ahead, minimum=1),
        stream_cache_bytes=parse_size(
            s.get("stream_cache_bytes", ServerSpec.stream_cache_bytes), s.path("stream_cache_bytes")
        ),
    )
    s.done()
    return spec


def _workers(s: Section) -> int:
    raw = s.get("workers", ServerSpec.workers)
    if raw == "auto":
        return available_cpus()
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 1024:
        raise ConfigError(
            f"{s.path('workers')}: expected an integer in [1, 1024] or 'auto', got {raw!r}"
        )
    return raw


def available_cpus() -> int:
    """CPUs this process may run on, capped by a cgroup v2 CPU quota (a container's limit)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, count or 1)


def _tls(raw: Any, base: Path) -> TlsSpec:
    if raw is None:
        return TlsSpec()
    s = Section(raw, "server.tls")
    ca = s.opt_str("client_ca_file")
    spec = TlsSpec(
        cert_file=resolve(s.str("cert_file"), base),
        key_file=resolve(s.str("key_file"), base),
        client_ca_file=resolve(ca, base) if ca else "",
    )
    s.done()
    return spec


def _limits(raw: Any) -> LimitsSpec:
    s, d = Section(raw if raw is not None else {}, "server.limits"), LimitsSpec
    spec = LimitsSpec(
        max_request_bytes=parse_size(
            s.get("max_request_bytes", d.max_request_bytes), s.path("max_request_bytes")
        ),
        max_concurrent_rpcs=s.int("max_concurrent_rpcs", d.max_concurrent_rpcs, minimum=1),
        max_streams_per_connection=s.int(
            "max_streams_per_connection", d.max_streams_per_connection, minimum=1
        ),
        keepalive_seconds=s.number("keepalive_seconds", d.keepalive_seconds, minimum=1.0),
        keepalive_timeout_seconds=s.number(
            "keepalive_timeout_seconds", d.keepalive_timeout_seconds, minimum=1.0
        ),
        min_ping_seconds=s.number("min_ping_seconds", d.min_ping_seconds, minimum=0.0),
        idle_seconds=s.number("idle_seconds", d.idle_seconds, minimum=1.0),
    )
    s.done()
    if spec.max_request_bytes < 1024:
        raise ConfigError(
            f"{s.path('max_request_bytes')}: {spec.max_request_bytes} bytes cannot "
            "hold a request; expected at least 1KiB"
        )
    return spec


def _auth(raw: Any, base: Path) -> AuthSpec:
    if raw is None:
        return AuthSpec()
    s = Section(raw, "server.auth")
    path, env = s.opt_str("tokens_file"), s.opt_str("tokens_env")
    s.done()
    if not (path or env):
        raise ConfigError(f"server.auth: expected tokens_file, tokens_env or both, got {raw!r}")
    if env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env):
        raise ConfigError(
            f"server.auth.tokens_env: expected the name of an environment variable, got {env!r}"
        )
    return AuthSpec(tokens_file=resolve(path, base) if path else "", tokens_env=env or "")


def _object_store(raw: Any) -> ObjectStoreSpec:
    s = Section(raw if raw is not None else {}, "object_store")
    d = ObjectStoreSpec
    spec = ObjectStoreSpec(
        endpoint_url=s.opt_str("endpoint_url"),
        region=s.opt_str("region"),
        addressing_style=s.str("addressing_style", d.addressing_style, ADDRESSING_STYLES),
        profile=s.opt_str("profile"),
        block_bytes=parse_size(s.get("block_bytes", d.block_bytes), s.path("block_bytes")),
        max_concurrency=s.int("max_concurrency", d.max_concurrency, minimum=1),
        max_attempts=s.int("max_attempts", d.max_attempts, minimum=1),
        backoff_base_seconds=s.number("backoff_base_seconds", d.backoff_base_seconds),
        backoff_max_seconds=s.number("backoff_max_seconds", d.backoff_max_seconds),
        connect_timeout_seconds=s.number("connect_timeout_seconds", d.connect_timeout_seconds),
        read_timeout_seconds=s.number("read_timeout_seconds", d.read_timeout_seconds),
    )
    s.done()
    if spec.endpoint_url is not None and not re.match(r"https?://", spec.endpoint_url):
        raise ConfigError(
            f"object_store.endpoint_url: expected http:// or https://, got {spec.endpoint_url!r}"
        )
    return spec


def _store(raw: Any, base: Path, server: ServerSpec) -> StoreSpec:
    if isinstance(raw, str):
        raw = {"uri": raw}
    s = Section(raw if raw is not None else {}, "store")
    d = StoreSpec
    uri = s.opt_str("uri") or ""
    if uri and not uri.startswith("s3://"):
        uri = resolve(uri.removeprefix("file://"), base)
    node = s.opt_str("node") or (f"{socket.gethostname()}:{server.cache_dir}" if uri else "")
    spec = StoreSpec(
        uri=uri,
        node=node,
        min_nodes=s.int("min_nodes", d.min_nodes, minimum=1),
        join_seconds=s.number("join_seconds", d.join_seconds),
        node_ttl_seconds=s.number("node_ttl_seconds", d.node_ttl_seconds),
        takeover_seconds=s.number("takeover_seconds", d.takeover_seconds),
    )
    s.done()
    if raw is not None and not uri:
        raise ConfigError("store.uri: expected s3://bucket/prefix/ or a directory")
    if spec.node_ttl_seconds <= 0:
        raise ConfigError("store.node_ttl_seconds: expected a positive number of seconds")
    return spec


def from_dict(raw: Any, *, base: Path | str = ".", origin: str = "<memory>") -> Config:
    base = Path(base)
    try:
        top = Section(raw, "")
        server = _server(top.get("server"), base)
        object_store = _object_store(top.get("object_store"))
        store = _store(top.get("store"), base, server)
        raw_jobs = top.require("jobs")
        if not isinstance(raw_jobs, dict) or not raw_jobs:
            raise ConfigError(f"jobs: expected a mapping of job name to job, got {raw_jobs!r}")
        jobs = []
        for name, job in raw_jobs.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
                raise ConfigError(f"jobs.{name}: job names are letters, digits, '.', '_', '-'")
            jobs.append(_job(name, job, f"jobs.{name}", base))
        top.done()
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from None
    return Config(
        server=server, jobs=tuple(jobs), object_store=object_store, store=store, origin=origin
    )


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        kind = "TOML" if path.suffix == ".toml" else "YAML"
        raise ConfigError(f"{path}: not valid {kind}: {e}") from e
    return from_dict(raw, base=path.resolve().parent, origin=str(path))
