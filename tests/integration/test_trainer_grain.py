"""Grain: TokenFeedIterator checkpointed by Grain's CheckpointHandler in JAX processes, resumed
2 -> 1 and 1 -> 2 processes (jax.distributed on CPU, gloo); tests/trainer_harness.py."""

from __future__ import annotations

from trainer_harness import check, scenario


def test_resume_at_another_process_count(server, tmp_path):
    check(scenario("grain", server.address, "main", tmp_path), server.address, "main")
