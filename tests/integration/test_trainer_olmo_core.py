"""OLMo-core: TokenFeedDataLoader in OLMo-core's Trainer (a tiny Transformer, DDP on gloo),
checkpointed by its CheckpointerCallback and resumed 2 -> 1 and 1 -> 2 processes;
tests/trainer_harness.py. And the loader's refusals, in this process."""

from __future__ import annotations

import pytest
from tokenfeed.client import Client
from trainer_harness import check, scenario


def test_resume_at_another_data_parallel_size(server, tmp_path):
    check(scenario("olmo_core", server.address, "main", tmp_path), server.address, "main")


def test_a_batch_size_that_is_not_the_jobs_is_refused_with_both(server, tmp_path):
    from tokenfeed.client.integrations.olmo_core import TokenFeedDataLoader

    with Client(server.address, job="main") as feed:
        # Rows, not tokens: the job serves 8 rows of 64 tokens per step.
        loader = TokenFeedDataLoader(feed, work_dir=tmp_path, global_batch_size=8)
        loader.reshuffle(epoch=1)
        with pytest.raises(ValueError, match=r"\(8, 64\) = 512 tokens.*gives 8") as e:
            next(iter(loader))
        assert "rows per step x seq_len" in str(e.value)
        with pytest.raises(ValueError, match="does not split into 3"):
            TokenFeedDataLoader(feed, work_dir=tmp_path, global_batch_size=512, dp_world_size=3)
        with pytest.raises(ValueError, match="in tokens"):
            TokenFeedDataLoader(feed, work_dir=tmp_path, global_batch_size=0)
        with pytest.raises(ValueError, match="epoch must be at least 1"):
            loader.reshuffle(epoch=0)
        other = {**loader.state_dict(), "job": "other"}
        with pytest.raises(ValueError, match="checkpoint is for job 'other'"):
            loader.load_state_dict(other)
