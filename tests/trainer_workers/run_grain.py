"""Grain worker: TokenFeedIterator in JAX processes (jax.distributed on CPU, gloo collectives),
the global batch assembled with make_array_from_process_local_data, one jitted SGD step per
global step; the iterator checkpointed by Grain's CheckpointHandler (one file per process), the
parameters with numpy by process 0. A resume with another process count reads the iterator
state with `state_from` (Grain's handler restores only a file of the same count)."""

from __future__ import annotations

import os
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import grain.checkpoint  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import Record, args  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tokenfeed.client import Client  # noqa: E402
from tokenfeed.client.integrations.grain import TokenFeedIterator, state_from  # noqa: E402

LR = 1.0


def init(vocab: int, dim: int = 16) -> dict:
    rng = np.random.default_rng(0)
    return {
        "embed": jnp.asarray(rng.normal(size=(vocab, dim)).astype(np.float32)),
        "out": jnp.asarray((rng.normal(size=(dim, vocab)) / np.sqrt(dim)).astype(np.float32)),
    }


def loss_fn(params: dict, ids: jax.Array, labels: jax.Array) -> jax.Array:
    logits = params["embed"][ids] @ params["out"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


@jax.jit
def train_step(params: dict, ids: jax.Array, labels: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, ids, labels)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


def main() -> None:
    a = args()
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{os.environ['MASTER_PORT']}",
        num_processes=a["world"],
        process_id=a["rank"],
    )
    pid, count = jax.process_index(), jax.process_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    record = Record(a)
    feed = Client(a["address"], job=a["job"])
    data = TokenFeedIterator(feed, pid, count)
    params = init(a["vocab"])
    step = 0
    if a["ckpt_in"]:
        where = Path(a["ckpt_in"]) / f"step_{a['resume_step']}"
        saved = np.load(where / "params.npz")
        params = {k: jnp.asarray(saved[k]) for k in params}
        if (where / f"process_{pid}-of-{count}.json").exists():
            grain.checkpoint.CheckpointHandler().restore(where, item=data)
        else:  # another process count than the checkpoint's
            data.set_state(state_from(where))
        step = record.resumed_at = data.feed.next_step
    params = jax.device_put(params, replicated)
    for local in data:
        ids = jax.make_array_from_process_local_data(rows, np.asarray(local["input_ids"]))
        labels = jax.make_array_from_process_local_data(rows, np.asarray(local["labels"]))
        params, loss = train_step(params, ids, labels)
        record.step(step, local["input_ids"], local["labels"], float(loss))
        step += 1
        if step == a["resume_step"]:
            where = Path(a["ckpt_out"]) / f"step_{step}"
            where.mkdir(parents=True, exist_ok=True)
            grain.checkpoint.CheckpointHandler().save(where, item=data)
            if pid == 0:
                host = jax.tree.map(np.asarray, params)
                np.savez(where / "params.npz", **host)
        if step >= a["steps"]:
            break
    record.write()
    feed.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
