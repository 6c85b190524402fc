"""The sync client's read-ahead hand-off (_prefetch.Handoff): bounded (the read-ahead thread
stops once `depth` batches wait, which is the stream's flow control), in order, across threads."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from tokenfeed.client._prefetch import Handoff


def test_a_full_handoff_refuses_until_a_place_is_freed():
    h = Handoff(2)
    assert h.put("a", timeout=0.01) and h.put("b", timeout=0.01)
    started = time.monotonic()
    assert not h.put("c", timeout=0.05)  # full: refused after the timeout
    assert time.monotonic() - started >= 0.05
    assert h.get(timeout=0.01) == "a"
    assert h.put("c", timeout=0.01)  # a place freed
    assert [h.get(timeout=0.01), h.get(timeout=0.01)] == ["b", "c"]
    with pytest.raises(queue.Empty):
        h.get(timeout=0.01)


def test_items_pass_between_threads_in_order_and_never_more_than_depth_wait():
    h, depth, n = Handoff(3), 3, 2000
    most = [0]
    waiting = [0]
    lock = threading.Lock()

    def produce() -> None:
        for i in range(n):
            while not h.put(i, timeout=0.1):
                pass
            with lock:
                waiting[0] += 1
                most[0] = max(most[0], waiting[0])

    t = threading.Thread(target=produce)
    t.start()
    got = []
    for _ in range(n):
        item = h.get(timeout=5)
        with lock:
            waiting[0] -= 1
        got.append(item)
        if len(got) % 100 == 0:
            time.sleep(0.005)  # a slow consumer now and then: the producer fills up and waits
    t.join()
    assert got == list(range(n))
    assert most[0] <= depth + 1  # depth queued, and at most one counted before its get
