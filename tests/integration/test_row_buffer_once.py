"""An epoch's row buffer of a chunk is laid out once for every stream and rank of a process
that reads it: threads that need a buffer being laid out wait for it instead of laying it out
again; a plan's missing buffers are laid out from the last position to the first, so each tail
is cut from the buffer laid out just before it. And a StreamBatches stream lays out the row
buffers of its next block of steps while it sends the current one, with the same bytes."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from support import built_job, job_spec
from tokenfeed.client import wire
from tokenfeed.server.pack import rowlayout

BIG_CACHE = 1 << 30


def _job(cache, corpus):
    return built_job(cache, job_spec([corpus / "*"], seq_len=48, seed=9, global_batch_size=16))


def _counting(monkeypatch) -> list[int]:
    """Calls of rowlayout.row_buffer (one per buffer laid out), slowed so threads overlap."""
    made: list[int] = []
    real = rowlayout.row_buffer

    def slow(*args, **kwargs):
        made.append(1)
        threading.Event().wait(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(rowlayout, "row_buffer", slow)
    return made


def test_threads_that_need_the_same_buffer_lay_it_out_once(tmp_path, corpus, monkeypatch):
    job = _job(tmp_path / "cache", corpus)
    plan = job.plan(job.steps_per_epoch + 1, 0, 1)  # epoch 1: nothing laid out yet
    keys = sorted(plan.buffers)
    made = _counting(monkeypatch)
    got: dict[int, list] = {}

    def ranks(i: int) -> None:
        got[i] = [job.assembler.row_buffer(*k) for k in keys]

    threads = [threading.Thread(target=ranks, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == len(keys)  # once each, not once per thread that missed it
    for i in range(1, 6):  # every thread got the one buffer laid out
        assert all(a is b for a, b in zip(got[0], got[i], strict=True))


def test_a_plans_buffers_are_laid_out_once_with_tails_cut_from_the_next(
    tmp_path, corpus, monkeypatch
):
    job = _job(tmp_path / "cache", corpus)
    reference = _job(tmp_path / "ref", corpus)
    spe = job.steps_per_epoch
    steps = list(range(spe + 1, spe + 9))
    plan = job.plan_steps(steps, 0, 1)
    made = _counting(monkeypatch)
    verified: list[tuple[int, int]] = []
    real_verified = job.assembler.opened.verified

    def counted(d, c, here=False):
        verified.append((d, c))
        return real_verified(d, c, here)

    monkeypatch.setattr(job.assembler.opened, "verified", counted)

    async def open_twice():
        with ThreadPoolExecutor(4) as pool:
            await asyncio.gather(job.open_chunks(plan, pool), job.open_chunks(plan, pool))

    asyncio.run(open_twice())
    assert len(made) == len(plan.buffers)
    # Laid out from the last position to the first: a buffer whose next position is in the
    # plan cuts its tail from that buffer, so only the chunks of the plan are checked (once
    # each) plus the tails' chunks past the plan's last buffer.
    in_plan = {(d, c) for d, _, c, _ in plan.buffers}
    assert {v for v in verified if v in in_plan} == in_plan
    assert len([v for v in verified if v in in_plan]) == len(in_plan)
    epochs, whole = job.assemble_group(plan, len(steps))
    got = zip(epochs, wire.split_rows(whole, whole.rows // len(steps), len(steps)), strict=True)
    for step, (epoch, compact) in zip(steps, got, strict=True):  # the bytes of each alone
        alone = reference.plan(step, 0, 1)

        async def one(p=alone):
            with ThreadPoolExecutor(2) as pool:
                await reference.open_chunks(p, pool)
            return reference.assemble(p)

        e, c = asyncio.run(one())
        assert e == epoch
        assert np.array_equal(c.tokens, compact.tokens)
        assert np.array_equal(c.starts, compact.starts)


class _Context:
    """What the stream loop asks of a gRPC context: no deadline."""

    def time_remaining(self):
        return None


def test_a_stream_lays_out_its_next_blocks_buffers_while_it_sends(tmp_path, corpus):
    # Chunks of a few rows, one per window: the next block's rows start in other chunks.
    from tokenfeed.client import wire
    from tokenfeed.server.serve.service import TokenFeedServicer
    from tokenfeed.server.serve.streaming import plan_group
    from tokenfeed.v1 import tokenfeed_pb2 as pb

    spec = job_spec([corpus / "*"], seq_len=48, seed=9, global_batch_size=16, chunk_bytes="4KiB")
    spec["window_chunks"] = 1
    job, reference = built_job(tmp_path / "cache", spec), built_job(tmp_path / "ref", spec)
    rows = job.spec.phases[0].global_batch_size
    block = plan_group(rows)
    start = job.steps_per_epoch + 1
    following = job.plan_steps(list(range(start + block, start + 2 * block)), 0, 1)
    current = job.plan_steps(list(range(start, start + block)), 0, 1)
    fresh = {k[:3] for k in following.buffers} - {k[:3] for k in current.buffers}
    assert fresh  # the next block starts rows in chunks the first does not

    async def stream():
        with ThreadPoolExecutor(2) as pool:
            servicer = TokenFeedServicer({job.name: job}, 5.0, pool, stream_ahead=2)
            batches = servicer.make.stream(job, start, start + 2 * block, 0, 1, _Context())
            first = await anext(batches)
            # The reader has taken one batch: the producer waits on the full queue, far from
            # the next block, whose row buffers are laid out meanwhile all the same.
            for _ in range(200):
                if all(job.assembler.buffers.contains(k) for k in fresh):
                    break
                await asyncio.sleep(0.05)
            laid_out = [job.assembler.buffers.contains(k) for k in fresh]
            rest = [b async for b in batches]
            return first, laid_out, rest

    first, laid_out, rest = asyncio.run(stream())
    assert all(laid_out)
    got = [first, *rest]
    assert len(got) == 2 * block
    for step, message in zip(range(start, start + 2 * block), got, strict=True):
        msg = pb.Batch.FromString(message)
        assert msg.step == step
        compact = wire.decode(msg)  # its fingerprint checked
        want = reference.batch(step, 0, 1)[1]
        for name in ("input_ids", "position_ids"):
            assert np.array_equal(wire.expand(compact, name), want[name])


def test_a_nodes_processes_start_at_their_own_place_and_map_each_others_buffers(
    tmp_path, corpus, monkeypatch
):
    from tokenfeed.server.pack.sharedrows import SharedRows

    reference = _job(tmp_path / "ref", corpus)
    spe = reference.steps_per_epoch
    steps = list(range(spe + 1, spe + 9))
    procs = []
    for k, turn in enumerate((1, 2)):  # two serving processes of one node
        job = _job(tmp_path / f"cache-{k}", corpus)
        rows = job.assembler.rows
        rows.shared, rows._identity = SharedRows(tmp_path / "shm", 1 << 30), lambda: "fp"
        rows.shared.turn = turn
        laid: list[tuple[int, int]] = []
        real = rows._lay_out

        def lay_out(key, epoch, c, position, here=False, place=None, real=real, laid=laid):
            laid.append((epoch, position))
            return real(key, epoch, c, position, here, place)

        monkeypatch.setattr(rows, "_lay_out", lay_out)
        procs.append((job, laid))
    plan = procs[0][0].plan_steps(steps, 0, 1)
    order = sorted({(k[1], k[3]) for k in plan.buffers}, reverse=True)
    assert len(order) > 2

    def opened(job):
        async def run():
            with ThreadPoolExecutor(2) as pool:
                await job.open_chunks(job.plan_steps(steps, 0, 1), pool)

        asyncio.run(run())
        return job.assemble_group(job.plan_steps(steps, 0, 1), len(steps))

    (first, laid), (second, none_laid) = procs
    got = opened(first)
    assert laid == order[1:] + order[:1]  # from its own place, round the list
    again = opened(second)
    assert none_laid == [] and second.assembler.rows.shared.mapped == len(order)
    want = reference.assemble_group(reference.plan_steps(steps, 0, 1), len(steps))
    for (e, c), (e2, c2) in ((got, want), (again, want)):
        assert e == e2
        assert np.array_equal(c.tokens, c2.tokens) and np.array_equal(c.starts, c2.starts)


def _copy(buf):
    return type(buf)(buf.ids.copy(), buf.starts.copy())


def _node(tmp_path, corpus, processes: int):
    """`processes` jobs of one node (the first the supervisor) sharing one arena of about
    four and a half epochs' row buffers (a quarter of it holds about one), each row cache
    keeping whatever it reads; and the row-buffer keys of an epoch's steps."""
    from tokenfeed.server.pack.arenaformat import DATA_START, SEGMENTS
    from tokenfeed.server.pack.sharedrows import SharedRows

    jobs = [_job(tmp_path / f"cache-{k}", corpus) for k in range(processes)]
    spe = jobs[0].steps_per_epoch

    def keys(epoch: int) -> list:
        plan = jobs[0].plan_steps(list(range(epoch * spe, (epoch + 1) * spe)), 0, 1)
        return sorted(k for k in plan.buffers if k[1] == epoch)

    epoch_bytes = sum(jobs[0].assembler.row_buffer(*k).nbytes for k in keys(0))
    segment = -(-epoch_bytes * 9 // 16 // DATA_START) * DATA_START
    for job in jobs:
        rows = job.assembler.rows
        rows.buffers.budget = BIG_CACHE  # keeps whatever it reads
        rows.shared, rows._identity = (
            SharedRows(tmp_path / "shm", DATA_START + SEGMENTS * segment),
            lambda: "fp",
        )
    return jobs, keys


def test_workers_that_read_apart_leave_the_arena_a_segment_to_share(tmp_path, corpus):
    """Two serving workers whose row caches could keep every buffer they read (a budget as
    large as the arena) hold at most a quarter of the node's arena in place each, their
    newest: the supervisor still writes each buffer it lays out into the arena, and a worker
    maps it. With each holding its oldest views (up to half the arena each), the two held
    every segment and every later buffer was laid out by each process apart (`unshared`)."""
    (writer, first, second), keys = _node(tmp_path, corpus, 3)
    shared = writer.assembler.rows.shared

    def lay_out(epochs) -> list:  # copies: the writer's own views would hold their segments
        return [_copy(writer.assembler.row_buffer(*k)) for e in epochs for k in keys(e)]

    laid = lay_out(range(1, 5))
    assert shared.made == len(laid)  # the ring holds four epochs
    for reader, epochs in ((first, (1, 2)), (second, (3, 4))):  # ranks far apart
        for k in (k for e in epochs for k in keys(e)):
            reader.assembler.row_buffer(*k)
        got = reader.assembler.rows.shared
        assert got.made == 0 and got.mapped == sum(len(keys(e)) for e in epochs)
        assert 0 < got.in_place_bytes() <= got.in_place_budget
    laid += lay_out((5, 6))
    assert shared.made == len(laid)  # every one written for the others, none unshared
    mapped = second.assembler.rows.shared.mapped
    got = [second.assembler.row_buffer(*k) for k in keys(6)]
    assert second.assembler.rows.shared.mapped == mapped + len(got)  # none laid out again
    for a, b in zip(got, laid[-len(got) :], strict=True):
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.starts, b.starts)


def test_an_idle_worker_lets_go_of_the_segments_the_ring_writes_next(tmp_path, corpus):
    """A worker that read the arena's oldest buffers and then went idle holds the segments
    the ring writes next; once a second (`let_go(every=True)`, run by every serving process)
    it lets go of what it holds there, and the supervisor renews the oldest segment, not the
    next one nobody holds (which would write over buffers laid out ahead and not yet read)."""
    from tokenfeed.server.pack.arenaformat import ARENA, ENTRY, SEGMENTS

    (writer, idle), keys = _node(tmp_path, corpus, 2)
    arena = tmp_path / "shm"
    for k in (k for e in range(1, 5) for k in keys(e)):
        writer.assembler.row_buffer(*k)
    for k in keys(1) + keys(4)[-3:]:  # the oldest epoch and the newest buffers, then nothing
        idle.assembler.row_buffer(*k)
    shared = idle.assembler.rows.shared
    nxt = shared.next_renewed()
    assert set(shared._pins.held()) & nxt  # it holds what the ring writes next
    idle.assembler.let_go(every=True)
    held = shared._pins.held()
    assert held and not set(held) & nxt  # the newest it keeps
    current = ARENA.unpack_from(shared._map, 0)[3]  # the segment being written
    assert nxt == {(current + i) % SEGMENTS for i in (1, 2, 3)}
    renewed = []
    for k in keys(5):
        writer.assembler.row_buffer(*k)
        name = writer.assembler.rows._file_name("fp", (k[0], k[1], k[2]))
        renewed.append(ENTRY.unpack((arena / name).read_bytes())[1])
    # The ring went on from the current segment to the oldest, the one the reader let go of.
    assert [g for g in dict.fromkeys(renewed) if g != current][:1] == [(current + 1) % SEGMENTS]


def test_a_worker_takes_a_buffer_laid_out_by_another_without_its_chunks(
    tmp_path, corpus, monkeypatch
):
    """On the event loop (`lay_out_here`) a worker takes a buffer another process laid out
    in the arena straight away: it needs neither its chunk nor its tail's chunks mapped, and
    works out no tail. Every worker takes every buffer its ranks read, so this is what a
    buffer costs each of a node's other workers (before, a worker whose chunks were not open
    handed each such buffer to a thread, which opened and verified its chunks first)."""
    (writer, worker), keys = _node(tmp_path, corpus, 2)
    epoch = keys(1)
    laid = [writer.assembler.row_buffer(*k) for k in epoch]
    rows = worker.assembler.rows
    assert not any(rows.opened.mapped(k[0], k[2]) for k in epoch)  # nothing open here
    touched: list = []
    monkeypatch.setattr(rows.opened, "verified", lambda *a, **kw: touched.append(a))
    monkeypatch.setattr(rows, "_tail", lambda *a: touched.append(a))
    for k, want in zip(epoch, laid, strict=True):
        assert rows.lay_out_here(*k)
        got = rows.buffers.peek((k[0], k[1], k[2]))  # in its row cache now, the same bytes
        assert np.array_equal(got.ids, want.ids) and np.array_equal(got.starts, want.starts)
    assert touched == [] and rows.shared.mapped == len(epoch) and rows.shared.made == 0


def test_the_supervisor_lays_buffers_out_in_the_arena_and_keeps_no_copy(tmp_path, corpus):
    """A supervisor lays each buffer out straight into a slot of the node's arena and reads it
    there afterwards (its tails cut from it), as a worker reads a mapped one: what its row
    cache keeps is in place, never a copy in its own memory (past its in-place budget it lets
    go of its oldest); the same bytes as a layout in memory, mapped by the workers."""
    from tokenfeed.server.pack.arenalocks import held_in_place

    reference = _job(tmp_path / "ref", corpus)
    (writer, worker), keys = _node(tmp_path, corpus, 2)
    epoch = sorted(keys(2), key=lambda k: -k[3])  # last position first, as the lay-ahead does
    rows = writer.assembler.rows
    rows.lay_out_all(epoch)
    kept = [b for k in epoch if (b := rows.buffers.peek((k[0], k[1], k[2]))) is not None]
    assert kept and all(held_in_place(b.ids) and held_in_place(b.starts) for b in kept)
    assert rows.shared.made == len(epoch)
    assert 0 < rows.shared.in_place_bytes() <= rows.shared.in_place_budget
    for k in epoch:
        want = reference.assembler.row_buffer(*k)
        got = worker.assembler.row_buffer(*k)
        assert np.array_equal(got.ids, want.ids) and np.array_equal(got.starts, want.starts)
    assert worker.assembler.rows.shared.mapped == len(epoch)
