"""OLMo-core worker: TokenFeedDataLoader in OLMo-core's Trainer with a tiny OLMo-core
Transformer (TransformerTrainModule, DDP on gloo), checkpointed by its CheckpointerCallback
every RESUME steps and resumed from `load_path` (the process group launched by the harness)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import LR, Record, args, finish
from olmo_core.data.data_loader import DataLoaderBase
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, LoadStrategy, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module import (
    TransformerDataParallelConfig,
    TransformerTrainModuleConfig,
)
from tokenfeed.client import Client
from tokenfeed.client.integrations.olmo_core import TokenFeedDataLoader

SEQ_LEN, ROWS = 64, 8  # the harness's job (tests/support.py job_spec)
LOSS = "train/CE loss"


class Recorder(Callback):
    """What the model consumed at each step (before the train module takes the batch apart) and
    the step's loss, as the Trainer reduces it over the ranks (the mean of their losses)."""

    def __init__(self, record: Record):
        super().__init__()
        self.record = record
        self.losses: dict[int, float] = {}

    def pre_train(self) -> None:
        self.record.resumed_at = self.trainer.global_step

    def pre_step(self, batch: dict) -> None:
        step = self.trainer.global_step - 1  # the Trainer counts from 1; the feed from 0
        self.record.step(step, batch["input_ids"], batch["labels"], float("nan"))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if LOSS in metrics:
            self.losses[step - 1] = metrics[LOSS]

    def losses_in_order(self) -> None:
        """The record's losses, step by step (common.finish writes the record)."""
        self.record.losses = [self.losses[s] for s in self.record.steps]


def main() -> None:
    a = args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = Record(a)
    feed = Client(a["address"], job=a["job"])
    model = TransformerConfig.llama_like(
        d_model=16, vocab_size=a["vocab"], n_layers=1, n_heads=2, hidden_size_multiple_of=16
    ).build(init_device="cpu")
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=ROWS // world * SEQ_LEN,
        max_sequence_length=SEQ_LEN,
        optim=AdamWConfig(lr=LR),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp),
    ).build(model, device=torch.device("cpu"))
    loader = TokenFeedDataLoader(
        feed,
        work_dir=a["work"],
        global_batch_size=ROWS * SEQ_LEN,
        dp_rank=rank,
        dp_world_size=world,
    )
    assert isinstance(loader, DataLoaderBase)
    recorder = Recorder(record)
    trainer = TrainerConfig(
        save_folder=a["ckpt_out"],
        work_dir=a["work"],
        load_path=os.path.join(a["ckpt_in"], f"step{a['resume_step']}") if a["ckpt_in"] else None,
        load_strategy=LoadStrategy.if_available,
        device="cpu",
        max_duration=Duration.steps(a["steps"]),
        metrics_collect_interval=1,
        callbacks={
            "checkpointer": CheckpointerCallback(
                save_interval=a["resume_step"], save_async=False, pre_train_checkpoint=False
            ),
            "recorder": recorder,
        },
    ).build(train_module, loader)
    trainer.fit()
    recorder.losses_in_order()
    finish(a, record, feed)


if __name__ == "__main__":
    main()
