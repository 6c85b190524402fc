"""Where a batch's rows live: pure order arithmetic over a job's schedule and its datasets'
epoch layouts, no data read.

A plan names, for each row of one rank's batch (or of several steps' batches, one after
another), the dataset it comes from, the epoch it starts in and the pieces of chunks its units
are (order.Pieces). Planning is O(rows of the batch · log chunks), whatever the corpus size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import NotBuiltError, RequestError
from tokenfeed.server.sampling import order

if TYPE_CHECKING:
    from tokenfeed.server.indexing.index import DatasetIndex
    from tokenfeed.server.sampling.mixture import Schedule
    from tokenfeed.server.settings.config import JobSpec

MAX_STEP = 2**62
# (epoch, chunk) packed into one int64 as epoch * this + chunk: chunks of a dataset stay far
# below 2**40 (a trillion), epochs below 2**23.
CHUNKS_PER_EPOCH_KEY = 2**40


@dataclass(frozen=True)
class PlanPart:
    """The rows of one dataset in one rank's batch: `slots` are their places in the batch,
    `epochs` the epoch each starts in, `pieces` where their units live (order.Pieces, whose
    `row` indexes `slots`)."""

    dataset: int
    slots: np.ndarray
    epochs: np.ndarray
    pieces: order.Pieces


class Plan(NamedTuple):
    rows: int  # rows of the rank's batch (of all its steps' batches)
    parts: list[PlanPart]


class Planner:
    """The plans of one job: its schedule says which dataset row fills each place of a batch,
    each dataset's epoch layouts where that row's units live."""

    def __init__(self, spec: JobSpec, indexes: list[DatasetIndex], schedule: Schedule):
        self.spec, self.name, self.indexes, self.schedule = spec, spec.name, indexes, schedule
        self._layouts: LRU[tuple[int, int, int], order.EpochLayout] = LRU(4 * len(indexes))
        self._windows: LRU[tuple[int, int, int], np.ndarray] = LRU(16 * len(indexes))

    def check_request(self, step: int, rank: int, world_size: int) -> None:
        limit = MAX_STEP // max(p.global_batch_size for p in self.spec.phases)
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

    def plan_steps(self, steps: list[int], rank: int, world_size: int) -> Plan:
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
            epochs, pieces = self.locate(d, rows, steps[int(mine[np.argmax(rows)]) // per_rank])
            parts.append(PlanPart(d, mine, epochs, pieces))
        return Plan(per_rank * len(steps), parts)

    def locate(self, d: int, rows: np.ndarray, step: int) -> tuple[np.ndarray, order.Pieces]:
        """(epoch of each row, the pieces of chunks they read) for rows of dataset `d`."""
        idx = self.indexes[d]
        if idx.ready:
            epochs = order.epoch_of_row(rows, idx.units_per_epoch, idx.per_row)
        else:  # still building: only epoch 0's rows of fully built windows are known
            need = int(rows.max()) + 1
            if need > idx.rows_built:
                raise NotBuiltError(idx.not_built(self.name, step, need))
            epochs = np.zeros(len(rows), dtype=np.int64)
        natural = np.empty_like(rows)
        for epoch in dict.fromkeys(epochs.tolist()):
            sel = epochs == epoch
            natural[sel] = order.natural_rows(
                self.layout(d, epoch),
                rows[sel],
                partial(self.window_perm, d, epoch),
            )
        pieces = order.locate_units(
            natural * idx.per_row, idx.span, idx.units_per_epoch, lambda e: self.layout(d, e)
        )
        return epochs, pieces

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
            _, pieces = self.locate(d, np.concatenate(found), first)
            out.update((d, c) for c in np.unique(pieces.chunk).tolist())
        return out

    @staticmethod
    def plan_chunks(plan: Plan) -> set[tuple[int, int, int]]:
        """The (dataset, epoch, chunk) stretches a plan reads."""
        out: set[tuple[int, int, int]] = set()
        for p in plan.parts:
            # A batch's pieces come from a few chunks: deduplicated in numpy, not per piece.
            both = np.unique(p.pieces.epoch * CHUNKS_PER_EPOCH_KEY + p.pieces.chunk).tolist()
            out.update(
                (p.dataset, k // CHUNKS_PER_EPOCH_KEY, k % CHUNKS_PER_EPOCH_KEY) for k in both
            )
        return out

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
