"""How many steps a stream assembles in one stretch of the event loop: small batches are
grouped (their fixed costs paid once), and no group holds more than three [32, 4096] batches'
tokens, so another stream never waits longer than that; and what a stalled stream holds."""

from __future__ import annotations

import asyncio

import pytest
from tokenfeed.server.serve.streaming import (
    GROUP_TOKENS,
    PLAN_ROWS,
    PLAN_STEPS,
    STREAM_GROUP,
    Ahead,
    plan_group,
    stream_group,
)


@pytest.mark.parametrize(
    ("rows", "seq_len", "expected"),
    [
        (8, 2048, 32),  # 16 K tokens a batch: a full group
        (16, 4096, 8),  # 64 K: eight fit in GROUP_TOKENS
        (32, 4096, 4),  # 128 K: four
        (96, 4096, 1),  # 384 K: one, a second would pass the bound
        (128, 4096, 1),  # one batch is the bound itself
        (64, 16384, 1),  # larger than the bound: one at a time, never zero
        (1, 128, 32),
    ],
)
def test_groups_are_bounded_by_tokens(rows, seq_len, expected):
    assert stream_group(rows, seq_len) == expected


def test_no_group_exceeds_the_token_bound_unless_one_batch_does():
    for rows in (1, 3, 8, 32, 100):
        for seq_len in (64, 1000, 2048, 4096, 32768):
            n = stream_group(rows, seq_len)
            assert 1 <= n <= STREAM_GROUP
            assert n == 1 or n * rows * seq_len <= GROUP_TOKENS


@pytest.mark.parametrize(
    ("rows", "expected"),
    [(8, PLAN_STEPS), (12, PLAN_STEPS), (16, PLAN_ROWS // 16), (64, PLAN_ROWS // 64), (4096, 1)],
)
def test_a_stream_plans_up_to_plan_rows_rows_at_once(rows, expected):
    # Planning is metadata only, but it runs on the event loop in one stretch: bounded by
    # rows so that a plan never costs more than assembling one batch.
    assert plan_group(rows) == expected
    assert plan_group(rows) * rows <= PLAN_ROWS or plan_group(rows) == 1


def test_a_pass_plans_whole_groups_of_the_usual_shapes():
    for rows, seq_len in ((1, 2048), (8, 2048), (16, 4096), (32, 4096), (64, 2048)):
        assert plan_group(rows) % stream_group(rows, seq_len) == 0, (rows, seq_len)


@pytest.mark.parametrize(("limit", "group"), [(2, 3), (2, 24), (2, 1), (4, 2)])
def test_a_stalled_reader_holds_the_group_being_sent_and_one_more(limit, group):
    """The stream's builder (serve/streaming.py) waits for room before it builds a group. A
    reader that takes one group and stalls leaves one more group and fewer than `limit`
    batches built: nothing else is built, however long it stalls."""

    async def scenario() -> int:
        ahead, built = Ahead(limit), 0

        async def builder() -> None:
            nonlocal built
            while True:
                await ahead.room()
                built += group  # a group assembled
                await ahead.put([object()] * group)

        task = asyncio.create_task(builder())
        await ahead.get()  # the group being sent; the reader then stalls
        for _ in range(50):
            await asyncio.sleep(0)
        task.cancel()
        return built

    built = asyncio.run(scenario())
    queued_most = (limit - 1) + group  # fewer than `limit` queued, then one group more
    assert built <= group + queued_most
    assert built > group  # one group more is built while the first is sent
