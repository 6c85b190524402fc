"""A job's spec: what it reads (sourcespec.py), its packing and batch schedule.

Each option is declared once on its field (options.py): its checks run when the spec is
constructed, so a spec built in code is held to the same rules as one read from a file, and
the file's keys, their reading and the reference follow from the same declaration. The shapes
of a job in a file (one dataset or a mixture, weights by name, the schedule) are jobparse.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configcheck import (
    Instance,
    Integer,
    OptionalChoice,
    OptionalInteger,
    Rule,
    Text,
    Tuple,
    fail,
)
from tokenfeed.server.settings.options import Form, Nested, option, validate
from tokenfeed.server.settings.sourcespec import DatasetSpec, TokenizerSpec

PACKINGS = ("concat", "best_fit")
BAD_RECORD_POLICIES = ("skip", "strict")
# A job's name travels in requests, metrics labels and file names.
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The sample order's keys are 64-bit (order.py).
SEED_LIMIT = 2**64

JOB_NAME_CHECK = Rule(
    lambda v: isinstance(v, str) and JOB_NAME.fullmatch(v),
    "a job name of letters, digits, '.', '_', '-'",
)


def check_job_name(name: str, value: object) -> str:
    return str(JOB_NAME_CHECK(name, value))


@dataclass(frozen=True)
class _Weights:
    """Exact rationals only: a float weight would apportion rows by its binary expansion."""

    accepts: str = "weights >= 0 with a positive sum"

    def __call__(self, name: str, value: Any) -> tuple[Fraction, ...]:
        weights = Tuple(Fraction)(name, value)
        for i, weight in enumerate(weights):
            if weight < 0:
                raise fail(f"{name}[{i}]", "a weight >= 0", weight)
        if sum(weights) <= 0:
            raise ConfigError(
                f"{name}: weights must have a positive sum, got {[str(w) for w in weights]}"
            )
        return weights


@dataclass(frozen=True)
class PhaseSpec:
    """From `start_step` on: this global batch size and these weights (one per dataset)."""

    start_step: int = field(
        metadata=option(
            Integer(minimum=0), doc="the first step of the phase, after the phase before's"
        )
    )
    global_batch_size: int = field(
        metadata=option(
            Integer(minimum=1),
            doc="rows per step across all ranks: any world size that divides it is valid at "
            "any step",
        )
    )
    weights: tuple[Fraction, ...] = field(
        metadata=option(
            _Weights(),
            read=Form('mapping of dataset name to weight: 3, 0.7 or "1/3"'),
            shown="each dataset's `weight`",
            doc="exact weights of the datasets by name; those not named keep theirs; a phase's "
            "weights must have a positive sum",
        )
    )
    seq_len: int | None = field(
        default=None,
        metadata=option(
            OptionalInteger(minimum=1),
            shown="the phase before's (the job's `seq_len` for the first)",
            doc="a context-extension phase: tokens per row from this phase on; each dataset's "
            "stream continues where the phase before left it "
            "([data plan](data-plan.md#a-phase-that-changes-seq_len))",
            why="None: the sequence length does not change",
        ),
    )
    packing: str | None = field(
        default=None,
        metadata=option(
            OptionalChoice(PACKINGS),
            shown="the phase before's (the job's `packing` for the first)",
            doc="how rows are packed from this phase on; each dataset's rows continue where "
            "the phase before left them "
            "([data plan](data-plan.md#a-phase-that-changes-the-packing))",
            why="None: the packing does not change",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class JobSpec:
    name: str = field(metadata=option(JOB_NAME_CHECK, key=None, doc="the name clients ask for"))
    datasets: tuple[DatasetSpec, ...] = field(
        metadata=option(
            Tuple(DatasetSpec),
            read=Form("mapping of dataset name to dataset (below)"),
            shown="one: the job's own `sources`",
            doc="a mixture: its datasets by name, instead of the job's own `sources`",
        )
    )
    tokenizer: TokenizerSpec = field(
        metadata=option(
            Instance(TokenizerSpec),
            read=Nested(TokenizerSpec, shorthand="path", absent="required"),
            doc="the tokenizer; a string is its `path`",
        )
    )
    seq_len: int = field(metadata=option(Integer(minimum=1), doc="tokens per row"))
    # phases[0] starts at step 0 and carries the job's global_batch_size and weights
    phases: tuple[PhaseSpec, ...] = field(
        metadata=option(
            Tuple(PhaseSpec),
            key="schedule",
            read=Form("list of phases (below)"),
            shown="none",
            doc="phases after step 0 (the job's own keys are the first); what a phase leaves "
            "out carries over from the one before",
        )
    )
    seed: int = field(
        default=0,
        metadata=option(
            Integer(minimum=0),
            Rule(lambda v: v < SEED_LIMIT, "an integer < 2**64"),
            doc="keys the sample order",
            why="any fixed value serves: a seed only keys the order",
        ),
    )
    packing: str = field(
        default="concat",
        metadata=option(Text(PACKINGS), doc="[batch format](batch-format.md)"),
    )
    window_chunks: int = field(
        default=8,
        metadata=option(
            Integer(minimum=1),
            doc="chunks whose rows are shuffled together: I/O locality against mixing; the order "
            "stays a full permutation per epoch",
        ),
    )
    bad_records: str = field(
        default="skip",
        metadata=option(
            Text(BAD_RECORD_POLICIES),
            doc="`skip`: count, log, go on; `strict`: refuse the job ([bad records](#bad-records))",
        ),
    )
    batch_multiple_of: int = field(
        default=1,
        metadata=option(
            Integer(minimum=1),
            doc="every phase's global batch size must be a multiple of this (the trainer's "
            "data-parallel size, say); it refuses schedules only and is not part of the job's "
            "fingerprint",
            why="1 refuses no batch size",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)
        self._check_datasets()
        self._check_phases()

    def _check_datasets(self) -> None:
        seen: set[str] = set()
        for i, dataset in enumerate(self.datasets):
            if dataset.name in seen:
                raise fail(f"datasets[{i}].name", "a name no other dataset has", dataset.name)
            seen.add(dataset.name)

    def _check_phases(self) -> None:
        if self.phases[0].start_step != 0:
            raise fail("phases[0].start_step", "0", self.phases[0].start_step)
        for i, phase in enumerate(self.phases):
            if len(phase.weights) != len(self.datasets):
                raise fail(
                    f"phases[{i}].weights",
                    f"one weight per dataset ({len(self.datasets)})",
                    [str(w) for w in phase.weights],
                )
            before = self.phases[i - 1].start_step if i else -1
            if phase.start_step <= before:
                raise ConfigError(
                    f"phases[{i}].start_step: phases must start in increasing order; "
                    f"{phase.start_step} is not after {before}"
                )
            if phase.global_batch_size % self.batch_multiple_of:
                raise ConfigError(
                    f"phases[{i}].global_batch_size: global_batch_size "
                    f"{phase.global_batch_size} is not a multiple of batch_multiple_of "
                    f"{self.batch_multiple_of}"
                )

    @property
    def global_batch_size(self) -> int:
        """The batch size of step 0."""
        return self.phases[0].global_batch_size

    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]
