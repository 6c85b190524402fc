"""The compact batch on the wire (docs/batch-format.md), shared by the server and the client.

A batch travels as one token array `[rows, seq_len + 1]` in the narrowest dtype that holds
the vocabulary (uint16 up to 65,536 ids, else int32): `input_ids` and `labels` are its two
overlapping views. Document boundaries travel as the positions (1 .. seq_len - 1) where a
document piece starts inside each row, with row splits; best_fit padding as a count per row
(the padding of a row is one run at its end). Everything else the trainer uses is derived:
`position_ids`, `segment_ids`, `loss_mask` (and `cu_seqlens`, see batch.varlen).

Fingerprint: hex xxh3-128 over a header (wire version, rows, seq_len, dtype codes) and the
compact bytes: about 30 GB/s, against about 1.5 GB/s for SHA-256 over five int32 tensors.
It detects corruption and mixed-up batches; it is not a signature (TLS authenticates).

Imports only numpy, xxhash, the generated protos and the client's errors (no gRPC).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import numpy as np
import xxhash
from tokenfeed.client.errors import WireError
from tokenfeed.v1 import tokenfeed_pb2 as pb

WIRE_VERSION = 2
TENSOR_NAMES = ("input_ids", "labels", "position_ids", "segment_ids", "loss_mask")
_TOKEN_DTYPES: dict[pb.DType, np.dtype] = {
    pb.DTYPE_UINT16: np.dtype("<u2"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}
_TOKEN_CODES = {dtype: code for code, dtype in _TOKEN_DTYPES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest wire dtype holding every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<i4")


_U2, _I4 = np.dtype("<u2"), np.dtype("<i4")


def position_dtype(seq_len: int) -> np.dtype:
    """Boundary positions and padding counts: uint16 while seq_len + 1 fits."""
    return _U2 if seq_len + 1 <= 65535 else _I4


@dataclass(frozen=True)
class Compact:
    """One rank's batch in compact form (numpy, read-only views where decoded)."""

    tokens: np.ndarray  # [rows, seq_len + 1], uint16 or int32
    starts: np.ndarray  # document piece starts in (0, seq_len), row by row
    row_splits: np.ndarray  # int32 [rows + 1]: row r's starts are starts[splits[r]:splits[r+1]]
    padding: np.ndarray | None  # per row, slots of padding at the row's end; None: no padding

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1]) - 1


def compact_from_starts(
    tokens: np.ndarray, starts: np.ndarray, padding: np.ndarray | None = None
) -> Compact:
    """From token ids [rows, seq_len + 1] and a boolean mask of document starts of the same
    shape (column 0 and the last column are ignored: a row always starts a piece, and the last
    slot is a label only)."""
    seq_len = tokens.shape[1] - 1
    rows, cols = np.nonzero(starts[:, 1:seq_len])
    splits = np.zeros(len(tokens) + 1, dtype=np.int32)
    np.cumsum(np.bincount(rows, minlength=len(tokens)), out=splits[1:])
    pad = None
    if padding is not None and np.any(padding):
        pad = np.asarray(padding).astype(position_dtype(seq_len))
    return Compact(tokens, (cols + 1).astype(position_dtype(seq_len)), splits, pad)


def compact_from_flat_starts(tokens: np.ndarray, starts: np.ndarray) -> Compact:
    """From token ids [rows, seq_len + 1] and the sorted flat indices of document starts
    (column 0 and the last column are ignored, as in `compact_from_starts`)."""
    rows, width = tokens.shape
    col = starts % width
    starts = starts[(col > 0) & (col < width - 1)]
    splits = np.searchsorted(starts, np.arange(rows + 1) * width).astype(np.int32)
    return Compact(tokens, (starts % width).astype(position_dtype(width - 1)), splits, None)


def slice_rows(c: Compact, lo: int, hi: int) -> Compact:
    """Rows [lo, hi) of a compact batch (views where possible)."""
    a, b = int(c.row_splits[lo]), int(c.row_splits[hi])
    padding = None if c.padding is None else c.padding[lo:hi]
    if padding is not None and not padding.any():
        padding = None
    return Compact(c.tokens[lo:hi], c.starts[a:b], c.row_splits[lo : hi + 1] - a, padding)


def cut_splits(row_splits: np.ndarray, per: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(where each of `steps` batches of `per` rows starts among the starts, each batch's own
    row splits [steps, per + 1]) of a group's row splits: all cut in one pass, not one
    subtraction a batch (split_rows, and the server's batchmsg.group_messages)."""
    bounds = row_splits[np.arange(steps + 1) * per]
    splits = np.empty((steps, per + 1), dtype=row_splits.dtype)
    splits[:, :per] = row_splits[: steps * per].reshape(steps, per) - bounds[:-1, None]
    splits[:, per] = bounds[1:] - bounds[:-1]
    return bounds, splits


def split_rows(c: Compact, per: int, steps: int) -> list[Compact]:
    """`slice_rows` of rows [i * per, (i + 1) * per) for each of `steps` batches: a server's
    group of steps cut into its batches, as their messages carry them (the server's
    `batchmsg.group_messages` slices the same bytes; its tests check one against the other)."""
    n = steps * per
    if n > c.rows or per < 1:
        raise ValueError(f"{steps} batches of {per} rows are not in {c.rows} rows")
    bounds, splits = cut_splits(c.row_splits, per, steps)
    padding: list[np.ndarray | None] = [None] * steps
    if c.padding is not None:
        pads = c.padding[:n].reshape(steps, per)
        used: list[bool] = np.any(pads, axis=1).tolist()
        padding = [p if u else None for p, u in zip(pads, used, strict=True)]
    at = bounds.tolist()
    return [
        Compact(c.tokens[i * per : (i + 1) * per], c.starts[at[i] : at[i + 1]], splits[i], pad)
        for i, pad in enumerate(padding)
    ]


def compact_from_tensors(arrays: Mapping[str, np.ndarray], dtype: np.dtype) -> Compact:
    """From the five int32 tensors (the inverse of `expand`): tokens are the inputs plus the
    last label, starts are where `position_ids` is 0 among the row's tokens, padding is what
    `loss_mask` leaves out."""
    ids, labels = arrays["input_ids"], arrays["labels"]
    seq_len = ids.shape[1]
    tokens = np.empty((len(ids), seq_len + 1), dtype=dtype)
    tokens[:, :seq_len] = ids
    tokens[:, seq_len] = labels[:, -1]
    used = arrays["loss_mask"].sum(axis=1, dtype=np.int64) + 1  # slots holding tokens
    col = np.arange(seq_len + 1)
    starts = np.zeros(tokens.shape, dtype=bool)
    starts[:, :seq_len] = arrays["position_ids"] == 0
    starts &= col < used[:, None]
    return compact_from_starts(tokens, starts, seq_len + 1 - used)


def fingerprint_header(c: Compact) -> bytes:
    """What a fingerprint hashes first: the same for every batch of one shape, dtype and
    padding (or none)."""
    code = _TOKEN_CODES[np.dtype(c.tokens.dtype)]
    return shape_header(c.rows, c.seq_len, code, c.padding is not None)


_HEADERS: dict[tuple[int, int, int, bool], bytes] = {}
HEADERS_MAX = 1024  # shapes remembered


def shape_header(rows: int, seq_len: int, code: int, padded: bool) -> bytes:
    """`fingerprint_header` of a batch of this shape, token dtype code and padding (or none)."""
    key = (rows, seq_len, code, padded)
    found = _HEADERS.get(key)
    if found is None:
        if len(_HEADERS) >= HEADERS_MAX:
            _HEADERS.clear()
        found = _HEADERS[key] = struct.pack("<IqqII", WIRE_VERSION, rows, seq_len, code, padded)
    return found


def fingerprint(c: Compact) -> str:
    """The batch's fingerprint (`digest` of its header and compact arrays)."""
    # `.data`: the contiguous array's own bytes, without a copy.
    return digest(
        fingerprint_header(c),
        np.ascontiguousarray(c.tokens).data,
        np.ascontiguousarray(c.starts).data,
        np.ascontiguousarray(c.row_splits).data,
        None if c.padding is None else np.ascontiguousarray(c.padding).data,
    )


_Bytes = bytes | memoryview
# The fingerprint's hash: `digest` is HASHER(header) updated with the arrays' bytes, then its
# hexdigest (a server's C extension takes it the same way: server/pack/rowmessages.py).
HASHER = xxhash.xxh3_128


def digest(
    header: bytes, tokens: _Bytes, starts: _Bytes, splits: _Bytes, padding: _Bytes | None
) -> str:
    """The hex xxh3-128 of a header and a batch's compact bytes, in the fingerprint's order:
    the arrays' buffers on a server, the received bytes on a client (the same bytes)."""
    h = HASHER(header)
    h.update(tokens)
    h.update(starts)
    h.update(splits)
    if padding is not None:
        h.update(padding)
    return h.hexdigest()


class BatchFields(TypedDict):
    """The fields of a `tokenfeed.v1.Batch` that carry a compact batch."""

    wire_version: int
    rows: int
    seq_len: int
    token_dtype: pb.DType
    tokens: NotRequired[bytes]
    starts: bytes
    row_splits: bytes
    padding: bytes
    fingerprint: str


def token_code(dtype: np.dtype | type) -> int:
    """The wire's code of a token dtype (WireError for one it cannot carry)."""
    code = _TOKEN_CODES.get(np.dtype(dtype).newbyteorder("<"))
    if code is None:
        raise WireError(f"tokens of dtype {np.dtype(dtype)} have no wire encoding")
    return code


def encode(c: Compact, with_tokens: bool = True) -> BatchFields:
    """The fields of a `tokenfeed.v1.Batch` that carry the compact batch, with its fingerprint
    (without `tokens` when `with_tokens` is false: a server appends them to the serialized
    message itself, copying them once)."""
    fields: BatchFields = {
        "wire_version": WIRE_VERSION,
        "rows": c.rows,
        "seq_len": c.seq_len,
        "token_dtype": token_code(c.tokens.dtype),  # type: ignore[typeddict-item]
        "starts": c.starts.tobytes(),
        "row_splits": c.row_splits.astype("<i4").tobytes(),
        "padding": b"" if c.padding is None else c.padding.tobytes(),
        "fingerprint": fingerprint(c),
    }
    if with_tokens:
        fields["tokens"] = np.ascontiguousarray(c.tokens).tobytes()
    return fields


def _array(data: _Bytes, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    if len(data) != count * dtype.itemsize:
        raise WireError(f"{what}: {len(data)} bytes, expected {count} of {dtype.name}")
    return np.frombuffer(data, dtype=dtype)


# Arrays of up to this many values are checked as Python lists: numpy's fixed cost per call is
# most of what checking a batch's few splits and starts costs.
_SMALL = 64


def _ascending(a: np.ndarray) -> bool:
    """Whether no value is less than the one before it."""
    if len(a) <= _SMALL:
        values = a.tolist()
        return all(map(operator.le, values, values[1:]))
    return not (a[1:] < a[:-1]).any()  # pairwise, not by np.diff: a third of the CPU


def _between(a: np.ndarray, lo: int, hi: int) -> bool:
    """Whether every value of a non-empty array is in [lo, hi)."""
    if len(a) <= _SMALL:
        values = a.tolist()
        return bool(min(values) >= lo and max(values) < hi)
    return bool(a.min() >= lo and a.max() < hi)


def decode(msg: pb.Batch, verify: bool = True, in_place: _Bytes | None = None) -> Compact:
    """Read-only numpy views over the message's bytes (no copy), checked for consistency. The
    fingerprint is taken over the received bytes themselves: they are the arrays' bytes.
    `in_place`: the tokens' bytes where the client's deserializer left them in the received
    message (_received.py; else `msg.tokens`). Runs once per batch a trainer reads: each
    field is read from the message once."""
    version, code, rows, seq_len = msg.wire_version, msg.token_dtype, msg.rows, msg.seq_len
    if version != WIRE_VERSION:
        raise WireError(
            f"batch of wire version {version}; this client reads "
            f"version {WIRE_VERSION} (upgrade the older side)"
        )
    dtype = _TOKEN_DTYPES.get(code)
    if dtype is None:
        raise WireError(f"unknown token dtype code {code}")
    if rows < 0 or seq_len < 1:
        raise WireError(f"batch of {rows} rows of seq_len {seq_len}")
    raw_tokens = msg.tokens if in_place is None else in_place
    raw_splits, raw_starts, raw_padding = msg.row_splits, msg.starts, msg.padding
    tokens = _array(raw_tokens, dtype, rows * (seq_len + 1), "tokens").reshape(rows, seq_len + 1)
    splits = _array(raw_splits, _I4, rows + 1, "row_splits")
    pdtype = position_dtype(seq_len)
    count = len(raw_starts) // pdtype.itemsize
    starts = _array(raw_starts, pdtype, count, "starts")
    if splits[0] != 0 or splits[-1] != count or not _ascending(splits):
        raise WireError("row_splits do not partition the document starts")
    if count and not _between(starts, 1, seq_len):
        raise WireError(f"document starts outside (0, {seq_len})")
    padding = None
    if raw_padding:
        padding = _array(raw_padding, pdtype, rows, "padding")
        if padding.max() > seq_len:
            raise WireError(f"padding of more than {seq_len} slots")
    if verify:
        header = shape_header(rows, seq_len, code, padding is not None)
        got = digest(header, raw_tokens, raw_starts, raw_splits, raw_padding or None)
        if got != msg.fingerprint:
            raise WireError(
                f"batch fingerprint mismatch: computed {got}, server sent {msg.fingerprint}"
            )
    return Compact(tokens, starts, splits, padding)


# -- expansion into the trainer's tensors (numpy; torch.py and jax.py do the same on device) --


def _starts_mask(c: Compact) -> np.ndarray:
    mask = np.zeros((c.rows, c.seq_len), dtype=bool)
    mask[:, 0] = True
    rows = np.repeat(np.arange(c.rows), np.diff(c.row_splits))
    mask[rows, c.starts] = True
    return mask


def _used(c: Compact) -> np.ndarray | None:
    """Slots holding tokens per row ([rows, 1]), or None when no row has padding."""
    if c.padding is None:
        return None
    return (c.seq_len + 1 - c.padding.astype(np.int64))[:, None]


def tokens_int32(c: Compact) -> np.ndarray:
    """The token array [rows, seq_len + 1] as int32: the array itself when it travelled as
    int32, else one contiguous widening pass (half the cost of widening `input_ids` and
    `labels` apart, which are strided views of it: bench/, client section)."""
    return c.tokens.astype(np.int32, copy=False)


def expand(c: Compact, name: str, wide: np.ndarray | None = None) -> np.ndarray:
    """One of the trainer's int32 tensors [rows, seq_len], computed with vectorised numpy:
    `input_ids` and `labels` are views of `wide` (`tokens_int32(c)`, made here when not
    given), so with int32 tokens they are views of the received bytes."""
    L = c.seq_len
    if name in ("input_ids", "labels"):
        wide = tokens_int32(c) if wide is None else wide
        return wide[:, :L] if name == "input_ids" else wide[:, 1:]
    col = np.arange(L, dtype=np.int32)
    used = _used(c)
    if name == "loss_mask":
        if used is None:
            return np.ones((c.rows, L), dtype=np.int32)
        return (col + 1 < used).astype(np.int32)
    mask = _starts_mask(c)
    if name == "segment_ids":
        out = np.cumsum(mask, axis=1, dtype=np.int32)
    elif name == "position_ids":
        out = col - np.maximum.accumulate(np.where(mask, col, 0), axis=1)
    else:
        raise KeyError(name)
    if used is not None:
        out[col >= used] = 0  # padding: segment 0, position 0
    return out
