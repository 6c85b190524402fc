from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import Buffer

def messages(
    heads: list[bytes],
    tails: list[bytes],
    sources: Sequence[Buffer],
    which: Buffer,
    src_at: Buffer,
    span: int,
    itemsize: int,
    fp_len: int,
    fingerprint: Callable[[int, memoryview], str],
    /,
) -> list[bytes]: ...
def batch_messages(
    parts: tuple[bytes, bytes, bytes, bytes],
    tags: bytes,
    steps: Buffer,
    epochs: Buffer,
    starts: Buffer,
    start_at: Buffer,
    splits: Buffer,
    splits_each: int,
    sources: Sequence[Buffer],
    which: Buffer,
    src_at: Buffer,
    span: int,
    itemsize: int,
    fp_len: int,
    hasher: Callable[[bytes], Any],
    header: bytes,
    /,
) -> list[bytes]: ...
