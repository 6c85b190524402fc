"""How gRPC reads a trainer's sockets: chosen once per process, before grpc is imported.

gRPC's C core (grpcio 1.85) reads a client channel's socket on an EventEngine thread of its own
and then wakes the thread that waits for the message: a thread hop per message. Without its
EventEngine client (the experiment `event_engine_client` turned off), the thread that waits for
a message polls the socket itself. On 2 cores, eight consumer processes reading the ranks of one
[64, 2048] job spent 0.0046-0.0050 CPU s per million tokens instead of 0.0065-0.0067 and read
0.59-0.61 of the bare transport instead of 0.48-0.53; one consumer of [8, 2048] 0.0020-0.0021
instead of 0.0031-0.0032 (alternating rounds of a /tmp harness). In `bench.wire --before
d3dd495` at 9ee14a8 (the README's serving table), eight ranks 0.58 against 0.46; one consumer of
[32, 4096] read more (0.51 of the transport against 0.41) but spent more CPU (0.0016 s per M
tokens against 0.0012): a large message's read loses the overlap it had on gRPC's thread. The
setting is grpc's, process-wide, and read when grpc is imported: so the client sets it where it
is imported first, never otherwise.

It is left alone (`grpc_setting` says why) when grpc was imported before tokenfeed.client (too
late to take effect), when `GRPC_EXPERIMENTS` is already set (the operator's choice wins: set it,
even to an empty string, to keep grpc's defaults), or when the installed grpcio is not one the
setting was measured on (`MEASURED`): another version may have no such experiment.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

ENV = "GRPC_EXPERIMENTS"
POLLING_CLIENT = "-event_engine_client"
# grpcio (major, minor) versions with the experiment, on which the setting was measured.
MEASURED = ((1, 85),)

_outcome = ""


def _grpcio_version() -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in metadata.version("grpcio").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return None


def choose() -> str:
    """Turn gRPC's EventEngine client off for this process where it may (see the module);
    returns what was done, as `grpc_setting` reports it."""
    global _outcome
    if _outcome:
        return _outcome
    version = _grpcio_version()
    if "grpc" in sys.modules:
        _outcome = "left alone: grpc was imported before tokenfeed.client"
    elif ENV in os.environ:
        _outcome = f"left alone: {ENV} is set ({os.environ[ENV]!r})"
    elif version is None or version[:2] not in MEASURED:
        shown = ".".join(map(str, version)) if version else "unknown"
        _outcome = f"left alone: grpcio {shown} is not a version the setting was measured on"
    else:
        os.environ[ENV] = POLLING_CLIENT
        _outcome = f"{ENV}={POLLING_CLIENT} (a message is read by the thread that waits for it)"
    return _outcome


def grpc_setting() -> str:
    """What the client chose for gRPC's client transport when it was imported (the module's
    docstring says why)."""
    return _outcome or "not chosen yet"
