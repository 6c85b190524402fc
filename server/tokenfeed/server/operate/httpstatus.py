"""The HTTP port for operators: `/metrics` (Prometheus text format) and `/` (a status page).

The status page is one HTML document with inline CSS and no scripts or external assets, so it
renders anywhere a browser can reach the port (a `kubectl port-forward` included): which server
it is (host, node name, version, uptime), each job's state, build progress, furthest step, each
rank's latest step, prefetch lead, cache use, throughput over the last minute and the most
recent warnings and errors. It reloads itself every few seconds with a meta refresh (no script
needed). `/status.json` gives the same content as JSON.

A page costs the same whatever the corpus: the server's identity is found once, at start, and
every other figure is a running total (jobs, datasets, ranks and cache kinds are few).

Runs in its own thread; it reads job state without locks (counters and snapshots of dicts:
a page may be a moment stale, never inconsistent enough to matter).
"""

from __future__ import annotations

import collections
import html
import importlib.metadata
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.jobs.job import FAILED, READY, Job
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)

RECENT_EVENTS = 50
_SAMPLE_SECONDS, _WINDOW_SECONDS = 5.0, 60.0
# Often enough to follow a build or a run, rarely enough that an open tab costs nothing: the
# throughput it shows is sampled every _SAMPLE_SECONDS anyway.
REFRESH_SECONDS = 5


class RecentEvents(logging.Handler):
    """The last warnings and errors, for the status page."""

    def __init__(self, size: int = RECENT_EVENTS):
        super().__init__(logging.WARNING)
        self.events: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=size)

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append((record.created, record.levelname.lower(), record.getMessage()))


class _Throughput:
    """Tokens served per second over the last minute, sampled in the background."""

    def __init__(self, jobs: dict[str, Job]):
        self.jobs = jobs
        self.samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque(
            maxlen=int(_WINDOW_SECONDS / _SAMPLE_SECONDS) + 1
        )
        self.sample()

    def sample(self) -> None:
        totals: dict[str, float] = {n: job.progress.tokens_served for n, job in self.jobs.items()}
        self.samples.append((time.monotonic(), totals))

    def rate(self, job: str) -> float:
        """From the oldest sample kept (up to a minute ago) to now."""
        t0, first = self.samples[0]
        elapsed = time.monotonic() - t0
        served = self.jobs[job].progress.tokens_served - first[job]
        return served / elapsed if elapsed > 0 else 0.0


def version() -> str:
    """The installed package's version, as `tokenfeed --version` prints it."""
    try:
        return importlib.metadata.version("tokenfeed")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a package)"


class Identity:
    """Which server a page comes from: found once, when the port opens (moments after the
    process starts, so its uptime is the server's)."""

    def __init__(self, jobs: dict[str, Job]):
        self.host = socket.gethostname()
        self.node = _shared_store_node(jobs) or self.host
        self.version = version()
        self.started = time.time()
        self._started = time.monotonic()

    def as_dict(self) -> dict:
        return {
            "host": self.host,
            "node": self.node,
            "version": self.version,
            "started": self.started,
            "uptime_seconds": round(time.monotonic() - self._started, 1),
        }


def _shared_store_node(jobs: dict[str, Job]) -> str:
    """The name this node heartbeats under in the shared store (`store.node`: the fleet's
    rendezvous hashing assigns chunks to it), or empty without a shared store."""
    for job in jobs.values():
        for index in job.indexes:
            if index.shared is not None:
                return index.shared.node
    return ""


def refresh_gauges(jobs: dict[str, Job]) -> None:
    """Job gauges read from the jobs at scrape time."""
    for name, job in jobs.items():
        state = job.state
        metrics.JOB_READY.labels(name).set(int(state == READY))
        metrics.JOB_FAILED.labels(name).set(int(state == FAILED))
        metrics.JOB_CHUNKS.labels(name).set(job.num_chunks)
        metrics.JOB_CHUNKS_BUILT.labels(name).set(job.chunks_indexed)
        p = job.progress
        metrics.PREFETCH_LEAD_STEPS.labels(name).set(max(p.lead_steps, 0))
        metrics.PREFETCH_LEAD_SECONDS.labels(name).set(p.lead_seconds)


def status(
    jobs: dict[str, Job], events: RecentEvents, throughput: _Throughput, identity: Identity
) -> dict:
    cache = next(iter(jobs.values())).store.cache if jobs else None
    out: dict[str, Any] = {
        "time": time.time(),
        "server": identity.as_dict(),
        "jobs": [],
        "cache": None,
        "events": [],
    }
    for name, job in sorted(jobs.items()):
        p = job.progress
        ranks = sorted(dict(p.ranks).items())
        out["jobs"].append(
            {
                "name": name,
                "state": job.state,
                "error": job.error,
                "fingerprint": job.fingerprint,
                "chunks": job.num_chunks,
                "chunks_built": job.chunks_indexed,
                "furthest_step": p.furthest,
                "prefetched_step": p.prefetched,
                "lead_steps": p.lead_steps,
                "lead_seconds": round(p.lead_seconds, 3),
                "step_rate": round(p.step_rate, 3),
                "tokens_per_second": round(throughput.rate(name), 1),
                "ranks": [
                    {"rank": r, "world_size": w, "step": s, "seen": t} for (r, w), (s, t) in ranks
                ],
                "plan": _plan(job),
            }
        )
    if cache is not None:
        out["cache"] = {
            "budget_bytes": cache.budget,
            "used_bytes": cache.used,
            "evictions": cache.evictions,
            "kinds": {k: {"entries": n, "bytes": b} for k, (n, b) in cache.usage().items()},
        }
    out["events"] = [{"time": t, "level": lvl, "message": m} for t, lvl, m in events.events]
    return out


def _plan(job: Job) -> dict:
    """The data plan in force and what each dataset gave the steps before the furthest one
    asked for (jobs/jobplan.py)."""
    plans = job.plans
    plan, chain = plans.plan, job.chain()
    step = max(job.progress.furthest + 1, 0)
    used = plans.consumed(step)
    keeper = plans.keeper
    return {
        "version": plans.version,
        "horizon": plans.horizon,
        "served": plans.served,
        "log": keeper.where if keeper is not None else "",
        "phase": used.phase,
        "phases": [
            {
                "start_step": p.start_step,
                "global_batch_size": p.global_batch_size,
                "seq_len": p.seq_len,
                "weights": {n: str(w) for n, w in zip(plan.names, p.weights, strict=False)},
                "fingerprint": chain[k][1] if chain else "",
            }
            for k, p in enumerate(plan.phases)
        ],
        "consumed_before_step": step,
        "consumed": [
            {"dataset": n, "rows": r, "tokens": t}
            for n, r, t in zip(plan.names, used.rows, used.tokens, strict=True)
        ],
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, h, m, s = s // 86400, s // 3600 % 24, s // 60 % 60, s % 60
    if d:
        return f"{d} d {h} h {m:02d} min"
    if h:
        return f"{h} h {m:02d} min {s:02d} s"
    return f"{m} min {s:02d} s" if m else f"{s} s"


def render(s: dict) -> str:
    e = html.escape
    srv = s["server"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{REFRESH_SECONDS}'>",
        f"<title>tokenfeed {e(srv['node'])}</title>",
        "<style>body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;"
        "padding:.25em .6em;text-align:left}th{background:#f3f3f3}.ready{color:#070}"
        ".failed{color:#b00}.indexing{color:#a60}.bar{background:#eee;width:12em;height:.8em}"
        ".bar div{background:#47a;height:100%}</style></head><body>",
        f"<h1>tokenfeed</h1><table><tr><th>host</th><td id='host'>{e(srv['host'])}</td></tr>"
        f"<tr><th>node</th><td id='node'>{e(srv['node'])}</td></tr>"
        f"<tr><th>version</th><td id='version'>{e(srv['version'])}</td></tr>"
        f"<tr><th>uptime</th><td id='uptime' data-seconds='{int(srv['uptime_seconds'])}'>"
        f"{_duration(srv['uptime_seconds'])} (since {_when(srv['started'])})</td></tr></table>"
        f"<p>as of {_when(s['time'])}, reloaded every {REFRESH_SECONDS} s; "
        "<a href='/metrics'>/metrics</a> (Prometheus), "
        "<a href='/status.json'>/status.json</a></p><h2>Jobs</h2>",
    ]
    for j in s["jobs"]:
        built = j["chunks_built"] / j["chunks"] if j["chunks"] else 0.0
        parts.append(
            f"<h3 id='job-{e(j['name'])}'>{e(j['name'])} "
            f"<span class='{e(j['state'])}'>{e(j['state'])}</span></h3><table>"
            f"<tr><th>build progress</th><td><div class='bar'><div style='width:"
            f"{100 * built:.0f}%'></div></div>{j['chunks_built']} / {j['chunks']} chunks</td></tr>"
            f"<tr><th>furthest step</th><td>{j['furthest_step']}</td></tr>"
            f"<tr><th>prefetch lead</th><td>{j['lead_steps']} steps, {j['lead_seconds']} s</td>"
            f"</tr><tr><th>step rate</th><td>{j['step_rate']} steps/s</td></tr>"
            f"<tr><th>throughput</th><td>{j['tokens_per_second']:,.0f} tokens/s (last minute)"
            f"</td></tr><tr><th>fingerprint</th><td><code>{e(j['fingerprint'])}</code></td></tr>"
        )
        if j["error"]:
            parts.append(f"<tr><th>error</th><td class='failed'>{e(j['error'])}</td></tr>")
        parts.append("</table>")
        parts.append(_render_plan(j["plan"]))
        if j["ranks"]:
            parts.append(
                "<table><tr><th>rank</th><th>world size</th><th>latest step</th>"
                "<th>last request</th></tr>"
            )
            parts += [
                f"<tr><td>{r['rank']}</td><td>{r['world_size']}</td><td>{r['step']}</td>"
                f"<td>{_when(r['seen'])}</td></tr>"
                for r in j["ranks"]
            ]
            parts.append("</table>")
    c = s["cache"]
    if c is not None:
        parts.append(
            f"<h2>Disk cache</h2><table><tr><th>use</th><td>{_mib(c['used_bytes'])} of "
            f"{_mib(c['budget_bytes'])}</td></tr><tr><th>evictions</th><td>{c['evictions']}"
            "</td></tr>"
        )
        parts += [
            f"<tr><th>{e(k)}</th><td>{v['entries']} entries, {_mib(v['bytes'])}</td></tr>"
            for k, v in sorted(c["kinds"].items())
        ]
        parts.append("</table>")
    parts.append("<h2>Recent warnings and errors</h2>")
    if s["events"]:
        parts.append("<table><tr><th>time</th><th>level</th><th>message</th></tr>")
        parts += [
            f"<tr><td>{_when(ev['time'])}</td><td>{e(ev['level'])}</td>"
            f"<td>{e(ev['message'])}</td></tr>"
            for ev in reversed(s["events"])
        ]
        parts.append("</table>")
    else:
        parts.append("<p>none</p>")
    parts.append("</body></html>")
    return "".join(parts)


def _render_plan(p: dict) -> str:
    e = html.escape
    out = [
        f"<table id='plan'><tr><th>data plan</th><td>version {p['version']}, frozen through "
        f"step {p['horizon']}, phase {p['phase']} in force; log {e(p['log'])}</td></tr></table>",
        "<table><tr><th>from step</th><th>batch</th><th>seq_len</th><th>weights</th>"
        "<th>fingerprint</th></tr>",
    ]
    for k, ph in enumerate(p["phases"]):
        mark = " class='ready'" if k == p["phase"] else ""
        weights = ", ".join(f"{e(n)} {e(w)}" for n, w in ph["weights"].items())
        out.append(
            f"<tr{mark}><td>{ph['start_step']}</td><td>{ph['global_batch_size']}</td>"
            f"<td>{ph['seq_len']}</td><td>{weights}</td>"
            f"<td><code>{e(ph['fingerprint'][:12])}</code></td></tr>"
        )
    out.append(
        f"</table><table><tr><th>dataset</th><th>rows before step "
        f"{p['consumed_before_step']}</th><th>row tokens</th></tr>"
    )
    out += [
        f"<tr><td>{e(c['dataset'])}</td><td>{c['rows']:,}</td><td>{c['tokens']:,}</td></tr>"
        for c in p["consumed"]
    ]
    out.append("</table>")
    return "".join(out)


class StatusServer:
    def __init__(self, listen: str, jobs: dict[str, Job], registry=metrics.REGISTRY):
        host, _, port = listen.rpartition(":")
        self.jobs, self.events, self.throughput = jobs, RecentEvents(), _Throughput(jobs)
        self.identity = Identity(jobs)
        logging.getLogger().addHandler(self.events)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    refresh_gauges(outer.jobs)
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                elif path in ("/", "/status"):
                    page = render(outer.status())
                    self._send(200, "text/html; charset=utf-8", page.encode())
                elif path == "/status.json":
                    body = json.dumps(outer.status())
                    self._send(200, "application/json", body.encode())
                else:
                    self._send(404, "text/plain", b"not found: try /, /metrics, /status.json\n")

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not news
                pass

        try:
            self.httpd = ThreadingHTTPServer((host or "0.0.0.0", int(port)), Handler)
        except (OSError, ValueError) as e:
            raise ConfigError(f"server.metrics_listen: cannot listen on {listen!r}: {e}") from e
        self.httpd.daemon_threads = True
        self.address = f"{host or '0.0.0.0'}:{self.httpd.server_address[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True).start()
        threading.Thread(target=self._sample, name="throughput", daemon=True).start()
        log.info("metrics and status page on http://%s/", self.address)

    def status(self) -> dict:
        return status(self.jobs, self.events, self.throughput, self.identity)

    def _sample(self) -> None:
        while not self._stop.wait(_SAMPLE_SECONDS):
            self.throughput.sample()

    def shutdown(self) -> None:
        self._stop.set()
        logging.getLogger().removeHandler(self.events)
        self.httpd.shutdown()
        self.httpd.server_close()


def start_http(listen: str, jobs: dict[str, Job], registry=None) -> StatusServer:
    """`registry`: what /metrics exposes (default: this process's metrics; a supervisor
    passes one that adds its workers' counts)."""
    return StatusServer(listen, jobs, registry if registry is not None else metrics.REGISTRY)
