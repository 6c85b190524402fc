"""Row buffers laid out ahead of the trainers by the process that owns the cache
(jobs/layahead.py): the window of the furthest request and the next few, once each, only where
the budget holds them; the same buffers (the same bytes) a stream lays out; with serving
workers, the supervisor lays them out into the node's shared buffers before a worker reads
them."""

from __future__ import annotations

import time

import numpy as np
import pytest
from support import built_job, job_spec, metric, mixture_job, scrape, workers_server
from tokenfeed.server.jobs import layahead
from tokenfeed.server.pack import arenaformat, sharedrows

BIG = 1 << 30


def _window_of(job, step: int) -> tuple[int, int]:
    """(epoch, window) of the first row of a step of a one-dataset job."""
    idx, rows = job.planner.indexes[0], job.planner.schedule.rows_of_steps(step, step + 1)[1]
    row = int(rows.min())
    e = row * idx.per_row // idx.units_per_epoch
    lay = job.planner.layout(0, e)
    return e, int(lay.window_rows.searchsorted(row, side="right")) - 1


def _windows(keys) -> set[tuple[int, int]]:
    return {(e, p) for _, e, _, p in keys}


def _following(job, e: int, w: int, count: int) -> list[tuple[int, int]]:
    """(epoch, window) of window w of epoch e and of the `count` windows after it."""
    out = [(e, w)]
    while len(out) <= count:
        e, w = out[-1]
        windows = len(job.planner.layout(0, e).window_rows) - 1
        out.append((e, w + 1) if w + 1 < windows else (e + 1, 0))
    return out


def _expected(job, windows) -> list[tuple[int, int, int, int]]:
    """The keys of these windows: nearest first, each last position first."""
    out = []
    for e, w in windows:
        lay = job.planner.layout(0, e)
        n, wc = len(lay.chunk_order), lay.window_chunks
        out += [
            (0, e, int(lay.chunk_order[p]), p)
            for p in reversed(range(w * wc, min((w + 1) * wc, n)))
        ]
    return out


def test_the_furthest_window_and_the_next_ones_are_handed_out_once(tmp_path, corpus, monkeypatch):
    # 3 windows ahead: this corpus's epochs hold 8 windows, more than the windows handed out.
    monkeypatch.setattr(layahead, "WINDOWS_AHEAD", 3)
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    ahead = layahead.WindowLayouts(job, BIG)
    k = layahead.WINDOWS_AHEAD
    lay = job.planner.layout(0, 0)
    assert len(lay.window_rows) - 1 > k + 1  # more windows in an epoch than are laid out ahead
    assert ahead.keys_ahead(0) == _expected(job, _following(job, 0, 0, k))
    assert ahead.keys_ahead(0) == []  # handed out once
    # A step in window 1: only the window k after it is new.
    step = next(s for s in range(10_000) if _window_of(job, s) == (0, 1))
    assert ahead.keys_ahead(step) == _expected(job, _following(job, 0, 1, k)[-1:])
    # Near an epoch's end the windows ahead are the next epoch's first ones.
    last = len(lay.window_rows) - 2
    step = next(s for s in range(10_000) if _window_of(job, s) == (0, last))
    got = ahead.keys_ahead(step)
    assert got == _expected(job, [w for w in _following(job, 0, last, k) if w[1] > 1 or w[0] > 0])
    assert {key[1] for key in got} == {0, 1}


def test_looks_hand_out_the_windows_of_each_step_once_across_an_epoch_end(tmp_path, corpus):
    """Looks every few steps (each dataset's last window remembered) hand out, at each step,
    the windows of its first row and the next few not handed out before, in order: the same
    as found from that step's rows alone, across windows and an epoch end, and after a
    rollback."""
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    ahead, done = layahead.WindowLayouts(job, BIG), set()
    spe = job.steps_per_epoch
    steps = [*range(0, 2 * spe + 10, 3), *range(spe // 2, spe + 10, 2)]
    assert {_window_of(job, s)[0] for s in steps} == {0, 1, 2}  # two epochs' ends
    for step in steps:
        want = [w for w in _following(job, *_window_of(job, step), layahead.WINDOWS_AHEAD)]
        want = [w for w in want if w not in done]
        done.update(want)
        assert ahead.keys_ahead(step) == _expected(job, want), step


@pytest.mark.parametrize("which", ["one", "mixture"])
def test_a_remembered_window_hands_out_what_a_fresh_walk_does(tmp_path, corpus, texts, which):
    """Each look hands out exactly what a WindowLayouts that remembers no window (with the
    same windows handed out) hands out: under a budget that holds only some windows ahead,
    a memory of handed-out windows so short that it is forgotten meanwhile, across windows,
    epochs, a mixture's phases, and back after a rollback."""
    if which == "one":
        job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
        end = 2 * job.steps_per_epoch + 10
    else:
        job = mixture_job(tmp_path, texts)
        end = 240  # the second dataset's 2nd epoch end; the first's 4th window
    lay = job.planner.layout(0, 0)
    sizes = [layahead.WindowLayouts(job, BIG)._bytes(0, lay, w) for w in range(3)]
    steps = [*range(0, end, 3), *range(end // 3, end // 2)]
    for budget, kept in [(BIG, layahead.WINDOWS_DONE), (sum(sizes) + sizes[2], 5)]:
        ahead, epochs = layahead.WindowLayouts(job, budget), set()
        for step in steps:
            fresh = layahead.WindowLayouts(job, budget)
            fresh._done = set(ahead._done)
            layahead.WINDOWS_DONE, was = kept, layahead.WINDOWS_DONE
            try:
                got, want = ahead.keys_ahead(step), fresh.keys_ahead(step)
            finally:
                layahead.WINDOWS_DONE = was
            assert got == want, (budget, step)
            assert ahead._done == fresh._done
            epochs |= {key[1] for key in got}
        assert {0, 1, 2} <= epochs


def test_a_budget_that_holds_one_window_lays_out_only_the_current_one(tmp_path, corpus):
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    lay = job.planner.layout(0, 0)
    sizes = [layahead.WindowLayouts(job, BIG)._bytes(0, lay, w) for w in range(3)]
    ahead = layahead.WindowLayouts(job, sizes[0] + 2 * sizes[1] - 1)  # not the next one
    assert ahead.keys_ahead(0) == _expected(job, [(0, 0)])
    # One more window's room: the next one too.
    ahead = layahead.WindowLayouts(job, sizes[0] + 2 * sizes[1])
    assert ahead.keys_ahead(0)[: lay.window_chunks * 2] == _expected(job, [(0, 0), (0, 1)])


def test_a_supervisor_lays_out_at_most_half_the_nodes_arena_ahead(tmp_path, corpus):
    """With serving workers the arena holds what is laid out ahead, beside what the workers
    hold in place: a supervisor lays out only what half the arena holds, whatever the row
    budget (pack/sharedrows.py)."""
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    lay = job.planner.layout(0, 0)
    sizes = [layahead.WindowLayouts(job, BIG)._bytes(0, lay, w) for w in range(2)]
    assert len(_windows(layahead.WindowLayouts(job, BIG).keys_ahead(0))) > 1
    page = arenaformat.DATA_START
    segment = ((sizes[0] + 2 * sizes[1]) * 2 - page - 1) // arenaformat.SEGMENTS // page * page
    arena = sharedrows.SharedRows(tmp_path / "shm", page + arenaformat.SEGMENTS * segment)
    assert arena.budget // 2 < sizes[0] + 2 * sizes[1]  # half of it: not the next window
    job.assembler.rows.shared = arena
    assert layahead.WindowLayouts(job, BIG).keys_ahead(0) == _expected(job, [(0, 0)])


def test_buffers_laid_out_ahead_are_those_a_stream_lays_out(tmp_path, corpus):
    spec = job_spec([corpus / "*"])
    ahead_job = built_job(tmp_path / "a", spec)
    plain_job = built_job(tmp_path / "b", spec)
    keys = layahead.WindowLayouts(ahead_job, BIG).keys_ahead(0)
    assert layahead.lay_out(ahead_job, keys) == len(keys) > 0
    assert layahead.lay_out(ahead_job, keys) == 0  # already laid out: nothing again
    rows = ahead_job.assembler.rows
    assert all(rows.buffers.contains(k[:3]) for k in keys)
    for step in range(12):  # the batches read from them equal a job's that laid out nothing
        a, b = ahead_job.batch(step, 0, 1)[1], plain_job.batch(step, 0, 1)[1]
        assert all(np.array_equal(a[name], b[name]) for name in a)
    for d, e, c, p in keys:
        got, want = rows.row_buffer(d, e, c, p), plain_job.assembler.rows.row_buffer(d, e, c, p)
        assert np.array_equal(got.ids, want.ids) and np.array_equal(got.starts, want.starts)


def test_laying_out_ahead_fetches_nothing(tmp_path, corpus):
    """A buffer ahead whose chunk, or a chunk its tail reads, is not in the cache is left to
    the streams: laying out ahead rebuilds no chunk (that would evict one the next steps
    read from a cache that holds little more than them) and lays out the others."""
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    keys = layahead.WindowLayouts(job, BIG).keys_ahead(0)
    tails = {k: set(job.planner.tail_chunks(k[0], k[1], k[3])) for k in keys}
    gone = next(k[2] for k in keys if any(k[2] in t for t in tails.values()))  # a tail's too
    name = job.indexes[0].keys[gone]
    job.store.drop(name, "evicted", body_only=True)
    left = {k for k in keys if gone == k[2] or gone in tails[k]}
    assert len(left) >= 2
    assert layahead.lay_out(job, keys) == len(keys) - len(left)
    assert not job.store.has_body(name)
    rows = job.assembler.rows
    assert {k for k in keys if not rows.buffers.contains(k[:3])} == left
    # The stream reads them as before: it rebuilds the chunk itself.
    plain = built_job(tmp_path / "plain", job_spec([corpus / "*"]))
    for step in range(6):
        a, b = job.batch(step, 0, 1)[1], plain.batch(step, 0, 1)[1]
        assert all(np.array_equal(a[n], b[n]) for n in a)
    assert job.store.has_body(name)


def test_a_supervisor_lays_out_the_next_window_for_its_workers(tmp_path, corpus):
    proc = workers_server(tmp_path, corpus)
    try:
        job = built_job(tmp_path / "probe", job_spec([corpus / "*"]))
        lay = job.planner.layout(0, 0)
        wc = lay.window_chunks
        with proc.client("main") as c:
            c.get_batch(0)  # the first step: window 0 of epoch 0
        # Window 1's buffers appear although no worker read a row of it.
        rows = arenaformat.node_dir(tmp_path / "cache")
        want = {f"0-0-0-{int(lay.chunk_order[p])}" for p in range(wc, 2 * wc)}
        deadline = time.monotonic() + 30
        while not want <= {p.name for p in rows.rglob("0-0-0-*")}:
            assert time.monotonic() < deadline, sorted(p.name for p in rows.rglob("*"))
            time.sleep(0.1)
        time.sleep(1.5)  # the workers send their counters every second
        samples = scrape(proc.metrics)
        files = [
            p
            for p in rows.rglob("*")
            if p.is_file() and p.parent != rows and not p.name.endswith(".lock")
        ]
        # Each buffer laid out once (by the supervisor or a worker; its entry beside the arena),
        # none unshared.
        assert metric(samples, "tokenfeed_row_buffers_total", outcome="laid_out") == len(files)
        assert metric(samples, "tokenfeed_row_buffers_total", outcome="unshared") == 0
    finally:
        assert proc.stop() == 0, proc.log()
