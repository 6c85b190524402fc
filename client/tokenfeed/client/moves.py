"""Streams spread evenly over a node's serving workers (`server.workers` > 1).

The kernel hands each new connection to one of the workers listening on the node's port by a
hash of its addresses, not by load: 16 connections on 16 workers left 5 or 6 workers with no
stream and one with 3 (bench/results/cores16-serving-by-process.txt), and in synchronous
training the busiest worker's ranks set every step's pace. So a worker that already serves more
StreamBatches calls than another worker of its node refuses a new one, UNAVAILABLE with the
trailer MOVE_TRAILER, when the call says it can move (MOVES_KEY: how often it has moved since
its last batch); this client then opens a new connection to the same address, which the kernel
hashes anew, and asks again at once, neither pausing nor taking the server for failed. The
worker stops refusing a call that has moved 3 times its node's workers (about two moves a
stream on 16 workers); the client stops moving after MOVES_MOST. A call without MOVES_KEY
(another client) is never refused. No batch changes: a stream starts where it asked to.
"""

from __future__ import annotations

from typing import Any

MOVES_KEY = "tokenfeed-moves"  # request metadata: the moves since this stream's last batch
MOVE_TRAILER = "tokenfeed-move"  # trailing metadata of a refusal: reconnect and ask again
MOVES_MOST = 64
# A channel replaced by a client's `reconnect` is closed this long after: the calls that were on
# it have ended by then (a stream's segments last seconds).
RETIRE_SECONDS = 120.0


def asked_to_move(error: Any) -> bool:
    """Whether a failed call (a grpc.RpcError, sync or aio) was a crowded worker's refusal."""
    try:
        trailers = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - not a call's error: no trailers, no refusal
        return False
    return any(key == MOVE_TRAILER for key, _ in trailers)


def with_moves(metadata: tuple[tuple[str, str], ...] | None, moves: int) -> tuple:
    """A stream call's request metadata, saying it can move and how often it has."""
    return (*(metadata or ()), (MOVES_KEY, str(moves)))


def retire(retired: list[tuple[float, Any]], channel: Any, now: float) -> list[Any]:
    """Add `channel`, replaced at `now`, to a client's `retired` channels, and take out and
    return those replaced more than RETIRE_SECONDS ago, for the client to close."""
    retired.append((now, channel))
    old = [c for t, c in retired if now - t > RETIRE_SECONDS]
    retired[:] = [(t, c) for t, c in retired if now - t <= RETIRE_SECONDS]
    return old
