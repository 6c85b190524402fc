"""Plain-text tables: a title, a header row, left-aligned labels and right-aligned figures."""

from __future__ import annotations

import math


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
