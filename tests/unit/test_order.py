"""Sample order: the keyed bijections and the epoch layout built on them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.sampling.bijection import ROUNDS, permutation, permute, round_keys
from tokenfeed.server.sampling.order import (
    document_order,
    epoch_layout,
    locate_units,
    natural_rows,
    window_order,
)

KEYS = round_keys("test", 0, "main", 0)

# Tiny domains (where the Feistel domain is much larger than n), exact powers of two (no cycle
# walking at all), one past a power of two (the most walking) and large odd sizes.
SIZES = [
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    15,
    16,
    17,
    100,
    255,
    256,
    257,
    1000,
    1023,
    1024,
    1025,
    4097,
    65536,
    65537,
    99_991,
    100_000,
]


def full(n: int, keys: tuple[int, ...] = KEYS) -> np.ndarray:
    return permute(np.arange(n), n, keys)


# -- permute ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_permute_is_a_bijection_with_an_inverse(n):
    y = full(n)
    assert y.dtype == np.int64
    assert np.array_equal(np.sort(y), np.arange(n))
    assert np.array_equal(permute(y, n, KEYS, inverse=True), np.arange(n))
    # The inverse is itself a bijection whose forward map undoes it.
    back = permute(np.arange(n), n, KEYS, inverse=True)
    assert np.array_equal(permute(back, n, KEYS), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 1000))
def test_permute_bijection_property(n, seed, epoch):
    keys = round_keys("chunks", seed, "ds", epoch)
    y = full(n, keys)
    assert np.array_equal(np.bincount(y, minlength=n), np.ones(n, dtype=np.int64))
    assert np.array_equal(permute(y, n, keys, inverse=True), np.arange(n))


@pytest.mark.parametrize("n", [2**33 + 5, 2**40 - 1, 2**62 + 3])
def test_permute_large_domains_stay_in_range_and_invert(n):
    # Positions far beyond the sizes a test can enumerate: the uint64 arithmetic must neither
    # overflow the half-width masks nor leave [0, n).
    x = np.array([0, 1, 2, n // 3, n // 2, n - 2, n - 1], dtype=np.int64)
    y = permute(x, n, KEYS)
    assert ((y >= 0) & (y < n)).all()
    assert len(set(y.tolist())) == len(x)
    assert np.array_equal(permute(y, n, KEYS, inverse=True), x)


@pytest.mark.parametrize("n", [10, 97, 1000, 65537])
def test_different_keys_give_different_permutations(n):
    perms = [full(n, round_keys("chunks", seed, "main", 0)) for seed in range(12)]
    perms += [full(n, round_keys("chunks", 0, "main", epoch)) for epoch in range(1, 12)]
    perms.append(full(n, round_keys("chunks", 0, "other", 0)))
    assert len({p.tobytes() for p in perms}) == len(perms)


def test_different_keys_agree_no_more_than_chance():
    # Two independent random permutations agree at about one position; a weak key schedule
    # (e.g. one that ignores most key bits) would agree on many.
    n = 10_000
    a = full(n, round_keys("chunks", 1, "main", 0))
    b = full(n, round_keys("chunks", 2, "main", 0))
    assert np.count_nonzero(a == b) < 20


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 100_000])
def test_scalar_and_array_calls_agree(n):
    y = full(n)
    for i in sorted({0, n // 2, n - 1, min(7, n - 1)}):
        for index in (i, np.int64(i)):
            got = permute(index, n, KEYS)
            assert type(got) is int
            assert got == y[i]
            assert permute(got, n, KEYS, inverse=True) == i
    # Any sub-array (any order, repeats) is the same function evaluated pointwise: random access.
    idx = np.array([n - 1, 0, n // 2, 0, n - 1])
    assert np.array_equal(permute(idx, n, KEYS), y[idx])


@pytest.mark.parametrize("n", [64, 100, 1000, 4096, 65537, 100_000])
def test_permute_is_not_an_arithmetic_progression(n):
    # An LCG-style map x -> a*x + c (mod n) has constant successive differences mod n.
    y = full(n)
    diffs = np.diff(y) % n
    assert np.unique(diffs).size > n // 10
    # Nor is it close to the identity or a rotation of it.
    assert np.count_nonzero(y == np.arange(n)) < n // 10
    assert np.count_nonzero(np.diff(y) == 1) < n // 10


def test_permute_is_deterministic_and_pinned():
    # Batches must be identical across processes and releases; these values pin the order.
    keys = round_keys("chunks", 0, "main", 0)
    assert len(keys) == ROUNDS
    assert all(0 <= k < 2**64 for k in keys)
    assert keys == round_keys("chunks", 0, "main", 0)
    assert full(10, keys).tolist() == [0, 7, 2, 8, 5, 3, 9, 4, 6, 1]
    assert full(10, round_keys("chunks", 0, "main", 1)).tolist() == [7, 1, 9, 4, 2, 6, 3, 0, 8, 5]
    assert np.array_equal(full(5000, keys), full(5000, keys))


def test_round_keys_separate_their_parts():
    # Joining parts without a separator would make ("a", "bc") and ("ab", "c") collide.
    assert round_keys("a", "bc") != round_keys("ab", "c")
    assert round_keys("rows", 0, "main", 0, 1) != round_keys("rows", 0, "main", 0, 2)
    assert round_keys("rows", 0, "main", 0) != round_keys("chunks", 0, "main", 0)


@given(n=st.integers(1, 5000), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 1000))
def test_the_whole_permutation_is_permute_of_every_index(n, seed, epoch):
    # permutation() walks cycles through a table of the Feistel network; permute() walks by
    # recomputing it: the same bijection (document, window and chunk orders use the first).
    keys = round_keys("docs", seed, "main", epoch)
    assert np.array_equal(permutation(n, keys), permute(np.arange(n), n, keys))


@pytest.mark.parametrize("n", SIZES)
def test_the_whole_permutation_of_each_size_is_pinned_by_permute(n):
    assert np.array_equal(permutation(n, KEYS), full(n))


@pytest.mark.parametrize("n", [0, -1])
def test_permutation_rejects_empty_domain(n):
    with pytest.raises(ValueError, match="non-empty"):
        permutation(n, KEYS)


@pytest.mark.parametrize("n", [0, -1])
def test_permute_rejects_empty_domain(n):
    with pytest.raises(ValueError, match="non-empty"):
        permute(0, n, KEYS)


@pytest.mark.parametrize("index", [-1, 10, [0, 10], [-1, 3]])
def test_permute_rejects_out_of_range_indices(index):
    with pytest.raises(ValueError, match="out of range"):
        permute(np.asarray(index) if isinstance(index, list) else index, 10, KEYS)


# -- epoch layout ----------------------------------------------------------------------------


# Rows of whole units (best_fit's rows: per_row = span = 1): row r of epoch e is unit r - e*U.


def layout_of(units, seed, dataset, epoch, window_chunks):
    units = np.asarray(units, dtype=np.int64)
    return epoch_layout(units, seed, dataset, epoch, window_chunks, 1, int(units.sum()))


def rows_of(layout) -> np.ndarray:
    return np.arange(layout.first_row, layout.end_row)


def locate_rows(layout, rows, window_perm=None):
    """(chunk, row within chunk) of each served row of the layout's epoch."""
    natural = natural_rows(layout, rows, window_perm)
    pieces = locate_units(natural, 1, layout.units, lambda e: layout)
    assert np.array_equal(pieces.row, np.arange(len(rows)))  # one unit, one piece
    return pieces.chunk, pieces.lo


def window_of_rows(layout) -> np.ndarray:
    """Window index of every epoch row, from the layout's prefix sums alone."""
    sizes = np.diff(layout.window_rows)
    return np.repeat(np.arange(len(sizes)), sizes)


@settings(max_examples=80, deadline=None)
@given(
    rows_per_chunk=st.lists(st.integers(0, 12), min_size=1, max_size=40),
    window_chunks=st.integers(1, 9),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 50),
)
def test_every_row_of_an_epoch_maps_to_a_distinct_chunk_row(
    rows_per_chunk, window_chunks, seed, epoch
):
    rpc = np.array(rows_per_chunk, dtype=np.int64)
    layout = layout_of(rpc, seed, "ds", epoch, window_chunks)
    n = len(rpc)
    assert sorted(layout.chunk_order.tolist()) == list(range(n))
    assert layout.end_row - layout.first_row == rpc.sum()

    chunks, within = locate_rows(layout, rows_of(layout))
    # A cached, materialised window permutation must give exactly the direct computation.
    cached = locate_rows(layout, rows_of(layout), lambda w: window_order(layout, w))
    assert np.array_equal(cached[0], chunks) and np.array_equal(cached[1], within)
    pairs = list(zip(chunks.tolist(), within.tolist(), strict=True))
    expected = {(c, r) for c in range(n) for r in range(rpc[c])}
    assert len(set(pairs)) == len(pairs)
    assert set(pairs) == expected

    # A window reads only its own chunks: I/O for window w never touches another window's.
    windows = window_of_rows(layout)
    for w in np.unique(windows):
        allowed = set(layout.chunk_order[w * window_chunks : (w + 1) * window_chunks].tolist())
        assert set(chunks[windows == w].tolist()) <= allowed


def test_zero_row_chunks_and_empty_windows_are_skipped():
    # Whole windows of empty chunks produce repeated prefix sums; rows must not land in them.
    rpc = np.array([0, 0, 5, 0, 0, 0, 3, 0, 0, 7, 0, 0])
    for window_chunks in (1, 2, 3, 5):
        layout = layout_of(rpc, 3, "ds", 0, window_chunks)
        chunks, within = locate_rows(layout, rows_of(layout))
        assert set(chunks.tolist()) == {2, 6, 9}
        assert (within < rpc[chunks]).all()
        assert len(set(zip(chunks.tolist(), within.tolist(), strict=True))) == 15


def test_window_order_is_the_permutation_of_each_window():
    rpc = np.random.default_rng(3).integers(1, 30, size=20)
    layout = layout_of(rpc, 5, "ds", 1, 6)
    sizes = np.diff(layout.window_rows)
    for w, size in enumerate(sizes.tolist()):
        perm = window_order(layout, w)
        assert sorted(perm.tolist()) == list(range(size))
    # Windows are keyed separately: equal-sized windows are not shuffled alike.
    even = layout_of(np.full(20, 10), 5, "ds", 1, 5)
    perms = {window_order(even, w).tobytes() for w in range(4)}
    assert len(perms) == 4


def test_window_order_of_an_empty_window_is_empty():
    # Chunks may pack to zero rows, so a whole window can be empty; asking for its order (a
    # prefetcher walking the windows would) should not raise.
    # One non-empty chunk among seven, windows of two: whatever the order, windows are empty.
    layout = layout_of(np.array([0, 0, 0, 0, 0, 0, 4]), 0, "ds", 0, 2)
    empty = [w for w in range(4) if layout.window_rows[w + 1] == layout.window_rows[w]]
    assert len(empty) == 3
    assert window_order(layout, empty[0]).shape == (0,)


def test_rows_within_a_window_are_shuffled():
    # One window of many chunks: the second bijection must mix rows across chunks, not serve
    # each chunk's rows back to back.
    rpc = np.full(16, 50)
    layout = layout_of(rpc, 0, "ds", 0, window_chunks=16)
    chunks, within = locate_rows(layout, rows_of(layout))
    first = chunks[:50]
    assert len(set(first.tolist())) > 8
    assert not np.array_equal(within, np.sort(within))


def test_locate_rows_is_random_access():
    # Any subset of rows, in any order, maps exactly as in the full epoch (no hidden state).
    rpc = np.random.default_rng(0).integers(0, 20, size=60)
    layout = layout_of(rpc, 9, "ds", 2, 4)
    chunks, within = locate_rows(layout, rows_of(layout))
    pick = layout.first_row + np.random.default_rng(1).permutation(len(rows_of(layout)))[:100]
    c2, w2 = locate_rows(layout_of(rpc, 9, "ds", 2, 4), pick)
    assert np.array_equal(c2, chunks[pick - layout.first_row])
    assert np.array_equal(w2, within[pick - layout.first_row])


def test_different_epochs_give_different_orders():
    rpc = np.full(50, 10)
    seqs = []
    for epoch in range(4):
        layout = layout_of(rpc, 0, "ds", epoch, 5)
        chunks, within = locate_rows(layout, rows_of(layout))
        seqs.append((layout.chunk_order.tobytes(), chunks.tobytes() + within.tobytes()))
    assert len({chunk_order for chunk_order, _ in seqs}) == 4
    assert len({rows for _, rows in seqs}) == 4
    # The dataset name keys the order too: two datasets with one seed do not march in step.
    other = layout_of(rpc, 0, "other", 0, 5)
    assert not np.array_equal(other.chunk_order, layout_of(rpc, 0, "ds", 0, 5).chunk_order)


@pytest.mark.parametrize("rows", [[-1], [100], [0, 100]])
def test_locate_rows_rejects_rows_outside_the_epoch(rows):
    layout = layout_of(np.full(10, 10), 0, "ds", 0, 3)
    with pytest.raises(ValueError, match="out of range"):
        locate_rows(layout, np.array(rows))


# -- document order --------------------------------------------------------------------------


def test_document_order_is_a_keyed_permutation():
    assert document_order(0, 0, "ds", 0, 0).shape == (0,)
    assert document_order(1, 0, "ds", 0, 0).tolist() == [0]
    base = document_order(500, 0, "ds", 0, 7)
    assert sorted(base.tolist()) == list(range(500))
    assert np.array_equal(base, document_order(500, 0, "ds", 0, 7))
    # Each chunk and each epoch reshuffles its documents.
    assert not np.array_equal(base, document_order(500, 0, "ds", 0, 8))
    assert not np.array_equal(base, document_order(500, 0, "ds", 1, 7))
    assert not np.array_equal(base, document_order(500, 1, "ds", 0, 7))


@settings(max_examples=60, deadline=None)
@given(
    units=st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda u: sum(u) > 0),
    start=st.integers(0, 400),
    span=st.integers(1, 200),
)
def test_one_stretch_is_located_as_among_others(units, start, span):
    """A lone stretch (a row buffer's tail) takes the int path; its pieces are those the array
    path gives the same stretch beside another, across chunks, empty chunks and epochs."""
    total = sum(units)
    layouts: dict[int, object] = {}

    def layout(e: int):
        return layouts.setdefault(e, layout_of(units, 7, "main", e, 3))

    start %= 4 * total
    alone = locate_units(np.array([start]), span, total, layout)
    both = locate_units(np.array([start, 0]), span, total, layout)
    mine = both.row == 0
    for name in ("row", "epoch", "chunk", "lo", "hi", "at"):
        got, want = getattr(alone, name), getattr(both, name)[mine]
        assert got.dtype == np.int64
        assert got.tolist() == want.tolist(), name
    assert int((alone.hi - alone.lo).sum()) == span
