"""Where a batch's rows live: pure order arithmetic over a job's schedule and its datasets'
epoch layouts, no data read.

A plan names, for each row of one rank's batch (or of several steps' batches, one after
another), the dataset it comes from, the epoch it starts in, and the chunk and unit it starts
at (order.RowStarts): a served row is one slice of that chunk's row buffer, which holds the
units its last row reads past the chunk's end (order.chunk_tail). Planning is O(rows of the
batch · log chunks), whatever the corpus size.

A phase that changes the sequence length starts a new segment of each dataset's rows
(segments.py): its rows are located in that segment's grid, and the rows it reads first from
the last window of the segment before (its carry) are planned as carry rows, each one slice of
a carry block (a laid-out run of the carry's stretches) instead of a chunk's row buffer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenfeed.server.errors import NotBuiltError, RequestError
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.epochlayouts import (
    CARRY_BLOCK_UNITS,
    ChunkShapes,
    DatasetUnits,
    EpochLayouts,
)

if TYPE_CHECKING:
    from tokenfeed.server.sampling.mixture import Schedule
    from tokenfeed.server.settings.config import JobSpec

MAX_STEP = 2**62


@dataclass(frozen=True)
class RowPlanPart:
    """The rows of one dataset in one rank's batch: `slots` are their places in the batch,
    `epochs` the epoch each starts in, `units` the stream unit each starts at, `starts` the
    chunk it starts in (order.RowStarts; a row is one slice of that chunk's row buffer)."""

    dataset: int
    slots: np.ndarray
    epochs: np.ndarray
    units: np.ndarray
    starts: order.RowStarts
    rows: np.ndarray  # each row's number in its dataset's own sequence (across phases)
    segment: int = 0  # of the dataset's rows (segments.py)
    # Carry rows: `units` are positions in the segment's own sequence, `starts` name carry
    # blocks (epoch -1, chunk: the block, lo: the row's offset in it).
    carry: bool = False
    # How its rows are made: "concat" (one slice of a row buffer each), "best_fit" (a best-fit
    # row of its chunk: `starts.lo` is the row within the chunk) or "padded" (a best_fit
    # segment's carry rows: slices of a carry block, the last one padded).
    packing: str = "concat"

    @property
    def key(self) -> int | tuple[int, int]:
        """What a row buffer belongs to: the dataset, or (dataset, segment) past the first."""
        return self.dataset if self.segment == 0 else (self.dataset, self.segment)


@dataclass(frozen=True)
class RowPlan:
    rows: int  # rows of the rank's batch (of all its steps' batches)
    parts: list[RowPlanPart]
    seq_len: int  # of every row: a plan's steps are of one phase

    @cached_property
    def buffers(self) -> frozenset[tuple[Any, int, int, int]]:
        """(dataset key, epoch, chunk, position) of each chunk a row starts in: the row buffers
        the plan reads (carry rows: epoch -1, their carry block, position -1)."""
        out: set[tuple[Any, int, int, int]] = set()
        for p in self.parts:
            # A few dozen rows: a set of tuples (made in C, no Python step per row) costs less
            # than the numpy calls of a unique.
            s = p.starts
            cols = (s.epoch.tolist(), s.chunk.tolist(), s.position.tolist())
            out.update(zip(itertools.repeat(p.key, len(cols[0])), *cols, strict=True))
        return frozenset(out)


class Planner:
    """The plans of one job: its schedule says which dataset row fills each place of a batch,
    each dataset's epoch layouts where that row's units live."""

    def __init__(
        self,
        spec: JobSpec,
        indexes: Sequence[DatasetUnits],
        schedule: Schedule,
        shapes: ChunkShapes | None = None,
    ):
        self.spec, self.name, self.indexes, self.schedule = spec, spec.name, indexes, schedule
        # EpochLayouts, window orders, tails and segments: their own module, shared with assembly.
        self.layouts = EpochLayouts(spec, indexes, schedule, shapes)
        self.layout, self.window_perm = self.layouts.layout, self.layouts.window_perm
        self.chunk_tail, self.tail_chunks = self.layouts.chunk_tail, self.layouts.tail_chunks
        self.carry_block, self.segments = self.layouts.carry_block, self.layouts.segments
        rows = max(p.global_batch_size for p in self.spec.phases)
        self.step_limit = MAX_STEP // (rows * max(self.spec.seq_len, 1))
        self.seq_len: Callable[[int], int] = lambda step: spec.seq_len

    def use(
        self,
        schedule: Schedule,
        step_limit: int,
        seq_len: Callable[[int], int],
        phases: Sequence[tuple[Any, ...]] | None = None,
    ) -> None:
        """A new version of the job's plan: its schedule, the first step past the servable
        ones (every row's stream units stay below MAX_STEP, so int64 arithmetic never
        overflows: about 5e11 steps of [1024, 8192]), the sequence length of a step, and
        the (start step, seq_len[, packing]) of each phase."""
        self.schedule, self.step_limit, self.seq_len = schedule, step_limit, seq_len
        self.layouts.use(schedule, phases if phases is not None else self.layouts.phases)

    def check_request(self, step: int, rank: int, world_size: int) -> None:
        limit = self.step_limit
        if not 0 <= step < limit:
            raise RequestError(f"step must be in [0, {limit}), got {step}")
        if world_size < 1:
            raise RequestError(f"world_size must be >= 1, got {world_size}")
        b = self.schedule.batch_size(step)
        if b % world_size:
            divisors = [w for w in range(1, b + 1) if b % w == 0]
            raise RequestError(
                f"world_size {world_size} does not divide global_batch_size {b} of job "
                f"{self.name} at step {step}; valid world sizes: {divisors}"
            )
        if not 0 <= rank < world_size:
            raise RequestError(f"rank must be in [0, {world_size}), got {rank}")

    def plan_steps(self, steps: list[int], rank: int, world_size: int) -> RowPlan:
        """One plan of one rank's batches of several steps of the same batch size, their rows
        one step after another: each dataset's rows are located in one pass (a stream's next
        steps pay the per-call costs once). NotBuiltError while a row is not built yet."""
        lo, hi = min(steps), max(steps)
        self.check_request(lo, rank, world_size)
        self.check_request(hi, rank, world_size)
        per_rank = self.schedule.batch_size(steps[0]) // world_size
        # Phases are intervals of steps: steps between two of one phase are requests as good
        # as theirs, of its batch size (a stream's pass: checked once, not step by step).
        if self.schedule.plan_at(lo) is not self.schedule.plan_at(hi):
            for step in steps:
                self.check_request(step, rank, world_size)
            if any(self.schedule.batch_size(step) // world_size != per_rank for step in steps):
                raise ValueError(f"steps {steps} have different batch sizes")
        datasets, dataset_rows = self.schedule.rows_at(steps, rank * per_rank, per_rank)
        parts = []
        for d in dict.fromkeys(datasets.tolist()):  # distinct, in order; cheap when small
            mine = np.nonzero(datasets == d)[0]
            rows = dataset_rows[mine]
            # The first step that needs a row not built yet is the one that waits.
            parts += self._parts(d, mine, rows, steps[int(mine[np.argmax(rows)]) // per_rank])
        return RowPlan(per_rank * len(steps), parts, self.seq_len(steps[0]))

    def _parts(self, d: int, slots: np.ndarray, rows: np.ndarray, step: int) -> list[RowPlanPart]:
        """The parts of a plan holding rows `rows` of dataset d (all of one phase, so of one
        segment) at places `slots`: its own rows, and its carry rows if it has any."""
        seg = self.layouts.segment_of(d, rows, step)
        if seg.index == 0:
            epochs, units = self.locate(d, rows, step)
            starts = order.locate_starts(
                units, self.indexes[d].units_per_epoch, self.layouts.lay(d)
            )
            return [RowPlanPart(d, slots, epochs, units, starts, rows, packing=seg.packing)]
        L, k = seg.seq_len, seg.index
        local = rows - seg.first_row
        carry = local < seg.carry_rows
        parts = []
        if carry.any():
            j = local[carry]
            block_rows = max(1, CARRY_BLOCK_UNITS // L)
            block, within = np.divmod(j, block_rows)
            first = seg.virtual(0, 1)[0][0]  # the epoch of the carry's first unit
            U = self.layouts.concat_epoch(d)
            epochs = np.full(len(j), first // U, dtype=np.int64)
            minus = np.full(len(j), -1, dtype=np.int64)
            starts = order.RowStarts(minus, minus, block, within * L)
            packing = "padded" if seg.padded else "concat"
            parts.append(
                RowPlanPart(d, slots[carry], epochs, j * L, starts, rows[carry], k, True, packing)
            )
        if (~carry).any():
            g = self.layouts.grid(d, k)
            own = local[~carry] - seg.carry_rows
            epochs = (g.origin + own * g.per_row) // g.units_per_epoch
            natural = np.empty_like(own)
            for epoch in dict.fromkeys(epochs.tolist()):
                sel = epochs == epoch
                natural[sel] = order.natural_rows(
                    self.layout(d, epoch, k), own[sel], partial(self.window_perm, d, epoch, k)
                )
            units = g.origin + natural * g.per_row
            lay = partial(self.layout, d, segment=k)
            starts = order.locate_starts(units, g.units_per_epoch, lay)
            parts.append(
                RowPlanPart(
                    d, slots[~carry], epochs, units, starts, rows[~carry], k, False, seg.packing
                )
            )
        return parts

    # ---------------------------------------------------------------- segments

    @staticmethod
    def split(plan: RowPlan, steps: int, per: int) -> list[RowPlan]:
        """A plan of `steps` steps (plan_steps) cut into plans of `per` steps each, the last
        maybe fewer: a stream plans several steps in one pass and assembles them a few at a
        time."""
        if per >= steps:
            return [plan]
        per_step = plan.rows // steps
        out = []
        for first in range(0, steps, per):
            lo, hi = first * per_step, min(steps, first + per) * per_step
            parts = []
            for p in plan.parts:  # each part's slots ascend: a step's rows are one stretch
                a, b = np.searchsorted(p.slots, [lo, hi]).tolist()
                s = p.starts
                parts.append(
                    dataclasses.replace(
                        p,
                        slots=p.slots[a:b] - lo,
                        epochs=p.epochs[a:b],
                        units=p.units[a:b],
                        starts=order.RowStarts(
                            s.epoch[a:b], s.position[a:b], s.chunk[a:b], s.lo[a:b]
                        ),
                        rows=p.rows[a:b],
                    )
                )
            out.append(RowPlan(hi - lo, parts, plan.seq_len))
        return out

    def locate(self, d: int, rows: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(epoch of each row, the stream unit it starts at) for rows of dataset `d`."""
        idx = self.indexes[d]
        if idx.ready:
            epochs = order.epoch_of_row(rows, idx.units_per_epoch, idx.per_row)
        else:  # still building: only epoch 0's rows of fully built windows are known
            need = int(rows.max()) + 1
            if need > idx.rows_built:
                raise NotBuiltError(idx.not_built(self.name, step, need))
            epochs = np.zeros(len(rows), dtype=np.int64)
        natural = np.empty_like(rows)
        distinct = dict.fromkeys(epochs.tolist())
        for epoch in distinct:
            sel = slice(None) if len(distinct) == 1 else epochs == epoch
            natural[sel] = order.natural_rows(
                self.layout(d, epoch),
                rows[sel],
                partial(self.window_perm, d, epoch, 0),
            )
        return epochs, natural * idx.per_row

    def pieces(self, part: RowPlanPart) -> order.Pieces:
        """The pieces of chunks a part's rows are made of (`row` indexes its slots), for
        provenance and accounting; serving reads the row buffers instead."""
        d = part.dataset
        if part.carry:
            seg = self.segments(d)[part.segment]
            return self.layouts.carry_pieces(d, seg, part.units, seg.seq_len + 1)
        g = self.layouts.grid(d, part.segment)
        lay = partial(self.layout, d, segment=part.segment)
        return order.locate_units(part.units, g.span, g.units_per_epoch, lay)

    def chunks_read(self, plan: RowPlan) -> set[tuple[int, int, int]]:
        """The (dataset, epoch, chunk) stretches whose units a plan's rows read."""
        out: set[tuple[int, int, int]] = set()
        for part in plan.parts:
            pc = self.pieces(part)
            _, first = np.unique(order.pair_codes(pc.epoch, pc.chunk), return_index=True)
            both = zip(pc.epoch[first].tolist(), pc.chunk[first].tolist(), strict=True)
            out.update((part.dataset, e, c) for e, c in both)
        return out

    def chunks_of_steps(self, first: int, end: int) -> set[tuple[int, int]]:
        """The (dataset, chunk) pairs that the whole global batches of steps [first, end)
        read: one pass over their rows, whatever the number of steps."""
        datasets, dataset_rows = self.schedule.rows_of_steps(first, end)
        out: set[tuple[int, int]] = set()
        for d in np.unique(datasets).tolist():
            all_rows = dataset_rows[datasets == d]
            # Rows of several phases: one segment at a time.
            segs = self.segments(d)
            which = np.searchsorted([s.first_row for s in segs], all_rows, side="right") - 1
            for k in dict.fromkeys(which.tolist()):
                mine = all_rows[which == k]
                for part in self._parts(d, np.arange(len(mine)), mine, first):
                    out.update(self._chunks_of_part(d, part))
        return out

    def _chunks_of_part(self, d: int, part: RowPlanPart) -> set[tuple[int, int]]:
        """The (dataset, chunk) pairs a part's rows read: the chunks they start in and those
        their row buffers' tails read (carry rows: every chunk of their stretches)."""
        if part.carry or part.packing == "best_fit":
            return {(d, int(c)) for c in np.unique(self.pieces(part).chunk).tolist()}
        s, out = part.starts, set()
        _, one = np.unique(order.pair_codes(s.epoch, s.position), return_index=True)
        cols = (s.epoch[one], s.position[one], s.chunk[one])
        for e, p, c in zip(*(a.tolist() for a in cols), strict=True):
            out.add((d, c))
            out.update((d, k) for k in self.tail_chunks(d, e, p, part.segment))
        return out
