"""A job's data plan as messages: PlanInfo out (GetPlan, AmendPlan, DescribeJob), an
AmendPlanRequest in (proto -> the domain's Amendment, every value checked on the way)."""

from __future__ import annotations

from fractions import Fraction

from tokenfeed.server.dataplan.model import Amendment, DataPlan, PlanPhase
from tokenfeed.server.errors import ConfigError, RequestError
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.settings.config import DatasetSpec, SourceSpec
from tokenfeed.v1 import tokenfeed_pb2 as pb

# What a request may ask for at most: a change is a few phases' worth of data, not a corpus.
MAX_NEW_DATASETS = 64
MAX_SOURCES = 1024


def phase_message(
    plan: DataPlan, phase: PlanPhase, packing: str, fingerprint: str = ""
) -> pb.PlanPhase:
    """A phase as a message; `packing` is the job's (a phase that keeps it does not say it)."""
    names = plan.names[: len(phase.weights)]
    return pb.PlanPhase(
        start_step=phase.start_step,
        global_batch_size=phase.global_batch_size,
        seq_len=phase.seq_len,
        datasets=names,
        weights=[str(w) for w in phase.weights],
        fingerprint=fingerprint,
        packing=phase.packing or packing,
    )


def plan_info(job: Job, step: int = 0, replaced: list[PlanPhase] | None = None) -> pb.PlanInfo:
    """The plan this server holds for `job`, and what the steps before `step` consumed (0: the
    furthest step its trainers asked for, plus one)."""
    plans = job.plans
    plan = plans.plan
    if step <= 0:
        step = max(job.progress.furthest + 1, 0)
    chain = job.chain()
    fingerprints = [fp for _, fp in chain] if chain else [""] * len(plan.phases)
    consumed = plans.consumed(step)
    keeper = plans.keeper
    return pb.PlanInfo(
        job=job.name,
        version=plans.version,
        horizon=plans.horizon,
        served=plans.served,
        phases=[
            phase_message(plan, p, job.spec.packing, fp)
            for p, fp in zip(plan.phases, fingerprints, strict=True)
        ],
        log=keeper.where if keeper is not None else "",
        step=step,
        phase=consumed.phase,
        consumed=[
            pb.DatasetConsumption(dataset=name, rows=rows, tokens=tokens)
            for name, rows, tokens in zip(plan.names, consumed.rows, consumed.tokens, strict=True)
        ],
        replaced=[phase_message(plan, p, job.spec.packing) for p in replaced or []],
    )


def amendment(request: pb.AmendPlanRequest) -> Amendment:
    """The change a request asks for; RequestError (INVALID_ARGUMENT) saying what to fix."""
    if len(request.add) > MAX_NEW_DATASETS:
        raise RequestError(f"a change adds at most {MAX_NEW_DATASETS} datasets")
    weights: dict[str, Fraction] | None = None
    if request.weights:
        weights = {}
        for w in request.weights:
            if not w.dataset:
                raise RequestError("each weight names its dataset (DatasetWeight.dataset)")
            if w.dataset in weights:
                raise RequestError(f"dataset {w.dataset!r} is given two weights")
            weights[w.dataset] = _fraction(w.weight, f"weight of dataset {w.dataset!r}")
    return Amendment(
        start_step=request.start_step,
        global_batch_size=request.global_batch_size or None,
        seq_len=request.seq_len or None,
        weights=weights,
        add=tuple(_dataset(d) for d in request.add),
        packing=request.packing or None,
    )


def _fraction(text: str, what: str) -> Fraction:
    expected = f'{what}: expected a rational >= 0 (3, 0.7 or "1/3")'
    if len(text) > 64:  # a weight is a short number; an exponent of a million digits is not
        raise RequestError(f"{expected}, got {len(text)} characters")
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise RequestError(f"{expected}, got {text!r}") from None
    if value < 0:
        raise RequestError(f"{what}: expected a rational >= 0, got {text!r}")
    return value


def _dataset(d: pb.NewDataset) -> DatasetSpec:
    if not d.sources:
        raise RequestError(f"new dataset {d.name!r}: give it at least one source (a path)")
    if len(d.sources) > MAX_SOURCES:
        raise RequestError(f"new dataset {d.name!r}: at most {MAX_SOURCES} sources")
    for s in d.sources:
        if "://" not in s.path and not s.path.startswith("/"):
            raise RequestError(
                f"new dataset {d.name!r}: source {s.path!r} is relative; give an absolute path "
                "on the servers or an object-store URI (s3://bucket/prefix/*.jsonl)"
            )
    try:
        sources = tuple(
            SourceSpec(
                s.path,
                format=s.format or "auto",
                text_field=s.text_field or "text",
                token_field=s.token_field or None,
            )
            for s in d.sources
        )
        if d.chunk_bytes:
            return DatasetSpec(d.name, sources, chunk_bytes=d.chunk_bytes)
        return DatasetSpec(d.name, sources)
    except ConfigError as e:
        raise RequestError(f"new dataset {d.name!r}: {e}") from None
