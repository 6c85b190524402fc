"""What a job's fingerprints cover: its fixed parts (format and packing versions, seed, packing,
window, BOS/EOS), and, for the job's own fingerprint, the plan it started with (version 1) and
its first datasets' content; a plan's chain covers the same fixed parts and every phase
(jobplan.py). Pure: the parts in, hex digests out."""

from __future__ import annotations

import hashlib

from tokenfeed.server.dataplan.model import DataPlan
from tokenfeed.server.pack import packing
from tokenfeed.server.settings.config import JobSpec
from tokenfeed.server.source.chunks import CHUNK_FORMAT_VERSION
from tokenfeed.server.tokenizer.tokenize import TextTokenizer


def fixed_parts(spec: JobSpec, tokenizer: TextTokenizer) -> list[str]:
    """What decides every batch of a job and never changes while it runs."""
    return [
        f"format={CHUNK_FORMAT_VERSION}",
        f"packing_version={packing.PACKING_VERSION}",
        f"seed={spec.seed}",
        f"packing={spec.packing}",
        f"window={spec.window_chunks}",
        f"eos={tokenizer.eos_id}",
        f"bos={tokenizer.bos_id}",
        f"add_bos={tokenizer.add_bos}",
    ]


def job_fingerprint(
    spec: JobSpec, tokenizer: TextTokenizer, first: DataPlan, datasets: list[str]
) -> str:
    """The job as it started: its fixed parts, the phases of its plan at version 1 and its
    first datasets' content fingerprints (`datasets`). Unchanged by amendments, so a client
    holds every server of a run to it; a phase's own seq_len counts only where it differs from
    the job's (the fingerprints of jobs configured before phases had one are unchanged)."""
    parts = fixed_parts(spec, tokenizer)
    parts.insert(2, f"seq_len={spec.seq_len}")  # where it stood before phases had their own
    parts += [
        f"phase={p.start_step}|{p.global_batch_size}|"
        + ",".join(map(str, p.weights))
        + (f"|seq_len={p.seq_len}" if p.seq_len != spec.seq_len else "")
        for p in first.phases
    ]
    parts += [f"dataset={fp}" for fp in datasets]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()
