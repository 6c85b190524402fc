"""WebDataset tar shards (`.tar`, `.tar.gz`/`.tgz`), read with the standard library's view of
the tar format (ustar, pax and GNU long names) and no webdataset at run time.

A sample is a run of consecutive members sharing a key: the member's path up to the first dot
of its file name (`shard/000017.txt` and `shard/000017.json` are sample `shard/000017`), as
webdataset groups them; its extension (lower-cased) names the field. The text is the member
named by the source's `member` (`txt` by default), or `text_field` of a JSON member
(`member: json`); chunks carry this reading as `txt` or `json:<field>`.

A plain tar is cut into chunks of whole samples holding about `chunk_bytes` of member data by
its member index, which a walk over its 512-byte headers builds once per shard version and the
token store keeps (shardindex.py); a chunk is then one ranged read. The walk verifies the
headers' checksums a batch at a time (`walked`), and a process that planned a tar keeps where
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
from dataclasses import dataclass
from functools import lru_cache
from typing import BinaryIO

import numpy as np
import orjson
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.source.chunk import Chunk
from tokenfeed.server.source.records import BadRecord, text_of
from tokenfeed.server.source.shardindex import ShardIndexes, cached, index_key

_BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")
_META = (b"x", b"L", b"g", b"K")
_WINDOW = 2**20


@dataclass(frozen=True)
class Member:
    header: int  # offset of its first header block (pax or long-name headers included)
    name: str
    data: int  # offset of its data
    size: int  # its data's size, as its header says
    end: int  # offset of the next header


@dataclass(frozen=True)
class Damage:
    at: int  # offset of the header that cannot be read
    why: str


def reading(member: str, field: str) -> str:
    """A source's member selection as a chunk's `text_field`."""
    return f"json:{field}" if member == "json" else member


def _number(raw: bytes) -> int:
    if raw and raw[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
        return int.from_bytes(raw[1:], "big")
    text = raw.split(b"\0", 1)[0].strip(b" \0")
    return int(text, 8) if text else 0


def _pax(payload: bytes) -> dict[bytes, bytes]:
    out, pos = {}, 0
    while pos < len(payload):
        space = payload.find(b" ", pos)
        if space < 0:
            break
        length = int(payload[pos:space])
        key, _, value = payload[space + 1 : pos + length - 1].partition(b"=")
        out[key] = value
        pos += length
    return out


class _Window:
    """Reads of a file through a window of `_WINDOW` bytes: a walk over many small members
    costs one read per window, not one per header."""

    def __init__(self, f: BinaryIO):
        self.f, self.lo, self.buf = f, 0, b""

    def read(self, pos: int, n: int) -> bytes:
        at = pos - self.lo
        if at < 0 or at + n > len(self.buf):
            self.f.seek(pos)
            self.lo, self.buf, at = pos, self.f.read(max(n, _WINDOW)), 0
        return self.buf[at : at + n]


def members(f: BinaryIO, size: int, pos: int = 0) -> Iterator[Member | Damage]:
    """The regular-file members from `pos` on, in order; a header that cannot be read ends
    the walk with a `Damage`."""
    return _walk(f, size, pos, None)


def walked(f: BinaryIO, size: int) -> list[Member | Damage]:
    """`list(members(f, size))`, with the headers' checksums verified a batch at a time in numpy
    instead of one Python sum a header (the walk's largest cost). A batch with a header that
    fails walks the tar again header by header, so the result is always `members`'."""
    batch = _Checksums()
    found = []
    try:
        for m in _walk(f, size, 0, batch):
            found.append(m)
            if not batch.hold():
                return list(members(f, size))
    except ValueError:  # a header read before its checksum was (or one with a large payload):
        return list(members(f, size))  # the walk that checks each header says why
    return found if batch.hold(final=True) else list(members(f, size))


class _Checksums:
    """Headers waiting for their checksums to be verified together."""

    BATCH = 4096

    def __init__(self) -> None:
        self.blocks: list[bytes] = []

    def add(self, block: bytes) -> None:
        self.blocks.append(block)

    def hold(self, final: bool = False) -> bool:
        """Whether every header so far holds its checksum (verified once BATCH are waiting,
        or all that wait when `final`); False too for a checksum field that is not a number."""
        if not self.blocks or (len(self.blocks) < self.BATCH and not final):
            return True
        raw = np.frombuffer(b"".join(self.blocks), dtype=np.uint8).reshape(-1, _BLOCK)
        checks, plain = _octal(raw[:, 148:156])
        try:
            for i in np.nonzero(~plain)[0].tolist():
                checks[i] = _number(self.blocks[i][148:156])
        except ValueError:
            return False
        sums = raw.sum(axis=1, dtype=np.int64) - raw[:, 148:156].sum(axis=1, dtype=np.int64)
        bad = np.nonzero(sums + 256 != checks)[0].tolist()
        ok = all(int(checks[i]) == _signed(self.blocks[i]) for i in bad)
        self.blocks = []
        return ok


def _octal(fields: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_number` of each row of header fields ([n, width] bytes), and which rows are plain:
    octal digits after spaces, ending at a NUL or spaces (the rest, e.g. base-256 or signs,
    is left to `_number`)."""
    rows = len(fields)
    value = np.zeros(rows, dtype=np.int64)
    started, trailing, nul, odd = (np.zeros(rows, dtype=bool) for _ in range(4))
    for col in fields.T:
        live = ~nul
        digit = live & (col >= 48) & (col <= 55)
        space = live & (col == 32)
        odd |= (digit & trailing) | (live & ~digit & ~space & (col != 0))
        value = np.where(digit, value * 8 + (col.astype(np.int64) - 48), value)
        started |= digit
        trailing |= space & started
        nul |= col == 0
    return value, ~odd


def _walk(
    f: BinaryIO, size: int, pos: int, deferred: _Checksums | None
) -> Iterator[Member | Damage]:
    """`members`; with `deferred`, each header's checksum is left to it (not verified here)."""
    first, long_name, pax = -1, b"", {}
    window = _Window(f)
    while pos < size:
        block = window.read(pos, _BLOCK)
        if len(block) < _BLOCK:
            yield Damage(pos, f"a header cut short at byte {size}")
            return
        if block == bytes(_BLOCK):
            return  # the end-of-archive marker
        try:
            # Deferred, the checksum field is read with the batch's (a field that is not a
            # number fails the batch, and the walk that checks says so).
            check = _number(block[148:156]) if deferred is None else 0
            n = _number(block[124:136])
        except ValueError:
            yield Damage(pos, "a header with unreadable numbers")
            return
        # A header whose payload is read (pax, long names) is checked before a large read.
        if deferred is not None and not (block[156:157] in _META and n > _WINDOW):
            deferred.add(block)
        elif deferred is not None:  # `walked` then walks with the checks, header by header
            raise ValueError(f"a header payload of {n} bytes at byte {pos}")
        elif check != sum(block) - sum(block[148:156]) + 256 and check != _signed(block):
            yield Damage(pos, "a header that fails its checksum")
            return
        kind, head = block[156:157], first if first >= 0 else pos
        if kind in _META:
            payload = window.read(pos + _BLOCK, n) if kind in (b"x", b"L") else b""
            if kind == b"x":
                pax = _pax(payload)
            elif kind == b"L":
                long_name = payload.split(b"\0", 1)[0]
            first, pos = head, pos + _BLOCK + -(-n // _BLOCK) * _BLOCK
            continue
        if b"size" in pax:
            n = int(pax[b"size"])
        name = pax.get(b"path") or long_name or block[:100].split(b"\0", 1)[0]
        if block[257:262] == b"ustar" and not (pax.get(b"path") or long_name):
            prefix = block[345:500].split(b"\0", 1)[0]
            name = prefix + b"/" + name if prefix else name
        end = pos + _BLOCK + -(-n // _BLOCK) * _BLOCK
        if kind in _REGULAR:
            yield Member(head, name.decode("utf-8", "replace"), pos + _BLOCK, n, end)
        first, long_name, pax, pos = -1, b"", {}, end


def _signed(block: bytes) -> int:
    """The checksum as some old tars compute it, over signed bytes (only when the usual one
    fails: it costs a Python loop over the header)."""
    return sum(b - 256 if b > 127 else b for b in block[:148] + b" " * 8 + block[156:])


def key_of(name: str) -> tuple[str, str] | None:
    """(sample key, lower-cased extension) of a member, as webdataset groups them; None for a
    name without an extension (webdataset skips those)."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    return None if dot <= slash + 1 else (name[:dot], name[dot + 1 :].lower())


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
