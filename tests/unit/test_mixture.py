"""Mixtures and schedules: apportionment, bounds, stability under later phases, rank slices."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.sampling.mixture import (
    MAX_PERIOD,
    Phase,
    Schedule,
    chairman_sequence,
    integer_weights,
)

weights_st = st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda w: sum(w) > 0)


def schedule(weights, batch=8, later=(), seed=5):
    phases = [Phase(0, batch, tuple(Fraction(w) for w in weights))]
    phases += [Phase(s, b, tuple(Fraction(w) for w in ws)) for s, b, ws in later]
    return Schedule(phases, seed)


@given(weights_st)
@settings(max_examples=150, deadline=None)
def test_every_prefix_of_the_period_is_within_one_row_of_its_share(weights):
    a = integer_weights([Fraction(w) for w in weights])
    owner, rank = chairman_sequence(a)
    period = sum(a)
    onehot = np.zeros((period, len(a)))
    onehot[np.arange(period), owner] = 1
    counts = np.cumsum(onehot, axis=0)
    exact = np.arange(1, period + 1)[:, None] * np.array(a) / period
    assert np.abs(counts - exact).max() < 1
    assert counts[-1].tolist() == a  # the period is exact
    for d in range(len(a)):  # ranks count each dataset's slots in order
        assert rank[owner == d].tolist() == list(range(a[d]))


@given(weights_st, st.integers(1, 24), st.integers(0, 500))
@settings(max_examples=150, deadline=None)
def test_batch_counts_equal_the_apportionment_and_rows_are_consecutive(weights, batch, step):
    sch = schedule(weights, batch)
    datasets, rows = sch.rows(step, 0, batch)
    counts = np.bincount(datasets, minlength=len(weights))
    assert counts.tolist() == sch.counts(step).tolist()
    assert (counts[np.array(weights) == 0] == 0).all()
    # each dataset's rows in this step continue exactly where the previous steps stopped
    before = sum((sch.counts(s) for s in range(step)), np.zeros(len(weights), dtype=np.int64))
    for d in range(len(weights)):
        got = sorted(rows[datasets == d].tolist())
        assert got == list(range(before[d], before[d] + counts[d]))


@given(weights_st, st.integers(1, 16))
@settings(max_examples=60, deadline=None)
def test_realised_proportions_stay_within_one_row_of_the_weights(weights, batch):
    sch = schedule(weights, batch)
    total = np.zeros(len(weights))
    shares = np.array(weights) / sum(weights)
    for step in range(200):
        total += sch.counts(step)
        assert np.abs(total - (step + 1) * batch * shares).max() < 1


@given(weights_st, st.integers(1, 12), st.integers(0, 300))
@settings(max_examples=100, deadline=None)
def test_rank_slices_concatenate_to_the_global_batch(weights, per_rank, step):
    world = 4
    sch = schedule(weights, per_rank * world)
    whole = sch.rows(step, 0, per_rank * world)
    parts = [sch.rows(step, r * per_rank, per_rank) for r in range(world)]
    for i in range(2):
        assert np.concatenate([p[i] for p in parts]).tolist() == whole[i].tolist()


def test_adding_or_editing_a_later_phase_leaves_earlier_batches_alone():
    base = schedule([3, 1], 8, later=[(30, 16, [1, 1])])
    more = schedule([3, 1], 8, later=[(30, 16, [1, 1]), (60, 4, [0, 1])])
    edited = schedule([3, 1], 8, later=[(30, 16, [1, 1]), (45, 32, [5, 2])])
    for step in range(60):
        assert (
            base.rows(step, 0, base.batch_size(step))[1].tolist()
            == more.rows(step, 0, more.batch_size(step))[1].tolist()
        )
    for step in range(45):
        assert (
            base.rows(step, 0, base.batch_size(step))[1].tolist()
            == edited.rows(step, 0, edited.batch_size(step))[1].tolist()
        )
    assert more.batch_size(59) == 16 and more.batch_size(60) == 4
    assert more.counts(60).tolist() == [0, 4]


def test_phases_continue_each_datasets_rows():
    sch = schedule([1, 1], 4, later=[(10, 8, [3, 1])])
    used = sum((sch.counts(s) for s in range(10)), np.zeros(2, dtype=np.int64))
    datasets, rows = sch.rows(10, 0, 8)
    for d in range(2):
        assert rows[datasets == d].min() == used[d]


def test_one_dataset_keeps_the_natural_slot_order():
    sch = schedule([1], 8)
    datasets, rows = sch.rows(7, 2, 4)
    assert datasets.tolist() == [0] * 4 and rows.tolist() == [58, 59, 60, 61]


def test_two_datasets_are_interleaved_within_the_batch():
    sch = schedule([1, 1], 64)
    datasets, _ = sch.rows(0, 0, 64)
    assert datasets[:32].sum() not in (0, 32), "slots are permuted, not blocked"


def test_huge_periods_are_rounded_by_less_than_one_part_in_max_period():
    weights = [Fraction(1234567), Fraction(2345678), Fraction(1)]
    a = integer_weights(weights)
    assert sum(a) <= MAX_PERIOD
    exact = [w / sum(weights) for w in weights]
    assert all(
        abs(Fraction(x, sum(a)) - e) < Fraction(1, MAX_PERIOD)
        for x, e in zip(a, exact, strict=True)
    )


def test_exact_decimal_weights():
    assert integer_weights([Fraction("0.7"), Fraction("0.2"), Fraction("0.1")]) == [7, 2, 1]


def test_first_phase_must_start_at_zero():
    with pytest.raises(ValueError, match="step 0"):
        Schedule([Phase(5, 8, (Fraction(1),))], 0)


@given(
    weights_st,
    st.integers(1, 6),
    st.integers(0, 30),
    st.integers(1, 12),
    st.integers(1, 20),
)
@settings(max_examples=100, deadline=None)
def test_rows_of_steps_are_the_rows_of_every_step(weights, batch, first, steps, change):
    """The one-pass rows of a stretch of whole global batches (what prefetch plans from) are
    the rows that `rows` gives step by step, across a phase with another batch size and
    weights (sorted: a step's slots are permuted, the stretch's are not)."""
    s = schedule(weights, batch, later=[(change, batch + 2, [1] * (len(weights) + 1))])
    datasets, rows = s.rows_of_steps(first, first + steps)
    expected = [s.rows(t, 0, s.batch_size(t)) for t in range(first, first + steps)]
    want = np.concatenate([d * 2**40 + r for d, r in expected])
    assert np.array_equal(np.sort(datasets * 2**40 + rows), np.sort(want))


@given(
    weights_st,
    st.integers(1, 6),
    st.integers(0, 30),
    st.integers(0, 12),
    st.integers(1, 20),
)
@settings(max_examples=100, deadline=None)
def test_row_spans_are_the_rows_of_steps(weights, batch, first, steps, change):
    """Each dataset's rows in a stretch of steps are one run, rows lo..hi-1 (what prefetch
    looks up windows from), across a phase with another batch size that adds a dataset."""
    s = schedule(weights, batch, later=[(change, batch + 2, [1] * (len(weights) + 1))])
    lo, hi = s.row_spans(first, first + steps)
    datasets, rows = s.rows_of_steps(first, first + steps)
    for d in range(len(weights) + 1):
        assert sorted(rows[datasets == d].tolist()) == list(range(lo[d], hi[d]))


@given(
    st.sampled_from([[1], [2, 1], [1, 1, 1]]),
    st.integers(1, 6),
    st.lists(st.integers(0, 40), min_size=1, max_size=9),
    st.integers(1, 20),
)
@settings(max_examples=100, deadline=None)
def test_rows_at_are_the_rows_of_each_step_in_order(weights, batch, steps, change):
    """Several steps' rows of one rank in one pass (what a stream plans) are `rows` of each
    step, one after another, in order: one pass where a phase of one dataset does not permute
    its slots, step by step otherwise or across phases."""
    s = schedule(weights, batch, later=[(change, batch, [1] * (len(weights) + 1))])
    first, count = batch // 3, batch - batch // 3
    datasets, rows = s.rows_at(steps, first, count)
    found = [s.rows(t, first, count) for t in steps]
    assert np.array_equal(datasets, np.concatenate([d for d, _ in found]))
    assert np.array_equal(rows, np.concatenate([r for _, r in found]))
