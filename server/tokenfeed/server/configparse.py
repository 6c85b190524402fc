"""Reading raw config mappings with errors that name the key path and the bad value."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

from tokenfeed.server.errors import ConfigError

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


def parse_size(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size such as 64MiB, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        size = int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    else:
        raise ConfigError(f"{where}: expected a size such as 64MiB, got {value!r}")
    if size < 1:
        raise ConfigError(f"{where}: expected a size >= 1 byte, got {value!r}")
    return size


class Section:
    """Reads one mapping of the raw config, tracking the key path for error messages."""

    def __init__(self, raw: Any, where: str):
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
        self.raw = raw
        self.where = where
        self.used: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.raw.get(key, default)

    def require(self, key: str) -> Any:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(f"{self.path(key)}: required")
        return self.raw[key]

    def int(self, key: str, default: int | None = None, minimum: int | None = None) -> int:
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.path(key)}: expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self.path(key)}: expected an integer >= {minimum}, got {value!r}")
        return value

    def str(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        value = self.require(key) if default is None else self.get(key, default)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.path(key)}: expected a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise ConfigError(f"{self.path(key)}: expected one of {list(choices)}, got {value!r}")
        return value

    def opt_int(self, key: str) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{self.path(key)}: expected a token id >= 0, got {value!r}")
        return value

    def opt_str(self, key: str) -> str | None:
        value = self.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{self.path(key)}: expected a non-empty string, got {value!r}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.path(key)}: expected true or false, got {value!r}")
        return value

    def number(self, key: str, default: float, minimum: float = 0.0) -> float:
        value = self.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (minimum <= value < math.inf)
        ):
            raise ConfigError(f"{self.path(key)}: expected a number >= {minimum}, got {value!r}")
        return float(value)

    def fraction(self, key: str, default: Any = None) -> Fraction:
        """A non-negative exact rational: 3, 0.7 (read as the decimal 7/10) or "1/3"."""
        value = self.require(key) if default is None else self.get(key, default)
        return to_fraction(value, self.path(key))

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise ConfigError(f"{self.path(unknown[0])}: unknown key (known keys: {known})")


def resolve(path: str, base: Path) -> str:
    if "://" in path:
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p))


def to_fraction(value: Any, where: str) -> Fraction:
    try:
        if isinstance(value, bool):
            raise ValueError
        frac = Fraction(str(value)) if isinstance(value, (int, float, str)) else None
    except (ValueError, ZeroDivisionError):
        frac = None
    if frac is None or frac < 0 or not math.isfinite(float(frac)):
        raise ConfigError(f'{where}: expected a weight >= 0 (3, 0.7 or "1/3"), got {value!r}')
    return frac
