"""The token store: one Megatron-compatible `.bin`/`.idx` pair per chunk, plus a `.json` manifest.

The format is specified in docs/token-store.md; numpy alone reads it. Layout under the cache
directory: `tokens/<key[:2]>/<key>.{bin,idx,json}` where key is `Chunk.key(tokenizer digest)`.

Crash safety: each file is written to a temporary name, flushed, fsynced and renamed; the
manifest is renamed last and is the commit point. A chunk whose manifest is missing, or whose
files disagree with the manifest's sizes (on every open) or BLAKE2b digests (on the first open in
a process), is dropped and rebuilt. Stale temporary files are removed when the store opens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenfeed.server.errors import StoreCorruptError

log = logging.getLogger(__name__)

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
# Megatron-LM's dtype codes for the .idx header.
DTYPE_CODES = {
    np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
    np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}  # fmt: skip
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MANIFEST_VERSION = 1


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
        [header, counts, lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(),
         doc_idx.astype("<i8").tobytes()]
    )  # fmt: skip


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


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(2**22):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TokenStore:
    def __init__(self, root: str | Path):
        self.root = Path(root) / "tokens"
        self.root.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()
        for stale in self.root.glob("*/*.tmp"):
            log.info("removing partial write %s", stale)
            stale.unlink(missing_ok=True)

    def _paths(self, key: str) -> tuple[Path, Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}.bin", d / f"{key}.idx", d / f"{key}.json"

    def put(
        self, key: str, tokens: np.ndarray, lengths: np.ndarray, records: int,
        bad: dict[str, int], bad_examples: list[str], source: str,
        record_ids: np.ndarray | None = None, data_start: int = 0,
    ) -> ChunkIndex:  # fmt: skip
        bin_path, idx_path, meta_path = self._paths(key)
        bin_path.parent.mkdir(parents=True, exist_ok=True)
        bin_bytes = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()
        idx_bytes = encode_idx(lengths, tokens.dtype)
        _write_atomic(bin_path, bin_bytes)
        _write_atomic(idx_path, idx_bytes)
        manifest = {
            "manifest_version": MANIFEST_VERSION, "key": key, "source": source,
            "num_docs": int(len(lengths)), "num_tokens": int(len(tokens)), "records": records,
            "dtype": tokens.dtype.name, "bad_records": bad, "bad_examples": bad_examples,
            "bin_bytes": len(bin_bytes), "idx_bytes": len(idx_bytes),
            "data_start": data_start,
            # per document, its index among the chunk's records: provenance (Explain)
            "record_ids": [] if record_ids is None else [int(r) for r in record_ids],
            "bin_blake2b": hashlib.blake2b(bin_bytes, digest_size=16).hexdigest(),
            "idx_blake2b": hashlib.blake2b(idx_bytes, digest_size=16).hexdigest(),
        }  # fmt: skip
        _write_atomic(meta_path, json.dumps(manifest, indent=1).encode())
        self._verified.add(key)
        return self._index(manifest)

    @staticmethod
    def _index(m: dict) -> ChunkIndex:
        return ChunkIndex(
            m["key"], m["num_docs"], m["num_tokens"], m["records"], m["bad_records"],
            m["bad_examples"], f"{m['bin_blake2b']}:{m['idx_blake2b']}",
        )  # fmt: skip

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
                and isinstance(m["bad_records"], dict)
                and isinstance(m["bad_examples"], list)
                and all(isinstance(m[k], str) for k in ("bin_blake2b", "idx_blake2b"))
            )
        except (TypeError, KeyError, ValueError):
            return False

    def _manifest(self, key: str) -> dict | None:
        bin_path, idx_path, meta_path = self._paths(key)
        try:
            m = json.loads(meta_path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.drop(key, f"unreadable manifest: {e}")
            return None
        try:
            ok = (
                self._consistent(m)
                and bin_path.stat().st_size == m["bin_bytes"]
                and idx_path.stat().st_size == m["idx_bytes"]
            )
        except OSError:
            ok = False
        if not ok:
            self.drop(key, "files disagree with the manifest")
            return None
        return m

    def provenance(self, key: str) -> tuple[list[int], int]:
        """(record index of each document, byte offset of the chunk's first record)."""
        m = self._manifest(key)
        if m is None:
            raise StoreCorruptError(f"token chunk {key} is missing or incomplete")
        return m.get("record_ids", []), m.get("data_start", 0)

    def get_index(self, key: str) -> ChunkIndex | None:
        """The chunk's manifest if the chunk is stored whole; None if it must be (re)built."""
        m = self._manifest(key)
        return None if m is None else self._index(m)

    def open(self, key: str) -> TokenChunk:
        m = self._manifest(key)
        if m is None:
            raise StoreCorruptError(f"token chunk {key} is missing or incomplete")
        bin_path, idx_path, _ = self._paths(key)
        if key not in self._verified:
            if _digest(bin_path) != m["bin_blake2b"] or _digest(idx_path) != m["idx_blake2b"]:
                self.drop(key, "checksum mismatch")
                raise StoreCorruptError(f"token chunk {key} failed its checksum and was dropped")
            self._verified.add(key)
        dtype, lengths, pointers = decode_idx(idx_path.read_bytes())
        if len(lengths) != m["num_docs"] or int(lengths.sum()) != m["num_tokens"]:
            self.drop(key, "index disagrees with the manifest")
            raise StoreCorruptError(f"token chunk {key} index disagrees with its manifest")
        tokens = np.zeros(0, dtype=dtype)
        if m["num_tokens"]:
            with open(bin_path, "rb") as f:
                # A plain read-only ndarray over the mapping: np.memmap's subclass overhead
                # shows up on every row gather.
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            tokens = np.frombuffer(mapped, dtype=dtype.newbyteorder("<"))
        return TokenChunk(tokens, pointers // dtype.itemsize, lengths)

    def drop(self, key: str, why: str) -> None:
        log.warning("dropping token chunk %s: %s", key, why)
        self._verified.discard(key)
        for path in reversed(self._paths(key)):
            path.unlink(missing_ok=True)
