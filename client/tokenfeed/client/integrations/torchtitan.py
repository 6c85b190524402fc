"""torchtitan: a dataloader with its `BaseDataLoader` / `Stateful` contract.

    from tokenfeed.client import Client
    from tokenfeed.client.integrations.torchtitan import TokenFeedDataLoader

    def build_tokenfeed_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **_):
        return TokenFeedDataLoader(Client(TARGET, job=JOB), dp_rank, dp_world_size)

    # in the TrainSpec: build_dataloader_fn=build_tokenfeed_dataloader

It yields `(input_dict, labels)` per step as torchtitan's trainer reads it: `input_dict["input"]`
the token ids, `input_dict["position_ids"]` (restarting at each document, for document-masked
attention), `labels` int64 with -100 where nothing is trained on. Its state is the global
`FeedState`, the same on every rank (DCP writes it once), so torchtitan's CheckpointManager
resumes it at any data-parallel size, where torchtitan's own dataloader refuses a changed one.
Loading the state warms the resume step while the model and optimizer load.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from tokenfeed.client._client import Client
from tokenfeed.client.integrations._feed import RankFeed
from tokenfeed.client.integrations._tensors import torch_batch

STATE_KEY = "tokenfeed"


@functools.cache
def _register() -> None:
    """Make TokenFeedDataLoader a torchtitan BaseDataLoader (an ABC: registered, not
    subclassed, so this module imports torchtitan only when a loader is made)."""
    from torchtitan.components.dataloader import BaseDataLoader

    BaseDataLoader.register(TokenFeedDataLoader)


class TokenFeedDataLoader:
    def __init__(
        self,
        client: Client,
        dp_rank: int,
        dp_world_size: int,
        *,
        job: str | None = None,
        start_step: int = 0,
        end_step: int | None = None,
        device: Any = None,
    ):
        _register()
        self.feed = RankFeed(
            client, dp_rank, dp_world_size, job=job, start_step=start_step, end_step=end_step
        )
        self.device = device

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        for batch in self.feed.batches():
            t = torch_batch(batch, self.device)
            yield {"input": t["input_ids"], "position_ids": t["position_ids"]}, t["labels"]

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: self.feed.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # torchtitan loads an empty state for a fresh run
            return
        self.feed.restore(state_dict[STATE_KEY])
