"""JAX (and any multi-host numpy) helper: each process reads its own slice of the global batch.

The recipe, with one process per host and the batch sharded over the data axis:

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tokenfeed.client import Client
    from tokenfeed.client.jax import host_batches

    mesh = Mesh(jax.devices(), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    feed = Client("dns:///tokenfeed.data.svc:50051", job="run3")
    for local in host_batches(feed, start_step, jax.process_index(), jax.process_count()):
        batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
        state = train_step(state, batch)

Process p of P receives global rows [p*B/P, (p+1)*B/P) of every step, so the jax.Array that
`make_array_from_process_local_data` assembles is exactly the global batch whatever P is.

`expand(batch, device)` moves only the compact batch (the token array in its wire dtype and the
document starts; docs/batch-format.md) to a device and derives the five int32 tensors there with
jax.numpy. JAX is imported only when `expand` is called.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
from tokenfeed.client._client import Client
from tokenfeed.client.batch import Batch
from tokenfeed.client.wire import TENSOR_NAMES, Compact


def expand(compact: Compact | Batch, device: Any = None) -> dict[str, Any]:
    """The five int32 tensors [rows, seq_len] of a batch as jax Arrays on `device` (default:
    JAX's default device), derived there from the compact form by one compiled function (one
    compilation per batch shape and bucket of document counts: a power of two)."""
    import jax

    c = compact.compact if isinstance(compact, Batch) else compact
    L, rows = c.seq_len, c.rows
    row_of = np.repeat(np.arange(rows, dtype=np.int32), np.diff(c.row_splits))
    flat = row_of * L + c.starts.astype(np.int32)
    bucket = 1 << max(int(len(flat)) - 1, 0).bit_length()
    padded = np.full(bucket, rows * L, dtype=np.int32)  # out of range: dropped
    padded[: len(flat)] = flat
    used = np.full(rows, L + 1, dtype=np.int32)
    if c.padding is not None:
        used -= c.padding.astype(np.int32)
    put = (lambda x: jax.device_put(x, device)) if device is not None else jax.device_put
    tokens = np.ascontiguousarray(c.tokens)
    out = _kernel(rows, L)(put(tokens), put(padded), put(used))
    return dict(zip(TENSOR_NAMES, out, strict=True))


@functools.cache
def _kernel(rows: int, seq_len: int):
    import jax
    import jax.numpy as jnp

    def run(tokens, flat, used):
        ids = tokens.astype(jnp.int32)
        mask = jnp.zeros(rows * seq_len, dtype=bool).at[flat].set(True, mode="drop")
        mask = mask.reshape(rows, seq_len).at[:, 0].set(True)
        col = jnp.arange(seq_len, dtype=jnp.int32)
        valid = col < used[:, None]
        segment = jnp.where(valid, jnp.cumsum(mask, axis=1, dtype=jnp.int32), 0)
        position = jnp.where(valid, col - jax.lax.cummax(jnp.where(mask, col, 0), axis=1), 0)
        loss = (col + 1 < used[:, None]).astype(jnp.int32)
        return ids[:, :seq_len], ids[:, 1:], position, segment, loss

    return jax.jit(run)


def host_batches(
    client: Client,
    start_step: int,
    process_index: int,
    process_count: int,
    end_step: int | None = None,
    *,
    job: str | None = None,
) -> Iterator[Batch]:
    """This process's slice of each step from start_step on, read ahead in the background."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
    yield from client.iter_batches(
        start_step, end_step, rank=process_index, world_size=process_count, job=job
    )
