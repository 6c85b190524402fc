"""A served batch as a serialized tokenfeed.v1.Batch: the token array appended to the other
fields as field 13, copied once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from tokenfeed.client import wire
from tokenfeed.v1 import tokenfeed_pb2 as pb

if TYPE_CHECKING:
    from tokenfeed.server.jobs.job import Job


def serialized(message: bytes) -> bytes:
    """Batches leave the servicer serialized (`batch_message`)."""
    return message


# tokenfeed.v1.Batch's `tokens` field (13), length-delimited.
_TOKENS_TAG = bytes([13 << 3 | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def batch_message(
    job: Job, step: int, rank: int, world_size: int, epoch: int, compact: wire.Compact
) -> tuple[bytes, int]:
    """A serialized tokenfeed.v1.Batch, and the bytes of its compact arrays. The token array
    is appended to the serialized other fields as field 13 (a message's fields may come in any
    order), so its bytes are copied once, straight from the assembled array (bench/, wire)."""
    fields = wire.encode(compact, with_tokens=False)
    phase_start, plan_fingerprint = job.plan_of(step)
    head = pb.Batch(
        job=job.name,
        step=step,
        rank=rank,
        world_size=world_size,
        epoch=epoch,
        job_fingerprint=job.fingerprint,
        plan_phase_start=phase_start,
        plan_fingerprint=plan_fingerprint,
        plan_version=job.plans.version,
        **fields,
    ).SerializeToString()
    tokens = np.ascontiguousarray(compact.tokens)
    message = b"".join((head, _TOKENS_TAG, _varint(tokens.nbytes), tokens.data))
    payload = (
        tokens.nbytes + len(fields["starts"]) + len(fields["row_splits"]) + len(fields["padding"])
    )
    return message, payload
