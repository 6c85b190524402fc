"""Concat packing: rows cut from one stream of `[BOS] tokens EOS` segments (here one chunk's
stream on its own; tests/unit/test_stream_rows.py covers rows that run across chunks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.pack import packing, rowlayout
from tokenfeed.server.pack.packing import TENSOR_NAMES, concat_rows_at, concat_stream, concat_units

BOS, EOS = 1, 2


def concat_rows(tokens: int, docs: int, seq_len: int, add_bos: bool) -> int:
    """Rows whose L + 1 tokens lie inside a stream of this chunk alone."""
    return max(0, (concat_units(tokens, docs, add_bos) - 1) // seq_len)


def make_chunk(lengths: list[int], dtype=np.int32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, doc offsets, doc lengths) of a chunk whose token ids are all distinct.

    Distinct ids (>= 10, never BOS or EOS) make any misplaced or repeated token visible.
    """
    lengths_arr = np.array(lengths, dtype=np.int32)
    tokens = np.arange(10, 10 + int(lengths_arr.sum()), dtype=dtype)
    offsets = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        offsets[1:] = np.cumsum(lengths_arr[:-1])
    return tokens, offsets, lengths_arr


def reference(tokens, offsets, lengths, order, add_bos):
    """The stream built naively, with each position's segment index and offset in its segment."""
    stream, segment, offset = [], [], []
    for k, d in enumerate(order):
        doc = tokens[offsets[d] : offsets[d] + lengths[d]].tolist()
        seg = ([BOS] if add_bos else []) + doc + [EOS]
        stream += seg
        segment += [k] * len(seg)
        offset += range(len(seg))
    return np.array(stream, dtype=np.int64), np.array(segment), np.array(offset)


def all_rows(tokens, offsets, lengths, order, seq_len, add_bos):
    stream = concat_stream(offsets, lengths, order, add_bos)
    n = concat_rows(int(lengths.sum()), len(lengths), seq_len, add_bos)
    return stream, concat_rows_at(stream, tokens, np.arange(n), seq_len, BOS, EOS)


def check_rows(lengths, order, seq_len, add_bos, dtype=np.int32) -> list[dict[str, np.ndarray]]:
    """Check every row of the chunk against the naive stream; return the rows one by one."""
    tokens, offsets, lens = make_chunk(lengths, dtype)
    stream, out = all_rows(tokens, offsets, lens, order, seq_len, add_bos)
    ref, segment, offset = reference(tokens, offsets, lens, order, add_bos)
    n = concat_rows(int(lens.sum()), len(lens), seq_len, add_bos)

    # Row count: every token is an input once, plus one token of lookahead for the last label.
    assert stream.total == len(ref)
    assert n == max(0, (len(ref) - 1) // seq_len)
    # concat_rows is exactly the number of rows the stream can produce.
    for past_the_end in ([n], [0, n], [n + 5]):
        with pytest.raises(IndexError):
            concat_rows_at(stream, tokens, np.array(past_the_end), seq_len, BOS, EOS)

    assert tuple(out) == TENSOR_NAMES
    for name in TENSOR_NAMES:
        assert out[name].dtype == np.int32 and out[name].shape == (n, seq_len), name
    rows = [{name: out[name][r] for name in TENSOR_NAMES} for r in range(n)]
    for r, row in enumerate(rows):
        window = slice(r * seq_len, r * seq_len + seq_len)
        # Labels are the inputs shifted by one, across row boundaries too.
        assert np.array_equal(row["labels"], ref[r * seq_len + 1 : r * seq_len + seq_len + 1])
        assert np.array_equal(row["labels"][:-1], row["input_ids"][1:])
        # Positions restart at the row start and at every segment start.
        assert np.array_equal(row["position_ids"], np.minimum(offset[window], np.arange(seq_len)))
        # Segments are numbered from 1 within each row.
        assert np.array_equal(row["segment_ids"], segment[window] - segment[r * seq_len] + 1)

    # Conservation: the inputs of all rows, end to end, are exactly the stream's prefix.
    assert np.array_equal(out["input_ids"].reshape(-1), ref[: n * seq_len])

    # Random access: any rows, in any order, with repeats, are the same rows.
    if n:
        pick = np.array([n - 1, 0, n // 2, n - 1, 0])
        some = concat_rows_at(stream, tokens, pick, seq_len, BOS, EOS)
        for name in TENSOR_NAMES:
            assert np.array_equal(some[name], out[name][pick]), name
    return rows


def test_worked_example_without_bos():
    # Stream: 10 11 12 E 20 21 E  (docs [10 11 12] and [13 14], ids renumbered by make_chunk)
    rows = check_rows([3, 2], [0, 1], seq_len=3, add_bos=False)
    assert [r["input_ids"].tolist() for r in rows] == [[10, 11, 12], [EOS, 13, 14]]
    assert [r["labels"].tolist() for r in rows] == [[11, 12, EOS], [13, 14, EOS]]
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2], [0, 0, 1]]
    assert [r["segment_ids"].tolist() for r in rows] == [[1, 1, 1], [1, 2, 2]]


def test_worked_example_with_bos():
    # Stream: B 10 11 12 E B 13 14 E  -> (9 - 1) // 4 = 2 rows
    rows = check_rows([3, 2], [0, 1], seq_len=4, add_bos=True)
    assert [r["input_ids"].tolist() for r in rows] == [[BOS, 10, 11, 12], [EOS, BOS, 13, 14]]
    assert [r["labels"].tolist() for r in rows] == [[10, 11, 12, EOS], [BOS, 13, 14, EOS]]
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 3], [0, 0, 1, 2]]
    assert [r["segment_ids"].tolist() for r in rows] == [[1, 1, 1, 1], [1, 2, 2, 2]]


def test_document_order_is_applied():
    rows = check_rows([2, 1, 3], [2, 0, 1], seq_len=8, add_bos=False)
    # Doc 2 (ids 13 14 15) first, then doc 0 (10 11), then doc 1 (12).
    assert rows[0]["input_ids"].tolist() == [13, 14, 15, EOS, 10, 11, EOS, 12]
    assert rows[0]["labels"].tolist()[-1] == EOS


def test_long_document_spans_rows_with_positions_restarting():
    rows = check_rows([10], [0], seq_len=4, add_bos=True)
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert all(r["segment_ids"].tolist() == [1, 1, 1, 1] for r in rows)


@pytest.mark.parametrize(
    ("tokens", "docs", "seq_len", "add_bos", "rows"),
    [
        (0, 0, 4, False, 0),  # empty chunk
        (0, 0, 4, True, 0),
        (3, 1, 4, False, 0),  # 4 stream tokens: one short of a row plus its last label
        (4, 1, 4, False, 1),  # 5 stream tokens: exactly one row
        (3, 1, 4, True, 1),  # BOS counts toward the stream
        (8, 1, 4, False, 2),
        (100, 10, 1, False, 109),
        (100, 10, 7, True, 17),  # (100 + 20 - 1) // 7
    ],
)
def test_concat_rows_from_index_entry(tokens, docs, seq_len, add_bos, rows):
    assert concat_rows(tokens, docs, seq_len, add_bos) == rows


def test_uint16_tokens_and_empty_documents():
    # Token stores keep small vocabularies as uint16; a document may tokenize to nothing.
    check_rows([0, 5, 0, 0, 3], [4, 0, 3, 1, 2], seq_len=3, add_bos=True, dtype=np.uint16)
    check_rows([0, 5, 0, 0, 3], [4, 0, 3, 1, 2], seq_len=2, add_bos=False, dtype=np.uint16)


def test_no_rows_requested():
    tokens, offsets, lens = make_chunk([3, 4])
    stream = concat_stream(offsets, lens, np.arange(2), add_bos=False)
    out = concat_rows_at(stream, tokens, np.zeros(0, dtype=np.int64), 3, BOS, EOS)
    assert all(out[name].shape == (0, 3) for name in TENSOR_NAMES)


def test_chunk_of_only_empty_documents():
    # Two documents of zero tokens still make the stream `EOS EOS`, and concat_rows counts the
    # row it holds at seq_len 1; the row must be producible, not an IndexError.
    assert concat_rows(0, 2, 1, add_bos=False) == 1
    check_rows([0, 0], [0, 1], seq_len=1, add_bos=False)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    # Chunks with at least one token: the all-empty chunk is the known failure above.
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=12).filter(
        lambda ls: not ls or any(ls)
    ),
    seq_len=st.integers(1, 24),
    add_bos=st.booleans(),
)
def test_concat_contract(data, lengths, seq_len, add_bos):
    order = data.draw(st.permutations(range(len(lengths))))
    check_rows(lengths, np.array(order, dtype=np.int64), seq_len, add_bos)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=40),
    add_bos=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_stream_laid_out_by_slices_equals_the_gather(lengths, add_bos, seed):
    # lay_out copies a document at a time where documents are long enough on average and
    # gathers token by token (fill_concat) otherwise: both must give the same ids and starts.

    tokens, offsets, lens = make_chunk(lengths, dtype=np.uint16)
    doc_order = np.random.default_rng(seed).permutation(len(lengths))
    stream = concat_stream(offsets, lens, doc_order, add_bos)
    want = np.full(stream.total, 9999, dtype=np.uint16)
    one = np.ones(1, dtype=np.int64)
    want_starts = packing.fill_concat(
        stream, tokens, 0 * one, stream.total * one, 0 * one, BOS, EOS, want
    )
    for mean in (0, 10**9):  # every chunk by slices, then every chunk by the gather
        rowlayout.SLICE_MEAN_TOKENS, was = mean, rowlayout.SLICE_MEAN_TOKENS
        try:
            got = np.full(stream.total, 7777, dtype=np.uint16)
            starts = rowlayout.lay_out(stream, tokens, got, BOS, EOS)
        finally:
            rowlayout.SLICE_MEAN_TOKENS = was
        assert np.array_equal(got, want)
        assert np.array_equal(starts, want_starts)
    # A row buffer (the stream, then tail pieces) joined from slices or laid out by the gather.
    tail = [
        rowlayout.RowBuffer(np.arange(5, dtype=np.uint16) + 500, np.array([0, 3], dtype=np.int64)),
        rowlayout.RowBuffer(np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.int64)),
    ]
    buffers = []
    for mean in (0, 10**9):
        rowlayout.SLICE_MEAN_TOKENS, was = mean, rowlayout.SLICE_MEAN_TOKENS
        try:
            buffers.append(rowlayout.row_buffer(stream, tokens, tail, BOS, EOS, np.uint16))
        finally:
            rowlayout.SLICE_MEAN_TOKENS = was
    joined, gathered = buffers
    assert np.array_equal(joined.ids, gathered.ids)
    assert np.array_equal(joined.ids[: stream.total], want)
    assert np.array_equal(joined.ids[stream.total :], tail[0].ids)
    assert np.array_equal(joined.starts, gathered.starts)
    assert np.array_equal(
        joined.starts, np.concatenate([want_starts, [stream.total, stream.total + 3]])
    )
