"""Object-store globs: `*` and `?` stay within a segment, `**` crosses segments."""

from __future__ import annotations

import pytest
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.s3uris import glob_regex, split_uri


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        ("corpus/*.jsonl", "corpus/a.jsonl", True),
        ("corpus/*.jsonl", "corpus/sub/a.jsonl", False),
        ("corpus/**/*.jsonl", "corpus/a.jsonl", True),
        ("corpus/**/*.jsonl", "corpus/x/y/a.jsonl", True),
        ("corpus/**", "corpus/x/y/a.jsonl", True),
        ("corpus/part-?.zst", "corpus/part-1.zst", True),
        ("corpus/part-?.zst", "corpus/part-10.zst", False),
        ("corpus/part-[01].zst", "corpus/part-1.zst", True),
        ("corpus/part-[!01].zst", "corpus/part-1.zst", False),
        ("corpus/a+b(1).jsonl", "corpus/a+b(1).jsonl", True),  # regex characters are literal
        ("corpus/*.jsonl", "corpus/a.jsonl.zst", False),
    ],
)
def test_glob(pattern, key, matches):
    assert bool(glob_regex(pattern).match(key)) is matches


def test_split_uri():
    assert split_uri("s3://bucket/a/b.jsonl") == ("bucket", "a/b.jsonl")
    assert split_uri("s3://bucket") == ("bucket", "")
    with pytest.raises(SourceError, match="no bucket"):
        split_uri("s3:///key")
    with pytest.raises(SourceError, match="not an s3"):
        split_uri("gs://bucket/key")
