"""Shard indexes (a tar's samples, an Arrow stream's record batches: source/shardindex.py) kept
in the disk cache beside the token chunks, under `shards/<key[:2]>/<key>.six`.

They are `shard-index` entries that are never evicted, like manifests: planning a job needs
them before anything else, and rebuilding one reads its whole shard again. Each is small (24
bytes per tar sample or record batch). Files are written atomically; on start, partial
writes are removed and a file that fails its digest is rebuilt when it is next asked for.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenfeed.server.diskcache.cache import DiskCache, Kind
from tokenfeed.server.diskcache.diskfiles import write_atomic

log = logging.getLogger(__name__)

KIND = "shard-index"


class ShardIndexFiles:
    """`source.shardindex.ShardIndexes` over the disk cache."""

    def __init__(self, cache: DiskCache, scan: bool = True):
        self.cache = cache
        self.root = cache.root / "shards"
        self.root.mkdir(parents=True, exist_ok=True)
        found = self._scan() if scan else []
        cache.register(Kind(KIND, lambda: found, self._delete, False))

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.six"

    def _scan(self) -> list[tuple[str, int]]:
        for stale in self.root.glob("*/*.tmp"):
            stale.unlink(missing_ok=True)
        return [(p.stem, p.stat().st_size) for p in self.root.glob("*/*.six")]

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        with self.cache.reserving(len(data), f"shard index {key}"):
            write_atomic(self._path(key), data)
            self.cache.commit(KIND, key, len(data))

    def _delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
