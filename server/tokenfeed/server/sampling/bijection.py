"""The keyed bijections of the sample order (order.py): each a balanced Feistel network on the
smallest even number of bits that covers the domain, with cycle-walking back into [0, n): O(1)
memory, any position computable directly. Round keys come from BLAKE2b of (purpose, seed,
dataset, epoch, ...). The round function is the splitmix64 finalizer, a strong 64-bit mixer.
Everything is vectorised over numpy uint64 arrays; the network itself runs in C where the
server's extension is built (_feistel.c), the same values as its numpy twin.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from types import ModuleType
from typing import overload

import numpy as np
import numpy.typing as npt

_native: ModuleType | None
try:  # built by setup.py where a C compiler is: the same network, a few times less CPU
    from tokenfeed.server.sampling import _feistel as _native
except ImportError:
    _native = None

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


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def _half_bits(n: int) -> int:
    bits = max(int(n - 1).bit_length(), 2)
    return (bits + 1) // 2


def _feistel(
    x: npt.NDArray[np.uint64], half: int, keys: tuple[int, ...], inverse: bool
) -> npt.NDArray[np.uint64]:
    """The network at every x: in C (_feistel.c, one pass, the GIL kept) where the extension
    is built, else `_feistel_numpy` (the reference; tests/unit/test_order_native.py checks
    that both agree)."""
    if _native is None or half > 32:
        return _feistel_numpy(x, half, keys, inverse)
    x = np.ascontiguousarray(x, dtype=np.uint64)
    out = np.empty_like(x)
    _native.feistel(x, out, half, keys, inverse)
    return out


def _feistel_numpy(
    x: npt.NDArray[np.uint64], half: int, keys: tuple[int, ...], inverse: bool
) -> npt.NDArray[np.uint64]:
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


def permutation(n: int, keys: tuple[int, ...]) -> npt.NDArray[np.int64]:
    """permute(np.arange(n), n, keys): the whole bijection of [0, n). The Feistel network runs
    once over its whole domain (at most 4n), and cycle-walking follows that table (a gather
    per walk, not 8 rounds of arithmetic): an epoch's document orders cost a few ns a document
    instead of a few us (bench/, wire section)."""
    if n <= 0:
        raise ValueError(f"permutation domain must be non-empty, got n={n}")
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    half = _half_bits(n)
    if _native is not None and half <= 31:  # the same walks in C, one pass
        found = np.empty(n, dtype=np.int64)
        _native.permutation(n, half, keys, found)
        return found
    table = _feistel(np.arange(1 << (2 * half), dtype=np.uint64), half, keys, False)
    walk = table.astype(np.int64)
    out = walk[:n].copy()
    todo = np.nonzero(out >= n)[0]
    while todo.size:
        out[todo] = walk[out[todo]]
        todo = todo[out[todo] >= n]
    return out


@overload
def permute(
    index: int | np.integer, n: int, keys: tuple[int, ...], inverse: bool = False
) -> int: ...
@overload
def permute(
    index: np.ndarray, n: int, keys: tuple[int, ...], inverse: bool = False
) -> npt.NDArray[np.int64]: ...
def permute(
    index: np.ndarray | int | np.integer, n: int, keys: tuple[int, ...], inverse: bool = False
) -> npt.NDArray[np.int64] | int:
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
