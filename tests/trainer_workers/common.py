"""What every trainer worker shares: its arguments, the tiny model, and its record of what the
model consumed at each global step (tests/trainer_harness.py reads it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from trainer_harness import digest

LR = 0.02


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


def leave_process_group() -> None:
    """Destroy the process group a framework made, before the process exits. A rank that exits
    with its gloo group alive can abort while its threads are torn down ("terminate called
    without an active exception", exit -6: one CI run, rank 1 of an HF Trainer resume)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
