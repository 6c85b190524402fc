"""Chunk planning: the unit of fetching, tokenizing, caching and packing, known from a listing.

- plain JSON Lines: byte ranges [k*chunk_bytes, (k+1)*chunk_bytes); a chunk holds the lines that
  *start* inside its range (Hadoop's split rule), so boundaries need no scan of the data;
- compressed JSON Lines (.gz, .zst): the whole object, since a stream cannot be entered midway;
- Parquet: one chunk per row group (from the footer), of text or of token ids (`token_field`);
- Megatron-LM indexed datasets (an `.idx` and the `.bin` beside it): runs of consecutive
  sequences holding about `chunk_bytes` of tokens on average, from the listing and the 34-byte
  `.idx` header alone (the rest of an `.idx` is 12 bytes per sequence: gigabytes, not read here).
Sources are sorted by URI, so listing order never matters.

Small objects are grouped: every chunk costs four store files, a manifest, its bookkeeping and at
least one GET, so consecutive sources (in URI order) smaller than `chunk_bytes`, of one kind and
one reading (`format`, `text_field`, `token_field`, URI scheme), form one chunk of up to
`chunk_bytes` (the running size stays <= chunk_bytes). Likewise consecutive small row groups of
one Parquet file, and of consecutive Parquet files whose row groups are all small. A group is a
`Chunk` whose `parts` are the chunks it replaces, read one after another; an object of
`chunk_bytes` or more, a large row group and Megatron runs (already about `chunk_bytes` each) are
planned alone, as before.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.objstore.storage import ObjectStorage, local_storage
from tokenfeed.server.settings.config import JSONL_SUFFIXES, SourceSpec
from tokenfeed.server.source.megatron import megatron_bin, megatron_header

# Bump when the bytes a chunk produces could change for the same inputs.
CHUNK_FORMAT_VERSION = 2


@dataclass(frozen=True)
class Chunk:
    source: ObjectInfo  # of a group: its first part's
    # "jsonl" | "jsonl.gz" | "jsonl.zst" | "parquet" | "parquet-tokens" | "megatron"
    kind: str
    text_field: str  # the column read (of token ids for parquet-tokens); "" for megatron
    # byte offset (jsonl kinds), first row of the row group (parquet kinds), first sequence
    # (megatron); of a group: 0 and its number of parts
    start: int
    end: int  # exclusive: byte offset, row after the row group, sequence after the chunk
    row_group: int = -1
    # Source bytes a read of the chunk needs (for a row group: its compressed column chunks;
    # for megatron: its .idx entries and its share of the .bin at the average sequence size;
    # for a group: its parts' together).
    nbytes: int = 0
    # An object read together with `source` and pinned like it: the .bin of a Megatron .idx.
    companion: ObjectInfo | None = None
    # A group: the simple chunks it is made of, read in this order (records are numbered
    # across them, the first part's first). Empty for a simple chunk.
    parts: tuple[Chunk, ...] = ()

    @classmethod
    def group(cls, parts: list[Chunk]) -> Chunk:
        """One chunk made of several simple chunks of one kind and reading."""
        if len(parts) < 2 or any(p.parts for p in parts):
            raise ValueError("a group is made of two or more simple chunks")
        first = parts[0]
        if any((p.kind, p.text_field) != (first.kind, first.text_field) for p in parts):
            raise ValueError(f"{first.describe()}: a group's parts must share kind and field")
        return cls(
            first.source,
            first.kind,
            first.text_field,
            0,
            len(parts),
            nbytes=sum(p.raw_bytes for p in parts),
            parts=tuple(parts),
        )

    @property
    def pieces(self) -> tuple[Chunk, ...]:
        """The simple chunks read for this one: its parts, or itself."""
        return self.parts or (self,)

    @property
    def objects(self) -> list[ObjectInfo]:
        """Every object a read of this chunk touches, each once, in reading order: what must
        be pinned (size and version) like a simple chunk's source."""
        seen: dict[str, ObjectInfo] = {}
        for p in self.pieces:
            seen.setdefault(p.source.uri, p.source)
            if p.companion is not None:
                seen.setdefault(p.companion.uri, p.companion)
        return list(seen.values())

    @property
    def raw_bytes(self) -> int:
        return self.nbytes or self.end - self.start

    def describe(self) -> str:
        if self.parts:
            first, last = self.parts[0], self.parts[-1]
            if first.source.uri == last.source.uri:  # row groups of one Parquet file
                return (
                    f"{first.source.uri} (row groups {first.row_group}-{last.row_group}, "
                    f"rows {first.start}-{last.end})"
                )
            n, objects = len(self.parts), len({p.source.uri for p in self.parts})
            parts = f"{n} parts, " if n != objects else ""
            return (
                f"{objects} objects {first.source.uri} .. {last.source.uri} ({parts}"
                f"{self.raw_bytes} bytes)"
            )
        if self.kind == "parquet":
            return f"{self.source.uri} (row group {self.row_group}, rows {self.start}-{self.end})"
        if self.kind == "parquet-tokens":
            return (
                f"{self.source.uri} (row group {self.row_group}, rows {self.start}-{self.end}"
                f", token ids in {self.text_field!r})"
            )
        if self.kind == "megatron":
            return f"{self.source.uri} (documents {self.start}-{self.end})"
        return f"{self.source.uri} (bytes {self.start}-{self.end})"

    def key(self, tokenizer_digest: str) -> str:
        """Content address of this chunk's tokens: changes when any input that decides them does."""
        if self.parts:  # its parts' keys, in order, under a tag no simple chunk's text starts with
            group = "\x1f".join(["group", *(p.key(tokenizer_digest) for p in self.parts)])
            return hashlib.blake2b(group.encode(), digest_size=16).hexdigest()
        parts: tuple = (
            CHUNK_FORMAT_VERSION,
            self.source.uri,
            self.source.size,
            self.source.version,
            self.kind,
            self.text_field,
            self.start,
            self.end,
            self.row_group,
            tokenizer_digest,
        )
        if self.companion is not None:  # appended, so the keys of other chunks stay as they were
            c = self.companion
            parts += (c.uri, c.size, c.version)
        text = "\x1f".join(map(str, parts)).encode()
        return hashlib.blake2b(text, digest_size=16).hexdigest()


def source_kind(uri: str, declared: str, token_field: str | None = None) -> str:
    name = uri.lower()
    compression = ""
    for suffix, comp in ((".gz", ".gz"), (".zst", ".zst"), (".zstd", ".zst")):
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], comp
            break
    if declared == "megatron" or (declared == "auto" and name.endswith(".idx")):
        if compression or not name.endswith(".idx"):
            raise SourceError(
                f"{uri}: a Megatron source must match the .idx files (the .bin "
                "beside each is read with it), uncompressed"
            )
        if token_field is not None:
            raise SourceError(
                f"{uri}: token_field applies to Parquet sources; a Megatron "
                "dataset holds nothing but token ids"
            )
        return "megatron"
    if declared == "parquet" or (declared == "auto" and name.endswith(".parquet")):
        if compression:
            raise SourceError(f"{uri}: Parquet files compress internally; got {compression}")
        return "parquet" if token_field is None else "parquet-tokens"
    if declared == "jsonl" or name.endswith(JSONL_SUFFIXES):
        if token_field is not None:
            raise SourceError(f"{uri}: token_field applies to Parquet sources, not JSON Lines")
        return "jsonl" + compression
    raise SourceError(
        f"{uri}: cannot tell the format from the name; expected .jsonl[.gz|.zst], .parquet or "
        ".idx (Megatron), or set format: jsonl|parquet|megatron on the source"
    )


def is_token_list(kind: pa.DataType) -> bool:
    """A Parquet/Arrow type that holds one document's token ids per row."""
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(
        kind.value_type
    )


def _parquet_chunks(store: ObjectBackend, obj: ObjectInfo, spec: SourceSpec) -> list[Chunk]:
    # Row groups are read whole from the footer's offsets; only the one column is decoded.
    tokens = spec.token_field is not None
    field = spec.text_field if spec.token_field is None else spec.token_field
    try:
        with store.open(obj) as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{obj.uri}: not a readable Parquet file: {e}") from e
    if field not in schema.names:
        key = "token_field" if tokens else "text_field"
        raise SourceError(
            f"{obj.uri}: no column {field!r} (columns: {schema.names}); set {key} on the source"
        )
    kind = schema.field(field).type
    if tokens and not is_token_list(kind):
        raise SourceError(
            f"{obj.uri}: column {field!r} is {kind}, expected a list of integer "
            "token ids (token_field)"
        )
    text = (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )
    if not tokens and not text:
        raise SourceError(f"{obj.uri}: column {field!r} is {kind}, expected a string")
    chunks, row = [], 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        n = group.num_rows
        columns = [group.column(c) for c in range(group.num_columns)]
        if tokens:  # only the token column is read (a list is one leaf: `field.list.element`)
            columns = [c for c in columns if c.path_in_schema.split(".")[0] == field]
            chunks.append(
                Chunk(
                    obj,
                    "parquet-tokens",
                    field,
                    row,
                    row + n,
                    g,
                    sum(c.total_compressed_size for c in columns),
                )
            )
        else:
            size = sum(c.total_compressed_size for c in columns)
            chunks.append(Chunk(obj, "parquet", field, row, row + n, g, size))
        row += n
    return chunks


def _megatron_chunks(store: ObjectBackend, idx: ObjectInfo, chunk_bytes: int) -> list[Chunk]:
    header = megatron_header(store, idx)
    data = megatron_bin(store, idx)
    n, itemsize = header.sequences, header.dtype.itemsize
    if data.size % itemsize or (n == 0 and data.size):
        raise SourceError(
            f"{data.uri}: {data.size} bytes do not fit {idx.uri}, which holds "
            f"{n} sequences of {header.dtype.name} tokens"
        )
    if n == 0:
        return []
    # Sequences per chunk from the average size: deterministic from the listing and the header.
    per = max(1, chunk_bytes * n // data.size) if data.size else n
    return [
        Chunk(
            idx,
            "megatron",
            "",
            s,
            min(s + per, n),
            nbytes=12 * (min(s + per, n) - s) + data.size * (min(s + per, n) - s) // n,
            companion=data,
        )
        for s in range(0, n, per)
    ]


def plan_chunks(
    objects: list[tuple[ObjectInfo, SourceSpec]],
    chunk_bytes: int,
    storage: ObjectStorage | None = None,
) -> list[Chunk]:
    """Chunks of every source object, in URI order, small ones grouped (see the module's
    docstring); empty objects contribute none."""
    storage = storage or local_storage()
    grouper = _Grouper(chunk_bytes)
    for obj, spec in sorted(objects, key=lambda pair: pair[0].uri):
        kind = source_kind(obj.uri, spec.format, spec.token_field)
        if kind == "megatron":  # an empty .idx is corrupt, not empty: it has no header
            grouper.alone(_megatron_chunks(storage.for_uri(obj.uri), obj, chunk_bytes))
            continue
        if obj.size == 0:
            continue
        reading = (
            obj.uri.split("://", 1)[0] if "://" in obj.uri else "file",
            kind,
            spec.format,
            spec.text_field,
            spec.token_field,
        )
        if kind in ("parquet", "parquet-tokens"):
            groups = _parquet_chunks(storage.for_uri(obj.uri), obj, spec)
            # A group crosses into another file only from a file of small row groups alone.
            whole = all(c.raw_bytes < chunk_bytes for c in groups)
            if not whole:
                grouper.flush()
            for c in groups:
                if c.raw_bytes < chunk_bytes:
                    grouper.add(c, reading)
                else:
                    grouper.alone([c])
            if not whole:
                grouper.flush()
        elif obj.size >= chunk_bytes:
            if kind == "jsonl":
                grouper.alone(
                    Chunk(obj, kind, spec.text_field, s, min(s + chunk_bytes, obj.size))
                    for s in range(0, obj.size, chunk_bytes)
                )
            else:
                grouper.alone([Chunk(obj, kind, spec.text_field, 0, obj.size, nbytes=obj.size)])
        else:  # the whole object, in one range (plain) or one stream (compressed)
            nbytes = 0 if kind == "jsonl" else obj.size
            grouper.add(Chunk(obj, kind, spec.text_field, 0, obj.size, nbytes=nbytes), reading)
    return grouper.done()


class _Grouper:
    """Collects planned chunks, grouping consecutive small ones of one reading while their
    running size stays <= chunk_bytes; a group of one is the simple chunk itself (its key, and
    so an existing store's chunk, unchanged)."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.chunks: list[Chunk] = []
        self._pending: list[Chunk] = []
        self._reading: tuple | None = None
        self._bytes = 0

    def add(self, chunk: Chunk, reading: tuple) -> None:
        size = chunk.raw_bytes
        if self._pending and (reading != self._reading or self._bytes + size > self.chunk_bytes):
            self.flush()
        self._pending.append(chunk)
        self._reading, self._bytes = reading, self._bytes + size

    def alone(self, chunks) -> None:
        self.flush()
        self.chunks.extend(chunks)

    def flush(self) -> None:
        if len(self._pending) > 1:
            self.chunks.append(Chunk.group(self._pending))
        else:
            self.chunks.extend(self._pending)
        self._pending, self._reading, self._bytes = [], None, 0

    def done(self) -> list[Chunk]:
        self.flush()
        return self.chunks
