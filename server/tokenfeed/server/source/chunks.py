"""Chunk planning: the unit of fetching, tokenizing, caching and packing, known from a listing.

- plain JSON Lines: byte ranges [k*chunk_bytes, (k+1)*chunk_bytes); a chunk holds the lines that
  *start* inside its range (Hadoop's split rule), so boundaries need no scan of the data;
- compressed JSON Lines (.gz, .zst): the whole object, since a stream cannot be entered midway;
- Parquet: one chunk per row group (from the footer), of text or of token ids (`token_field`);
- Megatron-LM indexed datasets (an `.idx` and the `.bin` beside it): runs of consecutive
  sequences holding about `chunk_bytes` of tokens on average, from the listing and the 34-byte
  `.idx` header alone (the rest of an `.idx` is 12 bytes per sequence: gigabytes, not read here);
- MDS shards (mds.py): runs of samples of about `chunk_bytes` from index.json alone; a
  compressed shard whole;
- Arrow stream files (arrowfiles.py) and plain tars (wds.py): runs of record batches or whole
  samples of about `chunk_bytes`, from a walk over their headers kept in the token store
  (shardindex.py); a compressed tar whole.
Which objects are read, and as what, is layouts.py's (directory layouts: MDS, save_to_disk, Hub
repositories). Sources are sorted by URI, so listing order never matters.

Small objects are grouped: every chunk costs four store files, a manifest, its bookkeeping and at
least one GET, so consecutive sources (in URI order) smaller than `chunk_bytes`, of one kind and
one reading (`format`, the field or member read, URI scheme), form one chunk of up to
`chunk_bytes` (the running size stays <= chunk_bytes). Likewise consecutive small row groups of
one Parquet file, and of consecutive Parquet files whose row groups are all small. A group is a
`Chunk` whose `parts` are the chunks it replaces, read one after another; an object of
`chunk_bytes` or more, a large row group and runs cut from a large object (already about
`chunk_bytes` each) are planned alone, as before.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.objstore.storage import ObjectStorage, local_storage
from tokenfeed.server.settings.config import SourceSpec
from tokenfeed.server.source import arrowfiles, mds, wds
from tokenfeed.server.source.chunk import CHUNK_FORMAT_VERSION, KINDS, Chunk
from tokenfeed.server.source.columns import is_text, is_token_list
from tokenfeed.server.source.layouts import Reading, resolve, source_kind
from tokenfeed.server.source.megatron import megatron_bin, megatron_header
from tokenfeed.server.source.shardindex import MemoryIndexes, ShardIndexes

__all__ = ["CHUNK_FORMAT_VERSION", "KINDS", "Chunk", "is_token_list", "plan_chunks", "source_kind"]


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
    if not tokens and not is_text(kind):
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
    indexes: ShardIndexes | None = None,
) -> list[Chunk]:
    """Chunks of every source object, in URI order, small ones grouped (see the module's
    docstring); empty objects contribute none. `indexes` keeps the tar and Arrow shards'
    indexes (the token store's; else this call's own)."""
    storage = storage or local_storage()
    indexes = indexes if indexes is not None else MemoryIndexes()
    grouper = _Grouper(chunk_bytes)
    for r in resolve(objects, storage):
        obj, spec, kind = r.obj, r.spec, r.kind
        store = storage.for_uri(obj.uri)
        if kind == "megatron":  # an empty .idx is corrupt, not empty: it has no header
            grouper.alone(_megatron_chunks(store, obj, chunk_bytes))
            continue
        if obj.size == 0:
            continue
        field = spec.text_field if spec.token_field is None else spec.token_field
        if kind == "tar" or kind == "tar.gz":
            field = wds.reading(spec.member, spec.text_field)
        reading = (
            obj.uri.split("://", 1)[0] if "://" in obj.uri else "file",
            kind,
            spec.format,
            field,
        )
        if kind in ("parquet", "parquet-tokens"):
            _add_runs(grouper, _parquet_chunks(store, obj, spec), reading, chunk_bytes, True)
        elif kind in ("mds", "mds-tokens", "arrow", "arrow-tokens", "tar", "tar.gz"):
            _add_runs(
                grouper,
                _layout_chunks(r, field, chunk_bytes, storage, indexes),
                reading,
                chunk_bytes,
                False,
            )
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


def _layout_chunks(
    r: Reading, field: str, chunk_bytes: int, storage: ObjectStorage, indexes: ShardIndexes
) -> list[Chunk]:
    store, tokens = storage.for_uri(r.obj.uri), r.spec.token_field is not None
    if r.shard is not None:
        return mds.plan(r.shard, r.obj, field, tokens, chunk_bytes)
    if r.kind.startswith("arrow"):
        return arrowfiles.plan(store, r.obj, field, tokens, chunk_bytes, indexes)
    return wds.plan(store, r.obj, field, chunk_bytes, indexes)


def _add_runs(
    grouper: _Grouper, chunks: list[Chunk], reading: tuple, chunk_bytes: int, across: bool
) -> None:
    """An object's chunks: small ones grouped. Parquet row groups group within a file, and
    across files only from a file of small row groups alone (`across`); the runs of a layout
    group across objects only when the object is one small chunk."""
    whole = all(c.raw_bytes < chunk_bytes for c in chunks) and (across or len(chunks) == 1)
    if not whole:
        grouper.flush()
    for c in chunks:
        if c.raw_bytes < chunk_bytes and (across or whole):
            grouper.add(c, reading)
        else:
            grouper.alone([c])
    if not whole:
        grouper.flush()


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
