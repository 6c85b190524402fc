"""The one retry and failover loop of both clients, as decisions without I/O.

`Attempts` walks the servers of the rendezvous ranking for one call (or for one stream until it
delivers), and says what to do next: pause this long, or try this server with this timeout and
this request metadata. The client that drives it does the pausing (_comeback.py: ended early
when a server whose connection was down comes back) and the calling, each in its own way
(blocking, or awaited), and reports back: `failed` (retryable or raised), `delivered`
(progress: the deadline renews and the next attempt starts again from the top of the ranking).

    attempts = Attempts(session, job, rank, credentials.metadata)
    for action in attempts:
        if isinstance(action, float):
            pause(action, attempts.wake_on)  # ended early if one of them comes back
            continue
        try:
            return call(action.addr, timeout=action.timeout, metadata=action.metadata)
        except grpc.RpcError as e:
            attempts.failed(action, e)
    raise attempts.error()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tokenfeed.client._session import Session
from tokenfeed.client.errors import TokenfeedClientError, from_rpc_error
from tokenfeed.client.moves import MOVES_MOST, asked_to_move
from tokenfeed.client.waits import METADATA_KEY, WaitReport

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Try:
    """Call `addr` now, with this per-attempt timeout and request metadata."""

    addr: str
    timeout: float
    metadata: Metadata | None
    report: WaitReport | None  # the wait report in `metadata`, if any


class Attempts:
    """The attempts of one call. `waits`: carry this (job, rank)'s wait report (batch calls)."""

    def __init__(
        self,
        session: Session,
        job: str,
        rank: int,
        metadata: Callable[[], Metadata | None],
        *,
        timeout: float | None = None,
        waits: bool = False,
    ):
        self.session, self.job, self.rank = session, job, rank
        self.timeout = timeout or session.policy.timeout
        self._metadata = metadata  # per attempt: a token file may rotate during a stream
        self._meter = session.waits(job, rank) if waits and session.report_waits else None
        self.last: TokenfeedClientError | None = None
        self._renewed = False
        self.moves = 0  # a crowded worker's refusals since the last progress (`moving`)
        # The servers whose coming back may end the pause just yielded (_comeback.py): a
        # round's servers before a backoff, none before a server's own pushback.
        self.wake_on: tuple[str, ...] = ()
        self.deadline = time.monotonic() + self.timeout

    def __iter__(self) -> Iterator[Try | float]:
        while True:
            self._renewed = False
            tried: tuple[str, ...] = ()
            for servers in self.session.rounds(self.job, self.rank, self.deadline):
                if isinstance(servers, float):
                    self.wake_on = tried
                    yield servers
                    continue
                tried = tuple(servers)
                for addr in servers:
                    pause = self.session.pause_before(addr, self.deadline)
                    if pause > 0:
                        self.wake_on = ()
                        yield pause
                    if time.monotonic() >= self.deadline:
                        break
                    yield self._try(addr)
                    if self._renewed:
                        break
                if self._renewed:
                    break
            if not self._renewed:
                return

    def _try(self, addr: str) -> Try:
        report = self._meter.take(time.monotonic()) if self._meter is not None else None
        metadata = self._metadata() or ()
        if report is not None:
            metadata = (*metadata, (METADATA_KEY, report.encode()))
        timeout = self.session.attempt_timeout(self.deadline)
        return Try(addr, timeout, metadata or None, report)

    def failed(
        self, attempt: Try, error: Any, *, stream: bool = False, progressed: bool = False
    ) -> None:
        """`attempt` failed with a grpc.RpcError: raised as a domain error unless retryable
        (for a stream, CANCELLED too: a stream we did not cancel was cut by the server,
        draining or dying); else the server goes to the back of the ranking for a while.
        `progressed`: the stream delivered batches before it failed (see `delivered`)."""
        err = from_rpc_error(error, attempt.addr)
        cancelled = stream and getattr(error.code(), "name", "") == "CANCELLED"
        if not progressed:
            self._unreported(attempt)
        if not (err.retryable or cancelled):
            raise err from None
        self.give_up_on(attempt.addr, err)
        if progressed:
            self.delivered()

    def moving(self, attempt: Try, error: Any, *, progressed: bool) -> bool:
        """Whether a stream's failed `attempt` was a crowded serving worker sending it elsewhere
        (moves.py), before any batch and fewer than MOVES_MOST times since the last one: then
        the client opens a new connection, and the next attempt asks the same server again at
        once, with no pause and nothing counted against it (`moves` tells the server how often
        it has moved)."""
        if progressed or self.moves >= MOVES_MOST or not asked_to_move(error):
            return False
        self.moves += 1
        self._unreported(attempt)
        self._renewed = True
        return True

    def give_up_on(self, addr: str, err: TokenfeedClientError) -> None:
        """`addr` is taken for failed (e.g. a stream silent past the limit)."""
        self.last = err
        self.session.mark_failed(addr, err)

    def _unreported(self, attempt: Try) -> None:
        # The servers count a report once its call delivered (serve/waits.py): one whose call
        # failed before that is kept for the next attempt, whichever server that goes to.
        if attempt.report is not None and self._meter is not None:
            self._meter.give_back(attempt.report)

    def delivered(self) -> None:
        """The attempt made progress: the deadline renews, and the next attempt starts from
        the top of the (freshly ranked) servers, with no pause."""
        self.deadline = time.monotonic() + self.timeout
        self.last = None
        self.moves = 0
        self._renewed = True

    def error(self) -> Exception:
        """What to raise once the attempts ran out."""
        return self.session.give_up(self.job, self.last)
