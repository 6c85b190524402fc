"""Grain / MaxText: an iterator with the `get_state` / `set_state` contract Grain checkpoints.

    import jax
    from tokenfeed.client import Client
    from tokenfeed.client.integrations.grain import TokenFeedIterator

    data = TokenFeedIterator(Client(TARGET, job=JOB), jax.process_index(), jax.process_count())
    for local in data:                      # numpy arrays of this process's rows
        batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
        ...
    grain.checkpoint.CheckpointHandler().save(path, data)     # what MaxText's handler does

Process p of P reads rows [p*B/P, (p+1)*B/P) of each global batch, so the jax.Array assembled
from the processes' slices is the global batch whatever P is. Items are dicts of read-only int32
numpy arrays (`input_ids`, `labels`, `position_ids`, `segment_ids`, `loss_mask`: MaxText's
`inputs`, `targets`, `inputs_position`, `inputs_segmentation`, `targets_segmentation` under
the names given by `names=`).

`get_state()` is the global FeedState as JSON bytes (as Grain's DataLoader iterator gives
its state), the same in every process. Grain's CheckpointHandler stores one file per process
named after the process count
(`process_{i}-of-{n}.json`) and restores only a file of the same count; after a change of the
number of processes, `state_from(directory)` reads the state from whichever files are there
(they agree) for `set_state`. `set_state` warms the resume step.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tokenfeed.client._client import Client
from tokenfeed.client.batch import Batch
from tokenfeed.client.integrations._feed import RankFeed
from tokenfeed.client.integrations._state import FeedState

MAXTEXT_NAMES = {
    "input_ids": "inputs",
    "labels": "targets",
    "position_ids": "inputs_position",
    "segment_ids": "inputs_segmentation",
    "loss_mask": "targets_segmentation",
}


class TokenFeedIterator:
    def __init__(
        self,
        client: Client,
        process_index: int,
        process_count: int,
        *,
        job: str | None = None,
        start_step: int = 0,
        end_step: int | None = None,
        names: Mapping[str, str] | None = None,
    ):
        self.feed = RankFeed(
            client, process_index, process_count, job=job, start_step=start_step, end_step=end_step
        )
        self.names = dict(names) if names is not None else None
        self._batches: Generator[Batch, None, None] | None = None

    def __iter__(self) -> TokenFeedIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._batches is None:
            self._batches = self.feed.batches()
        batch = next(self._batches)
        if self.names is None:
            return dict(batch.items())
        if self.names.get("loss_mask") == "targets_segmentation":
            # MaxText trains where targets_segmentation != 0: the segment, 0 on padding.
            out = {self.names[k]: v for k, v in batch.items() if k != "loss_mask"}
            out["targets_segmentation"] = np.where(batch["loss_mask"] > 0, batch["segment_ids"], 0)
            return out
        return {self.names.get(k, k): v for k, v in batch.items()}

    def get_state(self) -> bytes:
        """The FeedState as JSON bytes, like Grain's DataLoader iterator (what Grain's
        CheckpointHandler and MaxText's checkpointing store)."""
        return json.dumps(self.feed.state_dict(), sort_keys=True).encode()

    def set_state(self, state: bytes | str | Mapping[str, Any]) -> None:
        raw = json.loads(state) if isinstance(state, bytes | str) else state
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        self.feed.restore(raw)

    def start_prefetch(self) -> None:
        """Grain's handler calls this after `set_state`: the resume step is already warmed."""


def state_from(directory: str | Path) -> dict[str, Any]:
    """The iterator state in a Grain checkpoint directory written by any number of processes."""
    files = sorted(Path(directory).glob("process_*-of-*.json"))
    if not files:
        raise FileNotFoundError(f"no Grain iterator state (process_*-of-*.json) in {directory}")
    states = {FeedState.from_dict(json.loads(f.read_text())) for f in files}
    if len(states) != 1:
        raise ValueError(
            f"the processes' states in {directory} disagree: {sorted(map(str, states))}"
        )
    return states.pop().to_dict()
