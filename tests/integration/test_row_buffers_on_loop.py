"""A lone server lays out a small row buffer on its event loop when nothing there can block:
the chunks it reads are mapped and verified in the process. Otherwise (a chunk not yet opened, a
large chunk, damage found, buffers shared between processes) the buffer goes to a thread, as
before. Either way its bytes are the same."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support import built_job, job_spec
from tokenfeed.client import wire
from tokenfeed.server.jobs import layahead
from tokenfeed.server.pack import rowbuffers, rowlayout


def _spec(corpus) -> dict:
    return job_spec([corpus / "*"], seq_len=48, seed=9, global_batch_size=16)


def _laid_on(monkeypatch) -> list[int]:
    """The thread of each call of rowlayout.row_buffer (one per buffer laid out)."""
    threads: list[int] = []
    real = rowlayout.row_buffer

    def recorded(*args, **kwargs):
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(rowlayout, "row_buffer", recorded)
    return threads


def _opened_epoch(job, epoch: int):
    """Every buffer of `epoch` laid out by a thread (which maps and verifies every chunk);
    the plan of the first step of the epoch after it."""
    spe = job.steps_per_epoch
    first = job.plan_steps(list(range(epoch * spe, (epoch + 1) * spe)), 0, 1)

    async def open_first():
        with ThreadPoolExecutor(2) as pool:
            await job.open_chunks(first, pool)

    with job.pinned(first):
        asyncio.run(open_first())
    return job.plan_steps(list(range((epoch + 1) * spe, (epoch + 1) * spe + 4)), 0, 1)


def _map_all(job) -> None:
    """Every chunk of the job's dataset opened (mapped and verified) in this process."""
    for c in range(len(job.indexes[0].chunks)):
        job.assembler.opened.verified(0, c)


def _lay_ahead(job, keys) -> int:
    """layahead.lay_out_soon of `keys` on an event loop (and a pool); the loop's thread."""

    async def ahead():
        with ThreadPoolExecutor(2) as pool:
            await layahead.lay_out_soon(job, keys, pool)
        return threading.get_ident()

    return asyncio.run(ahead())


def _same(a: rowlayout.RowBuffer, b: rowlayout.RowBuffer) -> bool:
    return np.array_equal(a.ids, b.ids) and np.array_equal(a.starts, b.starts)


def test_a_plans_buffers_of_mapped_chunks_are_laid_out_on_the_loop(tmp_path, corpus, monkeypatch):
    job, reference = (
        built_job(tmp_path / "a", _spec(corpus)),
        built_job(tmp_path / "b", _spec(corpus)),
    )
    plan = _opened_epoch(job, 1)
    fresh = {k[:3] for k in plan.buffers if not job.assembler.buffers.contains(k[:3])}
    threads = _laid_on(monkeypatch)

    async def on_loop():
        loop_thread = threading.get_ident()
        with ThreadPoolExecutor(2) as pool, job.pinned(plan):
            await job.open_chunks(plan, pool)
        return loop_thread

    loop_thread = asyncio.run(on_loop())
    assert len(threads) == len(fresh) > 0
    assert set(threads) == {loop_thread}  # none went to a thread
    for key in plan.buffers:
        assert _same(job.assembler.row_buffer(*key), reference.assembler.row_buffer(*key))
    epochs, whole = job.assemble_group(plan, 4)
    want_epochs, want = reference.assemble_group(plan, 4)
    assert epochs == want_epochs
    assert np.array_equal(whole.tokens, want.tokens)
    assert wire.fingerprint(whole) == wire.fingerprint(want)


def test_a_chunk_not_opened_is_left_to_a_thread_unopened(tmp_path, corpus, monkeypatch):
    job = built_job(tmp_path / "cache", _spec(corpus))
    plan = job.plan(job.steps_per_epoch + 1, 0, 1)
    threads = _laid_on(monkeypatch)
    rows = job.assembler.rows
    for key in sorted(plan.buffers):
        d, _, c, _ = key
        assert not job.assembler.opened.mapped(d, c)
        assert rows.lay_out_here(*key) is False
        assert not job.assembler.opened.mapped(d, c)  # the look opened nothing
        assert not rows.buffers.contains(key[:3])
    assert threads == []


def test_a_large_chunks_buffer_goes_to_a_thread(tmp_path, corpus, monkeypatch):
    job = built_job(tmp_path / "cache", _spec(corpus))
    plan = _opened_epoch(job, 1)
    monkeypatch.setattr(rowbuffers, "LOOP_TOKENS", 0)  # every chunk is "large"
    threads = _laid_on(monkeypatch)
    for key in sorted(plan.buffers):
        assert job.assembler.rows.lay_out_here(*key) is False
    assert threads == []


def test_damage_met_on_the_loop_is_left_to_a_thread_which_rebuilds(tmp_path, corpus):
    job, reference = (
        built_job(tmp_path / "a", _spec(corpus)),
        built_job(tmp_path / "b", _spec(corpus)),
    )
    plan = _opened_epoch(job, 1)
    rows = job.assembler.rows
    key = next(k for k in sorted(plan.buffers) if not rows.buffers.contains(k[:3]))
    d, _, c, _ = key
    assert job.assembler.opened.mapped(d, c)
    body = job.store._paths(job.indexes[d].keys[c])[0]
    with open(body, "r+b") as f:  # the mapped body changes under the process
        first = f.read(2)
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in first))
    assert rows.lay_out_here(*key) is False  # found, not reopened on the loop
    assert not rows.buffers.contains(key[:3])
    # A thread's layout checks the digests, drops the body and rebuilds it: the same bytes.
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(rows.row_buffer, *key).result()
    assert _same(got, reference.assembler.row_buffer(*key))


def test_the_lay_ahead_lays_out_mapped_windows_on_the_loop(tmp_path, corpus, monkeypatch):
    job, reference = (
        built_job(tmp_path / "a", _spec(corpus)),
        built_job(tmp_path / "b", _spec(corpus)),
    )
    _map_all(job)
    keys = layahead.WindowLayouts(job, 1 << 40).keys_ahead(job.steps_per_epoch)
    fresh = {k[:3] for k in keys}
    assert 1 in {e for _, e, _ in fresh} and not any(map(job.assembler.buffers.contains, fresh))
    threads = _laid_on(monkeypatch)
    loop_thread = _lay_ahead(job, keys)
    assert len(threads) == len(fresh) and set(threads) == {loop_thread}
    rows = job.assembler.rows
    assert all(rows.buffers.contains(k[:3]) for k in keys)
    for k in keys:
        assert _same(rows.row_buffer(*k), reference.assembler.row_buffer(*k))


@pytest.mark.parametrize("mapped", [False, True])
def test_the_lay_ahead_hands_what_it_cannot_lay_out_here_to_a_thread(
    tmp_path, corpus, monkeypatch, mapped
):
    job = built_job(tmp_path / "a", _spec(corpus))
    if mapped:
        _map_all(job)
        monkeypatch.setattr(rowbuffers, "LOOP_TOKENS", 0)
    keys = layahead.WindowLayouts(job, 1 << 40).keys_ahead(job.steps_per_epoch)
    fresh = {k[:3] for k in keys if not job.assembler.buffers.contains(k[:3])}
    threads = _laid_on(monkeypatch)
    loop_thread = _lay_ahead(job, keys)
    assert len(threads) == len(fresh) > 0 and loop_thread not in threads
    assert all(job.assembler.rows.buffers.contains(k[:3]) for k in keys)


def test_a_serving_workers_loop_writes_or_maps_the_nodes_buffer_and_never_waits(
    tmp_path, corpus, monkeypatch
):
    from tokenfeed.server.pack.sharedrows import SharedRows

    reference = built_job(tmp_path / "ref", _spec(corpus))
    workers = []
    for k in range(2):  # two serving processes of one node, their chunks mapped
        job = built_job(tmp_path / f"w{k}", _spec(corpus))
        rows = job.assembler.rows
        rows.shared, rows._identity = SharedRows(tmp_path / "shm", 1 << 30), lambda: "fp"
        _map_all(job)
        workers.append(job)
    keys = sorted(workers[0].plan(workers[0].steps_per_epoch + 1, 0, 1).buffers)
    (first, second), key = workers, keys[0]
    # Another process is writing the first buffer: the loop leaves it to a thread, unwaited.
    lock = tmp_path / "shm" / first.assembler.rows._file_name("fp", key[:3])
    lock = lock.with_name(lock.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        assert first.assembler.rows.lay_out_here(*key) is False
        assert not first.assembler.buffers.contains(key[:3])
    finally:
        holder.kill()
        holder.wait(10)
    threads = _laid_on(monkeypatch)
    for k in keys:  # the first lays out and writes; the second maps what it wrote
        assert first.assembler.rows.lay_out_here(*k) and second.assembler.rows.lay_out_here(*k)
    made = {k[:3] for k in keys}
    assert len(threads) == len(made) and set(threads) == {threading.get_ident()}
    assert first.assembler.rows.shared.made == len(made)
    assert second.assembler.rows.shared.mapped == len(made)
    for k in keys:
        want = reference.assembler.row_buffer(*k)
        assert _same(second.assembler.row_buffer(*k), want)


HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "time.sleep(60)\n"
)
