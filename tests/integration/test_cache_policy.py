"""The cache uses the known future: next-use distances agree with the batches actually served,
and prefetch keeps the chunks of the next steps in the cache before they are asked for."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support import (
    ServerProcess,
    built_job,
    job_spec,
    metric,
    mixture_job,
    scrape,
    write_config,
)
from tokenfeed.server.jobs.future import next_use
from tokenfeed.server.jobs.prefetch import WindowChunks, fetch_steps


@pytest.fixture(scope="module")
def job(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("policy")
    return built_job(tmp / "cache", job_spec([corpus / "*"]), "main")


def first_use(job, start: int, steps: int) -> dict[str, int]:
    """Brute force: the first step at or after `start` whose global batch reads each chunk."""
    seen: dict[str, int] = {}
    for step in range(start, start + steps):
        for d, _, c in sorted(job.chunks_read(job.plan(step, 0, 1))):
            seen.setdefault(job.indexes[d].keys[c], step)
    return seen


def tails(job, step: int) -> set[str]:
    """The chunks that serving `step` reads beyond its rows' own: the tails of the row
    buffers its rows start in (the units their chunks' last rows read on into)."""
    plan = job.plan(step, 0, 1)
    return {
        job.indexes[d].keys[k]
        for d, e, _, p in plan.buffers
        for k in job.planner.tail_chunks(d, e, p)
    }


@pytest.mark.parametrize("first, steps", [(0, 1), (3, 5), (40, 9)])
def test_prefetch_plans_the_chunks_of_whole_global_batches(job, first, steps):
    """What prefetch keeps for steps [first, first + steps), planned in one pass, is what their
    global batches, planned step by step, read: the chunks their rows start in and the tails
    of those chunks' row buffers."""
    expected = set()
    for step in range(first, first + steps):
        plan = job.plan(step, 0, 1)
        expected |= {(d, c) for d, _, c, _ in plan.buffers}
        expected |= {
            (d, k) for d, e, _, p in plan.buffers for k in job.planner.tail_chunks(d, e, p)
        }
    assert job.planner.chunks_of_steps(first, first + steps) == expected


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, texts):
    """Two datasets (3:1, then 1:3 from step 20, 16 rows a step from step 40), built."""
    return mixture_job(tmp_path_factory.mktemp("policy-mix"), texts)


@pytest.fixture(scope="module")
def best_fit(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("policy-fit")
    return built_job(tmp / "cache", job_spec([corpus / "*"], packing="best_fit"), "fit")


@pytest.mark.parametrize("which", ["job", "mixture", "best_fit"])
def test_prefetch_windows_hold_every_chunk_the_steps_read(request, which):
    """Prefetch skips planning rows while the chunks of the windows their rows start in are
    cached: those must include every chunk the rows read (their own and their tails), for
    any stretch of steps, across window and epoch ends (and a mixture's phases), and be
    fewer than all the chunks."""
    job = request.getfixturevalue(which)
    windows = WindowChunks(job)
    spe = max(job.index.rows_per_epoch // job.spec.global_batch_size, 1)
    spans = [(s, k) for k in (1, 4, 9) for s in range(0, 2 * spe + 50, k)]
    for first, steps in spans:
        around = windows.of_steps(first, first + steps)
        assert around is not None
        read = {
            job.indexes[d].keys[c] for d, c in job.planner.chunks_of_steps(first, first + steps)
        }
        assert read <= around, (first, steps, read - around)
        # The last call's windows remembered: the same keys as found afresh.
        assert around == WindowChunks(job).of_steps(first, first + steps), (first, steps)
    assert len(windows.of_steps(0, 1)) < sum(len(i.keys) for i in job.indexes)


def test_prefetch_fetches_a_chunk_evicted_between_two_looks_in_one_window(tmp_path, corpus):
    """A look whose steps' windows are those of the last look (their keys remembered) still
    asks the cache for every one of their chunks: one evicted meanwhile is fetched again."""
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    windows = WindowChunks(job)
    first = next(s for s in range(2, 100) if windows.of_steps(s, s + 2) is windows.of_steps(0, 2))
    read = job.planner.chunks_of_steps(first, first + 2)
    key = min(job.indexes[d].keys[c] for d, c in read)
    with ThreadPoolExecutor(2) as pool:
        asyncio.run(fetch_steps(job, pool, 0, 2, windows))
        job.store.drop(key, "evicted", body_only=True)
        assert not job.store.has_body(key)
        asyncio.run(fetch_steps(job, pool, first, first + 2, windows))
    assert windows.of_steps(first, first + 2) is windows.of_steps(0, 2)
    assert job.store.has_body(key)


def test_prefetch_says_whether_the_steps_chunks_stayed(tmp_path, corpus):
    """A pass of prefetch says whether every chunk of its steps is cached when it ends: in a
    cache too small to hold them all, a chunk fetched for one step evicts another's, and
    prefetch must not count those steps in its lead (keep_ahead fetches again first)."""
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    first, end = 3, 9
    needed = job.planner.chunks_of_steps(first, end)
    keys = [job.indexes[d].keys[c] for d, c in needed]
    size = sum(int(job.indexes[d].body_bytes[c]) for d, c in needed)
    assert len(keys) > 2
    cache, budget = job.store.cache, job.store.cache.budget
    with ThreadPoolExecutor(2) as pool:
        for key in keys:
            job.store.drop(key, "evicted", body_only=True)
        assert asyncio.run(fetch_steps(job, pool, first, end)) is True
        assert job.store.has_bodies(keys)
        for key in keys:
            job.store.drop(key, "evicted", body_only=True)
        cache.budget = size * 2 // 3  # holds some of the steps' chunks, not all of them
        try:
            assert asyncio.run(fetch_steps(job, pool, first, end)) is False
        finally:
            cache.budget = budget
        assert not job.store.has_bodies(keys)


@pytest.mark.parametrize("furthest", [0, 7, 30])
def test_next_use_agrees_with_the_batches_served(job, furthest):
    job.progress.furthest = furthest
    keys = job.index.keys
    estimate = next_use(job, keys)
    actual = first_use(job, furthest, 3 * job.steps_per_epoch)
    assert set(estimate) == set(keys)
    never = set(keys) - set(actual)  # chunks that hold no unit of the stream
    assert all(estimate[k] == float("inf") for k in never)
    window_of = {}
    for key in actual:
        # Never later than the truth: a chunk is needed from the start of its window on (the
        # estimate is in steps, with the row's place within its step as the fraction).
        assert int(estimate[key]) <= actual[key] - furthest, key
        window_of.setdefault(estimate[key], []).append(actual[key])
    # Windows ranked by the estimate are first read in that order.
    firsts = [min(window_of[e]) for e in sorted(window_of)]
    assert firsts == sorted(firsts)
    # The chunks read right now rank nearest, the furthest ones are evicted first.
    nearest = min(actual, key=estimate.get)
    assert actual[nearest] == furthest
    assert max(estimate[k] for k in actual) > 0


def status(proc: ServerProcess) -> dict:
    with urllib.request.urlopen(f"http://{proc.metrics}/status.json", timeout=10) as r:
        return json.loads(r.read())


# Steps read after `start`: fewer than half the lead of 5, so that reading them starts no further
# prefetch, which could evict one of them (a tiny cache; the estimate ranks a window's chunks
# alike) while it is read: the misses counted are then those prefetch left, nothing else.
NEXT = 2


@pytest.mark.parametrize("prefetch_steps", [0, 5])
def test_prefetch_keeps_the_next_steps_in_the_cache(tmp_path, corpus, job, prefetch_steps):
    # A budget below the corpus's token chunks (about 330 KB): some of them are evicted after
    # the build. It holds the chunks of a step and of the next five (at most 170 KB) with room
    # to spare: at 200 KiB, the chunks prefetch fetched while `start` was served evicted one
    # another now and then (a window's chunks rank alike).
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"main": job_spec([corpus / "*"])},
        tmp_path / "cache",
        cache_bytes="256KiB",
        metrics_listen="127.0.0.1:0",
        prefetch_steps=prefetch_steps,
    )
    proc = ServerProcess(cfg, tmp_path / "server.log")
    try:
        info = proc.wait_ready("main")
        assert info["state"] == "JOB_STATE_READY", proc.log()
        assert info["fingerprint"] == job.fingerprint  # the same job as the in-process one
        chunks = [set(first_use(job, s, 1)) for s in range(job.steps_per_epoch)]
        touched = [chunks[s] | tails(job, s) for s in range(job.steps_per_epoch)]
        bodies = tmp_path / "cache" / "tokens"

        def cached(key: str) -> bool:
            return (bodies / key[:2] / f"{key}.bin").exists()

        # The last step of the epoch whose next steps read a chunk it does not and that the build
        # evicted (the chunks needed furthest ahead go first).
        start = next(
            s
            for s in range(job.steps_per_epoch - 6, 0, -1)
            if any(not cached(k) for k in set().union(*chunks[s + 1 : s + 1 + NEXT]) - touched[s])
        )
        later_keys = set().union(*chunks[start + 1 : start + 1 + NEXT]) - touched[start]
        with proc.client("main") as c:
            c.get_batch(start)
            if prefetch_steps:
                deadline = time.monotonic() + 30
                while status(proc)["jobs"][0]["lead_steps"] < prefetch_steps:
                    assert time.monotonic() < deadline, status(proc)
                    time.sleep(0.05)
            else:
                time.sleep(1.0)  # what prefetch would have had
            # The next steps' chunks that are not in the cache now (evicted by the build or by
            # serving `start`): without prefetch each of them is a miss when its step is read.
            absent = {k for k in later_keys if not cached(k)}
            before = scrape(proc.metrics)
            later = [c.get_batch(s) for s in range(start + 1, start + 1 + NEXT)]
            after = scrape(proc.metrics)
        misses = metric(after, "tokenfeed_cache_misses_total", kind="chunk") - metric(
            before, "tokenfeed_cache_misses_total", kind="chunk"
        )
        assert metric(after, "tokenfeed_cache_evictions_total", kind="chunk") > 0
        assert len(later) == NEXT
        if prefetch_steps:
            assert misses == 0
            assert metric(after, "tokenfeed_job_prefetch_lead_steps", tokenfeed_job="main") >= 0
            assert status(proc)["jobs"][0]["furthest_step"] == start + NEXT
        else:  # the control: without prefetch the steps whose chunks are absent wait on rebuilds
            assert absent and misses >= 1, (absent, misses)
        assert np.isfinite(metric(after, "tokenfeed_cache_bytes"))
    finally:
        assert proc.stop() == 0, proc.log()
