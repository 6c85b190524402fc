"""Range copies between arrays of one dtype: `gather(dst, dst_at, sources, which, src_at,
lengths)` copies, for each i, `lengths[i]` items of `sources[which[i]]` from item `src_at[i]`
into `dst` at item `dst_at[i]`. Every range is checked before anything is copied (ValueError
naming the range).

`row_starts(starts, which, lo, seq_len)`: the document starts inside rows cut from buffers
(each row positions [lo, lo + seq_len + 1) of buffer `which`, whose starts are `starts[which]`),
as positions in their rows, and the rows' splits: one binary search per row bound in C, GIL
kept (numpy's searchsorted lets it go; the serving thread then waits for it behind the layout
threads), or the same arrays from one numpy searchsorted over all the buffers' starts.

The memory moves of serving go through it: a chunk's documents laid out as its row buffer
(rowlayout.row_buffer) and a batch's rows cut from row buffers (rowlayout.assemble_rows), each
in one call into C (_gather.c, built with the package where a C compiler is present). A
layout thread asks for the GIL to be released while it copies (`release_gil`), so it no longer
holds the interpreter that the serving thread needs. The serving thread's own copies keep it:
a thread that lets go of the GIL waits up to the switch interval (5 ms) to get it back from a
thread running Python, far longer than a group's rows take to copy. Where the extension is not
built the same copies run as numpy slice assignments (`NATIVE` says which), GIL held; both
give the same bytes (tests/unit/test_gather.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

_gather: ModuleType | None
try:
    from tokenfeed.server.pack import _gather
except ImportError:  # built without a C compiler: the numpy twin below
    _gather = None

NATIVE = _gather is not None


def int64s(a: np.ndarray | Sequence[int]) -> np.ndarray:
    """`a` as a contiguous int64 array (what the C extensions take; no copy where it is one)."""
    return np.ascontiguousarray(a, dtype=np.int64)


def gather(
    dst: np.ndarray,
    dst_at: np.ndarray | Sequence[int],
    sources: Sequence[np.ndarray],
    which: np.ndarray | Sequence[int],
    src_at: np.ndarray | Sequence[int],
    lengths: np.ndarray | Sequence[int],
    release_gil: bool = False,
) -> None:
    """Copy the ranges into `dst` (C-contiguous, writable; every source of dst's dtype, made
    contiguous here where it is not)."""
    if not (dst.flags.c_contiguous and dst.flags.writeable):
        raise ValueError("the destination must be a writable C-contiguous array")
    for s in sources:
        if s.dtype != dst.dtype:
            raise TypeError(f"a source of {s.dtype} for a destination of {dst.dtype}")
    args = (int64s(dst_at), int64s(which), int64s(src_at), int64s(lengths))
    if _gather is None:
        _gather_numpy(dst, sources, *args)
        return
    to, k, frm, n = args
    whole = [np.ascontiguousarray(s) for s in sources]
    _gather.gather(dst, to, whole, k, frm, n, dst.dtype.itemsize, release_gil)


def _gather_numpy(
    dst: np.ndarray,
    sources: Sequence[np.ndarray],
    to: np.ndarray,
    which: np.ndarray,
    frm: np.ndarray,
    n: np.ndarray,
) -> None:
    if not (len(to) == len(which) == len(frm) == len(n)):
        raise ValueError(
            "dst_at, which, src_at and lengths differ in length "
            f"({len(to)}, {len(which)}, {len(frm)}, {len(n)})"
        )
    flat = dst.reshape(-1)
    size = len(flat)
    for i, (a, k, b, m) in enumerate(
        zip(to.tolist(), which.tolist(), frm.tolist(), n.tolist(), strict=True)
    ):
        if not 0 <= k < len(sources):
            raise ValueError(f"range {i} reads source {k} of {len(sources)}")
        items = sources[k].size
        if m < 0 or b < 0 or a < 0 or b > items - m or a > size - m:
            raise ValueError(
                f"range {i}: {m} items from {b} of a source of {items} to {a} of a "
                f"destination of {size}"
            )
    for a, k, b, m in zip(to.tolist(), which.tolist(), frm.tolist(), n.tolist(), strict=True):
        flat[a : a + m] = sources[k].reshape(-1)[b : b + m]


def row_starts(
    starts: Sequence[np.ndarray], which: np.ndarray, lo: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """(int64 positions, inside their rows, of the document starts at positions 1 .. seq_len
    - 1 of each row, row after row; int32 row splits, rows + 1): row r is [lo[r], lo[r] +
    seq_len + 1) of buffer which[r], whose ascending document starts are starts[which[r]]."""
    rows = len(which)
    k, at = int64s(which), int64s(lo)
    if len(at) != rows:
        raise ValueError(f"which and lo differ in length ({rows}, {len(at)})")
    if _gather is None:
        if rows and (int(k.min()) < 0 or int(k.max()) >= len(starts)):
            raise ValueError(
                f"row {int(np.argmax((k < 0) | (k >= len(starts))))} reads a "
                f"buffer outside the {len(starts)} given"
            )
        return _row_starts_numpy([int64s(s) for s in starts], k, at, seq_len)
    splits = np.empty(rows + 1, dtype=np.int32)
    found = _gather.row_starts([int64s(s) for s in starts], k, at, seq_len, splits)
    return np.frombuffer(found, dtype=np.int64), splits


def _row_starts_numpy(
    starts: list[np.ndarray], which: np.ndarray, lo: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """`row_starts` in numpy: buffer k's starts shifted by k * big (past every position of the
    buffers before it) make one sorted array, searched once for every row's bounds."""
    rows = len(which)
    big = 1 + max(
        [int(lo.max()) + seq_len + 1 if rows else 0] + [int(s[-1]) + 1 for s in starts if len(s)]
    )
    joined = np.concatenate([*starts, np.zeros(0, dtype=np.int64)])
    joined += np.repeat(np.arange(len(starts), dtype=np.int64) * big, [len(s) for s in starts])
    base = which * big + lo
    found = np.searchsorted(joined, np.concatenate((base + 1, base + max(seq_len, 1))))
    first = found[:rows]
    counts = np.maximum(found[rows:] - first, 0)
    splits = np.zeros(rows + 1, dtype=np.int32)
    np.add.accumulate(counts, dtype=np.int32, out=splits[1:])
    at = np.arange(int(splits[-1]), dtype=np.int64) + np.repeat(first - splits[:-1], counts)
    return joined[at] - np.repeat(base, counts), splits
