"""Sample order: pure functions of (seed, dataset, epoch, sizes). No I/O, clocks or global state.

Three keyed bijections decide the order of an epoch (docs/sample-order.md has the picture):

1. chunks are permuted over [0, n_chunks);
2. the documents of each chunk are permuted before the chunk is packed (packing.py);
3. consecutive chunks in permuted order form windows of `window_chunks`; the rows of a window
   are permuted, so the order mixes across the corpus while I/O stays within one window.

Each bijection is a balanced Feistel network on the smallest even number of bits that covers the
domain, with cycle-walking back into [0, n): O(1) memory, any position computable directly.
Round keys come from BLAKE2b of (purpose, seed, dataset, epoch, ...). The round function is the
splitmix64 finalizer, a strong 64-bit mixer. Everything is vectorised over numpy uint64 arrays.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

ROUNDS = 8
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@lru_cache(maxsize=4096)
def round_keys(*parts: object) -> tuple[int, ...]:
    """ROUNDS 64-bit keys derived from the parts (purpose, seed, dataset, epoch, ...)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8 * ROUNDS, person=b"tokenfeed.v1").digest()
    return tuple(int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(ROUNDS))


def _mix64(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def _half_bits(n: int) -> int:
    bits = max(int(n - 1).bit_length(), 2)
    return (bits + 1) // 2


def _feistel(x: np.ndarray, half: int, keys: tuple[int, ...], inverse: bool) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    left, right = x >> shift, x & mask
    ks = [np.uint64(k) for k in (reversed(keys) if inverse else keys)]
    with np.errstate(over="ignore"):
        if not inverse:
            for k in ks:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
        else:
            for k in ks:
                left, right = right ^ (_mix64(left ^ k) & mask), left
    return (left << shift) | right


def permute(index: np.ndarray | int, n: int, keys: tuple[int, ...], inverse: bool = False):
    """The keyed bijection of [0, n) (or its inverse) at `index` (an int or an integer array)."""
    if n <= 0:
        raise ValueError(f"permutation domain must be non-empty, got n={n}")
    scalar = np.isscalar(index)
    x = np.atleast_1d(np.asarray(index, dtype=np.int64))
    if x.size and (x.min() < 0 or x.max() >= n):
        raise ValueError(f"index out of range [0, {n})")
    if n == 1:
        out = np.zeros_like(x)
        return int(out[0]) if scalar else out
    half = _half_bits(n)
    y = _feistel(x.astype(np.uint64), half, keys, inverse)
    # Cycle-walking: the Feistel domain is at most 4n, so few elements walk more than once.
    todo = np.nonzero(y >= np.uint64(n))[0]
    while todo.size:
        y[todo] = _feistel(y[todo], half, keys, inverse)
        todo = todo[y[todo] >= np.uint64(n)]
    out = y.astype(np.int64)
    return int(out[0]) if scalar else out


@dataclass(frozen=True)
class EpochLayout:
    """Where every row of one epoch lives: O(number of chunks) memory.

    `chunk_order[p]` is the chunk at position p of the epoch; `rows_cum[p]` the number of rows
    before position p (length n+1); windows are positions [w*W, (w+1)*W).
    """

    seed: int
    dataset: str
    epoch: int
    window_chunks: int
    chunk_order: np.ndarray
    rows_cum: np.ndarray
    window_cum: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.rows_cum[-1])


def epoch_layout(
    rows_per_chunk: np.ndarray, seed: int, dataset: str, epoch: int, window_chunks: int
) -> EpochLayout:
    n = len(rows_per_chunk)
    order = permute(np.arange(n), n, round_keys("chunks", seed, dataset, epoch))
    rows_cum = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.asarray(rows_per_chunk, dtype=np.int64)[order], out=rows_cum[1:])
    bounds = np.append(np.arange(0, n, window_chunks), n)
    return EpochLayout(
        seed, dataset, epoch, window_chunks, order, rows_cum, rows_cum[bounds].copy()
    )


def window_order(layout: EpochLayout, w: int) -> np.ndarray:
    """The row permutation of window w, materialised: O(rows of one window)."""
    size = int(layout.window_cum[w + 1] - layout.window_cum[w])
    if size == 0:  # every chunk of the window packs to zero rows
        return np.zeros(0, dtype=np.int64)
    keys = round_keys("rows", layout.seed, layout.dataset, layout.epoch, w)
    return permute(np.arange(size), size, keys)


def locate_rows(
    layout: EpochLayout, rows: np.ndarray, window_perm: Callable[[int], np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Map epoch-relative row indices to (chunk id, row within chunk's packed rows).

    `window_perm(w)` may return a cached `window_order(layout, w)`; by default each row's
    permuted position is computed directly."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= layout.rows):
        raise ValueError(f"row out of range [0, {layout.rows})")
    windows = np.searchsorted(layout.window_cum, rows, side="right") - 1
    natural = np.empty_like(rows)
    for w in dict.fromkeys(windows.tolist()):  # distinct, in order; cheap when small
        sel = windows == w
        base = int(layout.window_cum[w])
        if window_perm is not None:
            natural[sel] = base + window_perm(int(w))[rows[sel] - base]
            continue
        size = int(layout.window_cum[w + 1]) - base
        keys = round_keys("rows", layout.seed, layout.dataset, layout.epoch, int(w))
        natural[sel] = base + permute(rows[sel] - base, size, keys)
    positions = np.searchsorted(layout.rows_cum, natural, side="right") - 1
    return layout.chunk_order[positions], natural - layout.rows_cum[positions]


def document_order(num_docs: int, seed: int, dataset: str, epoch: int, chunk: int) -> np.ndarray:
    """The order in which a chunk's documents are packed in one epoch."""
    if num_docs == 0:
        return np.zeros(0, dtype=np.int64)
    keys = round_keys("docs", seed, dataset, epoch, chunk)
    return permute(np.arange(num_docs), num_docs, keys)
