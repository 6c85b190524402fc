"""Each configuration option declared once: a spec's dataclass field carries its metadata, and
everything else follows from it.

A field is declared with `field(default=..., metadata=option(checks..., doc=..., why=...))`:

    @dataclass(frozen=True)
    class StoreSpec:
        min_nodes: int = field(
            default=1,                                 # the default, in code and in the file
            metadata=option(
                Integer(minimum=1),                    # the checks (configcheck.py), in order
                doc="before building, wait until this many nodes heartbeat",
                why="1: a node starts at once",         # the reason for the default
            ),
        )

        def __post_init__(self) -> None:
            validate(self)                             # every declared check, in field order

From that one declaration: the spec checks the field when it is constructed, with the check's
message (`min_nodes: expected an integer >= 1, got 0`); the file's key (`key=`, the field's
name unless given) is a known key of its level, with the closest key suggested for a typo
(specread.keys_of); the value is read and converted from the file (`read=`: configread's
SIZE, NUMBER, PATH...; AS_WRITTEN by default) and checked where it is written
(`tf.yaml: store.min_nodes: expected an integer >= 1, got 0`), or takes the file's default
(`default=`, the field's own unless given; REQUIRED: the file must give it); and the
reference in docs/configuration.md shows the key, what it accepts, its default, the doc and
the reason (configdocs.py, `make config-docs`).

Adding an option is adding the field, nothing else:
- a plain key: the field, as above (a new source key such as a `format`'s own options goes on
  SourceSpec; a new `format` value into FORMATS);
- a new section (`plan:` of a job): a frozen spec of declared fields whose `__post_init__`
  calls `validate(self)`, and a field holding it, `read=Nested(PlanSpec)`; then a table for
  its level in docs/configuration.md (`<!-- options: jobs.<job>.plan -->`, which the docs test
  asks for by name), filled by `make config-docs`;
- a per-phase key (a phase's `seq_len`): a field of PhaseSpec; jobparse reads phase 0 from
  the job's own keys and carries it over along `schedule:`. A key two specs declare at one
  level (JobSpec's `seq_len` too) is refused at import (configread.Keys.__or__).

Rules between fields (a key file needs its certificate) stay in the spec's `__post_init__`
after `validate(self)`. A key whose value is not one value but a shape the parser builds (a
job's datasets, its schedule, the shared store) is declared with `read=Form(...)`, documented
from here and read by configparse.py or jobparse.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenfeed.server.settings.configcheck import Check

# The metadata key of a declared field.
OPTION = "tokenfeed.option"


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# A file default: the file must give the key.
REQUIRED: Any = _Marker("REQUIRED")
# Not given to option(): the field's own name (key) or default (file default).
SAME: Any = _Marker("SAME")


@dataclass(frozen=True)
class Convert:
    """How the file writes a value: `fn(value as written, key path, config file's directory)`
    returns the field's value or raises naming the key path. `defaults_too`: the field's
    default is converted as well (a relative default path is relative to the file)."""

    fn: Callable[[Any, str, Path], Any]
    accepts: str = ""
    defaults_too: bool = False


@dataclass(frozen=True)
class Nested:
    """A mapping of another spec's keys (or a string: the value of its `shorthand` key).
    When the key is absent or null: `defaults` reads an empty mapping (every key at its
    default), `off` keeps the field's default (the feature is off; a section that is given
    must turn it on: `auth: {}` is refused), `required` refuses."""

    spec: type
    shorthand: str | None = None
    absent: Literal["defaults", "off", "required"] = "defaults"


@dataclass(frozen=True)
class Form:
    """A shape the parser builds with its own code (a job's datasets, its schedule, the
    shared store's default node name): the key is known and documented from the declaration,
    and read by configparse.py or jobparse.py."""

    accepts: str


Read = Convert | Nested | Form

# Most values are passed to the spec as written: its checks name what is wrong with them.
AS_WRITTEN = Convert(lambda value, where, base: value)


@dataclass(frozen=True)
class Option:
    """One declared option; `name`, `key` and `file_default` are filled in by options_of."""

    checks: tuple[Check, ...]
    doc: str
    why: str = ""
    key: str | None = None
    read: Read = AS_WRITTEN
    file_default: Any = SAME
    shown: str | None = None
    accepts: str | None = None
    name: str = ""

    def describe(self) -> str:
        """What the file may write here, for the reference."""
        if self.accepts is not None:
            return self.accepts
        read = self.read
        if isinstance(read, Nested):
            return f"`{read.shorthand}` or mapping (below)" if read.shorthand else "mapping (below)"
        if isinstance(read, Form) or (isinstance(read, Convert) and read.accepts):
            first = read.accepts
            rest = [c.accepts for c in self.checks[1:]]
            return "; ".join([first, *rest])
        return "; ".join(c.accepts for c in self.checks)


def option(
    *checks: Check,
    doc: str,
    why: str = "",
    key: str | None = SAME,
    read: Read = AS_WRITTEN,
    default: Any = SAME,
    shown: str | None = None,
    accepts: str | None = None,
) -> dict[str, Option]:
    """The metadata of a declared field (see the module's docstring). `key=None`: not in the
    file (the parser gives it); `default`: the file's default when it differs from the
    field's (REQUIRED: the file must give it); `shown`: the default as the reference writes
    it; `accepts`: what the reference says the key accepts, when the checks do not say it."""
    made = Option(checks, doc, why, key, read, default, shown, accepts)
    return {OPTION: made}


_DECLARED: dict[type, tuple[Option, ...]] = {}


def options_of(spec: type) -> tuple[Option, ...]:
    """A spec's declared options in field order; every field must be declared."""
    if spec in _DECLARED:
        return _DECLARED[spec]
    found = []
    for f in dataclasses.fields(spec):
        declared = f.metadata.get(OPTION)
        if not isinstance(declared, Option):
            raise TypeError(f"{spec.__name__}.{f.name}: declare it with option() (options.py)")
        default = declared.file_default
        if default is SAME:
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = REQUIRED
        key = f.name if declared.key is SAME else declared.key
        found.append(dataclasses.replace(declared, name=f.name, key=key, file_default=default))
    _DECLARED[spec] = tuple(found)
    return _DECLARED[spec]


def option_of(spec: type, name: str) -> Option:
    for declared in options_of(spec):
        if declared.name == name:
            return declared
    raise KeyError(f"{spec.__name__} has no option {name!r}")


def validate(spec: object) -> None:
    """Run every declared check of a frozen spec on its field, in field order, and keep the
    narrowed value (5 for a number of seconds is kept as 5.0)."""
    for declared in options_of(type(spec)):
        value = checked = getattr(spec, declared.name)
        for check in declared.checks:
            checked = check(declared.name, checked)
        if checked is not value:
            object.__setattr__(spec, declared.name, checked)


def file_only(key: str, read: Read, default: Any, doc: str) -> Option:
    """An option of the file that no spec field holds (a dataset's `weight`, which the parser
    gathers into its phases' weights): declared where the parser reads it."""
    return Option((), doc, key=key, read=read, file_default=default, name=key)
