from collections.abc import Sequence

from typing_extensions import Buffer

def gather(
    dst: Buffer,
    dst_at: Buffer,
    sources: Sequence[Buffer],
    which: Buffer,
    src_at: Buffer,
    lengths: Buffer,
    itemsize: int,
    release_gil: bool,
    /,
) -> None: ...
def row_starts(
    starts: Sequence[Buffer],
    which: Buffer,
    lo: Buffer,
    seq_len: int,
    splits: Buffer,
    /,
) -> bytearray: ...
