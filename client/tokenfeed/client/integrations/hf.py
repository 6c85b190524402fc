"""Hugging Face Trainer / accelerate: a per-rank dataset the Trainer uses as it is.

    from tokenfeed.client import Client
    from tokenfeed.client.integrations.hf import TokenFeedTrainer

    trainer = TokenFeedTrainer(
        model=model, args=TrainingArguments(output_dir, max_steps=..., save_steps=...),
        feed=Client(TARGET, job=JOB),
    )
    trainer.train(resume_from_checkpoint=True)  # or a path, or nothing

Each process reads its own rank's rows (`args.process_index` of `args.world_size`), so the
train dataloader is not prepared by accelerate: accelerate would re-shard an iterable dataset
(IterableDatasetShard keeps every world_size-th batch of it, or rank 0 reads all and dispatches).
Each step yields one rank batch, as the model's keyword arguments: `input_ids`, `position_ids`,
`labels` (pre-shifted, -100 where not trained on) and the same tensor as `shift_labels`, which
the causal-LM loss takes as they are (it would shift `labels` once more and lose the last
target). `gradient_accumulation_steps` micro-steps read as many steps of the feed.

Resuming: the Trainer restores `global_step` from the checkpoint's trainer_state.json; the
feed resumes at `global_step * gradient_accumulation_steps` at any world size, and warms it
before the first step. The Trainer's own data skipping (for datasets that restart from zero) is
switched off (`ignore_data_skip`): this stream already starts at the right step.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from tokenfeed.client._client import Client
from tokenfeed.client.integrations._feed import RankFeed
from tokenfeed.client.integrations._tensors import torch_batch


def hf_inputs(batch: Any, device: Any = None) -> dict[str, Any]:
    """A tokenfeed batch as a causal LM's keyword arguments."""
    t = torch_batch(batch, device)
    return {
        "input_ids": t["input_ids"],
        "position_ids": t["position_ids"],
        "labels": t["labels"],
        "shift_labels": t["labels"],
    }


def __getattr__(name: str) -> Any:
    # The classes subclass torch's and transformers' own: made when first asked for, so
    # importing this module imports neither.
    if name == "TokenFeedIterable":
        return _iterable_class()
    if name == "TokenFeedTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _iterable_class() -> type:
    from torch.utils.data import IterableDataset

    class TokenFeedIterable(IterableDataset):
        """One rank's batches, one per item (use DataLoader(batch_size=None))."""

        def __init__(self, feed: RankFeed):
            super().__init__()
            self.feed = feed

        def __iter__(self) -> Iterator[dict[str, Any]]:
            for batch in self.feed.batches():
                yield hf_inputs(batch)

    return TokenFeedIterable


@functools.cache
def _trainer_class() -> type:
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainerCallback

    class _Resume(TrainerCallback):
        def __init__(self, feed: RankFeed):
            self.feed = feed

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # The checkpoint's global_step is restored by now; the stream starts there.
            self.feed.resume_at(state.global_step * args.gradient_accumulation_steps)

    class TokenFeedTrainer(Trainer):
        def __init__(self, *args: Any, feed: Client, job: str | None = None, **kwargs: Any):
            if kwargs.get("train_dataset") is not None:
                raise ValueError("TokenFeedTrainer reads its train data from `feed`")
            super().__init__(*args, **kwargs)
            self.args.ignore_data_skip = True
            self.feed = RankFeed(feed, self.args.process_index, self.args.world_size, job=job)
            self.train_dataset = _iterable_class()(self.feed)
            self.add_callback(_Resume(self.feed))

        def get_train_dataloader(self) -> DataLoader:
            # Not prepared by accelerate: this rank's rows already (see the module's doc).
            return DataLoader(self.train_dataset, batch_size=None, num_workers=0)

    return TokenFeedTrainer
