"""One data-parallel rank's stream of a job, shared by every adapter: the next step, the batches
in order, the checkpoint state, and the warm start on restore.

The adapters differ only in the shape their framework wants (a dict of tensors, a tuple, a
numpy record) and in where their framework keeps the state; the stream's rules are here once:
a batch counts as consumed once handed to the trainer, so a checkpoint taken after the trainer
processed it resumes at the next one; a restore warms the resume step at once.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

from tokenfeed.client._base import ClientBase
from tokenfeed.client._client import Client
from tokenfeed.client._plans import ReadRecord
from tokenfeed.client.batch import Batch
from tokenfeed.client.integrations._state import FeedState


class RankFeed:
    """Steps from `next_step` on, of rank `rank` of `world_size`, through a sync `Client`."""

    def __init__(
        self,
        client: Client,
        rank: int = 0,
        world_size: int = 1,
        *,
        job: str | None = None,
        start_step: int = 0,
        end_step: int | None = None,
    ):
        if not isinstance(client, ClientBase):
            raise TypeError(f"expected a tokenfeed Client, got {type(client).__name__}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.client = client
        self.job = job or client.job or ""
        if not self.job:
            raise ValueError("no job: pass job= here or to Client(...)")
        self.rank, self.world_size = rank, world_size
        self.next_step, self.end_step = start_step, end_step
        self.read = ReadRecord(self.job)  # the job and plan it read: what a checkpoint holds

    def batches(self) -> Generator[Batch, None, None]:
        """The batches from `next_step` on (read ahead by the client), each counted as
        consumed when handed over."""
        stream = self.client.iter_batches(
            self.next_step, self.end_step, self.rank, self.world_size, job=self.job
        )
        try:
            for batch in stream:
                self.read.saw(
                    batch.job_fingerprint,
                    batch.plan_phase_start,
                    batch.plan_fingerprint,
                    batch.server,
                )
                self.next_step = batch.step + 1
                yield batch
        finally:
            stream.close()

    @property
    def job_fingerprint(self) -> str:
        return self.read.job_fingerprint

    def state(self) -> FeedState:
        links = self.read.links(self.next_step)
        return FeedState(self.next_step, self.job, self.read.job_fingerprint, links)

    def state_dict(self) -> dict[str, Any]:
        return self.state().to_dict()

    def restore(self, state: FeedState | Mapping[str, Any]) -> None:
        """Resume at the state's step (any world size), and start fetching it at once."""
        if not isinstance(state, FeedState):
            state = FeedState.from_dict(state)
        if state.job != self.job:
            raise ValueError(f"checkpoint is for job {state.job!r}, not {self.job!r}")
        if state.plan:  # the plan now must decide every step the run read as it did then
            self.client.check_plan(state.plan, state.next_step, job=self.job)
        self.read.job_fingerprint, self.read.plan_links = state.job_fingerprint, dict(state.plan)
        self.resume_at(state.next_step)

    def resume_at(self, step: int) -> None:
        """Resume at `step` (a framework that counts steps itself says where), warmed."""
        if step < 0:
            raise ValueError(f"resume step must be >= 0, got {step}")
        self.next_step = step
        if self.end_step is None or step < self.end_step:
            self.client.warm(step, self.rank, self.world_size, job=self.job)
