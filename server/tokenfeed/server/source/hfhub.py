"""A Hugging Face dataset repository laid out as the Hub stores it (`format: hf`), mirrored to
a directory or a prefix: which of its files are the data of one config and split.

The rules, in the order the Hub's own loader applies them:

1. The README's YAML `configs:` block: the config named by the source's `config` (else the one
   marked `default: true`, else the one named "default", else the only one), and its
   `data_files` for the split: a pattern or list of them (for "train"), or a list of
   `{split, path}`; patterns are relative to the repository, `*` within a path segment, `**`
   across segments.
2. The Parquet export (`refs/convert/parquet`): `<config>/<split>/*.parquet` (and
   `<config>/partial-<split>/`), config "default" unless named.
3. File names: data files (`.parquet`, `.jsonl[.gz|.zst]`, `.arrow`) whose path has the split's
   word between separators (`data/train-00000-of-00010.parquet`, `data/train/0.parquet`; for
   "validation" also valid, val, dev; for "test" also testing, eval, evaluation); when no file
   names any split, every data file is "train".

Each file chosen is then read by its own kind (Parquet row groups, JSON Lines, Arrow streams).
"""

from __future__ import annotations

import os
import re

import yaml
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo

DATA_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".arrow")
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEPARATORS = re.compile(r"[-._ 0-9/]+")


def root_of(pattern: str) -> str:
    """The repository a `format: hf` source names: its path, without a trailing `/**`."""
    root = pattern[:-3] if pattern.endswith("/**") else pattern
    return root.rstrip("/")


def _glob(pattern: str) -> re.Pattern:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            if pattern.startswith("/", i):
                out[-1] = "(?:.*/)?"
                i += 1
            continue
        c = pattern[i]
        out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _front_matter(text: str) -> dict:
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    try:
        meta = yaml.safe_load(text[3:end] if end > 0 else "")
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _configured(configs: list, config: str | None, split: str, readme: str) -> list[str] | None:
    """The data_files patterns of the README's config and split; None if the config has none."""
    named = {c.get("config_name", "default"): c for c in configs if isinstance(c, dict)}
    if config is None:
        marked = [n for n, c in named.items() if c.get("default")]
        config = marked[0] if marked else "default" if "default" in named else None
        if config is None and len(named) == 1:
            config = next(iter(named))
    if config not in named:
        raise SourceError(
            f"{readme}: no config {config!r} in its configs: block (configs: {sorted(named)}); "
            "set config on the source"
        )
    files = named[config].get("data_files")
    if files is None:
        return None
    if isinstance(files, str):
        files = [files]
    if isinstance(files, dict):
        files = [{"split": k, "path": v} for k, v in files.items()]
    if all(isinstance(f, str) for f in files):
        return list(files) if split == "train" else []
    paths = [f.get("path") for f in files if isinstance(f, dict) and f.get("split") == split]
    return [p for ps in paths for p in ([ps] if isinstance(ps, str) else ps or [])]


def _split_words(split: str) -> tuple[str, ...]:
    return SPLIT_WORDS.get(split, (split,))


def data_files(
    store: ObjectBackend, root: str, listed: list[ObjectInfo], config: str | None, split: str
) -> list[ObjectInfo]:
    """The data files of one config and split of the repository at `root` (see the module)."""
    if "://" not in root and not any(o.uri.startswith(root + "/") for o in listed):
        root = os.path.realpath(root)  # a local listing names objects by their resolved paths
    rel = {o.uri[len(root) + 1 :]: o for o in listed if o.uri.startswith(root + "/")}
    readme = rel.get("README.md")
    if readme is not None:
        meta = _front_matter(store.read_range(readme, 0, readme.size).decode("utf-8", "replace"))
        configs = meta.get("configs")
        if isinstance(configs, list) and configs:
            patterns = _configured(configs, config, split, readme.uri)
            if patterns is not None:
                regexes = [_glob(p.lstrip("./")) for p in patterns]
                found = [o for r, o in rel.items() if any(x.match(r) for x in regexes)]
                return _chosen(root, found, f"README.md configs data_files {patterns}", split)
    data = {r: o for r, o in rel.items() if r.lower().endswith(DATA_SUFFIXES)}
    name = config or "default"
    exported = [
        o for r, o in data.items() if r.startswith((f"{name}/{split}/", f"{name}/partial-{split}/"))
    ]
    if exported:
        return sorted(exported)
    if config is not None:
        return _chosen(root, [], f"{name}/{split}/*.parquet (the Parquet export)", split)
    named = {r: _SEPARATORS.split(r.lower()) for r in data}
    words = {w for ws in SPLIT_WORDS.values() for w in ws} | {split}
    if not any(words & set(ws) for ws in named.values()):
        found = list(data.values()) if split == "train" else []
    else:
        found = [data[r] for r, ws in named.items() if set(_split_words(split)) & set(ws)]
    return _chosen(root, found, f"data files named for split {split!r}", split)


def _chosen(root: str, found: list[ObjectInfo], rule: str, split: str) -> list[ObjectInfo]:
    if not found:
        raise SourceError(
            f"{root}: no data files for split {split!r} by {rule}; a Hub repository has "
            "a README.md configs: block, <config>/<split>/*.parquet, or data/<split>-*.parquet"
        )
    return sorted(found)
