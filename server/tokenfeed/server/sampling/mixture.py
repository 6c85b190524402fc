"""Mixtures and schedules: which dataset row fills each slot of each global batch. Pure.

A job's steps are cut into phases (`schedule`); each phase has a global batch size B and
integer weights a_d (the configured weights made exact rationals and put over a common
denominator Q = sum a_d). Within a phase the global slots k*B .. k*B+B-1 of relative step k are
dealt to datasets by one fixed sequence of period Q in which dataset d holds exactly a_d slots:

- the sequence is Tijdeman's chairman assignment: slot n goes to the dataset with the earliest
  deadline (N_d + 1 - 1/(2D-2)) / a_d (ties: lower dataset index), which keeps every prefix
  within one row of its exact share, |N_d(n) - n * a_d / Q| < 1, for every n;
- dataset d's own row behind slot n is closed-form: off_d + (n div Q) * a_d + rank(n mod Q),
  so random access to any step costs O(number of datasets + B), never a replay;
- a dataset's rows continue across phases (off_d accumulates what earlier phases used), and a
  phase depends only on the phases before it: adding or editing a later phase changes no
  earlier batch;
- a phase may know more datasets than the phases before it (a dataset added to a running job):
  its sequence is over the datasets it knows, so an earlier phase's, computed over fewer, is
  unchanged.
The B slots of a step are then put in a keyed order (Feistel, keyed by seed and step) so that
datasets interleave within the batch; with one dataset known the slots keep their natural
order.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import numpy.typing as npt
from tokenfeed.server.sampling import bijection

# Above this period the weights are rounded (each share moves by less than 1/MAX_PERIOD).
MAX_PERIOD = 1 << 16


def integer_weights(weights: list[Fraction]) -> list[int]:
    """Exact integer weights a_d with the same ratios (rounded when the period would be huge)."""
    lcm = math.lcm(*(w.denominator for w in weights))
    ints = [int(w * lcm) for w in weights]
    g = math.gcd(*ints)
    ints = [i // g for i in ints]
    if sum(ints) <= MAX_PERIOD:
        return ints
    total = sum(ints)
    exact = [Fraction(i * MAX_PERIOD, total) for i in ints]
    out = [math.floor(e) for e in exact]
    # largest remainder, once, for the whole run: ties to the lower index
    for d in sorted(range(len(out)), key=lambda d: (-(exact[d] - out[d]), d))[
        : MAX_PERIOD - sum(out)
    ]:
        out[d] += 1
    g = math.gcd(*out)
    return [o // g for o in out]


def chairman_sequence(a: list[int]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """(owner, rank) over one period: slot q belongs to dataset owner[q] and is that dataset's
    rank[q]-th slot of the period.

    Tijdeman's rule with delta = 1/(2D-2): slot n goes, among the datasets owed at least delta
    (n * s_d - N_d >= delta), to the one whose next slot is due first ((N_d + 1 - delta) / s_d),
    which bounds every prefix's error by 1 - delta."""
    period, datasets = sum(a), len(a)
    owner = np.empty(period, dtype=np.int32)
    rank = np.empty(period, dtype=np.int64)
    if datasets == 1:
        owner[:] = 0
        rank[:] = np.arange(period)
        return owner, rank
    w = np.asarray(a, dtype=np.int64)
    m = 2 * datasets - 2  # 1/delta
    counts = np.zeros(datasets, dtype=np.int64)
    inf = np.inf
    for n in range(1, period + 1):
        # everything scaled to integers: owed >= delta  <=>  (n*a_d - N_d*Q) * m >= Q
        eligible = (n * w - counts * period) * m >= period
        # due time (N_d + 1 - delta) / s_d, up to the common factor Q/m; exact as floats here
        due = np.where(eligible & (w > 0), ((counts + 1) * m - 1) / np.maximum(w, 1), inf)
        d = int(np.argmin(due))  # ties: the lowest index
        owner[n - 1], rank[n - 1] = d, counts[d]
        counts[d] += 1
    return owner, rank


@dataclass(frozen=True)
class Phase:
    start_step: int
    global_batch_size: int
    # per dataset known at this phase, in dataset order (a later phase may know more)
    weights: tuple[Fraction, ...]


class _PhasePlan:
    def __init__(self, phase: Phase, offsets: npt.NDArray[np.int64]):
        self.phase = phase
        self.known = len(phase.weights)
        known = integer_weights(list(phase.weights))
        self.a = np.zeros(len(offsets), dtype=np.int64)
        self.a[: self.known] = known
        self.period = int(self.a.sum())
        self.owner, self.rank = chairman_sequence(known)
        # cumulative slots per dataset over the period: counts before slot q
        self.before = np.zeros((self.period + 1, len(self.a)), dtype=np.int64)
        np.add.at(self.before[1:], (np.arange(self.period), self.owner), 1)
        np.cumsum(self.before, axis=0, out=self.before)
        self.offsets = offsets  # dataset rows used before this phase

    def used(self, slots: int) -> npt.NDArray[np.int64]:
        """Rows of each dataset behind the first `slots` slots of this phase."""
        whole, part = divmod(slots, self.period)
        before: npt.NDArray[np.int64] = self.before[part]
        return whole * self.a + before


class Schedule:
    """All phases of a job; validated on construction (see config.py for the messages)."""

    def __init__(self, phases: list[Phase], seed: int):
        if not phases or phases[0].start_step != 0:
            raise ValueError("the first phase must start at step 0")
        if any(len(b.weights) < len(a.weights) for a, b in itertools.pairwise(phases)):
            raise ValueError("a phase knows every dataset of the phases before it")
        self.seed = seed
        self.plans: list[_PhasePlan] = []
        offsets = np.zeros(len(phases[-1].weights), dtype=np.int64)
        for i, phase in enumerate(phases):
            if i:
                prev = self.plans[-1]
                steps = phase.start_step - prev.phase.start_step
                offsets = prev.offsets + prev.used(steps * prev.phase.global_batch_size)
            self.plans.append(_PhasePlan(phase, offsets))
        self.starts = [p.start_step for p in phases]
        self.datasets = len(phases[-1].weights)

    def plan_at(self, step: int) -> _PhasePlan:
        lo, hi = 0, len(self.starts)
        while hi - lo > 1:  # the last phase starting at or before `step`
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.starts[mid] <= step else (lo, mid)
        return self.plans[lo]

    def batch_size(self, step: int) -> int:
        return self.plan_at(step).phase.global_batch_size

    def rows(
        self, step: int, first: int, count: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(dataset index, dataset row) of batch positions [first, first+count) of `step`."""
        plan = self.plan_at(step)
        b = plan.phase.global_batch_size
        positions = np.arange(first, first + count, dtype=np.int64)
        if plan.known > 1:
            keys = bijection.round_keys("slots", self.seed, step)
            positions = bijection.permute(positions, b, keys)
        slots = (step - plan.phase.start_step) * b + positions
        whole: npt.NDArray[np.int64]
        q: npt.NDArray[np.int64]
        whole, q = np.divmod(slots, plan.period)
        dataset = plan.owner[q].astype(np.int64)
        row = plan.offsets[dataset] + whole * plan.a[dataset] + plan.rank[q]
        return dataset, row

    def rows_at(
        self, steps: list[int], first: int, count: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """`rows(step, first, count)` of each of `steps` (of one phase), one after another: in
        one pass where the phase's positions are not permuted (a phase of one dataset known),
        else step by step."""
        plan = self.plan_at(steps[0])
        if plan.known > 1 or any(self.plan_at(step) is not plan for step in steps):
            found = [self.rows(step, first, count) for step in steps]
            return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])
        b = plan.phase.global_batch_size
        at = (np.asarray(steps, dtype=np.int64) - plan.phase.start_step) * b + first
        slots = (at[:, None] + np.arange(count, dtype=np.int64)).reshape(-1)
        whole: npt.NDArray[np.int64]
        q: npt.NDArray[np.int64]
        whole, q = np.divmod(slots, plan.period)
        dataset = plan.owner[q].astype(np.int64)
        return dataset, plan.offsets[dataset] + whole * plan.a[dataset] + plan.rank[q]

    def rows_of_steps(
        self, first: int, end: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(dataset index, dataset row) of every slot of the whole global batches of steps
        [first, end), by slot (a step's slots unpermuted: the same set as `rows` gives for all
        of its positions, in one pass over all the steps)."""
        datasets: list[npt.NDArray[np.int64]] = []
        rows: list[npt.NDArray[np.int64]] = []
        for i, plan in enumerate(self.plans):
            start = plan.phase.start_step
            stop = self.starts[i + 1] if i + 1 < len(self.starts) else end
            lo, hi = max(first, start), min(end, stop)
            if lo >= hi:
                continue
            b = plan.phase.global_batch_size
            slots = np.arange((lo - start) * b, (hi - start) * b, dtype=np.int64)
            whole: npt.NDArray[np.int64]
            q: npt.NDArray[np.int64]
            whole, q = np.divmod(slots, plan.period)
            dataset = plan.owner[q].astype(np.int64)
            datasets.append(dataset)
            rows.append(plan.offsets[dataset] + whole * plan.a[dataset] + plan.rank[q])
        if len(datasets) == 1:
            return datasets[0], rows[0]
        empty = np.zeros(0, dtype=np.int64)
        return (
            np.concatenate(datasets) if datasets else empty,
            np.concatenate(rows) if rows else empty,
        )

    def consumed(self, step: int) -> npt.NDArray[np.int64]:
        """Rows of each dataset in all global batches before `step`."""
        plan = self.plan_at(step)
        return plan.offsets + plan.used(
            (step - plan.phase.start_step) * plan.phase.global_batch_size
        )

    def row_spans(self, first: int, end: int) -> tuple[list[int], list[int]]:
        """(lo, hi) by dataset: dataset d's rows in the global batches of steps [first, end)
        are exactly rows lo[d] .. hi[d] - 1 (none where equal), the set `rows_of_steps` gives
        (a dataset's rows are dealt in order, across phases): two `consumed`, whatever the
        batch, where prefetch only needs each dataset's first and last row."""
        return self.consumed(first).tolist(), self.consumed(end).tolist()

    def counts(self, step: int) -> npt.NDArray[np.int64]:
        """Rows of each dataset in the whole global batch of `step` (its apportionment)."""
        plan = self.plan_at(step)
        b, k = plan.phase.global_batch_size, step - plan.phase.start_step
        return plan.used((k + 1) * b) - plan.used(k * b)
