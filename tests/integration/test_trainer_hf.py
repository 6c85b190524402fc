"""Hugging Face Trainer: TokenFeedTrainer resumed from the Trainer's checkpoint 2 -> 1 and
1 -> 2 DDP processes (gloo); tests/trainer_harness.py."""

from __future__ import annotations

from trainer_harness import check, scenario


def test_resume_at_another_data_parallel_size(server, tmp_path):
    check(scenario("hf", server.address, "main", tmp_path), server.address, "main")
