"""The small LRU of pure values: bounded by count and bytes, the newest kept."""

from __future__ import annotations

import numpy as np
from tokenfeed.server.diskcache.lru import LRU


def test_get_finds_a_value_and_makes_it_the_newest():
    lru: LRU[str, int] = LRU(2)
    lru.get_or_make("a", lambda: 1)
    lru.get_or_make("b", lambda: 2)
    assert lru.get("a") == 1  # now newer than b
    assert lru.get("missing") is None
    lru.get_or_make("c", lambda: 3)  # evicts the oldest: b
    assert lru.keys() == ["a", "c"]
    assert lru.peek("b") is None


def test_a_byte_budget_binds_before_the_count():
    lru: LRU[int, np.ndarray] = LRU(1 << 20, budget_bytes=3000)
    for i in range(10):
        lru.get_or_make(i, lambda: np.zeros(1000, dtype=np.uint8))
    assert lru.keys() == [7, 8, 9]
