"""A chunk: the unit of fetching, tokenizing, caching and packing, and its content address.

How chunks are planned from a listing is chunks.py's business (and each layout's module's:
mds.py, arrowfiles.py, wds.py); this module holds only what a chunk is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tokenfeed.server.objstore.objects import ObjectInfo

# Bump when the bytes a chunk produces could change for the same inputs.
CHUNK_FORMAT_VERSION = 2
KINDS = (
    *("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "parquet-tokens", "megatron"),
    *("mds", "mds-tokens", "arrow", "arrow-tokens", "tar", "tar.gz"),
)


@dataclass(frozen=True)
class Chunk:
    source: ObjectInfo  # of a group: its first part's
    # "jsonl" | "jsonl.gz" | "jsonl.zst" | "parquet" | "parquet-tokens" | "megatron" | "mds" |
    # "mds-tokens" | "arrow" | "arrow-tokens" | "tar" | "tar.gz" (KINDS)
    kind: str
    # The column read (of token ids for the -tokens kinds); "" for megatron; of a tar, the
    # member read: its extension, and for a JSON member the field ("txt", "json:text").
    text_field: str
    # byte offset (jsonl, arrow and tar kinds), first row of the row group (parquet kinds),
    # first sequence (megatron), first sample (mds kinds); of a group: 0 and its number of parts
    start: int
    end: int  # exclusive: byte offset, row after the row group, sequence or sample after it
    # The row group (parquet kinds); the shard's position in its index.json (mds kinds).
    row_group: int = -1
    # Source bytes a read of the chunk needs (for a row group: its compressed column chunks;
    # for megatron: its .idx entries and its share of the .bin at the average sequence size;
    # for a group: its parts' together).
    nbytes: int = 0
    # An object read together with `source` and pinned like it: the .bin of a Megatron .idx,
    # the index.json of an MDS shard.
    companion: ObjectInfo | None = None
    # A group: the simple chunks it is made of, read in this order (records are numbered
    # across them, the first part's first). Empty for a simple chunk.
    parts: tuple[Chunk, ...] = ()
    # Byte ranges of an Arrow stream's record batches or a tar's samples: the object's row or
    # sample the range starts with (for locations); -1 for every other kind.
    first_record: int = -1

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
        if self.kind in ("mds", "mds-tokens"):
            return (
                f"{self.source.uri} (samples {self.start}-{self.end}, column {self.text_field!r})"
            )
        if self.first_record >= 0:
            what = "rows" if self.kind.startswith("arrow") else "samples"
            return (
                f"{self.source.uri} (bytes {self.start}-{self.end}, {what} from "
                f"{self.first_record})"
            )
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
        if self.first_record >= 0:  # likewise
            parts += ("first_record", self.first_record)
        text = "\x1f".join(map(str, parts)).encode()
        return hashlib.blake2b(text, digest_size=16).hexdigest()
