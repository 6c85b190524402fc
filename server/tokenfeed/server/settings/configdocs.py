"""The configuration reference, written from the declarations (options.py): one table per
level of the file, between markers in docs/configuration.md whose prose stays hand-written.

    <!-- options: server.limits -->
    (generated table)
    <!-- end options -->

`make config-docs` rewrites the tables; tests/unit/test_options.py fails when they differ from
the declarations, or when a level of the file has no table.

    python -m tokenfeed.server.settings.configdocs docs/configuration.md [--check]
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

from tokenfeed.server.settings.configcheck import Size
from tokenfeed.server.settings.configparse import FILE
from tokenfeed.server.settings.configread import Items, Keys, Named, Node, join
from tokenfeed.server.settings.options import REQUIRED, Nested, Option

BLOCK = re.compile(r"(<!-- options: (\S+) -->\n)(.*?)(<!-- end options -->)", re.S)
COMMAND = "make config-docs"
TOP = "file"


def levels(node: Node = FILE, path: str = TOP) -> Iterator[tuple[str, Keys]]:
    """Every mapping of the file with its key path (`jobs.<job>.sources[]`); `file` is the
    file itself."""
    if isinstance(node, Keys):
        yield path, node
        for key, inner in node.known.items():
            yield from levels(inner, key if path == TOP else join(path, key))
    elif isinstance(node, Named):
        yield from levels(node.item, join(path, node.label))
    elif isinstance(node, Items):
        yield from levels(node.item, f"{path}[]")


def table(keys: Keys) -> str:
    rows = ["| key | accepts | default | what it does | why this default |", "| --- " * 5 + "|"]
    for key, opt in keys.declared.items():
        cells = [f"`{key}`", opt.describe(), default(opt), opt.doc, opt.why]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def default(opt: Option) -> str:
    """The default as the file sees it."""
    if opt.shown is not None:
        return opt.shown
    value = opt.file_default
    if isinstance(opt.read, Nested):
        return {"defaults": "below", "off": "none", "required": "required"}[opt.read.absent]
    if value is REQUIRED:
        return "required"
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and any(isinstance(c, Size) for c in opt.checks):
        return f"`{size(value)}`"
    if isinstance(value, float | Fraction):
        return f"{float(value):g}"
    return str(value) if isinstance(value, int) else f"`{value}`"


def size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def render(text: str, root: Node = FILE) -> str:
    """`text` with every marked table written from the declarations; a marker naming no
    level, or a level of the file without a table, is an error naming the fix."""
    found = dict(levels(root))
    shown: set[int] = set()

    def fill(m: re.Match[str]) -> str:
        path = m.group(2)
        if path not in found:
            raise ValueError(f"<!-- options: {path} -->: no such level; levels: {list(found)}")
        shown.add(id(found[path]))
        return m.group(1) + table(found[path]) + m.group(4)

    out = BLOCK.sub(fill, text)
    # A level read in two places (a job's sources and a dataset's) is one table.
    missing = [path for path, keys in found.items() if id(keys) not in shown]
    if missing:
        raise ValueError(f"no table for {missing}: add `<!-- options: PATH -->` blocks")
    return out


def main(argv: list[str]) -> int:
    path, check = Path(argv[0]), "--check" in argv[1:]
    text = path.read_text(encoding="utf-8")
    new = render(text)
    if new == text:
        return 0
    if check:
        print(f"{path}: its reference tables differ from the declarations; run `{COMMAND}`")
        return 1
    path.write_text(new, encoding="utf-8")
    print(f"{path}: reference tables written from the declarations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
