"""Planner.plan_steps over a stream's pass of steps: checked once where the steps lie in one
phase (phases are intervals of steps, so the steps between two good ones are good), step by
step where they span phases; the same plan as the steps planned one at a time."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
from tokenfeed.server.errors import RequestError
from tokenfeed.server.sampling.mixture import Phase, Schedule
from tokenfeed.server.sampling.planner import Planner

SEQ_LEN = 8


class Units:
    """What the planner reads of a dataset's index (planner.DatasetUnits), READY."""

    def __init__(self, units: list[int]):
        self.dataset = SimpleNamespace(name="ds")
        self.units_per_chunk = np.array(units, dtype=np.int64)
        self.units_per_epoch = int(self.units_per_chunk.sum())
        self.per_row, self.span, self.seq_len = SEQ_LEN, SEQ_LEN + 1, SEQ_LEN
        self.ready, self.rows_built = True, 0


def planner(batches: list[tuple[int, int]], step_limit: int = 10**6) -> Planner:
    """A concat job of one dataset whose phases start at batches[i][0] with batch batches[i][1]."""
    schedule = Schedule([Phase(s, b, (Fraction(1),)) for s, b in batches], 3)
    spec = SimpleNamespace(
        name="j",
        seed=3,
        window_chunks=2,
        packing="concat",
        seq_len=SEQ_LEN,
        phases=[SimpleNamespace(global_batch_size=b) for _, b in batches],
    )
    made = Planner(spec, [Units([40, 25, 60, 33])], schedule)
    made.use(schedule, step_limit, lambda step: SEQ_LEN, [(s, SEQ_LEN) for s, _ in batches])
    return made


def test_a_pass_is_the_steps_planned_one_at_a_time():
    p = planner([(0, 4), (20, 8)])
    for steps, rank, world in (((3, 4, 5, 6, 7), 1, 2), ((18, 19), 0, 4), ((20, 21, 22), 3, 4)):
        whole = p.plan_steps(list(steps), rank, world)
        alone = [p.plan_steps([s], rank, world) for s in steps]
        rows = np.concatenate([part.rows for part in whole.parts])
        assert sorted(rows.tolist()) == sorted(
            np.concatenate([part.rows for a in alone for part in a.parts]).tolist()
        )
        assert whole.rows == sum(a.rows for a in alone)


def test_a_pass_across_phases_of_one_batch_size_is_planned():
    p = planner([(0, 4), (10, 4)])
    assert p.plan_steps([8, 9, 10, 11], 0, 2).rows == 8


def test_a_pass_across_phases_of_other_batch_sizes_is_refused():
    p = planner([(0, 4), (10, 8)])
    with pytest.raises(ValueError, match="different batch sizes"):
        p.plan_steps([8, 9, 10, 11], 0, 2)


@pytest.mark.parametrize(
    ("steps", "rank", "world", "match"),
    [
        ([98, 99, 100], 0, 2, "step must be in"),  # its last step past the limit
        ([-1, 0, 1], 0, 2, "step must be in"),
        ([4, 5], 2, 2, "rank must be in"),
        ([8, 9, 10], 0, 3, "does not divide global_batch_size 4"),  # 3 divides neither phase
        ([10, 11], 0, 8, "does not divide global_batch_size 4 of job j at step 10"),
    ],
)
def test_a_pass_with_a_bad_request_is_refused_whatever_the_steps(steps, rank, world, match):
    p = planner([(0, 4), (10, 4), (20, 8)], step_limit=100)
    with pytest.raises(RequestError, match=match):
        p.plan_steps(steps, rank, world)
