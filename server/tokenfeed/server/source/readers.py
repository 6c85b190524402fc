"""Reading the documents of one chunk, with every bad record counted and located.

Bad records are never silent: each one becomes a `BadRecord` with a reason and a location
(`uri:line` for JSON Lines, `uri row N` for Parquet). The caller applies the job's policy:
`skip` drops them (counted and logged), `strict` refuses the chunk with the first location.

JSON Lines is read by jsonl.py, Parquet here, the other layouts by their own modules.

A group of small objects (chunks.py) reads as its parts one after another, each located as a
chunk of its own; its records are numbered across the parts. `locate_record` turns a stored
document's record id back into its object and line, row or document, for any chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
from tokenfeed.server.errors import SourceError, StoreCorruptError
from tokenfeed.server.objstore.objects import ObjectBackend
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.source import arrowfiles, mdscolumns, wds
from tokenfeed.server.source.chunks import Chunk
from tokenfeed.server.source.jsonl import (
    JsonLines,
    jsonl_data,
    jsonl_pieces,
    line_number,
    read_jsonl,
    single_start,
)
from tokenfeed.server.source.provenance import PartStart, Provenance
from tokenfeed.server.source.records import BadRecord, ChunkDocuments, gather

REASONS = (
    "invalid_utf8",
    "malformed_json",
    "not_an_object",
    "missing_field",
    "not_text",
    "empty",
    "no_tokens",
)
T = TypeVar("T")


def locate_record(
    storage: ObjectStorage, chunk: Chunk, provenance: Provenance, record: int
) -> tuple[str, str]:
    """(object URI, "line N" | "row N" | "document N" | "sample N") of the chunk's `record`-th
    record (a tar sample's also names its key: "sample N (KEY)"), for a
    simple chunk or a group alike. `provenance` is `TokenStore.provenance(key)` of the chunk's
    key; `record` a record id from it (`provenance.record_ids[doc]` for document `doc`), counted
    across a group's parts. Lines count from 1; rows and Megatron documents from 0, across the
    whole object."""
    part, data_start = chunk, provenance.data_start
    if chunk.parts:
        if not isinstance(data_start, tuple) or len(data_start) != len(chunk.parts):
            raise StoreCorruptError(
                f"{chunk.describe()}: its manifest does not record its {len(chunk.parts)} parts"
            )
        total, asked = sum(p.records for p in data_start), record
        if not 0 <= record < total:
            raise ValueError(f"{chunk.describe()}: no record {asked} among its {total}")
        for part, start in zip(chunk.parts, data_start, strict=True):  # noqa: B007
            if record < start.records:
                data_start = start.data_start
                break
            record -= start.records
    if isinstance(data_start, tuple):
        raise StoreCorruptError(f"{chunk.describe()}: its manifest describes a group")
    uri = part.source.uri
    if part.kind in ("parquet", "parquet-tokens"):
        return uri, f"row {part.start + record}"
    if part.kind == "megatron":  # one document per sequence, counted from 0 like Megatron
        return uri, f"document {part.start + record}"
    if part.kind in ("mds", "mds-tokens"):
        return uri, f"sample {part.start + record}"
    if part.kind in ("arrow", "arrow-tokens"):
        return uri, f"row {part.first_record + record}"
    if part.kind in ("tar", "tar.gz"):
        key = wds.sample_key(storage.for_uri(uri), part, record)
        return uri, f"sample {max(part.first_record, 0) + record}" + (f" ({key})" if key else "")
    return uri, f"line {line_number(storage.for_uri(uri), part, data_start, record)}"


def read_parts(
    store: ObjectBackend, chunk: Chunk, read: Callable[[ObjectBackend, Chunk], T]
) -> list[T]:
    """`read(store, part)` of each part of a group (or of a simple chunk itself), in order.
    From object storage `store.parallel_reads` parts are read at once: each small object is a
    round trip of its own, so a group of 300 objects costs about 300 / 8 round trips, not 300
    (bench/smallobjects.py); local files are read one after another."""
    parts, in_flight = chunk.pieces, getattr(store, "parallel_reads", 1)
    if len(parts) == 1 or in_flight <= 1:
        return [read(store, p) for p in parts]
    pool = ThreadPoolExecutor(min(in_flight, len(parts)), "part-read")
    try:
        return list(pool.map(lambda p: read(store, p), parts))
    finally:  # a failed part: the others not started yet are not read
        pool.shutdown(wait=True, cancel_futures=True)


def _read_parquet(store: ObjectBackend, chunk: Chunk) -> ChunkDocuments:
    try:
        with store.open(chunk.source) as f:
            table = pq.ParquetFile(f).read_row_group(chunk.row_group, columns=[chunk.text_field])
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{chunk.describe()}: cannot read row group: {e}") from e
    column = table.column(0)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    texts, bad, ids = [], [], []
    for i, value in enumerate(column.to_pylist()):
        row = chunk.start + i
        location = f"{chunk.source.uri} row {row}"
        if value is None:
            bad.append(BadRecord("missing_field", location, f"{chunk.text_field!r} is null"))
            continue
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError as e:
            bad.append(BadRecord("invalid_utf8", location, f"byte {e.start} of the value"))
            continue
        if not text:
            bad.append(BadRecord("empty", location, f"{chunk.text_field!r} is empty"))
            continue
        texts.append(text)
        ids.append(i)
    return ChunkDocuments(texts, bad, len(table), ids)


def read_documents(store: ObjectBackend, chunk: Chunk) -> ChunkDocuments:
    """The documents of a chunk; a group's are its parts' one after another."""
    if chunk.parts:
        return _joined(read_parts(store, chunk, read_documents))
    if chunk.kind == "parquet":
        return _read_parquet(store, chunk)
    if chunk.kind in _LAYOUT_TEXTS:
        return gather(_LAYOUT_TEXTS[chunk.kind](store, chunk))
    return read_jsonl(store, chunk)


# Text kinds whose module reads a chunk's records (each a text or a bad record), in order.
_LAYOUT_TEXTS = {
    "mds": mdscolumns.read_texts,
    "arrow": arrowfiles.read_texts,
    "tar": wds.read_texts,
    "tar.gz": wds.read_texts,
}


def read_pieces(
    store: ObjectBackend, chunk: Chunk, docs_per_piece: int
) -> tuple[ChunkDocuments, Iterator[list[str]]]:
    """The documents of a chunk a piece at a time, so that tokenizing one piece overlaps
    parsing the next: (its records, the pieces of its texts). The records' bad records, count
    and ids fill in as the pieces are taken, and are complete once the last one is; their
    `texts` stay empty (each piece is the caller's). The chunk's bytes are read here, before
    the first piece is asked for; plain and compressed JSON Lines are then parsed piece by
    piece, while Parquet and groups are parsed here too (Arrow, and parallel reads of the
    parts, are fast at that)."""
    if not _json_lines(chunk):
        whole = read_documents(store, chunk)
        texts, whole.texts = whole.texts, []
        n = docs_per_piece
        return whole, (texts[i : i + n] for i in range(0, len(texts), n))
    docs = ChunkDocuments([], [], 0, [])
    data = jsonl_data(store, chunk, docs)
    return docs, jsonl_pieces(store, chunk, docs, data, docs_per_piece)


def _json_lines(chunk: Chunk) -> bool:
    """Whether the chunk is one plain or compressed JSON Lines object (parsed piece by piece,
    or line by line by the engine that encodes it), not Parquet, a group or another layout."""
    return not (chunk.parts or chunk.kind == "parquet" or chunk.kind in _LAYOUT_TEXTS)


def read_lines(store: ObjectBackend, chunk: Chunk) -> JsonLines | None:
    """A plain or compressed JSON Lines chunk's lines, read here, for an engine that parses
    them as it encodes (`JsonLines`); None for any other chunk (`read_pieces` reads it)."""
    if not _json_lines(chunk):
        return None
    return JsonLines(store, chunk)


def _joined(parts: list[ChunkDocuments]) -> ChunkDocuments:
    texts, bad, ids, base = [], [], [], 0
    for d in parts:
        texts += d.texts
        bad += d.bad
        ids += [base + i for i in d.record_ids]
        base += d.records
    return ChunkDocuments(
        texts,
        bad,
        base,
        ids,
        tuple(PartStart(d.records, single_start(None, d.data_start)) for d in parts),
    )
