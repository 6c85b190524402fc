"""Golden batches: the bytes of a fixed job over a shipped corpus and tokenizer, pinned.

Any change that alters a batch (order, packing, tokenization, store format, wire encoding: the
fingerprint is the wire form's) fails here. If the
change is deliberate, bump the format version where it applies and regenerate with
`TOKENFEED_REGEN_GOLDEN=1 python -m pytest tests/test_golden.py`, then say so in the change.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from support import DATA, TOKENIZER, ServerProcess, job_spec, write_config
from tokenfeed.client import wire
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.settings import config as configmod

GOLDEN = DATA / "golden" / "expected.json"
FULL_STEPS = (0, 5)
FINGERPRINT_STEPS = (0, 1, 2, 3, 10, 25, 26, 27, 100, 1000)


def _job(cache: Path):
    raw = {
        "server": {"cache_dir": str(cache)},
        "jobs": {
            "golden": {
                "sources": [str(DATA / "golden" / "corpus.jsonl")],
                "tokenizer": str(TOKENIZER),
                "seq_len": 48,
                "global_batch_size": 4,
                "seed": 1234,
                "chunk_bytes": "8KiB",
                "window_chunks": 3,
            }
        },
    }
    job = build_jobs(configmod.from_dict(raw))["golden"]

    async def build():
        with ThreadPoolExecutor(2) as pool:
            await job.build_index(pool, 2)

    asyncio.run(build())
    return job


def _observe(job) -> dict:
    out = {"steps_per_epoch": job.steps_per_epoch, "batches": {}}
    for step in FINGERPRINT_STEPS:
        epoch, compact = job.assemble(job.plan(step, 0, 1))
        arrays = {name: wire.expand(compact, name) for name in wire.TENSOR_NAMES}
        entry = {"epoch": epoch, "fingerprint": wire.fingerprint(compact)}
        if step in FULL_STEPS:
            entry["input_ids"] = arrays["input_ids"].tolist()
            entry["position_ids"] = arrays["position_ids"][:, :12].tolist()
            entry["segment_ids"] = arrays["segment_ids"][:, :12].tolist()
        out["batches"][str(step)] = entry
    store = job.store.root
    out["store"] = sorted(json.loads(p.read_text())["bin_blake2b"] for p in store.rglob("*.json"))
    return out


def _dump(observed: dict) -> str:
    """One line per batch and per row, so a diff shows which rows moved."""
    lines = ["{", f' "steps_per_epoch": {observed["steps_per_epoch"]},', ' "batches": {']
    items = list(observed["batches"].items())
    for i, (step, batch) in enumerate(items):
        lines.append(
            f'  "{step}": {{"epoch": {batch["epoch"]}, "fingerprint": "{batch["fingerprint"]}"'
        )
        for name in ("input_ids", "position_ids", "segment_ids"):
            if name in batch:
                rows = ",\n    ".join(json.dumps(r) for r in batch[name])
                lines[-1] += f',\n   "{name}": [\n    {rows}]'
        lines[-1] += "}" + ("," if i < len(items) - 1 else "")
    lines.append(" },")
    lines.append(f' "store": {json.dumps(observed["store"])}')
    lines.append("}")
    return "\n".join(lines) + "\n"


def test_golden_batches(tmp_path):
    observed = _observe(_job(tmp_path / "cache"))
    if os.environ.get("TOKENFEED_REGEN_GOLDEN"):
        GOLDEN.write_text(_dump(observed))
    expected = json.loads(GOLDEN.read_text())
    assert observed["steps_per_epoch"] == expected["steps_per_epoch"]
    assert observed["store"] == expected["store"], "token store bytes changed"
    for step, batch in expected["batches"].items():
        assert observed["batches"][step] == batch, f"step {step} changed"


def test_golden_batches_as_served(tmp_path):
    # The same job through a real server: the serialized messages (GetBatch and StreamBatches,
    # whose token bytes the server appends to the message itself) decode to the golden
    # batches, fingerprint and tensors alike.
    expected = json.loads(GOLDEN.read_text())["batches"]
    jobs = {
        "golden": job_spec(
            [DATA / "golden" / "corpus.jsonl"],
            seq_len=48,
            global_batch_size=4,
            seed=1234,
            chunk_bytes="8KiB",
            window_chunks=3,
        )
    }
    proc = ServerProcess(
        write_config(tmp_path / "tf.yaml", jobs, tmp_path / "cache"), tmp_path / "log"
    )
    try:
        assert proc.wait_ready("golden")["state"] == "JOB_STATE_READY", proc.log()
        with proc.client("golden") as c:
            unary = {s: c.get_batch(s) for s in FINGERPRINT_STEPS}
            streamed = {b.step: b for b in c.iter_batches(0, 4)}
    finally:
        assert proc.stop() == 0
    for step, batch in [*unary.items(), *streamed.items()]:
        want = expected[str(step)]
        assert (batch.epoch, batch.fingerprint) == (want["epoch"], want["fingerprint"]), step
        if "input_ids" in want:
            assert batch["input_ids"].tolist() == want["input_ids"]
            assert batch["position_ids"][:, :12].tolist() == want["position_ids"]
