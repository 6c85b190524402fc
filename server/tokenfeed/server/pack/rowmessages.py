"""A group's serialized messages, each made whole in one pass: its head, its fingerprint, its
tail, then its rows copied straight from their row buffers (no array of the group's rows in
between), the fingerprint computed over the rows just copied (serve/batchmsg.py makes a
stream's messages with it).

`messages(heads, tails, sources, which, src_at, span, fp_len, fingerprint)`: each batch's head
and tail given by the caller.

`batch_messages(parts, tags, steps, epochs, starts, start_at, splits, splits_each, sources,
which, src_at, span, fp_len, hasher, header)`: the same messages, each batch's head and tail
written here from the four pieces that every batch of a stream's group shares (`parts`) and
the batch's own fields: its step and epoch (varints, left out where 0, as protobuf leaves out
zeros) and its slices of the group's document starts and row splits (length-delimited, left
out where empty), and its fingerprint taken here too: `hasher(header)` (an xxh3-128 and the
shape's header, as wire.digest starts) updated with the rows as copied, the batch's starts and
its row splits, then its hexdigest. A batch then costs no Python of ours: a group of 32 small
batches ran about 2.5 us a batch of Python to make each head and tail, and a callback for the
fingerprint about 2 us more (bench/, wire section).

Both run in C (_rowmessages.c, built with the package where a C compiler is present: `NATIVE`),
else as their twins below, which make the same bytes and refuse the same input
(tests/unit/test_rowmessages.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
from tokenfeed.server.pack.gather import int64s

_rowmessages: ModuleType | None
try:
    from tokenfeed.server.pack import _rowmessages
except ImportError:  # built without a C compiler: the twins below
    _rowmessages = None

NATIVE = _rowmessages is not None

# fingerprint(i, rows): batch i's fingerprint (fp_len ASCII characters) from a read-only view
# of its rows as copied into its message; the view is released when it returns.
Fingerprint = Callable[[int, memoryview], str]
# hasher(header): an object whose update(bytes) and hexdigest() make a fingerprint (xxh3-128).
Hasher = Callable[[bytes], Any]
_Bytes = bytes | bytearray | memoryview

_SMALL = [bytes([n]) for n in range(128)]


def varint(n: int) -> bytes:
    """A protobuf varint (a negative int64 as its 10-byte two's complement, as protobuf does)."""
    if 0 <= n < 128:
        return _SMALL[n]
    if 0 < n < 1 << 14:  # a step, a payload's length: two bytes, without the loop
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _contiguous(sources: Sequence[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """The sources made contiguous, and their one itemsize (TypeError for several dtypes)."""
    dtypes = {s.dtype for s in sources}
    if len(dtypes) > 1:
        raise TypeError(f"sources of several dtypes: {sorted(map(str, dtypes))}")
    itemsize = dtypes.pop().itemsize if dtypes else 1
    return [np.ascontiguousarray(s) for s in sources], itemsize


def messages(
    heads: list[bytes],
    tails: list[bytes],
    sources: Sequence[np.ndarray],
    which: np.ndarray,
    src_at: np.ndarray,
    span: int,
    fp_len: int,
    fingerprint: Fingerprint,
) -> list[bytes]:
    """One bytes object per batch (`len(heads)` batches of `len(which) / len(heads)` rows):
    heads[i], batch i's fingerprint, tails[i], then its rows (row r: `span` items of
    sources[which[r]] from item src_at[r]), every source of one dtype. Every row is checked
    before anything is made (ValueError naming the row)."""
    whole, itemsize = _contiguous(sources)
    args = (heads, tails, whole, int64s(which), int64s(src_at), span, itemsize, fp_len)
    if _rowmessages is not None:
        return _rowmessages.messages(*args, fingerprint)
    return _messages_py(*args, fingerprint)


def batch_messages(
    parts: tuple[bytes, bytes, bytes, bytes],
    tags: bytes,
    steps: Sequence[int],
    epochs: Sequence[int],
    starts: _Bytes,
    start_at: Sequence[int],
    splits: _Bytes,
    splits_each: int,
    sources: Sequence[np.ndarray],
    which: np.ndarray,
    src_at: np.ndarray,
    span: int,
    fp_len: int,
    hasher: Hasher,
    header: bytes,
) -> list[bytes]:
    """`messages`, batch i's head and tail written here: parts (a, b, c, d), tags (four
    one-byte field keys t0 .. t3). Its head is a, field t0 of steps[i] (a varint; left out
    where 0), b; its tail field t1 of epochs[i] (likewise), c, field t2 of the bytes
    starts[start_at[i]:start_at[i + 1]] and field t3 of splits[i * splits_each:(i + 1) *
    splits_each] (each length-delimited; left out where empty), d. `len(steps)` batches;
    `start_at`: one byte offset more than batches, ascending. Its fingerprint: hasher(header)
    updated with its rows, its starts and its row splits, then hexdigest()."""
    whole, itemsize = _contiguous(sources)
    args = (
        tuple(parts),
        bytes(tags),
        int64s(steps),
        int64s(epochs),
        starts,
        int64s(start_at),
        splits,
        splits_each,
        whole,
        int64s(which),
        int64s(src_at),
        span,
        itemsize,
        fp_len,
    )
    if _rowmessages is not None:
        return _rowmessages.batch_messages(*args, hasher, bytes(header))
    return _batch_messages_py(*args, hasher, bytes(header))


def _batch_messages_py(
    parts: tuple,
    tags: bytes,
    steps: np.ndarray,
    epochs: np.ndarray,
    starts: _Bytes,
    start_at: np.ndarray,
    splits: _Bytes,
    splits_each: int,
    sources: list[np.ndarray],
    which: np.ndarray,
    src_at: np.ndarray,
    span: int,
    itemsize: int,
    fp_len: int,
    hasher: Hasher,
    header: bytes,
) -> list[bytes]:
    if fp_len < 0 or splits_each < 0 or not callable(hasher):
        raise ValueError("fp_len and splits_each must be >= 0, hasher callable")
    if len(parts) != 4 or len(tags) != 4:
        raise ValueError("parts must be 4 bytes objects, tags 4 bytes")
    for i, p in enumerate(parts):
        if not isinstance(p, bytes):
            raise TypeError(f"part {i} must be bytes")
    a, b, c, d = parts
    batches, cut = len(steps), start_at.tolist()
    if len(epochs) != batches or len(cut) != batches + 1:
        raise ValueError(
            f"{batches} steps, {len(epochs)} epochs and {len(cut)} start offsets: want one "
            "epoch a step and one offset more"
        )
    starts_b, splits_b = memoryview(starts).cast("B"), memoryview(splits).cast("B")
    for i in range(batches):
        if cut[i] < 0 or cut[i + 1] < cut[i] or cut[i + 1] > len(starts_b):
            raise ValueError(
                f"batch {i}'s starts [{cut[i]}, {cut[i + 1]}) are not inside the "
                f"{len(starts_b)} bytes given"
            )
    if splits_each * batches > len(splits_b):
        raise ValueError(
            f"{batches} batches of {splits_each} bytes of row splits: {len(splits_b)} given"
        )
    heads, tails, own = [], [], []
    for i, (step, epoch) in enumerate(zip(steps.tolist(), epochs.tolist(), strict=True)):
        heads.append(b"".join((a, *((tags[0:1], varint(step)) if step else ()), b)))
        mine = bytes(starts_b[cut[i] : cut[i + 1]])
        rows = bytes(splits_b[i * splits_each : (i + 1) * splits_each])
        tail = [*((tags[1:2], varint(epoch)) if epoch else ()), c]
        for tag, data in ((tags[2:3], mine), (tags[3:4], rows)):
            if data:
                tail += (tag, varint(len(data)), data)
        tails.append(b"".join((*tail, d)))
        own.append((mine, rows))

    def fingerprint(i: int, view: memoryview) -> str:
        h = hasher(header)
        for data in (view, *own[i]):
            h.update(data)
        return h.hexdigest()

    return _messages_py(heads, tails, sources, which, src_at, span, itemsize, fp_len, fingerprint)


def _messages_py(
    heads: list[bytes],
    tails: list[bytes],
    sources: list[np.ndarray],
    which: np.ndarray,
    src_at: np.ndarray,
    span: int,
    itemsize: int,
    fp_len: int,
    fingerprint: Fingerprint,
) -> list[bytes]:
    rows, batches = len(which), len(heads)
    if itemsize < 1 or span < 0:
        raise ValueError("itemsize must be at least 1, span >= 0")
    if fp_len < 0 or not callable(fingerprint):
        raise ValueError("fp_len must be >= 0, fingerprint callable")
    if len(tails) != batches:
        raise ValueError(f"{batches} heads for {len(tails)} tails")
    if len(src_at) != rows:
        raise ValueError(f"which and src_at differ in length ({rows}, {len(src_at)})")
    if batches < 1 or rows % batches:
        raise ValueError(f"{rows} rows are not {batches} batches of one shape")
    for r, (k, at) in enumerate(zip(which.tolist(), src_at.tolist(), strict=True)):
        if not 0 <= k < len(sources):
            raise ValueError(f"row {r} reads source {k} of {len(sources)}")
        if at < 0 or at > sources[k].size - span:
            raise ValueError(f"row {r}: {span} items from {at} of a source of {sources[k].size}")
    raw = [s.reshape(-1).data.cast("B") for s in sources]
    per, out = rows // batches, []
    for i in range(batches):
        mine = slice(i * per, (i + 1) * per)
        cut = zip(which[mine].tolist(), src_at[mine].tolist(), strict=True)
        body = b"".join(raw[k][at * itemsize : (at + span) * itemsize] for k, at in cut)
        with memoryview(body) as view:
            fp = fingerprint(i, view)
        if not isinstance(fp, str) or len(fp) != fp_len or not fp.isascii():
            raise ValueError(f"batch {i}'s fingerprint is not a str of {fp_len} characters")
        out.append(b"".join((heads[i], fp.encode(), tails[i], body)))
    return out
