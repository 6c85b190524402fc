"""Large batches through a real server: the client reads their tokens where gRPC received them
(_received.received, no copy), by GetBatch, StreamBatches and the asyncio client alike, and they
are the batches the job makes in process, fingerprint and tensors."""

from __future__ import annotations

import asyncio

import numpy as np
from support import DATA, ServerProcess, built_job, job_spec, write_config
from tokenfeed.client import AsyncClient, wire
from tokenfeed.client._received import IN_PLACE_BYTES

STEPS = range(0, 5)


def _spec() -> dict:
    # [16, 4096] batches of uint16 tokens: messages of about 131 KB, past IN_PLACE_BYTES.
    return job_spec([DATA / "golden" / "corpus.jsonl"], seq_len=4096, global_batch_size=32, seed=5)


def _owner(array: np.ndarray) -> object:
    """What holds an array's memory at the end of its chain of views."""
    owner: object = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    return owner


def test_large_batches_are_read_in_place_and_equal_the_jobs(tmp_path):
    reference = built_job(tmp_path / "ref", _spec())
    proc = ServerProcess(
        write_config(tmp_path / "tf.yaml", {"big": _spec()}, tmp_path / "cache"), tmp_path / "log"
    )
    try:
        assert proc.wait_ready("big")["state"] == "JOB_STATE_READY", proc.log()
        with proc.client("big") as c:
            unary = [c.get_batch(s, 1, 2) for s in STEPS]
            streamed = list(c.iter_batches(STEPS.start, STEPS.stop, 1, 2))

        async def read_async():
            async with AsyncClient(proc.address, job="big") as c:
                return [b async for b in c.iter_batches(STEPS.start, STEPS.stop, 1, 2)]

        aio = asyncio.run(read_async())
    finally:
        assert proc.stop() == 0
    for got in (unary, streamed, aio):
        assert [b.step for b in got] == list(STEPS)
        for batch in got:
            # A view of the received message, not a bytes object of its own.
            assert isinstance(_owner(batch.compact.tokens), memoryview)
            assert batch.compact.tokens.nbytes >= IN_PLACE_BYTES
            epoch, want = reference.batch(batch.step, 1, 2)
            assert batch.epoch == epoch
            for name in wire.TENSOR_NAMES:
                assert np.array_equal(batch[name], want[name]), (batch.step, name)
            _, compact = reference.assemble(reference.plan(batch.step, 1, 2))
            assert batch.fingerprint == wire.fingerprint(compact)
