"""Adapters for the trainers people run: each module imports its framework only when used.

| module | framework | what it gives |
| --- | --- | --- |
| `torchtitan` | torchtitan | `TokenFeedDataLoader`, a `BaseDataLoader` (a DCP `Stateful`) |
| `megatron` | Megatron-LM / Megatron-Core | `megatron_iterator`, for `--dataloader-type external` |
| `hf` | Hugging Face Trainer / accelerate | `TokenFeedTrainer`, `TokenFeedIterable` |
| `lightning` | Lightning | `TokenFeedDataModule`, its state in Lightning's checkpoint |
| `olmo_core` | OLMo-core | `TokenFeedDataLoader`, a `DataLoaderBase` |
| `grain` | Grain / MaxText | `TokenFeedIterator`, with Grain's `get_state` / `set_state` |

Every adapter's checkpoint state is `FeedState` (_state.py): the next global step and the job.
A batch is a pure function of (step, rank, world size), so a run resumes at any data-parallel
size from that step alone. Each adapter calls `Client.warm` as soon as it knows the resume
step, so the first batch is on its way while the trainer restores the rest of its checkpoint.
"""

from tokenfeed.client.integrations._state import FeedState

__all__ = ["FeedState"]
