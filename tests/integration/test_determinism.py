"""Determinism, elasticity and random access against real servers on loopback ports."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from support import ServerProcess, batch_bytes, job_spec, write_config

STEPS = [0, 1, 7, 40]


def test_same_request_same_bytes(server):
    with server.client("main") as c:
        for step in STEPS:
            first = c.get_batch(step)
            assert batch_bytes(c.get_batch(step)) == batch_bytes(first)
        # different steps really are different batches
        assert c.get_batch(0).fingerprint != c.get_batch(1).fingerprint


def test_two_servers_with_separate_caches_and_a_restart_agree(server, corpus, tmp_path):
    with server.client("main") as c:
        expected = {s: batch_bytes(c.get_batch(s)) for s in STEPS}
    cfg = write_config(tmp_path / "tf.yaml", {"main": job_spec([corpus / "*"])}, tmp_path / "c2")
    for attempt in range(2):  # the second start reuses the token store of the first
        other = ServerProcess(cfg, tmp_path / f"server{attempt}.log")
        try:
            assert other.wait_ready("main")["state"] == "JOB_STATE_READY"
            with other.client("main") as c:
                assert {s: batch_bytes(c.get_batch(s)) for s in STEPS} == expected
        finally:
            assert other.stop() == 0
    assert sorted((tmp_path / "c2" / "tokens").rglob("*.json")), "chunks are stored on disk"


def test_restart_reuses_the_token_store(corpus, tmp_path):
    cfg = write_config(tmp_path / "tf.yaml", {"main": job_spec([corpus / "*"])}, tmp_path / "c")
    first = ServerProcess(cfg, tmp_path / "a.log")
    first.wait_ready("main")
    first.stop()
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "c" / "tokens").rglob("*.bin")}
    second = ServerProcess(cfg, tmp_path / "b.log")
    try:
        second.wait_ready("main")
    finally:
        second.stop()
    # nothing was re-tokenized: every chunk file is the one the first run wrote
    assert {p: p.stat().st_mtime_ns for p in files} == files
    assert len(list((tmp_path / "c" / "tokens").rglob("*.bin"))) == len(files)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_rank_slices_concatenate_to_the_global_batch(server, world_size):
    with server.client("main") as c:
        for step in (0, 3, 41):
            whole = c.get_batch(step)
            parts = [c.get_batch(step, rank=r, world_size=world_size) for r in range(world_size)]
            for name in whole:
                joined = np.concatenate([p[name] for p in parts])
                assert joined.shape == whole[name].shape
                assert np.array_equal(joined, whole[name]), (name, step, world_size)


def test_random_access_equals_sequential(server, corpus, tmp_path):
    with server.client("main") as c:
        sequential = [batch_bytes(c.get_batch(s)) for s in range(13)]
    # a fresh server, asked for step 12 first, with no history
    cfg = write_config(tmp_path / "tf.yaml", {"main": job_spec([corpus / "*"])}, tmp_path / "c")
    fresh = ServerProcess(cfg, tmp_path / "s.log")
    try:
        with fresh.client("main") as c:
            assert batch_bytes(c.get_batch(12)) == sequential[12]
            assert batch_bytes(c.get_batch(5)) == sequential[5]
    finally:
        fresh.stop()


def test_stream_equals_unary(server):
    with server.client("main") as c:
        streamed = [(b.step, batch_bytes(b)) for b in c.iter_batches(5, 25, rank=1, world_size=2)]
        unary = [(s, batch_bytes(c.get_batch(s, rank=1, world_size=2))) for s in range(5, 25)]
    assert streamed == unary


def test_a_stream_across_an_epoch_end_equals_unary(server):
    # A stream's next steps are planned together: the group that holds the epoch's last step
    # and the next epoch's first must give each batch its own epoch and rows.
    with server.client("main") as c:
        spe = int(c.describe()["steps_per_epoch"])
        steps = range(spe - 3, spe + 4)
        streamed = [(b.step, b.epoch, batch_bytes(b)) for b in c.iter_batches(spe - 3, spe + 4)]
        unary = [(s, b.epoch, batch_bytes(b)) for s, b in ((s, c.get_batch(s)) for s in steps)]
    assert {e for _, e, _ in unary} == {0, 1}
    assert streamed == unary


def test_epochs_continue_with_a_new_order(server):
    with server.client("main") as c:
        info = c.describe()
        spe = int(info["steps_per_epoch"])
        b0, b1 = c.get_batch(0), c.get_batch(spe + 1)
        assert b1.epoch == 1 and b0.epoch == 0
        assert b0.fingerprint != b1.fingerprint


def test_sigterm_during_tokenization_abandons_the_chunk_and_exits_cleanly(tmp_path, texts):
    # one chunk of ~30 MB: seconds of tokenization, far longer than the drain
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        for _ in range(100):
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"big": job_spec([big], chunk_bytes="64MiB")},
        tmp_path / "cache",
        grace_seconds=0.5,
    )
    proc = ServerProcess(cfg, tmp_path / "log.txt")
    time.sleep(0.5)
    assert proc.stop() == 0, proc.log()
    # had the server waited for the tokenizer, the chunk would have been committed
    assert not list((tmp_path / "cache" / "tokens").rglob("*.json")), proc.log()
    assert not list((tmp_path / "cache" / "tokens").rglob("*.tmp"))
