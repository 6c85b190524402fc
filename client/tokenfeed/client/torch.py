"""PyTorch adapter: an IterableDataset whose checkpoint state is the next step.

    from tokenfeed.client import Client
    from tokenfeed.client.torch import TokenFeedDataset

    data = TokenFeedDataset(Client(target, job="run3"), rank=dp_rank, world_size=dp_size)
    loader = torch.utils.data.DataLoader(data, batch_size=None)   # batches come whole
    data.load_state_dict(checkpoint["data"])                        # on resume
    for batch in loader:                                            # dict of int32 tensors
        ...
        checkpoint["data"] = data.state_dict()

The state is `{"next_step", "job", "job_fingerprint"}`, and `plan` (the data plan's phases
the run read) once a batch was read. Loading it checks them against what the servers serve now:
a resumed run provably reads the same data up to its step, whatever the plan amends after it;
the world size may differ on resume (elastic). Use `num_workers=0`: the client already reads
ahead in a background thread, and DataLoader workers would each hold a copy of the position,
which the main process's `state_dict()` could not see.

With `device=` (e.g. "cuda"), only the compact batch (docs/batch-format.md: the token array in
its wire dtype and the document starts, a fifth of the five int32 tensors or less) is copied to
the device, and the five tensors are derived there (`expand`). Without it, the tensors are
derived on the CPU and copied (`torch.from_numpy` over read-only network buffers would be
unsafe to write); one memcpy of the batch, which DataLoader's `pin_memory` would make anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tokenfeed.client._client import Client
from tokenfeed.client._plans import ReadRecord
from tokenfeed.client.batch import Batch
from tokenfeed.client.wire import TENSOR_NAMES, Compact
from torch.utils.data import IterableDataset, get_worker_info


def expand(
    compact: Compact | Batch, device: str | torch.device | None = None, non_blocking: bool = False
) -> dict[str, torch.Tensor]:
    """The five int32 tensors [rows, seq_len] of a batch, derived on `device` from the compact
    form moved there (tokens in their wire dtype, the boundaries as small index arrays)."""
    c = compact.compact if isinstance(compact, Batch) else compact
    L, rows = c.seq_len, c.rows
    # uint16 has too few torch ops: widen on the device, after the (narrow) copy.
    narrow = (
        np.ascontiguousarray(c.tokens).view(np.int16)
        if c.tokens.dtype.itemsize == 2
        else np.ascontiguousarray(c.tokens)
    )
    tokens = torch.from_numpy(narrow.copy()).to(device, non_blocking=non_blocking)
    if c.tokens.dtype.itemsize == 2:
        tokens = tokens.to(torch.int32) & 0xFFFF
    else:
        tokens = tokens.to(torch.int32)
    row_of = np.repeat(np.arange(rows, dtype=np.int64), np.diff(c.row_splits))
    index = torch.from_numpy(row_of * L + c.starts.astype(np.int64)).to(device)
    mask = torch.zeros(rows * L, dtype=torch.bool, device=tokens.device)
    mask[index] = True
    mask = mask.view(rows, L)
    mask[:, 0] = True
    col = torch.arange(L, dtype=torch.int32, device=tokens.device)
    segment = torch.cumsum(mask, dim=1, dtype=torch.int32)
    last = torch.cummax(torch.where(mask, col, torch.zeros_like(col)), dim=1).values
    position = col - last
    if c.padding is None:
        loss = torch.ones((rows, L), dtype=torch.int32, device=tokens.device)
    else:
        used = (L + 1 - torch.from_numpy(c.padding.astype(np.int64)).to(device))[:, None]
        loss = (col + 1 < used).to(torch.int32)
        valid = col < used
        segment = segment * valid
        position = position * valid
    out = {
        "input_ids": tokens[:, :L],
        "labels": tokens[:, 1:],
        "position_ids": position,
        "segment_ids": segment,
        "loss_mask": loss,
    }
    return {name: out[name] for name in TENSOR_NAMES}


class TokenFeedDataset(IterableDataset[dict[str, torch.Tensor]]):
    def __init__(
        self,
        client: Client,
        rank: int = 0,
        world_size: int = 1,
        *,
        start_step: int = 0,
        end_step: int | None = None,
        job: str | None = None,
        device: str | torch.device | None = None,
    ):
        super().__init__()
        self.device = device
        self.client = client
        self.job = job or client.job
        if not self.job:
            raise ValueError("no job: pass job= here or to Client(...)")
        self.rank, self.world_size = rank, world_size
        self.next_step, self.end_step = start_step, end_step
        self.read = ReadRecord(self.job)  # the job and plan it read: what a checkpoint holds

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        if info is not None and info.num_workers > 0:
            raise RuntimeError(
                "TokenFeedDataset runs in the main process: use DataLoader(num_workers=0); "
                "the client's stream already reads ahead"
            )
        batches = self.client.iter_batches(
            self.next_step, self.end_step, self.rank, self.world_size, job=self.job
        )
        for batch in batches:
            self.read.saw(
                batch.job_fingerprint, batch.plan_phase_start, batch.plan_fingerprint, batch.server
            )
            # Counted as consumed once handed over: a checkpoint taken after the trainer
            # processed this batch resumes at the next one.
            self.next_step = batch.step + 1
            if self.device is not None:
                yield expand(batch, self.device)
            else:
                yield {name: torch.from_numpy(np.array(arr)) for name, arr in batch.items()}

    @property
    def job_fingerprint(self) -> str:
        return self.read.job_fingerprint

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "next_step": self.next_step,
            "job": self.job,
            "job_fingerprint": self.read.job_fingerprint,
        }
        links = self.read.links(self.next_step)
        if links:  # the data plan's phases the run read (docs/data-plan.md)
            state["plan"] = [[s, f] for s, f in links]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("job") != self.job:
            raise ValueError(f"checkpoint is for job {state.get('job')!r}, not {self.job!r}")
        # The checkpoint's fingerprint (empty if it was taken before any batch) binds the run;
        # the server's is checked now if its index is built, and on every batch anyway.
        self.read.job_fingerprint = state.get("job_fingerprint", "")
        self.read.check(self.client.describe(self.job)["fingerprint"], "the server")
        self.next_step = int(state["next_step"])
        links = [(int(s), str(f)) for s, f in state.get("plan") or ()]
        if links:  # the plan now must decide every step the run read as it did then
            self.client.check_plan(links, self.next_step, job=self.job)
        self.read.plan_links = dict(links)
        # The resume step's batches start coming while the trainer restores the rest.
        self.client.warm(self.next_step, self.rank, self.world_size, job=self.job)
