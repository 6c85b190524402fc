"""The daemon's entry: one process that owns the cache and serves (`server.workers: 1`,
single.py), or a supervisor that owns it and that many serving worker processes on one port
(workers.py)."""

from __future__ import annotations

import uvloop
from tokenfeed.client.memory import keep_freed_memory
from tokenfeed.server.serve import single, workers
from tokenfeed.server.settings.config import Config


def run(config: Config, ready_file: str | None = None) -> None:
    keep_freed_memory()  # row buffers reuse freed memory (client/memory.py)
    if config.server.workers > 1:
        uvloop.run(workers.supervise(config, ready_file))
    else:
        uvloop.run(single.serve(config, ready_file))
