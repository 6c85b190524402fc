"""gather.row_starts: the document starts inside rows cut from buffers, in C (GIL kept) and in
its numpy twin, against a row-by-row reference."""

from __future__ import annotations

import numpy as np
import pytest
from gilcheck import lets_others_run
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.pack import gather as g


def _reference(starts, which, lo, seq_len):
    """Row by row: the starts s with lo < s < lo + seq_len, as s - lo."""
    found, splits = [], [0]
    for k, a in zip(which, lo, strict=True):
        inside = [s - a for s in starts[k] if a < s < a + seq_len]
        found += inside
        splits.append(splits[-1] + len(inside))
    return found, splits


def _native_and_twin(starts, which, lo, seq_len):
    arrays = [np.array(s, dtype=np.int64) for s in starts]
    k, at = np.array(which, dtype=np.int64), np.array(lo, dtype=np.int64)
    twin = g._row_starts_numpy(arrays, k, at, seq_len)
    return g.row_starts(arrays, k, at, seq_len), twin


@settings(max_examples=120, deadline=None)
@given(data=st.data(), seq_len=st.integers(1, 12))
def test_c_twin_and_reference_agree(data, seq_len):
    sizes = data.draw(st.lists(st.integers(1, 60), min_size=1, max_size=4))
    starts = [sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n))) for n in sizes]
    rows = data.draw(st.integers(0, 10))
    which = [data.draw(st.integers(0, len(sizes) - 1)) for _ in range(rows)]
    lo = [data.draw(st.integers(0, max(sizes[k] - 1, 0))) for k in which]
    want_starts, want_splits = _reference(starts, which, lo, seq_len)
    for got_starts, got_splits in _native_and_twin(starts, which, lo, seq_len):
        assert got_starts.dtype == np.int64 and got_splits.dtype == np.int32
        assert got_starts.tolist() == want_starts
        assert got_splits.tolist() == want_splits


def test_a_known_case():
    # Buffer 0 has documents starting at 0, 3, 7 and 12; buffer 1 at 2 and 5.
    starts = [[0, 3, 7, 12], [2, 5]]
    (native, splits), (twin, twin_splits) = _native_and_twin(starts, [0, 1, 0], [2, 0, 7], 6)
    # Row 0: [2, 8] holds 3 and 7 -> 1, 5; row 1: [0, 6] holds 2, 5; row 2: [7, 13] holds 12
    # (5 positions in; 7 is the row's own first position, not a start inside it).
    assert native.tolist() == twin.tolist() == [1, 5, 2, 5, 5]
    assert splits.tolist() == twin_splits.tolist() == [0, 2, 4, 5]


@pytest.mark.parametrize(
    ("which", "lo", "message"),
    [([2], [0], "outside"), ([0, 0], [0], "differ in length")],
)
def test_bad_rows_are_refused(which, lo, message):
    with pytest.raises(ValueError, match=message):
        g.row_starts([np.array([0, 4])], np.array(which), np.array(lo), 8)


def test_the_c_search_keeps_the_gil():
    """A thread waiting for the GIL never runs inside the call (forced switches off)."""
    if not g.NATIVE:
        pytest.skip("the numpy twin is what runs")
    starts = [np.arange(0, 4 << 20, 3, dtype=np.int64)]
    rows = 200_000
    which = np.zeros(rows, dtype=np.int64)
    lo = np.arange(rows, dtype=np.int64) * 17
    found: list = []
    assert not lets_others_run(lambda: found.extend(g.row_starts(starts, which, lo, 64)))
    positions, splits = found
    assert int(splits[-1]) == len(positions) > 0
