"""Chunk planning: the unit of fetching, tokenizing, caching and packing, known from a listing.

- plain JSON Lines: byte ranges [k*chunk_bytes, (k+1)*chunk_bytes); a chunk holds the lines that
  *start* inside its range (Hadoop's split rule), so boundaries need no scan of the data;
- compressed JSON Lines (.gz, .zst): the whole object, since a stream cannot be entered midway;
- Parquet: one chunk per row group (from the footer).
Sources are sorted by URI, so listing order never matters.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from tokenfeed.server.config import SourceSpec
from tokenfeed.server.errors import SourceError
from tokenfeed.server.storage import ObjectInfo, ObjectStore, Storage

# Bump when the bytes a chunk produces could change for the same inputs.
CHUNK_FORMAT_VERSION = 2

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass(frozen=True)
class Chunk:
    source: ObjectInfo
    kind: str  # "jsonl" | "jsonl.gz" | "jsonl.zst" | "parquet"
    text_field: str
    start: int  # byte offset (jsonl kinds) or first row of the row group (parquet)
    end: int  # exclusive byte offset, or row after the row group
    row_group: int = -1
    # Source bytes a read of the chunk needs (for a row group: its compressed column chunks).
    nbytes: int = 0

    @property
    def raw_bytes(self) -> int:
        return self.nbytes or self.end - self.start

    def describe(self) -> str:
        if self.kind == "parquet":
            return f"{self.source.uri} (row group {self.row_group}, rows {self.start}-{self.end})"
        return f"{self.source.uri} (bytes {self.start}-{self.end})"

    def key(self, tokenizer_digest: str) -> str:
        """Content address of this chunk's tokens: changes when any input that decides them does."""
        parts = (
            CHUNK_FORMAT_VERSION, self.source.uri, self.source.size, self.source.version,
            self.kind, self.text_field, self.start, self.end, self.row_group, tokenizer_digest,
        )  # fmt: skip
        text = "\x1f".join(map(str, parts)).encode()
        return hashlib.blake2b(text, digest_size=16).hexdigest()


def source_kind(uri: str, declared: str) -> str:
    name = uri.lower()
    compression = ""
    for suffix, comp in ((".gz", ".gz"), (".zst", ".zst"), (".zstd", ".zst")):
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], comp
            break
    if declared == "parquet" or (declared == "auto" and name.endswith(".parquet")):
        if compression:
            raise SourceError(f"{uri}: Parquet files compress internally; got {compression}")
        return "parquet"
    if declared == "jsonl" or name.endswith(_JSONL_SUFFIXES):
        return "jsonl" + compression
    raise SourceError(
        f"{uri}: cannot tell the format from the name; expected .jsonl[.gz|.zst] or .parquet, "
        "or set format: jsonl|parquet on the source"
    )


def _parquet_chunks(store: ObjectStore, obj: ObjectInfo, spec: SourceSpec) -> list[Chunk]:
    # Row groups are read whole from the footer's offsets; only the text column is decoded.
    try:
        with store.open(obj) as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{obj.uri}: not a readable Parquet file: {e}") from e
    if spec.text_field not in schema.names:
        raise SourceError(
            f"{obj.uri}: no column {spec.text_field!r} (columns: {schema.names}); "
            "set text_field on the source"
        )
    kind = schema.field(spec.text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)):  # fmt: skip
        raise SourceError(f"{obj.uri}: column {spec.text_field!r} is {kind}, expected a string")
    chunks, row = [], 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        n = group.num_rows
        size = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        chunks.append(Chunk(obj, "parquet", spec.text_field, row, row + n, g, size))
        row += n
    return chunks


def plan_chunks(
    objects: list[tuple[ObjectInfo, SourceSpec]], chunk_bytes: int, storage: Storage | None = None
) -> list[Chunk]:
    """Chunks of every source object, in URI order; empty objects contribute none."""
    storage = storage or Storage()
    chunks: list[Chunk] = []
    for obj, spec in sorted(objects, key=lambda pair: pair[0].uri):
        kind = source_kind(obj.uri, spec.format)
        if obj.size == 0:
            continue
        if kind == "parquet":
            chunks.extend(_parquet_chunks(storage.for_uri(obj.uri), obj, spec))
        elif kind == "jsonl":
            chunks.extend(
                Chunk(obj, kind, spec.text_field, s, min(s + chunk_bytes, obj.size))
                for s in range(0, obj.size, chunk_bytes)
            )
        else:
            chunks.append(Chunk(obj, kind, spec.text_field, 0, obj.size, nbytes=obj.size))
    return chunks
