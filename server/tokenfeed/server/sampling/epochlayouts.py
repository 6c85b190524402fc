"""A job's epoch layouts, by dataset and segment, and what follows from them alone: the row
order of a window, the tail of a chunk's row buffer, and a dataset's segments (a phase that
changes seq_len starts one: segments.py) with their carries. Pure order arithmetic, cached
(layouts per epoch, windows' row orders, tails' chunks); the planner (planner.py) plans rows
over it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import NotBuiltError
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.segments import Segment, first_segment, next_segment

if TYPE_CHECKING:
    from tokenfeed.server.sampling.mixture import Schedule
    from tokenfeed.server.settings.config import JobSpec

# Carry rows laid out together (one carry block): a block holds about this many units.
CARRY_BLOCK_UNITS = 2**20
# Windows' row orders kept per dataset: at most this many, of at most this many bytes.
WINDOWS_KEPT = 8192
WINDOW_BYTES = 16 << 20


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


class EpochLayouts:
    def __init__(self, spec: JobSpec, indexes: Sequence[DatasetUnits], schedule: Schedule):
        self.spec, self.name, self.indexes, self.schedule = spec, spec.name, indexes, schedule
        self._layouts: LRU[tuple[Any, ...], order.EpochLayout] = LRU(4 * len(indexes))
        # Windows' row orders: many small ones when chunks are small (a window of 8 chunks of
        # 1 KB documents holds a row or two), so bounded by bytes, not by a handful of windows.
        self._windows: LRU[tuple[Any, ...], np.ndarray] = LRU(
            WINDOWS_KEPT * len(indexes), WINDOW_BYTES * len(indexes)
        )
        self._tails: LRU[tuple[int, int, int, int, int], tuple[int, ...]] = LRU(4096)
        # (start step, seq_len) of each phase: where a dataset's segments begin.
        self.phases: list[tuple[int, int]] = [(0, spec.seq_len)]
        self._segments: dict[int, tuple[object, int, list[Segment]]] = {}

    def use(self, schedule: Schedule, phases: list[tuple[int, int]]) -> None:
        self.schedule, self.phases = schedule, phases

    def segments(self, d: int) -> list[Segment]:
        """Dataset d's segments under the current schedule: a new one at each phase that
        changes the sequence length after the dataset is known. Past the first, they need the
        whole index (their carries are computed from full epoch layouts): while it builds only
        the first is known."""
        schedule, idx = self.schedule, self.indexes[d]
        cached = self._segments.get(d)
        version = -1 if idx.ready else idx.rows_built
        if cached is not None and cached[0] is schedule and cached[1] == version:
            return cached[2]
        segs = [first_segment(idx.per_row if self.spec.packing == "concat" else idx.span)]
        # Known so far while the later ones are computed (each needs its predecessor's layouts).
        self._segments[d] = (schedule, version, segs)
        if idx.ready:
            for start, seq_len in self.phases:
                if seq_len == segs[-1].seq_len or start == 0:
                    continue
                known = schedule.plan_at(start).known
                if known <= d:
                    continue
                row = int(schedule.consumed(start)[d])
                prev = segs[-1]
                segs.append(
                    next_segment(
                        prev,
                        row,
                        seq_len,
                        idx.units_per_epoch,
                        partial(self.layout, d, segment=prev.index),
                        partial(self._perm_of, d, prev.index),
                    )
                )
        self._segments[d] = (schedule, version, segs)
        return segs

    def carry_block(self, d: int, segment: int, block: int) -> tuple[order.Pieces, list[int]]:
        """The pieces of chunks that carry block `block` of a segment is made of (the carry
        rows it holds, each row's units and the label after), in order, and the positions in
        the block where a stretch of the carry joins the next (a document segment starts
        there)."""
        seg = self.segments(d)[segment]
        L = seg.seq_len
        per_block = max(1, CARRY_BLOCK_UNITS // L)
        first = block * per_block
        last = min(first + per_block, seg.carry_rows) - 1
        lo, hi = first * L, last * L + L + 1
        joins, at = [], 0
        for a, b in seg.virtual(lo, hi):
            if at:
                joins.append(at)
            at += b - a
        pc = self.carry_pieces(d, seg, np.array([lo], dtype=np.int64), hi - lo)
        return pc, joins

    def _perm_of(self, d: int, segment: int, epoch: int, w: int) -> np.ndarray:
        return self.window_perm(d, epoch, segment, w)

    def segment_of(self, d: int, rows: np.ndarray, step: int) -> Segment:
        """The segment of rows of one phase (NotBuiltError for a later segment while the
        dataset's index builds)."""
        segs = self.segments(d)
        seg = segs[int(np.searchsorted([s.first_row for s in segs], rows[0], side="right")) - 1]
        idx = self.indexes[d]
        if not idx.ready and seg.index == 0 and len(self.phases) > 1:
            later = [s for s, L in self.phases[1:] if L != seg.seq_len]
            if later and step >= later[0]:
                raise NotBuiltError(
                    (
                        f"step {step} of job {self.name} changes the sequence length: it needs "
                        f"dataset {idx.dataset.name}'s whole index, still being built",
                        5.0,
                    )
                )
        return seg

    def lay(self, d: int) -> Callable[[int], order.EpochLayout]:
        return partial(self.layout, d)

    def carry_pieces(self, d: int, seg: Segment, starts: np.ndarray, span: int) -> order.Pieces:
        """The pieces of chunks that positions [starts[i], starts[i] + span) of a segment's
        own sequence (its carry, then the stream) are made of; `row` indexes `starts`."""
        idx = self.indexes[d]
        lay = partial(self.layout, d, segment=seg.index)
        cols: list[list[np.ndarray]] = [[] for _ in range(6)]
        for i, v in enumerate(np.asarray(starts).tolist()):
            at = 0
            for a, b in seg.virtual(v, v + span):
                pc = order.locate_units(np.array([a]), b - a, idx.units_per_epoch, lay)
                for c, col in enumerate(
                    (np.full(len(pc.row), i), pc.epoch, pc.chunk, pc.lo, pc.hi, pc.at + at)
                ):
                    cols[c].append(col)
                at += b - a
        if not cols[0]:
            empty = np.zeros(0, dtype=np.int64)
            return order.Pieces(empty, empty, empty, empty, empty, empty)
        joined = [np.concatenate(c).astype(np.int64) for c in cols]
        return order.Pieces(*joined)

    def chunk_tail(self, d: int, epoch: int, position: int, segment: int = 0) -> order.Pieces:
        """What the row buffer of the chunk at `position` of `epoch` holds past the chunk's
        end (order.chunk_tail), in the grid of the dataset's `segment`."""
        idx = self.indexes[d]
        if segment == 0:
            per_row, span = idx.per_row, idx.span
        else:
            per_row = self.segments(d)[segment].seq_len
            span = per_row + 1
        return order.chunk_tail(
            self.layout(d, epoch, segment),
            position,
            idx.units_per_epoch,
            per_row,
            span,
            partial(self.layout, d, segment=segment),
        )

    def tail_chunks(self, d: int, epoch: int, position: int, segment: int = 0) -> tuple[int, ...]:
        """The chunks the tail of the row buffer of `position` in `epoch` reads (cached)."""
        version = -1 if self.indexes[d].ready else self.indexes[d].rows_built

        def make() -> tuple[int, ...]:
            return tuple(np.unique(self.chunk_tail(d, epoch, position, segment).chunk).tolist())

        return self._tails.get_or_make((d, epoch, position, version, segment), make)

    def layout(self, d: int, epoch: int, segment: int = 0) -> order.EpochLayout:
        """Epoch `epoch`'s layout, in the grid of the dataset's `segment`. While the index
        builds, the layout of epoch 0 is exact over its built windows (chunks not built yet
        count 0 rows, after them); it is keyed by how many windows are built, so it is remade
        as the build advances."""
        idx, s = self.indexes[d], self.spec
        version = -1 if idx.ready else idx.rows_built
        if segment == 0:
            per_row, origin, grid = idx.per_row, 0, ""
        else:
            seg = self.segments(d)[segment]
            per_row, origin, grid = seg.seq_len, seg.origin, seg.grid

        def make() -> order.EpochLayout:
            return order.epoch_layout(
                idx.units_per_chunk,
                s.seed,
                idx.dataset.name,
                epoch,
                s.window_chunks,
                per_row,
                idx.units_per_epoch or None,
                origin,
                grid,
            )

        key = (d, epoch, version) if segment == 0 else (d, epoch, version, segment, grid)
        return self._layouts.get_or_make(key, make)

    def window_perm(self, d: int, epoch: int, segment: int, w: int) -> np.ndarray:
        layout = self.layout(d, epoch, segment)
        key = (d, epoch, w) if segment == 0 else (d, epoch, w, segment, layout.grid)
        return self._windows.get_or_make(key, lambda: order.window_order(layout, w))
