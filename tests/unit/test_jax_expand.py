"""The JAX helper derives the trainer's tensors from the compact form on a device (here JAX's
default device, the CPU), equal to the client's numpy expansion.

JAX runs in a child process: once imported, its threads make any later `fork` in the test
session (PyTorch's DataLoader workers) unsafe.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from tokenfeed.client.wire import TENSOR_NAMES, compact_from_starts, compact_from_tensors, expand
from tokenfeed.server.pack import bestfit, packing

CHILD = r"""
import sys
import numpy as np
from tokenfeed.client.jax import expand
from tokenfeed.client.wire import Compact

data = np.load(sys.argv[1])
out = {}
for case in range(int(data["cases"])):
    padding = data[f"{case}.padding"]
    c = Compact(data[f"{case}.tokens"], data[f"{case}.starts"], data[f"{case}.row_splits"],
                padding if padding.size else None)
    for name, arr in expand(c).items():
        assert str(arr.dtype) == "int32", (name, arr.dtype)
        out[f"{case}.{name}"] = np.asarray(arr)
np.savez(sys.argv[2], **out)
"""


def cases() -> list:
    lens = np.array([5, 30, 1, 9, 14, 3], dtype=np.int32)
    tokens = np.arange(40_000, 40_000 + int(lens.sum()), dtype=np.int32)  # above int16's range
    offsets = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    stream = packing.concat_stream(offsets, lens, np.arange(len(lens)), True)
    rows, seq_len = np.array([0, 1, 3, 5, 6]), 8
    ids = np.empty((len(rows), seq_len + 1), dtype=np.int32)
    lo = rows * seq_len
    at = np.arange(len(rows)) * (seq_len + 1)
    found = packing.fill_concat(stream, tokens, lo, lo + seq_len + 1, at, 1, 2, ids.reshape(-1))
    concat = compact_from_starts(ids.astype("<u2"), packing.starts_mask(found, ids.shape))
    layout = bestfit.bestfit_layout(lens, seq_len, False)
    tensors = bestfit.bestfit_rows_at(
        layout, offsets, tokens, np.arange(layout.rows), seq_len, 1, 2, 2
    )
    assert tensors["loss_mask"].min() == 0  # padded rows: the padding path is exercised
    return [concat, compact_from_tensors(tensors, np.dtype("<i4"))]


def test_jax_expand_equals_the_numpy_expansion(tmp_path):
    compacts = cases()
    arrays = {"cases": np.array(len(compacts))}
    for i, c in enumerate(compacts):
        padding = c.padding if c.padding is not None else np.zeros(0)
        arrays.update(
            {
                f"{i}.tokens": c.tokens,
                f"{i}.starts": c.starts,
                f"{i}.row_splits": c.row_splits,
                f"{i}.padding": padding,
            }
        )
    np.savez(tmp_path / "in.npz", **arrays)
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    out = np.load(tmp_path / "out.npz")
    for i, c in enumerate(compacts):
        for name in TENSOR_NAMES:
            assert np.array_equal(out[f"{i}.{name}"], expand(c, name)), (i, name)
