"""Disk cache mechanics on real files: budget, pins, single flight, rescan, eviction order."""

from __future__ import annotations

import contextlib
import math
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tokenfeed.server.diskcache.cache import DiskCache, Kind
from tokenfeed.server.errors import CacheFullError, CacheTooSmallError
from tokenfeed.server.objstore.blockfiles import BlockFiles
from tokenfeed.server.store.tokstore import TokenStore


def files_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def put_block(blocks: BlockFiles, key: str, size: int, fill_byte: int = 1) -> bytes:
    return blocks.get(key, lambda: bytes([fill_byte]) * size)


def test_budget_is_never_exceeded_and_least_recent_goes_first(tmp_path):
    cache = DiskCache(tmp_path, budget=1000)
    blocks = BlockFiles(cache)
    for i in range(10):
        put_block(blocks, f"k{i}", 300)
        assert files_bytes(tmp_path) <= 1000
    assert cache.evictions == 7
    assert cache.contains("block", "k9") and not cache.contains("block", "k6")
    assert cache.usage()["block"] == (3, 900)


def test_policy_evicts_what_is_needed_furthest_in_the_future(tmp_path):
    cache = DiskCache(tmp_path, budget=1000)
    blocks = BlockFiles(cache)
    next_use = {"near": 1.0, "far": 50.0, "never": math.inf}
    cache.set_policy(lambda cands: [next_use.get(k, 0.0) for _, k in cands])
    for key in ("never", "far", "near"):
        put_block(blocks, key, 300)
    put_block(blocks, "new", 300)  # needs room for one: the never-again entry goes
    assert not cache.contains("block", "never")
    put_block(blocks, "new2", 300)
    assert not cache.contains("block", "far") and cache.contains("block", "near")


def test_pinned_entries_are_never_evicted_and_a_full_cache_says_what_it_needs(tmp_path):
    cache = DiskCache(tmp_path, budget=1000)
    blocks = BlockFiles(cache)
    put_block(blocks, "a", 400)
    put_block(blocks, "b", 400)
    with cache.pinned([("block", "a"), ("block", "b")]):
        with pytest.raises(CacheFullError, match=r"needs at least 1200 bytes"):
            put_block(blocks, "c", 400)
    assert cache.contains("block", "a") and cache.contains("block", "b")
    put_block(blocks, "c", 400)  # unpinned: now one of them can go
    assert files_bytes(tmp_path) <= 1000


def test_pins_taken_before_an_entry_exists_hold_once_it_does(tmp_path):
    cache = DiskCache(tmp_path, budget=700)
    blocks = BlockFiles(cache)
    with cache.pinned([("block", "later")]):
        put_block(blocks, "later", 300)
        put_block(blocks, "x", 300)
        put_block(blocks, "y", 300)  # must evict x, not the pinned entry
        assert cache.contains("block", "later") and not cache.contains("block", "x")


def test_concurrent_misses_on_one_key_fill_once(tmp_path):
    blocks = BlockFiles(DiskCache(tmp_path, budget=10**6))
    calls = []

    def slow_fill() -> bytes:
        calls.append(1)
        time.sleep(0.2)
        return b"z" * 100

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(blocks.get("k", slow_fill)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [b"z" * 100] * 8


def test_a_failed_fill_lets_the_next_caller_try_again(tmp_path):
    blocks = BlockFiles(DiskCache(tmp_path, budget=10**6))

    def broken() -> bytes:
        raise OSError("network down")

    with pytest.raises(OSError):
        blocks.get("k", broken)
    assert blocks.get("k", lambda: b"ok") == b"ok"


def test_rescan_keeps_complete_blocks_and_drops_partial_and_corrupt_ones(tmp_path):
    blocks = BlockFiles(DiskCache(tmp_path, budget=10**6))
    put_block(blocks, "good", 100, 7)
    put_block(blocks, "bad", 100, 8)
    (bad_file,) = (tmp_path / "blocks").rglob("bad.*.blk")
    bad_file.write_bytes(b"\x09" * 100)  # same size, other content: the name's digest differs
    partial = tmp_path / "blocks" / "zz" / "zzz.blk.abc.tmp"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"half")

    cache = DiskCache(tmp_path, budget=10**6)
    fresh = BlockFiles(cache)
    assert not partial.exists()
    assert cache.contains("block", "good") and cache.contains("block", "bad")
    assert fresh.get("good", lambda: pytest.fail("refetched a good block")) == b"\x07" * 100
    # The corrupt one is caught on its first read in the new process, dropped and refetched.
    assert fresh.get("bad", lambda: b"\x08" * 100) == b"\x08" * 100
    assert [p.read_bytes() for p in (tmp_path / "blocks").rglob("bad.*.blk")] == [b"\x08" * 100]


def test_rescan_with_a_smaller_budget_evicts_down_to_it(tmp_path):
    blocks = BlockFiles(DiskCache(tmp_path, budget=10**6))
    for i in range(5):
        put_block(blocks, f"k{i}", 300)
    cache = DiskCache(tmp_path, budget=700)
    BlockFiles(cache)
    assert cache.used <= 700 and files_bytes(tmp_path) <= 700


def test_token_chunks_share_the_budget_and_manifests_are_kept(tmp_path):
    cache = DiskCache(tmp_path, budget=5000)
    store = TokenStore(tmp_path, cache)
    tokens = np.arange(200, dtype=np.int32)  # 800 bytes of tokens per chunk
    lengths = np.array([100, 100], dtype=np.int32)
    keys = [f"{i:02d}" + "ab" * 15 for i in range(6)]
    for key in keys:
        store.put(key, tokens, lengths, 2, {}, [], "src")
        assert files_bytes(tmp_path) <= 5000
    assert cache.evictions > 0
    evicted = [k for k in keys if not store.has_body(k)]
    assert evicted and all(store.get_index(k) is not None for k in keys)


def test_claims_refuse_a_working_set_the_budget_cannot_hold(tmp_path):
    cache = DiskCache(tmp_path, budget=1000)
    cache.claim("a", 600, "job a")
    with pytest.raises(CacheTooSmallError, match=r"job b: 500 bytes.*at least 1100 bytes"):
        cache.claim("b", 500, "job b")
    cache.claim("a", 300, "job a")  # a job's claim replaces its earlier one
    cache.claim("b", 500, "job b")


# -- O(1) per request: running totals, no walk on the serving path, deletion without the lock


def check_totals(cache: DiskCache, root: Path) -> None:
    """The running totals equal a recount, entry by entry, and nothing is left half-deleted."""
    counted = cache.recount()
    assert cache.usage() == counted
    assert cache.used == sum(b for _, b in counted.values())
    entries = dict(cache.ledger.entries)
    assert cache.ledger.fixed == sum(e.size for e in entries.values() if not e.evictable)
    assert set(cache.ledger.evictable) == {k for k, e in entries.items() if e.evictable}
    assert not cache._deleting and cache._deleting_bytes == 0
    assert files_bytes(root) <= cache.budget


KEYS = [f"{i:032x}" for i in range(12)]  # valid token-chunk keys, also used as block keys
_OP_ARGS = {
    "block": st.tuples(st.sampled_from(KEYS), st.integers(1, 900)),
    "chunk": st.tuples(st.sampled_from(KEYS[:4]), st.integers(1, 120)),
    "remove": st.tuples(st.sampled_from(["block", "chunk", "manifest"]), st.sampled_from(KEYS)),
    "pin": st.tuples(st.sampled_from(["block", "chunk"]), st.sampled_from(KEYS)),
    "unpin": st.tuples(),
    "release": st.tuples(st.sets(st.sampled_from(KEYS[:4]))),
    "rescan": st.tuples(),
}
# Mostly writes, so the budget is exceeded often.
OPS = st.sampled_from(
    ["block"] * 4 + ["chunk"] * 2 + ["remove", "pin", "unpin", "release", "rescan"]
).flatmap(lambda name: _OP_ARGS[name].map(lambda args: (name, *args)))


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(OPS, min_size=10, max_size=60), budget=st.integers(1500, 3000))
def test_running_totals_equal_a_recount_under_any_sequence(ops, budget):
    """Commits, evictions (a small budget), removes, pins held across operations, manifests
    made evictable and rescans: after each, the totals equal a full recount."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = DiskCache(root, budget)
        blocks, store = BlockFiles(cache), TokenStore(root, cache)
        held: list[contextlib.ExitStack] = []
        evictions = 0
        for i, op in enumerate(ops):
            try:
                if op[0] == "block":
                    put_block(blocks, op[1], op[2])
                elif op[0] == "chunk":  # a body (evictable) and a manifest (kept)
                    tokens = np.arange(op[2], dtype=np.uint16)
                    store.put(op[1], tokens, np.array([op[2]], dtype=np.int32), 1, {}, [], "t")
                elif op[0] == "remove":
                    cache.remove(op[1], op[2], "test")
                elif op[0] == "pin":
                    held.append(contextlib.ExitStack())
                    held[-1].enter_context(cache.pinned([(op[1], op[2])]))
                elif op[0] == "unpin" and held:
                    held.pop().close()
                elif op[0] == "release":
                    cache.release_unreferenced("manifest", op[1].__contains__)
                elif op[0] == "rescan":
                    while held:
                        held.pop().close()
                    before, evictions = cache.usage(), evictions + cache.evictions
                    cache = DiskCache(root, budget)
                    blocks, store = BlockFiles(cache), TokenStore(root, cache)
                    # The rescan finds what was accounted; but for bodies whose manifest was
                    # evicted (once released): tokstore deletes a manifest's body files with it.
                    after = cache.usage()
                    assert {k: v for k, v in after.items() if k != "chunk"} == {
                        k: v for k, v in before.items() if k != "chunk"
                    }
                    assert after["chunk"] <= before["chunk"]
            except CacheFullError:
                event("a write refused: pins and kept manifests left no room")
            check_totals(cache, root)
            assert sum(cache._pins.values()) == len(held), f"after operation {i}: {op}"
        event("evicted" if evictions + cache.evictions else "nothing evicted")


class Walked(Exception):
    pass


class NoWalk(dict):
    """A dict that refuses to be iterated: lookups, inserts and pops only."""

    def values(self):
        raise Walked

    def items(self):
        raise Walked

    def keys(self):
        raise Walked

    def __iter__(self):
        raise Walked


def test_the_serving_path_never_walks_the_entries(tmp_path, monkeypatch):
    cache = DiskCache(tmp_path, budget=10**9)
    blocks = BlockFiles(cache)
    for i in range(2000):
        put_block(blocks, f"k{i}", 10)
    calls = {"candidates": 0, "recount": 0}
    real = cache._candidates_locked

    def candidates():
        calls["candidates"] += 1
        return real()

    monkeypatch.setattr(cache, "_candidates_locked", candidates)
    monkeypatch.setattr(cache, "recount", lambda: calls.__setitem__("recount", 1))
    monkeypatch.setattr(cache.ledger, "entries", NoWalk(cache.ledger.entries))
    monkeypatch.setattr(cache.ledger, "evictable", NoWalk(cache.ledger.evictable))
    for i in range(200):  # what every batch does: pin, look up, unpin
        with cache.pinned([("block", f"k{i}"), ("chunk", f"c{i}")]):
            assert cache.lookup("block", f"k{i}") and cache.contains("block", f"k{i}")
    assert cache.used == 20000 and cache.usage()["block"] == (2000, 20000)
    put_block(blocks, "new", 10)  # under the budget: no walk either
    assert calls == {"candidates": 0, "recount": 0}


def test_making_room_walks_the_evictable_entries_only(tmp_path, monkeypatch):
    """A corpus of many chunks keeps a manifest per chunk: eviction never walks them."""
    cache = DiskCache(tmp_path, budget=60_000)
    manifests = [(f"m{i}", 10) for i in range(5000)]
    cache.register(Kind("manifest", lambda: manifests, lambda key: None, evictable=False))
    blocks = BlockFiles(cache)
    for i in range(3):
        put_block(blocks, f"k{i}", 3000)
    walked: list[int] = []
    real = cache._candidates_locked
    monkeypatch.setattr(cache, "_candidates_locked", lambda: walked.append(1) or real())
    monkeypatch.setattr(cache.ledger, "entries", NoWalk(cache.ledger.entries))
    put_block(blocks, "k3", 3000)  # over the budget: one block goes, found among 3 entries
    assert walked == [1] and cache.evictions == 1
    assert len(real()) == 3 and cache.usage()["manifest"] == (5000, 50_000)


def test_evicted_files_are_deleted_without_the_lock(tmp_path):
    cache = DiskCache(tmp_path, budget=1000)
    blocks = BlockFiles(cache)
    for i in range(3):
        put_block(blocks, f"k{i}", 300)
    kind = cache._kinds["block"]
    seen = []
    deleting = threading.Event()
    proceed = threading.Event()

    def slow_delete(key: str) -> None:
        seen.append(cache._lock.locked())
        deleting.set()
        proceed.wait(5)
        kind.delete(key)

    cache._kinds["block"] = type(kind)(kind.name, kind.scan, slow_delete, kind.evictable)
    writer = threading.Thread(target=put_block, args=(blocks, "k3", 300))
    writer.start()
    assert deleting.wait(5)
    # While the evicted file is being deleted, the serving path goes on.
    started = time.monotonic()
    assert cache.contains("block", "k2") and cache.lookup("block", "k1")
    with cache.pinned([("block", "k2")]):
        pass
    assert time.monotonic() - started < 1.0
    # A fill of the key being deleted waits for the deletion (its new files survive).
    refill = threading.Thread(target=put_block, args=(blocks, "k0", 300, 2))
    refill.start()
    time.sleep(0.2)
    assert refill.is_alive()
    proceed.set()
    writer.join(5)
    refill.join(5)
    assert seen and not any(seen), "files were deleted with the cache lock held"
    assert put_block(blocks, "k0", 300) == bytes([2]) * 300
    assert files_bytes(tmp_path) <= 1000


def test_a_removed_entry_is_deleted_without_the_lock_and_refilled_after(tmp_path):
    cache = DiskCache(tmp_path, budget=10_000)
    blocks = BlockFiles(cache)
    put_block(blocks, "bad", 300, 1)
    put_block(blocks, "other", 300)
    kind = cache._kinds["block"]
    seen, deleting, proceed = [], threading.Event(), threading.Event()

    def slow_delete(key: str) -> None:
        seen.append(cache._lock.locked())
        deleting.set()
        proceed.wait(5)
        kind.delete(key)

    cache._kinds["block"] = type(kind)(kind.name, kind.scan, slow_delete, kind.evictable)
    remover = threading.Thread(target=cache.remove, args=("block", "bad", "test"))
    remover.start()
    assert deleting.wait(5)
    assert not cache.contains("block", "bad")  # absent as soon as it is being deleted
    assert cache.contains("block", "other") and cache.lookup("block", "other")
    refill = threading.Thread(target=put_block, args=(blocks, "bad", 300, 2))
    refill.start()
    time.sleep(0.2)
    assert refill.is_alive()  # waits for the deletion, so it cannot remove the new file
    proceed.set()
    remover.join(5)
    refill.join(5)
    assert seen == [False]
    assert put_block(blocks, "bad", 300) == bytes([2]) * 300
    check_totals(cache, tmp_path)


def test_unreferenced_manifests_become_evictable(tmp_path):
    cache = DiskCache(tmp_path, budget=10_000)
    store = TokenStore(tmp_path, cache)
    keys = [f"{i:032x}" for i in range(4)]
    for k in keys:
        tokens = np.arange(5, dtype=np.uint16)
        store.put(k, tokens, np.array([5], dtype=np.int32), 1, {}, [], "test")
    fixed = cache.recount()["manifest"][1]
    with pytest.raises(CacheTooSmallError):  # the manifests are kept: they take the room
        cache.claim("job", 10_000 - fixed + 1, "a job")
    assert cache.release_unreferenced("manifest", lambda k: k in keys[:1]) == 3
    cache.claim("job", 10_000 - fixed // 4 - 1, "a job")  # three manifests no longer count
    assert cache.release_unreferenced("manifest", lambda k: k in keys[:1]) == 0
