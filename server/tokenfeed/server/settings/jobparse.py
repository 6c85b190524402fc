"""A job's keys in a config file into its JobSpec: the single-dataset and mixture forms, the
source and tokenizer shorthands, weights by dataset name and the schedule's phases.

The keys of each level and how each value is read follow from the specs' declarations
(options.py); this module gives the shapes: the job's own keys are also its first phase's and,
without `datasets:`, its one dataset's; `text_field` and `chunk_bytes` given on a job are the
defaults of its datasets and sources. Errors of the specs' own checks are named by the key
path of the value (configread.build).
"""

from __future__ import annotations

import re
from difflib import get_close_matches
from fractions import Fraction
from pathlib import Path

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configread import (
    FRACTION,
    Items,
    Keys,
    Named,
    Section,
    join,
    to_fraction,
)
from tokenfeed.server.settings.jobspec import JobSpec, PhaseSpec, check_job_name
from tokenfeed.server.settings.options import file_only, option_of, options_of
from tokenfeed.server.settings.sourcespec import (
    CONFIG_FORMATS,
    MEMBER_FORMATS,
    SPLIT_FORMATS,
    DatasetSpec,
    SourceSpec,
)
from tokenfeed.server.settings.specread import (
    SpecReader,
    defaults_for,
    file_key,
    keys_of,
    read_option,
)

# A dataset's weight in the first phase (job-level or phase `weights` name it instead).
WEIGHT = file_only(
    "weight",
    FRACTION,
    Fraction(1),
    "the dataset's weight in the job's first phase (the job's `weights` may give it instead)",
)

# The keys of a job and of each level inside it (configread.check_keys walks them first).
SOURCE = keys_of(SourceSpec).showing("its dataset's or job's `text_field`", "text_field")
TEXT_FIELD = defaults_for(SourceSpec, "text_field", "the sources")
DATASET = (
    keys_of(DatasetSpec, exclude=("dataset",), sources=Items(SOURCE))
    | TEXT_FIELD
    | Keys({"weight": None}, {"weight": WEIGHT})
).showing("the job's", "chunk_bytes", "text_field")
_CARRIED = [o.key for o in options_of(PhaseSpec) if o.key and o.name != "start_step"]
PHASE = keys_of(PhaseSpec).showing("the phase before's", *_CARRIED)
JOB = (
    keys_of(JobSpec, datasets=Named(DATASET, "<dataset>"), schedule=Items(PHASE))
    | keys_of(PhaseSpec, exclude=("start_step", "seq_len", "packing"))
    | keys_of(DatasetSpec, sources=Items(SOURCE)).showing("required without `datasets`", "sources")
    | TEXT_FIELD
)
# The names a file gives its jobs, each holding a job's keys.
JOBS = Named(JOB, "<job>")


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
    text_field = read_option(TEXT_FIELD.declared["text_field"], s, base)
    chunk_bytes = read_option(option_of(DatasetSpec, "chunk_bytes"), s, base)
    datasets, weights = _datasets(s, base, text_field, chunk_bytes)
    names = [d.name for d in datasets]
    if s.has("weights"):
        weights = _weights(s.get("weights"), s.path("weights"), names, weights)
    # Without job-level weights, the datasets' own `weight` keys gave them.
    weights_key = "weights" if s.has("weights") else "datasets"
    job = SpecReader(JobSpec, s, base)
    job.read("batch_multiple_of")
    phase_key = file_key(PhaseSpec)
    first = SpecReader(PhaseSpec, s, base).build(
        lambda f: weights_key if f == "weights" else phase_key(f),
        done=False,
        start_step=0,
        weights=weights,
        seq_len=None,  # the first phase's is the job's own `seq_len`
        packing=None,  # and `packing`
    )
    job.read("tokenizer")
    job.read("seq_len")
    phases = _phases(s, first, names, base)
    s.get("dataset")  # read by _datasets for the single-dataset form
    return job.build(_job_key, name=name, datasets=datasets, phases=phases)


def _job_key(field: str) -> str:
    """Where a JobSpec field is in the file: phase 0 is the job's own keys, phase i the
    schedule's entry i - 1; the name is the job's key itself."""
    m = re.fullmatch(r"phases\[(\d+)\]\.?(.*)", field)
    if m is None:
        return file_key(JobSpec)(field)
    i, rest = int(m.group(1)), m.group(2)
    return rest if i == 0 else join(f"schedule[{i - 1}]", rest)


def _datasets(
    s: Section, base: Path, text_field: str, chunk_bytes: int
) -> tuple[tuple[DatasetSpec, ...], tuple[Fraction, ...]]:
    """(datasets, their weights): a `datasets:` mapping, or the job's own `sources:`."""
    if not s.has("datasets"):
        one = SpecReader(DatasetSpec, s, base)
        one.read("name")
        sources = _sources(s, base, text_field)
        return (one.build(done=False, sources=sources, chunk_bytes=chunk_bytes),), (Fraction(1),)
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
    dataset_key = file_key(DatasetSpec)
    for name, body in raw.items():
        d = Section(body, join(s.path("datasets"), str(name)))
        r = SpecReader(DatasetSpec, d, base)
        field = read_option(TEXT_FIELD.declared["text_field"], d, base, text_field)
        r.read("chunk_bytes", chunk_bytes)
        sources = _sources(d, base, field)
        weights.append(read_option(WEIGHT, d, base))
        key = lambda f: "" if f == "name" else dataset_key(f)  # noqa: E731 - the mapping's key
        datasets.append(r.build(key, name=str(name), sources=sources))
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
    spec = SpecReader(SourceSpec, s, base).build(defaults={"text_field": default_field})
    # What the source's own keys say together (a job's text_field is only a default).
    if spec.token_field is not None and s.has("text_field"):
        raise ConfigError(
            f"{s.path('token_field')}: a source reads either a text column or a "
            f"token column, got text_field {spec.text_field!r} and token_field "
            f"{spec.token_field!r}"
        )
    if spec.megatron and s.has("text_field"):
        raise ConfigError(
            f"{s.path('text_field')}: a Megatron source has no text field, got "
            f"{spec.text_field!r} for {spec.pattern!r}"
        )
    _layout_keys(s, spec)
    return spec


def _layout_keys(s: Section, spec: SourceSpec) -> None:
    """The layouts' own keys (member, split, config) only where a layout reads them."""
    fmt = spec.format
    for key, formats in (
        ("member", MEMBER_FORMATS),
        ("split", SPLIT_FORMATS),
        ("config", CONFIG_FORMATS),
    ):
        if s.has(key) and (fmt not in formats or (fmt == "auto" and (spec.jsonl or spec.megatron))):
            named = [f for f in formats if f != "auto"]
            raise ConfigError(
                f"{s.path(key)}: applies to format {' or '.join(named)} sources only, got "
                f"{s.get(key)!r} for {spec.pattern!r} (format {fmt})"
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


def _phases(s: Section, first: PhaseSpec, names: list[str], base: Path) -> tuple[PhaseSpec, ...]:
    """Phase 0 from the job's keys, then one per `schedule` entry; what an entry leaves out
    carries over from the phase before it."""
    phases = [first]
    raw = s.get("schedule", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{s.path('schedule')}: expected a list of phases, got {raw!r}")
    for i, body in enumerate(raw):
        p = Section(body, f"{s.path('schedule')}[{i}]")
        prev = phases[-1]
        r = SpecReader(PhaseSpec, p, base)
        r.read("start_step")
        carried = {o.name: getattr(prev, o.name) for o in options_of(PhaseSpec)}
        del carried["start_step"]
        r.read_all(carried)
        weights = prev.weights
        if p.has("weights"):
            weights = _weights(p.get("weights"), p.path("weights"), names, prev.weights)
        phases.append(r.build(weights=weights))
    return tuple(phases)
