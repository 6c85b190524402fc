"""PyTorch adapter: an IterableDataset whose checkpoint state is the next step.

    from tokenfeed.client import Client
    from tokenfeed.client.torch import TokenFeedDataset

    data = TokenFeedDataset(Client(target, job="run3"), rank=dp_rank, world_size=dp_size)
    loader = torch.utils.data.DataLoader(data, batch_size=None)   # batches come whole
    data.load_state_dict(checkpoint["data"])                        # on resume
    for batch in loader:                                            # dict of int32 tensors
        ...
        checkpoint["data"] = data.state_dict()

The state is `{"next_step", "job", "job_fingerprint"}`. Loading it checks the fingerprint
against what the servers serve now, so a resumed run provably reads the same data; the world
size may differ on resume (elastic). Use `num_workers=0`: the client already reads ahead in a
background thread, and DataLoader workers would each hold a copy of the position, which the
main process's `state_dict()` could not see.

Tensors are copies (`torch.from_numpy` over read-only network buffers would be unsafe to write);
one memcpy of the batch, which DataLoader's `pin_memory` would make anyway.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from tokenfeed.client._client import Client
from tokenfeed.client.errors import JobMismatch
from torch.utils.data import IterableDataset, get_worker_info


class TokenFeedDataset(IterableDataset):
    def __init__(
        self, client: Client, rank: int = 0, world_size: int = 1, *, start_step: int = 0,
        end_step: int | None = None, job: str | None = None,
    ):  # fmt: skip
        super().__init__()
        self.client = client
        self.job = job or client.job
        if not self.job:
            raise ValueError("no job: pass job= here or to Client(...)")
        self.rank, self.world_size = rank, world_size
        self.next_step, self.end_step = start_step, end_step
        self.job_fingerprint = ""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        if info is not None and info.num_workers > 0:
            raise RuntimeError(
                "TokenFeedDataset runs in the main process: use DataLoader(num_workers=0); "
                "the client already prefetches in a background thread"
            )
        batches = self.client.iter_batches(self.next_step, self.end_step, self.rank,
                                           self.world_size, job=self.job)  # fmt: skip
        for batch in batches:
            self._check(batch.job_fingerprint, f"server {batch.server}")
            # Counted as consumed once handed over: a checkpoint taken after the trainer
            # processed this batch resumes at the next one.
            self.next_step = batch.step + 1
            yield {name: torch.from_numpy(np.array(arr)) for name, arr in batch.items()}

    def _check(self, fingerprint: str, source: str) -> None:
        """Adopt the first fingerprint seen; refuse any other after it."""
        if self.job_fingerprint and fingerprint and fingerprint != self.job_fingerprint:
            raise JobMismatch(
                f"job {self.job!r}: {source} has job fingerprint {fingerprint}, but this run "
                f"(or its checkpoint) read {self.job_fingerprint}; the job's definition "
                "changed since the checkpoint"
            )
        self.job_fingerprint = self.job_fingerprint or fingerprint

    def state_dict(self) -> dict:
        return {"next_step": self.next_step, "job": self.job,
                "job_fingerprint": self.job_fingerprint}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if state.get("job") != self.job:
            raise ValueError(f"checkpoint is for job {state.get('job')!r}, not {self.job!r}")
        # The checkpoint's fingerprint (empty if it was taken before any batch) binds the run;
        # the server's is checked now if its index is built, and on every batch anyway.
        self.job_fingerprint = state.get("job_fingerprint", "")
        self._check(self.client.describe(self.job)["fingerprint"], "the server")
        self.next_step = int(state["next_step"])
