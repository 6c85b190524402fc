"""Which listed objects are read, and as what: single files by their names (JSON Lines,
Parquet, Megatron `.idx`, tar, Arrow streams) and directory layouts by the files that describe
them (an MDS `index.json`, a save_to_disk `state.json` or `dataset_dict.json`, a Hub
repository's README and file names: hfhub.py).

`format: auto` recognises a layout only where it is unambiguous: an `index.json` that is MDS
version 2 (any other index.json is JSON Lines, as before), a `state.json` listing `.arrow`
data files, `.tar`/`.tar.gz`/`.tgz` and `.arrow` by name. A Hub repository is named with
`format: hf`. The files a layout describes itself with (and the shards it claims) are not read
again as files of their own; a layout whose description names a file that is not there is
refused at start, naming both.
"""

from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import dataclass

from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.settings.config import JSONL_SUFFIXES, SourceSpec
from tokenfeed.server.source import hfhub, mds

log = logging.getLogger(__name__)

_TAR = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True)
class Reading:
    """One object to plan chunks of: its kind (chunk.KINDS) and the source that lists it."""

    obj: ObjectInfo
    kind: str
    spec: SourceSpec
    shard: mds.MdsShard | None = None  # an MDS shard's entry in its index.json


def source_kind(uri: str, declared: str, token_field: str | None = None) -> str:
    name = uri.lower()
    if declared in ("webdataset", "auto") and name.endswith(_TAR):
        if token_field is not None:
            raise SourceError(f"{uri}: token_field applies to columns, not to tar members")
        return "tar.gz" if name.endswith(("gz", "tgz")) else "tar"
    if declared == "webdataset":
        raise SourceError(f"{uri}: a WebDataset shard is a .tar, .tar.gz or .tgz file")
    if declared in ("arrow", "auto", "hf") and name.endswith(".arrow"):
        return "arrow" if token_field is None else "arrow-tokens"
    compression = ""
    for suffix, comp in ((".gz", ".gz"), (".zst", ".zst"), (".zstd", ".zst")):
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], comp
            break
    if declared == "megatron" or (declared == "auto" and name.endswith(".idx")):
        if compression or not name.endswith(".idx"):
            raise SourceError(
                f"{uri}: a Megatron source must match the .idx files (the .bin "
                "beside each is read with it), uncompressed"
            )
        if token_field is not None:
            raise SourceError(
                f"{uri}: token_field applies to Parquet sources; a Megatron "
                "dataset holds nothing but token ids"
            )
        return "megatron"
    if declared in ("parquet", "hf") or (declared == "auto" and name.endswith(".parquet")):
        if compression:
            raise SourceError(f"{uri}: Parquet files compress internally; got {compression}")
        return "parquet" if token_field is None else "parquet-tokens"
    if declared == "jsonl" or name.endswith(JSONL_SUFFIXES):
        if token_field is not None:
            raise SourceError(f"{uri}: token_field applies to Parquet sources, not JSON Lines")
        return "jsonl" + compression
    if name.endswith((".mds", ".mds.zstd")):
        raise SourceError(
            f"{uri}: an MDS shard is read through its index.json; name the directory that "
            "holds index.json (format: mds)"
        )
    raise SourceError(
        f"{uri}: cannot tell the format from the name; expected .jsonl[.gz|.zst], .parquet, "
        ".idx (Megatron), .tar[.gz], .arrow, or a directory with an MDS index.json or a "
        "save_to_disk state.json; or set format: jsonl|parquet|megatron|mds|hf|arrow|webdataset"
    )


def resolve(objects: list[tuple[ObjectInfo, SourceSpec]], storage: ObjectStorage) -> list[Reading]:
    """The objects to read, sorted by URI, each once (the first source that lists it wins)."""
    by_spec: dict[SourceSpec, list[ObjectInfo]] = {}
    for obj, spec in objects:
        by_spec.setdefault(spec, []).append(obj)
    readings: dict[str, Reading] = {}
    for spec, objs in by_spec.items():
        for r in _resolve_source(spec, sorted(objs), storage):
            readings.setdefault(r.obj.uri, r)
    return [readings[u] for u in sorted(readings)]


def _resolve_source(
    spec: SourceSpec, objs: list[ObjectInfo], storage: ObjectStorage
) -> list[Reading]:
    store = storage.for_uri(spec.pattern)
    if spec.format == "hf":
        files = hfhub.data_files(store, hfhub.root_of(spec.pattern), objs, spec.config, spec.split)
        return [Reading(o, source_kind(o.uri, "hf", spec.token_field), spec) for o in files]
    out: list[Reading] = []
    claimed: set[str] = set()
    if spec.format in ("mds", "auto"):
        out += _mds(spec, objs, store, claimed)
    if spec.format in ("arrow", "auto"):
        out += _arrow(spec, objs, store, claimed)
    rest = [o for o in objs if o.uri not in claimed]
    if spec.format in ("mds", "arrow"):
        if rest:
            log.info(
                "%s: %d objects beside the %s layout not read, e.g. %s",
                spec.pattern,
                len(rest),
                spec.format,
                rest[0].uri,
            )
        return out
    return out + [Reading(o, source_kind(o.uri, spec.format, spec.token_field), spec) for o in rest]


def _base(uri: str) -> str:
    return uri.rsplit("/", 1)[-1]


def _mds(spec: SourceSpec, objs: list[ObjectInfo], store: ObjectBackend, claimed: set[str]):
    indexes = [o for o in objs if _base(o.uri) == "index.json"]
    if spec.format == "mds" and not indexes:
        raise SourceError(
            f"{spec.pattern}: no index.json; an MDS dataset is a directory with an index.json "
            "(version 2) and its shard.*.mds[.zstd] files"
        )
    known = {o.uri: o for o in objs}
    listed_dirs: set[str] = set()
    out = []
    tokens = spec.token_field is not None
    field = spec.token_field if spec.token_field is not None else spec.text_field
    for index in sorted(indexes, key=lambda o: (o.uri.count("/"), o.uri)):  # shallowest first
        if index.uri in claimed:
            continue
        data = store.read_range(index, 0, index.size)
        if spec.format == "auto" and not mds.is_mds_index(data):
            continue  # an index.json that is not MDS: JSON Lines, as before
        claimed.add(index.uri)
        shards = mds.parse_index(index, data)
        sources = [_shard_source(s, store, known, listed_dirs) for s in shards]
        if all(uri in claimed for _, uri in sources):
            continue  # a part's index.json beside the merged one that claimed its shards
        if not any(field in s.names for s in shards):
            names = sorted({n for s in shards for n in s.names})
            key = "token_field" if tokens else "text_field"
            raise SourceError(
                f"{index.uri}: no shard has a column {field!r} (columns: {names}); set {key}"
            )
        for shard, (source, _) in zip(shards, sources, strict=True):
            mds.check_column(shard, field, tokens)
            claimed.update(shard.uri(n) for n in (shard.raw, shard.zipped) if n is not None)
            kind = "mds-tokens" if tokens else "mds"
            out.append(Reading(source, kind, spec, shard))
    return out


def _shard_source(
    shard: mds.MdsShard, store: ObjectBackend, known: dict[str, ObjectInfo], listed: set[str]
) -> tuple[ObjectInfo, str]:
    """The object an MDS shard is read from (plain if there, else compressed) and its URI."""
    for name in (shard.raw, shard.zipped):
        if name is None:
            continue
        uri = shard.uri(name)
        folder = posixpath.dirname(uri)
        if uri not in known and folder not in listed:  # named by its index.json alone
            listed.add(folder)
            known.update({o.uri: o for o in store.list(folder)})
        if uri in known:
            return known[uri], uri
    raise SourceError(
        f"{shard.index.uri}: its shard {shard.position} ({shard.raw}"
        f"{' or ' + shard.zipped if shard.zipped else ''}) is not there: the index.json does "
        "not match its directory"
    )


def _arrow(
    spec: SourceSpec, objs: list[ObjectInfo], store: ObjectBackend, claimed: set[str]
) -> list[Reading]:
    known = {o.uri: o for o in objs}
    out = []
    skipped_dirs = []
    for d in (o for o in objs if _base(o.uri) == "dataset_dict.json"):
        claimed.add(d.uri)
        skipped_dirs.append(posixpath.dirname(d.uri))
    states = [o for o in objs if _base(o.uri) == "state.json"]
    if spec.format == "arrow" and not states:
        raise SourceError(
            f"{spec.pattern}: no state.json; a save_to_disk dataset is a directory with "
            "state.json, dataset_info.json and data-*.arrow files (a DatasetDict: one per split)"
        )
    for state in states:
        folder = posixpath.dirname(state.uri)
        parent = posixpath.dirname(folder)
        if parent in skipped_dirs and _base(folder) != spec.split:  # another split's
            claimed.update(u for u in known if u.startswith(folder + "/"))
            continue
        files = _state_files(spec, store, state, known)
        if files is None:
            continue
        claimed.update({state.uri, folder + "/dataset_info.json"})
        for f in files:
            claimed.add(f.uri)
            out.append(Reading(f, source_kind(f.uri, "arrow", spec.token_field), spec))
    return out


def _state_files(
    spec: SourceSpec, store: ObjectBackend, state: ObjectInfo, known: dict[str, ObjectInfo]
) -> list[ObjectInfo] | None:
    """The data files a save_to_disk state.json lists; None for a state.json of another kind
    under `format: auto` (read as JSON Lines, as before)."""
    try:
        files = json.loads(store.read_range(state, 0, state.size))["_data_files"]
        names = [f["filename"] for f in files]
    except (ValueError, KeyError, TypeError) as e:
        if spec.format == "auto":
            return None
        raise SourceError(
            f"{state.uri}: not a save_to_disk state.json (expected JSON with _data_files, a "
            f"list of {{filename: data-*.arrow}}): {e!r}"
        ) from e
    folder, out = posixpath.dirname(state.uri), []
    for name in names:
        uri = posixpath.join(folder, name)
        if uri not in known:
            raise SourceError(
                f"{state.uri}: its data file {name} is not there: the state.json does not "
                "match its directory"
            )
        out.append(known[uri])
    return out
