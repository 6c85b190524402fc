"""A batch as the trainer sees it, and zero-copy ways to cut it up.

`Batch` maps tensor names to read-only int32 numpy arrays of shape [rows, seq_len], computed
lazily from the compact wire form (wire.py) the first time each is asked for: a trainer that
reads only `input_ids` and `labels` pays for nothing else, and those two are views of one
int32 token array: the received bytes themselves with int32 tokens, one widened copy with
uint16. `batch.compact` is the compact form itself, for helpers that expand it on an
accelerator (torch.py, jax.py).
`microbatches` splits a rank's batch into gradient-accumulation micro-batches, also views.
`varlen` gives flash-attention's `cu_seqlens` / `max_seqlen` from `position_ids`;
`doc_lengths` each row's document pieces as lengths (OLMo-core's `doc_lens`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
from tokenfeed.client.wire import TENSOR_NAMES, Compact, decode, expand, tokens_int32
from tokenfeed.v1 import tokenfeed_pb2 as pb


class Batch(Mapping[str, np.ndarray]):
    """One rank's slice of a step: read-only int32 arrays of shape [rows, seq_len]."""

    __slots__ = (
        "compact",
        "_arrays",
        "job",
        "step",
        "rank",
        "world_size",
        "epoch",
        "fingerprint",
        "job_fingerprint",
        "plan_phase_start",
        "plan_fingerprint",
        "plan_version",
        "server",
    )

    def __init__(
        self, msg: pb.Batch, verify: bool = True, server: str = "", tokens: memoryview | None = None
    ):
        self.compact: Compact = decode(msg, verify, tokens)  # tokens: where _received.py left them
        self._arrays: dict[str, np.ndarray] = {}
        self.job, self.step, self.rank = msg.job, msg.step, msg.rank
        self.world_size, self.epoch, self.fingerprint = msg.world_size, msg.epoch, msg.fingerprint
        self.job_fingerprint = msg.job_fingerprint
        # The data plan that decided this step (docs/data-plan.md): the start of its phase and
        # the fingerprint of the plan up to it; a checkpoint records them.
        self.plan_phase_start, self.plan_fingerprint = msg.plan_phase_start, msg.plan_fingerprint
        self.plan_version = msg.plan_version
        self.server = server

    def __getitem__(self, name: str) -> np.ndarray:
        arr = self._arrays.get(name)
        if arr is None:
            if name not in TENSOR_NAMES:
                raise KeyError(name)
            if name in ("input_ids", "labels"):
                # Both at once: views of one widened array, read-only as it is (every trainer
                # reads the two, once a batch).
                wide = tokens_int32(self.compact)
                wide.flags.writeable = False
                self._arrays["input_ids"] = expand(self.compact, "input_ids", wide)
                self._arrays["labels"] = expand(self.compact, "labels", wide)
                return self._arrays[name]
            arr = expand(self.compact, name)
            arr.flags.writeable = False
            self._arrays[name] = arr
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(TENSOR_NAMES)

    def __len__(self) -> int:
        return len(TENSOR_NAMES)

    def __repr__(self) -> str:
        shape = (self.compact.rows, self.compact.seq_len)
        return f"Batch(job={self.job!r}, step={self.step}, rank={self.rank}, shape={shape})"


def microbatches(batch: Mapping[str, np.ndarray], count: int) -> list[dict[str, np.ndarray]]:
    """`count` micro-batches of equal rows, each a dict of views into `batch` (no copy)."""
    rows = {len(arr) for arr in batch.values()}
    if len(rows) != 1:
        raise ValueError(f"tensors disagree on the number of rows: {sorted(rows)}")
    (n,) = rows
    if count < 1 or n % count:
        raise ValueError(
            f"cannot split {n} rows into {count} equal micro-batches; "
            f"choose a count that divides {n}"
        )
    size = n // count
    return [
        {name: arr[i * size : (i + 1) * size] for name, arr in batch.items()} for i in range(count)
    ]


def varlen(position_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """(cu_seqlens int32, max_seqlen) of a [rows, seq_len] batch flattened to one sequence:
    every document piece, and every row, starts where position_ids is 0."""
    flat = np.asarray(position_ids).reshape(-1)
    starts = np.flatnonzero(flat == 0)
    cu = np.append(starts, flat.size).astype(np.int32)
    return cu, int(np.diff(cu).max()) if len(cu) > 1 else 0


def doc_lengths(c: Compact) -> tuple[np.ndarray, list[int]]:
    """Each row's document pieces as lengths, in order, over its `seq_len` input positions
    (OLMo-core's `doc_lens`): int32 [rows, most pieces of a row], zero-padded, and each row's
    longest piece (`max_doc_lens`). A row's padding (best_fit) is one piece at its end."""
    L = c.seq_len
    pieces = []
    for r in range(c.rows):
        starts = c.starts[int(c.row_splits[r]) : int(c.row_splits[r + 1])].astype(np.int64)
        # Slots holding tokens, of the row's seq_len + 1: inputs past them are padding.
        used = L if c.padding is None else min(L, L + 1 - int(c.padding[r]))
        ends = [used, L] if used < L else [used]
        pieces.append(np.diff(np.concatenate(([0], starts[starts < used], ends))))
    out = np.zeros((c.rows, max(len(p) for p in pieces)), dtype=np.int32)
    for r, p in enumerate(pieces):
        out[r, : len(p)] = p
    return out, [int(p.max()) for p in pieces]
