"""Megatron worker: the `--dataloader-type external` iterator (micro-batches of 2 rows, gradient
accumulation), Megatron's masked loss, Megatron-Core's parallel_state for the data-parallel
rank and size, DDP on gloo, and a checkpoint in Megatron-LM's `--ckpt-format torch` layout
(iter_NNNNNNN/mp_rank_00/model_optim_rng.pt with `iteration` and the args'
`consumed_train_samples`), from which the iterator resumes.

What megatron-core 0.16.1 cannot do on a CPU-only torch: its GPTModel's attention asks for a
CUDA buffer (`get_global_memory_buffer`), and dist_checkpointing's writer calls
torch.cuda.synchronize (FileSystemWriterAsync.preload_tensors). So the model is the harness's
tiny LM and the checkpoint is written with torch.save in Megatron-LM's legacy layout; Megatron-LM
itself (megatron.training) is not on PyPI.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import Record, TinyLM, args, finish
from megatron.core import parallel_state as ps
from tokenfeed.client import Client
from tokenfeed.client.integrations.megatron import megatron_iterator

GLOBAL_BATCH, MICRO_BATCH, LR = 8, 2, 1.0


def checkpoint_file(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")


def main() -> None:
    a = args()
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(1, 1)
    dp_rank, dp_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    model = TinyLM(a["vocab"])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    record = Record(a)
    consumed = 0
    if a["ckpt_in"]:
        loaded = torch.load(checkpoint_file(a["ckpt_in"], a["resume_step"]), weights_only=False)
        model.load_state_dict(loaded["model"])
        consumed = int(loaded["args"]["consumed_train_samples"])
        record.resumed_at = consumed // GLOBAL_BATCH
    feed = Client(a["address"], job=a["job"])
    data = megatron_iterator(
        feed,
        consumed_samples=consumed,
        global_batch_size=GLOBAL_BATCH,
        dp_rank=dp_rank,
        dp_world_size=dp_world,
        micro_batch_size=MICRO_BATCH,
    )
    micro_per_step = GLOBAL_BATCH // dp_world // MICRO_BATCH
    while consumed < a["steps"] * GLOBAL_BATCH:
        step = consumed // GLOBAL_BATCH
        optimizer.zero_grad()
        tokens, labels, losses = [], [], []
        for _ in range(micro_per_step):
            micro = next(data)
            assert micro["attention_mask"] is None
            logits = ddp(micro["tokens"])
            per_token = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), micro["labels"].reshape(-1), reduction="none"
            )
            mask = micro["loss_mask"].reshape(-1)
            loss = (per_token * mask).sum() / mask.sum()  # Megatron's loss_func
            (loss / micro_per_step).backward()
            tokens.append(micro["tokens"])
            labels.append(micro["labels"])
            losses.append(loss.item())
        optimizer.step()
        consumed += GLOBAL_BATCH
        record.step(step, torch.cat(tokens), torch.cat(labels), sum(losses) / len(losses))
        if consumed == a["resume_step"] * GLOBAL_BATCH and dp_rank == 0:
            path = checkpoint_file(a["ckpt_out"], step + 1)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            state = {
                "iteration": step + 1,
                "args": {"consumed_train_samples": consumed},
                "model": model.state_dict(),
            }
            torch.save(state, path)
    finish(a, record, feed)


if __name__ == "__main__":
    main()
