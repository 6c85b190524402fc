"""Megatron-LM indexed datasets: the `.idx` layout's constants (tokenfeed's own chunk files
share the layout: store/chunkfiles.py writes them), and, for sources, the header of an `.idx`
checked against the object's size and the `.bin` beside it. Only the 34-byte header is read when
planning; the rest of an `.idx` is 12 bytes per sequence."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
# Megatron-LM's dtype codes for the .idx header.
DTYPE_CODES: dict[np.dtype, int] = {
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
MEGATRON_HEADER_BYTES = 34
# Token ids are integers: the format's float dtype codes (6, 7) are refused.
_TOKEN_DTYPES = {code: dtype for code, dtype in CODE_DTYPES.items() if dtype.kind in "iu"}


@dataclass(frozen=True)
class MegatronHeader:
    dtype: np.dtype  # of the token ids in the .bin
    sequences: int
    documents: int  # entries of the trailing document index (not used for packing)

    def lengths_at(self, i: int) -> int:
        """Byte offset in the .idx of sequence i's length (int32)."""
        return MEGATRON_HEADER_BYTES + 4 * i

    def pointers_at(self, i: int) -> int:
        """Byte offset in the .idx of sequence i's byte pointer into the .bin (int64)."""
        return MEGATRON_HEADER_BYTES + 4 * self.sequences + 8 * i


def megatron_header(store: ObjectBackend, idx: ObjectInfo) -> MegatronHeader:
    """The header of a Megatron .idx, checked against the object's size."""
    raw = store.read_range(idx, 0, MEGATRON_HEADER_BYTES)
    if len(raw) < MEGATRON_HEADER_BYTES or raw[: len(IDX_MAGIC)] != IDX_MAGIC:
        raise SourceError(
            f"{idx.uri}: not a Megatron .idx file (no MMIDIDX magic, or shorter "
            f"than the {MEGATRON_HEADER_BYTES}-byte header)"
        )
    version, code, n, docs = struct.unpack_from("<QBQQ", raw, len(IDX_MAGIC))
    if version != IDX_VERSION:
        raise SourceError(
            f"{idx.uri}: Megatron .idx version {version}; only version {IDX_VERSION} is supported"
        )
    if code not in _TOKEN_DTYPES:
        what = CODE_DTYPES[code].name if code in CODE_DTYPES else "unknown"
        raise SourceError(
            f"{idx.uri}: dtype code {code} ({what}) is not an integer token type; "
            f"supported codes: {sorted(_TOKEN_DTYPES)}"
        )
    expected = MEGATRON_HEADER_BYTES + 12 * n + 8 * docs
    if idx.size != expected:
        raise SourceError(
            f"{idx.uri}: {idx.size} bytes, but its header describes {n} sequences "
            f"and {docs} document entries ({expected} bytes): truncated or "
            "corrupt"
        )
    return MegatronHeader(_TOKEN_DTYPES[code], n, docs)


def megatron_bin(store: ObjectBackend, idx: ObjectInfo) -> ObjectInfo:
    """The .bin beside a Megatron .idx, listed (so pinned) like any source object."""
    uri = idx.uri[: -len(".idx")] + ".bin"
    pattern = re.sub(r"([*?\[])", r"[\1]", uri)  # the name taken literally, not as a glob
    try:
        found = store.list(pattern)
    except SourceError:
        found = []
    if len(found) != 1:
        raise SourceError(f"{idx.uri}: no {uri} beside it; a Megatron dataset is a .bin/.idx pair")
    return found[0]
