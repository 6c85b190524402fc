"""Where a batch's rows live: pure order arithmetic over a job's schedule and its datasets'
epoch layouts, no data read.

A plan names, for each row of one rank's batch (or of several steps' batches, one after
another), the dataset it comes from, the epoch it starts in, and the chunk and unit it starts
at (order.RowStarts): a served row is one slice of that chunk's row buffer, which holds the
units its last row reads past the chunk's end (order.chunk_tail). Planning is O(rows of the
batch · log chunks), whatever the corpus size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Protocol

import numpy as np
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import NotBuiltError, RequestError
from tokenfeed.server.sampling import order

if TYPE_CHECKING:
    from tokenfeed.server.sampling.mixture import Schedule
    from tokenfeed.server.settings.config import JobSpec

MAX_STEP = 2**62


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class DatasetUnits(Protocol):
    """What planning reads of a dataset's index (indexing/index.py's DatasetIndex): its units
    per chunk and epoch, how rows are cut from them, and, while it builds, how many rows of
    epoch 0 are built."""

    @property
    def dataset(self) -> _Named: ...
    @property
    def ready(self) -> bool: ...
    @property
    def rows_built(self) -> int: ...
    @property
    def units_per_epoch(self) -> int: ...
    @property
    def units_per_chunk(self) -> np.ndarray: ...
    @property
    def per_row(self) -> int: ...
    @property
    def span(self) -> int: ...

    def not_built(self, job: str, step: int, need: int) -> tuple[str, float]: ...


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


@dataclass(frozen=True)
class RowPlan:
    rows: int  # rows of the rank's batch (of all its steps' batches)
    parts: list[RowPlanPart]
    seq_len: int  # of every row: a plan's steps are of one phase

    @cached_property
    def buffers(self) -> frozenset[tuple[int, int, int, int]]:
        """(dataset, epoch, chunk, position) of each chunk a row starts in: the row buffers
        the plan reads."""
        out: set[tuple[int, int, int, int]] = set()
        for p in self.parts:
            # A few dozen rows: a set of tuples costs less than the numpy calls of a unique.
            s, d = p.starts, p.dataset
            cols = (s.epoch.tolist(), s.chunk.tolist(), s.position.tolist())
            out.update((d, e, c, q) for e, c, q in zip(*cols, strict=True))
        return frozenset(out)


class Planner:
    """The plans of one job: its schedule says which dataset row fills each place of a batch,
    each dataset's epoch layouts where that row's units live."""

    def __init__(self, spec: JobSpec, indexes: Sequence[DatasetUnits], schedule: Schedule):
        self.spec, self.name, self.indexes, self.schedule = spec, spec.name, indexes, schedule
        self._layouts: LRU[tuple[int, int, int], order.EpochLayout] = LRU(4 * len(indexes))
        self._windows: LRU[tuple[int, int, int], np.ndarray] = LRU(16 * len(indexes))
        self._tails: LRU[tuple[int, int, int, int], tuple[int, ...]] = LRU(4096)
        rows = max(p.global_batch_size for p in self.spec.phases)
        self.step_limit = MAX_STEP // (rows * max(self.spec.seq_len, 1))
        self.seq_len: Callable[[int], int] = lambda step: spec.seq_len

    def use(self, schedule: Schedule, step_limit: int, seq_len: Callable[[int], int]) -> None:
        """A new version of the job's plan: its schedule, the first step past the servable
        ones (every row's stream units stay below MAX_STEP, so int64 arithmetic never
        overflows: about 5e11 steps of [1024, 8192]), and the sequence length of a step."""
        self.schedule, self.step_limit, self.seq_len = schedule, step_limit, seq_len

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
        for step in steps:
            self.check_request(step, rank, world_size)
        per_rank = self.schedule.batch_size(steps[0]) // world_size
        if any(self.schedule.batch_size(step) // world_size != per_rank for step in steps):
            raise ValueError(f"steps {steps} have different batch sizes")
        found = [self.schedule.rows(step, rank * per_rank, per_rank) for step in steps]
        datasets = np.concatenate([f[0] for f in found]) if len(steps) > 1 else found[0][0]
        dataset_rows = np.concatenate([f[1] for f in found]) if len(steps) > 1 else found[0][1]
        parts = []
        for d in dict.fromkeys(datasets.tolist()):  # distinct, in order; cheap when small
            mine = np.nonzero(datasets == d)[0]
            rows = dataset_rows[mine]
            # The first step that needs a row not built yet is the one that waits.
            epochs, units = self.locate(d, rows, steps[int(mine[np.argmax(rows)]) // per_rank])
            starts = order.locate_starts(units, self.indexes[d].units_per_epoch, self._lay(d))
            parts.append(RowPlanPart(d, mine, epochs, units, starts, rows))
        return RowPlan(per_rank * len(steps), parts, self.seq_len(steps[0]))

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
                    RowPlanPart(
                        p.dataset,
                        p.slots[a:b] - lo,
                        p.epochs[a:b],
                        p.units[a:b],
                        order.RowStarts(s.epoch[a:b], s.position[a:b], s.chunk[a:b], s.lo[a:b]),
                        p.rows[a:b],
                    )
                )
            out.append(RowPlan(hi - lo, parts, plan.seq_len))
        return out

    def _lay(self, d: int) -> Callable[[int], order.EpochLayout]:
        return partial(self.layout, d)

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
                partial(self.window_perm, d, epoch),
            )
        return epochs, natural * idx.per_row

    def pieces(self, part: RowPlanPart) -> order.Pieces:
        """The pieces of chunks a part's rows are made of (`row` indexes its slots), for
        provenance and accounting; serving reads the row buffers instead."""
        idx, d = self.indexes[part.dataset], part.dataset
        return order.locate_units(part.units, idx.span, idx.units_per_epoch, self._lay(d))

    def chunks_read(self, plan: RowPlan) -> set[tuple[int, int, int]]:
        """The (dataset, epoch, chunk) stretches whose units a plan's rows read."""
        out: set[tuple[int, int, int]] = set()
        for part in plan.parts:
            pc = self.pieces(part)
            _, first = np.unique(order.pair_codes(pc.epoch, pc.chunk), return_index=True)
            both = zip(pc.epoch[first].tolist(), pc.chunk[first].tolist(), strict=True)
            out.update((part.dataset, e, c) for e, c in both)
        return out

    def chunk_tail(self, d: int, epoch: int, position: int) -> order.Pieces:
        """What the row buffer of the chunk at `position` of `epoch` holds past the chunk's
        end (order.chunk_tail)."""
        idx = self.indexes[d]
        return order.chunk_tail(
            self.layout(d, epoch),
            position,
            idx.units_per_epoch,
            idx.per_row,
            idx.span,
            self._lay(d),
        )

    def chunks_of_steps(self, first: int, end: int) -> set[tuple[int, int]]:
        """The (dataset, chunk) pairs that the whole global batches of steps [first, end)
        read: one pass over their rows, whatever the number of steps."""
        rows: dict[int, list[np.ndarray]] = {}
        for step in range(first, end):
            datasets, dataset_rows = self.schedule.rows(step, 0, self.schedule.batch_size(step))
            for d in dict.fromkeys(datasets.tolist()):
                rows.setdefault(d, []).append(dataset_rows[datasets == d])
        out: set[tuple[int, int]] = set()
        for d, found in rows.items():
            idx = self.indexes[d]
            _, units = self.locate(d, np.concatenate(found), first)
            s = order.locate_starts(units, idx.units_per_epoch, self._lay(d))
            # The chunks rows start in, and those their row buffers' tails read.
            _, one = np.unique(order.pair_codes(s.epoch, s.position), return_index=True)
            cols = (s.epoch[one], s.position[one], s.chunk[one])
            for e, p, c in zip(*(a.tolist() for a in cols), strict=True):
                out.add((d, c))
                out.update((d, k) for k in self.tail_chunks(d, e, p))
        return out

    def tail_chunks(self, d: int, epoch: int, position: int) -> tuple[int, ...]:
        """The chunks the tail of the row buffer of `position` in `epoch` reads (cached)."""
        version = -1 if self.indexes[d].ready else self.indexes[d].rows_built

        def make() -> tuple[int, ...]:
            return tuple(np.unique(self.chunk_tail(d, epoch, position).chunk).tolist())

        return self._tails.get_or_make((d, epoch, position, version), make)

    def layout(self, d: int, epoch: int) -> order.EpochLayout:
        """Epoch `epoch`'s layout. While the index builds, the layout of epoch 0 is exact over
        its built windows (chunks not built yet count 0 rows, after them); it is keyed by how
        many windows are built, so it is remade as the build advances."""
        idx, s = self.indexes[d], self.spec
        version = -1 if idx.ready else idx.rows_built

        def make() -> order.EpochLayout:
            return order.epoch_layout(
                idx.units_per_chunk,
                s.seed,
                idx.dataset.name,
                epoch,
                s.window_chunks,
                idx.per_row,
                idx.units_per_epoch or None,
            )

        return self._layouts.get_or_make((d, epoch, version), make)

    def window_perm(self, d: int, epoch: int, w: int) -> np.ndarray:
        layout = self.layout(d, epoch)
        return self._windows.get_or_make((d, epoch, w), lambda: order.window_order(layout, w))
