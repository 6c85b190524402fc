"""A config file into specs: YAML or TOML read, every level's keys checked first, values
converted (sizes, weights, paths, shorthands) and handed to the specs, whose own checks are
reported with the file and the key path of the value:
`tf.yaml: jobs.demo.seq_len: expected an integer >= 1, got -3`.

What each level knows and how each value is read follow from the specs' declarations
(options.py, specread.py); this module reads the file, the shared store's shorthand and its
default node name. Relative paths are resolved against the directory of the config file.
"""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path

import yaml
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configread import Section, check_keys, same
from tokenfeed.server.settings.jobparse import JOBS, jobs
from tokenfeed.server.settings.serverspec import Config, ServerSpec
from tokenfeed.server.settings.specread import SpecReader, keys_of
from tokenfeed.server.settings.storespec import StoreSpec

# The keys of the file (configread.check_keys walks them first).
FILE = keys_of(Config, jobs=JOBS, store=keys_of(StoreSpec))


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        kind = "TOML" if path.suffix == ".toml" else "YAML"
        raise ConfigError(f"{path}: not valid {kind}: {e}") from e
    return from_dict(raw, base=path.resolve().parent, origin=str(path))


def from_dict(raw: object, *, base: Path | str = ".", origin: str = "<memory>") -> Config:
    """The specs of a parsed file; every error starts with `origin` and the key path."""
    base = Path(base)
    try:
        check_keys(raw, FILE)
        top = Section(raw, "")
        r = SpecReader(Config, top, base)
        server = r.read("server")
        r.read("object_store")
        store = _store(top.get("store"), base, server)
        specs = jobs(top.require("jobs"), base)
        return r.build(same, store=store, jobs=specs, origin=origin)
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from None


def _store(raw: object, base: Path, server: ServerSpec) -> StoreSpec:
    """`store:` as a mapping or its uri alone; a node is named by its host and cache unless
    the file names it."""
    given = {"uri": raw} if isinstance(raw, str) else raw
    s = Section(given if given is not None else {}, "store")
    r = SpecReader(StoreSpec, s, base)
    uri = r.read("uri")
    node = r.read("node") or (f"{socket.gethostname()}:{server.cache_dir}" if uri else "")
    r.read_all(node=node)
    s.done()
    if raw is not None and not uri:
        raise ConfigError(f"store.uri: required (s3://bucket/prefix/ or a directory), got {raw!r}")
    return r.build()
