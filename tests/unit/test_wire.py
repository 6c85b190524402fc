"""Tensors on the wire: raw little-endian bytes, zero-copy decoding, and the batch fingerprint."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tokenfeed.client.wire import WireError, decode_tensors, encode_tensors, fingerprint
from tokenfeed.v1 import tokenfeed_pb2 as pb

WIRE_DTYPES = ["<i4", "<i8", "<u2", "u1", "<f4"]


def batch(rows: int = 2, seq_len: int = 5) -> dict[str, np.ndarray]:
    ids = np.arange(rows * seq_len, dtype=np.int32).reshape(rows, seq_len)
    return {"input_ids": ids, "labels": ids + 1, "position_ids": ids % 3, "segment_ids": ids // 4}


def over_the_wire(tensors: list[pb.Tensor], fp: str) -> pb.Batch:
    """Serialize and parse, as a real client would receive the message."""
    return pb.Batch.FromString(pb.Batch(tensors=tensors, fingerprint=fp).SerializeToString())


def reference_fingerprint(arrays: dict[str, np.ndarray]) -> str:
    """The documented fingerprint (hex SHA-256 cut to 128 bits), without the module under test."""
    h = hashlib.sha256()
    for name, arr in arrays.items():
        le = arr.astype(arr.dtype.newbyteorder("<"))
        h.update(name.encode() + b"\0")
        h.update(le.dtype.str.encode())
        h.update(b"".join(int(d).to_bytes(8, "little", signed=True) for d in arr.shape))
        h.update(np.ascontiguousarray(le).tobytes())
    return h.hexdigest()[:32]


def test_round_trip_through_a_serialized_message():
    arrays = batch()
    tensors, fp = encode_tensors(arrays)
    msg = over_the_wire(tensors, fp)
    out = decode_tensors(msg.tensors, msg.fingerprint)
    assert list(out) == list(arrays)
    for name, arr in arrays.items():
        assert out[name].dtype == np.dtype("<i4")
        assert np.array_equal(out[name], arr)


def test_decoded_arrays_are_read_only_views():
    tensors, fp = encode_tensors(batch())
    msg = over_the_wire(tensors, fp)
    for arr in decode_tensors(msg.tensors, fp).values():
        # A view over the message's immutable bytes, not a private copy.
        assert arr.flags.writeable is False
        assert arr.base is not None
        with pytest.raises(ValueError):
            arr[0, 0] = 1


def test_fingerprint_follows_the_documented_recipe():
    arrays = batch() | {
        "mask": np.ones((2, 5), dtype=np.uint8),
        "weights": np.linspace(0, 1, 6, dtype=np.float32).reshape(3, 2),
        "scalar": np.array(7, dtype=np.int64),
    }
    _, fp = encode_tensors(arrays)
    assert fp == reference_fingerprint(arrays)
    parts = [(n, a.dtype, a.shape, a.tobytes()) for n, a in arrays.items()]
    assert fingerprint(parts) == fp


def test_fingerprint_covers_names_dtypes_shapes_order_and_data():
    ids = np.arange(6, dtype=np.int32)
    base = encode_tensors({"a": ids.reshape(2, 3), "b": ids})[1]
    variants = [
        {"a": ids.reshape(3, 2), "b": ids},  # same bytes, other shape
        {"c": ids.reshape(2, 3), "b": ids},  # other name
        {"b": ids, "a": ids.reshape(2, 3)},  # other order
        {"a": ids.reshape(2, 3).astype(np.int64), "b": ids},  # other dtype, same values
        {"a": (ids + (ids == 5)).reshape(2, 3), "b": ids},  # one value changed
    ]
    fps = {encode_tensors(v)[1] for v in variants}
    assert base not in fps and len(fps) == len(variants)


def test_fingerprint_mismatch_raises():
    tensors, fp = encode_tensors(batch())
    wrong = ("0" if fp[0] != "0" else "1") + fp[1:]
    with pytest.raises(WireError, match="fingerprint mismatch"):
        decode_tensors(tensors, wrong)


def test_corrupted_data_fails_the_fingerprint():
    tensors, fp = encode_tensors(batch())
    data = bytearray(tensors[1].data)
    data[3] ^= 0x01
    tensors[1].data = bytes(data)
    with pytest.raises(WireError, match="fingerprint"):
        decode_tensors(tensors, fp)
    # Without an expected fingerprint there is nothing to check against.
    assert decode_tensors(tensors)["labels"].shape == (2, 5)


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: setattr(t, "data", t.data[:-1]),
        lambda t: setattr(t, "data", t.data + b"\0\0\0\0"),
        lambda t: t.shape.__setitem__(0, 3),
        lambda t: t.shape.append(2),
    ],
    ids=["short", "long", "bigger-shape", "extra-dim"],
)
def test_wrong_byte_count_raises(edit):
    tensors, fp = encode_tensors(batch())
    edit(tensors[2])
    with pytest.raises(WireError, match="position_ids: .* bytes do not fill shape"):
        decode_tensors(tensors, fp)


def test_unknown_dtype_code_raises():
    tensors, _ = encode_tensors(batch())
    tensors[0].dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(WireError, match="unknown dtype"):
        decode_tensors(tensors)


@pytest.mark.parametrize("dtype", [np.float64, np.int16, np.bool_, np.uint32])
def test_dtypes_without_a_wire_encoding_are_refused(dtype):
    with pytest.raises(WireError, match="no wire encoding"):
        encode_tensors({"x": np.zeros(3, dtype=dtype)})


def test_big_endian_and_strided_inputs_encode_as_little_endian_c_order():
    ids = np.arange(12, dtype=np.int32).reshape(3, 4)
    native_fp = encode_tensors({"x": ids.T.copy()})[1]
    for arr in (ids.astype(">i4").T, ids.T, ids[:, ::-1][:, ::-1].T):
        tensors, fp = encode_tensors({"x": arr})
        assert fp == native_fp
        assert tensors[0].data == ids.T.copy().tobytes()
        assert np.array_equal(decode_tensors(tensors, fp)["x"], ids.T)


arrays_strategy = st.dictionaries(
    keys=st.text(min_size=1, max_size=10),
    values=st.sampled_from(WIRE_DTYPES).flatmap(
        lambda dt: hnp.arrays(
            np.dtype(dt),
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
            elements={"allow_nan": False} if dt == "<f4" else None,
        )
    ),
    max_size=5,
)


@settings(max_examples=100, deadline=None)
@given(arrays=arrays_strategy)
def test_round_trip_property(arrays):
    tensors, fp = encode_tensors(arrays)
    assert fp == reference_fingerprint(arrays)
    msg = over_the_wire(tensors, fp)
    out = decode_tensors(msg.tensors, msg.fingerprint)
    assert list(out) == list(arrays)
    for name, arr in arrays.items():
        assert out[name].shape == arr.shape
        assert out[name].dtype == arr.dtype
        assert np.array_equal(out[name], arr)
