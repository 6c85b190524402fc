"""Plain-text tables: a title, a header row, left-aligned labels and right-aligned figures."""

from __future__ import annotations

import math
import statistics


def render(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([title, rule, line(header), rule, *map(line, rows), rule])


def number(value: float, digits: int = 0) -> str:
    """Thousands separators; 'n/a' for a figure that could not be measured."""
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the ratios of measurements taken side by side.

    On a noisy machine each pair shares its moment's load, so their ratio is steadier than the
    ratio of two medians taken over different moments.
    """
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True) if d]
    return statistics.median(ratios) if ratios else float("nan")
