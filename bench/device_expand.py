"""The client helpers' device-side expansion on an accelerator: the compact batch moved to the
device and the five int32 tensors derived there (torch, JAX), checked equal to the numpy
expansion, and timed against moving the five tensors themselves.

    python -m bench.device_expand [--device cuda]

Needs a GPU for figures that mean anything (on a CPU it runs, and checks equality).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tokenfeed.client.wire import TENSOR_NAMES, compact_from_flat_starts, expand

from bench.table import render

SHAPES = ((8, 2048), (32, 4096), (64, 8192))
VOCAB = 50_000


def compact_batch(rows: int, seq_len: int, rng: np.random.Generator):
    """A concat-like batch: random ids, documents of log-normal lengths (median ~600)."""
    tokens = rng.integers(0, VOCAB, (rows, seq_len + 1)).astype("<u2")
    width = seq_len + 1
    lengths = rng.lognormal(np.log(600), 1.0, rows * seq_len // 100 + 10).astype(np.int64) + 1
    starts = np.cumsum(lengths)
    starts = starts[starts < rows * width]
    return compact_from_flat_starts(tokens, starts)


def timed(fn, sync, repeats: int = 20) -> float:
    fn()
    sync()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - began) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    import torch
    from tokenfeed.client import jax as tf_jax
    from tokenfeed.client import torch as tf_torch

    device = torch.device(args.device if torch.cuda.is_available() else "cpu")
    rng = np.random.default_rng(0)
    rows_out = []
    for rows, seq_len in SHAPES:
        c = compact_batch(rows, seq_len, rng)
        want = {n: expand(c, n) for n in TENSOR_NAMES}
        got = tf_torch.expand(c, device)
        for n in TENSOR_NAMES:
            assert np.array_equal(got[n].cpu().numpy(), want[n]), ("torch", n)
        on_jax = tf_jax.expand(c)
        for n in TENSOR_NAMES:
            assert np.array_equal(np.asarray(on_jax[n]), want[n]), ("jax", n)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()

        compact_s = timed(lambda c=c: tf_torch.expand(c, device), sync)
        five_s = timed(
            lambda w=want: {n: torch.from_numpy(a).to(device) for n, a in w.items()}, sync
        )
        numpy_s = timed(lambda c=c: [expand(c, n) for n in TENSOR_NAMES], lambda: None)
        jax_s = timed(
            lambda c=c: [a.block_until_ready() for a in tf_jax.expand(c).values()], lambda: None
        )
        moved = c.tokens.nbytes + c.starts.nbytes + c.row_splits.nbytes
        rows_out.append(
            [
                f"[{rows}, {seq_len}]",
                f"{moved / 1024:,.0f}",
                f"{5 * rows * seq_len * 4 / 1024:,.0f}",
                f"{compact_s * 1e3:.3f}",
                f"{five_s * 1e3:.3f}",
                f"{jax_s * 1e3:.3f}",
                f"{numpy_s * 1e3:.3f}",
            ]
        )
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(
        render(
            f"Device-side expansion on {name}"
            " (torch and JAX equal to numpy on every shape; ms per batch, mean of 20)",
            [
                "batch",
                "compact KiB moved",
                "5 tensors KiB",
                "torch.expand",
                "move 5 tensors",
                "jax.expand",
                "numpy expand (CPU)",
            ],
            rows_out,
        )
    )


if __name__ == "__main__":
    main()
