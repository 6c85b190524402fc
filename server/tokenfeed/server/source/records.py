"""What reading a chunk yields, whatever its format: the documents (texts, or token ids for
pre-tokenized sources) and every bad record with its reason and location.

A `BadRecord`'s location names the object and the record in it (`uri:line`, `uri row N`,
`uri sample N`, `uri member NAME`); the caller applies the job's policy (`skip` or `strict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tokenfeed.server.source.provenance import DataStart


@dataclass(frozen=True)
class BadRecord:
    reason: str
    location: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class ChunkDocuments:
    texts: list[str]
    bad: list[BadRecord]
    records: int
    record_ids: list[int]  # per text: its index among the chunk's records (good or bad)
    # JSON Lines: byte offset of the chunk's first record in the (decompressed) object, from
    # which `line_number` finds line numbers when they are asked for; a group: per part
    data_start: DataStart = 0


@dataclass
class TokenRecords:
    """A pre-tokenized chunk's records as read: ids back to back, with what the reader already
    refused (pretokenized.py checks the rest against the vocabulary)."""

    ids: np.ndarray  # in the source's dtype
    lengths: np.ndarray  # int64, per record
    first: int  # global index of record 0 (document, row or sample), for locations
    where: str  # "<uri> document", "<uri> row" or "<uri> sample"
    refused: dict[int, BadRecord] = field(default_factory=dict)  # record -> why


def text_of(value: bytes | bytearray | memoryview, location: str, what: str) -> str | BadRecord:
    """A record's UTF-8 text, or why it is a bad record (not UTF-8, or empty)."""
    try:
        text = bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRecord("invalid_utf8", location, f"byte {e.start} of {what}")
    if not text:
        return BadRecord("empty", location, f"{what} is empty")
    return text


def gather(
    items: list[str | BadRecord], first_id: int = 0, data_start: DataStart = 0
) -> ChunkDocuments:
    """A chunk's documents from its records in order (each a text or a bad record)."""
    texts, bad, ids = [], [], []
    for i, item in enumerate(items):
        if isinstance(item, BadRecord):
            bad.append(item)
        else:
            texts.append(item)
            ids.append(first_id + i)
    return ChunkDocuments(texts, bad, len(items), ids, data_start)
