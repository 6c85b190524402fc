"""A token chunk damaged on disk while the server runs is found before its bytes are served
again, and rebuilt: what is served is copied from a body whose digests were checked at the
copy (a concat stream laid out for an epoch, best_fit's tokens)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support import built_job, job_spec


def _job(cache, corpus, packing: str):
    spec = job_spec([corpus / "*"], seed=5, packing=packing)
    return built_job(cache, spec)


def _batch(job, step):
    plan = job.plan(step, 0, 1)

    async def open_chunks():
        with ThreadPoolExecutor(2) as pool:
            await job.open_chunks(plan, pool)

    asyncio.run(open_chunks())
    return job.assemble(plan)[1].tokens.copy(), plan


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_a_chunk_damaged_under_a_running_server_is_rebuilt_not_served(
    tmp_path, corpus, caplog, packing
):
    reference = _job(tmp_path / "ref", corpus, packing)
    job = _job(tmp_path / "cache", corpus, packing)
    spe = job.steps_per_epoch
    want = {s: _batch(reference, s)[0] for s in (0, spe + 1)}
    got, plan = _batch(job, 0)
    assert np.array_equal(got, want[0])
    # Damage a body the server has opened and verified: flip bytes in the middle of its .bin.
    d, _, c = sorted(job.chunks_read(plan))[0]
    key = job.indexes[d].keys[c]
    path = job.store.root / key[:2] / f"{key}.bin"
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    # The next copy of that chunk (the next epoch's stream, or best_fit's tokens once the copy
    # is gone) checks the digests again, drops the body and rebuilds it.
    job.assembler.buffers = type(job.assembler.buffers)(4096, 1)  # nothing kept: every batch copies
    job.assembler.tokens = type(job.assembler.tokens)(4096, 1)
    with caplog.at_level(logging.WARNING):
        for step in (0, spe + 1):
            got, _ = _batch(job, step)
            assert np.array_equal(got, want[step]), f"step {step} served damaged tokens"
    assert "checksum" in caplog.text
    assert path.read_bytes() != bytes(data)  # rebuilt
