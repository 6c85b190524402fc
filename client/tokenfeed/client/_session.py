"""State and policy shared by the sync and asyncio clients (no I/O of its own).

- which server to try next: the rendezvous ranking for (job, rank), servers that failed
  recently moved to the back for `suspect_seconds`;
- when to give up: retryable codes only, exponential backoff with jitter after each full round
  of servers, an overall deadline that progress (a delivered batch) renews;
- when to ask a server again: not before the end of the retry pushback it sent;
- how a hung server is noticed: keepalive pings on every channel (channel_options);
- what a batch must agree with: the first job fingerprint seen for each job;
- how long each (job, rank) waited for data, not reported yet (waits.py).
The loop that walks these decisions for one call is `_attempts.Attempts`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tokenfeed.client._plans import PlanWatch
from tokenfeed.client._received import Received, received
from tokenfeed.client.batch import Batch
from tokenfeed.client.errors import (
    DeadlineExceeded,
    JobMismatch,
    TokenfeedClientError,
    Unavailable,
)
from tokenfeed.client.fleet import Fleet
from tokenfeed.client.waits import WaitMeters
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
    # A channel's own connections (not shared through the process's subchannel pool): a
    # client asked to move its stream to another serving worker opens a new channel, and
    # only a new connection reaches another worker (moves.py).
    ("grpc.use_local_subchannel_pool", 1),
    # Reconnect quickly to a server that comes back (the default backoff reaches 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def channel_options(policy: Policy) -> list[tuple[str, int]]:
    """CHANNEL_OPTIONS and the policy's keepalive pings.

    A hung server (stopped, swapped out, its host gone without a FIN) keeps the connection
    open and answers nothing; a ping it does not acknowledge within the timeout closes the
    connection, every call on it fails UNAVAILABLE, and the client moves on. gRPC core
    acknowledges pings on its own threads, so a server busy in a slow handler still answers
    them: a slow step is never taken for a hung server."""
    if not policy.keepalive_seconds:
        return list(CHANNEL_OPTIONS)
    return [
        *CHANNEL_OPTIONS,
        ("grpc.keepalive_time_ms", int(policy.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(policy.keepalive_timeout_seconds * 1000)),
        # grpc 1.85 times a keepalive ping's answer with the general ping timeout (60 s by
        # default) rather than keepalive_timeout_ms: both are set.
        ("grpc.http2.ping_timeout_ms", int(policy.keepalive_timeout_seconds * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),  # a hung idle server is found before a call
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging through a long silent call
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
    # The longest wait a server's retry pushback imposes before that server is asked again:
    # its estimate of when a step's chunks are built is rough, and asking again costs one call.
    max_pushback: float = 10.0
    # Ping every 5 s, the most often tokenfeed servers accept (server.limits.min_ping_seconds),
    # and drop a connection whose ping is unanswered after 3 s: a hung server is left within
    # 8 s. Acknowledging a ping takes the server's gRPC core microseconds, even when loaded.
    # keepalive_seconds=0 turns the pings off.
    keepalive_seconds: float = 5.0
    keepalive_timeout_seconds: float = 3.0


class Session:
    def __init__(
        self,
        target: str,
        policy: Policy,
        refresh_seconds: float = 30.0,
        resolver: Callable[[str], list[str]] | None = None,
        report_waits: bool = True,
    ):
        self.fleet = Fleet(target, refresh_seconds, resolver)
        self.policy = policy
        self.report_waits = report_waits
        self.waits = WaitMeters()  # how long each (job, rank) blocked its trainer (waits.py)
        self._suspects: dict[str, float] = {}
        self._not_before: dict[str, float] = {}  # the end of each server's retry pushback
        self._fingerprints: dict[str, str] = {}
        self._lock = threading.Lock()
        self.plans = PlanWatch()  # each job's plan links seen, and the servers' disagreement
        self.new_phase: set[str] = set()  # jobs whose last batch began a phase new to us
        self._plan_checked: dict[str, float] = {}

    def mark_failed(self, addr: str, error: Exception | None = None) -> None:
        """`addr` failed: to the back of every ranking for a while, and not asked again before
        the end of the pushback its error carries (capped at `max_pushback`)."""
        now = time.monotonic()
        pushback = min(getattr(error, "retry_after", 0.0), self.policy.max_pushback)
        with self._lock:
            self._suspects[addr] = now + self.policy.suspect_seconds
            if pushback > 0:
                self._not_before[addr] = now + pushback

    def order(self, job: str, rank: int, force: bool = False) -> list[str]:
        ranked = self.fleet.ranked(job, rank, force)
        now = time.monotonic()
        with self._lock:
            healthy = [a for a in ranked if self._suspects.get(a, 0) <= now]
            # Among the suspects, those free to be asked now come first.
            rest = sorted(
                (a for a in ranked if a not in healthy), key=lambda a: self._not_before.get(a, 0)
            )
        return healthy + rest

    def pause_before(self, addr: str, deadline: float) -> float:
        """Seconds to wait before asking `addr`: what is left of its pushback, never past the
        call's deadline."""
        now = time.monotonic()
        with self._lock:
            until = min(self._not_before.get(addr, 0.0), deadline)
        return max(until - now, 0.0)

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

    def batch(self, got: Received, server: str, expected_step: int) -> Batch:
        """A received batch (`received`, the stubs' deserializer), checked and admitted."""
        msg = got.msg
        if msg.step != expected_step:
            raise TokenfeedClientError(
                f"server {server} sent step {msg.step} where step {expected_step} was due"
            )
        batch = Batch(msg, self.policy.verify, server, got.tokens)
        self.expect_fingerprint(batch.job, batch.job_fingerprint, f"server {server}")
        if self.plans.saw(
            batch.job, batch.step, batch.plan_phase_start, batch.plan_fingerprint, server
        ):
            self.new_phase.add(batch.job)
        return batch

    def plan_check_due(self, job: str, every: float) -> bool:
        """Whether the servers' plans are to be compared now: a rank reached a phase new to
        this client, or `every` seconds passed since the last comparison (0: never)."""
        if not every:
            return False
        now = time.monotonic()
        # Most batches: nothing due. Read without the lock (a dict's and a set's lookups are
        # atomic); a due check is decided again under it.
        if job not in self.new_phase and now - self._plan_checked.get(job, -1e18) < every:
            return False
        with self._lock:
            due = job in self.new_phase or now - self._plan_checked.get(job, -1e18) >= every
            if due:
                self.new_phase.discard(job)
                self._plan_checked[job] = now
        return due

    def expect_fingerprint(self, job: str, fingerprint: str, source: str) -> None:
        if not fingerprint or self._fingerprints.get(job) == fingerprint:  # seen: no lock
            return
        with self._lock:
            seen = self._fingerprints.setdefault(job, fingerprint)
        if seen != fingerprint:
            raise JobMismatch(
                f"job {job!r}: {source} has job fingerprint {fingerprint}, but {seen} was seen "
                "first; the servers' configs (or a checkpoint) define this job differently"
            )

    def stream_request(
        self, job: str, step: int, end: int | None, rank: int, world: int
    ) -> pb.StreamBatchesRequest:
        return pb.StreamBatchesRequest(
            job=job, start_step=step, end_step=end or 0, rank=rank, world_size=world
        )


def batch_stub(channel: Any) -> pb_grpc.TokenFeedStub:
    """The service's stub on a sync or asyncio channel, whose GetBatch and StreamBatches hand
    over `Received` messages (_received.py): a large batch's tokens stay where they were
    received."""
    stub = pb_grpc.TokenFeedStub(channel)  # type: ignore[no-untyped-call]
    service = "/tokenfeed.v1.TokenFeed/"
    stub.GetBatch = channel.unary_unary(
        service + "GetBatch",
        request_serializer=pb.GetBatchRequest.SerializeToString,
        response_deserializer=received,
        _registered_method=True,
    )
    stub.StreamBatches = channel.unary_stream(
        service + "StreamBatches",
        request_serializer=pb.StreamBatchesRequest.SerializeToString,
        response_deserializer=received,
        _registered_method=True,
    )
    return stub
