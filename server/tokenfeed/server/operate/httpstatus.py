"""The HTTP port for operators: `/metrics` (Prometheus text format), `/` (the status page,
statuspage.py) and `/status.json` (the same snapshot as JSON, snapshot.py).

Runs in its own thread, with a second one that samples the served tokens for the throughput
the page shows.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.jobs.job import FAILED, READY, Job
from tokenfeed.server.operate.snapshot import (
    SAMPLE_SECONDS,
    Identity,
    RecentEvents,
    Throughput,
    status,
)
from tokenfeed.server.operate.statuspage import render
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)


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


class StatusServer:
    def __init__(self, listen: str, jobs: dict[str, Job], registry=metrics.REGISTRY):
        host, _, port = listen.rpartition(":")
        self.jobs, self.events, self.throughput = jobs, RecentEvents(), Throughput(jobs)
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
        while not self._stop.wait(SAMPLE_SECONDS):
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
