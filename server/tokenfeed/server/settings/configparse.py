"""A config file into specs: YAML or TOML read, every level's keys checked first, values
converted (sizes, weights, paths, shorthands) and handed to the specs, whose own checks are
reported with the file and the key path of the value:
`tf.yaml: jobs.demo.seq_len: expected an integer >= 1, got -3`.

Relative paths are resolved against the directory of the config file.
"""

from __future__ import annotations

import os
import socket
import tomllib
from pathlib import Path

import yaml
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configread import Section, build, check_keys, keys, resolve
from tokenfeed.server.settings.jobparse import JOBS, jobs
from tokenfeed.server.settings.portspec import AuthSpec, LimitsSpec, TlsSpec
from tokenfeed.server.settings.serverspec import (
    MAX_WORKERS,
    Config,
    ObjectStoreSpec,
    ServerSpec,
    StoreSpec,
)

# The keys of the file and of the server's levels (configread.check_keys walks them first).
SERVER = keys(
    *("listen", "metrics_listen", "health_listen", "cache_dir", "cache_bytes", "log_format"),
    *("prefetch_steps", "tokenize_threads", "max_wait_seconds", "grace_seconds", "workers"),
    *("stream_ahead", "stream_cache_bytes"),
    tls=keys("cert_file", "key_file", "client_ca_file"),
    auth=keys("tokens_file", "tokens_env"),
    limits=keys(
        *("max_request_bytes", "max_concurrent_rpcs", "max_streams_per_connection"),
        *("keepalive_seconds", "keepalive_timeout_seconds", "min_ping_seconds", "idle_seconds"),
    ),
)
OBJECT_STORE = keys(
    *("endpoint_url", "region", "addressing_style", "profile", "block_bytes"),
    *("max_concurrency", "max_attempts", "backoff_base_seconds", "backoff_max_seconds"),
    *("connect_timeout_seconds", "read_timeout_seconds"),
)
STORE = keys("uri", "node", "min_nodes", "join_seconds", "node_ttl_seconds", "takeover_seconds")
FILE = keys(server=SERVER, jobs=JOBS, object_store=OBJECT_STORE, store=STORE)


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


def from_dict(raw: object, *, base: Path | str = ".", origin: str = "<memory>") -> Config:
    """The specs of a parsed file; every error starts with `origin` and the key path."""
    base = Path(base)
    try:
        check_keys(raw, FILE)
        top = Section(raw, "")
        server = _server(top.get("server"), base)
        object_store = _object_store(top.get("object_store"))
        store = _store(top.get("store"), base, server)
        specs = jobs(top.require("jobs"), base)
        top.done()
        return build("", lambda: Config(server, specs, object_store, store, origin))
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from None


# ---------------------------------------------------------------- the server


def _server(raw: object, base: Path) -> ServerSpec:
    s, d = Section(raw if raw is not None else {}, "server"), ServerSpec
    listen = s.text("listen", d.listen)
    metrics_listen = s.optional_text("metrics_listen") or ""
    cache_dir = resolve(s.text("cache_dir", d.cache_dir), base)
    cache_bytes = s.size("cache_bytes", d.cache_bytes)
    prefetch_steps = s.integer("prefetch_steps", d.prefetch_steps)
    tokenize_threads = s.integer("tokenize_threads", d.tokenize_threads)
    log_format = s.text("log_format", d.log_format)
    max_wait_seconds = s.number("max_wait_seconds", d.max_wait_seconds)
    grace_seconds = s.number("grace_seconds", d.grace_seconds)
    health_listen = s.optional_text("health_listen") or ""
    tls = _tls(s.get("tls"), base)
    auth = _auth(s.get("auth"), base)
    limits = _limits(s.get("limits"))
    workers = _workers(s)
    stream_ahead = s.integer("stream_ahead", d.stream_ahead)
    stream_cache_bytes = s.size("stream_cache_bytes", d.stream_cache_bytes)
    s.done()
    return build(
        "server",
        lambda: ServerSpec(
            listen=listen,
            metrics_listen=metrics_listen,
            cache_dir=cache_dir,
            cache_bytes=cache_bytes,
            prefetch_steps=prefetch_steps,
            tokenize_threads=tokenize_threads,
            log_format=log_format,
            max_wait_seconds=max_wait_seconds,
            grace_seconds=grace_seconds,
            health_listen=health_listen,
            tls=tls,
            auth=auth,
            limits=limits,
            workers=workers,
            stream_ahead=stream_ahead,
            stream_cache_bytes=stream_cache_bytes,
        ),
    )


def _workers(s: Section) -> int:
    raw = s.get("workers", ServerSpec.workers)
    if raw == "auto":
        return min(available_cpus(), MAX_WORKERS)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(
            f"{s.path('workers')}: expected an integer in [1, {MAX_WORKERS}] or 'auto', got {raw!r}"
        )
    return raw


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


def _tls(raw: object, base: Path) -> TlsSpec:
    if raw is None:
        return TlsSpec()
    s = Section(raw, "server.tls")
    cert_file = resolve(s.text("cert_file"), base)
    key_file = resolve(s.text("key_file"), base)
    ca = s.optional_text("client_ca_file")
    client_ca_file = resolve(ca, base) if ca else ""
    s.done()
    return build(s.where, lambda: TlsSpec(cert_file, key_file, client_ca_file))


def _auth(raw: object, base: Path) -> AuthSpec:
    if raw is None:
        return AuthSpec()
    s = Section(raw, "server.auth")
    path, env = s.optional_text("tokens_file"), s.optional_text("tokens_env")
    s.done()
    if not (path or env):
        raise ConfigError(f"server.auth: expected tokens_file, tokens_env or both, got {raw!r}")
    tokens_file = resolve(path, base) if path else ""
    return build(s.where, lambda: AuthSpec(tokens_file, env or ""))


def _limits(raw: object) -> LimitsSpec:
    s, d = Section(raw if raw is not None else {}, "server.limits"), LimitsSpec
    max_request_bytes = s.size("max_request_bytes", d.max_request_bytes)
    max_concurrent_rpcs = s.integer("max_concurrent_rpcs", d.max_concurrent_rpcs)
    max_streams = s.integer("max_streams_per_connection", d.max_streams_per_connection)
    keepalive = s.number("keepalive_seconds", d.keepalive_seconds)
    keepalive_timeout = s.number("keepalive_timeout_seconds", d.keepalive_timeout_seconds)
    min_ping = s.number("min_ping_seconds", d.min_ping_seconds)
    idle = s.number("idle_seconds", d.idle_seconds)
    s.done()
    return build(
        s.where,
        lambda: LimitsSpec(
            max_request_bytes=max_request_bytes,
            max_concurrent_rpcs=max_concurrent_rpcs,
            max_streams_per_connection=max_streams,
            keepalive_seconds=keepalive,
            keepalive_timeout_seconds=keepalive_timeout,
            min_ping_seconds=min_ping,
            idle_seconds=idle,
        ),
    )


# ---------------------------------------------------------------- storage


def _object_store(raw: object) -> ObjectStoreSpec:
    s, d = Section(raw if raw is not None else {}, "object_store"), ObjectStoreSpec
    endpoint_url, region = s.optional_text("endpoint_url"), s.optional_text("region")
    addressing_style = s.text("addressing_style", d.addressing_style)
    profile = s.optional_text("profile")
    block_bytes = s.size("block_bytes", d.block_bytes)
    max_concurrency = s.integer("max_concurrency", d.max_concurrency)
    max_attempts = s.integer("max_attempts", d.max_attempts)
    backoff_base = s.number("backoff_base_seconds", d.backoff_base_seconds)
    backoff_max = s.number("backoff_max_seconds", d.backoff_max_seconds)
    connect_timeout = s.number("connect_timeout_seconds", d.connect_timeout_seconds)
    read_timeout = s.number("read_timeout_seconds", d.read_timeout_seconds)
    s.done()
    return build(
        s.where,
        lambda: ObjectStoreSpec(
            endpoint_url=endpoint_url,
            region=region,
            addressing_style=addressing_style,
            profile=profile,
            block_bytes=block_bytes,
            max_concurrency=max_concurrency,
            max_attempts=max_attempts,
            backoff_base_seconds=backoff_base,
            backoff_max_seconds=backoff_max,
            connect_timeout_seconds=connect_timeout,
            read_timeout_seconds=read_timeout,
        ),
    )


def _store(raw: object, base: Path, server: ServerSpec) -> StoreSpec:
    """`store:` as a mapping or its uri alone; a directory's path is resolved like others."""
    given = {"uri": raw} if isinstance(raw, str) else raw
    s, d = Section(given if given is not None else {}, "store"), StoreSpec
    uri = s.optional_text("uri") or ""
    if uri and not uri.startswith("s3://"):
        uri = resolve(uri.removeprefix("file://"), base)
    node = s.optional_text("node") or (f"{socket.gethostname()}:{server.cache_dir}" if uri else "")
    min_nodes = s.integer("min_nodes", d.min_nodes)
    join_seconds = s.number("join_seconds", d.join_seconds)
    node_ttl_seconds = s.number("node_ttl_seconds", d.node_ttl_seconds)
    takeover_seconds = s.number("takeover_seconds", d.takeover_seconds)
    s.done()
    if raw is not None and not uri:
        raise ConfigError(f"store.uri: required (s3://bucket/prefix/ or a directory), got {raw!r}")
    return build(
        s.where,
        lambda: StoreSpec(uri, node, min_nodes, join_seconds, node_ttl_seconds, takeover_seconds),
    )
