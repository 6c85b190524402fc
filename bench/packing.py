"""Packing: best_fit against concat on one chunk of documents with log-normal lengths.

In process, no server: what each packing wastes (best_fit pads the end of rows, concat drops the
tail of each chunk's stream), how fast best_fit lays a chunk out, and how fast each assembles
rows, a batch's worth at a time, from the same chunk in memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from tokenfeed.server.pack import bestfit, packing

from bench.stats import median

DOCS = 32_768  # about one default 64 MiB chunk at these lengths (2 bytes per token)
MEDIAN_TOKENS = 600
SIGMA = 1.0  # of the natural log of the length
CLIP = (1, 20_000)
SEQ_LENS = (2048, 8192)
ADD_BOS = False  # EOS only, as with GPT-2-style tokenizers
ROWS_PER_CALL = 8
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0
SEED = 0


@dataclass(frozen=True)
class PackingSizes:
    repeats: int  # layout timings and assembly rounds; figures are medians over them
    calls: int  # assembly calls of ROWS_PER_CALL rows per round and packing


@dataclass
class PackingCase:
    seq_len: int
    bestfit_rows: int
    concat_rows: int
    padding: float  # best_fit: padding input slots / input slots
    dropped: float  # concat: tokens of the chunk's stream read on into the next chunk
    layout_seconds: list[float]  # bestfit_layout
    count_seconds: list[float]  # bestfit_rows, what the index computes per chunk
    stream_seconds: list[float]  # concat_stream, concat's counterpart of the layout
    bestfit_call_seconds: list[float]  # per round: mean seconds of one bestfit_rows_at call
    concat_call_seconds: list[float]  # the same for concat_rows_at, in the same round


@dataclass
class PackingResult:
    docs: int
    tokens: int
    calls: int
    cases: list[PackingCase]


def chunk(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, doc offsets, doc lengths) of one synthetic chunk; ids are random, as the
    gathers' cost does not depend on them."""
    raw = np.exp(rng.normal(np.log(MEDIAN_TOKENS), SIGMA, DOCS))
    lengths = np.clip(np.rint(raw), *CLIP).astype(np.int64)
    tokens = rng.integers(3, 50_000, int(lengths.sum()), dtype=np.int32)
    return tokens, np.cumsum(lengths) - lengths, lengths


def timed(fn, repeats: int) -> tuple[object, list[float]]:
    seconds, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        seconds.append(time.perf_counter() - start)
    return value, seconds


def per_call(fn, picks: np.ndarray) -> float:
    start = time.perf_counter()
    for rows in picks:
        fn(rows)
    return (time.perf_counter() - start) / len(picks)


def case(sizes: PackingSizes, seq_len: int, rng, tokens, offsets, lengths) -> PackingCase:
    order = np.arange(len(lengths))
    layout, layout_seconds = timed(
        lambda: bestfit.bestfit_layout(lengths, seq_len, ADD_BOS), sizes.repeats
    )
    count, count_seconds = timed(
        lambda: bestfit.bestfit_rows(lengths, seq_len, ADD_BOS), sizes.repeats
    )
    assert count == layout.rows
    stream, stream_seconds = timed(
        lambda: packing.concat_stream(offsets, lengths, order, ADD_BOS), sizes.repeats
    )
    n_concat = (stream.total - 1) // seq_len  # rows inside this chunk; the tail reads on

    def fit(rows):
        return bestfit.bestfit_rows_at(
            layout, offsets, tokens, rows, seq_len, BOS_ID, EOS_ID, PAD_ID
        )

    def cat(rows):
        return packing.concat_rows_at(stream, tokens, rows, seq_len, BOS_ID, EOS_ID)

    shape = (sizes.calls, ROWS_PER_CALL)
    fit_picks, cat_picks = rng.integers(0, layout.rows, shape), rng.integers(0, n_concat, shape)
    fit_seconds, cat_seconds = [], []
    for r in range(sizes.repeats):
        # Alternate which side goes first so a slow moment falls on both.
        if r % 2:
            cat_seconds.append(per_call(cat, cat_picks))
            fit_seconds.append(per_call(fit, fit_picks))
        else:
            fit_seconds.append(per_call(fit, fit_picks))
            cat_seconds.append(per_call(cat, cat_picks))
    return PackingCase(
        seq_len=seq_len,
        bestfit_rows=layout.rows,
        concat_rows=n_concat,
        padding=bestfit.padding_fraction(layout, seq_len),
        dropped=(stream.total - n_concat * seq_len) / stream.total,
        layout_seconds=layout_seconds,
        count_seconds=count_seconds,
        stream_seconds=stream_seconds,
        bestfit_call_seconds=fit_seconds,
        concat_call_seconds=cat_seconds,
    )


def run(sizes: PackingSizes) -> PackingResult:
    rng = np.random.default_rng(SEED)
    tokens, offsets, lengths = chunk(rng)
    cases = [case(sizes, seq_len, rng, tokens, offsets, lengths) for seq_len in SEQ_LENS]
    return PackingResult(docs=len(lengths), tokens=len(tokens), calls=sizes.calls, cases=cases)


def docs_per_second(result: PackingResult, seconds: list[float]) -> float:
    return result.docs / median(seconds)
