"""Row buffers laid out a window ahead of the trainers by the process that owns the cache
(jobs/layahead.py): the window of the furthest request and the next one, once each, only where
the budget holds both; the same buffers (the same bytes) a stream lays out; with serving
workers, the supervisor lays them out into the node's shared buffers before a worker reads
them."""

from __future__ import annotations

import time

import numpy as np
from support import ServerProcess, built_job, job_spec, metric, scrape, write_config
from tokenfeed.server.jobs import layahead
from tokenfeed.server.pack import sharedrows

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


def test_the_furthest_window_and_the_next_are_handed_out_once(tmp_path, corpus):
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    ahead = layahead.WindowLayouts(job, BIG)
    lay = job.planner.layout(0, 0)
    wc, n = lay.window_chunks, len(lay.chunk_order)
    assert n > 2 * wc  # the corpus has three windows or more
    keys = ahead.keys_ahead(0)
    # Windows 0 and 1 of epoch 0: every position of both, last position first.
    assert [k[3] for k in keys] == list(range(2 * wc - 1, -1, -1))
    assert all(k[0] == 0 and k[1] == 0 and k[2] == int(lay.chunk_order[k[3]]) for k in keys)
    assert ahead.keys_ahead(0) == []  # handed out once
    # A step in window 1: only window 2 is new.
    step = next(s for s in range(10_000) if _window_of(job, s) == (0, 1))
    assert [k[3] for k in ahead.keys_ahead(step)] == list(range(min(3 * wc, n) - 1, 2 * wc - 1, -1))
    # The last window of an epoch: the next is the next epoch's first.
    last = (len(lay.window_rows) - 2)
    step = next(s for s in range(10_000) if _window_of(job, s) == (0, last))
    got = ahead.keys_ahead(step)
    assert {k[1] for k in got} == {0, 1} and {k[3] for k in got if k[1] == 1} == set(range(wc))


def test_a_budget_that_holds_one_window_lays_out_only_the_current_one(tmp_path, corpus):
    job = built_job(tmp_path / "cache", job_spec([corpus / "*"]))
    lay = job.planner.layout(0, 0)
    window = layahead.WindowLayouts(job, BIG)._bytes(0, lay, 0)
    ahead = layahead.WindowLayouts(job, window)  # one window, not two
    assert [k[3] for k in ahead.keys_ahead(0)] == list(range(lay.window_chunks - 1, -1, -1))


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


def test_a_supervisor_lays_out_the_next_window_for_its_workers(tmp_path, corpus):
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"main": job_spec([corpus / "*"])},
        tmp_path / "cache",
        metrics_listen="127.0.0.1:0",
        workers=2,
    )
    proc = ServerProcess(cfg, tmp_path / "server.log")
    try:
        assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
        job = built_job(tmp_path / "probe", job_spec([corpus / "*"]))
        lay = job.planner.layout(0, 0)
        wc = lay.window_chunks
        with proc.client("main") as c:
            c.get_batch(0)  # the first step: window 0 of epoch 0
        # Window 1's buffers appear although no worker read a row of it.
        rows = sharedrows.node_dir(tmp_path / "cache")
        want = {f"0-0-0-{int(lay.chunk_order[p])}" for p in range(wc, 2 * wc)}
        deadline = time.monotonic() + 30
        while not want <= {p.name for p in rows.rglob("0-0-0-*")}:
            assert time.monotonic() < deadline, sorted(p.name for p in rows.rglob("*"))
            time.sleep(0.1)
        time.sleep(1.5)  # the workers send their counters every second
        samples = scrape(proc.metrics)
        files = [p for p in rows.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
        # Each file laid out once (by the supervisor or a worker), none unshared.
        assert metric(samples, "tokenfeed_row_buffers_total", outcome="laid_out") == len(files)
        assert metric(samples, "tokenfeed_row_buffers_total", outcome="unshared") == 0
    finally:
        assert proc.stop() == 0, proc.log()
