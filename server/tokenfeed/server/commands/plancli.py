"""`tokenfeed plan show` and `tokenfeed plan append`: a running job's data plan, read and amended
on its servers (docs/data-plan.md, the runbook in docs/deployment.md).

`append` takes a fleet target: servers that keep one log (a shared store) get the change once,
through one of them; servers that keep their own logs (no shared store) each get it, and any
that refuses is reported (the client library holds batches back from the first step where
servers disagree, until they agree).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokenfeed.client import Client, TokenfeedClientError
from tokenfeed.server.commands.remote import add_credentials, credentials
from tokenfeed.server.errors import ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="show or change a running job's data plan")
    verbs = p.add_subparsers(dest="verb", required=True)

    show = verbs.add_parser("show", help="the plan's phases, version, and what was consumed")
    show.add_argument("--target", required=True, help="host:port (or a fleet: h1:p,h2:p)")
    show.add_argument("--job", required=True)
    show.add_argument(
        "--step",
        type=int,
        default=0,
        help="count what the steps before this one consumed "
        "(default: the furthest step asked for, plus one)",
    )
    show.add_argument("--json", action="store_true", help="print the raw answer as JSON")
    add_credentials(show)
    show.set_defaults(fn=cmd_show)

    app = verbs.add_parser("append", help="append a phase from a future step on")
    app.add_argument("--target", required=True, help="host:port (or a fleet: h1:p,h2:p)")
    app.add_argument("--job", required=True)
    app.add_argument("--at-step", type=int, required=True, help="the new phase's first step")
    app.add_argument(
        "--weights",
        help="name=weight,... (3, 0.7 or 1/3): the weights that change; a dataset not named "
        "keeps its weight from the phase before (0 drops one)",
    )
    app.add_argument("--global-batch-size", type=int, help="omitted: the phase before's")
    app.add_argument("--seq-len", type=int, help="omitted: the phase before's")
    app.add_argument(
        "--packing",
        choices=("concat", "best_fit"),
        help="omitted: the phase before's; each dataset's rows continue where they stopped",
    )
    app.add_argument(
        "--add-dataset",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a dataset to add, with one source (repeat NAME=PATH for more sources); give it "
        "a weight with --weights",
    )
    app.add_argument(
        "--expect-version", type=int, default=0, help="refuse if the plan is at another version"
    )
    add_credentials(app)
    app.set_defaults(fn=cmd_append)


def _client(target: str, args: argparse.Namespace) -> Client:
    try:
        return Client(target, job=args.job, **credentials(args))
    except ValueError as e:  # an unreadable certificate or token file
        raise ConfigError(str(e)) from e


def _weights(text: str | None) -> dict[str, str] | None:
    if not text:
        return None
    out = {}
    for item in text.split(","):
        name, sep, weight = item.partition("=")
        if not sep or not name.strip() or not weight.strip():
            raise ConfigError(f"--weights: expected name=weight,..., got {item!r}")
        out[name.strip()] = weight.strip()
    return out


def _datasets(items: list[str]) -> list[dict[str, Any]]:
    found: dict[str, list[str]] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--add-dataset: expected NAME=PATH, got {item!r}")
        found.setdefault(name, []).append(path)
    return [{"name": n, "sources": paths} for n, paths in found.items()]


def describe(info: dict) -> str:
    """A plan as lines of text (what `plan show` prints)."""
    lines = [
        f"job {info['job']}: data plan version {info['version']}, frozen through step "
        f"{info['horizon']} (served through step {info['served']}); log {info['log']}",
        f"{'from step':>10}  {'batch':>6}  {'seq_len':>7}  {'packing':<8}  {'fingerprint':<16}  "
        "weights",
    ]
    for k, p in enumerate(info["phases"]):
        weights = ", ".join(f"{d}={w}" for d, w in zip(p["datasets"], p["weights"], strict=True))
        mark = "*" if k == info["phase"] else " "
        lines.append(
            f"{mark}{p['start_step']:>9}  {p['global_batch_size']:>6}  {p['seq_len']:>7}  "
            f"{p.get('packing', ''):<8}  "
            f"{p['fingerprint'][:16]:<16}  {weights}"
        )
    lines.append(f"consumed by the steps before step {info['step']} (* the phase in force):")
    for c in info["consumed"]:
        lines.append(f"  {c['dataset']}: {c['rows']:,} rows, {c['tokens']:,} row tokens")
    if info.get("replaced"):
        starts = ", ".join(str(p["start_step"]) for p in info["replaced"])
        lines.append(f"replaced the future phase(s) from step {starts}")
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    with _client(args.target, args) as client:
        info = client.plan(step=args.step)
    print(json.dumps(info, indent=2) if args.json else describe(info))
    return 0


def cmd_append(args: argparse.Namespace) -> int:
    change = {
        "weights": _weights(args.weights),
        "global_batch_size": args.global_batch_size,
        "seq_len": args.seq_len,
        "packing": args.packing,
        "add": _datasets(args.add_dataset),
        "expected_version": args.expect_version,
    }
    # One change per plan log: servers on one shared store keep one log.
    logs: dict[str, list[str]] = {}
    with _client(args.target, args) as fleet:
        addresses = fleet.session.fleet.addresses()  # a dns:/// target resolved
    for addr in addresses:
        with _client(addr, args) as client:
            logs.setdefault(client.plan()["log"], []).append(addr)
    failed = 0
    for log, servers in sorted(logs.items()):
        with _client(servers[0], args) as client:
            try:
                info = client.amend_plan(args.at_step, **change)
            except TokenfeedClientError as e:
                print(f"{', '.join(servers)} ({log}): refused: {e}")
                failed += 1
                continue
        print(f"{', '.join(servers)} ({log}):")
        print(describe(info))
    return 1 if failed else 0
