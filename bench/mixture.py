"""Step lookup cost of a mixture: (dataset, dataset row) for every slot of one global batch."""

from __future__ import annotations

import time
from fractions import Fraction

from tokenfeed.server.sampling.mixture import Phase, Schedule

from bench.table import number, render

BATCH = 512
STEPS = (0, 10**4, 10**7)


def lookup_seconds(datasets: int, step: int, repeats: int) -> float:
    weights = tuple(Fraction(d % 7 + 1) for d in range(datasets))
    schedule = Schedule([Phase(0, BATCH, weights)], seed=1)
    schedule.rows(step, 0, BATCH)  # warm: nothing is cached between steps, only imports
    start = time.perf_counter()
    for i in range(repeats):
        schedule.rows(step + i, 0, BATCH)
    return (time.perf_counter() - start) / repeats


def mixture_table(repeats: int) -> str:
    rows = []
    for datasets in (1, 10, 100):
        cells = [number(lookup_seconds(datasets, step, repeats) * 1e6, 1) for step in STEPS]
        rows.append([str(datasets), *cells])
    title = (
        f"5. Mixture step lookup: dataset and row of all {BATCH} slots of a global batch, "
        f"microseconds per step (mean of {repeats})"
    )
    return render(title, ["datasets", *(f"step {s:,}" for s in STEPS)], rows)


if __name__ == "__main__":
    print(mixture_table(200))
