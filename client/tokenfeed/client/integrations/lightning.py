"""Lightning: a DataModule whose state rides in Lightning's checkpoint.

    from tokenfeed.client import Client
    from tokenfeed.client.integrations.lightning import TokenFeedDataModule

    data = TokenFeedDataModule(Client(TARGET, job=JOB))
    trainer = lightning.Trainer(max_steps=..., strategy="ddp", ...)
    trainer.fit(model, datamodule=data, ckpt_path="last")   # or None on the first run

The rank and world size come from the trainer (`global_rank`, `world_size`) at setup. Each
step is one rank batch: a dict of `input_ids`, `labels` (int64, pre-shifted, -100 where not
trained on), `position_ids`, `segment_ids`, `loss_mask`. `state_dict` (the global FeedState)
is saved by Lightning in every checkpoint under the DataModule's class name, and
`load_state_dict` resumes there at any world size, warming the resume step while Lightning
restores the model and optimizer. The state counts the batches that reached the training step
(Lightning fetches one ahead). The DataLoader has no workers: the client reads ahead.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from typing import Any

from tokenfeed.client._client import Client
from tokenfeed.client.integrations._feed import RankFeed
from tokenfeed.client.integrations._state import FeedState
from tokenfeed.client.integrations._tensors import torch_batch


def __getattr__(name: str) -> Any:
    # A LightningDataModule subclass, made when first asked for: importing this module does
    # not import Lightning.
    if name == "TokenFeedDataModule":
        return _datamodule_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _datamodule_class() -> type:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, IterableDataset

    class _Batches(IterableDataset):
        def __init__(self, feed: RankFeed, handed: deque[int]):
            super().__init__()
            self.feed, self.handed = feed, handed

        def __iter__(self) -> Iterator[dict[str, Any]]:
            for batch in self.feed.batches():
                self.handed.append(batch.step)
                yield torch_batch(batch)

    class TokenFeedDataModule(pl.LightningDataModule):
        def __init__(self, client: Client, *, job: str | None = None):
            super().__init__()
            self.client, self.job = client, job
            self.feed: RankFeed | None = None
            self._restored: FeedState | None = None
            # Lightning's fetcher reads a batch ahead of the one training: the state counts
            # the batches that reached the training step (on_before_batch_transfer), not
            # those handed to the fetcher, or a resume would skip one.
            self._handed: deque[int] = deque()
            self._trained: int | None = None

        def setup(self, stage: str) -> None:
            if self.feed is None:
                rank, world = self.trainer.global_rank, self.trainer.world_size
                self.feed = RankFeed(self.client, rank, world, job=self.job)
            if self._restored is not None:
                self.feed.restore(self._restored)
                self._restored = None

        def train_dataloader(self) -> DataLoader:
            if self.feed is None:
                raise RuntimeError("train_dataloader() before setup(): Lightning calls setup first")
            self._handed.clear()
            return DataLoader(_Batches(self.feed, self._handed), batch_size=None, num_workers=0)

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            if self.trainer is not None and self.trainer.training and self._handed:
                self._trained = self._handed.popleft() + 1
            return batch

        def state_dict(self) -> dict[str, Any]:
            if self.feed is None:
                return {}
            state = self.feed.state()
            if self._trained is not None:
                links = self.feed.read.links(self._trained)  # the steps it trained on
                state = FeedState(self._trained, state.job, state.job_fingerprint, links)
            return state.to_dict()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if not state_dict:
                return
            state = FeedState.from_dict(state_dict)
            self._trained = state.next_step
            if self.feed is not None:
                self.feed.restore(state)
            else:  # restored before setup: applied there
                self._restored = state

    return TokenFeedDataModule
