"""Serving while building: epoch 0's chunk order, how far along it the chunks are built, and the
epoch-0 rows of the leading windows whose units are all built (those rows can be served before
the rest of the dataset exists). Pure bookkeeping over a dataset's counts."""

from __future__ import annotations

import numpy as np
from tokenfeed.server.sampling import bijection


def epoch0_order(n: int, seed: int, dataset: str) -> np.ndarray:
    """Epoch 0's chunk order of a dataset of `n` chunks: the order its chunks are built in."""
    return bijection.permute(np.arange(n), n, bijection.round_keys("chunks", seed, dataset, 0))


class BuiltRows:
    """The built prefix of epoch 0's order and the rows it makes servable. Rows are cut from
    the dataset's stream of units (order.py): row r is units [r*per_row, r*per_row + span)."""

    def __init__(self, window: int, per_row: int, span: int, order0: np.ndarray | None = None):
        self.window, self.per_row, self.span = window, per_row, span
        self.order0 = np.zeros(0, dtype=np.int64) if order0 is None else order0
        self.position0 = np.empty(len(self.order0), dtype=np.int64)  # its inverse
        self.position0[self.order0] = np.arange(len(self.order0))
        self.positions = 0  # leading positions of that order whose chunks are built
        self.windows = 0  # leading windows whose rows can all be served
        self.rows = 0  # rows of those windows: epoch-0 rows [0, rows) are known
        self._units = 0  # units of the first `positions` positions
        self._window_ends: list[int] = []  # units before each window boundary built so far

    def advance(self, num_docs: np.ndarray, units_per_chunk: np.ndarray) -> bool:
        """Move the built prefix past every chunk built so far (its documents counted: not -1),
        and the servable rows past every window whose rows read only built units. True when
        the servable rows grew."""
        n, window, before = len(self.order0), self.window, self.rows
        while self.positions < n and num_docs[self.order0[self.positions]] >= 0:
            self._units += int(units_per_chunk[self.order0[self.positions]])
            self.positions += 1
            if self.positions % window == 0 and self.positions < n:
                self._window_ends.append(self._units)
        # A window's rows are servable once the units its last row reads are built; the last
        # window's last row reads on into epoch 1, which waits for the whole epoch (READY).
        while self.windows < len(self._window_ends):
            end_row = -(-self._window_ends[self.windows] // self.per_row)
            if (end_row - 1) * self.per_row + self.span > self._units:
                break
            self.windows += 1
            self.rows = max(end_row, 0)
        return self.rows != before
