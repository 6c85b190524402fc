"""What a serving worker's index asks of the process that owns the cache (`server.workers` >
1): the owner lists and plans each dataset's chunks once and tokenizes every chunk, so all
processes agree on chunk keys and no chunk is tokenized twice. serve/control.py's
`SupervisorLink` answers these over the control socket; the index only sees this interface."""

from __future__ import annotations

from typing import Protocol

from tokenfeed.server.source.chunks import Chunk


class ChunkOwner(Protocol):
    def chunks(self, job: str, timeout: float = 5.0, at_least: int = 0) -> list[list[Chunk]]:
        """The planned chunk list of each of the job's datasets (blocking); `at_least`: the
        datasets the asking process knows (its data plan may be newer than the owner's)."""
        ...

    def ensure(self, job: str, dataset: int, chunk: int) -> None:
        """Make a chunk's body present in the token store (blocking)."""
        ...
