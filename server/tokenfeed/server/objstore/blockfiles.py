"""The disk cache's `block` kind: byte ranges of objects fetched from object storage, one
file per block, checksummed by name."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from tokenfeed.server.diskcache.cache import DiskCache, Kind

log = logging.getLogger(__name__)


class BlockFiles:
    """The `block` kind: one file per block, named `<key>.<blake2b of content>.blk`, so a
    rename publishes content and checksum together. Sizes are checked on the rescan, checksums
    on the first read in a process."""

    KIND = "block"

    def __init__(self, cache: DiskCache):
        self.cache = cache
        self.dir = cache.root / "blocks"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._names: dict[str, Path] = {}
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        cache.register(Kind(self.KIND, self._scan, self._delete))

    def _scan(self) -> Iterator[tuple[str, int]]:
        for path in self.dir.glob("*/*"):
            parts = path.name.split(".")
            if len(parts) != 3 or parts[2] != "blk":
                log.info("cache: removing partial write %s", path)
                path.unlink(missing_ok=True)
                continue
            self._names[parts[0]] = path
            yield parts[0], path.stat().st_size

    def _delete(self, key: str) -> None:
        with self._lock:
            path = self._names.pop(key, None)
            self._verified.discard(key)
        if path is not None:
            path.unlink(missing_ok=True)

    def get(self, key: str, fill: Callable[[], bytes]) -> bytes:
        """The block's bytes: from disk, or from `fill()` (run once per key at a time)."""
        while True:
            if self.cache.lookup(self.KIND, key):
                with self.cache.pinned([(self.KIND, key)]):
                    data = self._read(key)
                if data is not None:
                    return data
                continue  # dropped as corrupt: fetch again
            fetched: list[bytes] = []
            self.cache.fill_once(self.KIND, key, partial(self._fill_into, fetched, key, fill))
            if fetched:
                return fetched[0]

    def _fill_into(self, out: list[bytes], key: str, fill: Callable[[], bytes]) -> None:
        out.append(self._fill(key, fill))

    def _fill(self, key: str, fill: Callable[[], bytes]) -> bytes:
        data = fill()
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        path = self.dir / key[:2] / f"{key}.{digest}.blk"
        with self._lock:
            self._names[key] = path
            self._verified.add(key)
        self.cache.write_bytes(self.KIND, key, path, data)
        return data

    def _read(self, key: str) -> bytes | None:
        with self._lock:
            path = self._names.get(key)
        try:
            data = path.read_bytes() if path is not None else None
        except OSError:
            data = None
        if path is None or data is None:
            self.cache.remove(self.KIND, key, "file missing")
            return None
        if key not in self._verified:
            if hashlib.blake2b(data, digest_size=16).hexdigest() != path.name.split(".")[1]:
                self.cache.remove(self.KIND, key, f"checksum mismatch in {path}")
                return None
            with self._lock:
                self._verified.add(key)
        return data
