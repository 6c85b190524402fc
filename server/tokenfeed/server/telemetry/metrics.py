"""Every Prometheus metric tokenfeed exports, declared in one place.

Names carry their unit (`_seconds`, `_bytes`, `_total`); labels are low-cardinality by rule:
`tokenfeed_job` (a handful per server), `method`, `code`, `kind`, `reason`, `op`, `outcome`.
Never a step, a rank, a chunk or an object name: those go to logs and the status page.

The training job's label is `tokenfeed_job`, not `job`: Prometheus attaches its own `job` (the
scrape job) to every series, and a scraped `job` would be renamed `exported_job` unless every
scrape config relabeled it.

The registry is private to tokenfeed (plus the standard process and platform collectors), so
a test can read every declared family and deploy files can be checked against it.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from tokenfeed.client import waits
from tokenfeed.server.telemetry.bucketed import BucketedHistogram

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Latency buckets from 0.5 ms (a cached batch on loopback) to 60 s (a request that waited for
# a chunk to be fetched and tokenized).
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# ---------------------------------------------------------------- service
REQUESTS = Counter(
    "tokenfeed_requests_total",
    "RPCs finished, by method and gRPC status code.",
    ["method", "code"],
    registry=REGISTRY,
)
# A stream's group of batches, made in one pass, counts as that many observations of its time
# per batch, added at once (telemetry/bucketed.py).
REQUEST_SECONDS = BucketedHistogram(
    "tokenfeed_request_duration_seconds",
    "Time to answer a unary RPC, or to produce one message of a stream.",
    "method",
    _LATENCY,
    REGISTRY,
)
SERVED_TOKENS = Counter(
    "tokenfeed_served_tokens_total",
    "Token positions sent to trainers (rows x seq_len).",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
STREAMS_MOVED = Counter(
    "tokenfeed_streams_moved_total",
    "StreamBatches calls a serving worker refused because it served more streams than another "
    "worker of its node (server.workers > 1); the client reconnected and asked again "
    "(client/tokenfeed/client/moves.py).",
    registry=REGISTRY,
)
ROW_BUFFERS = Counter(
    "tokenfeed_row_buffers_total",
    "Row buffers the serving workers of a node share (server.workers > 1): laid_out (by this "
    "process: the supervisor ahead of the trainers, or a worker; written for the others), "
    "mapped (taken from another process's layout in the node's arena), unshared (laid out here "
    "without writing: the other's layout was too slow, or the arena had no room or could not "
    "be written).",
    ["outcome"],
    registry=REGISTRY,
)
SERVED_BYTES = Counter(
    "tokenfeed_served_bytes_total",
    "Compact batch bytes sent to trainers (token array and document boundaries).",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
SERVING = Gauge(
    "tokenfeed_serving",
    "1 while health is SERVING (every job's index built), 0 before that and while draining.",
    registry=REGISTRY,
)

# ---------------------------------------------------------------- trainers' data waits
# Measured by the client where the trainer blocks and reported with its next request
# (tokenfeed.client.waits, serve/waits.py): the share of time trainers waited is
# rate(tokenfeed_trainer_wait_seconds_sum) / rate(tokenfeed_trainer_reported_seconds_total),
# the signal the alert and the autoscaler follow (deploy/).
TRAINER_WAIT = BucketedHistogram(
    "tokenfeed_trainer_wait_seconds",
    "Time a trainer was blocked waiting for a batch (one get_batch call or iterator next), "
    "measured by the client.",
    "tokenfeed_job",
    waits.BUCKETS,
    REGISTRY,
)
TRAINER_SECONDS = Counter(
    "tokenfeed_trainer_reported_seconds",
    "Trainers' wall-clock seconds covered by their wait reports (the denominator of the "
    "share of time they waited).",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
WAIT_REPORTS = Counter(
    "tokenfeed_wait_reports",
    "Trainers' wait reports received, by outcome (counted, malformed: ignored and logged).",
    ["outcome"],
    registry=REGISTRY,
)

# ---------------------------------------------------------------- jobs
JOB_READY = Gauge(
    "tokenfeed_job_ready",
    "1 when the job serves batches, 0 while indexing or failed.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
JOB_FAILED = Gauge(
    "tokenfeed_job_failed",
    "1 when the job's data refuses it (see the status page).",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
JOB_CHUNKS = Gauge(
    "tokenfeed_job_chunks", "Chunks in the job's corpus.", ["tokenfeed_job"], registry=REGISTRY
)
JOB_CHUNKS_BUILT = Gauge(
    "tokenfeed_job_chunks_built",
    "Chunks of the job that are tokenized and indexed.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
JOB_FURTHEST_STEP = Gauge(
    "tokenfeed_job_furthest_step",
    "Highest step any rank requested of the job.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
PREFETCH_LEAD_STEPS = Gauge(
    "tokenfeed_job_prefetch_lead_steps",
    "Steps past the furthest requested step whose chunks are in the cache.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
PREFETCH_LEAD_SECONDS = Gauge(
    "tokenfeed_job_prefetch_lead_seconds",
    "Prefetch lead in steps divided by the job's recent step rate.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
BAD_RECORDS = Counter(
    "tokenfeed_bad_records_total",
    "Source records skipped, by reason.",
    ["tokenfeed_job", "reason"],
    registry=REGISTRY,
)

# ---------------------------------------------------------------- tokenization
TOKENIZED_DOCUMENTS = Counter(
    "tokenfeed_tokenized_documents_total",
    "Documents tokenized.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
TOKENIZED_TOKENS = Counter(
    "tokenfeed_tokenized_tokens_total",
    "Tokens produced by the tokenizer.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
TOKENIZED_BYTES = Counter(
    "tokenfeed_tokenized_source_bytes_total",
    "Source bytes read to tokenize.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)
TOKENIZE_SECONDS = Counter(
    "tokenfeed_tokenize_seconds_total",
    "Thread-seconds spent reading and tokenizing chunks.",
    ["tokenfeed_job"],
    registry=REGISTRY,
)

# ---------------------------------------------------------------- disk cache
CACHE_BUDGET_BYTES = Gauge(
    "tokenfeed_cache_budget_bytes", "The disk cache's byte budget.", registry=REGISTRY
)
CACHE_BYTES = Gauge(
    "tokenfeed_cache_bytes",
    "Bytes held by the disk cache, by kind of entry.",
    ["kind"],
    registry=REGISTRY,
)
CACHE_ENTRIES = Gauge(
    "tokenfeed_cache_entries", "Entries in the disk cache, by kind.", ["kind"], registry=REGISTRY
)
CACHE_PINNED_BYTES = Gauge(
    "tokenfeed_cache_pinned_bytes",
    "Bytes of entries being read (never evicted).",
    registry=REGISTRY,
)
CACHE_HITS = Counter(
    "tokenfeed_cache_hits_total", "Cache lookups found on disk.", ["kind"], registry=REGISTRY
)
CACHE_MISSES = Counter(
    "tokenfeed_cache_misses_total",
    "Cache lookups that had to fetch or build.",
    ["kind"],
    registry=REGISTRY,
)
CACHE_EVICTIONS = Counter(
    "tokenfeed_cache_evictions_total",
    "Entries evicted to stay under the budget.",
    ["kind"],
    registry=REGISTRY,
)
CACHE_EVICTED_BYTES = Counter(
    "tokenfeed_cache_evicted_bytes_total",
    "Bytes evicted to stay under the budget.",
    ["kind"],
    registry=REGISTRY,
)
CACHE_DROPPED = Counter(
    "tokenfeed_cache_dropped_total",
    "Partial or corrupt entries removed.",
    ["kind"],
    registry=REGISTRY,
)

# ---------------------------------------------------------------- object store
STORE_CHUNKS = Counter(
    "tokenfeed_shared_store_chunks_total",
    "Token chunks exchanged with the shared store, by outcome: published (tokenized here), "
    "indexed (manifest read instead of tokenizing), fetched (body downloaded), taken_over "
    "(another node's chunk tokenized here).",
    ["outcome"],
    registry=REGISTRY,
)
OBJECT_REQUESTS = Counter(
    "tokenfeed_object_store_requests_total",
    "Object-store requests, by operation (get, head, list) and outcome (ok, retried, error).",
    ["op", "outcome"],
    registry=REGISTRY,
)
OBJECT_BYTES = Counter(
    "tokenfeed_object_store_bytes_total",
    "Bytes received from object storage.",
    registry=REGISTRY,
)
OBJECT_RETRIES = Counter(
    "tokenfeed_object_store_retries_total",
    "Object-store requests retried, by reason (throttled, server_error, timeout, reset, "
    "short_body).",
    ["reason"],
    registry=REGISTRY,
)
OBJECT_ERRORS = Counter(
    "tokenfeed_object_store_errors_total",
    "Object-store requests that failed for good, by reason.",
    ["reason"],
    registry=REGISTRY,
)
OBJECT_SECONDS = Histogram(
    "tokenfeed_object_store_request_duration_seconds",
    "Object-store request latency.",
    ["op"],
    buckets=_LATENCY,
    registry=REGISTRY,
)


def exported_names() -> set[str]:
    """Every sample name a scrape can show (counters as `_total`, histograms with their
    `_bucket`/`_sum`/`_count`), for checking dashboards and rules against."""
    names: set[str] = set()
    for family in REGISTRY.collect():
        names.add(family.name)
        if family.type == "counter":
            names.update({family.name + "_total", family.name + "_created"})
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count", "_created"))
    return names
