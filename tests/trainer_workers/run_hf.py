"""Hugging Face worker: TokenFeedTrainer training a tiny Llama (random weights, made from a
config) with DDP on gloo, checkpoints every RESUME steps, `train(resume_from_checkpoint=...)`."""

from __future__ import annotations

import os

import torch
from common import LR, Record, args, finish, lm_loss
from tokenfeed.client import Client
from tokenfeed.client.integrations.hf import TokenFeedTrainer
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments


class RecordingTrainer(TokenFeedTrainer):
    record: Record

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        # This rank's plain mean cross entropy, for the harness's comparison of curves.
        plain = lm_loss(outputs.logits.detach(), inputs["labels"])
        self.record.step(self.state.global_step, inputs["input_ids"], inputs["labels"], plain)
        return (loss, outputs) if return_outputs else loss


def main() -> None:
    a = args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=a["vocab"],
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=a["ckpt_out"],
        max_steps=a["steps"],
        save_strategy="steps",
        save_steps=a["resume_step"],
        per_device_train_batch_size=8 // a["world"],
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
        save_only_model=False,
    )
    record = Record(a)
    feed = Client(a["address"], job=a["job"])
    trainer = RecordingTrainer(model=model, args=training, feed=feed)
    trainer.record = record
    resume = None
    if a["ckpt_in"]:
        resume = os.path.join(a["ckpt_in"], f"checkpoint-{a['resume_step']}")
    trainer.add_callback(_ResumedAt(record))
    trainer.train(resume_from_checkpoint=resume)
    finish(a, record, feed)


class _ResumedAt(TrainerCallback):
    """Notes the step the Trainer restored from the checkpoint, at train begin."""

    def __init__(self, record: Record):
        self.record = record

    def on_train_begin(self, args, state, control, **kwargs):
        self.record.resumed_at = state.global_step


if __name__ == "__main__":
    main()
