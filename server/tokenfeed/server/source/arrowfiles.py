"""Arrow IPC stream files (what `Dataset.save_to_disk` writes as `data-0000x-of-0000N.arrow`),
cut into chunks by their own record batches and read with ranged reads.

A stream is a sequence of messages, each `0xFFFFFFFF | int32 metadata size | flatbuffer
Message | body`, the schema first and an end-of-stream marker last. Nothing but the messages
themselves says where the batches are, so planning walks the message headers once per file
(`batch_table`: only each header's few hundred bytes are parsed; bodies are skipped) and keeps
the table in the token store (shardindex.py). Consecutive batches of about `chunk_bytes` make a
chunk; a chunk is read as the schema's bytes and its batches' bytes (two ranged reads), and
decoded by pyarrow as a stream of its own. Text columns become documents and `list<int>`
columns token ids (`token_field`), row by row like a Parquet row group (columns.py).

A file cut short keeps the batches it holds whole; the rows of a batch cut short are bad
records (`<uri> row N`, truncated), as are those of a batch pyarrow cannot decode.
Dictionary-encoded streams are refused at start (their dictionaries would have to travel with
every chunk).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from functools import lru_cache
from typing import BinaryIO

import numpy as np
import pyarrow as pa
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.source.chunk import Chunk
from tokenfeed.server.source.columns import is_text, is_token_list, text_records, token_records
from tokenfeed.server.source.records import BadRecord, TokenRecords
from tokenfeed.server.source.shardindex import ShardIndexes, cached

_CONTINUATION = 0xFFFFFFFF
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
SCHEMA, DICTIONARY, BATCH = 1, 2, 3  # MessageHeader union types
CUT = -1  # a message cut inside its header: its rows are unknown


def _message(meta: bytes) -> tuple[int, int, int]:
    """(header type, body length, rows of a record batch) from a Message flatbuffer."""

    def field(table: int, i: int) -> int:  # the field's offset from its table, 0 if absent
        vtable = table - struct.unpack_from("<i", meta, table)[0]
        size = struct.unpack_from("<H", meta, vtable)[0]
        return struct.unpack_from("<H", meta, vtable + 4 + 2 * i)[0] if 4 + 2 * i < size else 0

    root = struct.unpack_from("<I", meta, 0)[0]
    kind = meta[root + field(root, 1)] if field(root, 1) else 0
    body = struct.unpack_from("<q", meta, root + field(root, 3))[0] if field(root, 3) else 0
    rows = 0
    if kind == BATCH:
        at = root + field(root, 2)
        header = at + struct.unpack_from("<I", meta, at)[0]
        length = field(header, 0)
        rows = struct.unpack_from("<q", meta, header + length)[0] if length else 0
    return kind, body, rows


def messages(f: BinaryIO, size: int, pos: int = 0) -> Iterator[tuple[int, int, int, int]]:
    """(offset, length, header type, rows) of each message from `pos` to the end of stream;
    a last one cut inside its header has type CUT and runs to the end of the bytes."""
    while pos + 4 <= size:
        f.seek(pos)
        head = f.read(8)
        (word,) = struct.unpack_from("<I", head)
        prefix, meta_len = 4, struct.unpack_from("<i", head)[0]
        if word == _CONTINUATION:
            if len(head) < 8:
                yield pos, size - pos, CUT, -1
                return
            prefix, meta_len = 8, struct.unpack_from("<i", head, 4)[0]
        if meta_len == 0:
            return
        f.seek(pos + prefix)
        meta = f.read(meta_len) if meta_len > 0 else b""
        try:
            if len(meta) < meta_len or meta_len < 0:
                raise ValueError("short")
            kind, body, rows = _message(meta)
        except (ValueError, struct.error, IndexError):
            yield pos, size - pos, CUT, -1
            return
        yield pos, prefix + meta_len + body, kind, rows
        pos += prefix + meta_len + body


def batch_table(store: ObjectBackend, obj: ObjectInfo) -> np.ndarray:
    """[offset, length, rows] of the schema (first) and each record batch of a stream file."""
    with store.open(obj) as f:
        _not_a_file(obj, f.read(6))
        found = list(messages(f, obj.size))
    if not found or found[0][2] != SCHEMA:
        raise SourceError(
            f"{obj.uri}: not an Arrow IPC stream (expected a schema message first, as "
            "save_to_disk writes)"
        )
    if any(kind == DICTIONARY for _, _, kind, _ in found):
        raise SourceError(f"{obj.uri}: dictionary-encoded Arrow streams are not read")
    rows = [m for m in found[1:] if m[2] in (BATCH, CUT)]
    return np.array([found[0][:2] + (0,)] + [(o, n, r) for o, n, _, r in rows], dtype=np.int64)


def _not_a_file(obj: ObjectInfo, head: bytes) -> None:
    if head == b"ARROW1":
        raise SourceError(
            f"{obj.uri}: an Arrow IPC file (ARROW1), expected the IPC stream format that "
            "save_to_disk writes; rewrite it as a stream or as Parquet"
        )


@lru_cache(maxsize=4096)
def _schema(store: ObjectBackend, obj: ObjectInfo) -> tuple[bytes, pa.Schema]:
    """The schema message's bytes and the schema, once per file and process."""
    with store.open(obj) as f:
        _not_a_file(obj, f.read(6))
        first = next(messages(f, obj.size), None)
    if first is None or first[2] != SCHEMA:
        raise SourceError(f"{obj.uri}: not an Arrow IPC stream (no schema message first)")
    raw = store.read_range(obj, first[0], first[0] + first[1])
    try:
        return raw, pa.ipc.read_schema(pa.py_buffer(raw))
    except pa.ArrowException as e:
        raise SourceError(f"{obj.uri}: unreadable Arrow schema: {e}") from e


def plan(
    store: ObjectBackend,
    obj: ObjectInfo,
    field: str,
    tokens: bool,
    chunk_bytes: int,
    indexes: ShardIndexes,
) -> list[Chunk]:
    """A stream file's chunks: consecutive record batches of about chunk_bytes each."""
    schema = _schema(store, obj)[1]
    key = "token_field" if tokens else "text_field"
    if field not in schema.names:
        raise SourceError(
            f"{obj.uri}: no column {field!r} (columns: {schema.names}); set {key} on the source"
        )
    kind = schema.field(field).type
    if (tokens and not is_token_list(kind)) or (not tokens and not is_text(kind)):
        want = "a list of integer token ids" if tokens else "a string"
        raise SourceError(f"{obj.uri}: column {field!r} is {kind}, expected {want} ({key})")
    table = cached(indexes, "arrow-stream", obj, lambda: batch_table(store, obj))
    chunks: list[Chunk] = []
    run: list[tuple[int, int, int]] = []
    row = 0
    for offset, length, rows in table[1:].tolist():
        if run and offset + length - run[0][0] > chunk_bytes:
            chunks.append(_chunk(obj, tokens, field, run))
            run = []
        run.append((offset, length, row))
        row += max(rows, 0)
    if run:
        chunks.append(_chunk(obj, tokens, field, run))
    return chunks


def _chunk(obj: ObjectInfo, tokens: bool, field: str, run: list[tuple[int, int, int]]) -> Chunk:
    start, end = run[0][0], run[-1][0] + run[-1][1]
    kind = "arrow-tokens" if tokens else "arrow"
    return Chunk(obj, kind, field, start, end, nbytes=end - start, first_record=run[0][2])


def _batches(
    store: ObjectBackend, chunk: Chunk
) -> Iterator[tuple[int, pa.RecordBatch | BadRecord]]:
    """(first row, the batch or why its rows cannot be read) of each batch of the chunk."""
    schema_bytes = _schema(store, chunk.source)[0]
    data = store.read_range(chunk.source, chunk.start, chunk.end)
    row, uri = chunk.first_record, chunk.source.uri
    for offset, length, kind, rows in messages(io.BytesIO(data), len(data)):
        if kind not in (BATCH, CUT):
            continue
        if kind == CUT or offset + length > len(data):
            end = chunk.start + len(data)
            what = f"rows {row}-{row + rows - 1}" if rows > 0 else f"bytes {chunk.start + offset}-"
            yield row, BadRecord("truncated", f"{uri} {what}", f"the file ends at byte {end}")
            row += max(rows, 0)
            continue
        try:
            stream = schema_bytes + data[offset : offset + length] + _EOS
            batch = pa.ipc.open_stream(pa.py_buffer(stream)).read_next_batch()
        except (pa.ArrowException, StopIteration) as e:
            yield row, BadRecord("corrupt_batch", f"{uri} rows {row}-{row + rows - 1}", str(e))
        else:
            yield row, batch
        row += rows


def _rows(bad: BadRecord, row: int) -> list[BadRecord]:
    """A batch's bad record as one per row, when its rows are known."""
    what = bad.location.rsplit(" ", 2)
    if what[-2] != "rows":
        return [bad]
    lo, hi = (int(x) for x in what[-1].split("-"))
    return [BadRecord(bad.reason, f"{what[0]} row {r}", bad.detail) for r in range(lo, hi + 1)]


def read_texts(store: ObjectBackend, chunk: Chunk) -> list[str | BadRecord]:
    out: list[str | BadRecord] = []
    for row, batch in _batches(store, chunk):
        if isinstance(batch, BadRecord):
            out += _rows(batch, row)
        else:
            column = batch.column(chunk.text_field)
            out += text_records(column, row, chunk.source.uri, chunk.text_field)
    return out


def read_tokens(store: ObjectBackend, chunk: Chunk) -> TokenRecords:
    parts, refused, base = [], {}, 0
    where = f"{chunk.source.uri} row"
    for row, batch in _batches(store, chunk):
        if isinstance(batch, BadRecord):
            for b in _rows(batch, row):
                refused[base] = b
                parts.append((np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)))
                base += 1
            continue
        rec = token_records(batch.column(chunk.text_field), row, where, chunk.text_field)
        refused.update({base + r: b for r, b in rec.refused.items()})
        parts.append((rec.ids.astype(np.int64), rec.lengths))
        base += len(rec.lengths)
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    lengths = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    return TokenRecords(ids, lengths, chunk.first_record, where, refused)
