"""`s3://bucket/key` URIs split into bucket and key, and key patterns matched like shell globs
(pure: what a listing keeps is decided here, what it asks S3 for in s3backend.py)."""

from __future__ import annotations

import re

from tokenfeed.server.errors import SourceError


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, key) of an `s3://` URI."""
    if not uri.startswith("s3://"):
        raise SourceError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise SourceError(f"{uri!r}: no bucket name")
    return bucket, key


def glob_regex(pattern: str) -> re.Pattern:
    """`*` and `?` stay within one path segment, `**` crosses segments, `[...]` a class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            if pattern.startswith("/", i):  # `a/**/b` also matches `a/b`
                out[-1] = "(?:.*/)?"
                i += 1
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (j := pattern.find("]", i + 1)) > i:
            body = pattern[i + 1 : j]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def has_magic(text: str) -> bool:
    """Whether a key pattern is a glob rather than one key (or a prefix)."""
    return any(c in text for c in "*?[")
