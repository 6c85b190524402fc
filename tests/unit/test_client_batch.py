"""Micro-batches are views; varlen boundaries agree with segment ids; doc_lengths as OLMo-core's."""

from __future__ import annotations

import numpy as np
import pytest
from tokenfeed.client import microbatches, varlen


def _batch(rows=8, seq=16):
    ids = np.arange(rows * seq, dtype=np.int32).reshape(rows, seq)
    return {"input_ids": ids, "labels": ids + 1}


def test_microbatches_are_equal_views_that_cover_the_batch():
    batch = _batch()
    parts = microbatches(batch, 4)
    assert len(parts) == 4
    for name, arr in batch.items():
        assert all(np.shares_memory(p[name], arr) for p in parts), "no copies"
        assert np.array_equal(np.concatenate([p[name] for p in parts]), arr)
        assert {p[name].shape for p in parts} == {(2, 16)}


@pytest.mark.parametrize("count", [0, 3, 16])
def test_microbatches_refuse_uneven_splits(count):
    with pytest.raises(ValueError, match="micro-batches"):
        microbatches(_batch(), count)


def test_varlen_matches_position_and_segment_ids():
    # two rows of 6: docs of 2+4 tokens, then 6 (a continuation from the previous row)
    position = np.array([[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]], dtype=np.int32)
    cu, longest = varlen(position)
    assert cu.tolist() == [0, 2, 6, 12] and cu.dtype == np.int32
    assert longest == 6


def test_doc_lengths_give_each_rows_pieces_and_padding_as_one_piece():
    from tokenfeed.client.batch import doc_lengths
    from tokenfeed.client.wire import compact_from_starts

    tokens = np.arange(3 * 7, dtype=np.uint16).reshape(3, 7)  # seq_len 6
    starts = np.zeros((3, 7), dtype=bool)
    starts[0, [2, 5]] = True  # pieces of 2, 3 and 1 inputs
    starts[2, 3] = True  # 3 tokens, a document of 1, then padding
    padding = np.array([0, 0, 3])  # row 2: tokens in 4 of its 7 slots, inputs 4..5 padding
    c = compact_from_starts(tokens, starts, padding)
    lens, longest = doc_lengths(c)
    assert lens.dtype == np.int32
    assert lens.tolist() == [[2, 3, 1], [6, 0, 0], [3, 1, 2]]
    assert longest == [3, 6, 3]
    assert lens.sum(axis=1).tolist() == [6, 6, 6]
    # Without padding, as concat batches are: the padding piece is gone.
    lens, _ = doc_lengths(compact_from_starts(tokens, starts))
    assert lens.tolist() == [[2, 3, 1], [6, 0, 0], [3, 3, 0]]
