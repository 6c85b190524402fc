"""A dataset's chunk keys, packed: the names its chunks have in the token store, with a sorted
view to find a chunk by its key."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

NAMED = 4096  # keys kept as str (about 200 bytes each): more than a window's chunks


class ChunkKeys:
    """A dataset's chunk keys (32 hex digits each), packed: 16 bytes per chunk where a list of
    str and a dict to look them up would take about 200, with a sorted view for lookups."""

    def __init__(self, keys: list[str]):
        self._raw = np.frombuffer(b"".join(bytes.fromhex(k) for k in keys), dtype="V16")
        self._order = np.argsort(self._raw, kind="stable")
        self._sorted = self._raw[self._order]
        self._named: dict[int, str] = {}  # keys recently asked for (serving asks per batch)

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i: int) -> str:
        found = self._named.get(i)
        if found is None:
            if len(self._named) >= NAMED:
                self._named.clear()
            found = self._named[i] = self._raw[i].tobytes().hex()
        return found

    def __iter__(self) -> Iterator[str]:
        return (v.tobytes().hex() for v in self._raw)

    def get(self, key: str) -> int | None:
        """The chunk id of a key, or None if the key is not one of this dataset's."""
        if len(key) != 32 or not len(self._raw):
            return None
        try:
            q = np.frombuffer(bytes.fromhex(key), dtype="V16")[0]
        except ValueError:
            return None
        j = int(np.searchsorted(self._sorted, q))
        return int(self._order[j]) if j < len(self._sorted) and self._sorted[j] == q else None
