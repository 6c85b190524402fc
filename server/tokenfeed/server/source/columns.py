"""Arrow columns (of Parquet row groups and Arrow stream files) as records, one per row: a text
column's strings, or a column of token-id lists (`token_field`); nulls, invalid UTF-8 and empty
values refused with their row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tokenfeed.server.source.records import BadRecord, TokenRecords, text_of


def is_token_list(kind: pa.DataType) -> bool:
    """A Parquet/Arrow type that holds one document's token ids per row."""
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(
        kind.value_type
    )


def token_records(column: pa.Array, first: int, where: str, field: str) -> TokenRecords:
    """Rows [first, first + len(column)) of `where` ("<uri> row"), each a record."""
    lengths = pc.list_value_length(column).fill_null(0).to_numpy().astype(np.int64)
    values = column.flatten()  # null lists contribute nothing; slicing offsets are applied
    refused = {
        int(r): BadRecord("missing_field", f"{where} {first + r}", f"{field!r} is null")
        for r in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))
    }
    if values.null_count:
        ends = np.cumsum(lengths)
        nulls = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
        for p in nulls[::-1]:  # reversed: the first null of each record is the one kept
            r = int(np.searchsorted(ends, p, side="right"))
            refused[r] = BadRecord(
                "null_token",
                f"{where} {first + r}",
                f"null at position {p - (ends[r] - lengths[r])}",
            )
        values = values.fill_null(0)
    ids = values.to_numpy(zero_copy_only=False)
    return TokenRecords(ids, lengths, first, where, refused)


def is_text(kind: pa.DataType) -> bool:
    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )


def text_records(column: pa.Array, first: int, uri: str, field: str) -> list[str | BadRecord]:
    """Rows [first, first + len(column)) of `uri`: each its text or why it is a bad record."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    out: list[str | BadRecord] = []
    for i, value in enumerate(column.to_pylist()):
        location = f"{uri} row {first + i}"
        if value is None:
            out.append(BadRecord("missing_field", location, f"{field!r} is null"))
        else:
            out.append(text_of(value, location, "the value"))
    return out
