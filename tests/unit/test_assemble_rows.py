"""rowlayout.assemble_rows against a row-by-row reference: rows cut from several row buffers
(several parts, datasets and epochs, shuffled places, repeated rows, buffers without starts),
each row a slice of its buffer and its starts those strictly inside its inputs; and a batch with
a place left out, filled twice, or a row past its buffer's end, refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.pack import rowlayout
from tokenfeed.server.sampling.order import RowStarts


def reference(rows, seq_len, parts, buffer, dtype):
    """Each row sliced on its own, its starts found by a Python scan."""
    ids = np.zeros((rows, seq_len + 1), dtype=dtype)
    starts: list[list[int]] = [[] for _ in range(rows)]
    for dataset, slots, where in parts:
        cols = (where.epoch, where.chunk, where.position, where.lo, slots)
        for e, c, p, lo, slot in zip(*(np.asarray(a).tolist() for a in cols), strict=True):
            buf = buffer(dataset, e, c, p)
            ids[slot] = buf.ids[lo : lo + seq_len + 1]
            starts[slot] = [s - lo for s in buf.starts.tolist() if lo < s < lo + seq_len]
    splits = np.cumsum([0] + [len(s) for s in starts]).astype(np.int32)
    return ids, np.array([s for row in starts for s in row], dtype=np.int64), splits


@st.composite
def batches(draw):
    seq_len = draw(st.integers(1, 40))
    span = seq_len + 1
    store: dict[tuple, rowlayout.RowBuffer] = {}
    parts, rows = [], 0
    for dataset in range(draw(st.integers(1, 3))):
        keys = draw(
            st.lists(
                st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 5)),
                min_size=1,
                max_size=5,
                unique=True,
            )
        )
        for e, c, p in keys:
            n = draw(st.integers(span, span + 120))
            ids = np.arange(n, dtype=np.int32) + 1000 * len(store)
            found = draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
            store[(dataset, e, c, p)] = rowlayout.RowBuffer(ids, np.array(sorted(found), np.int64))
        k = draw(st.integers(0, 12))
        picks = draw(st.lists(st.sampled_from(keys), min_size=k, max_size=k))
        lo = [draw(st.integers(0, len(store[(dataset, *key)].ids) - span)) for key in picks]
        cols = [np.array(col, dtype=np.int64).reshape(-1) for col in zip(*picks, strict=True)]
        if not picks:
            cols = [np.zeros(0, dtype=np.int64)] * 3
        parts.append((dataset, cols, np.array(lo, dtype=np.int64), rows))
        rows += k
    if not rows:
        return None
    places = np.array(draw(st.permutations(range(rows))), dtype=np.int64)
    out = [
        (d, places[at : at + len(lo)], RowStarts(cols[0], cols[2], cols[1], lo))
        for d, cols, lo, at in parts
    ]
    return rows, seq_len, out, store


@settings(max_examples=300, deadline=None)
@given(batches(), st.sampled_from([np.int32, np.uint16]))
def test_rows_equal_the_row_by_row_reference(batch, dtype):
    if batch is None:
        return
    rows, seq_len, parts, store = batch
    store = {k: rowlayout.RowBuffer(b.ids.astype(dtype), b.starts) for k, b in store.items()}
    calls: list[tuple] = []

    def buffer(dataset, e, c, p):
        calls.append((dataset, e, c, p))
        return store[(dataset, e, c, p)]

    got = rowlayout.assemble_rows(rows, seq_len, parts, buffer, dtype)
    want = reference(rows, seq_len, parts, lambda *k: store[k], dtype)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    assert got[1].dtype == np.int64 and got[2].dtype == np.int32
    assert len(calls) == len(set(calls))  # each buffer of a part fetched once


def _one(lo, slots, n=50, seq_len=8):
    buf = rowlayout.RowBuffer(np.arange(n, dtype=np.int32), np.array([0, 5, 20], np.int64))
    lo = np.asarray(lo, dtype=np.int64)
    zeros = np.zeros_like(lo)
    starts = RowStarts(zeros, zeros, zeros, lo)
    return lambda rows: rowlayout.assemble_rows(
        rows, seq_len, [(0, np.asarray(slots), starts)], lambda *k: buf, np.int32
    )


def test_a_place_left_out_or_filled_twice_is_refused():
    with pytest.raises(ValueError, match="places"):
        _one([0, 3], [0, 2])(3)  # place 1 left out
    with pytest.raises(ValueError, match="places"):
        _one([0, 3, 4], [0, 0, 1])(3)  # place 0 twice, place 2 never
    with pytest.raises(ValueError, match="places"):
        _one([0, 3], [0, 1])(3)  # too few rows


def test_a_row_outside_its_buffer_is_refused():
    _one([41], [0])(1)  # the last row that fits
    with pytest.raises(ValueError):
        _one([42], [0])(1)
    with pytest.raises(ValueError):
        _one([-1], [0])(1)
