"""The disk cache's mechanics: one directory, one byte budget, entries of several kinds
(`block`, `chunk`, `manifest`: docs/storage-and-cache.md).

- Budget: a write reserves its size first, evicting until `used + reserved + size <= budget`;
  if pinned and unevictable entries leave no room, it fails with `CacheFullError` (the bytes
  needed), never a wait that could deadlock.
- Pins (entries being read are never evicted) and single flight (concurrent misses on one key
  run its fill once).
- Which entry to evict is the policy's choice (its owner gives it: the jobs' next use of
  each entry, Belady, jobs/future.py); ties and unknown entries go least recently used first.
- O(1) per request: entries and bytes per kind and the unevictable bytes are running totals;
  only making room walks the entries (the evictable ones), only when the budget is exceeded.
- Deletion: an entry leaves the accounting under the lock and is marked "being deleted"; its
  files are deleted once the lock is released. Until then its bytes count against the budget
  and a fill of its key waits, so the deletion never removes a rebuilt entry's files.

Lock order (docs/architecture.md): `DiskCache._lock`, then only the locks that the policy and
the eviction listeners take. Never held while calling a fill, a kind's `scan` or `delete`, or
while waiting for a fill or a deletion.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfeed.server.diskcache.diskfiles import write_atomic
from tokenfeed.server.diskcache.ledger import Entry, EntryKey, Ledger
from tokenfeed.server.errors import CacheFullError, CacheTooSmallError
from tokenfeed.server.telemetry import metrics

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# Next use of each candidate, in steps from now (math.inf: not needed again as far as known).
UNBOUNDED = 2**62  # bytes: a budget that never binds
Policy = Callable[[list[EntryKey]], list[float]]


@dataclass(frozen=True)
class Kind:
    """How one kind of entry lives on disk: `scan()` yields (key, size) of the complete entries
    it keeps (dropping partial ones), `delete(key)` removes an entry's files."""

    name: str
    scan: Callable[[], Iterable[tuple[str, int]]]
    delete: Callable[[str], None]
    evictable: bool = True


class DiskCache:
    @classmethod
    def unbounded(cls, root: str | Path) -> DiskCache:
        """A cache without a budget over `root`: an offline build's (its output is the whole
        store), or that of a store made alone by a tool or a test."""
        return cls(root, UNBOUNDED)

    def __init__(self, root: str | Path, budget: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self._lock = threading.Lock()
        self.ledger = Ledger()  # what is cached, with running totals (lock held to use it)
        self._pins: dict[EntryKey, int] = {}
        self._claims: dict[str, int] = {}
        self._kinds: dict[str, Kind] = {}
        self._reserved = 0
        self._inflight: dict[EntryKey, threading.Event] = {}
        self._policy: Policy | None = None
        self._listeners: list[Callable[[EntryKey], None]] = []
        self._deleting: dict[EntryKey, threading.Event] = {}  # evicted, files not yet deleted
        self._deleting_sizes: dict[EntryKey, int] = {}
        self._deleting_bytes = 0  # their size: still on disk, so still counted against the budget
        self.evictions = 0
        metrics.CACHE_BUDGET_BYTES.set(budget)
        metrics.CACHE_PINNED_BYTES.set_function(self._pinned_bytes)

    # ------------------------------------------------------------ setup

    def register(self, kind: Kind) -> None:
        """Adopt a kind and the complete entries it finds on disk (the rescan on start)."""
        found = list(kind.scan())
        with self._lock:
            self._kinds[kind.name] = kind
            self.ledger.add_kind(kind.name)
            for key, size in found:
                self.ledger.add((kind.name, key), Entry(size, kind.evictable))
        if found:
            log.info(
                "cache: kept %d %s entries (%d bytes) from %s",
                len(found),
                kind.name,
                sum(s for _, s in found),
                self.root,
            )
        self._shrink_to_budget()

    def set_policy(self, policy: Policy) -> None:
        self._policy = policy

    def on_evict(self, listener: Callable[[EntryKey], None]) -> None:
        """Called (lock held) after an entry is evicted or dropped, e.g. to forget a mapping."""
        self._listeners.append(listener)

    # ------------------------------------------------------------ reads

    def lookup(self, kind: str, key: str, count: bool = True) -> bool:
        """Whether the entry is present (marking it used), counting a hit or a miss."""
        with self._lock:
            entry = self.ledger.entries.get((kind, key))
            if entry is not None:
                entry.used = time.monotonic()
        if count:
            (metrics.CACHE_HITS if entry is not None else metrics.CACHE_MISSES).labels(kind).inc()
        return entry is not None

    def contains(self, kind: str, key: str) -> bool:
        with self._lock:
            return (kind, key) in self.ledger.entries

    def contains_all(self, kind: str, keys: Iterable[str]) -> bool:
        """Whether every one of these entries is present: one taking of the lock, not one per
        key (prefetch asks for a window's dozen chunks every few steps)."""
        with self._lock:
            entries = self.ledger.entries
            return all((kind, key) in entries for key in keys)

    @contextmanager
    def pinned(self, entries: Iterable[EntryKey]) -> Iterator[None]:
        """Entries (present or not yet) that must not be evicted while the block runs."""
        entries = list(entries)
        self._pin(entries, +1)
        try:
            yield
        finally:
            self._pin(entries, -1)

    def _pin(self, entries: list[EntryKey], delta: int) -> None:
        with self._lock:  # pins may precede the entry: a chunk about to be (re)built
            for e in entries:
                n = self._pins.get(e, 0) + delta
                if n:
                    self._pins[e] = n
                else:
                    del self._pins[e]

    def fill_once(self, kind: str, key: str, fill: Callable[[], None]) -> None:
        """Run `fill` (which must commit the entry) unless the entry is present, once however
        many threads miss the same key at the same time."""
        while True:
            with self._lock:
                if (kind, key) in self.ledger.entries:
                    return
                # An entry whose files are still being deleted after its eviction is waited for
                # like a fill in flight, so the deletion never removes the new files.
                waiting = self._inflight.get((kind, key)) or self._deleting.get((kind, key))
                if waiting is None:
                    done = self._inflight[(kind, key)] = threading.Event()
            if waiting is not None:
                waiting.wait()
                continue  # the filler may have failed: check again, maybe fill ourselves
            try:
                fill()
                return
            finally:
                with self._lock:
                    del self._inflight[(kind, key)]
                done.set()

    # ------------------------------------------------------------ writes

    def admits(self, entry: EntryKey, size: int) -> bool:
        """Whether a new entry is worth caching: not if, to make room for it, Belady's rule
        would evict the entry itself first (it is needed later than everything it would
        displace). An entry pinned by a reader is always admitted."""
        with self._lock:
            if entry in self._pins or self._policy is None:
                return True
            excess = self.ledger.used + self._deleting_bytes + self._reserved + size - self.budget
            if excess <= 0:
                return True
            candidates = self._candidates_locked()
            return entry not in self._victims(candidates + [entry], excess, {entry: size})

    @contextmanager
    def reserving(self, size: int, why: str) -> Iterator[None]:
        """Room for `size` bytes of files written inside the block (then `commit` them)."""
        while True:
            with self._lock:
                try:
                    evicted = self._make_room(size, why)
                    self._reserved += size
                    break
                except CacheFullError:
                    if not self._deleting:
                        raise
                    pending = list(self._deleting.values())  # room is being freed: wait
            for done in pending:
                done.wait(5.0)
        self._delete(evicted)
        try:
            yield
        finally:
            with self._lock:
                self._reserved -= size

    def commit(self, kind: str, key: str, size: int) -> None:
        """Account for a complete entry whose files are in place (written under `reserving`)."""
        with self._lock:
            self.ledger.add((kind, key), Entry(size, self._kinds[kind].evictable))

    def remove(self, kind: str, key: str, why: str) -> None:
        """Forget a partial or corrupt entry and delete its files (the kind's `delete`, after
        the lock is released, like an eviction's); they are gone when this returns."""
        entry_key = (kind, key)
        with self._lock:
            entry = self.ledger.pop(entry_key)
            if entry is not None:
                metrics.CACHE_DROPPED.labels(kind).inc()
                for listener in self._listeners:
                    listener(entry_key)
            # Evicted meanwhile, its files being deleted: that deletion is waited for, never
            # run twice at once (a fill waiting for the first could race the second).
            pending = self._deleting.get(entry_key)
            self._mark_deleting_locked(entry_key, entry.size if entry is not None else 0)
        log.warning("cache: dropped %s %s: %s", kind, key, why)
        if pending is not None:
            pending.wait()
        else:
            self._delete([entry_key])

    def write_bytes(self, kind: str, key: str, path: Path, data: bytes) -> None:
        """A single-file entry: written to a temporary file, fsynced, renamed, committed."""
        with self.reserving(len(data), f"{kind} {key}"):
            write_atomic(path, data)
            self.commit(kind, key, len(data))

    def claim(self, owner: str, working_set: int, what: str) -> None:
        """Reserve room for an owner's working set (a job's largest windows and its reads in
        flight), refusing if the claims and the unevictable entries exceed the budget."""
        with self._lock:
            others = sum(v for k, v in self._claims.items() if k != owner)
            fixed = self.ledger.fixed
            need = others + fixed + working_set
            if need > self.budget:
                raise CacheTooSmallError(
                    f"disk cache budget {self.budget} bytes (server.cache_bytes) cannot hold "
                    f"the working set of {what}: {working_set} bytes, beside {others} bytes "
                    f"claimed by other jobs and {fixed} bytes of manifests; it needs at least "
                    f"{need} bytes"
                )
            self._claims[owner] = working_set

    def release(self, owner: str) -> None:
        with self._lock:
            self._claims.pop(owner, None)

    def release_unreferenced(self, kind: str, referenced: Callable[[str], bool]) -> int:
        """Make the kept entries of `kind` that `referenced` disowns evictable (manifests of
        chunks no configured job reads any more: an object's old version); the number.
        Walks the entries: once, after every job is planned."""
        with self._lock:
            found = [
                (k, e)
                for k, e in self.ledger.entries.items()
                if k[0] == kind and not e.evictable and not referenced(k[1])
            ]
            for k, entry in found:
                entry.evictable = True
                self.ledger.evictable[k] = None
                self.ledger.fixed -= entry.size
        return len(found)

    # ------------------------------------------------------------ state

    @property
    def used(self) -> int:
        with self._lock:
            return self.ledger.used

    def usage(self) -> dict[str, tuple[int, int]]:
        """kind -> (entries, bytes)."""
        with self._lock:
            return self.ledger.usage()

    def recount(self) -> dict[str, tuple[int, int]]:
        """kind -> (entries, bytes) counted entry by entry (tests: the totals must equal it)."""
        with self._lock:
            return self.ledger.recount(list(self._kinds))

    def _pinned_bytes(self) -> int:
        """At scrape time: bytes of the pinned entries (a few batches' chunks)."""
        with self._lock:
            return sum(self.ledger.entries[k].size for k in self._pins if k in self.ledger.entries)

    # ------------------------------------------------------------ eviction

    def _shrink_to_budget(self) -> None:
        """After a rescan with a smaller budget than before: evict down to the budget."""
        evicted: list[EntryKey] = []
        with self._lock:
            try:
                evicted = self._make_room(0, "rescan")
            except CacheFullError as e:
                log.warning("cache: %s", e)
        self._delete(evicted)

    def _make_room(self, size: int, why: str) -> list[EntryKey]:
        """Evict until `size` more bytes fit (lock held): the evicted entries leave the
        accounting now; the caller deletes their files (`_delete`) once the lock is released.
        Walks the entries only when the budget is exceeded."""
        used = (
            self.ledger.used + self._deleting_bytes
        )  # files of evicted entries not deleted yet count
        excess = used + self._reserved + size - self.budget
        if excess <= 0:
            return []
        candidates = self._candidates_locked()
        if sum(self.ledger.entries[k].size for k in candidates) < excess:
            stuck = used - sum(self.ledger.entries[k].size for k in candidates)
            raise CacheFullError(
                f"disk cache budget {self.budget} bytes cannot hold {size} more bytes for "
                f"{why}: {stuck} bytes are pinned or unevictable and {self._reserved} reserved "
                f"for writes in flight; the cache needs at least {stuck + self._reserved + size} "
                f"bytes (server.cache_bytes)"
            )
        victims = self._victims(candidates, excess)
        for victim in victims:
            size = self.ledger.entries[victim].size
            self.ledger.pop(victim)
            self._mark_deleting_locked(victim, size)
            self.evictions += 1
            metrics.CACHE_EVICTIONS.labels(victim[0]).inc()
            metrics.CACHE_EVICTED_BYTES.labels(victim[0]).inc(size)
            for listener in self._listeners:
                listener(victim)
        return victims

    def _candidates_locked(self) -> list[EntryKey]:
        """What may be evicted now (lock held): the evictable entries not pinned. O(evictable
        entries), called only when the budget is exceeded."""
        return [k for k in self.ledger.evictable if k not in self._pins]

    def _mark_deleting_locked(self, key: EntryKey, size: int) -> None:
        """An entry gone from the accounting whose files are about to be deleted (lock held):
        fills of it wait, and its bytes count against the budget, until `_delete` is done."""
        self._deleting.setdefault(key, threading.Event())
        self._deleting_sizes[key] = self._deleting_sizes.get(key, 0) + size
        self._deleting_bytes += size

    def _delete(self, victims: list[EntryKey]) -> None:
        """Delete evicted or removed entries' files, without the lock (a slow disk never stalls
        the serving path); then fills of them may proceed."""
        for victim in victims:
            try:
                self._kinds[victim[0]].delete(victim[1])
            finally:
                with self._lock:
                    self._deleting_bytes -= self._deleting_sizes.pop(victim, 0)
                    done = self._deleting.pop(victim, None)
                if done is not None:
                    done.set()

    def _victims(
        self, candidates: list[EntryKey], excess: int, incoming: dict[EntryKey, int] | None = None
    ) -> list[EntryKey]:
        """Furthest next use first (Belady); unknown or never-again before anything known;
        least recently used first among equals (an incoming entry counts as just used)."""
        incoming = incoming or {}
        future = self._policy(candidates) if self._policy else [math.inf] * len(candidates)
        now = time.monotonic()

        def size(k: EntryKey) -> int:
            return incoming[k] if k in incoming else self.ledger.entries[k].size

        def used(k: EntryKey) -> float:
            return now if k in incoming else self.ledger.entries[k].used

        ranked = sorted(zip(candidates, future, strict=True), key=lambda kf: (-kf[1], used(kf[0])))
        victims, freed = [], 0
        for key, _ in ranked:
            if freed >= excess:
                break
            victims.append(key)
            freed += size(key)
        return victims
