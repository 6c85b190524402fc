"""The client's deserializer of batches (the stubs' GetBatch and StreamBatches: _session.py's
`batch_stub`): a large batch's tokens are left where gRPC received them."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfeed.v1 import tokenfeed_pb2 as pb

# A received message of at least this many bytes has its tokens read where they lie
# (`received`); a smaller one is parsed whole, cheaper than the walk to find them.
IN_PLACE_BYTES = 64 << 10
_TOKENS_FIELD = 13  # tokenfeed.v1.Batch.tokens


@dataclass(frozen=True, slots=True)
class Received:
    """A received tokenfeed.v1.Batch: its fields but `tokens`, and the tokens' bytes where
    they lie in the received message (None: `msg.tokens` holds them)."""

    msg: pb.Batch
    tokens: memoryview | None = None


def received(raw: bytes) -> Received:
    """A StreamBatches or GetBatch response as gRPC hands it over, parsed (the client's
    deserializer). When the message is large and its tokens are its last field (as a
    tokenfeed server writes it), the fields before them are parsed and the tokens stay a view
    of `raw`: no copy of the batch's largest array, and none of the fresh memory, faulted in
    page by page, that a copy of a few hundred KB takes from glibc each batch (about 90
    faults and 150-200 us of a [32, 4096] consumer's CPU a batch on 2 cores; bench/, wire
    section). Otherwise the whole message is parsed, as protobuf always does."""
    if len(raw) >= IN_PLACE_BYTES:
        found = _last_tokens(raw)
        if found is not None:
            tag, start = found
            return Received(pb.Batch.FromString(raw[:tag]), memoryview(raw)[start:])
    return Received(pb.Batch.FromString(raw))


def _last_tokens(raw: bytes) -> tuple[int, int] | None:
    """(where its tag starts, where its bytes start) of the `tokens` field when it is the last
    field of a well-formed message, else None (then protobuf parses the whole, and says what
    is wrong). Fields are walked by their keys and lengths: a tokenfeed.v1.Batch has only
    varint and length-delimited fields."""
    end, i, found = len(raw), 0, None
    try:
        while i < end:
            tag_at, found = i, None  # a field after the tokens: they are not the last
            key, i = _varint_at(raw, i)
            kind = key & 7
            if kind == 0:
                _, i = _varint_at(raw, i)
            elif kind == 2:
                size, i = _varint_at(raw, i)
                if key >> 3 == _TOKENS_FIELD:
                    found = (tag_at, i)
                i += size
            else:
                return None
    except IndexError:
        return None
    return found if i == end else None


def _varint_at(raw: bytes, i: int) -> tuple[int, int]:
    """The varint at raw[i] and the position after it (IndexError past the end)."""
    byte = raw[i]
    value, shift = byte & 0x7F, 7
    while byte & 0x80:
        i += 1
        byte = raw[i]
        value |= (byte & 0x7F) << shift
        shift += 7
        if shift > 70:
            raise IndexError("varint of more than 10 bytes")
    return value, i + 1
