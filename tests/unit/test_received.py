"""The client's deserializer (_received.received): a large batch whose tokens are its last
field, as a tokenfeed server writes it, is parsed without its tokens, which stay a view of the
received bytes; anything else is parsed whole by protobuf. Either way the batch decodes to the
same arrays, and a malformed message is refused as protobuf refuses it."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from tokenfeed.client import wire
from tokenfeed.client._received import IN_PLACE_BYTES, received
from tokenfeed.client.batch import Batch
from tokenfeed.v1 import tokenfeed_pb2 as pb


def _fields(rows: int, seq_len: int, tokens: np.ndarray) -> pb.Batch:
    """A batch's fields but its tokens, fingerprinted over `tokens` (uint16)."""
    splits = np.zeros(rows + 1, dtype="<i4")
    starts = np.zeros(0, dtype="<u2")
    header = wire.shape_header(rows, seq_len, pb.DTYPE_UINT16, False)
    fingerprint = wire.digest(header, tokens.tobytes(), starts.tobytes(), splits.tobytes(), None)
    return pb.Batch(
        job="j",
        step=7,
        rank=1,
        world_size=2,
        fingerprint=fingerprint,
        wire_version=wire.WIRE_VERSION,
        rows=rows,
        seq_len=seq_len,
        token_dtype=pb.DTYPE_UINT16,
        row_splits=splits.tobytes(),
        plan_fingerprint="p",
        plan_version=3,
    )


def _tokens(rows: int, seq_len: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, size=(rows, seq_len + 1), dtype=np.uint16)


def _field(**one) -> bytes:
    """One field as protobuf writes it (a message holding only that field)."""
    return pb.Batch(**one).SerializeToString()


def _server_order(msg: pb.Batch, tokens: np.ndarray) -> bytes:
    """As a tokenfeed server writes a batch: its other fields, then the tokens last."""
    return msg.SerializeToString() + _field(tokens=tokens.tobytes())


def _same(a: Batch, b: Batch) -> None:
    for name in wire.TENSOR_NAMES:
        assert np.array_equal(a[name], b[name]), name
    assert (a.step, a.rank, a.fingerprint, a.plan_version) == (b.step, b.rank, b.fingerprint, 3)


@pytest.mark.parametrize("rows, seq_len", [(32, 4096), (8, 4096)])
def test_a_large_batchs_tokens_stay_in_the_received_bytes(rows, seq_len):
    tokens = _tokens(rows, seq_len)
    raw = _server_order(_fields(rows, seq_len, tokens), tokens)
    assert len(raw) >= IN_PLACE_BYTES
    got = received(raw)
    assert got.tokens is not None and got.tokens.obj is raw  # a view, no copy
    assert got.msg.tokens == b""  # parsed without them
    batch = Batch(got.msg, True, "s", got.tokens)
    whole = pb.Batch.FromString(raw)
    _same(batch, Batch(whole, True, "s"))
    assert np.array_equal(batch["input_ids"], tokens[:, :seq_len].astype(np.int32))


def test_a_small_batch_is_parsed_whole():
    tokens = _tokens(2, 64)
    raw = _server_order(_fields(2, 64, tokens), tokens)
    assert len(raw) < IN_PLACE_BYTES
    got = received(raw)
    assert got.tokens is None and got.msg == pb.Batch.FromString(raw)


def test_tokens_that_are_not_the_last_field_are_parsed_by_protobuf():
    tokens = _tokens(32, 4096)
    msg = _fields(32, 4096, tokens)
    msg.tokens = tokens.tobytes()
    raw = msg.SerializeToString()  # protobuf's own order: tokens (13) before row_splits (15)
    got = received(raw)
    assert got.tokens is None and got.msg == msg
    # A varint field after the tokens: not last either.
    tail = _server_order(_fields(32, 4096, tokens), tokens) + _field(step=9)
    got = received(tail)
    assert got.tokens is None and got.msg.step == 9 and got.msg.tokens == tokens.tobytes()


def test_tokens_given_twice_are_the_last_as_protobuf_reads_them():
    first, last = _tokens(32, 4096, 1), _tokens(32, 4096, 2)
    msg = _fields(32, 4096, last)
    raw = msg.SerializeToString() + _field(tokens=first.tobytes()) + _field(tokens=last.tobytes())
    got = received(raw)
    assert got.tokens is not None and bytes(got.tokens) == pb.Batch.FromString(raw).tokens
    _same(Batch(got.msg, True, "s", got.tokens), Batch(pb.Batch.FromString(raw), True, "s"))


@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_a_truncated_or_malformed_message_is_refused_as_protobuf_refuses_it(cut):
    tokens = _tokens(32, 4096)
    raw = _server_order(_fields(32, 4096, tokens), tokens)
    with pytest.raises(DecodeError):
        received(raw[:-cut])
    with pytest.raises(DecodeError):  # a field of a wire type a Batch never has, unfinished
        received(raw[:200] + bytes([1 << 3 | 5, 0xFF]) + b"\x00" * (IN_PLACE_BYTES))


def test_a_changed_token_in_place_fails_the_fingerprint():
    tokens = _tokens(32, 4096)
    raw = bytearray(_server_order(_fields(32, 4096, tokens), tokens))
    raw[-1] ^= 1
    got = received(bytes(raw))
    assert got.tokens is not None
    with pytest.raises(wire.WireError, match="fingerprint mismatch"):
        Batch(got.msg, True, "s", got.tokens)
