"""Best-fit packing: a chunk's documents placed whole into padded rows. Pure numpy, no I/O.

Input for one chunk: `doc_lengths` (tokens per document, no specials), `seq_len` L and `add_bos`.
Each document becomes a segment `[BOS] tokens EOS` of len + 1 + bos slots. A row holds L + 1 token
slots: inputs are its first L slots, labels its last L, as in concat.

Pieces. A segment of at most L + 1 slots is one piece and is never split. A longer one is cut
into pieces of exactly L + 1 slots, the last piece shorter: the first piece starts with BOS (if
add_bos), the last ends with EOS, middle pieces are plain tokens. Full-length pieces fill a row
by themselves. The token pair across a cut is not a training pair (each piece's first slot is an
input only, a full piece's last slot a label only), as when a long document spans concat rows.

Best-fit decreasing. Pieces are sorted by length, longest first (ties: document index, then piece
index), and each goes into the open row with the least remaining capacity that still fits it
(ties: the earliest-opened row), else into a new row. Rows are numbered in order of opening and
a row's pieces are laid end to end from slot 0, so its padding is one run at its end.

Document order. The layout is a pure function of its inputs. The caller passes the documents in
an epoch's order (`doc_lengths[order]`, then `doc_offsets[order]` to `bestfit_rows_at`); since
the placement depends only on the sequence of piece lengths, the rows' shapes (which lengths
share a row, at which slots) and hence the row count do not depend on that order: the order
only decides which of several equal-length pieces takes which place. `bestfit_rows` gives the
row count alone, for the index.

Tensors per row (`bestfit_rows_at`), int32 of shape [rows, L]: `input_ids` (slots[:L]), `labels`
(slots[1:]), `position_ids` (0 at each piece start, then +1; 0 on padding), `segment_ids`
(1, 2, ... per piece in the row; 0 on padding), `loss_mask` (1 where the label slot holds a token
of the row, 0 where it is padding). Padding slots hold `pad_id`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

# The same tensors, in the same order, as packing.TENSOR_NAMES (a test holds them equal).
BESTFIT_TENSOR_NAMES = ("input_ids", "labels", "position_ids", "segment_ids", "loss_mask")

# Open rows are kept as one sorted list of Python ints `remaining << _ROW_BITS | row`: bisect on
# plain ints is several times faster than on (remaining, row) tuples, and the order is the same.
_ROW_BITS = 40
_ROW_MASK = (1 << _ROW_BITS) - 1


@dataclass(frozen=True)
class BestFitLayout:
    """Where every piece of a chunk's documents sits. Pieces are sorted by (row, start)."""

    seq_len: int
    bos: int  # 1 if each segment opens with BOS, else 0
    rows: int
    row: np.ndarray  # int64 [P]: row of each piece
    start: np.ndarray  # int64 [P]: first slot of the piece within its row
    doc: np.ndarray  # int64 [P]: document index, in the order the caller passed
    offset: np.ndarray  # int64 [P]: offset of the piece's first slot within the segment
    length: np.ndarray  # int64 [P]: slots
    row_pieces: np.ndarray  # int64 [rows + 1]: row r's pieces: row_pieces[r] : row_pieces[r + 1]
    row_fill: np.ndarray  # int64 [rows]: slots holding tokens; the rest of the row is padding
    segment_lengths: np.ndarray  # int64 [D]: len + 1 + bos of every document


def _segments(doc_lengths: np.ndarray, seq_len: int, add_bos: bool) -> np.ndarray:
    lengths = np.asarray(doc_lengths)
    if lengths.ndim != 1:
        raise ValueError(f"doc_lengths must be one-dimensional, got shape {lengths.shape}")
    if lengths.size and not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"doc_lengths must be integers, got dtype {lengths.dtype}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    lengths = lengths.astype(np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"doc_lengths must be >= 0, got {int(lengths.min())}")
    return lengths + (2 if add_bos else 1)


def _best_fit(lengths: list[int], capacity: int) -> tuple[list[int], list[int], int]:
    """Best fit of pieces already sorted longest first: (row, start) of each, and rows opened."""
    rows, starts, opened = [], [], 0
    smallest = lengths[-1] if lengths else 0
    open_rows: list[int] = []
    for length in lengths:
        i = bisect_left(open_rows, length << _ROW_BITS)
        if i == len(open_rows):
            row, remaining = opened, capacity
            opened += 1
        else:
            key = open_rows.pop(i)
            row, remaining = key & _ROW_MASK, key >> _ROW_BITS
        rows.append(row)
        starts.append(capacity - remaining)
        remaining -= length
        # Lengths only decrease, so a row with less room than the smallest piece is closed
        # for good; keeping it out keeps the list (and every insort) short.
        if remaining >= smallest:
            insort(open_rows, remaining << _ROW_BITS | row)
    return rows, starts, opened


def _tails(segments: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Full pieces per document, and the documents' shorter last pieces in placement order."""
    full, tail = np.divmod(segments, capacity)
    docs = np.flatnonzero(tail)
    # Full pieces are the longest of all, so they come first and open one row each; the rest
    # sort by length descending, then document index (lexsort is stable on `docs`).
    return full, docs[np.lexsort((docs, -tail[docs]))]


def bestfit_rows(doc_lengths: np.ndarray, seq_len: int, add_bos: bool) -> int:
    """Rows a chunk yields under best-fit packing; the same for any order of the documents."""
    capacity = seq_len + 1
    segments = _segments(doc_lengths, seq_len, add_bos)
    full, tail_docs = _tails(segments, capacity)
    return int(full.sum()) + _best_fit((segments[tail_docs] % capacity).tolist(), capacity)[2]


def bestfit_layout(doc_lengths: np.ndarray, seq_len: int, add_bos: bool) -> BestFitLayout:
    """Pieces and rows of a chunk whose documents come in the order given. O(n log n)."""
    capacity = seq_len + 1
    segments = _segments(doc_lengths, seq_len, add_bos)
    full, tail_docs = _tails(segments, capacity)
    n_full = int(full.sum())
    tails = segments[tail_docs] % capacity
    tail_rows, tail_starts, opened = _best_fit(tails.tolist(), capacity)

    # Full pieces: row i is the i-th full piece in (document, piece) order.
    full_docs = np.repeat(np.arange(len(segments), dtype=np.int64), full)
    first_of_doc = np.cumsum(full) - full
    full_offsets = (np.arange(n_full, dtype=np.int64) - first_of_doc[full_docs]) * capacity

    row = np.concatenate(
        [np.arange(n_full, dtype=np.int64), np.asarray(tail_rows, dtype=np.int64) + n_full]
    )
    start = np.concatenate([np.zeros(n_full, np.int64), np.asarray(tail_starts, np.int64)])
    doc = np.concatenate([full_docs, tail_docs.astype(np.int64)])
    offset = np.concatenate([full_offsets, full[tail_docs] * capacity])
    length = np.concatenate([np.full(n_full, capacity, np.int64), tails])
    by_slot = np.lexsort((start, row))
    rows = n_full + opened
    row_pieces = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=rows), out=row_pieces[1:])
    fill = np.bincount(row, weights=length, minlength=rows).astype(np.int64)
    return BestFitLayout(
        seq_len=seq_len,
        bos=1 if add_bos else 0,
        rows=rows,
        row=row[by_slot],
        start=start[by_slot],
        doc=doc[by_slot],
        offset=offset[by_slot],
        length=length[by_slot],
        row_pieces=row_pieces,
        row_fill=fill,
        segment_lengths=segments,
    )


def padding_fraction(layout: BestFitLayout, seq_len: int) -> float:
    """Padding input slots / all input slots (0.0 for a chunk without rows)."""
    _check_seq_len(layout, seq_len)
    if not layout.rows:
        return 0.0
    # A row's last slot is a label only, so a full row pads no input.
    slots = layout.rows * seq_len
    return (slots - int(np.minimum(layout.row_fill, seq_len).sum())) / slots


def _check_seq_len(layout: BestFitLayout, seq_len: int) -> None:
    if seq_len != layout.seq_len:
        raise ValueError(f"seq_len {seq_len} differs from the layout's {layout.seq_len}")


def bestfit_rows_at(
    layout: BestFitLayout,
    doc_offsets: np.ndarray,
    tokens: np.ndarray,
    rows: np.ndarray,
    seq_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Rows `rows` of the layout, tensors BESTFIT_TENSOR_NAMES, each int32 [len(rows), seq_len].

    `doc_offsets` gives the offset in `tokens` of each document, indexed like the layout's
    documents. Vectorised over all the rows at once, but for one slice per padded row."""
    _check_seq_len(layout, seq_len)
    doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
    if len(doc_offsets) != len(layout.segment_lengths):
        raise ValueError(
            f"{len(doc_offsets)} doc_offsets for a layout of {len(layout.segment_lengths)} docs"
        )
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= layout.rows):
        raise IndexError(f"rows {rows.tolist()} outside the layout's {layout.rows} rows")

    capacity, k = seq_len + 1, len(rows)
    first = layout.row_pieces[rows]
    count = layout.row_pieces[rows + 1] - first
    row_of = np.repeat(np.arange(k), count)
    piece = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    start, length = layout.start[piece], layout.length[piece]
    offset, doc = layout.offset[piece], layout.doc[piece]
    fill = layout.row_fill[rows]

    # Each row's pieces, then one padding run (maybe empty), tile its slots exactly, so
    # np.repeat of a per-run value gives every slot's value in one pass: a run-length decode,
    # cheaper than a gather per slot from the piece arrays (bench/packing.py).
    ends = np.cumsum(count)
    runs = np.insert(length, ends, capacity - fill)
    number = np.insert(np.arange(1, len(piece) + 1) - np.repeat(ends - count, count), ends, 0)
    slot = np.arange(capacity, dtype=np.int64)
    # A slot's token sits at doc_offsets[doc] + (offset within the segment) - bos.
    base = np.insert(doc_offsets[doc] + offset - layout.bos - start, ends, 0)
    source = np.repeat(base, runs).reshape(k, capacity) + slot
    if tokens.size:
        # BOS, EOS and padding slots read a neighbour's token (clipped into range) and are
        # overwritten below.
        ids = np.take(tokens, source, mode="clip").astype(np.int32, copy=False)
    else:  # every document is empty: the segments are all EOS (and BOS)
        ids = np.full((k, capacity), eos_id, dtype=np.int32)
    flat = ids.reshape(-1)
    at = row_of * capacity + start
    ends_segment = offset + length == layout.segment_lengths[doc]
    flat[(at + length - 1)[ends_segment]] = eos_id
    if layout.bos:
        flat[at[offset == 0]] = bos_id
    run_start = np.repeat(np.insert(start, ends, 0), runs).reshape(k, capacity)
    position = (slot - run_start).astype(np.int32)
    loss = np.ones((k, seq_len), dtype=np.int32)
    # One slice per row with padding: a handful of calls next to the per-slot work above.
    for i in np.flatnonzero(fill < capacity).tolist():
        ids[i, fill[i] :] = pad_id
        position[i, fill[i] :] = 0
        loss[i, fill[i] - 1 :] = 0
    return {
        "input_ids": ids[:, :seq_len],
        "labels": ids[:, 1:],
        "position_ids": position[:, :seq_len],
        "segment_ids": np.repeat(number.astype(np.int32), runs).reshape(k, capacity)[:, :seq_len],
        "loss_mask": loss,
    }


def row_stretches(layout: BestFitLayout, doc_order: np.ndarray, row: int) -> list[tuple[int, int]]:
    """Where the pieces of best-fit row `row` lie in the chunk's concat stream of an epoch
    whose document order is `doc_order` (packing.concat_stream: documents as `[BOS] tokens
    EOS` segments end to end): (start, end) offsets, in the row's order. A phase that leaves
    best_fit reads a row's pieces back from that stream (sampling/segments.py)."""
    seg = layout.segment_lengths[doc_order]
    seg_starts = np.concatenate(([0], np.cumsum(seg)))
    place = np.empty(len(doc_order), dtype=np.int64)
    place[doc_order] = np.arange(len(doc_order))
    a, b = int(layout.row_pieces[row]), int(layout.row_pieces[row + 1])
    at = seg_starts[place[layout.doc[a:b]]] + layout.offset[a:b]
    return list(zip(at.tolist(), (at + layout.length[a:b]).tolist(), strict=True))
