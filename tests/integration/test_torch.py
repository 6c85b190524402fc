"""The PyTorch adapter: a trainer checkpoints its data position, exits, and a new process
resumes exactly where it stopped."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenfeed.client import Client, JobMismatch
from tokenfeed.client.torch import TokenFeedDataset
from torch.utils.data import DataLoader


def digest(tensors) -> str:
    """The five tensors' bytes, in order, hashed: equal tensors, equal digests."""
    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode() + b"\0" + np.ascontiguousarray(t).tobytes())
    return h.hexdigest()


TRAINER = r"""
import hashlib, json, os, sys
import numpy as np
import torch
from torch.utils.data import DataLoader
from tokenfeed.client import Client
from tokenfeed.client.torch import TokenFeedDataset

target, ckpt, log = sys.argv[1], sys.argv[2], sys.argv[5]
stop_after, end = int(sys.argv[3]), int(sys.argv[4])
data = TokenFeedDataset(Client(target, job="main"), rank=0, world_size=1, end_step=end)
if os.path.exists(ckpt):
    data.load_state_dict(torch.load(ckpt))
seen = []
for i, batch in enumerate(DataLoader(data, batch_size=None)):
    assert all(t.dtype == torch.int32 for t in batch.values())
    seen.append(hashlib.sha256(b"".join(k.encode() + b"\0" + t.numpy().tobytes()
                                        for k, t in batch.items())).hexdigest())
    if i + 1 == stop_after:
        torch.save(data.state_dict(), ckpt)   # the trainer's checkpoint, then it exits
        break
with open(log, "a") as f:
    f.write(json.dumps(seen) + "\n")
"""


def test_checkpoint_exit_and_resume_in_a_new_process(server, tmp_path):
    script, ckpt, log = tmp_path / "trainer.py", tmp_path / "data.pt", tmp_path / "log.jsonl"
    script.write_text(TRAINER)
    for stop_after in (7, 10**9):  # first process stops after 7 steps, second runs to the end
        run = subprocess.run(
            [
                sys.executable,
                str(script),
                server.address,
                str(ckpt),
                str(stop_after),
                "30",
                str(log),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
    first, second = (json.loads(line) for line in log.read_text().splitlines())
    with Client(server.address, job="main") as c:
        uninterrupted = [digest(c.get_batch(s)) for s in range(30)]
    assert len(first) == 7
    assert first + second == uninterrupted
    assert torch.load(ckpt)["next_step"] == 7


def test_state_dict_refuses_a_checkpoint_of_another_job_definition(server):
    data = TokenFeedDataset(Client(server.address, job="main"))
    state = {"next_step": 3, "job": "main", "job_fingerprint": "0" * 32}
    with pytest.raises(JobMismatch, match="changed since the checkpoint"):
        data.load_state_dict(state)
    with pytest.raises(ValueError, match="checkpoint is for job 'other'"):
        data.load_state_dict({**state, "job": "other"})


def test_dataset_yields_the_rank_slice_and_tracks_the_next_step(server):
    data = TokenFeedDataset(
        Client(server.address, job="main"), rank=1, world_size=2, start_step=4, end_step=6
    )
    batches = list(DataLoader(data, batch_size=None))
    assert data.state_dict()["next_step"] == 6 and len(batches) == 2
    with Client(server.address, job="main") as c:
        want = c.get_batch(5, rank=1, world_size=2)
    got = batches[1]
    assert set(got) == set(want) and all(
        torch.equal(got[k], torch.from_numpy(want[k].copy())) for k in want
    )
    assert digest({k: t.numpy() for k, t in got.items()}) == digest(want)
    # On a device: the compact form moves, the tensors are derived there, equal again.
    on_device = TokenFeedDataset(
        Client(server.address, job="main"),
        rank=1,
        world_size=2,
        start_step=5,
        end_step=6,
        device="cpu",
    )
    [derived] = list(DataLoader(on_device, batch_size=None))
    assert digest({k: t.numpy() for k, t in derived.items()}) == digest(want)


def test_dataloader_workers_are_refused_with_the_reason(server):
    data = TokenFeedDataset(Client(server.address, job="main"), end_step=2)
    with pytest.raises(RuntimeError, match="num_workers=0"):
        list(DataLoader(data, batch_size=None, num_workers=1))


def test_a_checkpoint_taken_before_the_first_batch_resumes(server):
    fresh = TokenFeedDataset(Client(server.address, job="main"), start_step=3, end_step=5)
    state = fresh.state_dict()
    assert state == {"next_step": 3, "job": "main", "job_fingerprint": ""}
    resumed = TokenFeedDataset(Client(server.address, job="main"), end_step=5)
    resumed.load_state_dict(state)
    assert [int(b["input_ids"].shape[0]) for b in DataLoader(resumed, batch_size=None)] == [8, 8]
    assert resumed.state_dict()["next_step"] == 5 and resumed.job_fingerprint
