"""OLMo-core: TokenFeedDataLoader in OLMo-core's Trainer (a tiny Transformer, DDP on gloo),
checkpointed by its CheckpointerCallback and resumed 2 -> 1 and 1 -> 2 processes;
tests/trainer_harness.py."""

from __future__ import annotations

from trainer_harness import check, scenario


def test_resume_at_another_data_parallel_size(server, tmp_path):
    check(scenario("olmo_core", server.address, "main", tmp_path), server.address, "main")
