"""Each option is declared once (settings/options.py): an option added to a spec is a known
key, read and converted from the file, checked with its declared message, and shown in the
reference; the reference in docs/configuration.md is the declarations'."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings import config as configmod
from tokenfeed.server.settings.configcheck import Instance, Integer, Size, Text
from tokenfeed.server.settings.configdocs import COMMAND, levels, render
from tokenfeed.server.settings.configparse import FILE
from tokenfeed.server.settings.configread import SIZE, Keys, Section, check_keys
from tokenfeed.server.settings.options import REQUIRED, Form, Nested, option, options_of, validate
from tokenfeed.server.settings.specread import SpecReader, keys_of

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


# ---------------------------------------------------------------- an option added in a test


@dataclass(frozen=True)
class PlanSpec:
    horizon_steps: int = field(
        default=64,
        metadata=option(
            Integer(minimum=1), doc="steps whose plan is frozen ahead", why="a test's reason"
        ),
    )
    log_bytes: int = field(
        default=2**20,
        metadata=option(Size(minimum=1024), read=SIZE, doc="the plan log's cap"),
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class OuterSpec:
    name: str = field(metadata=option(Text(), doc="a name"))
    plan: PlanSpec = field(
        default_factory=PlanSpec,
        metadata=option(Instance(PlanSpec), read=Nested(PlanSpec), doc="the plan"),
    )

    def __post_init__(self) -> None:
        validate(self)


ROOT = keys_of(OuterSpec)


def read(raw: dict) -> OuterSpec:
    return SpecReader(OuterSpec, Section(raw, "jobs.x"), Path("/base")).build()


def test_an_added_option_is_a_known_key_with_the_closest_key_suggested():
    plan = ROOT.known["plan"]
    assert isinstance(plan, Keys)
    assert list(plan.known) == ["horizon_steps", "log_bytes"]
    with pytest.raises(ConfigError) as info:
        check_keys({"name": "a", "plan": {"horizon": 3}}, ROOT, "jobs.x")
    assert str(info.value) == "jobs.x.plan.horizon: unknown key; did you mean horizon_steps?"


def test_an_added_option_is_read_converted_and_defaulted():
    assert read({"name": "a", "plan": {"log_bytes": "2KiB"}}) == OuterSpec("a", PlanSpec(64, 2048))
    assert read({"name": "a"}).plan == PlanSpec()
    assert read({"name": "a", "plan": None}).plan == PlanSpec()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"name": "a", "plan": {"horizon_steps": 0}},
            "jobs.x.plan.horizon_steps: expected an integer >= 1, got 0",
        ),
        (
            {"name": "a", "plan": {"horizon_steps": "8"}},
            "jobs.x.plan.horizon_steps: expected an integer, got '8'",
        ),
        (
            {"name": "a", "plan": {"log_bytes": "512B"}},
            "jobs.x.plan.log_bytes: expected a size >= 1024 bytes, got 512",
        ),
        ({"plan": {}}, "jobs.x.name: required"),
        ({"name": "a", "plna": {}}, "jobs.x.plna: unknown key; did you mean plan?"),
    ],
)
def test_an_added_option_is_checked_in_the_file_with_its_declared_message(raw, message):
    with pytest.raises(ConfigError) as info:
        read(raw)
    assert str(info.value) == message


def test_an_added_option_is_checked_in_code_with_its_declared_message():
    with pytest.raises(ConfigError, match=r"^horizon_steps: expected an integer >= 1, got 0$"):
        PlanSpec(horizon_steps=0)
    with pytest.raises(ConfigError, match=r"^plan: expected a PlanSpec, got \{\}$"):
        OuterSpec("a", {})  # type: ignore[arg-type]


def test_an_added_option_is_in_the_reference():
    text = (
        "<!-- options: file -->\n<!-- end options -->\n<!-- options: plan -->\n<!-- end options -->"
    )
    out = render(text, ROOT)
    row = (
        "| `horizon_steps` | integer >= 1 | 64 | steps whose plan is frozen ahead | a test's reason"
    )
    assert row in out
    assert "| `log_bytes` | size: 4096, `64MiB`" in out
    assert "| `1MiB` | the plan log's cap |  |" in out
    assert "| `plan` | mapping (below) | below | the plan |  |" in out
    # A level without a table is refused, naming it.
    with pytest.raises(ValueError, match=r"no table for \['plan'\]"):
        render("<!-- options: file -->\n<!-- end options -->", ROOT)


def test_a_field_without_a_declaration_is_refused():
    @dataclass(frozen=True)
    class Bare:
        size: int = 1

        def __post_init__(self) -> None:
            validate(self)

    with pytest.raises(TypeError, match=r"Bare\.size: declare it with option\(\)"):
        Bare()


# ---------------------------------------------------------------- the real declarations


SPECS = [
    getattr(configmod, name) for name in configmod.__all__ if name.endswith(("Spec", "Config"))
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.__name__ for s in SPECS])
def test_every_field_of_every_spec_is_declared_with_a_doc(spec):
    declared = options_of(spec)
    assert [o.name for o in declared] == [f.name for f in dataclasses.fields(spec)]
    assert all(o.doc for o in declared)


def test_every_key_of_the_file_has_its_declaration():
    for path, keys in levels(FILE):
        assert set(keys.declared) == set(keys.known), path
        assert all(o.doc for o in keys.declared.values()), path


def test_the_reference_tables_are_the_declarations():
    text = DOCS.read_text()
    assert render(text) == text, f"docs/configuration.md differs from the declarations: {COMMAND}"
    # Every level of the file has its table there.
    blocks = re.findall(r"<!-- options: (\S+) -->", text)
    assert "jobs.<job>.schedule[]" in blocks and "server.limits" in blocks


# Options whose default has no recorded reason yet (docs/configuration.md shows an empty "why"
# cell). A new option states its reason (`why=`); giving one here removes it from this list.
UNEXPLAINED = {
    "DatasetSpec.chunk_bytes",
    "JobSpec.packing",
    "JobSpec.window_chunks",
    "JobSpec.bad_records",
    "LimitsSpec.max_streams_per_connection",
    "LimitsSpec.idle_seconds",
    "ObjectStoreSpec.addressing_style",
    "ObjectStoreSpec.block_bytes",
    "ObjectStoreSpec.max_concurrency",
    "ObjectStoreSpec.max_attempts",
    "ObjectStoreSpec.backoff_base_seconds",
    "ObjectStoreSpec.backoff_max_seconds",
    "ObjectStoreSpec.connect_timeout_seconds",
    "ObjectStoreSpec.read_timeout_seconds",
    "ServerSpec.cache_dir",
    "ServerSpec.cache_bytes",
    "ServerSpec.prefetch_steps",
    "ServerSpec.tokenize_threads",
    "ServerSpec.log_format",
    "ServerSpec.max_wait_seconds",
    "ServerSpec.grace_seconds",
    "ServerSpec.stream_cache_bytes",
    "SourceSpec.format",
    "SourceSpec.text_field",
    "StoreSpec.join_seconds",
    "StoreSpec.node_ttl_seconds",
    "StoreSpec.takeover_seconds",
    "TokenizerSpec.add_bos",
}


def test_every_default_states_its_reason():
    # A default that is a choice (not "required", not "off", not a section of defaults).
    unexplained = {
        f"{spec.__name__}.{o.name}"
        for spec in SPECS
        for o in options_of(spec)
        if o.key is not None
        and not o.why
        and not o.shown
        and not isinstance(o.read, Nested | Form)
        and o.file_default not in (None, "", REQUIRED)
    }
    assert unexplained - UNEXPLAINED == set(), "declare why= for these defaults"
    assert UNEXPLAINED - unexplained == set(), "these state their reason now: drop them here"
