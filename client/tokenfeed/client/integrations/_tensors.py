"""A batch as the torch tensors the adapters hand to their trainers (torch imported when used).

Labels come pre-shifted from tokenfeed (labels[:, i] is the token after input_ids[:, i]) and
as int64, which torch's cross entropy wants; positions where `loss_mask` is 0 (best_fit
padding) are set to `ignore_index` so every trainer's loss skips them without a mask.
"""

from __future__ import annotations

from typing import Any

from tokenfeed.client.batch import Batch

IGNORE_INDEX = -100  # torch's cross entropy, Hugging Face and Megatron all skip this label


def torch_batch(batch: Batch, device: Any = None) -> dict[str, Any]:
    """input_ids (int64), labels (int64, IGNORE_INDEX where not trained on), position_ids,
    segment_ids (int64) and loss_mask (float32), on `device` (expanded there)."""
    import torch
    from tokenfeed.client.torch import expand

    t = expand(batch, device)
    mask = t["loss_mask"]
    labels = t["labels"].to(torch.int64).masked_fill(mask == 0, IGNORE_INDEX)
    return {
        "input_ids": t["input_ids"].to(torch.int64),
        "labels": labels,
        "position_ids": t["position_ids"].to(torch.int64),
        "segment_ids": t["segment_ids"].to(torch.int64),
        "loss_mask": mask.to(torch.float32),
    }
