"""torchtitan worker: TokenFeedDataLoader in torchtitan's CheckpointManager (DCP), DDP on gloo."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import LR, Record, TinyLM, args, finish, lm_loss
from tokenfeed.client import Client
from tokenfeed.client.integrations.torchtitan import TokenFeedDataLoader
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import Checkpoint as CheckpointConfig


class TrainState:
    """The step, as torchtitan's own TrainState keeps it (a DCP Stateful)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def main() -> None:
    a = args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyLM(a["vocab"])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": LR})
    schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0)
    feed = Client(a["address"], job=a["job"])
    loader = TokenFeedDataLoader(feed, rank, world)
    assert isinstance(loader, BaseDataLoader)
    state = TrainState()
    config = CheckpointConfig(
        enable=True,
        folder=os.path.basename(a["ckpt_out"]),
        interval=a["resume_step"],
        initial_load_path=(
            os.path.join(a["ckpt_in"], f"step-{a['resume_step']}") if a["ckpt_in"] else None
        ),
        initial_load_model_only=False,
    )
    checkpoint = CheckpointManager(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        checkpoint_config=config,
        sd_adapter=None,
        base_folder=os.path.dirname(a["ckpt_out"]),
    )
    record = Record(a)
    if a["ckpt_in"]:
        assert checkpoint.load(step=-1)
        record.resumed_at = state.step
    for inputs, labels in loader:
        step = state.step
        optimizers.zero_grad()
        loss = lm_loss(ddp(inputs["input"]), labels)
        loss.backward()
        optimizers.step()
        schedulers.step()
        record.step(step, inputs["input"], labels, loss.item())
        state.step += 1
        checkpoint.save(state.step, last_step=False)
        if state.step >= a["steps"]:
            break
    checkpoint.close()
    finish(a, record, feed)


if __name__ == "__main__":
    main()
