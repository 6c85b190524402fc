"""A served batch as a serialized tokenfeed.v1.Batch: the fields a stream keeps serialized once,
the token array appended to the other fields as field 13, copied once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from tokenfeed.client import wire
from tokenfeed.server.pack import rowlayout, rowmessages
from tokenfeed.server.pack.assembly import GroupRows
from tokenfeed.v1 import tokenfeed_pb2 as pb

if TYPE_CHECKING:
    from tokenfeed.server.jobs.job import Job


def serialized(message: bytes) -> bytes:
    """Batches leave the servicer serialized (`group_messages`)."""
    return message


_varint = rowmessages.varint


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


# Fields of tokenfeed.v1.Batch that change from batch to batch, as protobuf writes them: a key,
# then a varint (0) or a length and the bytes (2); proto3 leaves out zeros and empty bytes.
_STEP, _FINGERPRINT, _EPOCH = _tag(2, 0), _tag(6, 2), _tag(7, 0)
_TOKENS, _STARTS, _ROW_SPLITS, _PADDING = _tag(13, 2), _tag(14, 2), _tag(15, 2), _tag(16, 2)
# The keys of the fields a batch of a stream's group writes for itself (rowmessages.py).
_OWN_FIELDS = _STEP + _EPOCH + _STARTS + _ROW_SPLITS
HEADS_MAX = 4096  # stream shapes remembered (job, rank, world size, phase, batch shape)
FINGERPRINT_CHARS = 32  # a batch's fingerprint: the hex of an xxh3-128 (wire.digest)


class _Heads:
    """The serialized fields that one (job, rank, world size, plan phase, batch shape) keeps
    from batch to batch, made once by protobuf: a batch's message is these pieces and its own
    fields, in field-number order, so its bytes equal protobuf's serialization of the same
    Batch with `tokens` moved to the end (the golden tests and a test of this module pin it)."""

    def __init__(self) -> None:
        self._known: dict[tuple, tuple[bytes, bytes, bytes, bytes]] = {}

    def of(self, key: tuple) -> tuple[bytes, bytes, bytes, bytes]:
        found = self._known.get(key)
        if found is None:
            if len(self._known) >= HEADS_MAX:
                self._known.clear()
            found = self._known[key] = _pieces(*key)
        return found


def _pieces(
    job: str,
    rank: int,
    world_size: int,
    job_fingerprint: str,
    rows: int,
    seq_len: int,
    token_dtype: int,
    phase_start: int,
    plan_fingerprint: str,
    plan_version: int,
) -> tuple[bytes, bytes, bytes, bytes]:
    """(field 1; fields 3-4; fields 8-12; fields 17-19), each as protobuf serializes it."""
    ser = pb.Batch.SerializeToString
    return (
        ser(pb.Batch(job=job)),
        ser(pb.Batch(rank=rank, world_size=world_size)),
        ser(
            pb.Batch(
                job_fingerprint=job_fingerprint,
                wire_version=wire.WIRE_VERSION,
                rows=rows,
                seq_len=seq_len,
                token_dtype=token_dtype,  # type: ignore[arg-type]
            )
        ),
        ser(
            pb.Batch(
                plan_phase_start=phase_start,
                plan_fingerprint=plan_fingerprint,
                plan_version=plan_version,
            )
        ),
    )


_heads = _Heads()


def group_messages(
    job: Job,
    steps: Sequence[int],
    rank: int,
    world_size: int,
    epochs: Sequence[int],
    whole: wire.Compact | GroupRows,
) -> list[tuple[bytes, int]]:
    """The serialized tokenfeed.v1.Batch of each of a group's steps, and the bytes of its
    compact arrays, from the group's rows assembled as one batch (`whole`: the steps' batches
    one after another, as many rows each; `wire.split_rows` cuts the same batches). Each
    message's arrays and fingerprint are slices of the group's buffers, so a batch costs no
    numpy call; its bytes are those of the batch cut alone (tests/unit/test_batchmsg.py).

    The fields that stay the same along a stream are serialized once (`_Heads`); the token
    array is appended as field 13 (a message's fields may come in any order), so its bytes are
    copied once: with concat rows not yet copied (`GroupRows`), straight from the row buffers
    into the message, the fingerprint taken over them there (pack/rowmessages.py: in one C call
    for a group within one phase, which also writes each batch's own fields around the pieces
    its stream shares and takes each fingerprint itself); from a compact batch, from its
    array. The job's fields are read once for the group: it is made in one stretch of the
    event loop, which nothing changes in between; a phase's fields and fingerprint header are
    looked up once, not once a batch."""
    n = len(steps)
    rows = whole.rows
    if n < 1 or len(epochs) != n or rows % n:
        raise ValueError(f"{rows} rows are not {n} batches of one shape")
    per, seq_len = rows // n, whole.seq_len
    if isinstance(whole, GroupRows):
        dtype = whole.dtype
        token_bytes = memoryview(b"")  # the rows go into the messages from their sources
    else:
        tokens = np.ascontiguousarray(whole.tokens)
        token_bytes, dtype = tokens.data.cast("B"), tokens.dtype
    code = wire.token_code(dtype)
    name, job_fingerprint, version = job.name, job.fingerprint, job.plans.version
    # Each batch's row splits, from its own first start (as split_rows cuts them).
    bounds, splits = wire.cut_splits(np.asarray(whole.row_splits, dtype="<i4"), per, n)
    starts = np.ascontiguousarray(whole.starts)
    start_bytes, split_bytes = starts.data.cast("B"), splits.data.cast("B")
    tokens_each = per * (seq_len + 1) * dtype.itemsize
    splits_each, start_size = splits.nbytes // n, starts.itemsize
    at = [a * start_size for a in bounds.tolist()]
    paddings: list[bytes] = [b""] * n
    if whole.padding is not None:  # a group's batch without padding travels without (None)
        pads = np.asarray(whole.padding).reshape(n, per)
        used: list[bool] = [True] if n == 1 else np.any(pads, axis=1).tolist()
        paddings = [p.tobytes() if u else b"" for p, u in zip(pads, used, strict=True)]
    # Steps in one phase share its fields: phases are intervals of steps.
    low, high = min(steps), max(steps)
    one_phase = job.plan_of(low) if job.plans.same_phase(low, high) else None
    known: dict[tuple, tuple[bytes, bytes, bytes, bytes, bytes]] = {}

    def shared(phase: tuple, padded: bool) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        """The pieces around a batch's own fields, and its fingerprint's header."""
        found = known.get((phase, padded))
        if found is None:
            head, ranks, fields, plan = _heads.of(
                (name, rank, world_size, job_fingerprint, per, seq_len, code, *phase, version)
            )
            # What the shape decides, joined once: the tokens' length is the shape's.
            found = known[(phase, padded)] = (
                head,
                ranks + _FINGERPRINT + _varint(FINGERPRINT_CHARS),
                fields,
                plan + _TOKENS + _varint(tokens_each),
                wire.shape_header(per, seq_len, code, padded),
            )
        return found

    if isinstance(whole, GroupRows) and one_phase is not None and whole.padding is None:
        # A stream's group: every batch's head and tail written in C around its own fields.
        head, ranks, fields, plan, header = shared(one_phase, False)
        rows_of = whole.sources
        made = rowmessages.batch_messages(
            (head, ranks, fields, plan),
            _OWN_FIELDS,
            steps,
            epochs,
            start_bytes,
            at,
            split_bytes,
            splits_each,
            rows_of.ids,
            rows_of.which,
            rows_of.lo,
            rows_of.span,
            FINGERPRINT_CHARS,
            wire.HASHER,  # each fingerprint as wire.digest takes it, in C
            header,
        )
        each = tokens_each + splits_each
        return [(m, each + at[i + 1] - at[i]) for i, m in enumerate(made)]
    heads: list[bytes] = []
    tails: list[bytes] = []
    digested: list[tuple] = []
    payloads: list[int] = []
    out: list[tuple[bytes, int]] = []
    src: rowlayout.RowSources | None = whole.sources if isinstance(whole, GroupRows) else None
    for i, (step, epoch, padding) in enumerate(zip(steps, epochs, paddings, strict=True)):
        padded = whole.padding is not None and (n == 1 or bool(padding))
        head, ranks, fields, plan, header = shared(one_phase or job.plan_of(step), padded)
        start_part = start_bytes[at[i] : at[i + 1]]
        split_part = split_bytes[i * splits_each : (i + 1) * splits_each]
        before: list[bytes | memoryview] = [head]
        if step:
            before += (_STEP, _varint(step))
        before.append(ranks)
        after: list[bytes | memoryview] = [_EPOCH, _varint(epoch)] if epoch else []
        after.append(fields)
        for tag, data in ((_STARTS, start_part), (_ROW_SPLITS, split_part), (_PADDING, padding)):
            if len(data):
                after += (tag, _varint(len(data)), data)
        after.append(plan)
        digest = (header, start_part, split_part, padding if padded else None)
        payload = tokens_each + len(start_part) + splits_each + len(padding)
        if src is not None:
            heads.append(b"".join(before))
            tails.append(b"".join(after))
            digested.append(digest)
            payloads.append(payload)
            continue
        token_part = token_bytes[i * tokens_each : (i + 1) * tokens_each]
        fingerprint = wire.digest(digest[0], token_part, *digest[1:])
        parts = [*before, fingerprint.encode(), *after, token_part]
        out.append((b"".join(parts), payload))
    if src is None:
        return out

    def fingerprint_of(i: int, rows: memoryview) -> str:
        h, s, p, d = digested[i]
        return wire.digest(h, rows, s, p, d)

    made = rowmessages.messages(
        heads, tails, src.ids, src.which, src.lo, src.span, FINGERPRINT_CHARS, fingerprint_of
    )
    return list(zip(made, payloads, strict=True))
