"""How many steps a stream assembles in one stretch of the event loop: small batches are
grouped (their fixed costs paid once), and no group holds more than one large batch's tokens,
so another stream never waits longer than that."""

from __future__ import annotations

import pytest
from tokenfeed.server.serve.streaming import (
    GROUP_TOKENS,
    PLAN_ROWS,
    PLAN_STEPS,
    STREAM_GROUP,
    plan_group,
    stream_group,
)


@pytest.mark.parametrize(
    ("rows", "seq_len", "expected"),
    [
        (8, 2048, 8),  # 16 K tokens a batch: a full group
        (16, 4096, 2),  # 64 K: two fit in GROUP_TOKENS
        (32, 4096, 1),  # one [32, 4096] batch is the bound itself
        (64, 8192, 1),  # larger than the bound: one at a time, never zero
        (1, 128, 8),
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
    [(8, PLAN_STEPS), (32, PLAN_STEPS), (64, PLAN_ROWS // 64), (512, 1), (4096, 1)],
)
def test_a_stream_plans_up_to_plan_rows_rows_at_once(rows, expected):
    # Planning is metadata only, but it runs on the event loop in one stretch: bounded by
    # rows so that a plan never costs more than assembling one batch.
    assert plan_group(rows) == expected
    assert plan_group(rows) * rows <= PLAN_ROWS or plan_group(rows) == 1
