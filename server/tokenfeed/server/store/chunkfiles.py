"""A token chunk's files as bytes, and their checks: the Megatron-compatible `.bin`/`.idx`
pair, the record index (`.rec`) and the JSON manifest (docs/token-store.md). Pure: no disk,
no cache; tokstore.py keeps these files in the cache, sharedstore.py publishes them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenfeed.server.errors import StoreCorruptError
from tokenfeed.server.source.megatron import CODE_DTYPES, DTYPE_CODES, IDX_MAGIC, IDX_VERSION
from tokenfeed.server.source.provenance import DataStart, PartStart

MANIFEST_VERSION = 2


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
    if not consistent(m) or m.get("key") != key:
        raise StoreCorruptError(f"token chunk {key}: unreadable or inconsistent manifest")
    return m


def consistent(m: Any) -> bool:
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
            and all(isinstance(m[k], str) for k in ("bin_blake2b", "idx_blake2b", "rec_blake2b"))
            and ("parts" not in m or _parts_consistent(m["parts"], m["records"]))
        )
    except (TypeError, KeyError, ValueError):
        return False


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


def body_bytes(m: dict) -> int:
    return m["bin_bytes"] + m["idx_bytes"] + m["rec_bytes"]
