"""Specs built in code check themselves: a bad value raises ConfigError naming the field and
quoting the value, with no file involved; `dataclasses.replace` is held to the same rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fractions import Fraction

import pytest
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import (
    AuthSpec,
    Config,
    DatasetSpec,
    JobSpec,
    LimitsSpec,
    ObjectStoreSpec,
    PhaseSpec,
    ServerSpec,
    SourceSpec,
    StoreSpec,
    TlsSpec,
    TokenizerSpec,
)

SOURCE = SourceSpec("/d/*.jsonl")
TOKENIZER = TokenizerSpec("/t.json")
DATASET = DatasetSpec("main", (SOURCE,))
PHASE = PhaseSpec(0, 8, (Fraction(1),))
JOB = JobSpec("demo", (DATASET,), TOKENIZER, 16, (PHASE,))


def job(**changes: object) -> Callable[[], object]:
    return lambda: dataclasses.replace(JOB, **changes)


def phases(*specs: tuple[int, int]) -> tuple[PhaseSpec, ...]:
    return tuple(PhaseSpec(start, batch, (Fraction(1),)) for start, batch in specs)


# (make the spec, the message it must raise, exactly)
BAD: dict[str, tuple[Callable[[], object], str]] = {
    "job seq_len": (job(seq_len=0), "seq_len: expected an integer >= 1, got 0"),
    "job seq_len as text": (job(seq_len="8"), "seq_len: expected an integer, got '8'"),
    "job seed bool": (job(seed=True), "seed: expected an integer, got True"),
    "job seed too big": (job(seed=2**64), f"seed: expected an integer < 2**64, got {2**64}"),
    "job packing": (
        job(packing="first_fit"),
        "packing: expected one of ['concat', 'best_fit'], got 'first_fit'",
    ),
    "job policy": (
        job(bad_records="ignore"),
        "bad_records: expected one of ['skip', 'strict'], got 'ignore'",
    ),
    "job window": (job(window_chunks=0), "window_chunks: expected an integer >= 1, got 0"),
    "job name": (
        job(name="my job"),
        "name: expected a job name of letters, digits, '.', '_', '-', got 'my job'",
    ),
    "job datasets as a list": (job(datasets=[DATASET]), "datasets: expected a non-empty tuple"),
    "job without datasets": (job(datasets=()), "datasets: expected a non-empty tuple"),
    "job tokenizer as a path": (
        job(tokenizer="/t.json"),
        "tokenizer: expected a TokenizerSpec, got '/t.json'",
    ),
    "job first phase after 0": (
        job(phases=phases((5, 8))),
        "phases[0].start_step: expected 0, got 5",
    ),
    "job phases out of order": (
        job(phases=phases((0, 8), (50, 8), (20, 8))),
        "phases[2].start_step: phases must start in increasing order; 20 is not after 50",
    ),
    "job batch not a multiple": (
        job(phases=phases((0, 8), (10, 6)), batch_multiple_of=4),
        "phases[1].global_batch_size: global_batch_size 6 is not a multiple of batch_multiple_of 4",
    ),
    "job weights per dataset": (
        job(phases=(PhaseSpec(0, 8, (Fraction(1), Fraction(2))),)),
        "phases[0].weights: expected one weight per dataset (1), got ['1', '2']",
    ),
    "job two datasets of one name": (
        job(datasets=(DATASET, DATASET), phases=(PhaseSpec(0, 8, (Fraction(1), Fraction(1))),)),
        "datasets[1].name: expected a name no other dataset has, got 'main'",
    ),
    "phase float weight": (
        lambda: PhaseSpec(0, 8, (0.5,)),
        "weights[0]: expected a Fraction, got 0.5",
    ),
    "phase negative weight": (
        lambda: PhaseSpec(0, 8, (Fraction(-1),)),
        "weights[0]: expected a weight >= 0, got Fraction(-1, 1)",
    ),
    "phase zero weights": (
        lambda: PhaseSpec(0, 8, (Fraction(0), Fraction(0))),
        "weights: weights must have a positive sum, got ['0', '0']",
    ),
    "phase batch": (
        lambda: PhaseSpec(0, 0, (Fraction(1),)),
        "global_batch_size: expected an integer >= 1, got 0",
    ),
    "dataset chunk_bytes": (
        lambda: DatasetSpec("main", (SOURCE,), 0),
        "chunk_bytes: expected a size >= 1 byte, got 0",
    ),
    "dataset source as a path": (
        lambda: DatasetSpec("main", ("/d/*.jsonl",)),
        "sources[0]: expected a SourceSpec, got '/d/*.jsonl'",
    ),
    "source format": (
        lambda: SourceSpec("/d/*", format="csv"),
        "format: expected one of ['auto', 'jsonl', 'parquet', 'megatron', 'mds', 'hf', "
        "'arrow', 'webdataset'], got 'csv'",
    ),
    "source token_field on Megatron": (
        lambda: SourceSpec("/d/*.idx", token_field="ids"),
        "token_field: applies to Parquet sources only (and the MDS, Arrow and Hub layouts; "
        "Megatron datasets hold token ids already), got 'ids' for '/d/*.idx'",
    ),
    "source empty pattern": (
        lambda: SourceSpec(""),
        "pattern: expected a non-empty string, got ''",
    ),
    "tokenizer eos_id": (
        lambda: TokenizerSpec("/t.json", eos_id=-1),
        "eos_id: expected a token id >= 0, got -1",
    ),
    "tokenizer add_bos": (
        lambda: TokenizerSpec("/t.json", add_bos=1),
        "add_bos: expected true or false, got 1",
    ),
    "tokenizer backend": (
        lambda: TokenizerSpec("/t.json", backend="fast"),
        "backend: expected one of ['auto', 'hf', 'tiktoken'], got 'fast'",
    ),
    "server workers": (
        lambda: ServerSpec(workers=0),
        "workers: expected an integer in [1, 1024], got 0",
    ),
    "server log format": (
        lambda: ServerSpec(log_format="xml"),
        "log_format: expected one of ['text', 'json'], got 'xml'",
    ),
    "server nan wait": (
        lambda: ServerSpec(max_wait_seconds=float("nan")),
        "max_wait_seconds: expected a number >= 0.0, got nan",
    ),
    "server limits as a dict": (
        lambda: ServerSpec(limits={}),
        "limits: expected a LimitsSpec, got {}",
    ),
    "limits request bytes": (
        lambda: LimitsSpec(max_request_bytes=512),
        "max_request_bytes: 512 bytes cannot hold a request; expected at least 1KiB",
    ),
    "limits keepalive": (
        lambda: LimitsSpec(keepalive_seconds=0.5),
        "keepalive_seconds: expected a number >= 1.0, got 0.5",
    ),
    "tls key without certificate": (
        lambda: TlsSpec(key_file="/k.pem"),
        "cert_file: required with key_file '/k.pem'",
    ),
    "tls certificate without key": (
        lambda: TlsSpec(cert_file="/c.pem"),
        "key_file: required with cert_file '/c.pem'",
    ),
    "tls CA without TLS": (
        lambda: TlsSpec(client_ca_file="/ca.pem"),
        "cert_file: required with client_ca_file '/ca.pem'",
    ),
    "auth variable name": (
        lambda: AuthSpec(tokens_env="my-tokens"),
        "tokens_env: expected the name of an environment variable, got 'my-tokens'",
    ),
    "object store endpoint": (
        lambda: ObjectStoreSpec(endpoint_url="minio:9000"),
        "endpoint_url: expected http:// or https://, got 'minio:9000'",
    ),
    "object store attempts": (
        lambda: ObjectStoreSpec(max_attempts=0),
        "max_attempts: expected an integer >= 1, got 0",
    ),
    "store ttl": (
        lambda: StoreSpec(node_ttl_seconds=0),
        "node_ttl_seconds: expected a positive number of seconds, got 0",
    ),
    "store without node": (
        lambda: StoreSpec(uri="s3://b/p/"),
        "node: required with uri 's3://b/p/'",
    ),
    "config two jobs of one name": (
        lambda: Config(ServerSpec(), (JOB, JOB)),
        "jobs[1].name: expected a name no other job has, got 'demo'",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_spec_built_in_code_refuses_a_bad_value(case):
    make, message = BAD[case]
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


def test_good_specs_built_in_code_keep_their_values():
    spec = dataclasses.replace(
        JOB,
        phases=(PHASE, PhaseSpec(10, 16, (Fraction(1, 3),))),
        batch_multiple_of=8,
        seed=2**64 - 1,
    )
    assert spec.global_batch_size == 8
    assert [p.start_step for p in spec.phases] == [0, 10]
    assert ServerSpec(max_wait_seconds=5).max_wait_seconds == 5
    assert StoreSpec("s3://b/p/", node="n1").node == "n1"
    assert TlsSpec("/c.pem", "/k.pem", "/ca.pem").enabled
    assert Config(ServerSpec(), (JOB,)).job("demo") is JOB
