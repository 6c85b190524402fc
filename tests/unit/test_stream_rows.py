"""Concat rows across chunks, windows and epochs, against a stream built naively.

The reference lays out epoch after epoch by hand (chunks in the epoch's order, each chunk's
documents in the epoch's order, `[BOS] doc EOS` segments), cuts row r as stream[r*L : r*L+L+1]
and serves the rows that start in each window in that window's keyed order. The code under test
locates the same rows from prefix sums alone (order.py) and copies each from the row buffer of
the chunk it starts in: the chunk's stream and the tail its last row reads on into
(packing.py). Every token of every epoch must be an input of exactly one row.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.pack import packing, rowlayout
from tokenfeed.server.sampling import bijection, order

BOS, EOS = 1, 2
SEED, NAME = 77, "ds"


class Corpus:
    """Chunks of documents with distinct token ids (>= 10), and the code path under test."""

    def __init__(self, doc_lengths: list[list[int]], seq_len: int, window: int, add_bos: bool):
        self.seq_len, self.window, self.add_bos = seq_len, window, add_bos
        self.chunks = []  # (tokens, offsets, lengths)
        next_id = 10
        for lengths in doc_lengths:
            lens = np.array(lengths, dtype=np.int32)
            tokens = np.arange(next_id, next_id + int(lens.sum()), dtype=np.int32)
            next_id += int(lens.sum())
            offsets = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
            self.chunks.append((tokens, offsets[: len(lens)], lens))
        self.units = np.array(
            [
                packing.concat_units(int(lens.sum()), len(lens), add_bos)
                for _, _, lens in self.chunks
            ],
            dtype=np.int64,
        )
        self.total = int(self.units.sum())
        self._layouts: dict[int, order.EpochLayout] = {}

    # -- the code path under test (what Job.plan and Job.assemble do) --------------------
    def layout(self, epoch: int) -> order.EpochLayout:
        if epoch not in self._layouts:
            self._layouts[epoch] = order.epoch_layout(
                self.units, SEED, NAME, epoch, self.window, self.seq_len, self.total
            )
        return self._layouts[epoch]

    def stream(self, _dataset, epoch: int, c: int) -> packing.ChunkStream:
        _, offsets, lens = self.chunks[c]
        doc_order = order.document_order(len(lens), SEED, NAME, epoch, c)
        return packing.concat_stream(offsets, lens, doc_order, self.add_bos)

    def rows(self, served: np.ndarray) -> dict[str, np.ndarray]:
        epochs = order.epoch_of_row(served, self.total, self.seq_len)
        natural = np.empty_like(served)
        for e in np.unique(epochs):
            sel = epochs == e
            natural[sel] = order.natural_rows(self.layout(int(e)), served[sel])
        starts = order.locate_starts(natural * self.seq_len, self.total, self.layout)
        ids, cols, splits = rowlayout.assemble_rows(
            len(served),
            self.seq_len,
            [(0, np.arange(len(served)), starts)],
            self.buffer,
        )
        mask = np.zeros(ids.shape, dtype=bool)
        mask[np.repeat(np.arange(len(served)), np.diff(splits)), cols] = True
        return packing.concat_tensors(ids, mask, self.seq_len)

    def buffer(self, _dataset, epoch: int, c: int, position: int) -> rowlayout.RowBuffer:
        """Chunk c's row buffer: its stream, then the tail its last row reads past its end,
        copied piece by piece from the chunks after it (or cut from their row buffers)."""
        assert self.layout(epoch).chunk_order[position] == c
        tail = order.chunk_tail(
            self.layout(epoch), position, self.total, self.seq_len, self.seq_len + 1, self.layout
        )
        pieces = []
        cols = (tail.epoch, tail.chunk, tail.lo, tail.hi)
        for e, k, lo, hi in zip(*(a.tolist() for a in cols), strict=True):
            whole = rowlayout.stream_slice(
                self.stream(0, e, k), self.chunks[k][0], 0, self.stream(0, e, k).total, BOS, EOS
            )
            direct = rowlayout.stream_slice(
                self.stream(0, e, k), self.chunks[k][0], lo, hi, BOS, EOS
            )
            cut = whole.cut(lo, hi)
            assert np.array_equal(cut.ids, direct.ids) and np.array_equal(cut.starts, direct.starts)
            pieces.append(cut if (e + k) % 2 else direct)
        return rowlayout.row_buffer(
            self.stream(0, epoch, c), self.chunks[c][0], pieces, BOS, EOS, np.int32
        )

    # -- the reference ----------------------------------------------------------------
    def epoch_stream(self, epoch: int) -> tuple[list[int], list[bool]]:
        ids, starts = [], []
        n = len(self.chunks)
        chunk_order = bijection.permute(
            np.arange(n), n, bijection.round_keys("chunks", SEED, NAME, epoch)
        )
        for c in chunk_order.tolist():
            tokens, offsets, lens = self.chunks[c]
            for d in order.document_order(len(lens), SEED, NAME, epoch, c).tolist():
                doc = tokens[offsets[d] : offsets[d] + lens[d]].tolist()
                seg = ([BOS] if self.add_bos else []) + doc + [EOS]
                ids += seg
                starts += [True] + [False] * (len(seg) - 1)
        return ids, starts

    def served_order(self, epoch: int) -> list[int]:
        """Natural row behind each served row of `epoch`, window by window."""
        n, L = len(self.chunks), self.seq_len
        chunk_order = bijection.permute(
            np.arange(n), n, bijection.round_keys("chunks", SEED, NAME, epoch)
        )
        bounds = list(range(0, n, self.window)) + [n]
        out = []
        for w in range(len(bounds) - 1):
            a = epoch * self.total + int(self.units[chunk_order[: bounds[w]]].sum())
            b = epoch * self.total + int(self.units[chunk_order[: bounds[w + 1]]].sum())
            first, end = -(-a // L), -(-b // L)
            if end > first:
                keys = bijection.round_keys("rows", SEED, NAME, epoch, w)
                perm = bijection.permute(np.arange(end - first), end - first, keys)
                out += (first + perm).tolist()
        return out


def reference_rows(corpus: Corpus, epochs: int):
    ids, starts = [], []
    for e in range(epochs + 1):  # one more epoch: the last rows read on into it
        i, s = corpus.epoch_stream(e)
        ids += i
        starts += s
    natural = [r for e in range(epochs) for r in corpus.served_order(e)]
    return np.array(ids), np.array(starts), natural


def check(corpus: Corpus, epochs: int = 2) -> None:
    L = corpus.seq_len
    ids, starts, natural = reference_rows(corpus, epochs)
    served = np.arange(len(natural), dtype=np.int64)
    out = corpus.rows(served)
    for i, r in enumerate(natural):
        want = ids[r * L : r * L + L + 1]
        assert np.array_equal(out["input_ids"][i], want[:L]), f"row {i} (natural {r})"
        assert np.array_equal(out["labels"][i], want[1:])
        st_ = starts[r * L : r * L + L].copy()
        st_[0] = True
        assert np.array_equal(out["segment_ids"][i], np.cumsum(st_))
        last = np.maximum.accumulate(np.where(st_, np.arange(L), 0))
        assert np.array_equal(out["position_ids"][i], np.arange(L) - last)
    # Every token of each epoch is an input of exactly one of the rows that start in it, or
    # of the row that straddles its boundary: the natural rows of epochs 0..E-1 are exactly
    # the rows that start before E*U, so their inputs are stream[0 : first_row(E*U) * L].
    assert sorted(natural) == list(range(order.first_row(epochs * corpus.total, L)))
    inputs = np.concatenate([out["input_ids"][i] for i in np.argsort(natural)])
    assert np.array_equal(inputs, ids[: len(inputs)])
    # Random access: any rows, in any order, are the same rows.
    pick = np.random.default_rng(0).permutation(len(served))[:7]
    again = corpus.rows(served[pick])
    for name in packing.TENSOR_NAMES:
        assert np.array_equal(again[name], out[name][pick]), name


def test_rows_read_on_across_chunks_and_epochs():
    # Chunks far shorter than a row: under the old per-chunk packing none of them made a row.
    corpus = Corpus([[3, 1], [2], [4, 1], [5], [1, 1, 1]], seq_len=8, window=2, add_bos=False)
    assert int(corpus.units.max()) < 9
    check(corpus, epochs=3)


def test_with_bos_and_long_documents():
    corpus = Corpus([[40], [3, 7], [25, 2, 2], [9]], seq_len=16, window=3, add_bos=True)
    check(corpus)


def test_every_token_of_every_epoch_once():
    # Count tokens per epoch through the served rows' epochs: each document token once per
    # epoch, whatever the chunk sizes.
    corpus = Corpus(
        [[5, 9, 2], [30], [1], [7, 7], [3, 3, 3, 3]], seq_len=6, window=2, add_bos=False
    )
    L, U = corpus.seq_len, corpus.total
    epochs = 3
    rows = np.arange(order.first_row(epochs * U, L))
    out = corpus.rows(rows)
    doc_tokens = Counter(t for tokens, _, _ in corpus.chunks for t in tokens.tolist())
    seen: Counter[int] = Counter()
    for e in range(epochs):
        lo, hi = order.first_row(e * U, L), order.first_row((e + 1) * U, L)
        seen.update(t for t in out["input_ids"][lo:hi].ravel().tolist() if t >= 10)
    # Rows that straddle an epoch boundary lend tokens between neighbouring epochs; over whole
    # epochs the count is exact.
    assert seen == Counter({t: epochs for t in doc_tokens})


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=5), min_size=1, max_size=9),
    seq_len=st.integers(1, 12),
    window=st.integers(1, 4),
    add_bos=st.booleans(),
)
def test_any_chunking(docs, seq_len, window, add_bos):
    corpus = Corpus(docs, seq_len, window, add_bos)
    if corpus.total < seq_len + 1:  # refused by the index: no row in an epoch
        return
    check(corpus)
