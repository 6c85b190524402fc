"""Configuration: frozen specs that check themselves on construction, read from a file once
in `main` and passed down explicitly.

The specs live by subject: jobspec.py (a job: datasets, sources, tokenizer, packing,
schedule), serverspec.py (the server, object storage, the shared store, and `Config`),
portspec.py (TLS, tokens and limits of the serving port). configparse.py maps a YAML or TOML
file onto them and names the file and key path of every error (docs/configuration.md). This
module gathers the names the rest of the server imports.
"""

from __future__ import annotations

from tokenfeed.server.settings.configparse import from_dict, load
from tokenfeed.server.settings.jobspec import (
    BAD_RECORD_POLICIES,
    FORMATS,
    JSONL_SUFFIXES,
    PACKINGS,
    TOKENIZER_BACKENDS,
    DatasetSpec,
    JobSpec,
    PhaseSpec,
    SourceSpec,
    TokenizerSpec,
)
from tokenfeed.server.settings.portspec import AuthSpec, LimitsSpec, TlsSpec
from tokenfeed.server.settings.serverspec import (
    ADDRESSING_STYLES,
    Config,
    ObjectStoreSpec,
    ServerSpec,
    StoreSpec,
)

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
