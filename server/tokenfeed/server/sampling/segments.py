"""A dataset's rows when a phase changes the sequence length or the packing. Pure.

A dataset's rows are numbered on across phases (mixture.py); a phase with another seq_len starts
a new *segment* of its rows. Segment 0 is the dataset as order.py cuts it: row r is stream
units [r*L, r*L + L + 1). Segment k+1 begins at the dataset row R the phases before it consumed
and continues the stream where segment k left it, so that no unit is read twice or skipped
within an epoch:

- segment k consumed its rows window by window, each window's rows in a keyed order; at row R
  the window being read has some rows served and some not. The rows not served are the
  *carry*: their input units, in stream order, joined (adjacent rows merge into one stretch);
- segment k+1 reads the carry first, cut into rows of its own length (a row may join two
  stretches: the join starts a new document segment, so attention never crosses it), then the
  stream from the first unit of the next window on, cut with the new length from an *origin*
  (the unit its row 0 starts at) and laid out in windows as order.py does, with row
  permutations keyed by the segment's grid;
- if segment k had not yet read past its own carry, the rest of that carry is segment k+1's
  carry, and the stream continues where it did.

So the rows of an epoch still tile its stream: every unit is an input exactly once per epoch
across the change (the labels at a join are the next stretch's first token, as at a document
boundary). Memory: a carry holds at most one window's rows as stretches.

Packing (docs/data-plan.md, "changing the packing"). Stream units are always those of the
dataset's *concat stream* (its documents as `[BOS] tokens EOS`, chunk after chunk in each
epoch's order), whatever the packing: a best_fit row is a set of pieces of that stream. So a
carry is stretches of the concat stream under either packing, and its rows are cut from it with
the new seq_len (a best_fit segment's carry rows too: the last one is padded, never reads on):

- after a best_fit segment, the carry is the pieces of the rows of its window not served yet
  (which needs the documents of that window's chunks: `Geometry.bestfit_stretches`), and the
  stream continues at the next window's first chunk;
- a best_fit segment's own rows are the best-fit rows (at its seq_len) of whole chunks, so it
  continues from a chunk's start: the rest of the chunk it would begin inside joins its carry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from tokenfeed.server.sampling import order

CONCAT, BEST_FIT = "concat", "best_fit"


@dataclass(frozen=True)
class Segment:
    index: int  # k: 0 for the dataset's first
    first_row: int  # the dataset row it starts at
    seq_len: int  # its rows: units [s, s + L + 1) every L
    carry_lo: npt.NDArray[np.int64]  # stretches of stream units it reads first, in order
    carry_hi: npt.NDArray[np.int64]
    start: int  # the stream unit it continues from after its carry
    packing: str = CONCAT  # of its own rows past the carry (best_fit: whole chunks' rows)

    @property
    def grid(self) -> str:
        """What keys its windows' row permutations apart from other segments' ("" for 0)."""
        if not self.index:
            return ""
        if self.packing == BEST_FIT:
            return f"best_fit,seq_len={self.seq_len}@{self.first_row}"
        return f"seq_len={self.seq_len}@{self.first_row}"

    @property
    def padded(self) -> bool:
        """Its last carry row is padded instead of reading on into the stream (best_fit: the
        stream past the carry is read as whole chunks' best-fit rows)."""
        return self.packing == BEST_FIT

    @property
    def carry_units(self) -> int:
        return int((self.carry_hi - self.carry_lo).sum())

    @property
    def carry_rows(self) -> int:
        """Rows that start in the carry (the last may read on past it, into the stream)."""
        c = self.carry_units
        return -(-c // self.seq_len) if c else 0

    @property
    def origin(self) -> int:
        """The stream unit where its first row past the carry starts (concat; a best_fit
        segment's first row is the first best-fit row of the chunk starting at `start`)."""
        if self.padded:
            return self.start
        return self.start + self.carry_rows * self.seq_len - self.carry_units

    def virtual(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The stream stretches that positions [lo, hi) of the segment's own sequence (its
        carry, then the stream from `start`) are made of, in order. A padded carry's rows
        end with it."""
        cum = np.concatenate(([0], np.cumsum(self.carry_hi - self.carry_lo)))
        if self.padded:
            hi = min(hi, int(cum[-1]))
        out: list[tuple[int, int]] = []
        if lo < cum[-1]:
            i = int(np.searchsorted(cum, lo, side="right")) - 1
            while i < len(self.carry_lo) and cum[i] < hi:
                a = int(self.carry_lo[i]) + max(lo - int(cum[i]), 0)
                b = int(self.carry_lo[i]) + min(hi - int(cum[i]), int(cum[i + 1] - cum[i]))
                if a < b:
                    out.append((a, b))
                i += 1
        if hi > cum[-1]:
            past = max(lo - int(cum[-1]), 0)
            out.append((self.start + past, self.start + hi - int(cum[-1])))
        return out


def first_segment(seq_len: int, packing: str = CONCAT) -> Segment:
    empty = np.zeros(0, dtype=np.int64)
    return Segment(0, 0, seq_len, empty, empty, 0, packing)


@dataclass(frozen=True)
class Geometry:
    """What a new segment's carry is computed from (the caller caches each): the concat
    stream's size and layouts, the segment before's own layouts and window orders, and, after
    a best_fit segment, where its rows' pieces lie in the concat stream."""

    units_per_epoch: int  # concat units of one epoch
    concat_layout: Callable[[int], order.EpochLayout]  # epoch -> its concat layout
    layout: Callable[[int], order.EpochLayout]  # epoch -> its layout in prev's grid
    window_perm: Callable[[int, int], np.ndarray]  # (epoch, w) -> window w's row order there
    prev_units_per_epoch: int  # units of one epoch in prev's grid
    prev_origin: int  # where prev's own row 0 starts in its grid
    # (epoch, chunks, rows within them) of best-fit rows at prev's seq_len -> the concat stream
    # stretches (offsets within each chunk's stream in that epoch) their pieces are, per row
    bestfit_stretches: Callable[[int, np.ndarray, np.ndarray], list[list[tuple[int, int]]]]


def next_segment(prev: Segment, row: int, seq_len: int, packing: str, geo: Geometry) -> Segment:
    """The segment that starts at dataset row `row` with `seq_len` and `packing`, after
    `prev`."""
    k, L = prev.index + 1, prev.seq_len
    j = row - prev.first_row
    if j < prev.carry_rows:  # still in prev's carry: the rest of it, then the same stream
        rest = prev.virtual(j * L, prev.carry_units)
        lo = np.array([a for a, _ in rest], dtype=np.int64)
        hi = np.array([b for _, b in rest], dtype=np.int64)
        start = prev.start
    elif prev.packing == BEST_FIT:
        lo, hi, start = _after_bestfit(prev, j - prev.carry_rows, geo)
    else:
        jr = j - prev.carry_rows  # prev's own rows read so far
        origin = prev.origin
        epoch = (origin + jr * L) // geo.units_per_epoch
        lay = geo.layout(epoch)
        w = int(np.searchsorted(lay.window_rows, jr, side="right")) - 1
        ws, we = int(lay.window_rows[w]), int(lay.window_rows[w + 1])
        # The rows of window w not served yet: their natural rows, in stream order, joined.
        natural = np.sort(ws + geo.window_perm(epoch, w)[jr - ws :])
        lo, hi = _stretches(origin + natural * L, L)
        start = origin + we * L
    if packing == BEST_FIT:
        lo, hi, start = _to_chunk_start(lo, hi, start, geo)
    return Segment(k, row, seq_len, lo, hi, start, packing)


def _after_bestfit(prev: Segment, jr: int, geo: Geometry) -> tuple[np.ndarray, np.ndarray, int]:
    """The carry and continuation after `jr` own rows of a best_fit segment: the pieces of the
    rows of the window being read that are not served yet, and the next window's first chunk."""
    U = geo.prev_units_per_epoch
    unit = geo.prev_origin + jr
    epoch = unit // U
    lay = geo.layout(epoch)
    w = int(np.searchsorted(lay.window_rows, jr, side="right")) - 1
    ws = int(lay.window_rows[w])
    natural = np.sort(ws + geo.window_perm(epoch, w)[jr - ws :])
    starts = order.locate_starts(geo.prev_origin + natural, U, geo.layout)
    concat = geo.concat_layout(epoch)
    base = epoch * geo.units_per_epoch
    pieces: list[tuple[int, int]] = []
    for c in dict.fromkeys(starts.chunk.tolist()):
        sel = starts.chunk == c
        p = int(starts.position[sel][0])
        at = base + int(concat.units_cum[p])
        for row in geo.bestfit_stretches(epoch, np.full(int(sel.sum()), c), starts.lo[sel]):
            pieces += [(at + a, at + b) for a, b in row]
    pieces.sort()
    lo, hi = _joined(pieces)
    n = len(lay.chunk_order)
    after = min((w + 1) * lay.window_chunks, n)
    return lo, hi, base + int(concat.units_cum[after])


def _to_chunk_start(
    lo: np.ndarray, hi: np.ndarray, start: int, geo: Geometry
) -> tuple[np.ndarray, np.ndarray, int]:
    """A carry that continues at `start`, moved on to the start of the next chunk: the units
    before it join the carry (a best_fit segment reads whole chunks past its carry)."""
    U = geo.units_per_epoch
    epoch, offset = divmod(start, U)
    cum = geo.concat_layout(epoch).units_cum
    p = int(np.searchsorted(cum, offset, side="left"))
    if int(cum[p]) == offset:
        return lo, hi, start
    end = epoch * U + int(cum[p])
    if len(hi) and int(hi[-1]) == start:
        hi = hi.copy()
        hi[-1] = end
        return lo, hi, end
    return np.append(lo, start).astype(np.int64), np.append(hi, end).astype(np.int64), end


def _joined(pieces: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint stretches joined where adjacent."""
    lo: list[int] = []
    hi: list[int] = []
    for a, b in pieces:
        if hi and hi[-1] == a:
            hi[-1] = b
        else:
            lo.append(a)
            hi.append(b)
    return np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)


def _stretches(starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted row starts, each `length` units long, joined where adjacent."""
    if not len(starts):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    breaks = np.nonzero(np.diff(starts) != length)[0]
    lo = np.concatenate(([starts[0]], starts[breaks + 1])).astype(np.int64)
    hi = np.concatenate((starts[breaks] + length, [starts[-1] + length])).astype(np.int64)
    return lo, hi
