"""Row buffers: a chunk's concat stream laid out once in an epoch (with its tail), and the
rows cut from such buffers: the concat rows of a batch, each one slice of a buffer
(`assemble_rows`), and a best_fit segment's padded carry rows (`padded_rows`). Pure functions
over packing.py's streams; no I/O."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenfeed.server.pack import gather as ranges
from tokenfeed.server.pack.packing import ChunkStream, Int64s, concat_tensors, fill_concat
from tokenfeed.server.sampling.order import RowStarts


def padded_rows(
    buffers: Sequence[RowBuffer], los: np.ndarray, seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
    """The int32 tensors of rows cut from laid-out runs of a stream that end where the run does
    (a best_fit segment's carry rows: sampling/segments.py): row i is positions [los[i],
    los[i] + seq_len + 1) of buffers[i], or fewer, the rest of the row padding (`pad_id`,
    position and segment 0, no loss), as best_fit pads."""
    k, span = len(buffers), seq_len + 1
    ids = np.full((k, span), pad_id, dtype=np.int32)
    mask = np.zeros((k, span), dtype=bool)
    used = np.empty(k, dtype=np.int64)
    for i, (buf, lo) in enumerate(zip(buffers, np.asarray(los).tolist(), strict=True)):
        piece = buf.cut(lo, min(lo + span, len(buf.ids)))
        n = len(piece.ids)
        ids[i, :n] = piece.ids
        mask[i, piece.starts] = True
        used[i] = n
    out = concat_tensors(ids, mask, seq_len)
    col = np.arange(seq_len)
    pad = col[None, :] >= used[:, None]
    out["loss_mask"] = (col[None, :] + 1 < used[:, None]).astype(np.int32)
    out["position_ids"] = np.where(pad, 0, out["position_ids"]).astype(np.int32)
    out["segment_ids"] = np.where(pad, 0, out["segment_ids"]).astype(np.int32)
    return out


@dataclass(frozen=True)
class RowBuffer:
    """Stream positions laid out as token ids (in the wire's dtype), with the sorted positions
    in them where a document's segment starts. A chunk's row buffer is its whole concat stream
    in one epoch followed by its tail (the units its last row reads past the chunk's end,
    order.chunk_tail): every row starting in the chunk is then one slice of it."""

    ids: np.ndarray
    starts: Int64s

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.starts.nbytes)

    def cut(self, lo: int, hi: int) -> RowBuffer:
        """Positions [lo, hi) of this buffer (views)."""
        a, b = np.searchsorted(self.starts, [lo, hi], side="left").tolist()
        return RowBuffer(self.ids[lo:hi], self.starts[a:b] - lo)


def stream_slice(
    stream: ChunkStream,
    tokens: np.ndarray,
    lo: int,
    hi: int,
    bos_id: int,
    eos_id: int,
    dtype: np.dtype | type = np.int32,
) -> RowBuffer:
    """Stream positions [lo, hi) of one chunk, laid out."""
    ids = np.empty(hi - lo, dtype=dtype)
    one = partial(np.full, 1, dtype=np.int64)
    starts = fill_concat(stream, tokens, one(lo), one(hi), one(0), bos_id, eos_id, ids)
    return RowBuffer(ids, starts)


# A chunk's stream is laid out a document at a time (one slice copy each) when its documents
# average at least this many tokens: a Python step per document then costs less than
# fill_concat's per-token index arithmetic (about 6 ns a token; bench/, wire section), which
# stays the way for chunks of tiny documents.
SLICE_MEAN_TOKENS = 64


def lay_out(
    stream: ChunkStream, tokens: np.ndarray, ids: np.ndarray, bos_id: int, eos_id: int
) -> Int64s:
    """The whole stream into ids[:stream.total]; the positions where its segments start."""
    seg_starts = stream.seg_starts
    n, total = len(stream.doc_starts), stream.total
    if not n:
        return np.zeros(0, dtype=np.int64)
    if not tokens.size or total < SLICE_MEAN_TOKENS * n:
        one = partial(np.full, 1, dtype=np.int64)
        return fill_concat(stream, tokens, one(0), one(total), one(0), bos_id, eos_id, ids)
    body = seg_starts[:-1] + stream.bos  # each document's tokens go to [body, its EOS)
    eos = seg_starts[1:] - 1
    for src, a, b in zip(stream.doc_starts.tolist(), body.tolist(), eos.tolist(), strict=True):
        ids[a:b] = tokens[src : src + b - a]
    ids[eos] = eos_id
    if stream.bos:
        ids[seg_starts[:-1]] = bos_id
    return seg_starts[:-1].copy()


# Where a buffer is laid out: given its token count and its number of document starts, two
# arrays to fill (ids in the wire's dtype, starts as int64), or None (then it is allocated).
# The node's arena offers a slot this way (sharedrows.py), so a buffer is laid out in place
# there, not laid out and then copied in.
Place = Callable[[int, int], tuple[np.ndarray, np.ndarray] | None]


def row_buffer(
    stream: ChunkStream,
    tokens: np.ndarray,
    tail: Sequence[RowBuffer],
    bos_id: int,
    eos_id: int,
    dtype: np.dtype | type = np.int32,
    place: Place | None = None,
) -> RowBuffer:
    """A chunk's row buffer: its whole stream laid out (its documents in the stream's order,
    with BOS and EOS), then the pieces of its tail, in order. Where its documents are copied
    whole (`_joined`), into the arrays `place` gives if it gives them: the same bytes."""
    dtype = np.dtype(dtype)
    total = stream.total
    n = len(stream.doc_starts)
    at = _offsets(total, tail)
    if n and tokens.size and tokens.dtype == dtype and total >= SLICE_MEAN_TOKENS * n:
        starts = np.concatenate(
            [stream.seg_starts[:-1], *(t.starts + a for t, a in zip(tail, at, strict=True))]
        ).astype(np.int64, copy=False)
        size = total + sum(len(t.ids) for t in tail)
        given = place(size, len(starts)) if place is not None else None
        if given is None:
            return RowBuffer(_joined(stream, tokens, tail, bos_id, eos_id), starts)
        ids, into = given
        into[:] = starts
        into.flags.writeable = False
        return RowBuffer(_joined(stream, tokens, tail, bos_id, eos_id, ids), into)
    ids = np.empty(total + sum(len(t.ids) for t in tail), dtype=dtype)
    found = [lay_out(stream, tokens, ids, bos_id, eos_id)]
    for t, a in zip(tail, at, strict=True):
        ids[a : a + len(t.ids)] = t.ids
        found.append(t.starts + a)
    return RowBuffer(ids, np.concatenate(found))


def _offsets(total: int, tail: Sequence[RowBuffer]) -> list[int]:
    """Where each tail piece starts in a buffer whose stream has `total` positions."""
    out, at = [], total
    for t in tail:
        out.append(at)
        at += len(t.ids)
    return out


def _joined(
    stream: ChunkStream,
    tokens: np.ndarray,
    tail: Sequence[RowBuffer],
    bos_id: int,
    eos_id: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The stream and its tail as one read-only array: every document's tokens (a slice of the
    chunk's, in the wire's dtype already), BOS and EOS, and the tail pieces. With the C
    extension (gather.py) one range copy a document in one call, the GIL released, then BOS
    and EOS set by index; without it one bytes.join (GIL held), half the CPU of a slice
    assignment per document and no index per token (bench/, wire section). Into `out` where
    it is given (copied there without the extension)."""
    if ranges.NATIVE:
        return _gathered(stream, tokens, tail, bos_id, eos_id, out)
    size = tokens.dtype.itemsize
    raw = np.ascontiguousarray(tokens).data.cast("B")
    seg = stream.seg_starts
    lo = stream.doc_starts * size
    hi = lo + (seg[1:] - seg[:-1] - 1 - stream.bos) * size
    n, per = len(lo), 2 + stream.bos
    parts: list[Any] = [b""] * (per * n)
    parts[per - 2 :: per] = [raw[a:b] for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]
    parts[per - 1 :: per] = [np.array([eos_id], tokens.dtype).tobytes()] * n
    if stream.bos:
        parts[0::per] = [np.array([bos_id], tokens.dtype).tobytes()] * n
    parts += [np.ascontiguousarray(t.ids, tokens.dtype).data.cast("B") for t in tail]
    joined = np.frombuffer(b"".join(parts), dtype=tokens.dtype)
    if out is None:
        return joined
    out[:] = joined
    out.flags.writeable = False
    return out


def _gathered(
    stream: ChunkStream,
    tokens: np.ndarray,
    tail: Sequence[RowBuffer],
    bos_id: int,
    eos_id: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """`_joined` by gather.py's C range copies: the same array (`out` where it is given)."""
    seg, n, total = stream.seg_starts, len(stream.doc_starts), stream.total
    pieces = [np.ascontiguousarray(t.ids, tokens.dtype) for t in tail]
    sizes = np.array([len(p) for p in pieces], dtype=np.int64)
    ids = np.empty(total + int(sizes.sum()), dtype=tokens.dtype) if out is None else out
    body = seg[:-1] + stream.bos  # each document's tokens go to [body, its EOS)
    ranges.gather(
        ids,
        np.concatenate((body, total + np.cumsum(sizes) - sizes)),
        [tokens, *pieces],
        np.concatenate((np.zeros(n, dtype=np.int64), np.arange(1, len(pieces) + 1))),
        np.concatenate((stream.doc_starts, np.zeros(len(pieces), dtype=np.int64))),
        np.concatenate((seg[1:] - 1 - body, sizes)),
        release_gil=True,  # a layout thread: the serving thread runs meanwhile
    )
    ids[seg[1:] - 1] = eos_id
    if stream.bos:
        ids[seg[:-1]] = bos_id
    ids.flags.writeable = False
    return ids


@dataclass(frozen=True)
class RowSources:
    """Rows not yet copied: row i is positions [lo[i], lo[i] + span) of ids[which[i]]. A stream
    serializes its batches' messages straight from them (gather.messages), one copy of each
    row, into the message itself."""

    ids: list[np.ndarray]
    which: Int64s
    lo: Int64s
    span: int

    def copy(self, dtype: np.dtype | type) -> np.ndarray:
        """The rows as one [rows, span] array in `dtype` (`_rows`)."""
        return _rows(self.ids, self.which, self.lo, len(self.which), self.span, np.dtype(dtype))


def assemble_rows(
    rows: int,
    seq_len: int,
    parts: Iterable[tuple[Any, np.ndarray, RowStarts]],
    buffer: Callable[[Any, int, int, int], RowBuffer],
    dtype: np.dtype | type = np.int32,
) -> tuple[np.ndarray, Int64s, npt.NDArray[np.int32]]:
    """`row_sources`' rows copied: token ids [rows, seq_len + 1] in `dtype` (the wire's, so
    nothing is converted later), with their starts and row splits."""
    sources, starts, splits = row_sources(rows, seq_len, parts, buffer)
    return sources.copy(dtype), starts, splits


def row_sources(
    rows: int,
    seq_len: int,
    parts: Iterable[tuple[Any, np.ndarray, RowStarts]],
    buffer: Callable[[Any, int, int, int], RowBuffer],
) -> tuple[RowSources, Int64s, npt.NDArray[np.int32]]:
    """Where token ids [rows, seq_len + 1] are to be copied from (`RowSources`), and the
    document starts inside each row (positions 1 .. seq_len - 1, row after row, with
    row splits: the wire's form) of rows that are each one slice of a row buffer. `parts`
    holds (dataset, slots, starts): row i of a part fills place slots[i] of the batch with
    positions [starts.lo[i], starts.lo[i] + seq_len + 1) of `buffer(dataset, starts.epoch[i],
    starts.chunk[i], starts.position[i])`. Every place must be filled exactly once.

    Per batch: one copy of all rows (`_rows`: one call of gather.py's range copies, or one
    message each: gather.messages), and one call for the starts of all rows, whatever buffers
    they come from (gather.py's `row_starts`). Rows are grouped by buffer in C-level dict and
    map calls: no Python bytecode per row (a batch's rows come from a few buffers, shuffled,
    so per-buffer numpy calls cost as much as per-row slices).
    A buffer's starts are positions inside it (`RowBuffer`)."""
    span = seq_len + 1
    buffers: list[RowBuffer] = []
    which: list[int] = []  # each row's buffer, part after part
    los, places = [], []
    for dataset, slots, where in parts:
        keys = list(
            zip(where.epoch.tolist(), where.chunk.tolist(), where.position.tolist(), strict=True)
        )
        index: dict[tuple[int, int, int], int] = {}
        for key in dict.fromkeys(keys):  # each buffer once, exactly, whatever the epoch
            index[key] = len(buffers)
            buffers.append(buffer(dataset, *key))
        which += map(index.__getitem__, keys)
        los.append(where.lo)
        places.append(slots)
    lo = np.concatenate(los).astype(np.int64, copy=False)
    slot = np.concatenate(places)
    of = np.array(which, dtype=np.int64)
    every = np.arange(rows)
    if len(lo) != len(of):
        raise ValueError(f"{len(lo)} rows' starts for {len(of)} rows")
    if len(slot) != rows or not np.array_equal(slot, every):
        order = np.argsort(slot, kind="stable")
        if len(slot) != rows or not np.array_equal(slot[order], every):
            raise ValueError(f"the parts fill places {slot.tolist()}, not each of {rows} once")
        of, lo = of[order], lo[order]
    if rows and int(lo.min()) < 0:
        raise ValueError(f"a row starts before its buffer (at {int(lo.min())})")
    starts, splits = ranges.row_starts([b.starts for b in buffers], of, lo, seq_len)
    return RowSources([b.ids for b in buffers], of, lo, span), starts, splits


def _rows(
    ids: Sequence[np.ndarray], of: Int64s, lo: Int64s, rows: int, span: int, dtype: np.dtype
) -> np.ndarray:
    """Row i: positions [lo[i], lo[i] + span) of ids[of[i]], as [rows, span] in `dtype`,
    in one call: gather.py's range copies (the GIL kept: gather.py says why) where every
    buffer is of `dtype`, else one np.concatenate of the rows' views. A row reaching past
    its buffer's end is refused (ValueError) either way."""
    out = np.empty((rows, span), dtype=dtype)
    if ranges.NATIVE and all(a.dtype == dtype for a in ids):
        ranges.gather(out, np.arange(0, rows * span, span), ids, of, lo, np.full(rows, span))
        return out
    views: list[np.ndarray] = list(
        map(
            np.ndarray.__getitem__,
            map(ids.__getitem__, of.tolist()),
            map(slice, lo.tolist(), (lo + span).tolist()),
        )
    )
    if views:
        np.concatenate(views, out=out.reshape(-1))  # one copy of every row, in one call
    return out
