"""The token store: one Megatron-compatible `.bin`/`.idx` pair per chunk, the record index of
each document (`.rec`, for provenance), and a `.json` manifest.

The format is specified in docs/token-store.md; numpy alone reads it. Layout under the cache
directory: `tokens/<key[:2]>/<key>.{bin,idx,rec,json}` where key is `Chunk.key(tokenizer
digest)`. The three body files are one evictable cache entry; the manifest is kept, so a job's
index (documents and tokens per chunk) survives evictions and restarts, and an evicted body is
rebuilt when it is next needed (tokenization is deterministic: the rebuilt digests are checked).

Crash safety: each file is written to a temporary name, flushed, fsynced and renamed; the
manifest is renamed last and is the commit point. On start the store rescans itself: temporary
files, bodies without a manifest, and bodies whose sizes disagree with their manifest are
removed. BLAKE2b digests are checked on the first open of a body in a process; a mismatch drops
the body, which is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenfeed.server.diskcache.cache import DiskCache, Kind
from tokenfeed.server.diskcache.diskfiles import write_atomic
from tokenfeed.server.errors import ChunkMissing, StoreCorruptError
from tokenfeed.server.source.provenance import DataStart, Provenance
from tokenfeed.server.store.chunkfiles import (
    ChunkIndex,
    EncodedChunk,
    body_bytes,
    consistent,
    decode_idx,
    encode_chunk,
    manifest_data_start,
    parse_manifest,
)
from tokenfeed.server.store.shardfiles import ShardIndexFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenChunk:
    """A chunk's tokens, memory-mapped, and its documents' token offsets and lengths."""

    tokens: np.ndarray
    doc_offsets: np.ndarray  # int64, in tokens
    doc_lengths: np.ndarray  # int32


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(2**22):
            h.update(block)
    return h.hexdigest()


class TokenStore:
    """Token chunks in the disk cache: bodies (`chunk` entries, evictable) and manifests
    (`manifest` entries, kept: the index of every job is computed from them)."""

    def __init__(self, root: str | Path, cache: DiskCache | None = None, scan: bool = True):
        # Without a cache (tools, tests), an unbounded one over the same directory.
        self.cache = cache if cache is not None else DiskCache.unbounded(root)
        self.root = self.cache.root / "tokens"
        self.root.mkdir(parents=True, exist_ok=True)
        self._root_str = str(self.root)
        self._verified: set[str] = set()
        # Without `scan` (the worker processes of `tokenfeed build`, whose parent scanned),
        # nothing is removed: another process's temporary files are its writes in progress.
        manifests, bodies = self._scan() if scan else ([], [])
        self.cache.register(Kind("manifest", lambda: manifests, self._delete_all, False))
        self.cache.register(Kind("chunk", lambda: bodies, self._delete_body))
        # Tar and Arrow shards' indexes, built once per shard version (source/shardindex.py).
        self.shard_indexes = ShardIndexFiles(self.cache, scan)

    def _stem(self, key: str) -> str:
        """A chunk's files without their suffix (a str: `gone` looks per layout)."""
        return f"{self._root_str}/{key[:2]}/{key}"

    def _paths(self, key: str) -> tuple[Path, Path, Path, Path]:
        stem = self._stem(key)
        return Path(f"{stem}.bin"), Path(f"{stem}.idx"), Path(f"{stem}.rec"), Path(f"{stem}.json")

    def _scan(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """The rescan on start: complete manifests, and bodies whose files match them; partial
        writes and orphans are removed."""
        for stale in self.root.glob("*/*.tmp"):
            log.info("removing partial write %s", stale)
            stale.unlink(missing_ok=True)
        manifests, bodies, keep = [], [], set()
        for meta_path in self.root.glob("*/*.json"):
            key = meta_path.stem
            m = self._read_manifest(meta_path)
            if m is None or m.get("key") != key:
                log.warning("dropping token chunk %s: unreadable or inconsistent manifest", key)
                self._delete_all(key)
                continue
            keep.add(key)
            manifests.append((key, meta_path.stat().st_size))
            if self._body_complete(key, m):
                bodies.append((key, body_bytes(m)))
            else:
                self._delete_body(key)
        for path in self.root.glob("*/*.*"):
            if path.stem not in keep and path.suffix in (".bin", ".idx", ".rec"):
                path.unlink(missing_ok=True)  # a body whose manifest never landed
        return manifests, bodies

    def _body_complete(self, key: str, m: dict) -> bool:
        bin_path, idx_path, rec_path, _ = self._paths(key)
        try:
            return (
                bin_path.stat().st_size == m["bin_bytes"]
                and idx_path.stat().st_size == m["idx_bytes"]
                and rec_path.stat().st_size == m["rec_bytes"]
            )
        except OSError:
            return False

    def put(
        self,
        key: str,
        tokens: np.ndarray,
        lengths: np.ndarray,
        records: int,
        bad: dict[str, int],
        bad_examples: list[str],
        source: str,
        record_ids: np.ndarray | None = None,
        data_start: DataStart = 0,
    ) -> ChunkIndex:
        return self.put_encoded(
            encode_chunk(
                key, tokens, lengths, records, bad, bad_examples, source, record_ids, data_start
            )
        )

    def put_encoded(self, chunk: EncodedChunk, body: bool = True) -> ChunkIndex:
        """Store an encoded chunk: its manifest always, its body if `body` and the cache
        admits it (a body needed later than everything it would displace is not kept:
        Belady's bypass; the manifest is, so the index is complete and the body is rebuilt or
        fetched when it is due)."""
        key = chunk.key
        bin_path, idx_path, rec_path, meta_path = self._paths(key)
        size = chunk.body_bytes
        keep = body and self.cache.admits(("chunk", key), size)
        with self.cache.reserving(size * keep + len(chunk.manifest_bytes), f"token chunk {key}"):
            if keep:
                write_atomic(bin_path, chunk.bin)
                write_atomic(idx_path, chunk.idx)
                write_atomic(rec_path, chunk.rec)
            write_atomic(meta_path, chunk.manifest_bytes)  # the commit point
            self.cache.commit("manifest", key, len(chunk.manifest_bytes))
            if keep:
                self._verified.add(key)
                self.cache.commit("chunk", key, size)
        return self._index(chunk.manifest)

    def put_manifest(self, key: str, manifest_bytes: bytes) -> ChunkIndex:
        """Store a chunk's manifest alone (read from a shared store): the index needs only it;
        the body is fetched when it is first read."""
        m = parse_manifest(key, manifest_bytes)
        meta_path = self._paths(key)[3]
        with self.cache.reserving(len(manifest_bytes), f"token chunk {key} manifest"):
            write_atomic(meta_path, manifest_bytes)
            self.cache.commit("manifest", key, len(manifest_bytes))
        return self._index(m)

    def encoded(self, key: str) -> EncodedChunk | None:
        """The chunk's stored files, to publish (None without a complete, verified body)."""
        m = self._manifest(key)
        if m is None or not self.has_body(key):
            return None
        bin_path, idx_path, rec_path, meta_path = self._paths(key)
        try:
            chunk = EncodedChunk(
                key,
                bin_path.read_bytes(),
                idx_path.read_bytes(),
                rec_path.read_bytes(),
                meta_path.read_bytes(),
                m,
            )
        except FileNotFoundError:
            return None
        return chunk if chunk.verified() else None

    @staticmethod
    def _index(m: dict) -> ChunkIndex:
        return ChunkIndex(
            m["key"],
            m["num_docs"],
            m["num_tokens"],
            m["records"],
            m["bad_records"],
            m["bad_examples"],
            f"{m['bin_blake2b']}:{m['idx_blake2b']}",
            body_bytes(m),
        )

    def _read_manifest(self, path: Path) -> dict | None:
        try:
            m = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        return m if consistent(m) else None

    def _manifest(self, key: str) -> dict | None:
        path = self._paths(key)[3]
        if not path.exists():
            return None
        m = self._read_manifest(path)
        if m is None:
            self.drop(key, "unreadable or inconsistent manifest")
        return m

    def get_index(self, key: str) -> ChunkIndex | None:
        """The chunk's manifest if it was ever stored whole (its body may since be evicted)."""
        m = self._manifest(key)
        return None if m is None else self._index(m)

    def has_body(self, key: str) -> bool:
        return self.cache.contains("chunk", key)

    def has_bodies(self, keys: Iterable[str]) -> bool:
        """Whether every one of these chunks' bodies is present (one look at the cache)."""
        return self.cache.contains_all("chunk", keys)

    def provenance(self, key: str) -> Provenance:
        """(record index of each document, where the chunk's records start: the byte offset of
        its first record, or a `PartStart` per part of a group): what readers.locate_record
        needs."""
        m = self._manifest(key)
        if m is None or not self.has_body(key):
            raise StoreCorruptError(f"token chunk {key} is missing or incomplete")
        rec_path = self._paths(key)[2]
        return Provenance(np.fromfile(rec_path, dtype="<i8"), manifest_data_start(m))

    def open(self, key: str) -> TokenChunk:
        """The chunk's tokens, memory-mapped."""
        m = self._manifest(key)
        if m is None or not self.cache.lookup("chunk", key, count=False):
            raise ChunkMissing(f"token chunk {key} is not in the cache")
        return self._map(key, m)

    def _map(self, key: str, m: dict) -> TokenChunk:
        """Check (sizes on every open, digests once per process) and map a chunk's body."""
        bin_path, idx_path, rec_path, _ = self._paths(key)
        if not self._body_complete(key, m):  # sizes on every open, digests once
            self.drop(key, "files disagree with the manifest's sizes", body_only=True)
            raise StoreCorruptError(f"token chunk {key} files disagree with its manifest")
        if key not in self._verified:
            digests = (_digest(bin_path), _digest(idx_path), _digest(rec_path))
            if digests != (m["bin_blake2b"], m["idx_blake2b"], m["rec_blake2b"]):
                self.drop(key, "checksum mismatch", body_only=True)
                raise StoreCorruptError(f"token chunk {key} failed its checksum and was dropped")
            self._verified.add(key)
        try:
            dtype, lengths, pointers = decode_idx(idx_path.read_bytes())
        except FileNotFoundError:
            raise ChunkMissing(f"token chunk {key} was evicted while opening") from None
        if len(lengths) != m["num_docs"] or int(lengths.sum()) != m["num_tokens"]:
            self.drop(key, "index disagrees with the manifest", body_only=True)
            raise StoreCorruptError(f"token chunk {key} index disagrees with its manifest")
        tokens = np.zeros(0, dtype=dtype)
        if m["num_tokens"]:
            with open(bin_path, "rb") as f:
                # A plain read-only ndarray over the mapping: np.memmap's subclass overhead
                # shows up on every row gather.
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            tokens = np.frombuffer(mapped, dtype=dtype.newbyteorder("<"))
        return TokenChunk(tokens, pointers // dtype.itemsize, lengths)

    def forget_verified(self, key: str) -> None:
        """The next open of the chunk checks its digests again."""
        self._verified.discard(key)

    def gone(self, key: str) -> bool:
        """The body's files were removed (evicted) since they were mapped."""
        return not os.path.exists(f"{self._stem(key)}.bin")

    def drop(self, key: str, why: str, body_only: bool = False) -> None:
        """Remove a corrupt chunk: its body, or everything (then it is re-tokenized)."""
        log.warning("dropping token chunk %s: %s", key, why)
        self.cache.remove("chunk", key, why)
        if not body_only:
            self.cache.remove("manifest", key, why)

    def _delete_body(self, key: str) -> None:
        self._verified.discard(key)
        for path in self._paths(key)[:3]:
            path.unlink(missing_ok=True)

    def _delete_all(self, key: str) -> None:
        """The manifest first: without it the body is an orphan, removed on the next scan."""
        self._verified.discard(key)
        for path in reversed(self._paths(key)):
            path.unlink(missing_ok=True)


class TokenStoreView(TokenStore):
    """A serving worker's read-only view of the supervisor's token store (control.py): the
    same files, never written, scanned or evicted here. A body is present when its files are
    complete on disk; the supervisor makes it so on request. A mapped body stays readable
    after the supervisor evicts it (the kernel keeps unlinked files while they are mapped);
    `forget_gone` lets the worker drop such mappings so their disk space is freed."""

    def __init__(self, root: str | Path):
        super().__init__(root, DiskCache.unbounded(root), scan=False)

    def has_body(self, key: str) -> bool:
        m = self._manifest(key)
        return m is not None and self._body_complete(key, m)

    def has_bodies(self, keys: Iterable[str]) -> bool:
        return all(self.has_body(key) for key in keys)

    def open(self, key: str) -> TokenChunk:
        m = self._manifest(key)
        if m is None or not self._body_complete(key, m):
            raise ChunkMissing(f"token chunk {key} is not in the cache")
        try:
            return self._map(key, m)
        except FileNotFoundError:
            raise ChunkMissing(f"token chunk {key} was evicted while opening") from None

    def drop(self, key: str, why: str, body_only: bool = False) -> None:
        """Corrupt files are the owner's to remove; here they are only forgotten (the next
        open asks the supervisor, which verifies and rebuilds)."""
        log.warning("token chunk %s: %s (left to the supervisor)", key, why)
        self._verified.discard(key)

    def put_encoded(self, chunk: EncodedChunk, body: bool = True) -> ChunkIndex:
        raise StoreCorruptError("a serving worker never writes the token store")

    def put_manifest(self, key: str, manifest_bytes: bytes) -> ChunkIndex:
        raise StoreCorruptError("a serving worker never writes the token store")
