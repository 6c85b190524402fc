"""Generates the tokenfeed Grafana dashboard, deploy/grafana/dashboards/tokenfeed.json.

    python deploy/grafana/dashboard.py

Edit the panels here, not the JSON: a test checks that the checked-in JSON is this script's
output, that every query parses (promtool) and that every metric and label it names exists in
tokenfeed.server.telemetry.metrics. Per-job series carry `tokenfeed_job` (the training job's name, as
tokenfeed exports it; `job` is Prometheus's scrape job).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "tokenfeed.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SERVER = 'instance=~"$instance"'
JOB = 'instance=~"$instance", tokenfeed_job=~"$tokenfeed_job"'
RATE = "$__rate_interval"


def rate(metric: str, selector: str = SERVER) -> str:
    return f"rate({metric}{{{selector}}}[{RATE}])"


def quantiles(metric: str, by: str, selector: str = SERVER) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by ({by}, le) ({rate(metric + '_bucket', selector)}))",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


class Layout:
    """Panels left to right in rows of 24 grid units; ids in order."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.row_height = 0

    def _next_id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self.y += self.row_height
        self.x, self.row_height = 0, 0
        self.panels.append(
            {
                "type": "row",
                "id": self._next_id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def panel(
        self,
        kind: str,
        title: str,
        description: str,
        targets: list[tuple[str, str]],
        unit: str,
        width: int = 8,
        height: int = 8,
        **options,
    ) -> None:
        if self.x + width > 24:
            self.y += self.row_height
            self.x, self.row_height = 0, 0
        panel = {
            "type": kind,
            "id": self._next_id(),
            "title": title,
            "description": description,
            "datasource": DATASOURCE,
            "gridPos": {"h": height, "w": width, "x": self.x, "y": self.y},
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": DATASOURCE,
                    "expr": expr,
                    "legendFormat": legend,
                    "range": True,
                }
                for i, (expr, legend) in enumerate(targets)
            ],
            "fieldConfig": {
                "defaults": {"unit": unit, **options.pop("defaults", {})},
                "overrides": [],
            },
            "options": {**_options(kind), **options},
        }
        self.panels.append(panel)
        self.x += width
        self.row_height = max(self.row_height, height)


def _options(kind: str) -> dict:
    if kind == "timeseries":
        return {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}


def _query_variable(name: str, label: str, query: str) -> dict:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def panels() -> list[dict]:
    p = Layout()
    ts = "timeseries"

    p.row("Overview")
    p.panel(
        "stat",
        "Servers serving",
        "Servers whose health is SERVING: 0 while building indexes or draining.",
        [(f"sum(tokenfeed_serving{{{SERVER}}})", "serving")],
        "short",
        width=6,
        height=4,
    )
    p.panel(
        "stat",
        "Jobs failed",
        "Jobs whose data refuses them (see the status page).",
        [
            (
                f"count(max by (tokenfeed_job) (tokenfeed_job_failed{{{JOB}}}) == 1) or vector(0)",
                "failed",
            )
        ],
        "short",
        width=6,
        height=4,
        defaults={
            "thresholds": {
                "mode": "absolute",
                "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}],
            }
        },
        reduceOptions={"calcs": ["lastNotNull"], "fields": "", "values": False},
        colorMode="background",
    )
    p.panel(
        "stat",
        "Tokens served / s",
        "Token positions sent to trainers, all jobs.",
        [(f"sum({rate('tokenfeed_served_tokens_total', JOB)})", "tokens/s")],
        "short",
        width=6,
        height=4,
    )
    hits, misses = rate("tokenfeed_cache_hits_total"), rate("tokenfeed_cache_misses_total")
    p.panel(
        "stat",
        "Cache hit ratio",
        "Cache lookups found on disk, all kinds.",
        [(f"sum({hits}) / (sum({hits}) + sum({misses}))", "hit ratio")],
        "percentunit",
        width=6,
        height=4,
    )

    p.row("Requests")
    p.panel(
        ts,
        "Requests / s by method and code",
        "RPCs finished, by gRPC status code.",
        [(f"sum by (method, code) ({rate('tokenfeed_requests_total')})", "{{method}} {{code}}")],
        "reqps",
        width=12,
    )
    p.panel(
        ts,
        "Request latency",
        "Quantiles of the time to answer a unary RPC or to produce one message of a stream.",
        quantiles("tokenfeed_request_duration_seconds", "method"),
        "s",
        width=12,
    )
    p.panel(
        ts,
        "Tokens served / s by job",
        "Token positions sent (rows x seq_len).",
        [
            (
                f"sum by (tokenfeed_job) ({rate('tokenfeed_served_tokens_total', JOB)})",
                "{{tokenfeed_job}}",
            )
        ],
        "short",
        width=12,
    )
    p.panel(
        ts,
        "Bytes served / s by job",
        "Tensor bytes sent to trainers.",
        [
            (
                f"sum by (tokenfeed_job) ({rate('tokenfeed_served_bytes_total', JOB)})",
                "{{tokenfeed_job}}",
            )
        ],
        "Bps",
        width=12,
    )

    p.row("Trainers' data wait")
    waited = f"sum by (tokenfeed_job) ({rate('tokenfeed_trainer_wait_seconds_sum', JOB)})"
    reported = f"sum by (tokenfeed_job) ({rate('tokenfeed_trainer_reported_seconds_total', JOB)})"
    p.panel(
        ts,
        "Share of time trainers waited for data",
        "Seconds the trainers were blocked in get_batch / next, over the seconds they "
        "reported (measured by the client, summed over ranks and servers). Above the "
        "TokenfeedTrainersWaiting threshold the fleet is too small: the autoscaler adds servers.",
        [(f"{waited} / {reported}", "{{tokenfeed_job}}")],
        "percentunit",
        defaults={"min": 0, "max": 1},
    )
    p.panel(
        ts,
        "Data wait per batch",
        "Quantiles of one wait (one get_batch call or iterator next), as the trainers "
        "measured them. A prefetched batch waits microseconds.",
        quantiles("tokenfeed_trainer_wait_seconds", "tokenfeed_job", JOB),
        "s",
    )
    p.panel(
        ts,
        "Waits / s and reports",
        "Batches the trainers waited for, per second; wait reports received (malformed ones "
        "are ignored and logged).",
        [
            (
                f"sum by (tokenfeed_job) ({rate('tokenfeed_trainer_wait_seconds_count', JOB)})",
                "waits {{tokenfeed_job}}",
            ),
            (
                f"sum by (outcome) ({rate('tokenfeed_wait_reports_total')})",
                "reports {{outcome}}",
            ),
        ],
        "short",
    )

    p.row("Jobs")
    p.panel(
        ts,
        "Furthest step",
        "Highest step any rank requested of the job.",
        [(f"max by (tokenfeed_job) (tokenfeed_job_furthest_step{{{JOB}}})", "{{tokenfeed_job}}")],
        "short",
    )
    p.panel(
        ts,
        "Prefetch lead (steps)",
        "Steps past the furthest request whose chunks are in "
        "the cache, per server. At 0 the trainers wait.",
        [
            (
                f"min by (tokenfeed_job, instance) (tokenfeed_job_prefetch_lead_steps{{{JOB}}})",
                "{{tokenfeed_job}} {{instance}}",
            )
        ],
        "short",
    )
    p.panel(
        ts,
        "Prefetch lead (seconds)",
        "Prefetch lead divided by the job's recent step rate.",
        [
            (
                f"min by (tokenfeed_job, instance) (tokenfeed_job_prefetch_lead_seconds{{{JOB}}})",
                "{{tokenfeed_job}} {{instance}}",
            )
        ],
        "s",
    )
    p.panel(
        "bargauge",
        "Index build progress",
        "Chunks tokenized and indexed / chunks.",
        [
            (
                f"max by (tokenfeed_job) (tokenfeed_job_chunks_built{{{JOB}}}) / "
                f"max by (tokenfeed_job) (tokenfeed_job_chunks{{{JOB}}})",
                "{{tokenfeed_job}}",
            )
        ],
        "percentunit",
        defaults={"min": 0, "max": 1},
        reduceOptions={"calcs": ["lastNotNull"], "fields": "", "values": False},
        orientation="horizontal",
        displayMode="gradient",
    )
    p.panel(
        ts,
        "Jobs ready and failed",
        "Servers on which each job is ready / failed.",
        [
            (f"sum by (tokenfeed_job) (tokenfeed_job_ready{{{JOB}}})", "ready {{tokenfeed_job}}"),
            (f"sum by (tokenfeed_job) (tokenfeed_job_failed{{{JOB}}})", "failed {{tokenfeed_job}}"),
        ],
        "short",
    )
    p.panel(
        ts,
        "Bad records skipped / s by reason",
        "Source records skipped under bad_records: skip; each is logged with its shard and line.",
        [
            (
                f"sum by (tokenfeed_job, reason) ({rate('tokenfeed_bad_records_total', JOB)})",
                "{{tokenfeed_job}} {{reason}}",
            )
        ],
        "short",
    )

    p.row("Disk cache")
    p.panel(
        ts,
        "Cache bytes vs budget",
        "Bytes held, by kind of entry, against the budget; "
        "pinned entries are being read and never evicted.",
        [
            (
                f"sum by (instance, kind) (tokenfeed_cache_bytes{{{SERVER}}})",
                "{{kind}} {{instance}}",
            ),
            (f"tokenfeed_cache_budget_bytes{{{SERVER}}}", "budget {{instance}}"),
            (f"tokenfeed_cache_pinned_bytes{{{SERVER}}}", "pinned {{instance}}"),
        ],
        "bytes",
    )
    p.panel(
        ts,
        "Hit ratio by kind",
        "Lookups found on disk / all lookups.",
        [
            (
                f"sum by (kind) ({rate('tokenfeed_cache_hits_total')}) / (sum by (kind) "
                f"({rate('tokenfeed_cache_hits_total')}) + sum by (kind) "
                f"({rate('tokenfeed_cache_misses_total')}))",
                "{{kind}}",
            )
        ],
        "percentunit",
        defaults={"min": 0, "max": 1},
    )
    p.panel(
        ts,
        "Hits and misses / s",
        "Cache lookups by outcome and kind.",
        [
            (f"sum by (kind) ({rate('tokenfeed_cache_hits_total')})", "hits {{kind}}"),
            (f"sum by (kind) ({rate('tokenfeed_cache_misses_total')})", "misses {{kind}}"),
        ],
        "ops",
    )
    p.panel(
        ts,
        "Evictions / s",
        "Entries evicted to stay under the budget, and partial or corrupt entries dropped.",
        [
            (f"sum by (kind) ({rate('tokenfeed_cache_evictions_total')})", "evicted {{kind}}"),
            (f"sum by (kind) ({rate('tokenfeed_cache_dropped_total')})", "dropped {{kind}}"),
        ],
        "ops",
    )
    p.panel(
        ts,
        "Evicted bytes / s",
        "Bytes evicted to stay under the budget.",
        [(f"sum by (kind) ({rate('tokenfeed_cache_evicted_bytes_total')})", "{{kind}}")],
        "Bps",
    )
    p.panel(
        ts,
        "Cache entries",
        "Entries in the disk cache, by kind.",
        [(f"sum by (kind) (tokenfeed_cache_entries{{{SERVER}}})", "{{kind}}")],
        "short",
    )

    p.row("Object store")
    p.panel(
        ts,
        "Requests / s by operation and outcome",
        "GET, HEAD and LIST requests: ok, retried, error.",
        [
            (
                f"sum by (op, outcome) ({rate('tokenfeed_object_store_requests_total')})",
                "{{op}} {{outcome}}",
            )
        ],
        "reqps",
    )
    p.panel(
        ts,
        "Bytes received / s",
        "Bytes received from object storage, per server.",
        [(f"sum by (instance) ({rate('tokenfeed_object_store_bytes_total')})", "{{instance}}")],
        "Bps",
    )
    p.panel(
        ts,
        "Request latency",
        "Object-store request latency quantiles, by operation.",
        quantiles("tokenfeed_object_store_request_duration_seconds", "op"),
        "s",
    )
    p.panel(
        ts,
        "Retries / s by reason",
        "Throttled, server errors, timeouts, resets, short bodies.",
        [(f"sum by (reason) ({rate('tokenfeed_object_store_retries_total')})", "{{reason}}")],
        "ops",
        width=12,
    )
    p.panel(
        ts,
        "Errors / s by reason",
        "Requests that failed for good, after every retry.",
        [(f"sum by (reason) ({rate('tokenfeed_object_store_errors_total')})", "{{reason}}")],
        "ops",
        width=12,
    )

    p.row("Tokenization")
    p.panel(
        ts,
        "Source bytes tokenized / s by job",
        "Source bytes read and tokenized.",
        [
            (
                f"sum by (tokenfeed_job) ({rate('tokenfeed_tokenized_source_bytes_total', JOB)})",
                "{{tokenfeed_job}}",
            )
        ],
        "Bps",
    )
    p.panel(
        ts,
        "Tokens produced / s by job",
        "Tokens out of the tokenizer, and documents.",
        [
            (
                f"sum by (tokenfeed_job) ({rate('tokenfeed_tokenized_tokens_total', JOB)})",
                "tokens {{tokenfeed_job}}",
            ),
            (
                f"sum by (tokenfeed_job) ({rate('tokenfeed_tokenized_documents_total', JOB)})",
                "documents {{tokenfeed_job}}",
            ),
        ],
        "short",
    )
    p.panel(
        ts,
        "Tokenizer threads busy",
        "Thread-seconds per second spent reading and "
        "tokenizing chunks: cores kept busy by tokenization.",
        [(f"sum by (instance) ({rate('tokenfeed_tokenize_seconds_total')})", "{{instance}}")],
        "short",
    )
    p.panel(
        ts,
        "Shared store chunks / s",
        "Token chunks exchanged with the shared store: published (tokenized here), indexed "
        "(manifest read instead of tokenizing), fetched (body downloaded), taken_over (another "
        "node's chunk tokenized here).",
        [
            (
                f"sum by (outcome) ({rate('tokenfeed_shared_store_chunks_total')})",
                "{{outcome}}",
            )
        ],
        "ops",
    )

    p.row("Process")
    process = f'job="tokenfeed", {SERVER}'
    p.panel(
        ts,
        "CPU cores used",
        "CPU seconds per second of the tokenfeed process.",
        [(f"rate(process_cpu_seconds_total{{{process}}}[{RATE}])", "{{instance}}")],
        "short",
    )
    p.panel(
        ts,
        "Resident memory",
        "Resident set size of the tokenfeed process.",
        [(f"process_resident_memory_bytes{{{process}}}", "{{instance}}")],
        "bytes",
    )
    p.panel(
        ts,
        "Open file descriptors",
        "Open file descriptors (cache files, sockets).",
        [
            (f"process_open_fds{{{process}}}", "open {{instance}}"),
            (f"process_max_fds{{{process}}}", "max {{instance}}"),
        ],
        "short",
    )
    p.panel(
        ts,
        "Row buffers shared by the workers / s",
        "With server.workers > 1: row buffers laid out (and written for the other workers), "
        "mapped from another worker's file, or unshared (laid out without sharing: /dev/shm "
        "full or not writable, or a layout slower than 10 s).",
        [(f"sum by (outcome) ({rate('tokenfeed_row_buffers_total')})", "{{outcome}}")],
        "ops",
    )
    p.panel(
        ts,
        "Streams moved to a less busy worker / s",
        "With server.workers > 1: StreamBatches calls a worker refused because it served more "
        "streams than another worker of its node; the client reconnected and asked again. A "
        "steady rate means streams keep starting while the workers' counts differ (e.g. ranks "
        "that reconnect often).",
        [(f"sum({rate('tokenfeed_streams_moved_total')})", "moved")],
        "ops",
    )
    return p.panels


def dashboard() -> dict:
    return {
        "uid": "tokenfeed",
        "title": "tokenfeed",
        "description": "tokenfeed servers: requests, jobs, disk cache, object store, "
        "tokenization. Generated by deploy/grafana/dashboard.py.",
        "tags": ["tokenfeed"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "type": "dashboard",
                    "name": "Annotations & Alerts",
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "current": {"text": "Prometheus", "value": "prometheus"},
                },
                _query_variable("instance", "Server", "label_values(tokenfeed_serving, instance)"),
                _query_variable(
                    "tokenfeed_job", "Job", "label_values(tokenfeed_job_ready, tokenfeed_job)"
                ),
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
