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

TENSOR_NAMES = ("input_ids", "labels", "position_ids", "segment_ids", "loss_mask")


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
    doc_ids: np.ndarray  # int64 [D]: the chunk's document index behind each segment

    @property
    def total(self) -> int:
        return int(self.seg_starts[-1])

    @property
    def eos_at(self) -> np.ndarray:
        """Stream position of each segment's EOS."""
        return self.seg_starts[1:] - 1


def concat_stream(
    doc_offsets: np.ndarray, doc_lengths: np.ndarray, order: np.ndarray, add_bos: bool
) -> ChunkStream:
    bos = 1 if add_bos else 0
    seg = np.asarray(doc_lengths, dtype=np.int64)[order] + (1 + bos)
    seg_starts = np.zeros(len(seg) + 1, dtype=np.int64)
    np.cumsum(seg, out=seg_starts[1:])
    order = np.asarray(order, dtype=np.int64)
    return ChunkStream(np.asarray(doc_offsets, dtype=np.int64)[order], seg_starts, bos, order)


def _segments(seg_starts: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Segment index of every position of rows starting at `starts` ([k, 1]): [k, seq_len+1].

    Two binary searches per row and a running count of the segment starts inside it; much
    cheaper than a binary search per position (bench/)."""
    first = np.searchsorted(seg_starts, starts[:, 0], side="right") - 1
    last = np.searchsorted(seg_starts, starts[:, 0] + seq_len, side="right") - 1
    steps = np.zeros((len(first), seq_len + 1), dtype=np.int64)
    steps[:, 0] = first
    for i in np.nonzero(last > first)[0]:
        steps[i, seg_starts[first[i] + 1 : last[i] + 1] - starts[i, 0]] = 1
    return np.cumsum(steps, axis=1)


def concat_rows_at(
    stream: ChunkStream, tokens: np.ndarray, rows: np.ndarray, seq_len: int, bos_id: int,
    eos_id: int,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Rows `rows` of the stream: input_ids, labels, position_ids, segment_ids, each int32
    of shape [len(rows), seq_len]. Vectorised over all the rows at once."""
    starts = np.asarray(rows, dtype=np.int64).reshape(-1, 1) * seq_len
    pos = starts + np.arange(seq_len + 1, dtype=np.int64)
    if pos.size and pos[:, -1].max() >= stream.total:
        raise IndexError(f"rows {list(rows)} reach past the stream of {stream.total} tokens")
    seg = _segments(stream.seg_starts, starts, seq_len)
    seg_start = stream.seg_starts[seg]
    if tokens.size:
        # Body positions read the document's tokens; EOS (and BOS) positions are overwritten
        # below, so their out-of-document reads are merely clipped into range.
        source = stream.doc_starts[seg] + (pos - seg_start - stream.bos)
        ids = np.take(tokens, source, mode="clip").astype(np.int32)
    else:  # every document is empty: the stream is all EOS (and BOS)
        ids = np.full(pos.shape, eos_id, dtype=np.int32)
    ids[pos == stream.eos_at[seg]] = eos_id
    if stream.bos:
        ids[pos == seg_start] = bos_id

    inputs = seg[:, :seq_len]
    position = pos[:, :seq_len] - np.maximum(seg_start[:, :seq_len], starts)
    return {
        "input_ids": ids[:, :seq_len],
        "labels": ids[:, 1:],
        "position_ids": position.astype(np.int32),
        "segment_ids": (inputs - inputs[:, :1] + 1).astype(np.int32),
        "loss_mask": np.ones(inputs.shape, dtype=np.int32),  # concat has no padding
    }


def concat_pieces(
    stream: ChunkStream, row: int, seq_len: int
) -> list[tuple[int, int, int, int, int]]:
    """(document, token start, token end, row start, row end) of each document's tokens among
    the inputs of chunk row `row` (BOS and EOS are not document tokens)."""
    lo, hi = row * seq_len, row * seq_len + seq_len
    first = int(np.searchsorted(stream.seg_starts, lo, side="right")) - 1
    last = int(np.searchsorted(stream.seg_starts, hi - 1, side="right")) - 1
    out = []
    for s in range(first, last + 1):
        body = int(stream.seg_starts[s]) + stream.bos  # first token of the document
        end = int(stream.seg_starts[s + 1]) - 1  # its EOS
        a, b = max(lo, body), min(hi, end)
        if a < b:
            out.append((int(stream.doc_ids[s]), a - body, b - body, a - lo, b - lo))
    return out
