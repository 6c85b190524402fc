"""What a job reads: its datasets, their sources, and the tokenizer.

Each option is declared once on its field (options.py); the shapes a job file gives them
(a source as a plain path, one dataset or several) are jobparse.py's.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configcheck import Flag, OptionalText, Size, Text, TokenId, Tuple
from tokenfeed.server.settings.configread import PATH, SIZES, parse_size
from tokenfeed.server.settings.options import Convert, Form, option, validate

log = logging.getLogger(__name__)

# Names `format: auto` reads as JSON Lines (chunks.py reads the same suffixes).
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
FORMATS = ("auto", "jsonl", "parquet", "megatron", "mds", "hf", "arrow", "webdataset")
# Formats read through a layout (chunks.py, layouts.py) and the keys that only they take.
TOKEN_FORMATS = ("auto", "parquet", "mds", "hf", "arrow")  # where token_field applies
SPLIT_FORMATS = ("auto", "hf", "arrow")  # a Hub repository or a save_to_disk DatasetDict
MEMBER_FORMATS = ("auto", "webdataset")
CONFIG_FORMATS = ("auto", "hf")
TOKENIZER_BACKENDS = ("auto", "hf", "tiktoken")
# Under this, per-chunk costs outweigh the bytes read (bench/smallobjects.py, bench/store.py).
SMALL_CHUNK_BYTES = 2**20


@dataclass(frozen=True)
class SourceSpec:
    """One glob (or path) of source objects and how to read them."""

    pattern: str = field(
        metadata=option(
            Text(),
            key="path",
            read=PATH,
            doc="a glob or path of source objects, local or `s3://` (`**` crosses directories); "
            "a directory (or an object-storage prefix that names no object) is every object "
            "under it, as `<dir>/**`",
        )
    )
    format: str = field(
        default="auto",
        metadata=option(
            Text(FORMATS),
            doc="`auto` reads the name or layout: `.jsonl`/`.json`/`.ndjson` (+ `.gz`/`.zst`), "
            "`.parquet`, `.idx` (Megatron, [pre-tokenized](pretokenized.md)), an MDS "
            "`index.json` (version 2), a `save_to_disk` directory (`state.json` + `.arrow`), "
            "`.tar`/`.tar.gz`/`.tgz` (WebDataset); `hf` (a Hub repository's layout) is named, "
            "never guessed ([bring your data](bring-your-data.md))",
        ),
    )
    text_field: str = field(
        default="text",
        metadata=option(
            Text(), doc="the field (JSON Lines) or column (Parquet) that holds the text"
        ),
    )
    token_field: str | None = field(
        default=None,
        metadata=option(
            OptionalText(),
            doc="Parquet, MDS, Arrow and Hub layouts: a column of token ids (`list<int>`, or an "
            "integer MDS `ndarray`) read instead of text (no tokenizer; "
            "[pre-tokenized](pretokenized.md)); refused on JSON Lines, tar and Megatron sources "
            "and beside the source's own `text_field`",
        ),
    )
    member: str = field(
        default="txt",
        metadata=option(
            Text(),
            doc="WebDataset: the member, by its extension, that holds a sample's text (`json`: "
            "the `text_field` of that JSON member)",
            why="txt: the member webdataset's own writers use for text",
        ),
    )
    split: str = field(
        default="train",
        metadata=option(
            Text(),
            doc="a Hub repository (`hf`) or a `save_to_disk` DatasetDict: the split read",
            why="train: what pre-training reads",
        ),
    )
    config: str | None = field(
        default=None,
        metadata=option(
            OptionalText(),
            doc="a Hub repository (`hf`): the config read (none: the README's default config, "
            "else `default`)",
            why="none: the repository's own default",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.token_field is not None and (
            self.megatron or self.jsonl or self.tar or self.format not in TOKEN_FORMATS
        ):
            kind = (
                "Megatron datasets hold token ids already"
                if self.megatron
                else "not tar members"
                if self.tar
                else "not JSON Lines"
            )
            raise ConfigError(
                f"token_field: applies to Parquet sources only (and the MDS, Arrow and Hub "
                f"layouts; {kind}), got {self.token_field!r} for {self.pattern!r}"
            )
        if self.member.startswith(".") or "/" in self.member:
            raise ConfigError(
                f"member: expected a member's extension such as txt or json, got {self.member!r}"
            )

    # A pattern whose name does not tell the format (and `format: auto`) is checked per object
    # when its chunks are planned (chunks.source_kind).
    @property
    def megatron(self) -> bool:
        """Megatron `.bin`/`.idx` pairs, by `format` or by the pattern's name."""
        return self.format == "megatron" or (self.format == "auto" and self._name.endswith(".idx"))

    @property
    def jsonl(self) -> bool:
        """JSON Lines, by `format` or by the pattern's name."""
        return self.format == "jsonl" or (
            self.format == "auto" and self._name.endswith(JSONL_SUFFIXES)
        )

    @property
    def tar(self) -> bool:
        """WebDataset tar shards, by `format` or by the pattern's name."""
        return self.format == "webdataset" or (
            self.format == "auto" and self._name.endswith((".tar", ".tgz"))
        )

    @property
    def _name(self) -> str:
        return re.sub(r"\.(gz|zst|zstd)$", "", self.pattern.lower())


@dataclass(frozen=True)
class TokenizerSpec:
    path: str = field(
        metadata=option(
            Text(),
            read=PATH,
            doc="a HF `tokenizers` tokenizer.json, local or `s3://` ([tokenizer](#tokenizer)); "
            "the SHA-256 of its bytes is part of every chunk's key",
        )
    )
    # Explicit ids win; otherwise the named tokens are looked up in the tokenizer's vocabulary;
    # otherwise EOS is guessed from common names (see tokenize.py).
    eos_id: int | None = field(
        default=None,
        metadata=option(
            TokenId(),
            shown="from `eos_token`, or a common EOS name",
            doc="the id the packer adds after every document; wins over `eos_token`",
        ),
    )
    eos_token: str | None = field(
        default=None,
        metadata=option(
            OptionalText(),
            shown="a common EOS name",
            doc="the EOS token, looked up in the vocabulary; a tokenizer without one of the "
            "common EOS names (BERT's WordPiece) needs this or `eos_id`",
        ),
    )
    bos_id: int | None = field(
        default=None,
        metadata=option(
            TokenId(),
            shown="from `bos_token`, or a common BOS name",
            doc="the BOS id (used with `add_bos`); wins over `bos_token`",
        ),
    )
    bos_token: str | None = field(
        default=None,
        metadata=option(
            OptionalText(), shown="a common BOS name", doc="the BOS token, looked up like EOS"
        ),
    )
    add_bos: bool = field(
        default=False,
        metadata=option(Flag(), doc="BOS before every document (EOS always goes after one)"),
    )
    # The engine that computes the ids: never changes them (tokenize.py checks at load time),
    # so it is not part of the job's fingerprint.
    backend: str = field(
        default="auto",
        metadata=option(
            Text(TOKENIZER_BACKENDS),
            doc="the engine that computes the ids, never changing them "
            "([the engine](token-store.md#the-tokenizer-engine-tokenizerbackend)): `hf` always "
            "HF; `tiktoken` the exact tiktoken engine or an error saying why it cannot be exact",
            why="tiktoken where the load-time check shows it exact (about 3x faster), else HF",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)


def _chunk_bytes(value: object, where: str, base: Path) -> int:
    """A small `chunk_bytes` is allowed (tests use it) but said to cost what it does, once,
    where it is given."""
    size = parse_size(value, where)
    if size < SMALL_CHUNK_BYTES:
        log.warning(
            "%s: chunk_bytes %d is under 1 MiB: each chunk costs 4 store files, a manifest and "
            "at least one GET; expect slow builds and a large store",
            where,
            size,
        )
    return size


@dataclass(frozen=True)
class DatasetSpec:
    name: str = field(
        metadata=option(
            Text(),
            key="dataset",
            default="main",
            doc="keys the dataset's sample order (rename the job freely); a mixture names its "
            "datasets by their keys",
            why="any fixed name serves: it only keys the order",
        )
    )
    sources: tuple[SourceSpec, ...] = field(
        metadata=option(
            Tuple(SourceSpec),
            read=Form("a path, a mapping (below) or a list of them"),
            doc="the dataset's globs or paths; a string is `{path: ...}`",
        )
    )
    chunk_bytes: int = field(
        default=64 * 2**20,
        metadata=option(
            Size(),
            read=Convert(_chunk_bytes, SIZES),
            doc="plain JSONL is cut into ranges of this size; smaller objects (and Parquet row "
            "groups) are grouped into chunks of up to this size "
            "([token store](token-store.md#chunks-what-one-chunk-is)). Under 1 MiB is allowed "
            "but logs a warning: each chunk costs 4 store files, a manifest and at least one GET",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)
