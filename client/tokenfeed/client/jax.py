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
This module imports no JAX: it only names the slice each process must read.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenfeed.client._client import Client
from tokenfeed.client.batch import Batch


def host_batches(
    client: Client, start_step: int, process_index: int, process_count: int,
    end_step: int | None = None, *, job: str | None = None,
) -> Iterator[Batch]:  # fmt: skip
    """This process's slice of each step from start_step on, read ahead in the background."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
    yield from client.iter_batches(start_step, end_step, rank=process_index,
                                   world_size=process_count, job=job)  # fmt: skip
