"""Valid configs keep their meaning: the job fingerprints of fixed configs, pinned.

A job's fingerprint covers every input that decides its batches: the spec's values (sequence
length, seed, packing, window, EOS/BOS, each phase's batch size and exact weights) and every
chunk's key (source URI, size and version, reading, range, tokenizer digest). The sources sit
in a bucket of a fixed name on the S3 test server, whose versions are ETags (digests of the
bytes), so the fingerprint is the same on every machine. A change to how a file is read that
alters any value a job is built from changes it; if that is deliberate, say so and re-pin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from s3env import MotoServer, s3_client
from support import DATA, TOKENIZER
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.settings import config as configmod

BUCKET = "tokenfeed-config-fingerprint"

CONFIGS = {
    "single": (
        """
jobs:
  golden:
    sources: [s3://tokenfeed-config-fingerprint/web/corpus.jsonl]
    tokenizer: {tokenizer}
    seq_len: 48
    global_batch_size: 4
    seed: 1234
    chunk_bytes: 8KiB
    window_chunks: 3
""",
        "0303de095c6e5e078bf511c50f434bde",
    ),
    "mixture": (
        """
jobs:
  blend:
    datasets:
      web: {{sources: ["s3://tokenfeed-config-fingerprint/web/*.jsonl"], weight: 0.7,
             chunk_bytes: 16KiB}}
      code: {{sources: [{{path: "s3://tokenfeed-config-fingerprint/code/*", format: jsonl,
                          text_field: text}}], weight: "3/10"}}
    tokenizer: {{path: {tokenizer}, eos_id: 0, add_bos: true, bos_id: 1}}
    chunk_bytes: 8KiB
    seq_len: 32
    global_batch_size: 6
    batch_multiple_of: 3
    packing: best_fit
    seed: 18446744073709551615
    window_chunks: 2
    bad_records: strict
    schedule:
      - {{start_step: 7, weights: {{code: 1}}}}
      - {{start_step: 20, global_batch_size: 12}}
""",
        "112e1628da4c9ac385686729b00e8415",
    ),
}


@pytest.fixture(scope="module")
def bucket(moto_server: MotoServer) -> Iterator[str]:
    """The golden corpus, and its first 40 lines as a second source, under a fixed name."""
    client = s3_client(moto_server.endpoint)
    client.create_bucket(Bucket=BUCKET)
    body = (DATA / "golden" / "corpus.jsonl").read_bytes()
    objects = {
        "web/corpus.jsonl": body,
        "code/part": b"".join(body.splitlines(keepends=True)[:40]),
    }
    for key, data in objects.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
    yield moto_server.endpoint
    for key in objects:
        client.delete_object(Bucket=BUCKET, Key=key)
    client.delete_bucket(Bucket=BUCKET)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_job_fingerprint_of_a_valid_config_is_pinned(tmp_path, monkeypatch, bucket, name):
    for var, value in [("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x")]:
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    text, pinned = CONFIGS[name]
    raw = yaml.safe_load(text.format(tokenizer=TOKENIZER))
    raw["server"] = {"cache_dir": str(tmp_path / "cache")}
    raw["object_store"] = {"endpoint_url": bucket, "addressing_style": "path"}
    path = tmp_path / "tf.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    (job,) = build_jobs(configmod.load(path)).values()

    async def build() -> None:
        with ThreadPoolExecutor(2) as pool:
            await job.build_index(pool, 2)

    asyncio.run(build())
    assert job.error == ""
    assert job.fingerprint == pinned
