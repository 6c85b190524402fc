"""One column of MDS samples (mds.py reads the samples): a text column's documents, or an
integer `ndarray` column's token ids, each sample a record located as `<shard> sample N`.

A sample is `uint32 size` per variable-size column, then each column's bytes in order; an
`ndarray` value is streaming's NDArray encoding: `[dtype code] [ndim << 2 | shape width]
[shape] values`, without the parts its encoding string fixes (`ndarray:uint16` fixes the dtype,
`ndarray:uint16:2048` the shape too).
"""

from __future__ import annotations

import json
import struct

import numpy as np
from tokenfeed.server.objstore.objects import ObjectBackend
from tokenfeed.server.source.chunk import Chunk
from tokenfeed.server.source.mds import MdsShard, samples
from tokenfeed.server.source.records import BadRecord, TokenRecords, text_of

# ndarray value dtype codes (streaming's NDArray encoding), the integer ones only.
_NDARRAY_DTYPES = {
    8: "u1",
    9: "i1",
    16: "<u2",
    17: "<i2",
    32: "<u4",
    33: "<i4",
    64: "<u8",
    65: "<i8",
}
_SHAPE_BYTES = (1, 2, 4, 8)


def column(shard: MdsShard, field: str, sample: bytes, where: str) -> bytes | BadRecord:
    """One column's bytes of a sample."""
    if field not in shard.names:
        return BadRecord("missing_field", where, f"no column {field!r} in {list(shard.names)}")
    variable = [i for i, n in enumerate(shard.sizes) if n is None]
    pos = 4 * len(variable)
    if len(sample) < pos:
        return BadRecord("corrupt_sample", where, "shorter than its column sizes")
    sizes = list(shard.sizes)
    for k, i in enumerate(variable):
        sizes[i] = struct.unpack_from("<I", sample, 4 * k)[0]
    j = shard.names.index(field)
    start = pos + sum(sizes[:j])  # type: ignore[arg-type]
    end = start + sizes[j]  # type: ignore[operator]
    if end > len(sample):
        return BadRecord("corrupt_sample", where, "its column sizes exceed its bytes")
    return sample[start:end]


def text(shard: MdsShard, field: str, sample: bytes, where: str) -> str | BadRecord:
    value = column(shard, field, sample, where)
    if isinstance(value, BadRecord):
        return value
    decoded = text_of(value, where, f"column {field!r}")
    if shard.encodings[shard.names.index(field)] != "json" or isinstance(decoded, BadRecord):
        return decoded
    try:
        parsed = json.loads(decoded)
    except ValueError as e:
        return BadRecord("malformed_json", where, str(e))
    if not isinstance(parsed, str):
        return BadRecord(
            "not_text", where, f"column {field!r} holds a JSON {type(parsed).__name__}"
        )
    return parsed or BadRecord("empty", where, f"column {field!r} is empty")


def ids(shard: MdsShard, field: str, sample: bytes, where: str) -> np.ndarray | BadRecord:
    """A sample's token ids from a one-dimensional integer ndarray column."""
    value = column(shard, field, sample, where)
    if isinstance(value, BadRecord):
        return value
    parts = shard.encodings[shard.names.index(field)].split(":")
    pos, dtype = 0, None
    try:
        if len(parts) > 1:
            dtype = np.dtype(parts[1]).newbyteorder("<")
        else:
            code = value[0]
            pos = 1
            if code not in _NDARRAY_DTYPES:
                return BadRecord("not_tokens", where, f"ndarray dtype code {code}: not integer")
            dtype = np.dtype(_NDARRAY_DTYPES[code])
        if len(parts) < 3:
            ndim, width = value[pos] >> 2, _SHAPE_BYTES[value[pos] & 3]
            pos += 1 + ndim * width
            if ndim != 1:
                return BadRecord("not_tokens", where, f"an ndarray of {ndim} dimensions")
    except IndexError:
        return BadRecord("corrupt_sample", where, f"column {field!r} ends inside its header")
    body = value[pos:]
    if len(body) % dtype.itemsize:
        return BadRecord("corrupt_sample", where, f"{len(body)} bytes of {dtype.name} ids")
    return np.frombuffer(body, dtype=dtype)


def read_texts(store: ObjectBackend, chunk: Chunk) -> list[str | BadRecord]:
    shard, items = samples(store, chunk)
    return [
        s if isinstance(s, BadRecord) else text(shard, chunk.text_field, s, _at(chunk, i))
        for i, s in enumerate(items)
    ]


def read_tokens(store: ObjectBackend, chunk: Chunk) -> TokenRecords:
    shard, items = samples(store, chunk)
    arrays, refused = [], {}
    for i, s in enumerate(items):
        got = s if isinstance(s, BadRecord) else ids(shard, chunk.text_field, s, _at(chunk, i))
        if isinstance(got, BadRecord):
            refused[i] = got
            arrays.append(np.zeros(0, dtype=np.int64))
        else:
            arrays.append(got.astype(np.int64))
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return TokenRecords(flat, lengths, chunk.start, f"{chunk.source.uri} sample", refused)


def _at(chunk: Chunk, i: int) -> str:
    return f"{chunk.source.uri} sample {chunk.start + i}"
