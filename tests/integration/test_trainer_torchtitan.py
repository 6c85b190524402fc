"""torchtitan: TokenFeedDataLoader checkpointed by torchtitan's CheckpointManager (DCP) and
resumed 2 -> 1 and 1 -> 2 data-parallel processes (gloo); tests/trainer_harness.py."""

from __future__ import annotations

from trainer_harness import check, scenario


def test_resume_at_another_data_parallel_size(server, tmp_path):
    check(scenario("torchtitan", server.address, "main", tmp_path), server.address, "main")
