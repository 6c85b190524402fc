"""HF `tokenizers` behind one small class: load a tokenizer.json, find EOS/BOS, encode in bulk.

Encoding goes through `encode_batch_fast` (no offsets: the cheapest exact path), which runs in
Rust on all cores and releases the GIL, so callers run it in threads off the event loop.
Documents are encoded without special tokens; the packer adds EOS/BOS itself.

A tokenizer.json is a model's inference setup, and parts of it would change the documents:
- `truncation` would cut every document to `max_length` tokens and `padding` would pad short
  ones (to `length`, to a multiple, or to the longest of each encode batch) with pad ids. Both
  are turned off on load, with one warning naming what was ignored (`ignored_settings`):
  documents are packed whole. The digest stays that of the file's bytes.
- The post-processor's template (`[CLS] $A [SEP]`, BOS/EOS around each document) never runs:
  encoding passes `add_special_tokens=False`. The packer adds EOS after every document, and
  BOS before it only with `tokenizer.add_bos`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tokenfeed.server.config import TokenizerSpec
from tokenfeed.server.errors import ConfigError
from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# Looked up in this order when the config names no EOS.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]")
# Documents per encode call: large enough to keep every core busy, small enough to bound memory.
ENCODE_BATCH_DOCS = 512


class TextTokenizer:
    def __init__(self, spec: TokenizerSpec, raw: bytes | None = None):
        """`raw`: the tokenizer.json's bytes when the caller fetched them (object storage);
        otherwise read from the local path."""
        try:
            raw = Path(spec.path).read_bytes() if raw is None else raw
        except OSError as e:
            raise ConfigError(f"tokenizer.path: cannot read {spec.path}: {e.strerror}") from e
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises plain Exception on a bad file
            raise ConfigError(f"tokenizer.path: {spec.path} is not a tokenizer.json: {e}") from e
        self.path = spec.path
        # Of the raw bytes, as loaded: chunk keys carry it, and dropping the settings below
        # changes nothing the file says.
        self.digest = hashlib.sha256(raw).hexdigest()
        self.ignored_settings = self._drop_length_settings()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._special(spec.eos_id, spec.eos_token, EOS_CANDIDATES, "eos")
        if spec.add_bos or spec.bos_id is not None or spec.bos_token is not None:
            self.bos_id = self._special(spec.bos_id, spec.bos_token, BOS_CANDIDATES, "bos")
        else:
            self.bos_id = -1
        self.add_bos = spec.add_bos
        # Megatron's rule: uint16 while every id fits, else int32.
        self.dtype = np.dtype(np.uint16) if self.vocab_size <= 65535 else np.dtype(np.int32)

    def _drop_length_settings(self) -> tuple[str, ...]:
        """Turns off the file's truncation and padding; returns what they were, for the log and
        for callers to show."""
        ignored = []
        if (trunc := self._tok.truncation) is not None:
            ignored.append(f"truncation max_length={trunc['max_length']}")
            self._tok.no_truncation()
        if (pad := self._tok.padding) is not None:
            how = [f"{k}={pad[k]}" for k in ("length", "pad_to_multiple_of") if pad[k] is not None]
            ignored.append("padding " + (" ".join(how) or "to the longest document of each batch"))
            self._tok.no_padding()
        if ignored:
            log.warning(
                "%s: tokenizer.json sets %s; tokenfeed ignores %s: documents are packed "
                "whole, never cut or padded",
                self.path,
                " and ".join(ignored),
                "both" if len(ignored) == 2 else "it",
            )
        return tuple(ignored)

    @property
    def chunk_digest(self) -> str:
        """What chunk keys name the tokenizer by: the file's digest, marked when truncation or
        padding settings were switched off, so chunks an earlier version cut or padded with
        the same file are never taken for whole ones."""
        return self.digest + (":whole" if self.ignored_settings else "")

    def _special(self, given: int | None, token: str | None, guesses: tuple[str, ...], kind: str):
        if given is not None:
            if given >= self.vocab_size:
                raise ConfigError(
                    f"tokenizer.{kind}_id: {given} is outside the vocabulary of {self.vocab_size}"
                )
            return given
        for name in (token,) if token else guesses:
            found = self._tok.token_to_id(name)
            if found is not None:
                return found
        if token:
            raise ConfigError(f"tokenizer.{kind}_token: {token!r} is not in {self.path}")
        raise ConfigError(
            f"tokenizer {self.path} has none of the usual {kind.upper()} tokens {list(guesses)}; "
            f"set tokenizer.{kind}_id or tokenizer.{kind}_token"
        )

    def encode(
        self, texts: list[str], between_batches: Callable[[], None] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """All documents' tokens concatenated, and each document's length (int32).

        Ids become numpy arrays one encode batch at a time: as Python ints they cost ~40 bytes
        each. `between_batches` runs between encode calls (it may raise to abandon the work)."""
        token_parts, length_parts = [], []
        for i in range(0, len(texts), ENCODE_BATCH_DOCS):
            if between_batches is not None:
                between_batches()
            ids = [
                e.ids
                for e in self._tok.encode_batch_fast(
                    texts[i : i + ENCODE_BATCH_DOCS], add_special_tokens=False
                )
            ]
            lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
            total = int(lengths.sum(dtype=np.int64))
            token_parts.append(
                np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=total)
            )
            length_parts.append(lengths)
        if not token_parts:
            return np.zeros(0, dtype=self.dtype), np.zeros(0, dtype=np.int32)
        return np.concatenate(token_parts), np.concatenate(length_parts)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))
