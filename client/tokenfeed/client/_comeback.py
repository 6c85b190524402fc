"""A retry's pause that ends once a server whose connection was down can be reached again.

Between rounds of attempts the clients back off (`Session.rounds`: 0.5-1x a delay that doubles
up to `max_backoff`). Where the servers failed because their connections were down (a serving
worker killed and respawned, a server restarting), sleeping out the whole pause wastes the time
since the server came back. The pause instead watches the channels of the round's servers,
asking each to connect, and ends once one that was not READY when it began turns READY. A
channel that stays READY (a server that answered and refused, or said it was busy) never
shortens the pause, and a server's own pushback (`retry_after`) is waited out in full: those
pauses are not handed a channel to watch (`Attempts.wake_on`).

Watching also drives gRPC's reconnection where nothing else would. With gRPC's EventEngine client
turned off (GRPC_EXPERIMENTS=-event_engine_client, docs/client.md), a channel's reconnection
timers run only while some thread polls it; calls that fail fast between sleeps poll it for
an instant, and a client reached a worker respawned after SIGKILL 5.7-10.9 s after the kill
instead of 2.5 s. Subscribing to a channel's connectivity polls it for as long as the pause lasts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from typing import Any

import grpc

READY = grpc.ChannelConnectivity.READY
# How often a pause that can also be stopped (a stream's, by its close) looks at its stop.
STOP_SLICE = 0.05


class _Watch:
    """One channel's connectivity callback: sets `back` on READY after a state that was not."""

    def __init__(self, back: threading.Event):
        self.back, self.down = back, False

    def __call__(self, state: grpc.ChannelConnectivity) -> None:
        if state is not READY:
            self.down = True
        elif self.down:
            self.back.set()


def pause(
    channels: Iterable[grpc.Channel], seconds: float, stop: threading.Event | None = None
) -> bool:
    """Wait `seconds`, less if one of `channels` comes back (see the module); True if `stop`
    was set meanwhile."""
    back = threading.Event()
    watching: list[tuple[grpc.Channel, _Watch]] = []
    for channel in channels:
        watch = _Watch(back)
        try:
            channel.subscribe(watch, try_to_connect=True)
        except ValueError:  # closed meanwhile (the client is closing)
            continue
        watching.append((channel, watch))
    try:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if stop is not None and stop.is_set():
                return True
            if back.wait(left if stop is None else min(left, STOP_SLICE)):
                break
        return stop is not None and stop.is_set()
    finally:
        for channel, watch in watching:
            try:
                channel.unsubscribe(watch)
            except (ValueError, KeyError):  # closed meanwhile
                pass


async def _comes_back(channel: Any) -> None:
    """Returns once `channel` (grpc.aio) turns READY after a state that was not; never if it
    fails to say (a channel closed meanwhile): the pause then runs its course."""
    try:
        state = channel.get_state(try_to_connect=True)
        down = state is not READY
        while True:
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)
            if state is not READY:
                down = True
            elif down:
                return
    except Exception:  # noqa: BLE001 - a closed channel: nothing to watch
        await asyncio.Event().wait()


async def apause(channels: Iterable[Any], seconds: float) -> None:
    """`pause` for the asyncio client's channels."""
    watchers = [asyncio.ensure_future(_comes_back(c)) for c in channels]
    if not watchers:
        await asyncio.sleep(seconds)
        return
    try:
        await asyncio.wait(watchers, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in watchers:
            w.cancel()
