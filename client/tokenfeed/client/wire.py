"""Tensors on the wire: raw little-endian bytes with a dtype and a shape, and the batch fingerprint.

Shared by the server (encoding) and the client (decoding, verification); imports only numpy and
the generated protos.

Fingerprint: hex SHA-256, truncated to 128 bits, over, for each tensor in order, the UTF-8 name,
a NUL byte, the numpy dtype string (e.g. `<i4`), the shape as little-endian int64s, and the data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np
from tokenfeed.v1 import tokenfeed_pb2 as pb

_TO_PROTO = {
    np.dtype("<i4"): pb.DTYPE_INT32, np.dtype("<i8"): pb.DTYPE_INT64,
    np.dtype("<u2"): pb.DTYPE_UINT16, np.dtype("u1"): pb.DTYPE_UINT8,
    np.dtype("<f4"): pb.DTYPE_FLOAT32,
}  # fmt: skip
_FROM_PROTO = {code: dtype for dtype, code in _TO_PROTO.items()}


class WireError(ValueError):
    """A message whose tensors do not decode: wrong size, unknown dtype, bad fingerprint."""


def fingerprint(named: Iterable[tuple[str, np.dtype, tuple[int, ...], bytes | memoryview]]) -> str:
    h = hashlib.sha256()  # twice BLAKE2b's speed where the CPU has SHA instructions
    for name, dtype, shape, data in named:
        h.update(name.encode())
        h.update(b"\0")
        h.update(np.dtype(dtype).str.encode())
        h.update(np.asarray(shape, dtype="<i8").tobytes())
        h.update(data)
    return h.hexdigest()[:32]


def encode_tensors(arrays: Mapping[str, np.ndarray]) -> tuple[list[pb.Tensor], str]:
    tensors, parts = [], []
    for name, arr in arrays.items():
        dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        if np.dtype(dtype) not in _TO_PROTO:
            raise WireError(f"tensor {name}: dtype {arr.dtype} has no wire encoding")
        data = np.ascontiguousarray(arr, dtype=dtype).tobytes()
        tensors.append(pb.Tensor(name=name, dtype=_TO_PROTO[np.dtype(dtype)], shape=arr.shape,
                                 data=data))  # fmt: skip
        parts.append((name, np.dtype(dtype), arr.shape, data))
    return tensors, fingerprint(parts)


def decode_tensors(
    tensors: Iterable[pb.Tensor], expected_fingerprint: str | None = None
) -> dict[str, np.ndarray]:
    """Read-only numpy views over the messages' bytes (no copy of the tensor data)."""
    out, parts = {}, []
    for t in tensors:
        dtype = _FROM_PROTO.get(t.dtype)
        if dtype is None:
            raise WireError(f"tensor {t.name}: unknown dtype code {t.dtype}")
        shape = tuple(t.shape)
        data = t.data
        if len(data) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise WireError(f"tensor {t.name}: {len(data)} bytes do not fill shape {shape}")
        out[t.name] = np.frombuffer(data, dtype=dtype).reshape(shape)
        parts.append((t.name, dtype, shape, data))
    if expected_fingerprint is not None:
        got = fingerprint(parts)
        if got != expected_fingerprint:
            raise WireError(f"batch fingerprint mismatch: computed {got}, server sent "
                            f"{expected_fingerprint}")  # fmt: skip
    return out
