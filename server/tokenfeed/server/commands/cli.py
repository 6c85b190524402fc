"""`tokenfeed` command line: serve, build, inspect, explain, describe."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tokenfeed.client.errors import TokenfeedClientError
from tokenfeed.server.commands import plancli
from tokenfeed.server.commands.remote import add_credentials, remote
from tokenfeed.server.errors import ConfigError, JobFailedError, TokenfeedError
from tokenfeed.server.settings import config as configmod
from tokenfeed.server.telemetry import logs

log = logging.getLogger("tokenfeed")
# Where the remote commands look for a bearer token when no flag names one.


def _load(args) -> configmod.Config:
    cfg = configmod.load(args.config)
    server = cfg.server
    if getattr(args, "listen", None):
        server = dataclasses.replace(server, listen=args.listen)
    if getattr(args, "cache_dir", None):
        server = dataclasses.replace(server, cache_dir=args.cache_dir)
    return dataclasses.replace(cfg, server=server)


def cmd_serve(args) -> int:
    from tokenfeed.server.serve import app

    cfg = _load(args)
    logs.configure(args.log_format or cfg.server.log_format)
    app.run(cfg, ready_file=args.ready_file)
    return 0


# Seconds between two progress lines of a long step.
PROGRESS_SECONDS = 2.0


def _say(line: str) -> None:
    """A progress line: on stderr, so that stdout stays the command's answer."""
    print(line, file=sys.stderr, flush=True)


async def _report_build(job, what: str, started: float) -> None:
    """Progress lines while a job's index builds, until cancelled."""
    while True:
        await asyncio.sleep(PROGRESS_SECONDS)
        planned = f"{job.chunks_indexed}/{job.num_chunks} chunks" if job.num_chunks else "listing"
        _say(f"{what}: job {job.name}: {planned} indexed, {time.monotonic() - started:.0f}s")


def _local_batch(cfg: configmod.Config, job_name: str, step: int, rank: int, world: int):
    """Build the job's index in this process and compute the batch, with no server."""
    from tokenfeed.server.indexing.index import JobState
    from tokenfeed.server.jobs.stack import build_jobs

    spec = cfg.job(job_name)
    _say(
        f"inspect: no --target: building job {spec.name}'s index here first, tokenizing every "
        f"chunk not already in {cfg.server.cache_dir}; --target HOST:PORT asks a running "
        "server instead and prints at once"
    )
    job = build_jobs(dataclasses.replace(cfg, jobs=(spec,)))[spec.name]
    started = time.monotonic()

    async def build() -> None:
        report = asyncio.create_task(_report_build(job, "inspect", started))
        try:
            with ThreadPoolExecutor(cfg.server.tokenize_threads) as pool:
                await job.build_index(pool, cfg.server.tokenize_threads, retry=False)
        finally:
            report.cancel()
        if job.state == JobState.FAILED:
            raise JobFailedError(job.error)

    asyncio.run(build())
    _say(
        f"inspect: job {job.name}: {job.num_chunks} chunks indexed in "
        f"{time.monotonic() - started:.1f}s"
    )
    return job, job.batch(step, rank, world)[1]


def cmd_build(args) -> int:
    logs.configure("text", logging.WARNING)
    cfg = _load(args)
    names = [cfg.job(args.job).name] if args.job else cfg.job_names()
    if args.ray is not None:
        from tokenfeed.server.offline.raybuild import build_on_ray

        build_on_ray(cfg, names, args.ray, args.workers)
        return 0
    from tokenfeed.server.offline import buildpool

    workers = args.workers or os.cpu_count() or 1
    # The first job's worker processes start before this one imports what a build needs.
    started = buildpool.start_for(cfg, names[0], workers) if names else None
    from tokenfeed.server.offline.build import build

    build(cfg, names, workers, started=started)
    return 0


def _tokenizer(cfg: configmod.Config, spec: configmod.JobSpec):
    """The job's tokenizer, read where the config says (a path or an object-store URI)."""
    from tokenfeed.server.jobs.stack import object_storage
    from tokenfeed.server.tokenizer.tokenize import TextTokenizer

    try:
        raw = object_storage(cfg).read_object(spec.tokenizer.path)[1]
    except OSError as e:
        raise ConfigError(f"cannot read {spec.tokenizer.path}: {e}") from e
    return TextTokenizer(spec.tokenizer, raw)


def cmd_inspect(args) -> int:
    logs.configure("text", logging.WARNING)
    cfg = _load(args)
    spec = cfg.job(args.job)
    if args.target:
        with remote(args, spec.name) as client:
            batch = client.get_batch(args.step, rank=args.rank, world_size=args.world_size)
        arrays = dict(batch)
        tok = _tokenizer(cfg, spec)
    else:
        job, arrays = _local_batch(cfg, spec.name, args.step, args.rank, args.world_size)
        tok = job.tokenizer
    ids = arrays["input_ids"]
    print(
        f"job {spec.name} step {args.step} rank {args.rank}/{args.world_size}: "
        f"{ids.shape[0]} rows x {ids.shape[1]} tokens"
    )
    for r in range(min(args.rows, ids.shape[0])):
        segments = arrays["segment_ids"][r]
        print(f"--- row {r}: {int(segments.max())} document piece(s)")
        if args.tokens:
            print(" ".join(str(int(i)) for i in ids[r][: args.tokens]))
        text = tok.decode(ids[r])
        print(text if args.chars <= 0 else text[: args.chars])
    return 0


def cmd_explain(args) -> int:
    with remote(args, args.job) as client:
        info = client.explain(args.step, rank=args.rank, world_size=args.world_size)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(
        f"job {info['job']} step {info['step']} rank {info['rank']}/{info['world_size']} "
        f"fingerprint {info['fingerprint']}"
    )
    for row in info["rows"]:
        print(f"row {row['row']}: dataset {row['dataset']}, epoch {row['epoch']}")
        for p in row["pieces"]:
            print(
                f"  inputs [{p['row_start']}, {p['row_end']}) <- tokens "
                f"[{p['token_start']}, {p['token_end']}) of {p['source']} {p['record']}"
            )
    return 0


def cmd_describe(args) -> int:
    with remote(args) as client:
        infos = [client.describe(args.job)] if args.job else client.list_jobs()
    print(json.dumps(infos, indent=2, default=str))
    return 0


def version() -> str:
    try:
        return importlib.metadata.version("tokenfeed")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a package)"


def _output_closed() -> int:
    """The reader of our output went away (`tokenfeed explain ... | head`): what it did not read
    is not an error. Exits as a process killed by SIGPIPE does, without a traceback; stdout
    now points at /dev/null so the interpreter's last flush raises nothing either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        return _output_closed()


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="tokenfeed", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tokenfeed {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gRPC daemon")
    p.add_argument("--config", required=True, help="YAML or TOML config file")
    p.add_argument("--listen", help="override server.listen, e.g. 127.0.0.1:0")
    p.add_argument("--cache-dir", help="override server.cache_dir")
    p.add_argument("--ready-file", help="write {address, pid} as JSON here once serving")
    p.add_argument("--log-format", choices=("text", "json"), help="override server.log_format")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("build", help="tokenize the token store offline, on every core")
    p.add_argument("--config", required=True, help="YAML or TOML config file")
    p.add_argument("--job", help="one job (default: every job of the config)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="at most this many processes (default: one per core; fewer when the corpus or the "
        "cores cannot keep more busy); with --ray and no ADDRESS, the local Ray's CPUs",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="tokenize as Ray tasks on the cluster at ADDRESS (a local Ray when "
        "none is given) into the shared store (store.uri, required)",
    )
    p.add_argument("--cache-dir", help="override server.cache_dir (the local store)")
    p.set_defaults(fn=cmd_build)

    p = sub.add_parser("inspect", help="print a batch decoded back to text")
    p.add_argument("--config", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--rows", type=int, default=2, help="rows to print")
    p.add_argument("--chars", type=int, default=600, help="characters per row (0: all)")
    p.add_argument("--tokens", type=int, default=0, help="also print the first N token ids")
    p.add_argument("--target", help="fetch from this server instead of computing locally")
    p.add_argument("--cache-dir", help="override server.cache_dir (local mode)")
    add_credentials(p)
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("explain", help="where each row of a batch comes from")
    p.add_argument("--target", required=True, help="host:port of a tokenfeed server")
    p.add_argument("--job", required=True)
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the raw answer as JSON")
    add_credentials(p)
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("describe", help="print a server's jobs as JSON")
    p.add_argument("--target", required=True, help="host:port of a tokenfeed server")
    p.add_argument("--job", help="one job (default: all)")
    add_credentials(p)
    p.set_defaults(fn=cmd_describe)

    plancli.add_parser(sub)

    args = parser.parse_args(argv)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except (TokenfeedError, TokenfeedClientError) as e:
        print(f"tokenfeed: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
