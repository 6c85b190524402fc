"""Per-shard layout indexes, built once per shard version and kept: a tar's samples (wds.py)
and an Arrow stream's record batches (arrowfiles.py).

Unlike an MDS shard (whose index.json gives its sample count) or a Parquet file (whose footer
gives its row groups), a tar or an Arrow stream says where its samples are only in headers
spread through the whole object. Planning its chunks therefore walks those headers once (every
block of the object, on object storage), and the result is kept in the token store
(`ShardIndexes`, store/shardfiles.py) under a key of the object's URI, size and version, so a
restart or another job plans from it without reading the shard again.

An index is an int64 table (rows of a fixed width per layout) with a BLAKE2b digest; a stored
one that fails its digest is rebuilt.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np
from tokenfeed.server.objstore.objects import ObjectInfo

# Bump when a layout's index (what a walk records) changes.
SHARD_INDEX_VERSION = 2
_MAGIC = b"TFSHIX01"


class ShardIndexes(Protocol):
    """Where shard indexes are kept: `get` a stored one's bytes, `put` a new one's."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...


class MemoryIndexes:
    """Shard indexes kept in this process only (tools, tests, planning without a store)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._data[key] = data


def index_key(layout: str, obj: ObjectInfo) -> str:
    text = "\x1f".join(map(str, (SHARD_INDEX_VERSION, layout, obj.uri, obj.size, obj.version)))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def encode(table: np.ndarray) -> bytes:
    body = np.ascontiguousarray(table, dtype="<i8")
    head = _MAGIC + np.array(body.shape, dtype="<i8").tobytes()
    data = head + body.tobytes()
    return data + hashlib.blake2b(data, digest_size=16).digest()


def decode(data: bytes) -> np.ndarray | None:
    """The table, or None when the bytes are not a whole index (rebuilt then)."""
    if len(data) < 40 or data[:8] != _MAGIC:
        return None
    body, digest = data[:-16], data[-16:]
    if hashlib.blake2b(body, digest_size=16).digest() != digest:
        return None
    rows, width = (int(x) for x in np.frombuffer(body[8:24], dtype="<i8"))
    if rows < 0 or width < 0 or len(body) != 24 + 8 * rows * width:
        return None
    return np.frombuffer(body[24:], dtype="<i8").reshape(rows, width)


def cached(
    indexes: ShardIndexes, layout: str, obj: ObjectInfo, build: Callable[[], np.ndarray]
) -> np.ndarray:
    """The stored index of `obj`, or `build()` it and store it."""
    key = index_key(layout, obj)
    stored = indexes.get(key)
    table = decode(stored) if stored is not None else None
    if table is None:
        table = build()
        indexes.put(key, encode(table))
    return table
