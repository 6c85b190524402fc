"""A dataset's rows when a phase changes the sequence length (concat packing). Pure.

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from tokenfeed.server.sampling import order


@dataclass(frozen=True)
class Segment:
    index: int  # k: 0 for the dataset's first
    first_row: int  # the dataset row it starts at
    seq_len: int  # its rows: units [s, s + L + 1) every L
    carry_lo: npt.NDArray[np.int64]  # stretches of stream units it reads first, in order
    carry_hi: npt.NDArray[np.int64]
    start: int  # the stream unit it continues from after its carry

    @property
    def grid(self) -> str:
        """What keys its windows' row permutations apart from other segments' ("" for 0)."""
        return f"seq_len={self.seq_len}@{self.first_row}" if self.index else ""

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
        """The stream unit where its first row past the carry starts."""
        return self.start + self.carry_rows * self.seq_len - self.carry_units

    def virtual(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The stream stretches that positions [lo, hi) of the segment's own sequence (its
        carry, then the stream from `start`) are made of, in order."""
        cum = np.concatenate(([0], np.cumsum(self.carry_hi - self.carry_lo)))
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


def first_segment(seq_len: int) -> Segment:
    empty = np.zeros(0, dtype=np.int64)
    return Segment(0, 0, seq_len, empty, empty, 0)


def next_segment(
    prev: Segment,
    row: int,
    seq_len: int,
    units_per_epoch: int,
    layout: Callable[[int], order.EpochLayout],
    window_perm: Callable[[int, int], np.ndarray],
) -> Segment:
    """The segment that starts at dataset row `row` with `seq_len`, after `prev`.
    `layout(epoch)` is the epoch's layout in prev's grid, `window_perm(epoch, w)` its window
    w's row order (both cached by the caller)."""
    k, L = prev.index + 1, prev.seq_len
    j = row - prev.first_row
    if j < prev.carry_rows:  # still in prev's carry: the rest of it, then the same stream
        rest = prev.virtual(j * L, prev.carry_units)
        lo = np.array([a for a, _ in rest], dtype=np.int64)
        hi = np.array([b for _, b in rest], dtype=np.int64)
        return Segment(k, row, seq_len, lo, hi, prev.start)
    jr = j - prev.carry_rows  # prev's own rows read so far
    origin = prev.origin
    epoch = (origin + jr * L) // units_per_epoch
    lay = layout(epoch)
    w = int(np.searchsorted(lay.window_rows, jr, side="right")) - 1
    ws, we = int(lay.window_rows[w]), int(lay.window_rows[w + 1])
    # The rows of window w not served yet: their natural rows, in stream order, joined.
    natural = np.sort(ws + window_perm(epoch, w)[jr - ws :])
    lo, hi = _stretches(origin + natural * L, L)
    return Segment(k, row, seq_len, lo, hi, origin + we * L)


def _stretches(starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted row starts, each `length` units long, joined where adjacent."""
    if not len(starts):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    breaks = np.nonzero(np.diff(starts) != length)[0]
    lo = np.concatenate(([starts[0]], starts[breaks + 1])).astype(np.int64)
    hi = np.concatenate((starts[breaks] + length, [starts[-1] + length])).astype(np.int64)
    return lo, hi
