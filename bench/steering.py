"""A trainer steering its own data mixture through the service, and the run replayed from the
plan log (docs/data-plan.md).

    python -m bench.steering [--steps N] [--every K]

Rank 0 of a run reads its batches; every K steps it computes a per-dataset "loss" (here a
stand-in: the mean token id of each dataset's rows in the last K steps, scaled, which moves as
the mixture moves) and appends new weights for a step just past the frozen horizon, as a
DoReMi- or ODM-style online policy would (more weight where the loss is higher). After N steps
a second client, in a fresh connection, reads steps 0..N-1 again: the plan log is the record,
so every batch must come back bit for bit. Prints the phases appended and the replay's outcome.
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction
from pathlib import Path

import yaml
from tokenfeed.client import Client
from tokenfeed.server.commands import democorpus

from bench.procs import ServerProcess
from bench.table import render

OUT = Path(__file__).resolve().parent / "out" / "steering"


def _config(work: Path, corpus: Path, tokenizer: Path) -> Path:
    files = sorted(corpus.glob("*"))
    half = len(files) // 2
    for name, part in (("a", files[:half]), ("b", files[half:])):
        (work / name).mkdir(parents=True, exist_ok=True)
        for f in part:
            target = work / name / f.name
            if not target.exists():
                target.symlink_to(f)
    raw = {
        "server": {
            "listen": "127.0.0.1:0",
            "cache_dir": str(work / "cache"),
            "plan_freeze_steps": 4,
        },
        "jobs": {
            "steer": {
                "datasets": {
                    "a": {"sources": [str(work / "a" / "*")], "weight": 1},
                    "b": {"sources": [str(work / "b" / "*")], "weight": 1},
                },
                "tokenizer": str(tokenizer),
                "seq_len": 256,
                "global_batch_size": 16,
                "chunk_bytes": "64KiB",
                "seed": 7,
            }
        },
    }
    path = work / "steer.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def policy(losses: dict[str, float]) -> dict[str, Fraction]:
    """Weights proportional to each dataset's loss, as exact rationals (bounded periods)."""
    total = sum(losses.values()) or 1.0
    return {n: Fraction(max(1, round(100 * v / total)), 100) for n, v in losses.items()}


def run(steps: int, every: int) -> str:
    OUT.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer, _ = democorpus.prepare(OUT / "corpus")
    config = _config(OUT, corpus, tokenizer)
    for old in (OUT / "cache").glob("plans/*.json"):
        old.unlink()  # a fresh run each time: its own log
    server = ServerProcess(
        "steer",
        [sys.executable, "-m", "tokenfeed.server.commands.cli", "serve", "--config", str(config)],
        OUT,
    )
    server.start(timeout=300)
    appended: list[list[str]] = []
    try:
        first: dict[int, str] = {}
        with Client(server.address, job="steer", timeout=300) as c:
            while c.describe()["state"] != "JOB_STATE_READY":
                time.sleep(0.1)
            seen: dict[str, list[float]] = {"a": [], "b": []}
            started = time.monotonic()
            for step in range(steps):
                batch = c.get_batch(step)
                first[step] = batch.fingerprint
                rows = c.explain(step)["rows"] if step % every == every - 1 else []
                for r in rows:
                    ids = batch["input_ids"][r["row"]]
                    seen[r["dataset"]].append(float(ids.mean()))
                if rows:
                    losses = {n: sum(v) / len(v) if v else 1.0 for n, v in seen.items()}
                    weights = policy(losses)
                    horizon = c.plan()["horizon"]
                    info = c.amend_plan(horizon + 1, weights=weights)
                    appended.append(
                        [
                            str(horizon + 1),
                            ", ".join(f"{n}={w}" for n, w in weights.items()),
                            str(info["version"]),
                        ]
                    )
                    seen = {"a": [], "b": []}
            elapsed = time.monotonic() - started
        with Client(server.address, job="steer", timeout=300) as replay:
            again = {s: replay.get_batch(s).fingerprint for s in range(steps)}
            final = replay.plan(step=steps)
    finally:
        server.stop(30)
    same = sum(again[s] == first[s] for s in range(steps))
    table = render(
        f"Online mixing: rank 0 appends weights every {every} steps ({steps} steps, "
        f"{elapsed:.1f} s), then a fresh client replays steps 0..{steps - 1}",
        ["phase from step", "weights", "plan version"],
        appended[:8] + ([["...", f"{len(appended) - 8} more", ""]] if len(appended) > 8 else []),
    )
    consumed = ", ".join(f"{c['dataset']} {c['rows']} rows" for c in final["consumed"])
    verdict = "bit for bit" if same == steps else f"{steps - same} batches differ"
    return (
        f"{table}\nphases: {len(final['phases'])}; consumed before step {steps}: {consumed}\n"
        f"replay: {same}/{steps} batches equal ({verdict})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    args = parser.parse_args()
    print(run(args.steps, args.every))


if __name__ == "__main__":
    main()
