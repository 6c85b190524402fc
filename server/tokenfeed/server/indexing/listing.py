"""A dataset's chunks planned from a listing of its sources, and what they are made from (the
record a shared store keeps, and the raw bytes a build holds in the cache at once)."""

from __future__ import annotations

from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectInfo
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.settings.config import DatasetSpec, SourceSpec
from tokenfeed.server.source.chunks import CHUNK_FORMAT_VERSION, Chunk, plan_chunks
from tokenfeed.server.source.shardindex import ShardIndexes


def list_chunks(
    name: str, dataset: DatasetSpec, storage: ObjectStorage, indexes: ShardIndexes | None = None
) -> list[Chunk]:
    """List the dataset's sources and plan its chunks (blocking: run it in a worker thread);
    `name` is the dataset as messages name it; `indexes` keeps the tar and Arrow shards'
    indexes (the token store's)."""
    objects: dict[str, tuple[ObjectInfo, SourceSpec]] = {}
    for source in dataset.sources:
        found = storage.for_uri(source.pattern).list(source.pattern)
        if not found:
            raise SourceError(f"job {name}: source {source.pattern!r} matched no objects")
        for obj in found:  # an object matched by two patterns is read once, as the first says
            objects.setdefault(obj.uri, (obj, source))
    chunks = plan_chunks(list(objects.values()), dataset.chunk_bytes, storage, indexes)
    if not chunks:
        raise SourceError(f"job {name}: every source object is empty")
    return chunks


def inputs(chunks: list[Chunk], tokenizer_digest: str, chunk_bytes: int) -> dict:
    """What a dataset's chunks are made from: recorded in a shared store, which refuses a
    dataset of the same name made from other inputs."""
    pieces = [p for c in chunks for p in c.pieces]  # every part of a group
    sources = {
        c.source.uri: [c.source.uri, c.source.size, c.source.version, c.kind, c.text_field]
        for c in pieces
    }
    for c in pieces:  # a Megatron .idx's .bin
        if c.companion is not None:
            sources[c.source.uri] += [c.companion.uri, c.companion.size, c.companion.version]
    return {
        "chunk_format": CHUNK_FORMAT_VERSION,
        "tokenizer_blake2b": tokenizer_digest,
        "chunk_bytes": chunk_bytes,
        "sources": [sources[u] for u in sorted(sources)],
    }


def raw_working_set(chunks: list[Chunk], block: int, parallel: int) -> int:
    """Cache bytes for the raw data of `parallel` chunks tokenized at once: their source bytes
    rounded out to blocks of `block` bytes (only for objects that are fetched into the cache);
    a group's per object, which holds no more blocks than its own size."""

    def need(c: Chunk) -> int:
        if not c.parts:
            return c.raw_bytes + 2 * block
        per_object: dict[ObjectInfo, int] = {}
        for p in c.parts:
            per_object[p.source] = per_object.get(p.source, 0) + p.raw_bytes
        return sum(min(n + 2 * block, o.size) for o, n in per_object.items())

    remote = [need(c) for c in chunks if c.source.uri.startswith("s3://")]
    if not remote:
        return 0
    return min(parallel, len(remote)) * max(remote)
