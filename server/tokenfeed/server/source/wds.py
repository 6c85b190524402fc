"""WebDataset tar shards (`.tar`, `.tar.gz`/`.tgz`), read with the standard library's view of
the tar format (tarwalk.py: ustar, pax and GNU long names) and no webdataset at run time.

A sample is a run of consecutive members sharing a key: the member's path up to the first dot
of its file name (`shard/000017.txt` and `shard/000017.json` are sample `shard/000017`), as
webdataset groups them; its extension (lower-cased) names the field. The text is the member
named by the source's `member` (`txt` by default), or `text_field` of a JSON member
(`member: json`); chunks carry this reading as `txt` or `json:<field>`.

A plain tar is cut into chunks of whole samples holding about `chunk_bytes` of member data by
its member index, which a walk over its 512-byte headers builds once per shard version and the
token store keeps (shardindex.py); a chunk is then one ranged read. The walk verifies the
headers' checksums a batch at a time (tarwalk.walked), and a process that planned a tar keeps where
each sample's text lies, so reading its chunks cuts the texts out without walking them again
(a chunk with any damage is walked, which says where and why). A compressed tar is one chunk,
read whole. Damage is located by shard and member or sample: a member cut short
(truncated), a header that fails its checksum (the rest of the shard is one bad record), a
sample without the member, text that is not UTF-8, a JSON member that is malformed or lacks the
field.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from functools import lru_cache
from typing import BinaryIO

import numpy as np
import orjson
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.source.chunk import Chunk
from tokenfeed.server.source.records import BadRecord, text_of
from tokenfeed.server.source.shardindex import ShardIndexes, cached, index_key
from tokenfeed.server.source.tarwalk import Damage, Member, key_of, walked


def reading(member: str, field: str) -> str:
    """A source's member selection as a chunk's `text_field`."""
    return f"json:{field}" if member == "json" else member


def _samples(f: BinaryIO, size: int) -> Iterator[list[Member] | Damage]:
    """Runs of consecutive members of one key."""
    run: list[Member] = []
    key = ""
    for m in walked(f, size):
        if isinstance(m, Damage):
            if run:
                yield run
            yield m
            return
        k = key_of(m.name)
        if k is None:
            continue
        if run and key != k[0]:
            yield run
            run = []
        if not run:
            key = k[0]
        run.append(m)
    if run:
        yield run


def sample_table(store: ObjectBackend, obj: ObjectInfo, text_field: str = "") -> np.ndarray:
    """[first header, end, data bytes] of each sample of a plain tar (a damaged tail is one
    more row). With `text_field` (a chunk's reading), where each sample's text member lies is
    kept in this process too (`_planned`), so reading the chunks does not walk them again."""
    rows, texts = [], []
    ext = text_field.partition(":")[0]
    with store.open(obj) as f:
        for s in _samples(f, obj.size):
            if isinstance(s, Damage):
                rows.append((s.at, obj.size, obj.size - s.at))
                texts.append((-1, 0))
            else:
                rows.append((s[0].header, s[-1].end, sum(m.size for m in s)))
                m = next((m for m in s if key_of(m.name)[1] == ext), None)  # type: ignore[index]
                texts.append((-1, 0) if m is None else (m.data, m.size))
    table = np.array(rows, dtype=np.int64).reshape(-1, 3)
    if text_field:
        planned = np.array(texts, dtype=np.int64).reshape(-1, 2)
        _PLANNED.get_or_make(_planned_key(obj, text_field), lambda: np.hstack([table, planned]))
    return table


# Where the text member of each sample of recently planned tars lies ([first header, end, data
# bytes, text offset, text bytes] rows; -1: none), by shard version and reading.
_PLANNED: LRU[tuple[str, str], np.ndarray] = LRU(256, 64 << 20)


def _planned_key(obj: ObjectInfo, text_field: str) -> tuple[str, str]:
    return index_key("tar", obj), text_field


def plan(
    store: ObjectBackend, obj: ObjectInfo, field: str, chunk_bytes: int, indexes: ShardIndexes
) -> list[Chunk]:
    """A tar's chunks: whole samples holding about chunk_bytes of member data (plain), or the
    whole object. The members' data, not the tar's extent: 512-byte headers and padding can
    triple the size of small text samples, and a chunk's costs follow its documents (its
    `nbytes`, what a read fetches, is still the extent)."""
    if obj.uri.lower().endswith((".gz", ".tgz")):
        return [Chunk(obj, "tar.gz", field, 0, obj.size, nbytes=obj.size)]
    table = cached(indexes, "tar", obj, lambda: sample_table(store, obj, field))

    def chunk(first: int, stop: int) -> Chunk:
        start, end = int(table[first][0]), int(table[stop - 1][1])
        return Chunk(obj, "tar", field, start, end, nbytes=end - start, first_record=first)

    chunks, first, held = [], 0, 0
    for i in range(len(table)):
        if i > first and held + table[i][2] > chunk_bytes:
            chunks.append(chunk(first, i))
            first, held = i, 0
        held += int(table[i][2])
    return chunks + ([chunk(first, len(table))] if len(table) else [])


def _bytes(store: ObjectBackend, chunk: Chunk) -> tuple[bytes, bool]:
    """The chunk's bytes, and whether they end where they should (a compressed stream that
    ends early does not: its samples held whole are read, the rest is one bad record)."""
    if chunk.kind == "tar":
        return store.read_range(chunk.source, chunk.start, chunk.end), True
    raw = store.read_range(chunk.source, 0, chunk.source.size)
    d = zlib.decompressobj(wbits=47)
    try:
        data = d.decompress(raw)
    except zlib.error:
        return b"", False
    return data, d.eof


def read_texts(store: ObjectBackend, chunk: Chunk) -> list[str | BadRecord]:
    """The chunk's samples, each its text or why it is a bad record."""
    (data, whole), uri = _bytes(store, chunk), chunk.source.uri
    if chunk.kind == "tar":
        planned = _PLANNED.get(_planned_key(chunk.source, chunk.text_field))
        texts = None if planned is None else _planned_texts(data, chunk, planned)
        if texts is not None:
            return texts  # type: ignore[return-value]
    ext, _, field = chunk.text_field.partition(":")
    out: list[str | BadRecord] = []
    n = max(chunk.first_record, 0)
    for s in _samples(io.BytesIO(data), len(data)):
        if isinstance(s, Damage):
            at = s.at + (chunk.start if chunk.kind == "tar" else 0)
            out.append(BadRecord("corrupt_header", f"{uri} byte {at}", s.why))
            continue
        out.append(_text(data, s, ext, field, f"{uri} sample {n}", uri))
        n += 1
    if not whole:  # one record for what the stream lost (a header it cut included)
        if out and isinstance(out[-1], BadRecord) and out[-1].reason == "corrupt_header":
            out.pop()
        detail = f"the compressed stream ends early, after {len(data)} bytes of tar"
        out.append(BadRecord("truncated", f"{uri} sample {n}", detail))
    return out


def _planned_texts(data: bytes, chunk: Chunk, planned: np.ndarray) -> list[str] | None:
    """The chunk's texts cut where the plan's walk found them, or None for anything but good
    text in every sample (a sample without the member, damage, a short read, text that is not
    UTF-8 or empty, JSON that does not hold the field): the walk then reads the chunk, and
    says where and why."""
    field = chunk.text_field.partition(":")[2]
    first = max(chunk.first_record, 0)
    rows = planned[first:][planned[first:, 0] < chunk.end]
    if not len(rows) or rows[0, 0] != chunk.start:
        return None
    out: list[str] = []
    for at, n in (rows[:, 3:5] - (chunk.start, 0)).tolist():
        if at < 0 or at + n > len(data):
            return None
        raw = data[at : at + n]
        try:
            text = orjson.loads(raw).get(field) if field else raw.decode("utf-8")
        except (orjson.JSONDecodeError, AttributeError, UnicodeDecodeError):
            return None
        if not isinstance(text, str) or not text:
            return None
        out.append(text)
    return out


def _text(data: bytes, sample: list[Member], ext: str, field: str, where: str, uri: str):
    found = [m for m in sample if key_of(m.name)[1] == ext]  # type: ignore[index]
    if not found:
        exts = sorted({key_of(m.name)[1] for m in sample})  # type: ignore[index]
        key = key_of(sample[0].name)[0]  # type: ignore[index]
        return BadRecord("missing_field", where, f"sample {key!r} has no .{ext} member ({exts})")
    m = found[0]
    at = f"{uri} member {m.name}"
    if m.data + m.size > len(data):
        return BadRecord(
            "truncated", at, f"{m.size} bytes in its header, {len(data) - m.data} held"
        )
    raw = data[m.data : m.data + m.size]
    if not field:
        return text_of(raw, at, "the member")
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return BadRecord("malformed_json", at, str(e))
    if not isinstance(record, dict) or field not in record:
        return BadRecord("missing_field", at, f"no {field!r} field")
    value = record[field]
    if not isinstance(value, str):
        return BadRecord("not_text", at, f"{field!r} is {type(value).__name__}")
    return value or BadRecord("empty", at, f"{field!r} is empty")


def sample_key(store: ObjectBackend, chunk: Chunk, record: int) -> str:
    """The key of the chunk's `record`-th sample (Explain), "" if it cannot be read."""
    keys = _keys(store, chunk)
    return keys[record] if 0 <= record < len(keys) else ""


@lru_cache(maxsize=64)
def _keys(store: ObjectBackend, chunk: Chunk) -> tuple[str, ...]:
    """The keys of a chunk's samples in order ("" for damage), read once per chunk and process:
    Explain asks for many pieces of one chunk, and a compressed tar is read whole for each."""
    data = _bytes(store, chunk)[0]
    return tuple(
        "" if isinstance(s, Damage) else key_of(s[0].name)[0]  # type: ignore[index]
        for s in _samples(io.BytesIO(data), len(data))
    )
