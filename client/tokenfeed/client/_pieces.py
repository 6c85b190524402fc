"""A stream segment read as consecutive calls, two open at once (both clients' streams).

A serving thread hands gRPC one message of a call at a time. Over one long call a lone server's
messages of [8, 2048] went out a median of 59 us apart, and 26-28 us apart over calls of 192
steps read one after another (bare stubs; the server's send times): short calls are what gains.
So each segment (_prefetch.py) is read as consecutive StreamBatches calls ("pieces") of about
PIECE_SECONDS each, FIRST_PIECE steps at least, and the next piece's call is opened as soon as
the piece before it delivers its first batch, so that its start (its request, the server's
first plan and group) overlaps the piece being read. One consumer of [8, 2048] through bare
stubs read 0.79 of the bare transport so (pieces of 192 steps), 0.76 with calls of 192 steps
one after another and 0.61 with one call (medians of 4 alternating rounds, a /tmp harness);
through the `Client`, 0.638 against 0.567 with one call a segment (8 rounds). The batches are
the same, in the same order: a piece starts where the one before it ended, and a piece that
ends early ends its segment (the next segment starts from the next step due).

Only a segment's first piece carries the trainer's wait report (a delta the server counts once)
and may be moved to another serving worker (moves.py); the pieces after it ask the same server
on the same connection with neither. A piece opened ahead that the server refuses for want of
room (RESOURCE_EXHAUSTED, `limits.max_concurrent_rpcs`) before any batch is opened again once
the piece before it has ended, and the stream reads one call at a time from then on.
"""

from __future__ import annotations

from typing import Any

from tokenfeed.client.waits import METADATA_KEY

Piece = tuple[Any, int, int]  # a piece's call (gRPC's, sync or asyncio), its first step, its end

# Steps of a segment's first piece, and the fewest of any piece but a segment's last: calls of
# 192 steps read one after another kept a lone server's messages of [8, 2048] 26-28 us apart
# (against 59 us over one long call), and eight ranks reading on 2 cores, each a few hundred
# steps a second, pay a call's own cost (its request, the server's first plan) once per 192
# steps rather than per 20 ms of their slower pace.
FIRST_PIECE = 192
# How long a piece lasts, at the rate the piece before it was read: long enough that a call's
# own cost (its request, the server's first plan) is small beside its batches.
PIECE_SECONDS = 0.02
# Pieces only while batches are small (their tokens at most this many bytes): the serving
# thread's work between messages is what pieces hide, and a large batch's message is the
# work itself. One consumer of [32, 4096] (256 KiB of tokens) through the Client read 0.44 of
# the bare transport in pieces against 0.49 in one call a segment, spending 25% more CPU
# (8 alternating rounds; bench/, wire section); [8, 2048] (32 KiB) gained.
PIECE_BATCH_BYTES = 64 * 1024


def small(batch: Any) -> bool:
    """Whether a batch (batch.Batch) is small enough to read in pieces."""
    return bool(batch.compact.tokens.nbytes <= PIECE_BATCH_BYTES)


def next_piece(steps: int, seconds: float) -> int:
    """Steps of the next piece: PIECE_SECONDS at the rate `steps` were read in `seconds`, at
    least FIRST_PIECE."""
    return max(FIRST_PIECE, int(steps / max(seconds, 1e-6) * PIECE_SECONDS))


def later_metadata(metadata: Any) -> tuple | None:
    """A segment's metadata for its pieces after the first: without the wait report (the
    first piece carries it) and without a move count (never moved: moves.py)."""
    kept = tuple((k, v) for k, v in metadata or () if k != METADATA_KEY)
    return kept or None


def refused_for_room(error: Any) -> bool:
    """Whether a call (a grpc.RpcError, sync or aio) was refused for want of room."""
    try:
        return getattr(error.code(), "name", "") == "RESOURCE_EXHAUSTED"
    except Exception:  # noqa: BLE001 - not a call's error
        return False


class Pieces:
    """A stream's pieces (both clients'): how long the next one is, and whether the next one is
    opened ahead."""

    def __init__(self) -> None:
        self.steps = FIRST_PIECE  # of the next piece (but a segment's last)
        self.ahead = True  # False once a piece opened ahead found no room
        self.small = True  # the last batch a piece started with was small (`small`)

    def stop(self, start: int, end: int) -> int:
        """Where the piece from `start` ends, within its segment's `end`."""
        return min(start + self.steps, end) if self.ahead and self.small else end

    def open_next(self, batch: Any, stop: int, end: int) -> bool:
        """At the first batch of the piece that ends at `stop`: whether to open the next one."""
        if stop >= end or not self.ahead:
            return False
        self.small = small(batch)
        return self.small

    def refused(self, error: Any, start: int, first: int, step: int) -> bool:
        """Whether the failed piece from `start` (its segment's from `first`; `step` the next one
        due) was opened ahead and refused for room before any batch: it is then opened again,
        and no piece is opened ahead any more."""
        if start == first or step != start or not refused_for_room(error):
            return False
        self.ahead = False
        return True

    def read(self, start: int, stop: int, seconds: float) -> None:
        """The piece [start, stop) was read whole in `seconds`: the next one's length."""
        self.steps = next_piece(stop - start, seconds)
