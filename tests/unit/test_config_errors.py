"""Config errors as a user meets them: loaded from a real file, every message names the file,
the key path and the bad value; unknown keys come first, with the closest known key."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import from_dict, load
from tokenfeed.server.settings.configparse import FILE
from tokenfeed.server.settings.configread import Items, Keys, Named, Node, join

DOCS = Path(__file__).resolve().parents[2] / "docs"


def base() -> dict:
    """A valid file with both forms of a job: sources of its own, and a scheduled mixture."""
    return {
        "server": {"listen": "127.0.0.1:0", "cache_dir": "cache"},
        "jobs": {
            "run": {
                "sources": ["data/*.jsonl"],
                "tokenizer": "tok.json",
                "seq_len": 8,
                "global_batch_size": 4,
            },
            "mix": {
                "datasets": {
                    "web": {"sources": ["web/*.jsonl"], "weight": 0.7},
                    "code": {"sources": [{"path": "code/*.parquet"}], "weight": "3/10"},
                },
                "tokenizer": {"path": "tok.json", "eos_id": 2},
                "seq_len": 8,
                "global_batch_size": 8,
                "batch_multiple_of": 2,
                "schedule": [{"start_step": 10, "weights": {"code": 1}}],
            },
        },
    }


def _steps(path: str) -> list[str | int]:
    """`jobs.mix.schedule[0].weights` -> ['jobs', 'mix', 'schedule', 0, 'weights']."""
    tokens = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    return [int(t[1:-1]) if t.startswith("[") else t for t in tokens]


def edit(raw: dict, path: str, value: object, delete: bool = False) -> dict:
    *parents, last = _steps(path)
    node = raw
    for step in parents:
        node = node[step] if isinstance(step, int) else node.setdefault(step, {})
    if delete:
        del node[last]
    else:
        node[last] = value
    return raw


def write(tmp_path: Path, raw: dict, name: str = "tf.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load(path)
    return str(info.value)


def test_the_base_file_is_valid(tmp_path):
    cfg = load(write(tmp_path, base()))
    assert cfg.job_names() == ["run", "mix"]


# ---------------------------------------------------------------- file, key path and value

# (key set, value written there, key path of the error if not the key set, the value as the
# message quotes it if not its repr)
BAD: list[tuple[str, object, str | None, str | None]] = [
    ("server.listen", "", None, None),
    ("server.metrics_listen", 9100, None, None),
    ("server.cache_dir", "", None, None),
    ("server.cache_bytes", "lots", None, None),
    ("server.cache_bytes", "0GiB", None, None),
    ("server.prefetch_steps", -1, None, None),
    ("server.tokenize_threads", 0, None, None),
    ("server.log_format", "xml", None, None),
    ("server.max_wait_seconds", -1, None, None),
    ("server.grace_seconds", "10s", None, None),
    ("server.health_listen", "", None, None),
    ("server.workers", 0, None, None),
    ("server.workers", 2000, None, None),
    ("server.workers", "many", None, None),
    ("server.stream_ahead", 0, None, None),
    ("server.stream_cache_bytes", "1 parsec", None, None),
    ("server.tls", "cert.pem", None, None),
    ("server.tls", {"cert_file": "", "key_file": "k"}, "server.tls.cert_file", "''"),
    ("server.tls", {"cert_file": "c", "key_file": 5}, "server.tls.key_file", "5"),
    ("server.auth", {"tokens_env": "my-tokens"}, "server.auth.tokens_env", "'my-tokens'"),
    ("server.auth", {}, None, "{}"),
    ("server.limits.max_request_bytes", "512B", None, "512"),
    ("server.limits.max_concurrent_rpcs", 0, None, None),
    ("server.limits.max_streams_per_connection", "x", None, None),
    ("server.limits.keepalive_seconds", 0.5, None, None),
    ("server.limits.keepalive_timeout_seconds", -1, None, None),
    ("server.limits.min_ping_seconds", -1, None, None),
    ("server.limits.idle_seconds", 0, None, None),
    ("object_store.endpoint_url", "minio:9000", None, None),
    ("object_store.region", "", None, None),
    ("object_store.addressing_style", "dns", None, None),
    ("object_store.block_bytes", "0KiB", None, None),
    ("object_store.max_concurrency", 0, None, None),
    ("object_store.max_attempts", 0, None, None),
    ("object_store.backoff_base_seconds", -1, None, None),
    ("object_store.read_timeout_seconds", "60", None, None),
    ("store", {"node": "n1"}, "store.uri", "{'node': 'n1'}"),
    ("store.uri", 5, None, None),
    ("store", {"uri": "s3://b/p/", "node_ttl_seconds": 0}, "store.node_ttl_seconds", "0"),
    ("store", {"uri": "s3://b/p/", "min_nodes": 0}, "store.min_nodes", "0"),
    ("store", {"uri": "s3://b/p/", "join_seconds": -5}, "store.join_seconds", "-5"),
    ("jobs", ["run"], None, None),
    ("jobs.bad name!", {"sources": "x"}, None, "'bad name!'"),
    ("jobs.run", "x", None, None),
    ("jobs.run.seq_len", -3, None, None),
    ("jobs.run.seq_len", "8", None, None),
    ("jobs.run.global_batch_size", 0, None, None),
    ("jobs.run.seed", -1, None, None),
    ("jobs.run.seed", 2**64, None, None),
    ("jobs.run.seed", True, None, None),
    ("jobs.run.packing", "first_fit", None, None),
    ("jobs.run.window_chunks", 0, None, None),
    ("jobs.run.bad_records", "ignore", None, None),
    ("jobs.run.chunk_bytes", "12 parsecs", None, None),
    ("jobs.run.chunk_bytes", 1.5, None, None),
    ("jobs.run.text_field", "", None, None),
    ("jobs.run.dataset", "", None, None),
    ("jobs.run.batch_multiple_of", 0, None, None),
    ("jobs.run.batch_multiple_of", 3, "jobs.run.global_batch_size", "4"),
    ("jobs.run.sources", [], None, None),
    ("jobs.run.sources", [42], "jobs.run.sources[0]", "42"),
    ("jobs.run.sources", [{"path": "a", "format": "csv"}], "jobs.run.sources[0].format", "'csv'"),
    ("jobs.run.sources[0]", {"path": "a.jsonl", "token_field": "ids"}, "*.token_field", "'ids'"),
    ("jobs.run.sources[0]", {"path": "a.idx", "text_field": "t"}, "*.text_field", "'t'"),
    ("jobs.run.sources[0]", {"path": "", "format": "jsonl"}, "*.path", "''"),
    ("jobs.run.tokenizer", "", "jobs.run.tokenizer.path", "''"),
    ("jobs.run.tokenizer", {"path": "t", "eos_id": -1}, "*.eos_id", "-1"),
    ("jobs.run.tokenizer", {"path": "t", "bos_id": "1"}, "*.bos_id", "'1'"),
    ("jobs.run.tokenizer", {"path": "t", "add_bos": "yes"}, "*.add_bos", "'yes'"),
    ("jobs.run.tokenizer", {"path": "t", "backend": "fast"}, "*.backend", "'fast'"),
    ("jobs.run.tokenizer", {"path": "t", "eos_token": ""}, "*.eos_token", "''"),
    ("jobs.mix.datasets", {}, None, None),
    ("jobs.mix.datasets.web.weight", -1, None, None),
    ("jobs.mix.datasets.web.weight", "x", None, None),
    ("jobs.mix.datasets.web.chunk_bytes", 0, None, None),
    ("jobs.mix.datasets.web.sources", "", "jobs.mix.datasets.web.sources[0].path", "''"),
    ("jobs.mix.weights", {"web": 0, "code": 0}, None, "['0', '0']"),
    ("jobs.mix.weights", {"wbe": 1}, "jobs.mix.weights.wbe", "unknown dataset; did you mean web?"),
    ("jobs.mix.weights", [1, 2], None, None),
    ("jobs.mix.sources", ["x.jsonl"], None, None),
    ("jobs.mix.schedule", {"start_step": 5}, None, None),
    ("jobs.mix.schedule[0].start_step", "10", None, None),
    ("jobs.mix.schedule[0].start_step", 0, None, "0 is not after 0"),
    ("jobs.mix.schedule[0].global_batch_size", 0, None, None),
    ("jobs.mix.schedule[0].global_batch_size", 5, None, "global_batch_size 5"),
    ("jobs.mix.schedule[0].weights", {"code": -1}, "jobs.mix.schedule[0].weights.code", "-1"),
    ("jobs.mix.schedule[0].weights", {"web": 0, "code": 0}, None, "['0', '0']"),
    (
        "jobs.mix.schedule",
        [{"start_step": 50}, {"start_step": 20}],
        "jobs.mix.schedule[1].start_step",
        "20 is not after 50",
    ),
]


def _id(case: tuple[str, object, str | None, str | None]) -> str:
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("case", BAD, ids=[_id(c) for c in BAD])
def test_every_error_names_the_file_the_key_path_and_the_value(tmp_path, case):
    key, value, where, quoted = case
    where = (where or key).replace("*", key)
    path = write(tmp_path, edit(base(), key, value))
    message = error_of(path)
    assert message.startswith(f"{path}: {where}: "), message
    assert (quoted if quoted is not None else repr(value)) in message.removeprefix(
        f"{path}: {where}: "
    ), message


@pytest.mark.parametrize(
    "key",
    [
        "jobs",
        "jobs.run.sources",
        "jobs.run.tokenizer",
        "jobs.run.seq_len",
        "jobs.run.global_batch_size",
        "jobs.mix.schedule[0].start_step",
        "jobs.mix.datasets.web.sources",
    ],
)
def test_a_missing_key_is_named_with_the_file(tmp_path, key):
    path = write(tmp_path, edit(base(), key, None, delete=True))
    assert error_of(path) == f"{path}: {key}: required"


@pytest.mark.parametrize(("text", "shown"), [("", "NoneType None"), ("- a\n", "list ['a']")])
def test_a_file_that_is_not_a_mapping_is_named(tmp_path, text, shown):
    path = tmp_path / "tf.yaml"
    path.write_text(text)
    assert error_of(path) == f"{path}: expected a mapping, got {shown}"


def test_toml_errors_name_the_file_too(tmp_path):
    path = tmp_path / "tf.toml"
    path.write_text(
        '[jobs.run]\nsources = "a.jsonl"\ntokenizer = "t.json"\nseq_len = 0\n'
        "global_batch_size = 8\n"
    )
    assert error_of(path).startswith(f"{path}: jobs.run.seq_len: expected an integer >= 1, got 0")


# ---------------------------------------------------------------- unknown keys

UNKNOWN = [
    ("jobz", {}, "jobz: unknown key; did you mean jobs?"),
    ("server.listn", "x", "server.listn: unknown key; did you mean listen?"),
    (
        "server.limits.max_concurrent_rpc",
        1,
        "server.limits.max_concurrent_rpc: unknown key; did you mean max_concurrent_rpcs?",
    ),
    (
        "server.tls",
        {"cert_file": "c", "key_file": "k", "client_ca": "ca"},
        "server.tls.client_ca: unknown key; did you mean client_ca_file?",
    ),
    (
        "server.auth.token_file",
        "t",
        "server.auth.token_file: unknown key; did you mean tokens_file?",
    ),
    ("jobs.run.seq_lenn", 8, "jobs.run.seq_lenn: unknown key; did you mean seq_len?"),
    ("jobs.run.batch_size", 8, "jobs.run.batch_size: unknown key; did you mean global_batch_size?"),
    (
        "jobs.run.tokenizer",
        {"path": "t", "eos": 2},
        "jobs.run.tokenizer.eos: unknown key; did you mean eos_id?",
    ),
    (
        "jobs.run.sources[0]",
        {"path": "x", "text_feild": "t"},
        "jobs.run.sources[0].text_feild: unknown key; did you mean text_field?",
    ),
    (
        "jobs.mix.datasets.web.weigth",
        1,
        "jobs.mix.datasets.web.weigth: unknown key; did you mean weight?",
    ),
    (
        "jobs.mix.schedule[0].start",
        5,
        "jobs.mix.schedule[0].start: unknown key; did you mean start_step?",
    ),
    (
        "object_store.endpoint",
        "http://x",
        "object_store.endpoint: unknown key; did you mean endpoint_url?",
    ),
    ("store.url", "s3://b/", "store.url: unknown key; did you mean uri?"),
    (
        "jobs.run.zzz",
        1,
        "jobs.run.zzz: unknown key; known keys: bad_records, batch_multiple_of, chunk_bytes, "
        "dataset, datasets, global_batch_size, packing, schedule, seed, seq_len, sources, "
        "text_field, tokenizer, weights, window_chunks",
    ),
]


@pytest.mark.parametrize(("key", "value", "message"), UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_an_unknown_key_is_named_with_the_closest_known_one(tmp_path, key, value, message):
    path = write(tmp_path, edit(base(), key, value))
    assert error_of(path) == f"{path}: {message}"


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        # the typo instead of the key it meant: not "jobs.run.seq_len: required"
        (
            [("jobs.run.seq_len", None, True), ("jobs.run.seq_lenn", 8, False)],
            "jobs.run.seq_lenn: unknown key; did you mean seq_len?",
        ),
        # a typo deeper than a missing key
        (
            [
                ("jobs.run.global_batch_size", None, True),
                ("jobs.run.tokenizer", {"path": "t", "eos": 1}, False),
            ],
            "jobs.run.tokenizer.eos: unknown key; did you mean eos_id?",
        ),
        # a typo in a later job than the one missing a key
        (
            [("jobs.run.seq_len", None, True), ("jobs.mix.schedule[0].weigths", {}, False)],
            "jobs.mix.schedule[0].weigths: unknown key; did you mean weights?",
        ),
        # a typo in the server, read before the jobs, while a job's value is bad
        (
            [("jobs.run.seq_len", -3, False), ("server.limits.idle_secs", 5, False)],
            "server.limits.idle_secs: unknown key; did you mean idle_seconds?",
        ),
        # no jobs at all
        (
            [("jobs", None, True), ("store.uri_", "s3://b/", False)],
            "store.uri_: unknown key; did you mean uri?",
        ),
    ],
)
def test_unknown_keys_are_reported_before_missing_or_bad_values(tmp_path, edits, message):
    raw = base()
    for key, value, delete in edits:
        edit(raw, key, value, delete)
    path = write(tmp_path, raw)
    assert error_of(path) == f"{path}: {message}"


# ---------------------------------------------------------------- the keys the parser knows


def _schema_paths(node: Node, path: str = "") -> Iterator[str]:
    if isinstance(node, Keys):
        for key, inner in node.known.items():
            yield join(path, key)
            yield from _schema_paths(inner, join(path, key))
    elif isinstance(node, Named):
        yield from _schema_paths(node.item, join(path, "*"))
    elif isinstance(node, Items):
        yield from _schema_paths(node.item, f"{path}[]")


def _present(raw: object, steps: list[str]) -> bool:
    if not steps:
        return True
    step, rest = steps[0], steps[1:]
    if step == "*":
        return isinstance(raw, dict) and any(_present(v, rest) for v in raw.values())
    if step == "[]":
        return isinstance(raw, list) and any(_present(v, rest) for v in raw)
    return isinstance(raw, dict) and step in raw and _present(raw[step], rest)


FULL = {
    "server": {
        **{"listen": "0.0.0.0:1", "metrics_listen": "0.0.0.0:2", "health_listen": "0.0.0.0:3"},
        **{"cache_dir": "c", "cache_bytes": "1GiB", "prefetch_steps": 0, "log_format": "json"},
        **{"tokenize_threads": 3, "max_wait_seconds": 1, "grace_seconds": 1, "workers": 2},
        **{"stream_ahead": 4, "stream_cache_bytes": "1MiB"},
        **{"plan_freeze_steps": 8, "plan_refresh_seconds": 2},
        "tls": {"cert_file": "c.pem", "key_file": "k.pem", "client_ca_file": "ca.pem"},
        "auth": {"tokens_file": "t", "tokens_env": "TOK"},
        "limits": {
            **{"max_request_bytes": "2KiB", "max_concurrent_rpcs": 3},
            **{"max_streams_per_connection": 4, "keepalive_seconds": 2},
            **{"keepalive_timeout_seconds": 3, "min_ping_seconds": 0, "idle_seconds": 9},
        },
    },
    "object_store": {
        **{"endpoint_url": "http://x:9000", "region": "r", "addressing_style": "virtual"},
        **{"profile": "p", "block_bytes": "1MiB", "max_concurrency": 2, "max_attempts": 3},
        **{"backoff_base_seconds": 0.5, "backoff_max_seconds": 2},
        **{"connect_timeout_seconds": 1, "read_timeout_seconds": 2},
    },
    "store": {
        **{"uri": "s3://b/p/", "node": "n1", "min_nodes": 2, "join_seconds": 5},
        **{"node_ttl_seconds": 3, "takeover_seconds": 4},
    },
    "jobs": {
        "a": {
            "sources": [
                {"path": "x.parquet", "format": "parquet", "token_field": "ids"},
                {"path": "y.jsonl", "text_field": "t"},
                {"path": "w/*.tar", "format": "webdataset", "member": "json"},
                {"path": "hub", "format": "hf", "config": "en", "split": "validation"},
            ],
            "tokenizer": {"path": "t.json", "eos_token": "</s>", "bos_token": "<s>"},
            **{"seq_len": 5, "global_batch_size": 6, "seed": 1, "packing": "best_fit"},
            **{"window_chunks": 1, "bad_records": "strict", "dataset": "other"},
        },
        "b": {
            "datasets": {
                "d1": {
                    "sources": [
                        {"path": "p/*.parquet", "format": "parquet", "token_field": "ids"},
                        {"path": "q/*.jsonl", "text_field": "x"},
                        {"path": "r/*.tar.gz", "member": "md"},
                        {"path": "s/", "format": "hf", "config": "c", "split": "test"},
                    ],
                    **{"weight": 1, "chunk_bytes": "2MiB"},
                },
                "d2": {"sources": {"path": "z", "text_field": "body"}, "text_field": "q"},
            },
            "tokenizer": {"path": "t", "eos_id": 0, "bos_id": 5, "add_bos": True, "backend": "hf"},
            **{"seq_len": 1, "global_batch_size": 2, "batch_multiple_of": 2, "weights": {"d2": 2}},
            **{"text_field": "body", "chunk_bytes": "4MiB"},
            "schedule": [
                {
                    "start_step": 3,
                    "weights": {"d1": 2.5},
                    "global_batch_size": 4,
                    "seq_len": 2,
                    "packing": "best_fit",
                }
            ],
        },
    },
}


def test_the_known_keys_are_the_keys_the_parser_reads():
    # Every key check_keys accepts is set somewhere in FULL, and FULL loads: the parser read
    # each of them (a key given but not read is refused), so none is accepted and ignored.
    missing = [
        path
        for path in _schema_paths(FILE)
        if not _present(FULL, re.sub(r"\[\]", ".[]", path).split("."))
    ]
    assert missing == []
    cfg = from_dict(copy.deepcopy(FULL), base="/base")
    assert [j.name for j in cfg.jobs] == ["a", "b"]
    assert cfg.jobs[1].batch_multiple_of == 2
    assert [p.packing for p in cfg.jobs[1].phases] == [None, "best_fit"]


# ---------------------------------------------------------------- the documented example


def test_the_documented_error_is_what_the_code_says(tmp_path, monkeypatch):
    text = (DOCS / "configuration.md").read_text()
    section = text[text.index("\n## Errors\n") :]
    config = re.findall(r"```yaml\n(.*?)```", section, re.S)[0]
    shown = re.findall(r"```text\n(.*?)```", section, re.S)[0].strip()
    (tmp_path / "tf.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    assert error_of(Path("tf.yaml")) == shown
