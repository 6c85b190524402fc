"""Megatron-LM indexed datasets (`.bin`/`.idx`, `MMIDIDX` version 1) for tests, written and read
from the published format (Megatron-LM's `megatron/core/datasets/indexed_dataset.py`, the
`_IndexWriter` and `_IndexReader` classes), with struct and numpy only: nothing here comes from
tokenfeed, so a test that pairs these with the server checks tokenfeed against the format.

.idx, little-endian: magic b"MMIDIDX\\x00\\x00", u64 version (1), u8 dtype code, u64 sequence
count N, u64 document count D, i32[N] sequence lengths (tokens), i64[N] sequence pointers (bytes
into .bin), i64[D] document indices (the first sequence of each document, then N).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
DTYPES = {code: dtype for dtype, code in CODES.items()}


def write(prefix: Path, docs: list, dtype, document_index: list[int] | None = None) -> Path:
    """`<prefix>.bin` and `<prefix>.idx` holding `docs` (one sequence each); the .idx path.

    `document_index` defaults to one document per sequence (0, 1, ..., N); Megatron's
    `--split-sentences` datasets group several sequences per document instead."""
    dtype = np.dtype(dtype)
    arrays = [np.asarray(d, dtype=dtype.newbyteorder("<")) for d in docs]
    lengths = np.array([len(a) for a in arrays], dtype="<i4")
    pointers = np.zeros(len(arrays), dtype="<i8")
    for i in range(1, len(arrays)):
        pointers[i] = pointers[i - 1] + lengths[i - 1] * dtype.itemsize
    doc_idx = np.asarray(
        range(len(arrays) + 1) if document_index is None else document_index, dtype="<i8"
    )
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    bin_path.write_bytes(b"".join(a.tobytes() for a in arrays))
    header = MAGIC + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype])
    header += struct.pack("<Q", len(arrays)) + struct.pack("<Q", len(doc_idx))
    idx_path.write_bytes(header + lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    return idx_path


def read(prefix: Path | str) -> list[np.ndarray]:
    """Every sequence of `<prefix>.bin`/`.idx`, as the format defines them."""
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[:9] == MAGIC, "bad magic"
    (version,) = struct.unpack("<Q", idx[9:17])
    assert version == 1, version
    dtype = DTYPES[idx[17]].newbyteorder("<")
    n, d = struct.unpack("<QQ", idx[18:34])
    assert len(idx) == 34 + 4 * n + 8 * n + 8 * d, "size disagrees with the header"
    lengths = np.frombuffer(idx[34 : 34 + 4 * n], dtype="<i4")
    pointers = np.frombuffer(idx[34 + 4 * n : 34 + 12 * n], dtype="<i8")
    data = Path(f"{prefix}.bin").read_bytes()
    return [
        np.frombuffer(data[p : p + k * dtype.itemsize], dtype=dtype)
        for k, p in zip(lengths.tolist(), pointers.tolist(), strict=True)
    ]
