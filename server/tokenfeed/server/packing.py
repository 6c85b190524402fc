"""Packing: pure functions from a chunk's documents to fixed-length rows. No I/O.

`concat` (docs/batch-format.md): the chunk's documents, in the epoch's document order, are laid
end to end as `[BOS] tokens EOS` segments to form one stream of T tokens. Row r is the window
stream[r*L : r*L + L + 1]: inputs are its first L tokens, labels its last L. Rows overlap by one
token, so every token of the stream is an input exactly once; a chunk yields (T - 1) // L rows
and the last (T - 1) % L + 1 tokens are the chunk's dropped remainder.

Per row we also emit position ids (0 at the row start and at every document start) and segment
ids (1 for the first document piece in the row, 2 for the next, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TENSOR_NAMES = ("input_ids", "labels", "position_ids", "segment_ids")


def concat_rows(num_tokens: int, num_docs: int, seq_len: int, add_bos: bool) -> int:
    """Rows a chunk yields under concat packing, from its index entry alone."""
    total = num_tokens + num_docs * (2 if add_bos else 1)
    return max(0, (total - 1) // seq_len)


@dataclass(frozen=True)
class ChunkStream:
    """A chunk's documents in one epoch's order, as segments of one token stream."""

    doc_starts: np.ndarray  # int64 [D]: offset of each permuted document's tokens in the chunk
    seg_starts: np.ndarray  # int64 [D+1]: stream offset where each segment starts; last = T
    bos: int  # 1 if each segment opens with BOS, else 0

    @property
    def total(self) -> int:
        return int(self.seg_starts[-1])


def concat_stream(
    doc_offsets: np.ndarray, doc_lengths: np.ndarray, order: np.ndarray, add_bos: bool
) -> ChunkStream:
    bos = 1 if add_bos else 0
    seg = np.asarray(doc_lengths, dtype=np.int64)[order] + (1 + bos)
    seg_starts = np.zeros(len(seg) + 1, dtype=np.int64)
    np.cumsum(seg, out=seg_starts[1:])
    return ChunkStream(np.asarray(doc_offsets, dtype=np.int64)[order], seg_starts, bos)


def concat_rows_at(
    stream: ChunkStream, tokens: np.ndarray, rows: np.ndarray, seq_len: int, bos_id: int,
    eos_id: int,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Rows `rows` of the stream: input_ids, labels, position_ids, segment_ids, each int32
    of shape [len(rows), seq_len]. Vectorised over all the rows at once."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 1)
    starts = rows * seq_len
    pos = starts + np.arange(seq_len + 1, dtype=np.int64)
    if pos.size and pos.max() >= stream.total:
        raise IndexError(f"rows {rows.ravel().tolist()} exceed the stream of {stream.total}")
    seg = np.searchsorted(stream.seg_starts, pos, side="right") - 1
    seg_start = stream.seg_starts[seg]
    offset = pos - seg_start  # offset within [BOS] tokens EOS
    is_eos = offset == stream.seg_starts[seg + 1] - seg_start - 1
    is_bos = (offset == 0) & (stream.bos == 1)
    body = ~(is_eos | is_bos)
    ids = np.empty(pos.shape, dtype=np.int32)
    ids[is_eos] = eos_id
    ids[is_bos] = bos_id
    ids[body] = tokens[stream.doc_starts[seg[body]] + offset[body] - stream.bos]

    inputs = seg[:, :seq_len]
    position = pos[:, :seq_len] - np.maximum(seg_start[:, :seq_len], starts)
    return {
        "input_ids": ids[:, :seq_len],
        "labels": ids[:, 1:],
        "position_ids": position.astype(np.int32),
        "segment_ids": (inputs - inputs[:, :1] + 1).astype(np.int32),
    }
