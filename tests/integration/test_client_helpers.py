"""Client helpers against a real server: per-host slices for JAX, micro-batches of a batch."""

from __future__ import annotations

import numpy as np
from tokenfeed.client import Client, microbatches
from tokenfeed.client.jax import host_batches


def test_host_batches_of_every_process_form_the_global_batch(server):
    with Client(server.address, job="main") as c:
        whole = [c.get_batch(s) for s in range(3, 6)]
        per_host = [list(host_batches(c, 3, p, 4, end_step=6)) for p in range(4)]
    for i, batch in enumerate(whole):
        for name in batch:
            joined = np.concatenate([per_host[p][i][name] for p in range(4)])
            assert np.array_equal(joined, batch[name])


def test_microbatches_of_a_served_batch(server):
    with Client(server.address, job="main") as c:
        batch = c.get_batch(0)
    parts = microbatches(batch, 2)
    assert all(np.shares_memory(p["input_ids"], batch["input_ids"]) for p in parts)
    assert not parts[0]["input_ids"].flags.writeable
