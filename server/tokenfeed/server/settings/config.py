"""Configuration: frozen specs that check themselves on construction, read from a file once
in `main` and passed down explicitly.

Each option is declared once, on its spec's field (options.py says how, and how to add one).
The specs live by subject: sourcespec.py (datasets, sources, the tokenizer), jobspec.py (a
job: packing, schedule), serverspec.py (the server and `Config`), storespec.py (object storage
and the shared store), portspec.py (TLS, tokens and limits of the serving port).
configparse.py and jobparse.py map a YAML or TOML file onto them and name the file and key
path of every error (docs/configuration.md, whose reference tables configdocs.py writes). This
module gathers the names the rest of the server imports.
"""

from __future__ import annotations

from tokenfeed.server.settings.configparse import from_dict, load
from tokenfeed.server.settings.jobspec import BAD_RECORD_POLICIES, PACKINGS, JobSpec, PhaseSpec
from tokenfeed.server.settings.portspec import AuthSpec, LimitsSpec, TlsSpec
from tokenfeed.server.settings.serverspec import Config, ServerSpec
from tokenfeed.server.settings.sourcespec import (
    FORMATS,
    JSONL_SUFFIXES,
    TOKENIZER_BACKENDS,
    DatasetSpec,
    SourceSpec,
    TokenizerSpec,
)
from tokenfeed.server.settings.storespec import ADDRESSING_STYLES, ObjectStoreSpec, StoreSpec

__all__ = [
    "ADDRESSING_STYLES",
    "BAD_RECORD_POLICIES",
    "FORMATS",
    "JSONL_SUFFIXES",
    "PACKINGS",
    "TOKENIZER_BACKENDS",
    "AuthSpec",
    "Config",
    "DatasetSpec",
    "JobSpec",
    "LimitsSpec",
    "ObjectStoreSpec",
    "PhaseSpec",
    "ServerSpec",
    "SourceSpec",
    "StoreSpec",
    "TlsSpec",
    "TokenizerSpec",
    "from_dict",
    "load",
]
