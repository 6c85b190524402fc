"""Reading the documents of one chunk, with every bad record counted and located.

Bad records are never silent: each one becomes a `BadRecord` with a reason and a location
(`uri:line` for JSON Lines, `uri row N` for Parquet). The caller applies the job's policy:
`skip` drops them (counted and logged), `strict` refuses the chunk with the first location.

A group of small objects (chunks.py) reads as its parts one after another, each located as a
chunk of its own; its records are numbered across the parts. `locate_record` turns a stored
document's record id back into its object and line, row or document, for any chunk.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import TypeVar

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from tokenfeed.server.errors import SourceError, StoreCorruptError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.source import arrowfiles, mdscolumns, wds
from tokenfeed.server.source.chunks import Chunk
from tokenfeed.server.source.provenance import DataStart, PartStart, Provenance
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
_BLOCK = 4 * 2**20
_TAIL_READ = 64 * 2**10
T = TypeVar("T")


def _line_range(store: ObjectBackend, chunk: Chunk) -> tuple[bytes, int]:
    """The bytes of the lines that start in [chunk.start, chunk.end), and where they start."""
    obj, size = chunk.source, chunk.source.size
    lo = max(chunk.start - 1, 0)
    buf = store.read_range(obj, lo, chunk.end)
    begin = 0
    if chunk.start > 0:
        nl = buf.find(b"\n")
        if nl < 0 or lo + nl + 1 >= chunk.end:
            return b"", chunk.end
        begin = nl + 1
    if not buf.endswith(b"\n") and chunk.end < size:
        # Finish the last line: small reads first, since lines are usually short.
        parts, pos, step = [buf], chunk.end, _TAIL_READ
        while pos < size:
            more = store.read_range(obj, pos, pos + step)
            if not more:
                break
            k = more.find(b"\n")
            parts.append(more if k < 0 else more[: k + 1])
            if k >= 0:
                break
            pos, step = pos + len(more), min(step * 4, _BLOCK)
        buf = b"".join(parts)
    return buf[begin:], lo + begin


@lru_cache(maxsize=65536)
def _newlines_in_block(store: ObjectBackend, obj: ObjectInfo, k: int) -> int:
    return store.read_range(obj, k * _BLOCK, (k + 1) * _BLOCK).count(b"\n")


def _count_lines_before(store: ObjectBackend, chunk: Chunk, offset: int) -> int:
    """Newlines in [0, offset). Whole aligned blocks are counted once per process, so locating
    bad records in many chunks of one file reads the file about once, not once per chunk."""
    full = offset // _BLOCK
    count = sum(_newlines_in_block(store, chunk.source, k) for k in range(full))
    tail = store.read_range(chunk.source, full * _BLOCK, offset)
    return count + tail.count(b"\n")


def _unzstd(raw: bytes) -> bytes:
    """Every frame of a .zst object; a truncated last frame is an error, not a short read."""
    out, rest = [], raw
    while rest:
        d = zstandard.ZstdDecompressor().decompressobj()
        out.append(d.decompress(rest))
        if not d.eof:
            raise zstandard.ZstdError("truncated: the last frame ends early")
        rest = d.unused_data
    return b"".join(out)


def _decompressed(store: ObjectBackend, chunk: Chunk) -> bytes:
    raw = store.read_range(chunk.source, 0, chunk.source.size)
    try:
        return gzip.decompress(raw) if chunk.kind == "jsonl.gz" else _unzstd(raw)
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as e:
        raise SourceError(f"{chunk.source.uri}: cannot decompress {chunk.kind}: {e}") from e


def _parse_lines(data: bytes, chunk: Chunk) -> Iterator[tuple[int, str | BadRecord]]:
    """(line index within data, its text or why it is a bad record)."""
    field = chunk.text_field
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for i, line in enumerate(lines):
        if not line.strip():
            yield i, BadRecord("empty", "", "blank line")
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield i, BadRecord("invalid_utf8", "", f"byte {e.start} of the line")
            continue
        try:
            record = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            yield i, BadRecord("malformed_json", "", str(e))
            continue
        if not isinstance(record, dict):
            yield i, BadRecord("not_an_object", "", f"a JSON {type(record).__name__}")
        elif field not in record:
            yield i, BadRecord("missing_field", "", f"no {field!r} field")
        elif not isinstance(record[field], str):
            yield i, BadRecord("not_text", "", f"{field!r} is {type(record[field]).__name__}")
        elif not record[field]:
            yield i, BadRecord("empty", "", f"{field!r} is empty")
        else:
            yield i, record[field]


def _single_start(chunk: Chunk | None, data_start: DataStart) -> int:
    """The data start of one object's records (a group's parts are read one at a time, each
    with documents of its own)."""
    if isinstance(data_start, tuple):
        what = chunk.describe() if chunk is not None else "a part of a group"
        raise ValueError(f"{what}: per-part data starts where one object's was expected")
    return data_start


def _read_jsonl(store: ObjectBackend, chunk: Chunk) -> ChunkDocuments:
    docs = ChunkDocuments([], [], 0, [])
    docs.texts = list(_jsonl_texts(store, chunk, docs, _jsonl_data(store, chunk, docs)))
    return docs


def _jsonl_data(store: ObjectBackend, chunk: Chunk, docs: ChunkDocuments) -> bytes:
    """The chunk's lines (decompressed); where they start goes to `docs`."""
    if chunk.kind == "jsonl":
        data, docs.data_start = _line_range(store, chunk)
        return data
    docs.data_start = 0
    return _decompressed(store, chunk)


def _jsonl_texts(
    store: ObjectBackend, chunk: Chunk, docs: ChunkDocuments, data: bytes
) -> Iterator[str]:
    """The good texts of the chunk's lines `data`, one at a time; its bad records, record
    count and record ids go to `docs` as the lines are parsed (its `texts` are the caller's)."""
    line_base: int | None = 0 if docs.data_start == 0 else None
    for i, item in _parse_lines(data, chunk):
        docs.records += 1
        if isinstance(item, str):
            docs.record_ids.append(i)
            yield item
            continue
        if line_base is None:  # only paid when a range chunk has a bad record
            line_base = _count_lines_before(store, chunk, _single_start(chunk, docs.data_start))
        location = f"{chunk.source.uri}:{line_base + i + 1}"
        docs.bad.append(BadRecord(item.reason, location, item.detail))


def line_number(store: ObjectBackend, chunk: Chunk, data_start: int, record: int) -> int:
    """1-based line of the chunk's `record`-th record (simple JSON Lines chunks; any chunk:
    `locate_record`)."""
    if chunk.parts:
        raise ValueError(f"{chunk.describe()}: a group; locate_record finds its part")
    before = _count_lines_before(store, chunk, data_start) if data_start else 0
    return before + record + 1


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
    return _read_jsonl(store, chunk)


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
    if chunk.parts or chunk.kind == "parquet" or chunk.kind in _LAYOUT_TEXTS:
        whole = read_documents(store, chunk)
        texts, whole.texts = whole.texts, []
        n = docs_per_piece
        return whole, (texts[i : i + n] for i in range(0, len(texts), n))
    docs = ChunkDocuments([], [], 0, [])
    data = _jsonl_data(store, chunk, docs)
    return docs, _batched(_jsonl_texts(store, chunk, docs, data), docs_per_piece)


def _batched(items: Iterator[str], n: int) -> Iterator[list[str]]:
    piece: list[str] = []
    for item in items:
        piece.append(item)
        if len(piece) == n:
            yield piece
            piece = []
    if piece:
        yield piece


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
        tuple(PartStart(d.records, _single_start(None, d.data_start)) for d in parts),
    )
