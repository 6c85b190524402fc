"""Summaries of repeated measurements."""

from __future__ import annotations

import math
import statistics


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]): an observed value, never an interpolation."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * q / 100)) - 1]


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the ratios of measurements taken side by side.

    On a noisy machine each pair shares its moment's load, so their ratio is steadier than the
    ratio of two medians taken over different moments.
    """
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True) if d]
    return median(ratios)
