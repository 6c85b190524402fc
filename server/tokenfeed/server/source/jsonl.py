"""JSON Lines (plain, gzip or zstd) read where it lies: a chunk's byte range finished to whole
lines, or a compressed object whole; each line's text field parsed, every bad record located by
its line (`uri:line`, whose count before a range is read once per block and process)."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import orjson
import zstandard
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.source.chunks import Chunk
from tokenfeed.server.source.provenance import DataStart
from tokenfeed.server.source.records import BadRecord, ChunkDocuments

_BLOCK = 4 * 2**20
_TAIL_READ = 64 * 2**10


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


def _lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def _bad_line(line: bytes, field: str) -> BadRecord | None:
    """Why the line is a bad record, or None where its text is good."""
    try:
        # orjson reads the bytes and refuses invalid UTF-8 itself; only a line it refuses is
        # decoded, to tell the two apart.
        record = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        if not line.strip():
            return BadRecord("empty", "", "blank line")
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as u:
            return BadRecord("invalid_utf8", "", f"byte {u.start} of the line")
        return BadRecord("malformed_json", "", str(e))
    if not isinstance(record, dict):
        return BadRecord("not_an_object", "", f"a JSON {type(record).__name__}")
    if field not in record:
        return BadRecord("missing_field", "", f"no {field!r} field")
    if not isinstance(record[field], str):
        return BadRecord("not_text", "", f"{field!r} is {type(record[field]).__name__}")
    if not record[field]:
        return BadRecord("empty", "", f"{field!r} is empty")
    return None


def single_start(chunk: Chunk | None, data_start: DataStart) -> int:
    """The data start of one object's records (a group's parts are read one at a time, each
    with documents of its own)."""
    if isinstance(data_start, tuple):
        what = chunk.describe() if chunk is not None else "a part of a group"
        raise ValueError(f"{what}: per-part data starts where one object's was expected")
    return data_start


def read_jsonl(store: ObjectBackend, chunk: Chunk) -> ChunkDocuments:
    """The documents of a simple JSON Lines chunk, all at once."""
    docs = ChunkDocuments([], [], 0, [])
    data = jsonl_data(store, chunk, docs)
    docs.texts = [t for piece in jsonl_pieces(store, chunk, docs, data, 4096) for t in piece]
    return docs


def jsonl_data(store: ObjectBackend, chunk: Chunk, docs: ChunkDocuments) -> bytes:
    """The chunk's lines (decompressed); where they start goes to `docs`."""
    if chunk.kind == "jsonl":
        data, docs.data_start = _line_range(store, chunk)
        return data
    docs.data_start = 0
    return _decompressed(store, chunk)


def jsonl_pieces(
    store: ObjectBackend, chunk: Chunk, docs: ChunkDocuments, data: bytes, n: int
) -> Iterator[list[str]]:
    """The good texts of the chunk's lines `data`, n at a time (the last piece may be
    shorter); its bad records, record count and record ids go to `docs` as the pieces are
    taken (its `texts` are the caller's). Good lines take one parse and one lookup, and only a
    line that fails them is looked at again, to say why."""
    field, loads, lines = chunk.text_field, orjson.loads, _lines(data)
    where = _Locator(store, chunk, docs.data_start)
    ids, piece, before = docs.record_ids, [], docs.records
    for i, line in enumerate(lines):
        try:
            text = loads(line)[field]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            text = None
        if type(text) is str and text:
            piece.append(text)
            ids.append(i)
            if len(piece) == n:
                docs.records = before + i + 1
                yield piece
                piece = []
            continue
        docs.bad.append(where.bad(line, i))
    docs.records = before + len(lines)
    if piece:
        yield piece


class _Locator:
    """A chunk's bad lines located (`uri:line`): the lines before a range chunk's first are
    counted once, and only when one of its lines is bad."""

    def __init__(self, store: ObjectBackend, chunk: Chunk, data_start: DataStart):
        self.store, self.chunk, self.data_start = store, chunk, data_start
        self._base: int | None = 0 if data_start == 0 else None

    def bad(self, line: bytes, i: int) -> BadRecord:
        """Why line `i` of the chunk (a line that failed the parse and lookup) is bad, and
        where."""
        field, chunk = self.chunk.text_field, self.chunk
        found = _bad_line(line, field)
        if found is None:  # cannot be: the line failed the lookup
            raise AssertionError(f"{chunk.describe()}: line {i} is good on a second look")
        if self._base is None:
            start = single_start(chunk, self.data_start)
            self._base = _count_lines_before(self.store, chunk, start)
        return BadRecord(found.reason, f"{chunk.source.uri}:{self._base + i + 1}", found.detail)


class JsonLines:
    """A JSON Lines chunk's lines, read (plain or decompressed), for an engine that parses
    each line on the thread that encodes it (`text`) and then says which were documents
    (`documents`): its records are then what `jsonl_pieces` gives for the same lines."""

    def __init__(self, store: ObjectBackend, chunk: Chunk):
        self.store, self.chunk, self.field = store, chunk, chunk.text_field
        self._docs = ChunkDocuments([], [], 0, [])
        self.lines = _lines(jsonl_data(store, chunk, self._docs))

    def text(self, line: bytes) -> str | None:
        """The line's text, or None where the line is a bad record."""
        try:
            text = orjson.loads(line)[self.field]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None
        return text if type(text) is str and text else None

    def documents(self, good: np.ndarray) -> ChunkDocuments:
        """The chunk's records (`texts` left empty), given which lines were documents."""
        good = np.asarray(good, dtype=bool)
        if good.shape != (len(self.lines),):
            raise ValueError(f"{good.size} answers for {len(self.lines)} lines")
        docs, where = self._docs, _Locator(self.store, self.chunk, self._docs.data_start)
        docs.record_ids = np.flatnonzero(good).tolist()
        docs.bad = [where.bad(self.lines[i], i) for i in np.flatnonzero(~good).tolist()]
        docs.records = len(self.lines)
        return docs


def line_number(store: ObjectBackend, chunk: Chunk, data_start: int, record: int) -> int:
    """1-based line of the chunk's `record`-th record (simple JSON Lines chunks; any chunk:
    `locate_record`)."""
    if chunk.parts:
        raise ValueError(f"{chunk.describe()}: a group; locate_record finds its part")
    before = _count_lines_before(store, chunk, data_start) if data_start else 0
    return before + record + 1
