"""Pre-tokenized sources: token ids taken as they are, checked, never sent through a tokenizer.

- Megatron-LM indexed datasets (`.idx` + `.bin`, planned by chunks.py from the `.idx` header):
  chunk k is two ranged reads of the `.idx` (the lengths and the byte pointers of its
  sequences) and one of the `.bin` (their tokens, back to back), after one read of the header
  per `.idx` and process. Each sequence is a document.
- Parquet columns of token-id lists (`token_field`): one row group per chunk, one row per
  document; likewise Arrow stream files' `list<int>` columns (arrowfiles.py) by record batches.
- MDS integer `ndarray` columns (`token_field`, mds.py): one sample per document.

The packer ends every document with EOS (packing.py). A document whose last id already is the
tokenizer's EOS (Megatron's `--append-eod`, or `input_ids` tokenized with EOS) has that id
dropped here, so the packed stream holds one EOS between documents either way.

Damage to the structure (a header, sizes or pointers that disagree) is a `SourceError` naming
the object: nothing read through such an index can be trusted. A document with no ids, a null,
or an id outside `[0, vocab_size)` is a `BadRecord` (`<.idx uri> document <i>`, `<uri> row
<r>`), skipped or refused by the job's policy like a malformed line of text.

A group of small row groups (chunks.py) reads as its parts one after another, each checked and
located as a chunk of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend
from tokenfeed.server.source import arrowfiles, mdscolumns
from tokenfeed.server.source.chunk import Chunk
from tokenfeed.server.source.columns import is_token_list, token_records
from tokenfeed.server.source.megatron import megatron_header
from tokenfeed.server.source.provenance import DataStart, PartStart
from tokenfeed.server.source.readers import BadRecord, read_parts
from tokenfeed.server.source.records import TokenRecords


class Vocabulary(Protocol):
    """What checking token ids needs of the job's tokenizer (tokenize.TextTokenizer has it)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def dtype(self) -> np.dtype: ...


KINDS: tuple[str, ...] = ("megatron", "parquet-tokens", "mds-tokens", "arrow-tokens")
REASONS = ("missing_field", "empty", "null_token", "token_out_of_range")

# One header read per .idx (and version: ObjectInfo is part of the key) per process, not per
# chunk: on S3 each would be a GET of its own.
_header = lru_cache(maxsize=4096)(megatron_header)


@dataclass
class PretokenizedChunk:
    """A chunk's kept documents, shaped like the tokenizer's output (index.py stores it)."""

    tokens: np.ndarray  # every kept document's ids back to back, in `tokenizer.dtype`
    lengths: np.ndarray  # int32, per kept document
    bad: list[BadRecord]
    record_ids: list[int]  # per kept document: its index among the chunk's records
    records: int  # records read, good or bad
    # (line numbers are a JSON Lines matter); a group: its parts' records, counted across them
    data_start: DataStart = 0


def read_chunk(store: ObjectBackend, chunk: Chunk, tokenizer: Vocabulary) -> PretokenizedChunk:
    """The documents of a pre-tokenized chunk; `store` serves `chunk.source` (and its .bin), and
    each part's of a group, whose documents are its parts' one after another."""
    if chunk.parts:
        return _joined(read_parts(store, chunk, lambda s, part: read_chunk(s, part, tokenizer)))
    if chunk.kind == "megatron":
        records = _read_megatron(store, chunk)
    elif chunk.kind == "parquet-tokens":
        records = _read_parquet_tokens(store, chunk)
    elif chunk.kind == "mds-tokens":
        records = mdscolumns.read_tokens(store, chunk)
    elif chunk.kind == "arrow-tokens":
        records = arrowfiles.read_tokens(store, chunk)
    else:
        raise ValueError(f"{chunk.describe()}: not a pre-tokenized chunk ({chunk.kind})")
    return _checked(records, tokenizer)


def _read_megatron(store: ObjectBackend, chunk: Chunk) -> TokenRecords:
    idx, data = chunk.source, chunk.companion
    if data is None:
        raise ValueError(f"{chunk.describe()}: a Megatron chunk without its .bin")
    header = _header(store, idx)
    n, a, b = header.sequences, chunk.start, chunk.end
    if not 0 <= a < b <= n:
        raise SourceError(f"{idx.uri}: documents {a}-{b} planned, but it holds {n}")
    # With b < n, the pointer of sequence b too: it must be where the chunk's last one ends.
    top = b + 1 if b < n else b
    raw_lengths = store.read_range(idx, header.lengths_at(a), header.lengths_at(b))
    raw_pointers = store.read_range(idx, header.pointers_at(a), header.pointers_at(top))
    if len(raw_lengths) != 4 * (b - a) or len(raw_pointers) != 8 * (top - a):
        raise SourceError(f"{idx.uri}: short read of the index of documents {a}-{b}")
    lengths = np.frombuffer(raw_lengths, dtype="<i4").astype(np.int64)
    pointers = np.frombuffer(raw_pointers, dtype="<i8")
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise SourceError(f"{idx.uri}: document {a + i} has length {lengths[i]}: corrupt index")
    ends = pointers[: b - a] + lengths * header.dtype.itemsize  # where each sequence ends
    step = np.nonzero(pointers[1:] != ends[: len(pointers) - 1])[0]
    if step.size:
        i = int(step[0]) + 1
        raise SourceError(
            f"{idx.uri}: document {a + i} starts at byte {pointers[i]} of {data.uri}, but the "
            f"one before it ends at byte {ends[i - 1]}: the pointers disagree with the lengths"
        )
    lo, hi = int(pointers[0]), int(ends[-1])
    if (a == 0 and lo != 0) or lo < 0 or hi > data.size or (b == n and hi != data.size):
        raise SourceError(
            f"{idx.uri}: documents {a}-{b} span bytes {lo}-{hi} of {data.uri}, which has "
            f"{data.size} bytes{' (the last document must end there)' if b == n else ''}: the "
            ".idx does not describe this .bin"
        )
    raw = store.read_range(data, lo, hi)
    if len(raw) != hi - lo:
        raise SourceError(f"{data.uri}: short read of bytes {lo}-{hi}")
    ids = np.frombuffer(raw, dtype=header.dtype.newbyteorder("<"))
    return TokenRecords(ids, lengths, a, f"{idx.uri} document")


def _read_parquet_tokens(store: ObjectBackend, chunk: Chunk) -> TokenRecords:
    try:
        with store.open(chunk.source) as f:
            table = pq.ParquetFile(f).read_row_group(chunk.row_group, columns=[chunk.text_field])
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{chunk.describe()}: cannot read row group: {e}") from e
    column = table.column(0).combine_chunks()
    if not is_token_list(column.type):
        raise SourceError(
            f"{chunk.describe()}: column {chunk.text_field!r} is {column.type}, "
            "expected a list of integer token ids"
        )
    return token_records(column, chunk.start, f"{chunk.source.uri} row", chunk.text_field)


def _checked(rec: TokenRecords, tokenizer: Vocabulary) -> PretokenizedChunk:
    """Ids checked against the vocabulary, trailing EOS dropped, bad records set aside."""
    ids, lengths, vocab = rec.ids, rec.lengths, tokenizer.vocab_size
    ends = np.cumsum(lengths)
    starts = ends - lengths
    bad = dict(rec.refused)
    outside = (ids < 0) | (ids >= vocab)
    if outside.any():
        positions = np.flatnonzero(outside)
        records = np.searchsorted(ends, positions, side="right")
        firsts = np.unique(records, return_index=True)[1]  # each record's first bad id
        for r, p in zip(records[firsts].tolist(), positions[firsts].tolist(), strict=True):
            bad.setdefault(
                r,
                BadRecord(
                    "token_out_of_range",
                    f"{rec.where} {rec.first + r}",
                    f"id {ids[p]} at position {p - starts[r]} is outside the vocabulary of "
                    f"{vocab} ids",
                ),
            )
    # The packer adds EOS after every document: one already there is not doubled.
    nonempty = lengths > 0
    trailing = np.zeros(len(lengths), dtype=bool)
    trailing[nonempty] = ids[ends[nonempty] - 1] == tokenizer.eos_id
    kept_lengths = lengths - trailing
    for r in np.flatnonzero(kept_lengths == 0).tolist():
        detail = "only an end-of-document id" if lengths[r] else "no token ids"
        bad.setdefault(r, BadRecord("empty", f"{rec.where} {rec.first + r}", detail))
    keep = np.ones(len(lengths), dtype=bool)
    keep[list(bad)] = False
    if keep.all() and not trailing.any():
        tokens = ids.astype(tokenizer.dtype)
    else:
        mask = np.repeat(keep, lengths)
        mask[ends[trailing] - 1] = False
        tokens = ids[mask].astype(tokenizer.dtype)
    return PretokenizedChunk(
        tokens=tokens,
        lengths=kept_lengths[keep].astype(np.int32),
        bad=[bad[r] for r in sorted(bad)],
        record_ids=np.flatnonzero(keep).tolist(),
        records=len(lengths),
    )


def _joined(parts: list[PretokenizedChunk]) -> PretokenizedChunk:
    ids, base = [], 0
    for p in parts:
        ids += [base + r for r in p.record_ids]
        base += p.records
    return PretokenizedChunk(
        tokens=np.concatenate([p.tokens for p in parts]),
        lengths=np.concatenate([p.lengths for p in parts]),
        bad=[b for p in parts for b in p.bad],
        record_ids=ids,
        records=base,
        # Pre-tokenized records have no line numbers: nothing to count them from.
        data_start=tuple(PartStart(p.records) for p in parts),
    )
