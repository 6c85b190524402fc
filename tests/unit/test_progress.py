"""A job's progress: the furthest step of its active ranks, which prefetch and eviction follow."""

from __future__ import annotations

import asyncio
import random

from tokenfeed.server.jobs import progress as progress_mod
from tokenfeed.server.jobs.progress import RANK_EXPIRY_SECONDS, Progress


def test_furthest_is_the_active_ranks_maximum_under_any_sequence():
    """Two world sizes asking in any order, none silent long enough to stop being active."""
    rng = random.Random(5)
    p, latest, now = Progress(), {}, 1000.0
    for _ in range(3000):
        rank, world = rng.randrange(8), rng.choice((4, 8))
        step = rng.randrange(200) if rng.random() < 0.1 else max(latest.values(), default=0) + 1
        now += rng.random() * 1e-3
        p.note(step, rank, world, now)
        latest[(rank, world)] = step
        assert p.furthest == max(latest.values())
        assert p._at_furthest == sum(s == p.furthest for s in latest.values())


def test_a_rollback_moves_prefetch_back():
    p = Progress()
    for step in range(100):
        for rank in range(4):
            p.note(step, rank, 4, 1000.0 + step)
    p.prefetched = 108
    assert p.furthest == 99
    # Every rank restarts from the checkpoint at step 40.
    for rank in range(4):
        p.note(40, rank, 4, 2000.0)
    assert p.furthest == 40 and p.prefetched == 40  # prefetch starts again at 41
    p.note(41, 0, 4, 2001.0)
    assert p.furthest == 41


def test_silent_ranks_expire():
    p = Progress()
    p.note(500, 0, 2, 1000.0)  # a rank that no longer asks
    p.note(10, 1, 2, 1000.0 + RANK_EXPIRY_SECONDS + 1)
    assert p.furthest == 500  # not swept yet: at most every SWEEP_SECONDS
    p._swept -= progress_mod.SWEEP_SECONDS + 1
    p.note(11, 1, 2, 1000.0 + RANK_EXPIRY_SECONDS + 2)
    assert p.furthest == 11 and (0, 2) not in p.ranks


def test_the_common_path_never_walks_the_ranks(monkeypatch):
    p = Progress()
    for rank in range(1000):
        p.note(0, rank, 1000, 1000.0)
    calls = []
    monkeypatch.setattr(p, "_recompute", lambda now: calls.append(now))
    for step in range(1, 50):  # ranks advance in lock step
        for rank in range(1000):
            p.note(step, rank, 1000, 1000.0 + step)
    assert calls == []


def test_a_waiter_wakes_at_the_step_it_waits_for_or_a_rollback():
    """Prefetch waits for the step its next look is due at: earlier steps do not wake it."""

    async def run() -> list[str]:
        p, woke = Progress(), []
        p.note(10, 0, 1, 1000.0)

        async def wait(step: int) -> None:
            await p.reaches(step)
            woke.append(f"{step} at {p.furthest}")

        await p.reaches(0)  # the advance to 10 happened before any wait: it wakes at once
        for step, moves in [(14, [11, 12, 13, 14]), (20, [15, 16, 3])]:
            task = asyncio.create_task(wait(step))
            for s in moves:
                await asyncio.sleep(0)
                assert not task.done(), (step, s)
                p.note(s, 0, 1, 1000.0 + s)  # one rank: a lower step is a rollback
            await asyncio.wait_for(task, 1.0)
        return woke

    assert asyncio.run(run()) == ["14 at 14", "20 at 3"]


def test_a_run_restarted_at_a_new_size_moves_prefetch_to_its_ranks_within_seconds():
    """Elastic training: the ranks of the old size stopped (a restart takes longer than
    RESIZE_SECONDS); once the new size has asked for RESIZE_SECONDS their steps stop holding
    prefetch, not 10 minutes on. A tool that asks once at another size in a pause does not."""
    p = Progress()
    for step in range(300, 400):
        for rank in range(16):
            p.note(step, rank, 16, 1000.0 + step / 10)
    assert p.furthest == 399
    p.prefetched = 407
    p.note(0, 0, 1, 1045.0)  # a checkpoint pause; someone reads step 0 with the CLI
    assert p.furthest == 399 and p.prefetched == 407
    restart = 1100.0  # the new run resumes an earlier checkpoint with 8 ranks
    for k, step in enumerate(range(120, 126)):
        for rank in range(8):
            p.note(step, rank, 8, restart + k * 0.5)
        if k * 0.5 < progress_mod.RESIZE_SECONDS:
            assert p.furthest == 399  # the old run's ranks still hold it
    # Moved back at the first request RESIZE_SECONDS after the new size's first (step 124);
    # prefetch starts again from there.
    assert p.furthest == 125 and p.prefetched == 124
    assert len(p.ranks) == 16 + 1 + 8  # the status page still lists every rank heard from
    p.note(126, 0, 8, restart + 3.1)
    assert p.furthest == 126


def test_another_size_that_goes_on_asking_keeps_holding_prefetch(monkeypatch):
    """An evaluation of 2 ranks reading further on than a training run of 8: while both ask in
    turn both hold prefetch (the furthest is the evaluation's); once the evaluation stops and the
    training has asked alone for RESIZE_SECONDS, the training's step is the furthest."""
    clock = [5000.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    p, now = Progress(), 1000.0
    for step in range(50):
        now += 0.3
        clock[0] += 0.3
        for rank in range(8):
            p.note(100 + step, rank, 8, now)
        for rank in range(2):
            p.note(900 + step, rank, 2, now)
        assert p.furthest == 900 + step
    for step in range(50, 60):  # the evaluation has ended
        now += 0.5
        clock[0] += 0.5
        for rank in range(8):
            p.note(100 + step, rank, 8, now)
    assert p.furthest == 159 and len(p.ranks) == 10
