"""tokenfeed benchmarks: warm serving against a raw gRPC ceiling, tokenization against the bare
engines (offline builds, a server's cold index, Ray), the client's own costs in a fleet
(decoding, waiting on data, failover), packing, and serving from object storage through the
disk cache.

    python -m bench.run [--quick] [--only SECTION ...]
                                       (from the repository root; `make bench`, `make bench-quick`)

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

from bench import (
    client,
    formats,
    mixture,
    objstore,
    packing,
    raybuild,
    scale,
    served,
    serving,
    smallobjects,
    store,
    tokenization,
    wire,
    wiretable,
)
from bench.client import ClientResult
from bench.objstore import ObjstoreResult
from bench.packing import PackingResult
from bench.serving import ServingResult
from bench.stats import median, paired_ratio, percentile
from bench.table import number, render

OUT = Path(__file__).resolve().parent / "out"
SERVING_TARGET = 0.70
FETCH_TARGET = 1.10  # bytes fetched from object storage / bytes the epoch needed, at most
WARM_RANGE = (0.90, 1.10)  # warm S3 / local tokens/s: both serve from the token cache
SECTIONS = (
    "serving",
    "tokenization",
    "client",
    "packing",
    "mixture",
    "objstore",
    "store",
    "smallobjects",
    "wire",
    "served",
    "scale",
    "raybuild",
    "formats",
)
SMALL_OBJECTS_TARGET = 0.80  # build rate of many small objects / of a few large ones
INDEX_RSS_TARGET = 300.0  # MB, a server holding the index of 300,000 chunks

QUICK = (
    serving.ServingSizes(rounds=3, unary_calls=100, stream_steps=105),
    tokenization.QUICK,
    client.ClientSizes(decodes=200, handoffs=2000, trainer_steps=250, rounds=2, failovers=3),
    packing.PackingSizes(repeats=3, calls=100),
    objstore.ObjstoreSizes(copies=4, rounds=2),
    store.StoreSizes(lookups=5),
    smallobjects.SmallObjectsSizes(objects=2000, copies=4, rounds=2),
)
FULL = (
    serving.ServingSizes(rounds=7, unary_calls=500, stream_steps=525),
    tokenization.FULL,
    client.ClientSizes(decodes=1000, handoffs=10000, trainer_steps=500, rounds=5, failovers=7),
    packing.PackingSizes(repeats=7, calls=500),
    objstore.ObjstoreSizes(copies=10, rounds=5),
    store.StoreSizes(lookups=20),
    smallobjects.SmallObjectsSizes(objects=10_000, copies=16, rounds=3),
)


def cores() -> int:
    """CPUs this process may run on (a container's limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def target(value: float, goal: float) -> str:
    return f">= {goal:.2f} ({'met' if value >= goal else 'missed'})"


def at_most(value: float, goal: float) -> str:
    return f"<= {goal:.2f} ({'met' if value <= goal else 'missed'})"


def within(value: float, low: float, high: float) -> str:
    return f"{low:.2f}-{high:.2f} ({'met' if low <= value <= high else 'missed'})"


def serving_table(r: ServingResult) -> str:
    tf, cl = r.tokenfeed, r.ceiling
    tokens = serving.SEQ_LEN * serving.GLOBAL_BATCH
    payload = tokens * 2 // 1024  # the compact wire form: uint16 tokens (plus a few starts)
    unary = paired_ratio(tf.unary_rates, cl.unary_rates)
    stream = paired_ratio(tf.stream_rates, cl.stream_rates)
    rows = [
        [
            "GetBatch latency p50 (ms)",
            number(percentile(tf.latencies, 50) * 1e3, 2),
            number(percentile(cl.latencies, 50) * 1e3, 2),
            "",
            "",
        ],
        [
            "GetBatch latency p99 (ms)",
            number(percentile(tf.latencies, 99) * 1e3, 2),
            number(percentile(cl.latencies, 99) * 1e3, 2),
            "",
            "",
        ],
        [
            "GetBatch tokens/s",
            number(median(tf.unary_rates)),
            number(median(cl.unary_rates)),
            number(unary, 2),
            target(unary, SERVING_TARGET),
        ],
        [
            "StreamBatches tokens/s",
            number(median(tf.stream_rates)),
            number(median(cl.stream_rates)),
            number(stream, 2),
            target(stream, SERVING_TARGET),
        ],
        ["batches unlike their warm-up", str(tf.mismatches), "-", "", "0"],
    ]
    title = (
        f"1. Warm serving, one client\n"
        f"   seq_len {serving.SEQ_LEN} x {serving.GLOBAL_BATCH} rows = {tokens:,} tokens "
        f"({payload} KiB) per batch; {r.steps_per_epoch} steps per epoch ({r.docs:,} docs)\n"
        f"   {len(tf.latencies)} GetBatch calls per server; tokens/s: median of "
        f"{len(tf.unary_rates)} alternating rounds; ratio: median of the rounds' ratios"
    )
    table = render(title, ["", "tokenfeed", "gRPC ceiling", "tokenfeed/ceiling", "target"], rows)
    return f"{table}\nshutdown: tokenfeed {tf.stopped.describe()}; ceiling {cl.stopped.describe()}"


def client_table(r: ClientResult) -> str:
    one, three = client.ROWS[client.ONE_RANK], client.ROWS[client.THREE_RANKS]
    costs = render(
        f"3. Client and fleet\n"
        f"3a. Client cost per batch: seq_len {serving.SEQ_LEN} x {one} rows, compact wire form; "
        f"median of {client.REPEATS} timed loops",
        ["", "us per batch"],
        [[label, number(us, 1)] for label, us in r.costs.items()],
    )
    notes = (
        "protobuf parse: pb.Batch.FromString of the serialized message (gRPC does it once)\n"
        "Batch(msg...): views over the compact wire form, with and without its xxh3 fingerprint\n"
        "hand-off: one put + get of a Batch through a bounded queue.Queue(4) between threads\n"
        "iter_batches flat out: wall time per batch from one server, no compute (server-bound)"
    )
    rows, rounds = [], 0
    for (ranks, servers), figures in r.trainers.items():
        waits, rates, used = (list(column) for column in zip(*figures, strict=True))
        compute = client.COMPUTE_SECONDS[ranks]
        rows.append(
            [
                f"{ranks} x {compute * 1e3:g} ms",
                str(servers),
                f"{median(waits):.1%}",
                number(median(rates)),
                number(1 / compute),
                str(max(used)),
            ]
        )
        rounds = len(figures)
    waits = render(
        "3b. Trainer waiting on data: iter_batches (prefetch 4), a sleep per step as compute\n"
        f"    1 rank: {one} rows, world 1; 3 ranks: {three} rows, world 3 ({three // 3} per rank),"
        " a thread and a Client each\n"
        "    waiting: time blocked in next() / wall time, the first batch (opening the stream) "
        f"not counted;\n    medians of {rounds} alternating rounds",
        [
            "ranks x compute/step",
            "servers",
            "waiting",
            "steps/s per rank",
            "1/compute",
            "servers used",
        ],
        rows,
    )
    fo = r.failovers
    ms = {
        "SIGKILL to first batch from another server (ms)": [f.to_other * 1e3 for f in fo],
        "longest gap between batches around the kill (ms)": [f.longest_gap * 1e3 for f in fo],
        "usual gap between batches before the kill (ms)": [f.usual_gap * 1e3 for f in fo],
        "batches from the killed server after the kill": [float(f.stale) for f in fo],
    }
    failover = render(
        f"3c. Failover: {len(fo)} SIGKILLs of the server streaming to 1 rank ({one} rows, "
        f"{client.COMPUTE_SECONDS[1] * 1e3:g} ms compute per step)\n"
        f"    after {client.KILL_AT} batches, {client.SERVERS} servers; the killed one "
        "restarts between repetitions",
        ["", "median", "max"],
        [[label, number(median(v), 1), number(max(v), 1)] for label, v in ms.items()],
    )
    note = (
        "the first row includes consuming the batches already read from the killed server "
        "(prefetch queue, gRPC buffers)\n"
        f"batches out of step order, all repetitions: {sum(f.out_of_order for f in fo)}"
    )
    return f"{costs}\n{notes}\n\n{waits}\n\n{failover}\n{note}"


def packing_table(r: PackingResult) -> str:
    rows = []
    for c in r.cases:
        fit, cat = median(c.bestfit_call_seconds), median(c.concat_call_seconds)
        # Same work per call on both sides, so the speed ratio is the inverse ratio of times.
        speed = paired_ratio(c.concat_call_seconds, c.bestfit_call_seconds)
        per_call = packing.ROWS_PER_CALL
        rows += [
            [
                str(c.seq_len),
                "best_fit",
                number(c.bestfit_rows),
                f"{c.padding:.4%}",
                number(packing.docs_per_second(r, c.layout_seconds)),
                number(per_call / fit),
                number(per_call * c.seq_len / fit),
                number(speed, 2),
            ],
            [
                str(c.seq_len),
                "concat",
                number(c.concat_rows),
                f"{c.dropped:.4%}",
                number(packing.docs_per_second(r, c.stream_seconds)),
                number(per_call / cat),
                number(per_call * c.seq_len / cat),
                "",
            ],
        ]
    low, high = packing.CLIP
    title = (
        f"4. Packing, in process: one chunk of {r.docs:,} docs, {r.tokens / 1e6:.1f}M tokens; "
        f"lengths log-normal, median {packing.MEDIAN_TOKENS}, sigma {packing.SIGMA}, clipped to "
        f"[{low}, {high}]; add_bos {packing.ADD_BOS}\n"
        f"   layout: median of {len(r.cases[0].layout_seconds)}; assembly: {packing.ROWS_PER_CALL}"
        f" random rows per call, {r.calls} calls per round, median of "
        f"{len(r.cases[0].bestfit_call_seconds)} alternating rounds"
    )
    header = [
        "seq_len",
        "packing",
        "rows",
        "waste",
        "layout docs/s",
        "rows/s",
        "tokens/s",
        "best_fit/concat",
    ]
    counts = "; ".join(
        f"seq_len {c.seq_len}: {number(packing.docs_per_second(r, c.count_seconds))} docs/s"
        for c in r.cases
    )
    notes = (
        "waste: best_fit, padding input slots / input slots; concat, tokens of the chunk's "
        "stream in no row (its tail) / stream tokens\n"
        "layout: bestfit_layout for best_fit, concat_stream for concat; "
        f"bestfit_rows alone (the index's row count): {counts}\n"
        "best_fit/concat: rows/s ratio, median of the rounds' ratios"
    )
    return f"{render(title, header, rows)}\n{notes}"


def objstore_table(r: ObjstoreResult) -> str:
    cold, warm = r.cold, r.warm

    def paired(label: str, figure: str, starts: dict, digits: int, goal=None) -> list[str]:
        s3, local = ([getattr(s, figure) for s in starts[side]] for side in objstore.SIDES)
        ratio = paired_ratio(s3, local)
        return [
            label,
            number(median(s3), digits),
            number(median(local), digits),
            number(ratio, 2),
            goal(ratio) if goal else "",
        ]

    def s3_only(label: str, values: list[float], digits: int, goal: str = "") -> list[str]:
        return [label, number(median(values), digits), "-", "", goal]

    fetched = [s.fetched_bytes / r.needed_bytes for s in cold["s3"]]
    requests = " / ".join(
        number(median([s.requests[op] for s in warm["s3"]])) for op in objstore.OPS
    )
    rows = [
        paired("cold start: time to first batch (s)", "first_batch", cold, 2),
        paired("cold start: GetBatch tokens/s", "rate", cold, 0),
        paired("warm restart: time to first batch (s)", "first_batch", warm, 2),
        paired(
            "warm restart: GetBatch tokens/s", "rate", warm, 0, lambda v: within(v, *WARM_RANGE)
        ),
        s3_only(
            "cold start: bytes fetched / bytes needed",
            fetched,
            3,
            at_most(median(fetched), FETCH_TARGET),
        ),
        s3_only(
            "cold start: GET requests per chunk", [s.gets / s.num_chunks for s in cold["s3"]], 2
        ),
        s3_only("warm restart: bytes fetched", [s.fetched_bytes for s in warm["s3"]], 0),
        ["warm restart: GET / HEAD / LIST requests", requests, "-", "", ""],
        ["batches unlike local files' (every step)", str(r.mismatches()), "-", "", "0"],
    ]
    c, first = r.corpus, cold["s3"][0]
    block, chunk = objstore.BLOCK_BYTES // 2**10, objstore.CHUNK_BYTES // 2**20
    title = (
        f"6. Object storage and the disk cache: S3 (moto {version('moto')} on loopback) against "
        "local files, same job\n"
        f"   corpus: {len(c.paths)} objects, {c.source_bytes / 1e6:.2f} MB ({c.jsonl} JSON Lines "
        f"cut at about {objstore.OBJECT_BYTES / 2**20:g} MiB, {c.zst} .jsonl.zst, {c.parquet} "
        f"Parquet of {objstore.PARQUET_ROW_GROUPS} row groups), {c.docs:,} docs; tokenizer.json "
        f"{r.tokenizer_bytes / 1e3:.0f} KB, from the bucket too\n"
        f"   object_store.block_bytes {block} KiB, chunk_bytes {chunk} MiB: {first.num_chunks} "
        f"chunks; seq_len {serving.SEQ_LEN} x {serving.GLOBAL_BATCH} rows, {r.steps_per_epoch} "
        "steps per epoch\n"
        f"   a new `tokenfeed serve` per start; medians of {len(fetched)} rounds (which side "
        "starts first alternates); ratios: median of the rounds' ratios"
    )
    table = render(title, ["", "S3", "local files", "S3/local", "target"], rows)
    stops = r.stops()
    bad = [s.describe() for s in stops if s.returncode != 0]
    shutdown = (
        f"all {len(stops)} servers exited 0, at most "
        f"{max(s.seconds for s in stops):.2f}s after SIGTERM"
        if not bad
        else "; ".join(bad)
    )
    notes = (
        "time to first batch: from launching the process to the answer for step 0, the client "
        "retrying while the job indexes;\n"
        "  cold: an empty cache, the whole corpus fetched and tokenized; warm: a new process on "
        "the cache the cold one left\n"
        "tokens/s: GetBatch, one client, the steps of the first epoch after step 0 (every chunk "
        "read once by the process)\n"
        "bytes needed: the source objects and tokenizer.json, each once (an epoch reads every "
        f"chunk): {r.needed_bytes:,}; fetched: tokenfeed_object_store_bytes_total after the epoch"
        f"\n  per round: {', '.join(f'{v:.3f}' for v in fetched)}\n"
        'GET requests: tokenfeed_object_store_requests_total{op="get"} (every attempt) / '
        "DescribeJob's num_chunks\n"
        f"shutdown: {shutdown}"
    )
    return f"{table}\n{notes}"


def store_table(r: store.StoreResult) -> str:
    x = r.index
    lookups = [
        [f"{int(m):,}", number(x["cold"][m] * 1e3, 2), number(x["warm"][m] * 1e3, 3)]
        for m in x["cold"]
    ]
    rss = x["hwm_mb"]
    index_title = (
        f"7. A server's index at corpus scale: {x['chunks']:,} chunks of 32M tokens in "
        f"{x['objects']:,} objects ({x['tokens'] / 1e12:.1f} trillion tokens), seq_len "
        f"{store.SEQ_LEN} x {store.BATCH} rows: {x['steps_per_epoch']:,} steps per epoch\n"
        f"   RSS: {x['rss_base_mb']:.0f} MB after imports, {x['rss_index_mb']:.0f} MB with the "
        f"index, peak {rss:.0f} MB after the lookups; target < {INDEX_RSS_TARGET:.0f} MB "
        f"({'met' if rss < INDEX_RSS_TARGET else 'missed'}); planning the index took "
        f"{x['plan_seconds']:.1f}s"
    )
    index_table = render(index_title, ["steps near", "first lookup ms", "again ms"], lookups)
    index_notes = (
        "first lookup: a random step in [m, 2m) (the first in an epoch computes that epoch's "
        "layout, O(chunks); a new window materialises its row permutation); again: the same "
        "step once more (the plan alone); medians"
    )
    return f"{index_table}\n{index_notes}"


def smallobjects_table(r: smallobjects.SmallObjectsResult, workers: int) -> str:
    small, large = r.objects["small"], r.objects["large"]
    rows = []
    for backend, label in (("local", "local files"), ("s3", "S3 (moto)")):
        s, g = r.seconds[backend, "small"], r.seconds[backend, "large"]
        ratio = paired_ratio([1 / x for x in s], [1 / x for x in g])  # rates of one workload
        rows += [
            [
                f"{label}: build MB/s of text",
                number(r.rate(median(s)), 2),
                number(r.rate(median(g)), 2),
                number(ratio, 2),
                target(ratio, SMALL_OBJECTS_TARGET),
            ],
            [f"{label}: build seconds", number(median(s), 2), number(median(g), 2), "", ""],
            [
                f"{label}: chunks",
                str(r.chunks[backend, "small"]),
                str(r.chunks[backend, "large"]),
                "",
                "",
            ],
        ]
    rows.append(
        [
            f"moto: bare GETs of the {small:,} small objects (s)",
            number(median(r.bare_gets), 2),
            "-",
            "",
            "",
        ]
    )
    extra = [a - b for a, b in zip(r.seconds["s3", "small"], r.seconds["s3", "large"], strict=True)]
    title = (
        f"8. Many small objects: `tokenfeed build --workers {workers}` of the same {r.docs:,} "
        f"docs ({r.text_bytes / 1e6:.2f} MB of text) as {small:,} small .jsonl.gz objects "
        f"({r.source_bytes['small'] / small / 1e3:.1f} KB each) and as {large} large ones\n"
        f"   chunk_bytes {r.chunk_bytes:,} (the largest large object); an empty cache per build; "
        f"medians of {len(r.bare_gets)} rounds; ratio: median of the rounds' ratios"
    )
    table = render(
        title,
        ["", f"{small:,} small objects", f"{large} large objects", "small/large", "target"],
        rows,
    )
    notes = (
        "build: wall time of the whole command (listing, planning, worker start-up, tokenizing, "
        "storing)\n"
        f"bare GETs: boto3, {smallobjects.GETS_IN_FLIGHT} in flight, every small object once, in "
        "the same rounds: the floor moto puts under any reader of that layout;\n"
        "  S3 small build seconds beyond the large build's / bare GET seconds: "
        f"{paired_ratio(extra, r.bare_gets):.2f}"
    )
    return f"{table}\n{notes}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only this section (repeatable): {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--before",
        default="",
        metavar="REV",
        help="wire section: also measure the server of this earlier commit",
    )
    args = parser.parse_args()
    only = set(args.only or SECTIONS)
    (
        serving_sizes,
        tokenize_sizes,
        client_sizes,
        packing_sizes,
        objstore_sizes,
        store_sizes,
        small_sizes,
    ) = QUICK if args.quick else FULL
    threads = cores()
    OUT.mkdir(parents=True, exist_ok=True)

    print(
        f"tokenfeed bench ({'quick' if args.quick else 'full'}): {threads} cores, "
        f"Python {platform.python_version()}, grpcio {version('grpcio')}, "
        f"tokenizers {version('tokenizers')}; working files in {OUT}\n",
        flush=True,
    )
    start = time.perf_counter()
    if "serving" in only:
        print(serving_table(serving.run(serving_sizes, OUT, threads)) + "\n", flush=True)
    if "tokenization" in only:
        print(tokenization.run(tokenize_sizes, OUT) + "\n", flush=True)
    if "client" in only:
        print(client_table(client.run(client_sizes, OUT, threads)) + "\n", flush=True)
    if "packing" in only:
        print(packing_table(packing.run(packing_sizes)) + "\n", flush=True)
    if "mixture" in only:
        print(mixture.mixture_table(50 if args.quick else 200) + "\n", flush=True)
    if "objstore" in only:
        print(objstore_table(objstore.run(objstore_sizes, OUT, threads)) + "\n", flush=True)
    if "store" in only:
        print(store_table(store.run(store_sizes, OUT)) + "\n", flush=True)
    if "smallobjects" in only:
        small = smallobjects.run(small_sizes, OUT, threads)
        print(smallobjects_table(small, threads) + "\n", flush=True)
    if "wire" in only:  # StreamBatches vs the raw wire, CPU per M tokens, serving workers
        sizes = wire.QUICK if args.quick else wire.FULL
        print(wiretable.table(wire.run(sizes, OUT, args.before)) + "\n", flush=True)
    if "served" in only:  # every token: served per epoch / indexed, per corpus layout
        print(served.run(args.quick, OUT) + "\n", flush=True)
    if "scale" in only:  # GetBatch p50/p99 with 100 and 300,000 chunks
        print(scale.run(scale.QUICK if args.quick else scale.FULL, OUT) + "\n", flush=True)
    if "raybuild" in only:  # tokenfeed build --ray on a local cluster vs --workers
        print(raybuild.run(args.quick) + "\n", flush=True)
    if "formats" in only:  # build rate of MDS, Arrow, Parquet, tar against JSON Lines
        sizes = formats.QUICK if args.quick else formats.FULL
        print(formats.table(formats.run(sizes, OUT, threads), threads) + "\n", flush=True)
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
