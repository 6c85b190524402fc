"""OLMo-core: a `DataLoaderBase` for its Trainer.

    from tokenfeed.client import Client
    from tokenfeed.client.integrations.olmo_core import TokenFeedDataLoader

    data_loader = TokenFeedDataLoader(
        Client(TARGET, job=JOB), work_dir=work_dir, global_batch_size=rows * seq_len,
        dp_rank=get_rank(dp_process_group), dp_world_size=get_world_size(dp_process_group),
    )
    trainer = trainer_config.build(train_module, data_loader)

`global_batch_size` is in tokens, OLMo-core's unit for text (its Trainer's `tokens_per_batch`,
and what `TransformerTrainModule` divides by `rank_microbatch_size`): the job's rows per step
times its `seq_len`. A batch that does not hold this rank's share of it is an error naming
both, not a silent miscount of tokens.

Each batch is this rank's rows of a step: `input_ids` and `labels` (int64, aligned to the
inputs, -100 where not trained on). With labels given, OLMo-core's train modules take them as
they are instead of shifting `input_ids` (`get_labels`), so the last position of each row is
trained on too. Other keys of a batch are passed by `TransformerTrainModule` to the model as
keyword arguments, and OLMo-core's Transformer takes document boundaries only as `doc_lens`
and `max_doc_lens` (with a flash-attention backend): `doc_lens=True` adds them, in the form
OLMo-core's own loader makes (`generate_doc_lengths`); positions are not sent.

The stream is the server's order and never ends: OLMo-core's epochs are bookkeeping here
(`total_batches` is None, so train by steps or tokens; `reshuffle` only sets the epoch). The
Trainer saves `state_dict` in every checkpoint (`train/rank<r>.pt`; a rank that has none
reads rank 0's): the global FeedState plus OLMo's `batches_processed` and `epoch`.
`load_state_dict` resumes at the state's step at any data-parallel size, and warms that step
while the Trainer restores the model and optimizer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenfeed.client._client import Client
from tokenfeed.client.batch import doc_lengths
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
        _epoch: int | None  # DataLoaderBase's (OLMo-core is not analysed by mypy)

        def __init__(
            self,
            client: Client,
            *,
            work_dir: str | Path,
            global_batch_size: int,
            dp_rank: int = 0,
            dp_world_size: int = 1,
            fs_local_rank: int | None = None,
            job: str | None = None,
            doc_lens: bool = False,
        ):
            if not isinstance(global_batch_size, int) or global_batch_size <= 0:
                raise ValueError(
                    f"global_batch_size is in tokens (rows x seq_len), got {global_batch_size!r}"
                )
            if global_batch_size % dp_world_size:
                raise ValueError(
                    f"global_batch_size {global_batch_size} tokens does not split into "
                    f"{dp_world_size} data-parallel ranks"
                )
            # The feed first: it checks the rank, which OLMo-core only asserts.
            self.feed = RankFeed(client, dp_rank, dp_world_size, job=job)
            self.doc_lens = doc_lens
            super().__init__(
                work_dir=work_dir,
                global_batch_size=global_batch_size,
                dp_world_size=dp_world_size,
                dp_rank=dp_rank,
                fs_local_rank=fs_local_rank,
            )

        @property
        def total_batches(self) -> int | None:
            return None  # the server's stream has no end

        def state_dict(self) -> dict[str, Any]:
            return {
                **self.feed.state_dict(),
                "batches_processed": self.batches_processed,
                "epoch": self._epoch,
            }

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.feed.restore(state_dict)
            self.batches_processed = int(state_dict.get("batches_processed", 0))
            self._epoch = state_dict.get("epoch") or self._epoch

        def reshuffle(self, epoch: int | None = None, **kwargs: Any) -> None:
            # The Trainer calls this before each epoch, after a restore too: the order is the
            # server's, so only OLMo-core's epoch number changes.
            if epoch is None:
                epoch = 1 if self._epoch is None else self._epoch + 1
            if epoch <= 0:
                raise ValueError(f"epoch must be at least 1, got {epoch}")
            self._epoch = epoch

        def _iter_batches(self) -> Iterable[dict[str, Any]]:
            for batch in self.feed.batches():
                t = torch_batch(batch)
                ids = t["input_ids"]
                if ids.numel() != self.rank_batch_size:
                    raise ValueError(
                        f"step {batch.step}: rank {self.dp_rank} of {self.dp_world_size} got "
                        f"{tuple(ids.shape)} = {ids.numel()} tokens, where global_batch_size "
                        f"{self.global_batch_size} gives {self.rank_batch_size}: pass the "
                        "job's rows per step x seq_len"
                    )
                out: dict[str, Any] = {"input_ids": ids, "labels": t["labels"]}
                if self.doc_lens:
                    lens, longest = doc_lengths(batch.compact)
                    out["doc_lens"], out["max_doc_lens"] = torch.from_numpy(lens), longest
                yield out

        def get_mock_batch(self) -> dict[str, Any]:
            # The Trainer's dry run (a forward and backward pass before the first step).
            seq_len = int(self.feed.client.describe(self.feed.job)["seq_len"])
            ids = torch.zeros((max(self.rank_batch_size // seq_len, 1), seq_len), dtype=torch.int64)
            mock: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
            if self.doc_lens:  # one document a row
                mock["doc_lens"] = torch.full((len(ids), 1), seq_len, dtype=torch.int32)
                mock["max_doc_lens"] = [seq_len] * len(ids)
            return mock

        def global_num_tokens_in_batch(self, batch: dict[str, Any]) -> int | None:
            return self.global_batch_size  # every rank's share was checked to be whole

    return TokenFeedDataLoader
