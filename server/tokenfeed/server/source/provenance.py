"""Where a chunk's documents come from in their sources: each document's record among the
chunk's records, and where those records start in their objects (per part of a grouped chunk).
Readers produce it, the token store keeps it (the `.rec` file and the manifest), Explain reads
it back (readers.locate_record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class PartStart:
    """Where one part of a grouped chunk (chunks.py) keeps its records: how many it read (good
    or bad; record ids count on from the parts before it) and the byte offset of its first
    record in its object."""

    records: int
    data_start: int = 0


# Where a chunk's records start: the byte offset of its first record in its object (a simple
# chunk), or per part (a group).
DataStart = int | tuple[PartStart, ...]


class Provenance(NamedTuple):
    """What locating a chunk's documents in their sources needs (readers.locate_record)."""

    record_ids: np.ndarray  # per document: its index among the chunk's records
    data_start: DataStart
