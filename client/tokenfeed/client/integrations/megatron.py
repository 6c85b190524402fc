"""Megatron-LM / Megatron-Core: the iterator for `--dataloader-type external`.

    from tokenfeed.client import Client
    from tokenfeed.client.integrations.megatron import megatron_iterator
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    def train_valid_test_datasets_provider(train_val_test_num_samples):
        args = get_args()
        train = megatron_iterator(
            Client(TARGET, job=JOB),
            consumed_samples=args.consumed_train_samples,
            global_batch_size=args.global_batch_size,
            dp_rank=ps.get_data_parallel_rank(),
            dp_world_size=ps.get_data_parallel_world_size(),
        )
        return train, None, None
    # with --dataloader-type external: Megatron uses it as the train data iterator

Each `next` is one micro-batch as GPT's `get_batch` reads it: `tokens`, `labels`, `loss_mask`,
`position_ids` (int64 / float32 tensors) and `attention_mask` None (use
`--no-create-attention-mask-in-dataloader`: causal masking is the model's). A step's rank
batch (global batch / data-parallel size rows) is cut into micro-batches of
`micro_batch_size` rows, in order, so gradient accumulation sees the rows in the same order.

Megatron checkpoints `consumed_train_samples` itself; the iterator starts at step
`consumed_samples // global_batch_size`, at whatever data-parallel size the run now has, and
warms that step at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenfeed.client._client import Client
from tokenfeed.client.batch import microbatches
from tokenfeed.client.integrations._feed import RankFeed
from tokenfeed.client.integrations._tensors import torch_batch


class MegatronIterator:
    """Micro-batches of one data-parallel rank from a global sample count on."""

    def __init__(self, feed: RankFeed, micro_batch_size: int | None, device: Any = None):
        self.feed, self.micro_batch_size, self.device = feed, micro_batch_size, device
        self._micro: Iterator[dict[str, Any]] = iter(())
        self._batches = feed.batches()

    def __iter__(self) -> MegatronIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        for micro in self._micro:
            return micro
        batch = next(self._batches)
        t = torch_batch(batch, self.device)
        rows = t["input_ids"].shape[0]
        size = self.micro_batch_size or rows
        gpt = {
            "tokens": t["input_ids"],
            "labels": t["labels"].clamp(min=0),  # Megatron masks by loss_mask, not -100
            "loss_mask": t["loss_mask"],
            "position_ids": t["position_ids"],
        }
        parts = microbatches(gpt, rows // size) if size != rows else [gpt]
        self._micro = iter([{**part, "attention_mask": None} for part in parts])
        return next(self._micro)


def megatron_iterator(
    client: Client,
    *,
    consumed_samples: int,
    global_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    micro_batch_size: int | None = None,
    job: str | None = None,
    device: Any = None,
) -> MegatronIterator:
    """The train data iterator of a run that has consumed `consumed_samples` samples."""
    if consumed_samples % global_batch_size:
        raise ValueError(
            f"consumed_samples {consumed_samples} is not a whole number of global batches of "
            f"{global_batch_size}: tokenfeed resumes at a step boundary"
        )
    local = global_batch_size // dp_world_size
    if micro_batch_size is not None and (
        global_batch_size % dp_world_size or local % micro_batch_size
    ):
        raise ValueError(
            f"global batch {global_batch_size} over {dp_world_size} ranks does not split into "
            f"micro-batches of {micro_batch_size}"
        )
    feed = RankFeed(client, dp_rank, dp_world_size, job=job)
    feed.resume_at(consumed_samples // global_batch_size)
    return MegatronIterator(feed, micro_batch_size, device)
