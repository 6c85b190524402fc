"""Configuration: frozen dataclasses validated on construction, parsed once in `main`.

A config file is YAML (`.yaml`/`.yml`) or TOML (`.toml`). Every error names the key path and the
bad value, and the file it came from, e.g. `jobs.demo.seq_len: expected an integer >= 1, got -3`.
Relative paths are resolved against the directory of the config file.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tokenfeed.server.errors import ConfigError

PACKINGS = ("concat",)
BAD_RECORD_POLICIES = ("skip", "strict")
FORMATS = ("auto", "jsonl", "parquet")

_SIZE_RE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_SIZE_UNITS = {
    None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}  # fmt: skip


@dataclass(frozen=True)
class SourceSpec:
    """One glob (or path) of source objects and how to read them."""

    pattern: str
    format: str = "auto"
    text_field: str = "text"


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


@dataclass(frozen=True)
class JobSpec:
    name: str
    sources: tuple[SourceSpec, ...]
    tokenizer: TokenizerSpec
    seq_len: int
    global_batch_size: int
    seed: int = 0
    packing: str = "concat"
    # Name under which the sample order is keyed: renaming a job keeps its batches.
    dataset: str = "main"
    window_chunks: int = 8
    chunk_bytes: int = 64 * 2**20
    bad_records: str = "skip"


@dataclass(frozen=True)
class ServerSpec:
    listen: str = "127.0.0.1:50051"
    cache_dir: str = ".tokenfeed-cache"
    tokenize_threads: int = 2
    log_format: str = "text"
    # How long a request waits for a job that is still indexing before UNAVAILABLE.
    max_wait_seconds: float = 30.0
    grace_seconds: float = 10.0


@dataclass(frozen=True)
class Config:
    server: ServerSpec
    jobs: tuple[JobSpec, ...] = field(default_factory=tuple)
    origin: str = "<memory>"

    def job(self, name: str) -> JobSpec:
        for job in self.jobs:
            if job.name == name:
                return job
        raise ConfigError(f"no job named {name!r} in {self.origin}; jobs: {self.job_names()}")

    def job_names(self) -> list[str]:
        return [j.name for j in self.jobs]


def parse_size(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size such as 64MiB, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        size = int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    else:
        raise ConfigError(f"{where}: expected a size such as 64MiB, got {value!r}")
    if size < 1:
        raise ConfigError(f"{where}: expected a size >= 1 byte, got {value!r}")
    return size


class _Section:
    """Reads one mapping of the raw config, tracking the key path for error messages."""

    def __init__(self, raw: Any, where: str):
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
        self.raw = raw
        self.where = where
        self.used: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.raw.get(key, default)

    def require(self, key: str) -> Any:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(f"{self.path(key)}: required")
        return self.raw[key]

    def int(self, key: str, default: int | None = None, minimum: int | None = None) -> int:
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.path(key)}: expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self.path(key)}: expected an integer >= {minimum}, got {value!r}")
        return value

    def str(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        value = self.require(key) if default is None else self.get(key, default)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.path(key)}: expected a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise ConfigError(f"{self.path(key)}: expected one of {list(choices)}, got {value!r}")
        return value

    def opt_int(self, key: str) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{self.path(key)}: expected a token id >= 0, got {value!r}")
        return value

    def opt_str(self, key: str) -> str | None:
        value = self.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{self.path(key)}: expected a non-empty string, got {value!r}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.path(key)}: expected true or false, got {value!r}")
        return value

    def number(self, key: str, default: float, minimum: float = 0.0) -> float:
        value = self.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (minimum <= value < math.inf)
        ):
            raise ConfigError(f"{self.path(key)}: expected a number >= {minimum}, got {value!r}")
        return float(value)

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise ConfigError(f"{self.path(unknown[0])}: unknown key (known keys: {known})")


def _resolve(path: str, base: Path) -> str:
    if "://" in path:
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p))


def _source(raw: Any, where: str, base: Path, default_field: str) -> SourceSpec:
    if isinstance(raw, str):
        raw = {"path": raw}
    s = _Section(raw, where)
    spec = SourceSpec(
        pattern=_resolve(s.str("path"), base),
        format=s.str("format", "auto", FORMATS),
        text_field=s.str("text_field", default_field),
    )
    s.done()
    return spec


def _tokenizer(raw: Any, where: str, base: Path) -> TokenizerSpec:
    if isinstance(raw, str):
        raw = {"path": raw}
    s = _Section(raw, where)
    spec = TokenizerSpec(
        path=_resolve(s.str("path"), base),
        eos_id=s.opt_int("eos_id"),
        eos_token=s.opt_str("eos_token"),
        bos_id=s.opt_int("bos_id"),
        bos_token=s.opt_str("bos_token"),
        add_bos=s.bool("add_bos", False),
    )
    s.done()
    return spec


def _job(name: str, raw: Any, where: str, base: Path) -> JobSpec:
    s = _Section(raw, where)
    text_field = s.str("text_field", "text")
    raw_sources = s.require("sources")
    if isinstance(raw_sources, (str, dict)):
        raw_sources = [raw_sources]
    if not isinstance(raw_sources, list) or not raw_sources:
        raise ConfigError(f"{s.path('sources')}: expected a non-empty list, got {raw_sources!r}")
    sources = tuple(
        _source(r, f"{s.path('sources')}[{i}]", base, text_field) for i, r in enumerate(raw_sources)
    )
    spec = JobSpec(
        name=name,
        sources=sources,
        tokenizer=_tokenizer(s.require("tokenizer"), s.path("tokenizer"), base),
        seq_len=s.int("seq_len", minimum=1),
        global_batch_size=s.int("global_batch_size", minimum=1),
        seed=s.int("seed", 0, minimum=0),
        packing=s.str("packing", "concat", PACKINGS),
        dataset=s.str("dataset", "main"),
        window_chunks=s.int("window_chunks", 8, minimum=1),
        chunk_bytes=parse_size(s.get("chunk_bytes", 64 * 2**20), s.path("chunk_bytes")),
        bad_records=s.str("bad_records", "skip", BAD_RECORD_POLICIES),
    )
    if spec.seed >= 2**64:
        raise ConfigError(f"{s.path('seed')}: expected an integer < 2**64, got {spec.seed}")
    s.done()
    return spec


def _server(raw: Any, base: Path) -> ServerSpec:
    s = _Section(raw if raw is not None else {}, "server")
    spec = ServerSpec(
        listen=s.str("listen", ServerSpec.listen),
        cache_dir=_resolve(s.str("cache_dir", ServerSpec.cache_dir), base),
        tokenize_threads=s.int("tokenize_threads", ServerSpec.tokenize_threads, minimum=1),
        log_format=s.str("log_format", "text", ("text", "json")),
        max_wait_seconds=s.number("max_wait_seconds", ServerSpec.max_wait_seconds),
        grace_seconds=s.number("grace_seconds", ServerSpec.grace_seconds),
    )
    s.done()
    return spec


def from_dict(raw: Any, *, base: Path | str = ".", origin: str = "<memory>") -> Config:
    base = Path(base)
    try:
        top = _Section(raw, "")
        server = _server(top.get("server"), base)
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
    return Config(server=server, jobs=tuple(jobs), origin=origin)


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
