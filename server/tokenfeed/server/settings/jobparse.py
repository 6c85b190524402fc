"""A job's keys in a config file into its JobSpec: the single-dataset and mixture forms, the
source and tokenizer shorthands, weights by dataset name and the schedule's phases. Errors of
the specs' own checks are named by the key path of the value (configread.build).
"""

from __future__ import annotations

import logging
import re
from difflib import get_close_matches
from fractions import Fraction
from functools import partial
from pathlib import Path

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configread import (
    Items,
    Named,
    Section,
    build,
    join,
    keys,
    resolve,
    to_fraction,
)
from tokenfeed.server.settings.jobspec import (
    MEMBER_FORMATS,
    SPLIT_FORMATS,
    DatasetSpec,
    JobSpec,
    PhaseSpec,
    SourceSpec,
    TokenizerSpec,
    check_job_name,
)

log = logging.getLogger(__name__)

# Under this, per-chunk costs outweigh the bytes read (bench/smallobjects.py, bench/store.py).
SMALL_CHUNK_BYTES = 2**20

# The keys of a job and of each level inside it (configread.check_keys walks them first).
SOURCE = keys("path", "format", "text_field", "token_field", "member", "split", "config")
TOKENIZER = keys("path", "eos_id", "eos_token", "bos_id", "bos_token", "add_bos", "backend")
DATASET = keys("text_field", "chunk_bytes", "weight", sources=Items(SOURCE))
PHASE = keys("start_step", "global_batch_size", "weights")
JOB = keys(
    *("text_field", "chunk_bytes", "dataset", "weights", "batch_multiple_of"),
    *("global_batch_size", "seq_len", "seed", "packing", "window_chunks", "bad_records"),
    sources=Items(SOURCE),
    datasets=Named(DATASET),
    tokenizer=TOKENIZER,
    schedule=Items(PHASE),
)
# The names a file gives its jobs, each holding a job's keys.
JOBS = Named(JOB)


def jobs(raw: object, base: Path) -> tuple[JobSpec, ...]:
    """The `jobs:` mapping of job name to job."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"jobs: expected a mapping of job name to job, got {raw!r}")
    specs = []
    for name, body in raw.items():
        where = f"jobs.{name}"
        # The name first: it is in every later message about this job.
        specs.append(_job(check_job_name(where, name), body, where, base))
    return tuple(specs)


def _job(name: str, raw: object, where: str, base: Path) -> JobSpec:
    s = Section(raw, where)
    text_field = s.text("text_field", SourceSpec.text_field)
    chunk_bytes = _chunk_bytes(s, DatasetSpec.chunk_bytes)
    datasets, weights = _datasets(s, base, text_field, chunk_bytes)
    names = [d.name for d in datasets]
    if s.has("weights"):
        weights = _weights(s.get("weights"), s.path("weights"), names, weights)
    # Without job-level weights, the datasets' own `weight` keys gave them.
    weights_key = "weights" if s.has("weights") else "datasets"
    multiple = s.integer("batch_multiple_of", JobSpec.batch_multiple_of)
    batch = s.integer("global_batch_size")
    first = build(
        where, partial(PhaseSpec, 0, batch, weights), lambda f: weights_key if f == "weights" else f
    )
    tokenizer = _tokenizer(s.require("tokenizer"), s.path("tokenizer"), base)
    seq_len = s.integer("seq_len")
    phases = _phases(s, first, names)
    seed = s.integer("seed", JobSpec.seed)
    packing = s.text("packing", JobSpec.packing)
    window_chunks = s.integer("window_chunks", JobSpec.window_chunks)
    bad_records = s.text("bad_records", JobSpec.bad_records)
    s.get("dataset")  # read by _datasets for the single-dataset form
    s.done()
    return build(
        where,
        lambda: JobSpec(
            name=name,
            datasets=datasets,
            tokenizer=tokenizer,
            seq_len=seq_len,
            phases=phases,
            seed=seed,
            packing=packing,
            window_chunks=window_chunks,
            bad_records=bad_records,
            batch_multiple_of=multiple,
        ),
        _job_key,
    )


def _job_key(field: str) -> str:
    """Where a JobSpec field is in the file: phase 0 is the job's own keys, phase i the
    schedule's entry i - 1; the name is the job's key itself."""
    if field == "name":
        return ""
    m = re.fullmatch(r"phases\[(\d+)\]\.?(.*)", field)
    if m is None:
        return field
    i, rest = int(m.group(1)), m.group(2)
    return rest if i == 0 else join(f"schedule[{i - 1}]", rest)


def _chunk_bytes(s: Section, default: int) -> int:
    """`chunk_bytes` of a job or dataset; a small one is allowed (tests use it) but said to
    cost what it does, once, where it is given."""
    size = s.size("chunk_bytes", default)
    if s.has("chunk_bytes") and size < SMALL_CHUNK_BYTES:
        log.warning(
            "%s: chunk_bytes %d is under 1 MiB: each chunk costs 4 store files, a manifest and "
            "at least one GET; expect slow builds and a large store",
            s.path("chunk_bytes"),
            size,
        )
    return size


def _datasets(
    s: Section, base: Path, text_field: str, chunk_bytes: int
) -> tuple[tuple[DatasetSpec, ...], tuple[Fraction, ...]]:
    """(datasets, their weights): a `datasets:` mapping, or the job's own `sources:`."""
    if not s.has("datasets"):
        name = s.text("dataset", "main")
        sources = _sources(s, base, text_field)
        one = build(
            s.where,
            partial(DatasetSpec, name, sources, chunk_bytes),
            lambda f: "dataset" if f == "name" else f,
        )
        return (one,), (Fraction(1),)
    raw = s.require("datasets")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"{s.path('datasets')}: expected a mapping of name to dataset, got {raw!r}"
        )
    if s.has("sources"):
        raise ConfigError(
            f"{s.path('sources')}: give sources inside each dataset of "
            f"{s.path('datasets')}, not beside them; got {s.get('sources')!r}"
        )
    datasets, weights = [], []
    for name, body in raw.items():
        d = Section(body, join(s.path("datasets"), str(name)))
        field = d.text("text_field", text_field)
        size = _chunk_bytes(d, chunk_bytes)
        sources = _sources(d, base, field)
        weights.append(d.fraction("weight", Fraction(1)))
        d.done()
        make = partial(DatasetSpec, str(name), sources, size)
        datasets.append(build(d.where, make, lambda f: "" if f == "name" else f))
    return tuple(datasets), tuple(weights)


def _sources(s: Section, base: Path, text_field: str) -> tuple[SourceSpec, ...]:
    raw = s.require("sources")
    if isinstance(raw, str | dict):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{s.path('sources')}: expected a non-empty list, got {raw!r}")
    where = s.path("sources")
    return tuple(_source(r, f"{where}[{i}]", base, text_field) for i, r in enumerate(raw))


def _source(raw: object, where: str, base: Path, default_field: str) -> SourceSpec:
    s = Section({"path": raw} if isinstance(raw, str) else raw, where)
    pattern = resolve(s.text("path"), base)
    fmt = s.text("format", SourceSpec.format)
    text_field = s.text("text_field", default_field)
    token_field = s.optional_text("token_field")
    member = s.text("member", SourceSpec.member)
    split, config = s.text("split", SourceSpec.split), s.optional_text("config")
    s.done()
    spec = build(
        where,
        lambda: SourceSpec(pattern, fmt, text_field, token_field, member, split, config),
        lambda f: "path" if f == "pattern" else f,
    )
    _layout_keys(s, spec)
    # What the source's own keys say together (a job's text_field is only a default).
    if token_field is not None and s.has("text_field"):
        raise ConfigError(
            f"{s.path('token_field')}: a source reads either a text column or a "
            f"token column, got text_field {text_field!r} and token_field {token_field!r}"
        )
    if spec.megatron and s.has("text_field"):
        raise ConfigError(
            f"{s.path('text_field')}: a Megatron source has no text field, got "
            f"{text_field!r} for {spec.pattern!r}"
        )
    return spec


def _layout_keys(s: Section, spec: SourceSpec) -> None:
    """The layouts' own keys (member, split, config) only where a layout reads them."""
    fmt = spec.format
    wrong = [
        (key, formats)
        for key, formats in (
            ("member", MEMBER_FORMATS),
            ("split", SPLIT_FORMATS),
            ("config", ("auto", "hf")),
        )
        if s.has(key) and (fmt not in formats or (fmt == "auto" and (spec.jsonl or spec.megatron)))
    ]
    if wrong:
        key, formats = wrong[0]
        named = [f for f in formats if f != "auto"]
        raise ConfigError(
            f"{s.path(key)}: applies to format {' or '.join(named)} sources only, got "
            f"{s.get(key)!r} for {spec.pattern!r} (format {fmt})"
        )


def _tokenizer(raw: object, where: str, base: Path) -> TokenizerSpec:
    s = Section({"path": raw} if isinstance(raw, str) else raw, where)
    path = resolve(s.text("path"), base)
    eos_id, eos_token = s.token_id("eos_id"), s.optional_text("eos_token")
    bos_id, bos_token = s.token_id("bos_id"), s.optional_text("bos_token")
    add_bos = s.flag("add_bos", TokenizerSpec.add_bos)
    backend = s.text("backend", TokenizerSpec.backend)
    s.done()
    return build(
        where, lambda: TokenizerSpec(path, eos_id, eos_token, bos_id, bos_token, add_bos, backend)
    )


def _weights(
    raw: object, where: str, names: list[str], previous: tuple[Fraction, ...]
) -> tuple[Fraction, ...]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of dataset name to weight, got {raw!r}")
    unknown = sorted(set(map(str, raw)) - set(names))
    if unknown:
        close = get_close_matches(unknown[0], names, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"{where}.{unknown[0]}: unknown dataset{hint} (datasets: {names})")
    given = {str(k): to_fraction(v, f"{where}.{k}") for k, v in raw.items()}
    return tuple(given.get(n, previous[i]) for i, n in enumerate(names))


def _phases(s: Section, first: PhaseSpec, names: list[str]) -> tuple[PhaseSpec, ...]:
    """Phase 0 from the job's keys, then one per `schedule` entry; what an entry leaves out
    carries over from the phase before it."""
    phases = [first]
    raw = s.get("schedule", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{s.path('schedule')}: expected a list of phases, got {raw!r}")
    for i, body in enumerate(raw):
        p = Section(body, f"{s.path('schedule')}[{i}]")
        prev = phases[-1]
        start = p.integer("start_step")
        batch = p.integer("global_batch_size", prev.global_batch_size)
        weights = prev.weights
        if p.has("weights"):
            weights = _weights(p.get("weights"), p.path("weights"), names, prev.weights)
        p.done()
        phases.append(build(p.where, partial(PhaseSpec, start, batch, weights)))
    return tuple(phases)
