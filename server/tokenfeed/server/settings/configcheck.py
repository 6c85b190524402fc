"""Checks a config spec runs on its own fields when it is constructed.

Each check takes the field's name and value, returns the value with its type narrowed, and
raises `ConfigError("<name>: expected ..., got <value!r>")`. The message starts with the name
so that the file parser (configparse.py) can replace it with where the value was written
(`jobs.demo.seq_len`); a spec built in code reports the field's own name.
"""

from __future__ import annotations

import math
from typing import TypeVar

from tokenfeed.server.errors import ConfigError

T = TypeVar("T")


def fail(name: str, expected: str, value: object) -> ConfigError:
    """The error for a value that is not what `name` takes, quoting the value as written."""
    return ConfigError(f"{name}: expected {expected}, got {value!r}")


def integer(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> int:
    # bool is an int subclass; `seq_len: true` is a mistake, never 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(name, "an integer", value)
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise fail(name, f"an integer in [{minimum}, {maximum}]", value)
    if minimum is not None and value < minimum:
        raise fail(name, f"an integer >= {minimum}", value)
    if maximum is not None and value > maximum:
        raise fail(name, f"an integer <= {maximum}", value)
    return value


def number(name: str, value: object, minimum: float = 0.0) -> float:
    """A finite real number >= minimum, as a float; NaN (YAML `.nan`, TOML `nan`) is refused."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not minimum <= value < math.inf
    ):
        raise fail(name, f"a number >= {minimum}", value)
    return float(value)


def positive(name: str, value: object) -> float:
    """A finite number of seconds > 0, as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise fail(name, "a positive number of seconds", value)
    return float(value)


def float_field(spec: object, name: str, minimum: float = 0.0, above_zero: bool = False) -> None:
    """Check the number field `name` of a frozen spec and keep it as a float: a file (or a
    caller) may write 5 for 5.0, and the spec holds one type either way. Errors quote the
    value as it was given."""
    value = getattr(spec, name)
    checked = positive(name, value) if above_zero else number(name, value, minimum)
    object.__setattr__(spec, name, checked)


def text(name: str, value: object, choices: tuple[str, ...] = (), empty: bool = False) -> str:
    """A string; non-empty unless `empty` (where "" means "none"); one of `choices` if given."""
    if not isinstance(value, str) or (not value and not empty):
        raise fail(name, "a string" if empty else "a non-empty string", value)
    if choices and value not in choices:
        raise fail(name, f"one of {list(choices)}", value)
    return value


def optional_text(name: str, value: object) -> str | None:
    return None if value is None else text(name, value)


def token_id(name: str, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise fail(name, "a token id >= 0", value)
    return value


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise fail(name, "true or false", value)
    return value


def size(name: str, value: object, minimum: int = 1) -> int:
    """A number of bytes (the file may write it as `64MiB`: configparse converts it first)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(name, f"a size >= {minimum} byte{'s' if minimum > 1 else ''}", value)
    return value


def instance(name: str, value: object, kind: type[T]) -> T:
    if not isinstance(value, kind):
        raise fail(name, f"a {kind.__name__}", value)
    return value


def items(name: str, value: object, kind: type[T]) -> tuple[T, ...]:
    """A non-empty tuple of `kind`; errors name the item (`sources[1]`)."""
    if not isinstance(value, tuple) or not value:
        raise fail(name, f"a non-empty tuple of {kind.__name__}", value)
    for i, item in enumerate(value):
        instance(f"{name}[{i}]", item, kind)
    return value
