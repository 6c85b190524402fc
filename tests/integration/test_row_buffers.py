"""Rows copied from row buffers: each chunk's stream laid out with its tail (the units its last
row reads past the chunk's end), so a row is one slice. A stream plans several steps in one
pass and assembles them a few at a time; a tail is cut from the next chunk's row buffer when
that is laid out, else copied from the chunk verified then. Every way gives the same bytes."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support import built_job, job_spec
from tokenfeed.client import wire
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import RequestError
from tokenfeed.server.pack import rowlayout
from tokenfeed.server.pack.assembly import GroupRows
from tokenfeed.server.serve import batchmsg
from tokenfeed.v1 import tokenfeed_pb2 as pb


def _job(cache, corpus, packing_: str = "concat"):
    return built_job(cache, job_spec([corpus / "*"], seq_len=48, seed=9, packing=packing_))


def _assembled(job, plan, steps: int):
    async def run():
        with ThreadPoolExecutor(2) as pool:
            await job.open_chunks(plan, pool)
        epochs, whole = job.assemble_group(plan, steps)
        return list(zip(epochs, wire.split_rows(whole, whole.rows // steps, steps), strict=True))

    return asyncio.run(run())


def _all(job, asked):
    """The batches of (step, rank, world_size) requests, in order."""

    async def run():
        out = []
        with ThreadPoolExecutor(2) as pool:
            for step, rank, ws in asked:
                plan = job.plan(step, rank, ws)
                await job.open_chunks(plan, pool)
                out.append(job.assemble(plan))
        return out

    return asyncio.run(run())


def _same(a, b) -> None:
    (ea, ca), (eb, cb) = a, b
    assert ea == eb
    assert np.array_equal(ca.tokens, cb.tokens)
    assert np.array_equal(ca.starts, cb.starts)
    assert np.array_equal(ca.row_splits, cb.row_splits)
    assert (ca.padding is None) == (cb.padding is None)
    if ca.padding is not None:
        assert np.array_equal(ca.padding, cb.padding)


@pytest.mark.parametrize("packing_", ["concat", "best_fit"])
@pytest.mark.parametrize("world_size", [1, 4])
def test_steps_planned_together_and_assembled_apart_are_the_steps_alone(
    tmp_path, corpus, packing_, world_size
):
    job = _job(tmp_path / "cache", corpus, packing_)
    spe = job.steps_per_epoch
    for first in (0, spe - 2, 2 * spe - 1):  # across the epoch boundary too
        steps = list(range(first, first + 4))
        rank = world_size - 1
        plan = job.plan_steps(steps, rank, world_size)
        alone = [_assembled(job, job.plan(s, rank, world_size), 1)[0] for s in steps]
        for per in (1, 2, 3, 4):
            parts = job.split_plan(plan, len(steps), per)
            assert len(parts) == -(-len(steps) // per)
            got = [
                b
                for i, p in enumerate(parts)
                for b in _assembled(job, p, len(steps[i * per :][:per]))
            ]
            assert len(got) == len(steps)
            for g, want in zip(got, alone, strict=True):
                _same(g, want)


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_streams_rows_copied_into_their_messages_are_the_rows_assembled(
    tmp_path, corpus, world_size
):
    """A stream's group of a real job (rows across chunks, their tails, an epoch's end) is
    left uncopied (`Job.group`: GroupRows) and made into messages from its row buffers; the
    messages are those of the same group assembled first, byte for byte, and decode to the
    batches of each step alone."""
    job = _job(tmp_path / "cache", corpus)
    spe, rank = job.steps_per_epoch, world_size - 1
    for first in (0, spe - 2):
        steps = list(range(first, first + 4))
        plan = job.plan_steps(steps, rank, world_size)
        _assembled(job, plan, len(steps))  # opens its chunks, lays out its buffers
        epochs, group = job.group(plan, len(steps))
        assert isinstance(group, GroupRows)
        want_epochs, whole = job.assemble_group(plan, len(steps))
        assert epochs == want_epochs
        got = batchmsg.group_messages(job, steps, rank, world_size, epochs, group)
        assert got == batchmsg.group_messages(job, steps, rank, world_size, epochs, whole)
        for step, (message, _) in zip(steps, got, strict=True):
            back = wire.decode(pb.Batch.FromString(message))  # its fingerprint checked
            _, alone = _assembled(job, job.plan(step, rank, world_size), 1)[0]
            assert np.array_equal(back.tokens, alone.tokens)
            assert np.array_equal(back.starts, alone.starts)


def test_tails_cut_from_laid_out_buffers_equal_tails_copied_from_verified_chunks(
    tmp_path, corpus, monkeypatch
):
    kept = _job(tmp_path / "kept", corpus)
    bare = _job(tmp_path / "bare", corpus)
    bare.assembler.buffers = LRU(4096, 1)  # only the newest buffer is kept: tails are copied
    calls = {"cut": 0, "copied": 0}
    cut, stream_slice = rowlayout.RowBuffer.cut, rowlayout.stream_slice

    def counted_cut(self, lo, hi):
        calls["cut"] += 1
        return cut(self, lo, hi)

    def counted_slice(*args, **kwargs):
        calls["copied"] += 1
        return stream_slice(*args, **kwargs)

    monkeypatch.setattr(rowlayout.RowBuffer, "cut", counted_cut)
    monkeypatch.setattr(rowlayout, "stream_slice", counted_slice)
    spe = kept.steps_per_epoch
    steps = range(spe + 2)  # an epoch and the rows reading on into the next
    _all(kept, [(s, 0, 1) for s in steps])  # lays out every buffer of the kept job
    kept.assembler.buffers = LRU(4096, 2**30)  # lay out again, later chunks' buffers first
    asked = [(s, 0, 1) for s in reversed(steps)]
    for a, b in zip(_all(kept, asked), _all(bare, asked), strict=True):
        _same(a, b)
    assert calls["cut"] > 0 and calls["copied"] > 0, calls


def test_a_row_buffer_holds_at_most_seq_len_tokens_past_its_chunk(tmp_path, corpus):
    job = _job(tmp_path / "cache", corpus)
    seq_len, idx = job.spec.seq_len, job.index
    tails = 0
    for epoch in (0, 1):
        layout = job.layout(0, epoch)
        for position, c in enumerate(layout.chunk_order.tolist()):
            stream = job.assembler.stream(0, epoch, c)
            buf = job.assembler.row_buffer(0, epoch, c, position)
            extra = len(buf.ids) - stream.total
            assert 0 <= extra <= seq_len
            tails += extra > 0
            # The last row starting in the chunk fits: it is the chunk's last slice.
            begin = epoch * idx.units_per_epoch + int(layout.units_cum[position])
            end = epoch * idx.units_per_epoch + int(layout.units_cum[position + 1])
            last = -(-end // seq_len) - 1
            if last * seq_len >= begin:
                assert len(buf.ids) == max(stream.total, last * seq_len - begin + seq_len + 1)
    assert tails > 0


def test_steps_up_to_the_limit_are_served_and_the_limit_is_refused(tmp_path, corpus):
    # Stream units of every servable step stay below 2**62: no int64 arithmetic overflows,
    # and rows of epochs in the trillions group by (epoch, chunk) exactly.
    job = _job(tmp_path / "cache", corpus)
    limit = job.step_limit
    assert limit * job.spec.global_batch_size * job.spec.seq_len <= 2**62
    for step in (limit - 1, limit // 3, 4_600_000_000_000_000 % limit):
        ((epoch, compact),) = _all(job, [(step, 1, 2)])
        assert epoch >= 0 and compact.tokens.shape == (4, job.spec.seq_len + 1)
        assert (epoch, compact.tokens.tolist()) == (
            _all(job, [(step, 1, 2)])[0][0],
            compact.tokens.tolist(),
        )
    with pytest.raises(RequestError, match=rf"step must be in \[0, {limit}\)"):
        job.plan(limit, 0, 1)
