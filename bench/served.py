"""Every token, at any chunk size: tokens served per epoch against tokens indexed, for corpora
laid out as real ones often are.

    python -m bench.served [--quick]

Each layout is indexed in process (the server's own build) and epoch 0 is walked through the
server's own plans: the input positions of every row that starts in epoch 0 that hold epoch-0
stream tokens are counted (a row that straddles the epoch's end lends its tail to epoch 1).
Served / indexed must be 1.0: every token of every document (and its EOS) once per epoch.
Beside it, what per-chunk packing (version 1's rule: each chunk packed on its own, its last
partial row dropped) would serve from the same chunks; version 1 also made one chunk per small
object, which lost more.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenfeed.server.commands import democorpus
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.settings import config as configmod

from bench.table import render

BATCH = 8


def _gz_files(root: Path, texts: list[str], per_file: int) -> None:
    for i in range(0, len(texts), per_file):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[i : i + per_file])
        (root / f"part-{i // per_file:05d}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))


def _plain(root: Path, texts: list[str]) -> None:
    (root / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _parquet(root: Path, texts: list[str]) -> None:
    pq.write_table(pa.table({"text": texts}), root / "all.parquet", row_group_size=4)


# (label, writer, seq_len, chunk_bytes)
LAYOUTS = [
    ("many .jsonl.gz files of 2 docs", lambda r, t: _gz_files(r, t, 2), 2048, "64MiB"),
    ("the same files, seq_len 8192", lambda r, t: _gz_files(r, t, 2), 8192, "64MiB"),
    ("one plain JSONL, 16 KiB chunks", _plain, 1024, "16KiB"),
    ("one plain JSONL, 1 KiB chunks", _plain, 256, "1KiB"),
    ("Parquet, row groups of 4 rows", _parquet, 2048, "16KiB"),
]


def measure(
    work: Path, label: str, write, seq_len: int, chunk_bytes: str, texts: list[str], tokenizer: Path
) -> list[str]:
    root = work / "corpus"
    shutil.rmtree(work, ignore_errors=True)
    root.mkdir(parents=True)
    write(root, texts)
    raw = {
        "server": {"cache_dir": str(work / "cache")},
        "jobs": {
            "j": {
                "sources": [str(root / "*")],
                "tokenizer": str(tokenizer),
                "seq_len": seq_len,
                "global_batch_size": BATCH,
                "seed": 3,
                "chunk_bytes": chunk_bytes,
                "window_chunks": 4,
            }
        },
    }
    job = build_jobs(configmod.from_dict(raw))["j"]

    async def build() -> None:
        with ThreadPoolExecutor(2) as pool:
            await job.build_index(pool, 2, retry=False)

    asyncio.run(build())
    idx = job.index
    units = idx.units_per_epoch  # document tokens + one EOS each
    end_row = -(-units // seq_len)  # rows that start in epoch 0
    served = 0
    for step in range(-(-end_row // BATCH)):
        plan = job.plan(step, 0, 1)
        for part in plan.parts:
            pc = job.planner.pieces(part)
            row = part.slots[pc.row] + step * BATCH
            inputs = np.minimum(pc.hi, pc.lo + np.maximum(seq_len - pc.at, 0)) - pc.lo
            keep = (row < end_row) & (pc.epoch == 0)
            served += int(np.maximum(inputs[keep], 0).sum())
    # Version 1: each chunk packed alone, (T - 1) // L rows of L inputs each.
    old = int(((idx.units_per_chunk - 1).clip(min=0) // seq_len * seq_len).sum())
    objects = len(list(root.iterdir()))
    return [
        label,
        f"{objects:,}",
        f"{len(idx.chunks):,}",
        str(seq_len),
        f"{units:,}",
        f"{served / units:.4f}",
        f"{old / units:.4f}",
    ]


def run(quick: bool, out: Path) -> str:
    _, tokenizer, _ = democorpus.prepare(out / "democorpus")
    texts = democorpus.documents()[: 300 if quick else 1200]
    rows = [measure(out / "served", *layout, texts, tokenizer) for layout in LAYOUTS]
    return render(
        f"Every token: tokens served per epoch / tokens indexed ({len(texts):,} documents; "
        "indexed = document tokens + one EOS each)",
        [
            "layout",
            "objects",
            "chunks",
            "seq_len",
            "tokens indexed",
            "served/indexed",
            "per-chunk rule",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(run(args.quick, Path(__file__).resolve().parent / "out"))


if __name__ == "__main__":
    main()
