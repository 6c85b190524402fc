"""How many StreamBatches calls each serving worker of a node serves now, so that a crowded
worker can send a new one elsewhere (client/tokenfeed/client/moves.py says why and how).

The supervisor makes the table, one int64 per worker in the node's directory beside the row
buffers' arena (`create`); each worker maps it, writes only its own slot (from its event loop:
one writer a slot) and reads the others'. A worker that starts, or starts again after a crash,
zeroes its slot: its earlier process's streams ended with it.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
from tokenfeed.client.moves import MOVES_KEY
from tokenfeed.server.telemetry import metrics

TABLE = "streams"
MOVES_PER_WORKER = 3  # a call that has moved 3 x workers times is served where it lands


def create(root: str | Path, workers: int) -> Path:
    """The node's table of `workers` zeroed slots under `root` (written whole, then renamed)."""
    path = Path(root) / TABLE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TABLE}.{os.getpid()}.tmp")
    tmp.write_bytes(bytes(8 * workers))
    os.replace(tmp, path)
    return path


class StreamSpread:
    """Worker `index`'s view of its node's table at `path`."""

    def __init__(self, path: str | Path, index: int):
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.counts = np.frombuffer(self._map, dtype=np.int64)
        if not 0 <= index < len(self.counts):
            raise ValueError(f"worker {index} has no slot in {path} ({len(self.counts)} slots)")
        self.index = index
        self.counts[index] = 0

    def should_move(self, metadata: object) -> bool:
        """Whether to refuse a new stream whose request `metadata` (grpc's invocation
        metadata) says it can move: this worker serves more streams than another does now,
        and the call has moved fewer than 3 times the workers. Counted when refused."""
        moves = _moves(metadata)
        if moves is None or moves >= MOVES_PER_WORKER * len(self.counts):
            return False
        counts = self.counts
        if int(counts[self.index]) <= int(counts.min()):
            return False
        metrics.STREAMS_MOVED.inc()
        return True

    def enter(self) -> None:
        self.counts[self.index] += 1

    def leave(self) -> None:
        self.counts[self.index] -= 1


def _moves(metadata: object) -> int | None:
    """The MOVES_KEY entry of a call's metadata (None: absent or not a count)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == MOVES_KEY:
            try:
                return max(int(value), 0)
            except ValueError:
                return None
    return None
