"""A job's data plan and its log: pure values, no I/O.

The plan is what decides which rows a step reads, by phase: from each phase's start step on, a
global batch size, a sequence length and exact weights over the datasets known by then (a phase
may add datasets; dropping one is a weight of 0). Version 1 comes from the config; later versions
append a phase at a future step (docs/data-plan.md). The log is the plan's versions' record, as
stored: the latest plan, its version, and the frozen horizon, the step through which the plan
can no longer change (servers serve a step only from a log whose horizon reaches it).

A phase depends only on the phases before it, so an appended phase changes no earlier step:
each dataset's rows continue where the previous phase left them (sampling/mixture.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tokenfeed.server.errors import ConfigError, PlanFrozenError, RequestError
from tokenfeed.server.settings.config import DatasetSpec, JobSpec, SourceSpec

LOG_FORMAT = 1
PACKINGS = ("concat", "best_fit")
# What a log's history keeps: the newest entries (the plan itself is always whole).
HISTORY_ENTRIES = 200


@dataclass(frozen=True)
class PlanPhase:
    start_step: int
    global_batch_size: int
    seq_len: int
    # One exact weight per dataset known at this phase, in the plan's dataset order: a phase
    # knows every dataset of the phases before it, and those it adds.
    weights: tuple[Fraction, ...]
    # "concat" or "best_fit" from this phase on; "": the job's own (what a config's phases and
    # every phase appended before packing could change have)
    packing: str = ""

    def describe(self, names: list[str]) -> str:
        shares = ", ".join(f"{n}={w}" for n, w in zip(names, self.weights, strict=False))
        packing = f", packing {self.packing}" if self.packing else ""
        return (
            f"from step {self.start_step}: global_batch_size {self.global_batch_size}, "
            f"seq_len {self.seq_len}{packing}, weights {shares}"
        )


@dataclass(frozen=True)
class DataPlan:
    """Datasets in the order they became known (the config's first), and phases by start."""

    datasets: tuple[DatasetSpec, ...]
    phases: tuple[PlanPhase, ...]

    @classmethod
    def from_spec(cls, spec: JobSpec) -> DataPlan:
        """Version 1: the config's datasets and schedule (a phase's seq_len and packing are the
        job's unless the phase names its own)."""
        phases = tuple(
            PlanPhase(
                p.start_step,
                p.global_batch_size,
                p.seq_len or spec.seq_len,
                tuple(p.weights),
                p.packing if p.packing and p.packing != spec.packing else "",
            )
            for p in spec.phases
        )
        return cls(tuple(spec.datasets), phases)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.datasets]

    def phase_at(self, step: int) -> int:
        """The index of the phase in force at `step`."""
        lo, hi = 0, len(self.phases)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.phases[mid].start_step <= step else (lo, mid)
        return lo

    def phase_end(self, step: int) -> int | None:
        """The first step of the phase after the one in force at `step` (None: it is the
        last)."""
        k = self.phase_at(step) + 1
        return self.phases[k].start_step if k < len(self.phases) else None

    def known(self, k: int) -> int:
        """Datasets known at phase k."""
        return len(self.phases[k].weights)

    def starts(self) -> list[int]:
        return [p.start_step for p in self.phases]


@dataclass(frozen=True)
class Amendment:
    """A phase to append from `start_step` on. What it leaves out (None) carries over from the
    phase in force before it; `weights` names datasets (those it does not name keep their
    weight, as in a config's schedule; a dataset added gets 0 unless named); `add` are new
    datasets, which its weights may name."""

    start_step: int
    global_batch_size: int | None = None
    seq_len: int | None = None
    weights: dict[str, Fraction] | None = None
    add: tuple[DatasetSpec, ...] = ()
    packing: str | None = None  # "concat" or "best_fit"


def amend(
    plan: DataPlan, change: Amendment, horizon: int, served: int, spec: JobSpec
) -> tuple[DataPlan, list[PlanPhase]]:
    """The plan with `change` appended, and the future phases it replaces (those starting at or
    after its step, none of them frozen). RequestError for a change that is not valid as
    asked, PlanFrozenError for one at a frozen step: nothing of the plan changes then."""
    at = change.start_step
    if at < 1:
        raise RequestError(
            f"start_step must be >= 1, got {at}: the phase from step 0 is the config's "
            "(change the config before the run starts)"
        )
    if at <= horizon:
        raise PlanFrozenError(
            f"step {at} is frozen: the plan of job {spec.name} can no longer change through "
            f"step {horizon} (a server has served step {served}); start the phase "
            f"at step {horizon + 1} or later"
        )
    kept = tuple(p for p in plan.phases if p.start_step < at)
    replaced = [p for p in plan.phases if p.start_step >= at]
    before = kept[-1]
    names = plan.names
    datasets = list(plan.datasets[: len(before.weights)])
    for d in change.add:
        if d.name in {x.name for x in datasets}:
            raise RequestError(
                f"dataset {d.name!r} exists already in job {spec.name}: add it under another "
                "name, or give it a weight"
            )
        datasets.append(d)
    # A dataset known only to a replaced phase is forgotten with it unless added again.
    names = [d.name for d in datasets]
    kept_weights = tuple(before.weights) + (Fraction(0),) * (len(names) - len(before.weights))
    if change.weights is None:
        weights = kept_weights
    else:
        unknown = sorted(set(change.weights) - set(names))
        if unknown:
            raise RequestError(
                f"weights name dataset {unknown[0]!r}, which job {spec.name} does not have "
                f"(its datasets: {names}); add it with its sources, or name a known one"
            )
        weights = tuple(change.weights.get(n, w) for n, w in zip(names, kept_weights, strict=True))
    for n, w in zip(names, weights, strict=True):
        if not isinstance(w, Fraction) or w < 0:
            raise RequestError(f"weight of dataset {n!r} must be a rational >= 0, got {w}")
    if sum(weights) <= 0:
        raise RequestError(
            f"weights must have a positive sum, got "
            f"{dict(zip(names, map(str, weights), strict=True))}"
        )
    batch = (
        before.global_batch_size if change.global_batch_size is None else change.global_batch_size
    )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise RequestError(f"global_batch_size must be an integer >= 1, got {batch!r}")
    if batch % spec.batch_multiple_of:
        raise RequestError(
            f"global_batch_size {batch} is not a multiple of batch_multiple_of "
            f"{spec.batch_multiple_of} of job {spec.name}"
        )
    seq_len = before.seq_len if change.seq_len is None else change.seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise RequestError(f"seq_len must be an integer >= 1, got {seq_len!r}")
    packing = (before.packing or spec.packing) if change.packing is None else change.packing
    if packing not in PACKINGS:
        raise RequestError(
            f"packing must be one of {', '.join(PACKINGS)}, got {packing!r} (a phase of "
            "another packing reads each dataset on from where the phase before left it)"
        )
    # Stored only where it differs from the job's: the phases of a job that never changes its
    # packing are written (and hashed into the plan's fingerprints) as before.
    phase = PlanPhase(at, batch, seq_len, weights, "" if packing == spec.packing else packing)
    return DataPlan(tuple(datasets), (*kept, phase)), replaced


# ---------------------------------------------------------------- the log


@dataclass(frozen=True)
class PlanLog:
    """A job's plan as stored: `version` counts changes of the plan, `revision` every write
    (a horizon moved on is a new revision of the same version)."""

    job: str
    identity: str  # identity(spec) of the config that created it
    version: int
    revision: int
    horizon: int  # the plan is final through this step (-1: nothing frozen yet)
    served: int  # the furthest step a server said it serves when it moved the horizon
    plan: DataPlan
    history: tuple[dict[str, Any], ...] = ()
    # The plan at version 1, as the run started: what the job's fingerprint covers, the same
    # on every server whatever was amended since (or whatever their config files say now).
    first: DataPlan | None = None

    @property
    def origin(self) -> DataPlan:
        return self.first if self.first is not None else self.plan

    def with_horizon(self, horizon: int, served: int) -> PlanLog:
        return dataclasses.replace(
            self,
            revision=self.revision + 1,
            horizon=max(self.horizon, horizon),
            served=max(self.served, served),
        )

    def with_plan(self, plan: DataPlan, entry: dict[str, Any]) -> PlanLog:
        history = (*self.history, {"version": self.version + 1, **entry})[-HISTORY_ENTRIES:]
        return dataclasses.replace(
            self, version=self.version + 1, revision=self.revision + 1, plan=plan, history=history
        )

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": LOG_FORMAT,
                "job": self.job,
                "identity": self.identity,
                "version": self.version,
                "revision": self.revision,
                "horizon": self.horizon,
                "served": self.served,
                "datasets": [_dataset_json(d) for d in self.plan.datasets],
                "phases": [_phase_json(p) for p in self.plan.phases],
                "first_datasets": len(self.origin.datasets),
                "first_phases": [_phase_json(p) for p in self.origin.phases],
                "history": list(self.history),
            },
            indent=1,
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> PlanLog:
        try:
            m = json.loads(raw)
            if m.get("format") != LOG_FORMAT:
                raise ValueError(f"format {m.get('format')!r}, this server reads {LOG_FORMAT}")
            datasets = tuple(_dataset_from(d) for d in m["datasets"])
            phases = tuple(_phase_from(p) for p in m["phases"])
            first = DataPlan(
                datasets[: int(m["first_datasets"])],
                tuple(_phase_from(p) for p in m["first_phases"]),
            )
            return cls(
                str(m["job"]),
                str(m["identity"]),
                int(m["version"]),
                int(m["revision"]),
                int(m["horizon"]),
                int(m["served"]),
                DataPlan(datasets, phases),
                tuple(m.get("history", [])),
                first,
            )
        except (ValueError, KeyError, TypeError, ConfigError) as e:
            raise ConfigError(f"plan log {where} cannot be read: {e}") from e


def new_log(spec: JobSpec, origin: str) -> PlanLog:
    """Version 1 of a job's log: the config's plan, nothing frozen yet."""
    entry = {"version": 1, "what": f"created from the config {origin}"}
    plan = DataPlan.from_spec(spec)
    return PlanLog(spec.name, identity(spec), 1, 1, -1, -1, plan, (entry,), plan)


def identity(spec: JobSpec) -> str:
    """What makes two configs the same run: everything fixed for the run's life (the
    tokenizer, seed, packing, window, the first datasets and their sources), not the phases,
    which a run may amend."""
    fixed = {
        "tokenizer": dataclasses.asdict(spec.tokenizer) | {"backend": None},
        "seed": spec.seed,
        "packing": spec.packing,
        "window_chunks": spec.window_chunks,
        "datasets": [_dataset_json(d) for d in spec.datasets],
    }
    text = json.dumps(fixed, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def merge_config(log: PlanLog, spec: JobSpec) -> tuple[DataPlan | None, str]:
    """How the config's plan relates to the log's (same identity): (the plan with the config's
    later phases appended, what was done) when the config extends the log's plan past its
    horizon, else (None, why the log's plan stands): a config that repeats the log, lags behind
    it (a server restarted with an old config file), or differs from it (the log is the
    record of the run: amendments go through `tokenfeed plan append`)."""
    mine = DataPlan.from_spec(spec)
    theirs = log.plan
    common = 0
    while (
        common < min(len(mine.phases), len(theirs.phases))
        and mine.phases[common] == theirs.phases[common]
    ):
        common += 1
    if common == len(mine.phases):
        return None, "the config's plan is the log's, or a part of it"
    if common == len(theirs.phases) and mine.phases[common].start_step > log.horizon:
        names = mine.names
        if names[: len(theirs.names)] == theirs.names:
            return DataPlan(mine.datasets, mine.phases), (
                f"the config adds phases from step {mine.phases[common].start_step} on"
            )
    first = mine.phases[common] if common < len(mine.phases) else None
    where = f"its phase from step {first.start_step}" if first else "its datasets"
    return None, (
        f"the config's plan differs from the log's at {where}; the log is the record of the "
        "run and stands (change a running job with `tokenfeed plan append`)"
    )


def _phase_json(p: PlanPhase) -> dict[str, Any]:
    out: dict[str, Any] = {
        "start_step": p.start_step,
        "global_batch_size": p.global_batch_size,
        "seq_len": p.seq_len,
        "weights": [str(w) for w in p.weights],
    }
    if p.packing:
        out["packing"] = p.packing
    return out


def _phase_from(p: dict[str, Any]) -> PlanPhase:
    return PlanPhase(
        int(p["start_step"]),
        int(p["global_batch_size"]),
        int(p["seq_len"]),
        tuple(Fraction(w) for w in p["weights"]),
        str(p.get("packing", "")),
    )


def _dataset_json(d: DatasetSpec) -> dict[str, Any]:
    out = dataclasses.asdict(d)
    out["sources"] = [dataclasses.asdict(s) for s in d.sources]
    return out


def _dataset_from(m: dict[str, Any]) -> DatasetSpec:
    fields = {f.name for f in dataclasses.fields(DatasetSpec)}
    sources = tuple(SourceSpec(**s) for s in m["sources"])
    return DatasetSpec(
        **{k: v for k, v in m.items() if k in fields and k != "sources"}, sources=sources
    )
