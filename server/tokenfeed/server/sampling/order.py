"""Sample order: pure functions of (seed, dataset, epoch, sizes). No I/O, clocks or global state.

Three keyed bijections decide the order of an epoch (docs/sample-order.md has the picture):

1. chunks are permuted over [0, n_chunks);
2. the documents of each chunk are permuted before the chunk is packed (packing.py);
3. consecutive chunks in permuted order form windows of `window_chunks`; the rows that start in
   a window are permuted, so the order mixes across the corpus while I/O stays within one
   window (and the first chunks of the next, which a window's last row may reach into).

A dataset is an endless stream of units: epoch after epoch, each the chunks in that epoch's
order. Row r is the stretch [r*q, r*q + span) of it (concat: q = seq_len tokens, span =
seq_len + 1; best_fit: one pre-packed row, q = span = 1), so nothing is left between rows: a
chunk's or an epoch's last partial row carries on into the next chunk, window or epoch.

Each bijection is bijection.py's keyed Feistel network, with round keys of (purpose, seed,
dataset, epoch, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import overload

import numpy as np
import numpy.typing as npt
from tokenfeed.server.sampling.bijection import permutation, permute, round_keys


@dataclass(frozen=True)
class EpochLayout:
    """Where every unit of one epoch lives: O(number of chunks) memory.

    A dataset is an endless stream of units (tokens of the packed stream for concat, rows for
    best_fit); epoch e is its stretch [e*U, (e+1)*U), the chunks in the epoch's order.
    `chunk_order[p]` is the chunk at position p; `units_cum[p]` the units before position p
    (length n+1); windows are positions [w*W, (w+1)*W). `window_rows[w]` is the first
    dataset row whose start falls in window w (length windows+1): rows are the stretches
    [origin + r*q, origin + r*q + span) of the stream, so a window's rows are a contiguous
    range. `origin` and `grid` are those of a dataset's later segment (segments.py: rows cut
    with another seq_len from a phase on); 0 and "" for its first, whose rows start at 0.
    """

    seed: int
    dataset: str
    epoch: int
    window_chunks: int
    chunk_order: np.ndarray
    units_cum: np.ndarray
    window_rows: np.ndarray
    origin: int = 0
    grid: str = ""

    def row_keys(self, w: int) -> tuple[int, ...]:
        """The keys of window w's row permutation (a later segment's differ: its own rows)."""
        if self.grid:
            return round_keys("rows", self.seed, self.dataset, self.epoch, w, self.grid)
        return round_keys("rows", self.seed, self.dataset, self.epoch, w)

    @property
    def units(self) -> int:
        return int(self.units_cum[-1])

    @property
    def first_row(self) -> int:
        return int(self.window_rows[0])

    @property
    def end_row(self) -> int:
        return int(self.window_rows[-1])


def first_row(units: int, per_row: int) -> int:
    """The first row whose start is at or past stream unit `units`: ceil(units / per_row)."""
    return -(-units // per_row)


@overload
def epoch_of_row(row: int | np.integer, units_per_epoch: int, per_row: int) -> np.int64: ...
@overload
def epoch_of_row(row: np.ndarray, units_per_epoch: int, per_row: int) -> npt.NDArray[np.int64]: ...
def epoch_of_row(
    row: np.ndarray | int | np.integer, units_per_epoch: int, per_row: int
) -> npt.NDArray[np.int64] | np.int64:
    """The epoch in which row `row` starts: the largest e with first_row(e*U) <= row."""
    return (np.asarray(row, dtype=np.int64) * per_row) // units_per_epoch


def epoch_layout(
    units_per_chunk: np.ndarray,
    seed: int,
    dataset: str,
    epoch: int,
    window_chunks: int,
    per_row: int,
    units_per_epoch: int | None = None,
    origin: int = 0,
    grid: str = "",
) -> EpochLayout:
    """The layout of `epoch`. `units_per_epoch` is the full epoch's size U (it places the
    epoch in the stream); while a dataset builds, units of chunks not built yet count 0 and
    U is unknown, which only epoch 0 allows (it starts at unit 0). Rows start at `origin` +
    r * per_row (a later segment's rows: none starts before its origin)."""
    n = len(units_per_chunk)
    order = permutation(n, round_keys("chunks", seed, dataset, epoch))
    units_cum = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.asarray(units_per_chunk, dtype=np.int64)[order], out=units_cum[1:])
    if units_per_epoch is None and epoch:
        raise ValueError("an epoch past 0 needs the size of a whole epoch")
    base = epoch * (units_per_epoch or 0)
    bounds = np.append(np.arange(0, n, window_chunks), n)
    window_rows = np.maximum(-(-(base + units_cum[bounds] - origin) // per_row), 0)
    return EpochLayout(
        seed, dataset, epoch, window_chunks, order, units_cum, window_rows, origin, grid
    )


def window_order(layout: EpochLayout, w: int) -> np.ndarray:
    """The row permutation of window w, materialised: O(rows of one window)."""
    size = int(layout.window_rows[w + 1] - layout.window_rows[w])
    if size == 0:  # no row starts in the window (its units lie inside a neighbour's rows)
        return np.zeros(0, dtype=np.int64)
    return permutation(size, layout.row_keys(w))


def natural_rows(
    layout: EpochLayout, rows: np.ndarray, window_perm: Callable[[int], np.ndarray] | None = None
) -> np.ndarray:
    """Map dataset rows of the layout's epoch (in served order) to the rows of the stream they
    read (in natural order): within each window, a keyed permutation.

    `window_perm(w)` may return a cached `window_order(layout, w)`; by default each row's
    permuted position is computed directly."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < layout.first_row or rows.max() >= layout.end_row):
        raise ValueError(f"row out of range [{layout.first_row}, {layout.end_row})")
    windows = np.searchsorted(layout.window_rows, rows, side="right") - 1
    natural = np.empty_like(rows)
    for w in dict.fromkeys(windows.tolist()):  # distinct, in order; cheap when small
        sel = windows == w
        base = int(layout.window_rows[w])
        if window_perm is not None:
            natural[sel] = base + window_perm(int(w))[rows[sel] - base]
            continue
        size = int(layout.window_rows[w + 1]) - base
        natural[sel] = base + permute(rows[sel] - base, size, layout.row_keys(int(w)))
    return natural


@dataclass(frozen=True)
class Pieces:
    """Where the units of some rows live: piece i covers units [lo[i], hi[i]) of chunk
    `chunk[i]` (in epoch `epoch[i]`'s order of that chunk's contents) and fills positions
    [at[i], at[i] + hi[i] - lo[i]) of row `row[i]`."""

    row: np.ndarray
    epoch: np.ndarray
    chunk: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    at: np.ndarray


def locate_units(
    starts: np.ndarray, span: int, units_per_epoch: int, layout: Callable[[int], EpochLayout]
) -> Pieces:
    """The pieces of chunks that stream units [starts[i], starts[i] + span) are made of.

    A stretch may cross chunks, windows and epochs; each crossing starts a new piece.
    `layout(e)` returns epoch e's layout (callers cache them)."""
    starts = np.asarray(starts, dtype=np.int64)
    if len(starts) == 1:  # a row buffer's tail: the same pieces in int arithmetic
        return _locate_one(int(starts[0]), span, units_per_epoch, layout)
    out: list[tuple[np.ndarray, ...]] = []
    todo = np.arange(len(starts))
    cur = starts.copy()
    end = starts + span
    while todo.size:
        epochs = cur[todo] // units_per_epoch if units_per_epoch else np.zeros_like(todo)
        for e in dict.fromkeys(epochs.tolist()):
            sel = todo[epochs == e]
            lay = layout(int(e))
            base = int(e) * units_per_epoch
            offset = cur[sel] - base
            p = np.searchsorted(lay.units_cum, offset, side="right") - 1
            if p.size and p.max() >= len(lay.chunk_order):
                raise ValueError(f"units past the end of epoch {e} (not built yet?)")
            lo = offset - lay.units_cum[p]
            stop = np.minimum(end[sel] - base, lay.units_cum[p + 1])
            hi = stop - lay.units_cum[p]
            out.append(
                (sel, np.full(len(sel), e), lay.chunk_order[p], lo, hi, cur[sel] - starts[sel])
            )
            cur[sel] = base + stop
        todo = todo[cur[todo] < end[todo]]
    if not out:
        empty = np.zeros(0, dtype=np.int64)
        return Pieces(empty, empty, empty, empty, empty, empty)
    cols = [np.concatenate(c).astype(np.int64) for c in zip(*out, strict=True)]
    return Pieces(*cols)


def _locate_one(
    start: int, span: int, units_per_epoch: int, layout: Callable[[int], EpochLayout]
) -> Pieces:
    """`locate_units` of one stretch, piece after piece, without an array op per piece."""
    cols: tuple[list[int], ...] = ([], [], [], [], [], [])
    cur, end = start, start + span
    while cur < end:
        e = cur // units_per_epoch if units_per_epoch else 0
        lay, base = layout(e), e * units_per_epoch
        p = int(lay.units_cum.searchsorted(cur - base, side="right")) - 1
        if p >= len(lay.chunk_order):
            raise ValueError(f"units past the end of epoch {e} (not built yet?)")
        first = int(lay.units_cum[p])
        stop = min(end - base, int(lay.units_cum[p + 1]))
        piece = (0, e, int(lay.chunk_order[p]), cur - base - first, stop - first, cur - start)
        for col, v in zip(cols, piece, strict=True):
            col.append(v)
        cur = base + stop
    return Pieces(*(np.array(c, dtype=np.int64) for c in cols))


def pair_codes(a: np.ndarray, b: np.ndarray) -> npt.NDArray[np.int64]:
    """Int64 codes equal exactly where the pairs (a[i], b[i]) are equal, for grouping: packed
    into one integer when that cannot overflow (any epoch up to the largest step's), else
    numbered by a sort of the pairs."""
    if not len(a):
        return np.zeros(0, dtype=np.int64)
    a0, b0 = a - a.min(), b - b.min()
    width = int(b0.max()) + 1
    codes: npt.NDArray[np.int64]
    if (int(a0.max()) + 1) * width < 2**62:
        codes = (a0 * width + b0).astype(np.int64)
    else:
        pairs = np.stack((a, b), axis=1)
        codes = np.unique(pairs, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    return codes


@dataclass(frozen=True)
class RowStarts:
    """Where stretches of the stream start: stretch i begins at unit lo[i] of the chunk at
    `position[i]` of epoch `epoch[i]`'s order, chunk `chunk[i]`."""

    epoch: np.ndarray
    position: np.ndarray
    chunk: np.ndarray
    lo: np.ndarray


def locate_starts(
    starts: np.ndarray, units_per_epoch: int, layout: Callable[[int], EpochLayout]
) -> RowStarts:
    """The chunk in which each stream unit `starts[i]` lies: one binary search per epoch the
    starts fall in (a served row is then one slice of its first chunk's row buffer, which
    holds the units its last row reads past the chunk's end: `chunk_tail`)."""
    starts = np.asarray(starts, dtype=np.int64)
    epochs = starts // units_per_epoch if units_per_epoch else np.zeros_like(starts)
    position, chunk, lo = np.empty_like(starts), np.empty_like(starts), np.empty_like(starts)
    distinct = dict.fromkeys(epochs.tolist())
    for e in distinct:
        sel = slice(None) if len(distinct) == 1 else epochs == e
        lay = layout(int(e))
        offset = starts[sel] - int(e) * units_per_epoch
        p = np.searchsorted(lay.units_cum, offset, side="right") - 1
        if p.size and (p.max() >= len(lay.chunk_order) or p.min() < 0):
            raise ValueError(f"units outside epoch {e} (not built yet?)")
        position[sel], chunk[sel], lo[sel] = p, lay.chunk_order[p], offset - lay.units_cum[p]
    return RowStarts(epochs, position, chunk, lo)


def chunk_tail(
    lay: EpochLayout,
    position: int,
    units_per_epoch: int,
    per_row: int,
    span: int,
    layout: Callable[[int], EpochLayout],
) -> Pieces:
    """The pieces of later chunks (of this window, the next ones, or the next epoch) that the
    last row starting in the chunk at `position` reads past the chunk's end: what its row
    buffer holds after the chunk's own units, so that each row starting in it is one slice.
    Empty when no row starts in the chunk or its last row ends inside it."""
    base, origin = lay.epoch * units_per_epoch, lay.origin
    begin, end = base + int(lay.units_cum[position]), base + int(lay.units_cum[position + 1])
    last = first_row(end - origin, per_row) - 1  # the last row starting before the chunk's end
    need = origin + last * per_row + span - end
    if last < 0 or origin + last * per_row < begin or need <= 0:
        empty = np.zeros(0, dtype=np.int64)
        return Pieces(empty, empty, empty, empty, empty, empty)
    return locate_units(np.array([end], dtype=np.int64), need, units_per_epoch, layout)


def document_order(num_docs: int, seed: int, dataset: str, epoch: int, chunk: int) -> np.ndarray:
    """The order in which a chunk's documents are packed in one epoch."""
    if num_docs == 0:
        return np.zeros(0, dtype=np.int64)
    keys = round_keys("docs", seed, dataset, epoch, chunk)
    return permutation(num_docs, keys)
