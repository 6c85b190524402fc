"""A small thread-safe LRU for values that are pure functions of their keys (layouts, window
permutations, opened chunks, laid-out streams), bounded in items and optionally in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A small thread-safe LRU; `make` runs outside the lock (two threads may both make a
    value on a miss: every value here is a pure function of its key, so either is right)."""

    def __init__(self, capacity: int, budget_bytes: int = 0):
        """`capacity` items; with `budget_bytes`, also at most that many bytes of values
        (numpy arrays: their nbytes), always keeping the newest."""
        self.capacity, self.budget = capacity, budget_bytes
        self._items: OrderedDict[K, V] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def contains(self, key: K) -> bool:
        with self._lock:
            return key in self._items

    def peek(self, key: K) -> V | None:
        """The value of `key` if present (its recency unchanged), else None."""
        with self._lock:
            return self._items.get(key)

    def get(self, key: K) -> V | None:
        """The value of `key` if present (now the most recent), else None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._items)

    def discard(self, key: K) -> None:
        with self._lock:
            self._bytes -= self._size(self._items.pop(key, None))

    def _size(self, value: V | None) -> int:
        return int(getattr(value, "nbytes", 0)) if self.budget else 0

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()
        with self._lock:
            if key not in self._items:
                self._items[key] = value
                self._bytes += self._size(value)
            while len(self._items) > 1 and (
                len(self._items) > self.capacity or self.budget and self._bytes > self.budget
            ):
                self._bytes -= self._size(self._items.popitem(last=False)[1])
        return value
