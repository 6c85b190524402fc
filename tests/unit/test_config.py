"""Config: YAML and TOML parse to the same frozen specs; every error names key path and value."""

from __future__ import annotations

import copy
import dataclasses
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import (
    Config,
    DatasetSpec,
    JobSpec,
    PhaseSpec,
    ServerSpec,
    SourceSpec,
    TokenizerSpec,
    from_dict,
    load,
)
from tokenfeed.server.settings.configread import parse_size

YAML = """\
server:
  listen: 0.0.0.0:6000
  cache_dir: cache
  tokenize_threads: 4
  log_format: json
  max_wait_seconds: 5
jobs:
  demo:
    sources:
      - data/*.jsonl
      - path: s3://bucket/corpus/*.parquet
        format: parquet
        text_field: content
    tokenizer:
      path: tok/tokenizer.json
      eos_id: 2
      bos_id: 1
      add_bos: true
    seq_len: 2048
    global_batch_size: 64
    seed: 1234
    window_chunks: 4
    chunk_bytes: 16MiB
    bad_records: strict
"""

TOML = """\
[server]
listen = "0.0.0.0:6000"
cache_dir = "cache"
tokenize_threads = 4
log_format = "json"
max_wait_seconds = 5

[jobs.demo]
seq_len = 2048
global_batch_size = 64
seed = 1234
window_chunks = 4
chunk_bytes = "16MiB"
bad_records = "strict"
tokenizer = { path = "tok/tokenizer.json", eos_id = 2, bos_id = 1, add_bos = true }

[[jobs.demo.sources]]
path = "data/*.jsonl"

[[jobs.demo.sources]]
path = "s3://bucket/corpus/*.parquet"
format = "parquet"
text_field = "content"
"""


def expected(base: Path, origin: str) -> Config:
    sources = (
        SourceSpec(str(base / "data/*.jsonl")),
        SourceSpec("s3://bucket/corpus/*.parquet", "parquet", "content"),
    )
    job = JobSpec(
        name="demo",
        datasets=(DatasetSpec("main", sources, 16 * 2**20),),
        tokenizer=TokenizerSpec(str(base / "tok/tokenizer.json"), eos_id=2, bos_id=1, add_bos=True),
        seq_len=2048,
        phases=(PhaseSpec(0, 64, (Fraction(1),)),),
        seed=1234,
        window_chunks=4,
        bad_records="strict",
    )
    server = ServerSpec(
        "0.0.0.0:6000",
        cache_dir=str(base / "cache"),
        tokenize_threads=4,
        log_format="json",
        max_wait_seconds=5.0,
    )
    return Config(server=server, jobs=(job,), origin=origin)


@pytest.mark.parametrize(("name", "text"), [("tf.yaml", YAML), ("tf.yml", YAML), ("tf.toml", TOML)])
def test_good_files_load(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    cfg = load(path)
    # Relative paths resolve against the config file's directory, not the working directory.
    assert cfg == expected(tmp_path.resolve(), str(path))
    assert cfg.job("demo") is cfg.jobs[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.jobs[0].seq_len = 1  # type: ignore[misc]


def minimal() -> dict:
    return {
        "jobs": {
            "demo": {
                "sources": ["data/*.jsonl"],
                "tokenizer": "tok.json",
                "seq_len": 8,
                "global_batch_size": 4,
            }
        }
    }


def test_defaults_and_shorthands():
    cfg = from_dict(minimal(), base="/base")
    job = cfg.job("demo")
    (dataset,) = job.datasets
    assert dataset.sources == (SourceSpec("/base/data/*.jsonl", "auto", "text"),)
    assert job.tokenizer == TokenizerSpec("/base/tok.json")
    assert (job.seed, job.packing, dataset.name, job.window_chunks) == (0, "concat", "main", 8)
    assert (dataset.chunk_bytes, job.bad_records) == (64 * 2**20, "skip")
    assert cfg.server == ServerSpec(cache_dir="/base/.tokenfeed-cache")


def test_job_text_field_is_the_default_for_its_sources():
    raw = minimal()
    raw["jobs"]["demo"]["text_field"] = "body"
    raw["jobs"]["demo"]["sources"] = ["a.jsonl", {"path": "b.jsonl", "text_field": "content"}]
    job = from_dict(raw).job("demo")
    assert [s.text_field for s in job.datasets[0].sources] == ["body", "content"]


def test_single_source_string_is_a_list_of_one():
    raw = minimal()
    raw["jobs"]["demo"]["sources"] = "/abs/*.jsonl"
    assert from_dict(raw).job("demo").datasets[0].sources == (SourceSpec("/abs/*.jsonl"),)


def test_unknown_job_name_lists_the_jobs():
    with pytest.raises(ConfigError, match=r"'nope'.*\['demo'\]"):
        from_dict(minimal()).job("nope")


def job_set(key: str, value):
    def edit(raw: dict) -> None:
        raw["jobs"]["demo"][key] = value

    return edit


def job_del(key: str):
    def edit(raw: dict) -> None:
        del raw["jobs"]["demo"][key]

    return edit


def nested_set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(raw: dict) -> None:
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value

    return edit


# (edit, substrings the message must contain: the key path, then the bad value as written)
BAD = {
    "negative seq_len": (job_set("seq_len", -3), ["jobs.demo.seq_len", "-3"]),
    "zero global_batch_size": (
        job_set("global_batch_size", 0),
        ["jobs.demo.global_batch_size", "0"],
    ),
    "string seq_len": (job_set("seq_len", "8"), ["jobs.demo.seq_len", "'8'"]),
    "bool seed": (job_set("seed", True), ["jobs.demo.seed", "True"]),
    "negative seed": (job_set("seed", -1), ["jobs.demo.seed", "-1"]),
    "huge seed": (job_set("seed", 2**64), ["jobs.demo.seed", str(2**64)]),
    "unknown job key": (job_set("seq_length", 8), ["jobs.demo.seq_length", "unknown key"]),
    "unknown top key": (nested_set("jobz", {}), ["jobz", "unknown key"]),
    "unknown server key": (nested_set("server", "port", 1), ["server.port", "unknown key"]),
    "bad packing": (job_set("packing", "first_fit"), ["jobs.demo.packing", "'first_fit'"]),
    "bad policy": (job_set("bad_records", "ignore"), ["jobs.demo.bad_records", "'ignore'"]),
    "bad size": (job_set("chunk_bytes", "12 parsecs"), ["jobs.demo.chunk_bytes", "'12 parsecs'"]),
    "zero size": (job_set("chunk_bytes", "0MiB"), ["jobs.demo.chunk_bytes", "'0MiB'"]),
    "float size": (job_set("chunk_bytes", 1.5), ["jobs.demo.chunk_bytes", "1.5"]),
    "zero window": (job_set("window_chunks", 0), ["jobs.demo.window_chunks", "0"]),
    "missing tokenizer": (job_del("tokenizer"), ["jobs.demo.tokenizer", "required"]),
    "null tokenizer": (job_set("tokenizer", None), ["jobs.demo.tokenizer", "required"]),
    "missing seq_len": (job_del("seq_len"), ["jobs.demo.seq_len", "required"]),
    "empty sources": (job_set("sources", []), ["jobs.demo.sources", "[]"]),
    "missing sources": (job_del("sources"), ["jobs.demo.sources", "required"]),
    "bad source format": (
        job_set("sources", ["a.jsonl", {"path": "b", "format": "csv"}]),
        ["jobs.demo.sources[1].format", "'csv'"],
    ),
    "unknown source key": (
        job_set("sources", [{"path": "b", "glob": "*"}]),
        ["jobs.demo.sources[0].glob", "unknown key"],
    ),
    "source not a mapping": (job_set("sources", [42]), ["jobs.demo.sources[0]", "42"]),
    "negative eos_id": (
        job_set("tokenizer", {"path": "t.json", "eos_id": -1}),
        ["jobs.demo.tokenizer.eos_id", "-1"],
    ),
    "string add_bos": (
        job_set("tokenizer", {"path": "t.json", "add_bos": "yes"}),
        ["jobs.demo.tokenizer.add_bos", "'yes'"],
    ),
    "empty tokenizer path": (job_set("tokenizer", ""), ["jobs.demo.tokenizer.path", "''"]),
    "zero threads": (nested_set("server", "tokenize_threads", 0), ["server.tokenize_threads", "0"]),
    "negative wait": (
        nested_set("server", "max_wait_seconds", -1),
        ["server.max_wait_seconds", "-1"],
    ),
    "bad log format": (nested_set("server", "log_format", "xml"), ["server.log_format", "'xml'"]),
    "bad job name": (nested_set("jobs", "bad name!", {}), ["jobs.bad name!"]),
    "jobs not a mapping": (nested_set("jobs", ["demo"]), ["jobs", "['demo']"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_values_name_key_path_and_value(case):
    edit, needles = BAD[case]
    raw = copy.deepcopy(minimal())
    edit(raw)
    with pytest.raises(ConfigError) as info:
        from_dict(raw, origin="cfg.yaml")
    message = str(info.value)
    assert message.startswith("cfg.yaml: ")
    for needle in needles:
        assert needle in message


def test_load_errors_name_the_file(tmp_path):
    raw = minimal()
    raw["jobs"]["demo"]["seq_len"] = -3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"bad\.yaml: jobs\.demo\.seq_len: .*got -3"):
        load(path)


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("bad.yaml", "jobs: [unclosed", "not valid YAML"),
        ("bad.toml", "[jobs\nx = 1", "not valid TOML"),
        ("empty.yaml", "", "expected a mapping"),
    ],
)
def test_unparseable_files(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle) as info:
        load(path)
    assert name in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("64MiB", 64 * 2**20),
        ("1 GB", 10**9),
        (" 3 TB ", 3 * 10**12),
        ("2KiB", 2048),
        ("1TiB", 2**40),
        ("100", 100),
        ("100B", 100),
        (4096, 4096),
    ],
)
def test_parse_size(value, size):
    assert parse_size(value, "x.chunk_bytes") == size


@pytest.mark.parametrize("value", ["1.5MiB", "MiB", "", "-1", "64 MiBs", 0, -5, True, None, 1.5])
def test_parse_size_rejects(value):
    with pytest.raises(ConfigError) as info:
        parse_size(value, "x.chunk_bytes")
    assert "x.chunk_bytes" in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("key", ["max_wait_seconds", "grace_seconds"])
def test_nan_seconds_are_rejected(key):
    # YAML `.nan` and TOML `nan` both parse to a float NaN, which is no duration.
    raw = minimal()
    raw["server"] = {key: float("nan")}
    with pytest.raises(ConfigError, match=f"server.{key}"):
        from_dict(raw)
