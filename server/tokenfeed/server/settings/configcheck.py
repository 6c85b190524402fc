"""The checks an option declares (options.py): what a spec's field accepts, run on the field
when the spec is constructed.

A check is called with the field's name and value, returns the value (with its type narrowed:
a number of seconds becomes a float) and raises `ConfigError("<name>: expected ..., got
<value!r>")`. The message starts with the name so that the file parser can put where the value
was written in its place (`jobs.demo.seq_len`); a spec built in code reports the field's own
name. `accepts` says the same in a few words for the configuration reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenfeed.server.errors import ConfigError


class Check(Protocol):
    @property
    def accepts(self) -> str: ...

    def __call__(self, name: str, value: Any) -> Any: ...


def fail(name: str, expected: str, value: object) -> ConfigError:
    """The error for a value that is not what `name` takes, quoting the value as written."""
    return ConfigError(f"{name}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class Integer:
    minimum: int | None = None
    maximum: int | None = None

    @property
    def accepts(self) -> str:
        return self._expected().removeprefix("an ")

    def _expected(self) -> str:
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            return f"an integer in [{low}, {high}]"
        if low is not None:
            return f"an integer >= {low}"
        return "an integer" if high is None else f"an integer <= {high}"

    def __call__(self, name: str, value: Any) -> int:
        # bool is an int subclass; `seq_len: true` is a mistake, never 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(name, "an integer", value)
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            raise fail(name, self._expected(), value)
        return value


@dataclass(frozen=True)
class Number:
    """A finite real number >= minimum (> 0 if `above_zero`), kept as a float: a file (or a
    caller) may write 5 for 5.0. NaN (YAML `.nan`, TOML `nan`) is refused."""

    minimum: float = 0.0
    above_zero: bool = False

    @property
    def accepts(self) -> str:
        return "number > 0" if self.above_zero else f"number >= {self.minimum:g}"

    def __call__(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            ok = False
        else:
            ok = 0 < value < math.inf if self.above_zero else self.minimum <= value < math.inf
        if not ok:
            expected = "a positive number of seconds" if self.above_zero else None
            raise fail(name, expected or f"a number >= {float(self.minimum)}", value)
        return float(value)


@dataclass(frozen=True)
class Text:
    """A string; non-empty unless `empty` (where "" means "none"); one of `choices` if given."""

    choices: tuple[str, ...] = ()
    empty: bool = False

    @property
    def accepts(self) -> str:
        if self.choices:
            return "one of " + ", ".join(f"`{c}`" for c in self.choices)
        return "string" if self.empty else "non-empty string"

    def __call__(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or (not value and not self.empty):
            raise fail(name, "a string" if self.empty else "a non-empty string", value)
        if self.choices and value not in self.choices:
            raise fail(name, f"one of {list(self.choices)}", value)
        return value


@dataclass(frozen=True)
class OptionalText:
    """A non-empty string, or None."""

    accepts: str = "non-empty string"

    def __call__(self, name: str, value: Any) -> str | None:
        return None if value is None else Text()(name, value)


@dataclass(frozen=True)
class OptionalChoice:
    """One of `choices`, or None (the option is not given: what it falls back to says its
    doc)."""

    choices: tuple[str, ...]

    @property
    def accepts(self) -> str:
        return "one of " + ", ".join(f"`{c}`" for c in self.choices)

    def __call__(self, name: str, value: Any) -> str | None:
        return None if value is None else Text(self.choices)(name, value)


@dataclass(frozen=True)
class OptionalInteger:
    """An integer >= `minimum`, or None (the option is not given: what it falls back to says
    its doc)."""

    minimum: int = 1

    @property
    def accepts(self) -> str:
        return f"integer >= {self.minimum}"

    def __call__(self, name: str, value: Any) -> int | None:
        return None if value is None else Integer(minimum=self.minimum)(name, value)


@dataclass(frozen=True)
class TokenId:
    accepts: str = "token id >= 0"

    def __call__(self, name: str, value: Any) -> int | None:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise fail(name, "a token id >= 0", value)
        return value


@dataclass(frozen=True)
class Flag:
    accepts: str = "`true` or `false`"

    def __call__(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise fail(name, "true or false", value)
        return value


@dataclass(frozen=True)
class Size:
    """A number of bytes (a file may write it as `64MiB`: its reader converts it first)."""

    minimum: int = 1

    @property
    def accepts(self) -> str:
        return f"size >= {self.minimum} byte{'s' if self.minimum > 1 else ''}"

    def __call__(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.minimum:
            raise fail(name, f"a {self.accepts}", value)
        return value


@dataclass(frozen=True)
class Instance:
    kind: type

    @property
    def accepts(self) -> str:
        return "mapping"

    def __call__(self, name: str, value: Any) -> Any:
        if not isinstance(value, self.kind):
            raise fail(name, f"a {self.kind.__name__}", value)
        return value


@dataclass(frozen=True)
class Tuple:
    """A non-empty tuple of `kind`; errors name the item (`sources[1]`)."""

    kind: type

    @property
    def accepts(self) -> str:
        return "non-empty list"

    def __call__(self, name: str, value: Any) -> tuple[Any, ...]:
        if not isinstance(value, tuple) or not value:
            raise fail(name, f"a non-empty tuple of {self.kind.__name__}", value)
        for i, item in enumerate(value):
            Instance(self.kind)(f"{name}[{i}]", item)
        return value


@dataclass(frozen=True)
class Rule:
    """What the checks before it let through must also pass `test`; otherwise the value is
    refused as not `expected`, or with `message` (formatted with the value) where a plain
    "expected ..., got ..." would not say what to fix."""

    test: Callable[[Any], object]
    expected: str
    message: str = ""

    @property
    def accepts(self) -> str:
        return self.expected.removeprefix("an ").removeprefix("a ")

    def __call__(self, name: str, value: Any) -> Any:
        if not self.test(value):
            if self.message:
                raise ConfigError(f"{name}: " + self.message.format(value=value))
            raise fail(name, self.expected, value)
        return value
