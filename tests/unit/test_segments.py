"""A phase that changes seq_len: every unit of a dataset's stream is an input of exactly one row,
whatever the chunk sizes, window, change steps and lengths (segments.py, planner.py).

The planner runs on its own over a made-up dataset (units per chunk, no tokens): the rows of
steps 0, 1, 2, ... are located and cut into the pieces of chunks they read (Planner.pieces:
a later segment's own rows, and its carry rows, whose stretches come from the window the
segment before had not finished). Each piece's input positions are mapped back to stream
units; no unit may be an input twice, and after the rows have read three epochs' worth of units,
the first two epochs must be covered whole.
"""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.mixture import Phase, Schedule
from tokenfeed.server.sampling.planner import Planner

SEED, NAME = 5, "ds"


class FakeIndex:
    """What the planner reads of a dataset's index (planner.DatasetUnits), READY."""

    def __init__(self, units: list[int], seq_len: int):
        self.dataset = SimpleNamespace(name=NAME)
        self.units_per_chunk = np.array(units, dtype=np.int64)
        self.units_per_epoch = int(self.units_per_chunk.sum())
        self.per_row, self.span, self.seq_len = seq_len, seq_len + 1, seq_len
        self.ready, self.rows_built = True, 0

    def not_built(self, job, step, need):  # pragma: no cover - READY
        raise AssertionError


def planner_for(units, window, batch, phases) -> tuple[Planner, FakeIndex]:
    first = phases[0][1]
    idx = FakeIndex(units, first)
    schedule = Schedule([Phase(s, batch, (Fraction(1),)) for s, _ in phases], SEED)
    spec = SimpleNamespace(
        name="j",
        seed=SEED,
        window_chunks=window,
        packing="concat",
        seq_len=first,
        phases=[SimpleNamespace(global_batch_size=batch)],
    )
    planner = Planner(spec, [idx], schedule)
    starts = [s for s, _ in phases]

    def seq_len(step: int) -> int:
        return phases[int(np.searchsorted(starts, step, side="right")) - 1][1]

    planner.use(schedule, 2**40, seq_len, list(phases))
    return planner, idx


def unit_of(planner: Planner, epoch: int, chunk: int, lo: int, segment: int) -> int:
    lay = planner.layout(0, epoch, segment)
    position = int(np.nonzero(lay.chunk_order == chunk)[0][0])
    return epoch * planner.indexes[0].units_per_epoch + int(lay.units_cum[position]) + lo


@settings(max_examples=40, deadline=None)
@given(
    units=st.lists(st.integers(1, 60), min_size=2, max_size=9),
    window=st.integers(1, 4),
    batch=st.integers(1, 5),
    changes=st.lists(
        st.tuples(st.integers(1, 30), st.integers(2, 41)),
        min_size=1,
        max_size=3,
        unique_by=lambda c: c[0],
    ),
    first=st.integers(2, 17),
)
def test_every_unit_is_an_input_once_across_seq_len_changes(units, window, batch, changes, first):
    phases = [(0, first)] + sorted(changes)
    planner, idx = planner_for(units, window, batch, phases)
    U = idx.units_per_epoch
    seen = np.zeros(4 * U + 200, dtype=np.int64)
    served, step = 0, 0
    while served < 3 * U:
        plan = planner.plan_steps([step], 0, 1)
        L = plan.seq_len
        for part in plan.parts:
            pc = planner.pieces(part)
            for e, c, lo, hi, at in zip(
                pc.epoch.tolist(),
                pc.chunk.tolist(),
                pc.lo.tolist(),
                pc.hi.tolist(),
                pc.at.tolist(),
                strict=True,
            ):
                inputs = max(0, min(hi - lo, L - at))  # the row's last position is a label
                if inputs:
                    u = unit_of(planner, e, c, lo, part.segment)
                    seen[u : u + inputs] += 1
        served += plan.rows * L
        step += 1
    assert seen.max() <= 1, f"unit {int(np.argmax(seen))} is an input twice"
    assert seen[: 2 * U].min() == 1, f"unit {int(np.argmin(seen[: 2 * U]))} never served"


def test_without_a_change_the_first_segment_is_the_dataset_as_before():
    planner, idx = planner_for([30, 7, 50, 12], 2, 3, [(0, 8)])
    (seg,) = planner.segments(0)
    assert (seg.index, seg.first_row, seg.carry_units, seg.start, seg.origin) == (0, 0, 0, 0, 0)
    plan = planner.plan_steps([2], 0, 1)
    (part,) = plan.parts
    lay = order.epoch_layout(idx.units_per_chunk, SEED, NAME, 0, 2, 8, idx.units_per_epoch)
    rows = np.arange(6, 9)
    assert np.array_equal(part.units, order.natural_rows(lay, rows) * 8)
