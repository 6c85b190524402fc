"""docker-compose's one-shot seed job: a sample corpus and its tokenizer in an S3 bucket.

Runs in the tokenfeed server image, which has boto3 and the demo corpus builder: makes the
corpus `make demo` uses (Python's own documentation as JSONL, JSONL.zst, JSONL.gz and Parquet,
`tokenfeed.server.commands.democorpus`) and a byte-level BPE tokenizer trained on it, creates
the bucket if it is missing and uploads

    s3://BUCKET/corpus/docs-000.jsonl ... docs-003.parquet
    s3://BUCKET/tokenizer.json

The corpus is deterministic, so running the job again uploads the same bytes. Credentials come
from boto3's standard chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in compose).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from tokenfeed.server.commands import democorpus


def ensure_bucket(s3, bucket: str) -> None:
    try:
        s3.head_bucket(Bucket=bucket)
        return
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    try:
        s3.create_bucket(Bucket=bucket)
    except ClientError as e:  # another seed run got there first
        if e.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
            raise


def seed(s3, bucket: str, workdir: Path) -> list[str]:
    """Build the corpus and tokenizer under `workdir`, upload them; the keys written."""
    corpus, tokenizer, n_docs = democorpus.prepare(workdir)
    ensure_bucket(s3, bucket)
    keys = []
    for path in sorted(corpus.iterdir()):
        key = f"corpus/{path.name}"
        s3.upload_file(str(path), bucket, key)
        keys.append(key)
    s3.upload_file(str(tokenizer), bucket, "tokenizer.json")
    keys.append("tokenizer.json")
    size = sum(p.stat().st_size for p in corpus.iterdir())
    print(
        f"seed: {n_docs} documents, {size / 1e6:.2f} MB in {len(keys) - 1} objects "
        f"and a tokenizer uploaded to s3://{bucket}/"
    )
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--endpoint-url",
        default=os.environ.get("S3_ENDPOINT_URL"),
        help="S3 endpoint, e.g. http://minio:9000 (env S3_ENDPOINT_URL)",
    )
    parser.add_argument("--bucket", default=os.environ.get("SEED_BUCKET", "tokenfeed-demo"))
    parser.add_argument("--region", default=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    args = parser.parse_args(argv)
    s3 = boto3.client(
        "s3",
        endpoint_url=args.endpoint_url,
        region_name=args.region,
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard"}),
    )
    with tempfile.TemporaryDirectory(prefix="tokenfeed-seed-") as tmp:
        seed(s3, args.bucket, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
