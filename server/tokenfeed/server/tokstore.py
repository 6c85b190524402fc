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
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tokenfeed.server.cache import DiskCache, Kind
from tokenfeed.server.diskfiles import write_atomic
from tokenfeed.server.errors import StoreCorruptError

log = logging.getLogger(__name__)

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
# Megatron-LM's dtype codes for the .idx header.
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MANIFEST_VERSION = 2


@dataclass(frozen=True)
class PartStart:
    """Where one part of a grouped chunk (chunks.py) keeps its records: how many it read (good
    or bad; record ids count on from the parts before it) and the byte offset of its first
    record in its object."""

    records: int
    data_start: int = 0


# Where a chunk's records start: the byte offset of its first record in its object (a simple
# chunk), or per part (a group).
DataStart = int | tuple[PartStart, ...]


class Provenance(NamedTuple):
    """What locating a chunk's documents in their sources needs (readers.locate_record)."""

    record_ids: np.ndarray  # per document: its index among the chunk's records
    data_start: DataStart


@dataclass(frozen=True)
class ChunkIndex:
    """A chunk's manifest: what the index of a job is computed from."""

    key: str
    num_docs: int
    num_tokens: int
    records: int
    bad: dict[str, int]
    bad_examples: list[str]
    digest: str  # of the chunk's .bin and .idx content
    body_bytes: int  # of its .bin, .idx and .rec files: what it takes in the cache


@dataclass(frozen=True)
class TokenChunk:
    """A chunk's tokens, memory-mapped, and its documents' token offsets and lengths."""

    tokens: np.ndarray
    doc_offsets: np.ndarray  # int64, in tokens
    doc_lengths: np.ndarray  # int32


def encode_idx(lengths: np.ndarray, dtype: np.dtype) -> bytes:
    n = len(lengths)
    pointers = np.zeros(n, dtype=np.int64)
    if n > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    header = IDX_MAGIC + struct.pack("<Q", IDX_VERSION) + struct.pack("<B", DTYPE_CODES[dtype])
    counts = struct.pack("<QQ", n, n + 1)
    doc_idx = np.arange(n + 1, dtype=np.int64)
    return b"".join(
        [
            header,
            counts,
            lengths.astype("<i4").tobytes(),
            pointers.astype("<i8").tobytes(),
            doc_idx.astype("<i8").tobytes(),
        ]
    )


def decode_idx(raw: bytes | memoryview) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, document lengths, document byte pointers) from an .idx file's bytes."""
    if len(raw) < 34 or bytes(raw[:9]) != IDX_MAGIC:
        raise StoreCorruptError("not a Megatron .idx file (bad magic or short header)")
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n, _docs = struct.unpack_from("<QQ", raw, 18)
    if version != IDX_VERSION or code not in CODE_DTYPES:
        raise StoreCorruptError(f".idx version {version} dtype code {code} not supported")
    if len(raw) != 34 + 12 * n + 8 * _docs:
        raise StoreCorruptError(f".idx of {len(raw)} bytes does not hold {n} documents")
    lengths = np.frombuffer(raw, dtype="<i4", count=n, offset=34)
    pointers = np.frombuffer(raw, dtype="<i8", count=n, offset=34 + 4 * n)
    return CODE_DTYPES[code], lengths, pointers


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk's four files as bytes: what is written to the cache and published to a shared
    store. Deterministic: the same inputs give the same bytes on every node."""

    key: str
    bin: bytes
    idx: bytes
    rec: bytes
    manifest_bytes: bytes
    manifest: dict

    @property
    def body_bytes(self) -> int:
        return len(self.bin) + len(self.idx) + len(self.rec)

    def verified(self) -> bool:
        m = self.manifest
        return (
            len(self.bin) == m["bin_bytes"]
            and len(self.idx) == m["idx_bytes"]
            and len(self.rec) == m["rec_bytes"]
            and _blake(self.bin) == m["bin_blake2b"]
            and _blake(self.idx) == m["idx_blake2b"]
            and _blake(self.rec) == m["rec_blake2b"]
        )


def _blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def encode_chunk(
    key: str,
    tokens: np.ndarray,
    lengths: np.ndarray,
    records: int,
    bad: dict[str, int],
    bad_examples: list[str],
    source: str,
    record_ids: np.ndarray | None = None,
    data_start: DataStart = 0,
) -> EncodedChunk:
    bin_bytes = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()
    idx_bytes = encode_idx(lengths, tokens.dtype)
    if record_ids is None:
        record_ids = np.arange(len(lengths), dtype=np.int64)
    rec_bytes = np.asarray(record_ids, dtype="<i8").tobytes()
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "key": key,
        "source": source,
        "num_docs": int(len(lengths)),
        "num_tokens": int(len(tokens)),
        "records": records,
        "dtype": tokens.dtype.name,
        "bad_records": bad,
        "bad_examples": bad_examples,
        "bin_bytes": len(bin_bytes),
        "idx_bytes": len(idx_bytes),
        "rec_bytes": len(rec_bytes),
        "data_start": data_start,
        "bin_blake2b": _blake(bin_bytes),
        "idx_blake2b": _blake(idx_bytes),
        "rec_blake2b": _blake(rec_bytes),
    }
    if isinstance(data_start, tuple):  # a group: records and data_start per part
        if len(data_start) < 2 or sum(part.records for part in data_start) != records:
            raise ValueError(
                f"token chunk {key}: a group's parts ({len(data_start)}) must be "
                f"two or more, their records adding up to {records}"
            )
        manifest["data_start"] = 0
        # Two arrays, not an object per part: a manifest of thousands of parts stays small.
        manifest["parts"] = {
            "records": [part.records for part in data_start],
            "data_start": [part.data_start for part in data_start],
        }
    meta_bytes = json.dumps(manifest, indent=1).encode()
    return EncodedChunk(key, bin_bytes, idx_bytes, rec_bytes, meta_bytes, manifest)


def parse_manifest(key: str, raw: bytes) -> dict:
    """A manifest's content, checked for consistency; StoreCorruptError if it is not one."""
    try:
        m = json.loads(raw)
    except ValueError:
        m = None
    if not TokenStore._consistent(m) or m.get("key") != key:
        raise StoreCorruptError(f"token chunk {key}: unreadable or inconsistent manifest")
    return m


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
        self.cache = cache if cache is not None else DiskCache(root, 2**62)
        self.root = self.cache.root / "tokens"
        self.root.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()
        # Without `scan` (the worker processes of `tokenfeed build`, whose parent scanned),
        # nothing is removed: another process's temporary files are its writes in progress.
        manifests, bodies = self._scan() if scan else ([], [])
        self.cache.register(Kind("manifest", lambda: manifests, self._delete_all, False))
        self.cache.register(Kind("chunk", lambda: bodies, self._delete_body))

    def _paths(self, key: str) -> tuple[Path, Path, Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}.bin", d / f"{key}.idx", d / f"{key}.rec", d / f"{key}.json"

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
                bodies.append((key, _body_bytes(m)))
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
            _body_bytes(m),
        )

    @staticmethod
    def _consistent(m: object) -> bool:
        """The manifest's counts agree with its file sizes (the digests vouch for the files)."""
        try:
            n, t = m["num_docs"], m["num_tokens"]
            itemsize = np.dtype(m["dtype"]).itemsize
            return (
                m["manifest_version"] == MANIFEST_VERSION
                and m["bin_bytes"] == t * itemsize
                and m["idx_bytes"] == 34 + 12 * n + 8 * (n + 1)
                and m["rec_bytes"] == 8 * n
                and isinstance(m["bad_records"], dict)
                and isinstance(m["bad_examples"], list)
                and all(
                    isinstance(m[k], str) for k in ("bin_blake2b", "idx_blake2b", "rec_blake2b")
                )
                and ("parts" not in m or _parts_consistent(m["parts"], m["records"]))
            )
        except (TypeError, KeyError, ValueError):
            return False

    def _read_manifest(self, path: Path) -> dict | None:
        try:
            m = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        return m if self._consistent(m) else None

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
        return not self._paths(key)[0].exists()

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


class ChunkMissing(Exception):
    """The chunk's body is not in the cache (evicted, or never built): build it."""


def _parts_consistent(parts: object, records: int) -> bool:
    """A group's `parts`: records and data_start of two or more parts, whole and non-negative,
    the records adding up to the chunk's."""
    if not isinstance(parts, dict):
        return False
    counts, starts = parts.get("records"), parts.get("data_start")
    return (
        isinstance(counts, list)
        and isinstance(starts, list)
        and len(counts) == len(starts) > 1
        and all(type(v) is int and v >= 0 for v in counts + starts)
        and sum(counts) == records
    )


def manifest_data_start(m: dict) -> DataStart:
    """A manifest's `data_start`, or its `parts` (a group's; manifests before groups have
    none)."""
    if "parts" in m:
        parts = m["parts"]
        return tuple(
            PartStart(n, s) for n, s in zip(parts["records"], parts["data_start"], strict=True)
        )
    return int(m["data_start"])


def _body_bytes(m: dict) -> int:
    return m["bin_bytes"] + m["idx_bytes"] + m["rec_bytes"]


class StoreView(TokenStore):
    """A serving worker's read-only view of the supervisor's token store (control.py): the
    same files, never written, scanned or evicted here. A body is present when its files are
    complete on disk; the supervisor makes it so on request. A mapped body stays readable
    after the supervisor evicts it (the kernel keeps unlinked files while they are mapped);
    `forget_gone` lets the worker drop such mappings so their disk space is freed."""

    def __init__(self, root: str | Path):
        super().__init__(root, DiskCache(root, 2**62), scan=False)

    def has_body(self, key: str) -> bool:
        m = self._manifest(key)
        return m is not None and self._body_complete(key, m)

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

    put_manifest = put_encoded  # type: ignore[assignment]
