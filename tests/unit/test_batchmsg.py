"""A served batch's message (serve/batchmsg.py): the fields a stream keeps serialized once, its
own fields written beside them, the tokens appended. Its bytes are protobuf's serialization of
the same Batch with `tokens` moved to the end, whatever the values (zeros left out, as proto3
does; negative int64; padding or none; int32 or uint16 tokens; several phases of one stream)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from tokenfeed.client import wire
from tokenfeed.server.pack import rowlayout, rowmessages
from tokenfeed.server.pack.assembly import GroupRows
from tokenfeed.server.serve import batchmsg
from tokenfeed.v1 import tokenfeed_pb2 as pb


def _message(job, step: int, rank: int, world: int, epoch: int, c: wire.Compact):
    """One batch's message and payload bytes (a group of one, as GetBatch makes it)."""
    [one] = batchmsg.group_messages(job, [step], rank, world, [epoch], c)
    return one


def _each_alone(job, steps, rank: int, world: int, built) -> list:
    """Each batch's message made alone (a group of one), in order: batches of any shapes."""
    return [_message(job, s, rank, world, e, c) for s, (e, c) in zip(steps, built, strict=True)]


def _job(name="job-a", fingerprint="f" * 32, phases=((0, "p0"),), version=3):
    def plan_of(step: int) -> tuple[int, str]:
        return phases[phase_at(step)]

    def phase_at(step: int) -> int:
        return max(k for k, p in enumerate(phases) if p[0] <= step)

    plans = SimpleNamespace(version=version, same_phase=lambda a, b: phase_at(a) == phase_at(b))
    return SimpleNamespace(name=name, fingerprint=fingerprint, plan_of=plan_of, plans=plans)


def _compact(rows: int, seq_len: int, dtype, padded: bool, seed: int) -> wire.Compact:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 60_000, (rows, seq_len + 1)).astype(dtype)
    starts = np.sort(rng.integers(1, seq_len, 3 * rows)).astype(wire.position_dtype(seq_len))
    splits = np.linspace(0, 3 * rows, rows + 1).astype(np.int32)
    padding = rng.integers(0, 3, rows).astype(wire.position_dtype(seq_len)) if padded else None
    return wire.Compact(tokens, starts, splits, padding)


def _protobuf(job, step, rank, world, epoch, c: wire.Compact) -> bytes:
    phase_start, plan_fingerprint = job.plan_of(step)
    fields = wire.encode(c, with_tokens=True)
    tokens = fields.pop("tokens")
    head = pb.Batch(
        job=job.name,
        step=step,
        rank=rank,
        world_size=world,
        epoch=epoch,
        job_fingerprint=job.fingerprint,
        plan_phase_start=phase_start,
        plan_fingerprint=plan_fingerprint,
        plan_version=job.plans.version,
        **fields,
    ).SerializeToString()
    return head + pb.Batch(tokens=tokens).SerializeToString()


@pytest.mark.parametrize(
    ("step", "rank", "world", "epoch", "dtype", "padded"),
    [
        (0, 0, 1, 0, np.uint16, False),  # every zero left out
        (1, 3, 4, 2, np.uint16, True),
        (2**40 + 7, 127, 128, 129, np.int32, False),  # varints of several bytes
        (300, 0, 1, -1, np.int32, True),  # a negative int64: ten bytes
    ],
)
def test_the_message_is_protobufs_serialization(step, rank, world, epoch, dtype, padded):
    job = _job()
    c = _compact(4, 2048, dtype, padded, seed=step % 1000)
    message, payload = _message(job, step, rank, world, epoch, c)
    assert message == _protobuf(job, step, rank, world, epoch, c)
    back = pb.Batch.FromString(message)
    got = wire.decode(back)  # the client's check of the fingerprint passes
    assert np.array_equal(got.tokens, c.tokens) and back.step == step and back.epoch == epoch
    assert payload == c.tokens.nbytes + c.starts.nbytes + c.row_splits.nbytes + (
        0 if c.padding is None else c.padding.nbytes
    )


def test_a_stream_through_a_phase_and_of_other_jobs_keeps_each_ones_fields():
    a = _job("a", phases=((0, "first"), (5, "second")))
    b = _job("b", fingerprint="0" * 32, version=9)
    for step in range(10):
        for job in (a, b, a):
            c = _compact(2, 64, np.uint16, step % 2 == 0, seed=step)
            message, _ = _message(job, step, 1, 2, step // 4, c)
            assert message == _protobuf(job, step, 1, 2, step // 4, c)
            assert pb.Batch.FromString(message).plan_fingerprint == job.plan_of(step)[1]


def test_tokens_of_a_dtype_the_wire_cannot_carry_are_refused():
    c = _compact(2, 64, np.uint16, False, seed=1)
    bad = wire.Compact(c.tokens.astype(np.float32), c.starts, c.row_splits, None)
    with pytest.raises(wire.WireError, match="no wire encoding"):
        _message(_job(), 1, 0, 1, 0, bad)


@pytest.mark.parametrize(
    ("steps", "per", "dtype", "padded", "first"),
    [
        (24, 8, np.uint16, None, 0),  # a stream's usual group
        (24, 2, np.uint16, None, 113),  # steps across a varint's size change (128)
        (3, 32, np.int32, None, 16_382),  # and the next (16,384)
        (6, 2, np.uint16, None, 2**21 - 3),  # and the next
        (5, 4, np.uint16, "some", 7),  # padding in some batches only: the others travel without
        (4, 2, np.uint16, "all", 1),
        (2, 1, np.int32, "some", 0),
    ],
)
def test_a_groups_messages_are_those_of_its_batches_cut_alone(steps, per, dtype, padded, first):
    """group_messages (a stream's group, its arrays sliced from the group's buffers, the job's
    fields read once, a phase's looked up once) makes each batch's message of split_rows' cut
    of it made alone, byte for byte, across a phase change and varints' size changes."""
    job = _job("g", phases=((0, "first"), (first + steps // 2, "second")))
    rng = np.random.default_rng(steps * per)
    seq_len = 64
    whole = _compact(steps * per, seq_len, dtype, False, seed=steps)
    starts = [
        np.sort(rng.integers(1, seq_len, int(rng.integers(0, 4)))) for _ in range(steps * per)
    ]
    padding = None
    if padded:
        padding = rng.integers(0, 3, steps * per).astype(wire.position_dtype(seq_len))
        if padded == "some":
            padding[: per * (steps // 2)] = 0  # the first half of the batches have none
    splits = np.concatenate(([0], np.cumsum([len(s) for s in starts]))).astype(np.int32)
    flat = np.concatenate(starts).astype(wire.position_dtype(seq_len))
    whole = wire.Compact(whole.tokens, flat, splits, padding)
    numbers = list(range(first, first + steps))
    epochs = [s % 3 for s in numbers]
    got = batchmsg.group_messages(job, numbers, 1, 2, epochs, whole)
    cut = wire.split_rows(whole, per, steps)
    assert got == _each_alone(job, numbers, 1, 2, list(zip(epochs, cut, strict=True)))
    for step, epoch, c, (message, _) in zip(numbers, epochs, cut, got, strict=True):
        assert message == _protobuf(job, step, 1, 2, epoch, c)
        back = wire.decode(pb.Batch.FromString(message))  # its fingerprint checks
        assert np.array_equal(back.tokens, c.tokens) and (back.padding is None) == (
            c.padding is None
        )


def test_a_group_that_is_not_whole_batches_is_refused():
    with pytest.raises(ValueError, match="not 3 batches"):
        batchmsg.group_messages(
            _job(), [0, 1, 2], 0, 1, [0, 0, 0], _compact(4, 16, np.uint16, False, 1)
        )


@pytest.mark.parametrize(
    ("steps", "per", "dtype", "first", "change"),
    [
        (4, 32, np.uint16, 0, True),
        (24, 8, np.int32, 113, True),
        (1, 3, np.uint16, 0, True),
        (3, 2, np.int32, 0, True),
        # One phase (a stream's group never spans two): heads and tails written in C around
        # each batch's step, epoch, starts and splits, zeros and varints' size changes among.
        (4, 32, np.uint16, 0, False),
        (24, 8, np.int32, 113, False),
        (6, 2, np.uint16, 16_381, False),
        (1, 3, np.int32, 2**21 - 1, False),
    ],
)
@pytest.mark.parametrize("native", [True, False])
def test_messages_made_from_rows_not_yet_copied_are_those_of_the_rows_copied(
    steps, per, dtype, first, change, native, monkeypatch
):
    """A group of concat rows left in their row buffers (GroupRows: a stream's usual group)
    makes, byte for byte, the messages of the same rows copied first (its compact batch),
    within one phase and across a phase change, with the C extension and with its twin; each
    message decodes, its fingerprint checked, to its rows."""
    if not native:
        monkeypatch.setattr(rowmessages, "_rowmessages", None)
    second = first + (steps // 2 if change else steps + 5)
    job = _job("r", phases=((0, "first"), (second, "second")))
    rng = np.random.default_rng(steps * per)
    seq_len = 48
    buffers = [rng.integers(0, 60_000, int(n)).astype(dtype) for n in rng.integers(60, 400, 5)]
    rows = steps * per
    which = rng.integers(0, len(buffers), rows)
    lo = np.array([rng.integers(0, len(buffers[k]) - seq_len) for k in which], dtype=np.int64)
    starts = [np.sort(rng.integers(1, seq_len, int(rng.integers(0, 4)))) for _ in range(rows)]
    splits = np.concatenate(([0], np.cumsum([len(s) for s in starts]))).astype(np.int32)
    flat = np.concatenate(starts).astype(wire.position_dtype(seq_len))
    sources = rowlayout.RowSources(buffers, which, lo, seq_len + 1)
    group = GroupRows(sources, flat, splits, np.dtype(dtype))
    numbers = list(range(first, first + steps))
    epochs = [s % 3 for s in numbers]
    got = batchmsg.group_messages(job, numbers, 0, 1, epochs, group)
    compact = group.compact()
    assert compact.rows == group.rows and compact.seq_len == group.seq_len
    assert got == batchmsg.group_messages(job, numbers, 0, 1, epochs, compact)
    for i, (message, _) in enumerate(got):
        back = wire.decode(pb.Batch.FromString(message))
        want = np.stack([buffers[k][a : a + seq_len + 1] for k, a in zip(which, lo, strict=True)])
        assert np.array_equal(back.tokens, want[i * per : (i + 1) * per])
