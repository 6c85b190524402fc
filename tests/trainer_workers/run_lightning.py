"""Lightning worker: TokenFeedDataModule, DDP on gloo, ModelCheckpoint every RESUME steps,
resumed by `trainer.fit(ckpt_path=...)` (the process group launched by the harness)."""

from __future__ import annotations

import glob
import os

import lightning.pytorch as pl
import torch
from common import LR, Record, TinyLM, args, finish, lm_loss
from tokenfeed.client import Client
from tokenfeed.client.integrations.lightning import TokenFeedDataModule


class Module(pl.LightningModule):
    def __init__(self, vocab: int, record: Record):
        super().__init__()
        self.model, self.record = TinyLM(vocab), record

    def on_train_start(self) -> None:
        self.record.resumed_at = self.global_step

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model(batch["input_ids"]), batch["labels"])
        self.record.step(self.global_step, batch["input_ids"], batch["labels"], loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def main() -> None:
    a = args()
    record = Record(a)
    feed = Client(a["address"], job=a["job"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=a["world"],
        strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
        max_steps=a["steps"],
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=a["ckpt_out"], every_n_train_steps=a["resume_step"], save_top_k=-1
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=a["work"],
    )
    ckpt = None
    if a["ckpt_in"]:
        (ckpt,) = glob.glob(os.path.join(a["ckpt_in"], f"*step={a['resume_step']}.ckpt"))
    trainer.fit(Module(a["vocab"], record), datamodule=TokenFeedDataModule(feed), ckpt_path=ckpt)
    finish(a, record, feed)


if __name__ == "__main__":
    main()
