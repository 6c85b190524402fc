"""Test inputs in the layouts users already have, made by the real writers: mosaicml-streaming's
MDSWriter, Hugging Face `datasets` (save_to_disk, to_parquet in the Hub's file naming with a
README configs: block) and webdataset's TarWriter. Test-only dependencies (pyproject's dev
extra, constraints.txt); the server reads these layouts without them.

mosaicml-streaming pins numpy < 2.2 and pulls torchvision, transformers and cloud SDKs, none of
which the writer needs: it is installed without its dependencies (Makefile `env`), and only its
writer modules are loaded (`mds_writer`), with the packages above them made as bare namespaces
so that `streaming/__init__.py` (the datasets, torchvision) never runs.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
import types
from pathlib import Path

import numpy as np


def mds_writer():
    """streaming's MDSWriter, imported without `streaming/__init__.py`."""
    if "streaming.base.format.mds.writer" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.origin is None:
            raise ImportError("mosaicml-streaming is not installed (make env installs it)")
        root = os.path.dirname(spec.origin)
        for name in ("streaming", "streaming.base", "streaming.base.format"):
            if name not in sys.modules:
                module = types.ModuleType(name)
                module.__path__ = [os.path.join(root, *name.split(".")[1:])]
                sys.modules[name] = module
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter


def write_mds(
    out: Path,
    texts: list[str],
    compression: str | None = None,
    ids: list[list[int]] | None = None,
    size_limit: int = 1 << 13,
) -> Path:
    """An MDS directory: `text` (str), `n` (int32) and, with `ids`, `ids` (ndarray:uint16)."""
    columns = {"text": "str", "n": "int32"}
    if ids is not None:
        columns["ids"] = "ndarray:uint16"
    writer = mds_writer()
    with writer(out=str(out), columns=columns, compression=compression, size_limit=size_limit) as w:
        for i, t in enumerate(texts):
            sample = {"text": t, "n": i}
            if ids is not None:
                sample["ids"] = np.asarray(ids[i], dtype=np.uint16)
            w.write(sample)
    return out


def write_saved(
    out: Path, texts: list, ids: list[list[int]] | None = None, shards=2, batch_rows=16
) -> Path:
    """`Dataset.save_to_disk`: state.json, dataset_info.json, data-*.arrow streams, with record
    batches of `batch_rows` (datasets writes 1000-row batches; a small corpus needs smaller)."""
    import datasets
    from datasets import config

    data: dict = {"text": texts}
    if ids is not None:
        data["ids"] = ids
    old, config.DEFAULT_MAX_BATCH_SIZE = config.DEFAULT_MAX_BATCH_SIZE, batch_rows
    try:
        datasets.Dataset.from_dict(data).save_to_disk(str(out), num_shards=shards)
    finally:
        config.DEFAULT_MAX_BATCH_SIZE = old
    return out


def write_hub(root: Path, splits: dict[str, list[str]], shards: int = 3) -> Path:
    """A Hub repository: data/<split>-0000k-of-0000n.parquet by `to_parquet`, row groups of 16
    rows, and a README whose configs: block names them."""
    import datasets

    (root / "data").mkdir(parents=True, exist_ok=True)
    files = []
    for split, texts in splits.items():
        ds = datasets.Dataset.from_dict({"text": texts})
        for k in range(shards):
            name = f"data/{split}-{k:05d}-of-{shards:05d}.parquet"
            ds.shard(shards, k, contiguous=True).to_parquet(str(root / name), batch_size=16)
            files.append({"split": split, "path": f"data/{split}-*"})
    unique = [dict(t) for t in {tuple(f.items()) for f in files}]
    readme = {"configs": [{"config_name": "default", "default": True, "data_files": unique}]}
    import yaml

    (root / "README.md").write_text(f"---\n{yaml.safe_dump(readme)}---\n# a test dataset\n")
    return root


def write_tar(
    path: Path, texts: list[str], member: str = "txt", extra: bool = True, gz: bool = False
) -> Path:
    """A WebDataset shard by TarWriter: per sample its text as `<key>.txt` (or as the `text`
    of `<key>.json`), and with `extra` a `<key>.cls` beside it."""
    from webdataset import TarWriter

    with open(path, "wb") as f, TarWriter(f, compress=gz) as w:
        for i, t in enumerate(texts):
            sample: dict = {"__key__": f"{path.stem.split('.')[0]}/{i:06d}"}
            if member == "json":
                sample["json"] = json.dumps({"text": t, "id": i}).encode()
            else:
                sample[member] = t
            if extra:
                sample["cls"] = str(i % 7)
            w.write(sample)
    return path


def tar_bytes(samples: list[tuple[str, bytes]]) -> bytes:
    """A tar of the given (name, data) members, in order (for damaged shards)."""
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in samples:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
