"""State and policy shared by the sync and asyncio clients (no I/O of its own).

- which server to try next: the rendezvous ranking for (job, rank), servers that failed
  recently moved to the back for `suspect_seconds`;
- when to give up: retryable codes only, exponential backoff with jitter after each full round
  of servers, an overall deadline that progress (a delivered batch) renews;
- what a batch must agree with: the first job fingerprint seen for each job.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tokenfeed.client.batch import Batch
from tokenfeed.client.errors import (
    DeadlineExceeded,
    JobMismatch,
    TokenfeedClientError,
    Unavailable,
)
from tokenfeed.client.fleet import Fleet
from tokenfeed.v1 import tokenfeed_pb2 as pb

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
    # Reconnect quickly to a server that comes back (the default backoff reaches 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class Policy:
    timeout: float = 60.0  # overall, per call (or per stream without progress)
    # Per server, and the longest a stream may stay silent: past it the server is taken for
    # hung and the next one is tried. None: a third of `timeout`, so a hung server leaves
    # time for two more.
    attempt_timeout: float | None = None
    backoff: float = 0.05
    max_backoff: float = 2.0
    suspect_seconds: float = 10.0
    verify: bool = True


class Session:
    def __init__(self, target: str, policy: Policy, refresh_seconds: float = 30.0):
        self.fleet = Fleet(target, refresh_seconds)
        self.policy = policy
        self._suspects: dict[str, float] = {}
        self._fingerprints: dict[str, str] = {}
        self._lock = threading.Lock()

    def mark_failed(self, addr: str) -> None:
        with self._lock:
            self._suspects[addr] = time.monotonic() + self.policy.suspect_seconds

    def order(self, job: str, rank: int, force: bool = False) -> list[str]:
        ranked = self.fleet.ranked(job, rank, force)
        now = time.monotonic()
        with self._lock:
            healthy = [a for a in ranked if self._suspects.get(a, 0) <= now]
        return healthy + [a for a in ranked if a not in healthy]

    def rounds(self, job: str, rank: int, deadline: float) -> Iterator[list[str] | float]:
        """Yields server lists to try, with sleeps (floats, seconds) between rounds, until
        the deadline. The caller tries each server of a list in order."""
        delay, first = self.policy.backoff, True
        while True:
            servers = self.order(job, rank, force=not first)
            first = False
            if servers:
                yield servers
            pause = delay * (0.5 + random.random() / 2)
            if time.monotonic() + pause >= deadline:
                return
            yield pause
            delay = min(delay * 2, self.policy.max_backoff)

    @property
    def silence_limit(self) -> float:
        p = self.policy
        return p.attempt_timeout if p.attempt_timeout is not None else p.timeout / 3

    def attempt_timeout(self, deadline: float) -> float:
        return min(self.silence_limit, max(deadline - time.monotonic(), 0.001))

    def give_up(self, job: str, last: Exception | None) -> Exception:
        if last is not None:
            return last
        if not self.fleet.addresses():
            return Unavailable(f"no server address for target {self.fleet.target!r}")
        return DeadlineExceeded(f"no server answered for job {job!r} in time")

    def batch(self, msg: pb.Batch, server: str, expected_step: int) -> Batch:
        if msg.step != expected_step:
            raise TokenfeedClientError(
                f"server {server} sent step {msg.step} where step {expected_step} was due"
            )
        batch = Batch(msg, self.policy.verify, server)
        self.expect_fingerprint(batch.job, batch.job_fingerprint, f"server {server}")
        return batch

    def expect_fingerprint(self, job: str, fingerprint: str, source: str) -> None:
        if not fingerprint:
            return
        with self._lock:
            seen = self._fingerprints.setdefault(job, fingerprint)
        if seen != fingerprint:
            raise JobMismatch(
                f"job {job!r}: {source} has job fingerprint {fingerprint}, but {seen} was seen "
                "first; the servers' configs (or a checkpoint) define this job differently"
            )

    def stream_request(self, job: str, step: int, end: int | None, rank: int, world: int):
        return pb.StreamBatchesRequest(
            job=job, start_step=step, end_step=end or 0, rank=rank, world_size=world
        )


class ClientBase:
    """What the sync and asyncio clients share: their options and their job."""

    def __init__(
        self,
        target: str,
        job: str | None = None,
        *,
        timeout: float = 60.0,
        attempt_timeout: float | None = None,
        prefetch: int = 4,
        verify: bool = True,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        suspect_seconds: float = 10.0,
    ):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        policy = Policy(timeout, attempt_timeout, backoff, max_backoff, suspect_seconds, verify)
        self.session = Session(target, policy)
        self.target, self.job, self.prefetch = target, job, prefetch

    def _job(self, job: str | None) -> str:
        name = job or self.job
        if not name:
            raise ValueError(f"no job: pass job= to {type(self).__name__}(...) or to the call")
        return name
