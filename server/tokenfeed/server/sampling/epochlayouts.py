"""A job's epoch layouts, by dataset and segment, and what follows from them alone: the row
order of a window, the tail of a chunk's row buffer, and a dataset's segments (a phase that
changes seq_len starts one: segments.py) with their carries. Pure order arithmetic, cached
(layouts per epoch, windows' row orders, tails' chunks); the planner (planner.py) plans rows
over it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import NotBuiltError
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.segments import (
    BEST_FIT,
    CONCAT,
    Geometry,
    Segment,
    first_segment,
    next_segment,
)

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

    @property
    def seq_len(self) -> int: ...

    def not_built(self, job: str, step: int, need: int) -> tuple[str, float]: ...


class ChunkShapes(Protocol):
    """What a phase that changes the packing reads of a dataset's documents (jobs/shapes.py):
    per chunk, its units in the concat stream and its best-fit rows at a seq_len (NotBuiltError
    while they are being counted), and where a best-fit row's pieces lie in the concat stream."""

    def concat_units(self, d: int) -> np.ndarray: ...

    def bestfit_units(self, d: int, seq_len: int) -> np.ndarray: ...

    def bestfit_stretches(
        self, d: int, seq_len: int, epoch: int, chunks: np.ndarray, rows: np.ndarray
    ) -> list[list[tuple[int, int]]]: ...


@dataclass(frozen=True)
class Grid:
    """How a segment's rows are cut from its units: units per chunk and per epoch, a row every
    `per_row` units reading `span`, its own row 0 at unit `origin`."""

    units_per_chunk: np.ndarray
    units_per_epoch: int
    per_row: int
    span: int
    origin: int


class EpochLayouts:
    def __init__(
        self,
        spec: JobSpec,
        indexes: Sequence[DatasetUnits],
        schedule: Schedule,
        shapes: ChunkShapes | None = None,
    ):
        self.spec, self.name, self.indexes, self.schedule = spec, spec.name, indexes, schedule
        self.shapes = shapes
        self._layouts: LRU[tuple[Any, ...], order.EpochLayout] = LRU(4 * len(indexes))
        # Windows' row orders: many small ones when chunks are small (a window of 8 chunks of
        # 1 KB documents holds a row or two), so bounded by bytes, not by a handful of windows.
        self._windows: LRU[tuple[Any, ...], np.ndarray] = LRU(
            WINDOWS_KEPT * len(indexes), WINDOW_BYTES * len(indexes)
        )
        self._tails: LRU[tuple[Any, ...], tuple[int, ...]] = LRU(4096)
        self._chunk_tails: LRU[tuple[Any, ...], order.Pieces] = LRU(4096)
        # (start step, seq_len, packing) of each phase: where a dataset's segments begin.
        self.phases: list[tuple[int, int, str]] = [(0, spec.seq_len, spec.packing)]
        self._segments: dict[int, tuple[object, int, list[Segment]]] = {}
        self._grids: dict[tuple[int, int], tuple[object, int, Grid]] = {}
        self._concat_units: dict[int, tuple[int, np.ndarray, int]] = {}

    def use(self, schedule: Schedule, phases: Sequence[tuple[Any, ...]]) -> None:
        """A new plan: its schedule and the (start step, seq_len[, packing]) of each phase."""
        self.schedule = schedule
        self.phases = [
            (int(p[0]), int(p[1]), str(p[2]) if len(p) > 2 and p[2] else self.spec.packing)
            for p in phases
        ]

    def segments(self, d: int) -> list[Segment]:
        """Dataset d's segments under the current schedule: a new one at each phase that
        changes the sequence length or the packing after the dataset is known. Past the first,
        they need the whole index (their carries are computed from full epoch layouts): while
        it builds only the first is known. NotBuiltError while one needs its documents counted
        (a change of packing: jobs/shapes.py)."""
        schedule, idx = self.schedule, self.indexes[d]
        cached = self._segments.get(d)
        version = -1 if idx.ready else idx.rows_built
        if cached is not None and cached[0] is schedule and cached[1] == version:
            return cached[2]
        segs = [first_segment(idx.seq_len, self.spec.packing)]
        # Known so far while the later ones are computed (each needs its predecessor's layouts).
        self._segments[d] = (schedule, version, segs)
        if idx.ready:
            try:
                for start, seq_len, packing in self.phases:
                    last = segs[-1]
                    if (seq_len, packing) == (last.seq_len, last.packing) or start == 0:
                        continue
                    known = schedule.plan_at(start).known
                    if known <= d:
                        continue
                    row = int(schedule.consumed(start)[d])
                    segs.append(next_segment(last, row, seq_len, packing, self._geometry(d, last)))
            except BaseException:
                del self._segments[d]
                raise
        self._segments[d] = (schedule, version, segs)
        return segs

    def _geometry(self, d: int, prev: Segment) -> Geometry:
        grid = self.grid(d, prev.index)
        return Geometry(
            self.concat_epoch(d),
            partial(self.concat_layout, d),
            partial(self.layout, d, segment=prev.index),
            partial(self._perm_of, d, prev.index),
            grid.units_per_epoch,
            grid.origin,
            partial(self._stretches_of, d, prev.seq_len),
        )

    def _stretches_of(
        self, d: int, seq_len: int, epoch: int, chunks: np.ndarray, rows: np.ndarray
    ) -> list[list[tuple[int, int]]]:
        return self._shapes().bestfit_stretches(d, seq_len, epoch, chunks, rows)

    def _shapes(self) -> ChunkShapes:
        if self.shapes is None:
            raise RuntimeError(f"job {self.name} changes packing without its chunks' shapes")
        return self.shapes

    def concat_units(self, d: int) -> np.ndarray:
        """Dataset d's units per chunk in its concat stream (the units every carry is in)."""
        return self._concat(d)[0]

    def concat_epoch(self, d: int) -> int:
        """Dataset d's units of one epoch in its concat stream."""
        return self._concat(d)[1]

    def _concat(self, d: int) -> tuple[np.ndarray, int]:
        idx = self.indexes[d]
        version = -1 if idx.ready else idx.rows_built
        cached = self._concat_units.get(d)
        if cached is None or cached[0] != version:
            if self.spec.packing == CONCAT:
                units = idx.units_per_chunk
            else:
                units = self._shapes().concat_units(d)
            cached = self._concat_units[d] = (version, units, int(units.sum()))
        return cached[1], cached[2]

    def concat_layout(self, d: int, epoch: int) -> order.EpochLayout:
        """Epoch `epoch`'s layout of dataset d's concat stream (its chunks' places in it)."""
        if self.spec.packing == CONCAT:
            return self.layout(d, epoch)
        version = -1 if self.indexes[d].ready else self.indexes[d].rows_built

        def make() -> order.EpochLayout:
            s, name = self.spec, self.indexes[d].dataset.name
            return order.epoch_layout(
                self.concat_units(d), s.seed, name, epoch, s.window_chunks, 1, self.concat_epoch(d)
            )

        return self._layouts.get_or_make((d, epoch, version, "concat"), make)

    def grid(self, d: int, segment: int) -> Grid:
        """How the rows of dataset d's `segment` are cut (cached per schedule)."""
        idx = self.indexes[d]
        if segment == 0:
            return Grid(idx.units_per_chunk, idx.units_per_epoch, idx.per_row, idx.span, 0)
        key = (d, segment)
        cached = self._grids.get(key)
        version = -1 if idx.ready else idx.rows_built
        if cached is not None and cached[0] is self.schedule and cached[1] == version:
            return cached[2]
        seg = self.segments(d)[segment]
        if seg.packing == CONCAT:
            units = self.concat_units(d)
            grid = Grid(units, int(units.sum()), seg.seq_len, seg.seq_len + 1, seg.origin)
        else:
            units = self._bestfit_units(d, seg.seq_len)
            U = int(units.sum())
            Uc = self.concat_epoch(d)
            epoch, offset = divmod(seg.start, Uc)
            lay = self.concat_layout(d, epoch)
            p = int(np.searchsorted(lay.units_cum, offset, side="left"))
            before = int(units[lay.chunk_order[:p]].sum())
            grid = Grid(units, U, 1, 1, epoch * U + before)
        self._grids[key] = (self.schedule, version, grid)
        return grid

    def _bestfit_units(self, d: int, seq_len: int) -> np.ndarray:
        idx = self.indexes[d]
        if self.spec.packing == BEST_FIT and idx.seq_len == seq_len:
            return idx.units_per_chunk
        return self._shapes().bestfit_units(d, seq_len)

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
        if seg.padded:  # the carry's last row ends with it
            hi = min(hi, seg.carry_units)
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
            later = [s for s, L, p in self.phases[1:] if (L, p) != (seg.seq_len, seg.packing)]
            if later and step >= later[0]:
                raise NotBuiltError(
                    (
                        f"step {step} of job {self.name} changes the sequence length or the "
                        f"packing: it needs dataset {idx.dataset.name}'s whole index, still "
                        "being built",
                        5.0,
                    )
                )
        return seg

    def lay(self, d: int) -> Callable[[int], order.EpochLayout]:
        return partial(self.layout, d)

    def carry_pieces(self, d: int, seg: Segment, starts: np.ndarray, span: int) -> order.Pieces:
        """The pieces of chunks that positions [starts[i], starts[i] + span) of a segment's
        own sequence (its carry, then the stream) are made of; `row` indexes `starts`."""
        lay = partial(self.concat_layout, d)
        U = self.concat_epoch(d)
        cols: list[list[np.ndarray]] = [[] for _ in range(6)]
        for i, v in enumerate(np.asarray(starts).tolist()):
            at = 0
            for a, b in seg.virtual(v, v + span):
                pc = order.locate_units(np.array([a]), b - a, U, lay)
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
        end (order.chunk_tail), in the grid of the dataset's `segment`. Cached: prefetch asks
        which chunks a tail reads (`tail_chunks`) a few steps before the row buffer is laid out
        with the same pieces, and both were a chunk's order arithmetic each (about a sixth of
        a [32, 4096] stream's layout time; bench/, wire section). Callers only read it."""

        def make() -> order.Pieces:
            g = self.grid(d, segment)
            return order.chunk_tail(
                self.layout(d, epoch, segment),
                position,
                g.units_per_epoch,
                g.per_row,
                g.span,
                partial(self.layout, d, segment=segment),
            )

        return self._chunk_tails.get_or_make(
            (d, epoch, position, *self._tail_key(d, segment)), make
        )

    def tail_chunks(self, d: int, epoch: int, position: int, segment: int = 0) -> tuple[int, ...]:
        """The chunks the tail of the row buffer of `position` in `epoch` reads (cached)."""

        def make() -> tuple[int, ...]:
            return tuple(np.unique(self.chunk_tail(d, epoch, position, segment).chunk).tolist())

        return self._tails.get_or_make((d, epoch, position, *self._tail_key(d, segment)), make)

    def _tail_key(self, d: int, segment: int) -> tuple[int, int, str]:
        """What a tail's pieces depend on besides its place: how far the index is built, the
        segment and its grid (as `layout` keys them)."""
        idx = self.indexes[d]
        version = -1 if idx.ready else idx.rows_built
        return version, segment, self.segments(d)[segment].grid if segment else ""

    def layout(self, d: int, epoch: int, segment: int = 0) -> order.EpochLayout:
        """Epoch `epoch`'s layout, in the grid of the dataset's `segment`. While the index
        builds, the layout of epoch 0 is exact over its built windows (chunks not built yet
        count 0 rows, after them); it is keyed by how many windows are built, so it is remade
        as the build advances."""
        idx, s = self.indexes[d], self.spec
        version = -1 if idx.ready else idx.rows_built
        g = self.grid(d, segment)
        grid = self.segments(d)[segment].grid if segment else ""

        def make() -> order.EpochLayout:
            return order.epoch_layout(
                g.units_per_chunk,
                s.seed,
                idx.dataset.name,
                epoch,
                s.window_chunks,
                g.per_row,
                g.units_per_epoch or None,
                g.origin,
                grid,
            )

        key = (d, epoch, version) if segment == 0 else (d, epoch, version, segment, grid)
        return self._layouts.get_or_make(key, make)

    def window_perm(self, d: int, epoch: int, segment: int, w: int) -> np.ndarray:
        layout = self.layout(d, epoch, segment)
        key = (d, epoch, w) if segment == 0 else (d, epoch, w, segment, layout.grid)
        return self._windows.get_or_make(key, lambda: order.window_order(layout, w))
