"""MosaicML Streaming's MDS layout, read without the streaming library.

An MDS dataset is a directory with an `index.json` (`{"version": 2, "shards": [...]}`) and its
shards, `shard.NNNNN.mds`, or only their compressed form (`shard.NNNNN.mds.zstd`, gz, bz2).
Each shard entry of the index names its columns (`column_names`, `column_encodings`,
`column_sizes`: a byte size for fixed-size encodings, null for variable ones), its sample count
and its files. A shard file is

    uint32 samples | uint32 offsets[samples + 1] (absolute byte offsets) | ... | samples

and a sample is `uint32 size` per variable-size column, then each column's bytes in order.

Planning needs only index.json: a plain shard is cut into runs of samples holding about
`chunk_bytes` at the shard's average sample size (like a Megatron .idx, chunks.py); each run is
read with two ranged reads (its offsets, then its samples). A compressed shard cannot be entered
midway and is one chunk, read whole. Small shards are grouped by chunks.py.

Text columns (`str`, `bytes`, `json` holding a string) become documents; an integer `ndarray`
column (`token_field`) holds token ids (pretokenized.py); mdscolumns.py decodes them. `pkl`
is refused at start: decoding a pickle from storage runs code. Damage is located by shard and
sample: samples past the end of a truncated shard, samples that index.json counts but the shard
does not hold (or holds but index.json does not count), and samples whose column sizes do not
add up are bad records.
"""

from __future__ import annotations

import bz2
import json
import posixpath
import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import zstandard
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.source.chunk import Chunk
from tokenfeed.server.source.records import BadRecord

TEXT_ENCODINGS = ("str", "bytes", "json")
# Compressions the server decodes with what it already has; MDS also writes br and snappy.
COMPRESSIONS = ("zstd", "gz", "bz2")


@dataclass(frozen=True)
class MdsShard:
    """One shard entry of an index.json."""

    index: ObjectInfo
    position: int  # in the index's `shards`
    samples: int
    names: tuple[str, ...]
    encodings: tuple[str, ...]
    sizes: tuple[int | None, ...]
    raw: str  # basename of the plain shard, relative to the index's directory
    raw_bytes: int
    zipped: str | None  # basename of the compressed shard, if any
    compression: str | None

    def uri(self, basename: str) -> str:
        return posixpath.join(posixpath.dirname(self.index.uri), basename)


def is_mds_index(data: bytes) -> bool:
    """An index.json of MDS version 2 (what auto-detection looks for)."""
    try:
        index = json.loads(data)
    except ValueError:
        return False
    return isinstance(index, dict) and index.get("version") == 2 and "shards" in index


def parse_index(index: ObjectInfo, data: bytes) -> list[MdsShard]:
    """The shard entries of an index.json, refused with its path when it is not MDS version 2."""
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("version") != 2:
            raise ValueError(f"version {raw.get('version') if isinstance(raw, dict) else None}")
        return [_shard(index, i, s) for i, s in enumerate(raw["shards"])]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SourceError(
            f"{index.uri}: not an MDS index (expected JSON with version 2 and a list of shards "
            f"of format mds, each with column_names, column_encodings, column_sizes, samples "
            f"and raw_data): {e!r}"
        ) from e


def _shard(index: ObjectInfo, i: int, s: dict) -> MdsShard:
    if s.get("format") != "mds" or s.get("version") != 2:
        raise ValueError(f"shard {i} is format {s.get('format')!r} version {s.get('version')}")
    names, encodings = tuple(s["column_names"]), tuple(s["column_encodings"])
    sizes = tuple(None if n is None else int(n) for n in s["column_sizes"])
    if not len(names) == len(encodings) == len(sizes):
        raise ValueError(f"shard {i}: columns, encodings and sizes differ in number")
    zipped = s.get("zip_data") or None
    return MdsShard(
        index,
        i,
        int(s["samples"]),
        names,
        encodings,
        sizes,
        s["raw_data"]["basename"],
        int(s["raw_data"]["bytes"]),
        zipped["basename"] if zipped else None,
        (s.get("compression") or "").split(":")[0] or None,
    )


@lru_cache(maxsize=1024)
def read_index(store: ObjectBackend, index: ObjectInfo) -> list[MdsShard]:
    """An index.json's shards, once per version and process."""
    return parse_index(index, store.read_range(index, 0, index.size))


def check_column(shard: MdsShard, field: str, tokens: bool) -> None:
    """Refuse at start a column that cannot be read as asked (its encoding), with the reason;
    a shard without the column at all has its samples counted as bad records instead."""
    if field not in shard.names:
        return
    encoding = shard.encodings[shard.names.index(field)]
    where = f"{shard.index.uri}: shard {shard.raw}: column {field!r} is encoded {encoding!r}"
    if encoding == "pkl":
        raise SourceError(
            f"{where}: pickles are refused, since loading a pickle from storage runs code; "
            "rewrite the column as str or ndarray"
        )
    if tokens and not _token_encoding(encoding):
        raise SourceError(f"{where}, expected an integer ndarray of token ids (token_field)")
    if not tokens and encoding not in TEXT_ENCODINGS:
        raise SourceError(f"{where}, expected text: one of {list(TEXT_ENCODINGS)} (text_field)")
    if shard.zipped is not None and shard.compression not in COMPRESSIONS:
        raise SourceError(
            f"{shard.index.uri}: shard {shard.zipped} is compressed with {shard.compression!r}; "
            f"the server reads {list(COMPRESSIONS)} or plain shards"
        )


def _token_encoding(encoding: str) -> bool:
    parts = encoding.split(":")
    if parts[0] != "ndarray":
        return False
    return len(parts) == 1 or np.dtype(parts[1]).kind in "iu"


def plan(shard: MdsShard, source: ObjectInfo, field: str, tokens: bool, chunk_bytes: int):
    """The chunks of one shard: runs of samples of about chunk_bytes (plain), or the whole
    compressed object."""
    kind, n = ("mds-tokens" if tokens else "mds"), shard.samples
    if n == 0:
        return []
    if source.uri != shard.uri(shard.raw):  # compressed: one stream, read whole
        return [Chunk(source, kind, field, 0, n, shard.position, source.size, shard.index)]
    per = max(1, chunk_bytes * n // max(shard.raw_bytes, 1))
    return [
        Chunk(
            source,
            kind,
            field,
            s,
            min(s + per, n),
            shard.position,
            4 * (min(s + per, n) - s) + shard.raw_bytes * (min(s + per, n) - s) // n,
            shard.index,
        )
        for s in range(0, n, per)
    ]


def _decompress(raw: bytes, compression: str | None) -> bytes:
    """What can be decompressed: a truncated stream gives the samples it holds whole."""
    if compression == "zstd":
        out, rest = [], raw
        while rest:
            d = zstandard.ZstdDecompressor().decompressobj()
            try:
                out.append(d.decompress(rest))
            except zstandard.ZstdError:
                break
            rest = d.unused_data if d.eof else b""
        return b"".join(out)
    try:
        if compression == "gz":
            return zlib.decompressobj(wbits=31).decompress(raw)
        return bz2.BZ2Decompressor().decompress(raw)
    except (OSError, EOFError, zlib.error, ValueError):
        return b""


class _Shard:
    """Ranged reads of a plain shard, or the bytes of a decompressed one."""

    def __init__(self, store: ObjectBackend, chunk: Chunk, shard: MdsShard):
        self.store, self.obj = store, chunk.source
        self.data: bytes | None = None
        if chunk.source.uri != shard.uri(shard.raw):
            raw = store.read_range(chunk.source, 0, chunk.source.size)
            self.data = _decompress(raw, shard.compression)
        self.size = len(self.data) if self.data is not None else chunk.source.size

    def read(self, lo: int, hi: int) -> bytes:
        if self.data is not None:
            return self.data[lo:hi]
        return self.store.read_range(self.obj, lo, hi)


def samples(store: ObjectBackend, chunk: Chunk) -> tuple[MdsShard, list[bytes | BadRecord]]:
    """The chunk's samples [start, end) as bytes, or why each cannot be read."""
    if chunk.companion is None:
        raise ValueError(f"{chunk.describe()}: an MDS chunk without its index.json")
    shard = read_index(store, chunk.companion)[chunk.row_group]
    f, a, b, uri = _Shard(store, chunk, shard), chunk.start, chunk.end, chunk.source.uri
    head = f.read(0, 4)
    held = struct.unpack("<I", head)[0] if len(head) == 4 else 0
    raw = f.read(4 + 4 * a, 4 + 4 * (min(b, held) + 1)) if a < held else b""
    offsets = np.frombuffer(raw[: len(raw) // 4 * 4], dtype="<u4").astype(np.int64)
    out: list[bytes | BadRecord] = []
    whole = [
        i
        for i in range(len(offsets) - 1)
        if offsets[i] <= offsets[i + 1] <= f.size and offsets[i] >= 4 * (held + 2)
    ]
    lo = min(int(offsets[i]) for i in whole) if whole else 0
    body = f.read(lo, max(int(offsets[i + 1]) for i in whole)) if whole else b""
    ok = set(whole)
    for i in range(b - a):
        s = a + i
        where = f"{uri} sample {s}"
        if s >= held:
            detail = f"index.json counts {shard.samples} samples, the shard holds {held}"
            out.append(
                BadRecord("index_mismatch" if len(head) == 4 else "truncated", where, detail)
            )
        elif i in ok:
            out.append(body[int(offsets[i]) - lo : int(offsets[i + 1]) - lo])
        elif i + 1 >= len(offsets) or offsets[i + 1] > f.size:
            out.append(BadRecord("truncated", where, f"the shard ends at byte {f.size}"))
        else:
            out.append(BadRecord("corrupt_sample", where, "its offsets are out of order"))
    if b == shard.samples and held > shard.samples:  # samples index.json does not count
        where = f"{uri} samples {shard.samples}-{held - 1}"
        detail = f"the shard holds {held} samples, index.json counts {shard.samples}: not read"
        out.append(BadRecord("index_mismatch", where, detail))
    return shard, out
