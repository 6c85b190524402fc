"""What every trainer worker shares: its arguments, the tiny model, and its record of what the
model consumed at each global step (tests/trainer_harness.py reads it)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from trainer_harness import digest

LR = 0.02

# A worker that hangs prints every thread's stack to its log before the harness kills it.
faulthandler.dump_traceback_later(float(os.environ.get("TOKENFEED_WORKER_STACKS_AFTER", 200)))


def args() -> dict:
    return json.loads(sys.argv[1])


class TinyLM(torch.nn.Module):
    """An embedding and a projection: a few thousand parameters, seeded identically in every
    run and process, so an uninterrupted run and a resumed one can be compared step by step."""

    def __init__(self, vocab: int, dim: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(input_ids))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100
    )


class Record:
    """Per global step: the digest of the rows this rank trained on, and its loss."""

    def __init__(self, a: dict):
        self.path = Path(a["out"])
        self.steps: list[int] = []
        self.digests: list[str] = []
        self.losses: list[float] = []
        self.resumed_at: int | None = None

    def step(self, step: int, input_ids, labels, loss: float) -> None:
        """input_ids and labels: torch tensors or numpy arrays."""
        self.steps.append(int(step))
        self.digests.append(digest(np.asarray(input_ids), np.asarray(labels)))
        self.losses.append(float(loss))

    def write(self) -> None:
        data = {
            "steps": self.steps,
            "digests": self.digests,
            "losses": self.losses,
            "resumed_at": self.resumed_at,
        }
        self.path.write_text(json.dumps(data))


def finish(a: dict, record: Record, feed) -> None:
    """Write this rank's record, close its Client, wait until every rank of the run has done
    the same, and exit at once, skipping torch's teardown of the process group.

    That teardown failed in CI three times, each time after the run had finished and been
    recorded: an HF rank aborted at exit with its gloo group alive ("terminate called without an
    active exception", exit -6); an HF rank hung past the harness's deadline after destroying
    the group; a Megatron rank hung in the destructors of its main function's locals after
    destroying it (the stacks the watchdog above printed ended at `main()`). None of this is
    what the tests check. The ranks meet through files, not through gloo, so no collective is in
    flight when the first one exits; a Client that does not close in time shows in the
    watchdog's stacks too."""
    record.write()
    feed.close()
    work = Path(a["work"])
    work.mkdir(parents=True, exist_ok=True)
    (work / f"done.rank{a['rank']}").touch()
    deadline = time.monotonic() + 60
    while not all((work / f"done.rank{r}").exists() for r in range(a["world"])):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other ranks of the run did not finish within 60 s ({work})")
        time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
