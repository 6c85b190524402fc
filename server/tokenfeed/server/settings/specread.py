"""A spec's declared options (options.py) read from one mapping of the file: the keys each
level knows, each value read and converted, the file's defaults, and the spec built with its
errors named by the key path of the value.

    r = SpecReader(TlsSpec, Section(raw, "server.tls"), base)
    tls = r.build()     # every declared key read, the mapping checked for others, TlsSpec(...)

A parser that builds part of a spec itself (jobparse.py) reads single options first
(`r.read("seq_len")`) and gives what it built to `build(phases=...)`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configread import Keys, Node, Section, build
from tokenfeed.server.settings.options import (
    REQUIRED,
    SAME,
    Convert,
    Form,
    Nested,
    Option,
    option_of,
    options_of,
)

S = TypeVar("S")


def keys_of(spec: type, exclude: tuple[str, ...] = (), **forms: Node) -> Keys:
    """The keys a mapping of `spec` knows, each with the option that declared it; a nested
    spec's keys below its key; `forms`: what the keys read by the parser's own code hold."""
    known: dict[str, Node] = {}
    declared: dict[str, Option] = {}
    for opt in options_of(spec):
        if opt.key is None or opt.key in exclude:
            continue
        if isinstance(opt.read, Nested):
            known[opt.key] = keys_of(opt.read.spec)
        else:
            known[opt.key] = forms.get(opt.key) if isinstance(opt.read, Form) else None
        declared[opt.key] = opt
    return Keys(known, declared)


def file_key(spec: type) -> Callable[[str], str]:
    """Where a field of `spec` is written, for an error its checks raise: `pattern` is a
    source's `path`; `sources[1]` stays `sources[1]`; a field with no key is the mapping
    itself ("")."""
    keys = {opt.name: opt.key for opt in options_of(spec)}

    def key(field: str) -> str:
        m = re.match(r"(\w+)(.*)", field, re.S)
        if m is None or m.group(1) not in keys:
            return field
        written, rest = keys[m.group(1)], m.group(2)
        return f"{written}{rest}" if written else rest.removeprefix(".")

    return key


def read_option(opt: Option, s: Section, base: Path, default: Any = SAME) -> Any:
    """The value of one declared option in mapping `s`, converted and checked as declared
    (so errors come in the order values are read, each named where it is written), or its
    default: the file's, or `default` where the parser knows better (a source's text_field
    defaults to its job's). An inner spec's option given on an outer level (defaults_for) is
    checked here too, where no spec of its own checks it."""
    if opt.key is None or isinstance(opt.read, Form):
        raise TypeError(f"{opt.name}: read by the parser's own code, not by its declaration")
    if default is SAME:
        default = opt.file_default
    given = s.get(opt.key)
    if isinstance(opt.read, Nested):
        return _nested(opt, opt.read, given, s, base, default)
    if not s.has(opt.key) or (given is None and default is REQUIRED):
        if default is REQUIRED:
            raise ConfigError(f"{s.path(opt.key)}: required")
        if isinstance(opt.read, Convert) and opt.read.defaults_too:
            return opt.read.fn(default, s.path(opt.key), base)
        return default
    value = opt.read.fn(given, s.path(opt.key), base)
    for check in opt.checks:
        value = check(s.path(opt.key), value)
    return value


def _nested(opt: Option, read: Nested, given: object, s: Section, base: Path, default: Any) -> Any:
    assert opt.key is not None  # read_option checked it
    if given is None:
        if read.absent == "required":
            raise ConfigError(f"{s.path(opt.key)}: required")
        if read.absent == "off":
            return default
        given = {}
    if isinstance(given, str) and read.shorthand:
        given = {read.shorthand: given}
    spec: object = SpecReader(read.spec, Section(given, s.path(opt.key)), base).build()
    if read.absent == "off" and spec == default:
        # A section that is given turns its feature on: `auth: {}` is a mistake, not "no auth".
        raise ConfigError(f"{s.path(opt.key)}: expected {opt.describe()}, got {given!r}")
    return spec


class SpecReader(Generic[S]):
    """Reads the declared options of `spec` from one mapping and builds the spec."""

    def __init__(self, spec: type[S], section: Section, base: Path) -> None:
        self.spec = spec
        self.section = section
        self.base = base
        self.options = {opt.name: opt for opt in options_of(spec)}
        self.values: dict[str, Any] = {}

    def read(self, name: str, default: Any = SAME) -> Any:
        """One option now (its errors come before those of options read later)."""
        self.values[name] = read_option(self.options[name], self.section, self.base, default)
        return self.values[name]

    def read_all(self, defaults: Mapping[str, Any] | None = None, **given: Any) -> None:
        """Every declared option not read yet and not `given` (nor left to the parser),
        with `defaults` in place of the file's (a phase's carry over from the one before)."""
        self.values.update(given)
        for name, opt in self.options.items():
            if name in self.values or opt.key is None or isinstance(opt.read, Form):
                continue
            self.read(name, (defaults or {}).get(name, SAME))

    def build(
        self,
        key: Callable[[str], str] | None = None,
        done: bool = True,
        defaults: Mapping[str, Any] | None = None,
        **given: Any,
    ) -> S:
        """The spec of what was read, the rest read now and `given`; `done`: the mapping
        holds no other key (False where other specs read the same mapping, as a job's keys
        also give its first phase). Its checks' errors are named by `key(field)`."""
        self.read_all(defaults, **given)
        if done:
            self.section.done()
        values = self.values
        return build(self.section.where, lambda: self.spec(**values), key or file_key(self.spec))


def defaults_for(spec: type, name: str, what: str) -> Keys:
    """The key of an inner spec's option given on an outer level, as the default of the inner
    ones that do not set it (a job's `text_field` for its sources): one key, documented so."""
    opt = option_of(spec, name)
    assert opt.key is not None
    doc = f"the default `{opt.key}` of {what} that set none: {opt.doc}"
    return Keys({opt.key: None}, {opt.key: dataclasses.replace(opt, doc=doc)})
