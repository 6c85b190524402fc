"""OLMo-core: a `DataLoaderBase` for its Trainer.

    from tokenfeed.client import Client
    from tokenfeed.client.integrations.olmo_core import TokenFeedDataLoader

    data_loader = TokenFeedDataLoader(
        Client(TARGET, job=JOB), work_dir=work_dir, global_batch_size=rows,
        dp_rank=get_rank(dp_process_group), dp_world_size=get_world_size(dp_process_group),
    )
    trainer = trainer_config.build(train_module, data_loader)

Each batch is this rank's rows of a step: `input_ids`, `labels` (aligned to the inputs, -100
where not trained on, as OLMo-core's `get_labels` takes them) and `position_ids`. The stream is
the server's order; OLMo-core's epochs are bookkeeping here (`total_batches` is None: train by
steps). The state is the global FeedState plus OLMo's `batches_processed`; loading it resumes
at its step at any data-parallel size, warmed.

Not tested against OLMo-core itself: ai2-olmo-core 3.0.0 does not install next to this
project's pins (filelock<4, and huggingface-hub<2 through cached-path; see docs/client.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenfeed.client._client import Client
from tokenfeed.client.integrations._feed import RankFeed
from tokenfeed.client.integrations._tensors import torch_batch


def __getattr__(name: str) -> Any:
    # A DataLoaderBase subclass, made when first asked for: importing this module does not
    # import OLMo-core.
    if name == "TokenFeedDataLoader":
        return _loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _loader_class() -> type:
    import torch
    from olmo_core.data.data_loader import DataLoaderBase

    class TokenFeedDataLoader(DataLoaderBase):
        def __init__(
            self,
            client: Client,
            *,
            work_dir: str | Path,
            global_batch_size: int,
            dp_rank: int = 0,
            dp_world_size: int = 1,
            job: str | None = None,
        ):
            super().__init__(
                work_dir=work_dir,
                global_batch_size=global_batch_size,
                dp_world_size=dp_world_size,
                dp_rank=dp_rank,
            )
            self.feed = RankFeed(client, dp_rank, dp_world_size, job=job)

        @property
        def total_batches(self) -> int | None:
            return None

        def state_dict(self) -> dict[str, Any]:
            return {**self.feed.state_dict(), "batches_processed": self.batches_processed}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches_processed = int(state_dict.get("batches_processed", 0))
            self.feed.restore(state_dict)

        def reshuffle(self, epoch: int | None = None, **kwargs: Any) -> None:
            self._epoch = epoch if epoch is not None else 1  # the order is the server's

        def _iter_batches(self) -> Iterable[dict[str, Any]]:
            for batch in self.feed.batches():
                t = torch_batch(batch)
                yield {k: t[k] for k in ("input_ids", "labels", "position_ids")}

        def get_mock_batch(self) -> dict[str, Any]:
            info = self.feed.client.describe(self.feed.job)
            rows = self.global_batch_size // self.dp_world_size
            shape = (rows, int(info["seq_len"]))
            ids = torch.zeros(shape, dtype=torch.int64)
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": ids.clone()}

        def global_num_tokens_in_batch(self, batch: dict[str, Any]) -> int | None:
            return int(batch["input_ids"].numel()) * self.dp_world_size

    return TokenFeedDataLoader
