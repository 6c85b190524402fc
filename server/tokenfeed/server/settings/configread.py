"""Reading a config file's raw values: each mapping with its key path, the keys each level
knows (an unknown one is named with the closest known key), and how a file writes sizes,
numbers, weights and paths (the converters options declare with `read=`: SIZE, NUMBER, PATH).

Every error raised here starts with the key path of the value (`jobs.demo.seq_len: ...`);
configparse.py adds the file's name in front.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TypeAlias, TypeVar

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings import configcheck as check
from tokenfeed.server.settings.options import Convert, Option

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}


def join(where: str, key: str) -> str:
    """The key path of `key` inside `where`: `jobs.demo` + `seq_len`, `sources` + `[1]`."""
    if not key:
        return where
    if not where or key.startswith("["):
        return f"{where}{key}"
    return f"{where}.{key}"


# ---------------------------------------------------------------- the keys each level knows


@dataclass(frozen=True)
class Keys:
    """A mapping with these keys, each with what its value holds (None: a plain value). A
    value of another type (a string shorthand, a mistake) is left to the parser. `declared`:
    the option each key was declared by (specread.keys_of), for the reference."""

    known: Mapping[str, Node]
    declared: Mapping[str, Option] = field(default_factory=dict)

    def __or__(self, other: Keys) -> Keys:
        """The keys of one level that several specs read (a job's own, its first phase's)."""
        twice = sorted(set(self.known) & set(other.known))
        if twice:
            raise TypeError(f"keys declared twice at one level: {twice}")
        return Keys({**self.known, **other.known}, {**self.declared, **other.declared})

    def showing(self, default: str, *names: str) -> Keys:
        """The same keys, the reference showing `default` as the default of `names`: what a
        shape of the file means for them (a phase's keys carry over from the one before)."""
        declared = dict(self.declared)
        for name in names:
            declared[name] = dataclasses.replace(declared[name], shown=default)
        return Keys(self.known, declared)


@dataclass(frozen=True)
class Named:
    """A mapping of names the file chooses (jobs, datasets) to values like `item`; `label`
    stands for the name in the reference (`jobs.<job>.seq_len`)."""

    item: Node
    label: str = "<name>"


@dataclass(frozen=True)
class Items:
    """A list of values like `item`, or one such value alone."""

    item: Node


Node: TypeAlias = Keys | Named | Items | None


def keys(*plain: str, **nested: Node) -> Keys:
    """Keys with plain values, and keys holding further levels."""
    return Keys({**dict.fromkeys(plain), **nested})


def unknown_key(where: str, key: object, known: Iterable[str]) -> ConfigError:
    names = sorted(known)
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(names)}"
    return ConfigError(f"{join(where, str(key))}: unknown key; {hint}")


def check_keys(raw: object, node: Node, where: str = "") -> None:
    """Raise on the first unknown key, at any depth, before anything else is read: a typo is
    named as a typo, not as the required key it failed to give. A level's own keys are
    checked before the levels inside it."""
    if isinstance(node, Keys) and isinstance(raw, dict):
        for key in raw:
            if key not in node.known:
                raise unknown_key(where, key, node.known)
        for key, value in raw.items():
            check_keys(value, node.known[key], join(where, key))
    elif isinstance(node, Named) and isinstance(raw, dict):
        for key, value in raw.items():
            check_keys(value, node.item, join(where, str(key)))
    elif isinstance(node, Items):
        if isinstance(raw, list):
            for i, value in enumerate(raw):
                check_keys(value, node.item, f"{where}[{i}]")
        else:
            check_keys(raw, node.item, where)


# ---------------------------------------------------------------- one mapping's values


class Section:
    """One mapping of the raw config and its key path, and the keys read from it."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, dict):
            # The file itself has no key path: its name alone goes in front (from_dict).
            prefix = f"{where}: " if where else ""
            raise ConfigError(f"{prefix}expected a mapping, got {type(raw).__name__} {raw!r}")
        self.raw: dict[object, object] = raw
        self.where = where
        self.used: set[str] = set()

    def path(self, key: str) -> str:
        return join(self.where, key)

    def has(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: object = None) -> object:
        self.used.add(key)
        return self.raw.get(key, default)

    def require(self, key: str) -> object:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(f"{self.path(key)}: required")
        return self.raw[key]

    def done(self) -> None:
        """Every key given was read: check_keys and the parser agree on what a level holds."""
        for key in self.raw:
            if key not in self.used:
                raise unknown_key(self.where, key, self.used)


# ---------------------------------------------------------------- conversions and locations


def parse_size(value: object, where: str) -> int:
    """A size as the file writes it (`64MiB`, `1 GB`, 4096) in bytes, >= 1."""
    if isinstance(value, bool):
        raise check.fail(where, "a size such as 64MiB", value)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        size = int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    else:
        raise check.fail(where, "a size such as 64MiB", value)
    if size < 1:
        raise check.fail(where, "a size >= 1 byte", value)
    return size


def to_fraction(value: object, where: str) -> Fraction:
    """A non-negative exact rational: 3, 0.7 (read as the decimal 7/10) or "1/3"."""
    frac: Fraction | None = None
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            frac = Fraction(str(value))
        except (ValueError, ZeroDivisionError):
            frac = None
    if frac is None or frac < 0 or not math.isfinite(float(frac)):
        raise check.fail(where, 'a weight >= 0 (3, 0.7 or "1/3")', value)
    return frac


def resolve(path: str, base: Path) -> str:
    """A path relative to the config file's directory; URIs as they are."""
    if "://" in path:
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p))


def _number(value: object, where: str, base: Path) -> object:
    """As written (5 stays 5, so errors quote it so): the spec keeps it as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise check.fail(where, "a number", value)
    return value


def _path(value: object, where: str, base: Path) -> str:
    return resolve(check.Text()(where, value), base)


def _optional_path(value: object, where: str, base: Path) -> str:
    return "" if value is None else _path(value, where, base)


def _text_or_none(value: object, where: str, base: Path) -> str:
    return "" if value is None else check.Text()(where, value)


# How a file writes values of a few kinds (options.Convert). A value as written is
# options.AS_WRITTEN: the spec's checks name what is wrong with it.
NUMBER = Convert(_number)
SIZES = "size: 4096, `64MiB`, `1 GB` (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
SIZE = Convert(lambda v, where, base: parse_size(v, where), SIZES)
FRACTION = Convert(lambda v, where, base: to_fraction(v, where), 'weight: 3, 0.7 or "1/3"')
PATH = Convert(_path, "path or URI (a relative path is relative to this file)", defaults_too=True)
# "" (none) in the spec; in the file, the key left out or null, never an empty string.
OPTIONAL_PATH = Convert(_optional_path, "path (relative to this file)")
TEXT_OR_NONE = Convert(_text_or_none, "non-empty string")


def same(field: str) -> str:
    return field


def build(where: str, make: Callable[[], T], key: Callable[[str], str] = same) -> T:
    """`make()` constructs one spec; an error of its checks names one of its fields
    (`seq_len: ...`) and is raised again naming where that value is in the file:
    `where` joined with `key(field)` ("" for `where` itself)."""
    try:
        return make()
    except ConfigError as e:
        field, sep, reason = str(e).partition(": ")
        if not sep:
            raise ConfigError(f"{where}: {e}") from None
        raise ConfigError(f"{join(where, key(field))}: {reason}") from None
