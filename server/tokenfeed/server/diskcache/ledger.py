"""The disk cache's ledger: its entries and their running totals (entries and bytes per kind,
all bytes, the bytes that may not be evicted), kept as entries come and go so that nothing on
the serving path counts them. It has no lock of its own: the cache's lock is held to use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenfeed.server.telemetry import metrics

if TYPE_CHECKING:
    from prometheus_client import Gauge

EntryKey = tuple[str, str]  # (kind, key)


@dataclass
class Entry:
    size: int
    evictable: bool
    used: float = field(default_factory=time.monotonic)


class Ledger:
    def __init__(self) -> None:
        self.entries: dict[EntryKey, Entry] = {}
        # The keys of the evictable entries (insertion-ordered): what making room walks, never
        # the manifests, which are one per chunk of the corpus and kept.
        self.evictable: dict[EntryKey, None] = {}
        self.totals: dict[str, list[int]] = {}  # kind -> [entries, bytes]
        self.used = 0  # bytes of every entry
        self.fixed = 0  # bytes of the unevictable entries
        self._gauges: dict[str, tuple[Gauge, Gauge]] = {}  # kind -> (entries, bytes) children

    def add_kind(self, kind: str) -> None:
        self.totals.setdefault(kind, [0, 0])
        self._gauge(kind)

    def add(self, key: EntryKey, entry: Entry) -> None:
        """Account for an entry; replaces any entry of the same key."""
        self.pop(key)
        self.entries[key] = entry
        if entry.evictable:
            self.evictable[key] = None
        totals = self.totals.setdefault(key[0], [0, 0])
        totals[0] += 1
        totals[1] += entry.size
        self.used += entry.size
        self.fixed += 0 if entry.evictable else entry.size
        self._gauge(key[0])

    def pop(self, key: EntryKey) -> Entry | None:
        """Forget an entry; its files are the caller's."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.evictable.pop(key, None)
            totals = self.totals[key[0]]
            totals[0] -= 1
            totals[1] -= entry.size
            self.used -= entry.size
            self.fixed -= 0 if entry.evictable else entry.size
            self._gauge(key[0])
        return entry

    def usage(self) -> dict[str, tuple[int, int]]:
        """kind -> (entries, bytes), from the running totals."""
        return {kind: (n, b) for kind, (n, b) in self.totals.items()}

    def recount(self, kinds: list[str]) -> dict[str, tuple[int, int]]:
        """kind -> (entries, bytes) counted entry by entry (tests: the totals must equal it)."""
        out = {name: (0, 0) for name in kinds}
        for (kind, _), e in self.entries.items():
            n, b = out.get(kind, (0, 0))
            out[kind] = (n + 1, b + e.size)
        return out

    def _gauge(self, kind: str) -> None:
        """Set the kind's gauges from its running totals: O(1)."""
        gauges = self._gauges.get(kind)
        if gauges is None:
            gauges = self._gauges[kind] = (
                metrics.CACHE_ENTRIES.labels(kind),
                metrics.CACHE_BYTES.labels(kind),
            )
        n, b = self.totals[kind]
        gauges[0].set(n)
        gauges[1].set(b)
