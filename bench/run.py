"""tokenfeed benchmarks: warm serving against a raw gRPC ceiling, and tokenization overhead.

    python -m bench.run [--quick]      (from the repository root; `make bench`, `make bench-quick`)

Prints one table per section. Targets are printed beside the figures and never asserted: the
machine this runs on decides the absolute numbers, the ratios are what the targets are about.
Working files (demo corpus, configs, caches, server logs) go under bench/out/.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from importlib.metadata import version
from pathlib import Path

from bench import serving, tokenization
from bench.serving import ServingResult
from bench.stats import median, paired_ratio, percentile
from bench.table import number, render
from bench.tokenization import TokenizationResult

OUT = Path(__file__).resolve().parent / "out"
SERVING_TARGET = 0.70
TOKENIZE_TARGET = 0.85

QUICK = (
    serving.ServingSizes(rounds=3, unary_calls=100, stream_steps=105),
    tokenization.TokenizationSizes(copies=1, repeats=3),
)
FULL = (
    serving.ServingSizes(rounds=7, unary_calls=500, stream_steps=525),
    tokenization.TokenizationSizes(copies=4, repeats=7),
)


def cores() -> int:
    """CPUs this process may run on (a container's limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def target(value: float, goal: float) -> str:
    return f">= {goal:.2f} ({'met' if value >= goal else 'missed'})"


def serving_table(r: ServingResult) -> str:
    tf, cl = r.tokenfeed, r.ceiling
    tokens = serving.SEQ_LEN * serving.GLOBAL_BATCH
    payload = tokens * 4 * 4 // 1024  # four int32 tensors
    unary = paired_ratio(tf.unary_rates, cl.unary_rates)
    stream = paired_ratio(tf.stream_rates, cl.stream_rates)
    rows = [
        ["GetBatch latency p50 (ms)", number(percentile(tf.latencies, 50) * 1e3, 2),
         number(percentile(cl.latencies, 50) * 1e3, 2), "", ""],
        ["GetBatch latency p99 (ms)", number(percentile(tf.latencies, 99) * 1e3, 2),
         number(percentile(cl.latencies, 99) * 1e3, 2), "", ""],
        ["GetBatch tokens/s", number(median(tf.unary_rates)), number(median(cl.unary_rates)),
         number(unary, 2), target(unary, SERVING_TARGET)],
        ["StreamBatches tokens/s", number(median(tf.stream_rates)),
         number(median(cl.stream_rates)), number(stream, 2), target(stream, SERVING_TARGET)],
        ["batches unlike their warm-up", str(tf.mismatches), "-", "", "0"],
    ]  # fmt: skip
    title = (
        f"1. Warm serving, one client\n"
        f"   seq_len {serving.SEQ_LEN} x {serving.GLOBAL_BATCH} rows = {tokens:,} tokens "
        f"({payload} KiB) per batch; {r.steps_per_epoch} steps per epoch ({r.docs:,} docs)\n"
        f"   {len(tf.latencies)} GetBatch calls per server; tokens/s: median of "
        f"{len(tf.unary_rates)} alternating rounds; ratio: median of the rounds' ratios"
    )
    table = render(title, ["", "tokenfeed", "gRPC ceiling", "tokenfeed/ceiling", "target"], rows)
    return f"{table}\nshutdown: tokenfeed {tf.stopped.describe()}; ceiling {cl.stopped.describe()}"


def tokenization_table(r: TokenizationResult) -> str:
    # Rates of one workload: the ratio of rates is the inverse ratio of times, repeat by repeat.
    value = paired_ratio(r.bare_seconds, r.index_seconds)

    def row(label: str, per_second) -> list[str]:
        bare, index = per_second(r.bare_seconds), per_second(r.index_seconds)
        return [label, number(bare, 2), number(index, 2), number(value, 2),
                target(value, TOKENIZE_TARGET)]  # fmt: skip

    rows = [
        ["seconds (median)", number(median(r.bare_seconds), 3),
         number(median(r.index_seconds), 3), "", ""],
        row("docs/s", r.docs_per_second),
        row("MB/s of text", r.mb_per_second),
    ]  # fmt: skip
    title = (
        f"2. Tokenization, same tokenizer and texts\n"
        f"   {r.docs:,} docs, {r.text_bytes / 1e6:.2f} MB of text; JSONL in {r.chunks} chunks of "
        f"{tokenization.CHUNK_BYTES}; tokenize_threads {r.threads}\n"
        f"   median of {len(r.bare_seconds)} alternating repeats; ratio: median of the repeats' "
        "ratios"
    )
    header = ["", "encode_batch_fast loop", "tokenfeed index build", "index/loop", "target"]
    return render(title, header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    args = parser.parse_args()
    serving_sizes, tokenize_sizes = QUICK if args.quick else FULL
    threads = cores()
    OUT.mkdir(parents=True, exist_ok=True)

    print(f"tokenfeed bench ({'quick' if args.quick else 'full'}): {threads} cores, "
          f"Python {platform.python_version()}, grpcio {version('grpcio')}, "
          f"tokenizers {version('tokenizers')}; working files in {OUT}\n", flush=True)  # fmt: skip
    start = time.perf_counter()
    served = serving.run(serving_sizes, OUT, threads)
    print(serving_table(served) + "\n", flush=True)
    print(tokenization_table(tokenization.run(tokenize_sizes, OUT, threads)) + "\n")
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
