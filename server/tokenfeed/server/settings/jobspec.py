"""A job's spec: its datasets and sources, tokenizer, packing and batch schedule.

Every spec checks its own fields when it is constructed (configcheck.py), so a spec built in
code is held to the same rules as one read from a file. Field names are the spec's own; the
file's keys that fill them are configparse.py's business.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings import configcheck as check

PACKINGS = ("concat", "best_fit")
# Names `format: auto` reads as JSON Lines (chunks.py reads the same suffixes).
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
BAD_RECORD_POLICIES = ("skip", "strict")
FORMATS = ("auto", "jsonl", "parquet", "megatron", "mds", "hf", "arrow", "webdataset")
# Formats read through a layout (chunks.py, layouts.py) and the keys that only they take.
TOKEN_FORMATS = ("auto", "parquet", "mds", "hf", "arrow")  # where token_field applies
SPLIT_FORMATS = ("auto", "hf", "arrow")  # a Hub repository or a save_to_disk DatasetDict
MEMBER_FORMATS = ("auto", "webdataset")
TOKENIZER_BACKENDS = ("auto", "hf", "tiktoken")
# A job's name travels in requests, metrics labels and file names.
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The sample order's keys are 64-bit (order.py).
SEED_LIMIT = 2**64


def check_job_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not JOB_NAME.fullmatch(value):
        raise check.fail(name, "a job name of letters, digits, '.', '_', '-'", value)
    return value


@dataclass(frozen=True)
class SourceSpec:
    """One glob (or path) of source objects and how to read them."""

    pattern: str
    format: str = "auto"
    text_field: str = "text"
    # Parquet, MDS and Arrow: a column of token ids read instead of a text column (no
    # tokenizer): a list of integers (Parquet, Arrow) or an integer `ndarray` (MDS).
    token_field: str | None = None
    # The layouts' own keys (docs/bring-your-data.md). WebDataset: the member, by its
    # extension, that holds a sample's text ("json": `text_field` of that JSON object).
    member: str = "txt"
    # A Hub repository (`hf`) or a save_to_disk DatasetDict: the split read, and for a Hub
    # repository the config (None: the README's default config, else "default").
    split: str = "train"
    config: str | None = None

    def __post_init__(self) -> None:
        check.text("pattern", self.pattern)
        check.text("format", self.format, FORMATS)
        check.text("text_field", self.text_field)
        check.optional_text("token_field", self.token_field)
        check.text("member", self.member)
        check.text("split", self.split)
        check.optional_text("config", self.config)
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
            raise check.fail("member", "a member's extension such as txt or json", self.member)

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
    path: str
    # Explicit ids win; otherwise the named tokens are looked up in the tokenizer's vocabulary;
    # otherwise EOS is guessed from common names (see tokenize.py).
    eos_id: int | None = None
    eos_token: str | None = None
    bos_id: int | None = None
    bos_token: str | None = None
    add_bos: bool = False
    # The engine that computes the ids: never changes them (tokenize.py checks at load time),
    # so it is not part of the job's fingerprint.
    backend: str = "auto"

    def __post_init__(self) -> None:
        check.text("path", self.path)
        check.token_id("eos_id", self.eos_id)
        check.optional_text("eos_token", self.eos_token)
        check.token_id("bos_id", self.bos_id)
        check.optional_text("bos_token", self.bos_token)
        check.flag("add_bos", self.add_bos)
        check.text("backend", self.backend, TOKENIZER_BACKENDS)


@dataclass(frozen=True)
class DatasetSpec:
    # Keys the dataset's sample order: renaming a job keeps its batches.
    name: str
    sources: tuple[SourceSpec, ...]
    chunk_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        check.text("name", self.name)
        check.items("sources", self.sources, SourceSpec)
        check.size("chunk_bytes", self.chunk_bytes)


@dataclass(frozen=True)
class PhaseSpec:
    """From `start_step` on: this global batch size and these weights (one per dataset)."""

    start_step: int
    global_batch_size: int
    weights: tuple[Fraction, ...]

    def __post_init__(self) -> None:
        check.integer("start_step", self.start_step, minimum=0)
        check.integer("global_batch_size", self.global_batch_size, minimum=1)
        # Exact rationals only: a float weight would apportion rows by its binary expansion.
        check.items("weights", self.weights, Fraction)
        for i, weight in enumerate(self.weights):
            if weight < 0:
                raise check.fail(f"weights[{i}]", "a weight >= 0", weight)
        if sum(self.weights) <= 0:
            raise ConfigError(
                f"weights: weights must have a positive sum, got {[str(w) for w in self.weights]}"
            )


@dataclass(frozen=True)
class JobSpec:
    name: str
    datasets: tuple[DatasetSpec, ...]
    tokenizer: TokenizerSpec
    seq_len: int
    # phases[0] starts at step 0 and carries the job's global_batch_size and weights
    phases: tuple[PhaseSpec, ...]
    seed: int = 0
    packing: str = "concat"
    window_chunks: int = 8
    bad_records: str = "skip"
    # Every phase's global batch size is a multiple of this (the trainer's data-parallel size,
    # say). It refuses schedules only; it is not part of the job's fingerprint.
    batch_multiple_of: int = 1

    def __post_init__(self) -> None:
        check_job_name("name", self.name)
        check.items("datasets", self.datasets, DatasetSpec)
        check.instance("tokenizer", self.tokenizer, TokenizerSpec)
        check.integer("seq_len", self.seq_len, minimum=1)
        check.items("phases", self.phases, PhaseSpec)
        check.integer("seed", self.seed, minimum=0)
        if self.seed >= SEED_LIMIT:
            raise check.fail("seed", "an integer < 2**64", self.seed)
        check.text("packing", self.packing, PACKINGS)
        check.integer("window_chunks", self.window_chunks, minimum=1)
        check.text("bad_records", self.bad_records, BAD_RECORD_POLICIES)
        check.integer("batch_multiple_of", self.batch_multiple_of, minimum=1)
        self._check_datasets()
        self._check_phases()

    def _check_datasets(self) -> None:
        seen: set[str] = set()
        for i, dataset in enumerate(self.datasets):
            if dataset.name in seen:
                raise check.fail(f"datasets[{i}].name", "a name no other dataset has", dataset.name)
            seen.add(dataset.name)

    def _check_phases(self) -> None:
        if self.phases[0].start_step != 0:
            raise check.fail("phases[0].start_step", "0", self.phases[0].start_step)
        for i, phase in enumerate(self.phases):
            if len(phase.weights) != len(self.datasets):
                raise check.fail(
                    f"phases[{i}].weights",
                    f"one weight per dataset ({len(self.datasets)})",
                    [str(w) for w in phase.weights],
                )
            before = self.phases[i - 1].start_step if i else -1
            if phase.start_step <= before:
                raise ConfigError(
                    f"phases[{i}].start_step: phases must start in increasing order; "
                    f"{phase.start_step} is not after {before}"
                )
            if phase.global_batch_size % self.batch_multiple_of:
                raise ConfigError(
                    f"phases[{i}].global_batch_size: global_batch_size "
                    f"{phase.global_batch_size} is not a multiple of batch_multiple_of "
                    f"{self.batch_multiple_of}"
                )

    @property
    def global_batch_size(self) -> int:
        """The batch size of step 0."""
        return self.phases[0].global_batch_size

    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]
