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

Two engines give the same ids (`tokenizer.backend`): HF always, or tiktoken where fasttok.py
can reproduce the tokenizer exactly (byte-level BPE), about 3x faster. `auto` takes tiktoken
when it is eligible and agrees with HF on a built-in sample of hard texts; either way the job's
first documents are encoded by both, and one difference sends the job back to HF for good, with
the HF ids kept. Ids never depend on the engine.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import TokenizerSpec
from tokenfeed.server.tokenizer import fasttok
from tokenizers import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")
# Which engine encodes, and why: a logger of its own, to follow (or silence) on its own.
engine_log = logging.getLogger(__name__ + ".engine")

# Looked up in this order when the config names no EOS.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]")
# Documents per encode call: large enough to keep every core busy, small enough to bound memory.
ENCODE_BATCH_DOCS = 512
# The same with the tiktoken engine, whose ids come as numpy arrays (4 bytes a token, not HF's
# Python ints): a call's fixed work (the pool's hand-over, the order's sort, the join) is paid
# 8x less often; whole 4 MiB chunks a call built 1.5% faster than 512 documents (6 paired
# rounds; bench/, tokenization). A call holds its texts, which its chunk's bytes already bound.
FAST_BATCH_DOCS = 4096
# The job's first documents that tiktoken and HF must agree on before tiktoken's ids are taken
# alone: the first encode batch of a large chunk, a few small chunks; or, where documents are
# long, those of the first PARITY_CHARS characters. The check runs HF in every process that
# encodes: 512 code sections of a few KB cost a 31 MB build on 2 cores about a tenth of its
# time (bench/, tokenization section); 256 K characters still span many documents. HF
# encodes them beside tiktoken's batch, on the cores tiktoken leaves idle (_encode_batch).
PARITY_DOCS = ENCODE_BATCH_DOCS
PARITY_CHARS = 256 * 1024


class TextTokenizer:
    def __init__(
        self,
        spec: TokenizerSpec,
        raw: bytes | None = None,
        fast: fasttok.FastEngine | None = None,
    ):
        """`raw`: the tokenizer.json's bytes when the caller fetched them (object storage);
        otherwise read from the local path. `fast`: a tiktoken engine built elsewhere, instead
        of the one made from the file; it is checked all the same."""
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
        self._fast: fasttok.FastEngine | None = None
        self._agreed = 0  # of the job's documents, compared by both engines
        self._agreed_chars = 0  # their characters
        self._switch = threading.Lock()
        self.engine, self.engine_reason = self._choose_engine(spec.backend, fast)
        engine_log.info("%s: tokenizer engine %s: %s", self.path, self.engine, self.engine_reason)

    def _choose_engine(self, backend: str, fast: fasttok.FastEngine | None) -> tuple[str, str]:
        """(engine, why); keeps the tiktoken engine in `_fast` when it is chosen."""
        if backend == "hf":
            return "hf", "tokenizer.backend is hf"
        try:
            if fast is None:
                config = json.loads(self._tok.to_str())
                fast = fasttok.FastEngine.from_config(config, self._tok.encode_special_tokens)
            added = tuple(t.content for t in self._tok.get_added_tokens_decoder().values())
            sample = fasttok.edge_sample(added)
            if diff := self._difference(
                sample, self._hf_encode(sample), fast.encode(sample, self.dtype)
            ):
                raise fasttok.NotExact(f"its ids differ from HF's on the built-in sample: {diff}")
        except (fasttok.NotExact, ImportError) as e:
            why = str(e) if isinstance(e, fasttok.NotExact) else f"tiktoken is not installed ({e})"
            if backend == "tiktoken":
                raise ConfigError(
                    f"tokenizer.backend: tiktoken cannot reproduce {self.path} exactly: {why}; "
                    "set tokenizer.backend to auto or hf"
                ) from e
            return "hf", f"tiktoken is not exact for it: {why}"
        self._fast = fast
        return "tiktoken", (
            f"exact byte-level BPE, agrees on the built-in sample; the job's first "
            f"{PARITY_DOCS} documents (or {PARITY_CHARS:,} characters) are compared too"
        )

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
        i = 0
        while i < len(texts):
            if between_batches is not None:
                between_batches()
            step = self.batch_docs  # HF's size from the batch after a switch to HF
            tokens, lengths = self._encode_batch(texts[i : i + step])
            token_parts.append(tokens)
            length_parts.append(lengths)
            i += step
        if not token_parts:
            return np.zeros(0, dtype=self.dtype), np.zeros(0, dtype=np.int32)
        return np.concatenate(token_parts), np.concatenate(length_parts)

    def encode_items(
        self,
        items: list[T],
        text: Callable[[T], str | None],
        between_batches: Callable[[], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`encode` of the items' texts (`text(item)`; None: a bad record, not a document):
        (tokens, lengths, which items are documents). The tiktoken engine finds each text on
        the pool thread that encodes it (fasttok.FastEngine.encode_items), once the job's
        first documents agreed with HF; before that, and with HF, the texts are found here
        first. Same ids either way."""
        token_parts, length_parts, good_parts = [], [], []
        i = 0
        while i < len(items):
            if between_batches is not None:
                between_batches()
            step = self.batch_docs
            piece = items[i : i + step]
            fast = self._fast
            if fast is not None and self._checked():
                tokens, lengths, good = fast.encode_items(piece, self.dtype, text)
                if good is None:  # cannot be: `text` was given
                    raise RuntimeError("the tiktoken engine said nothing of the items")
            else:
                texts = [text(item) for item in piece]
                good = np.fromiter((t is not None for t in texts), dtype=bool, count=len(texts))
                tokens, lengths = self.encode([t for t in texts if t is not None])
            token_parts.append(tokens)
            length_parts.append(lengths)
            good_parts.append(good)
            i += step
        if not token_parts:
            empty = np.zeros(0, dtype=np.int32)
            return np.zeros(0, dtype=self.dtype), empty, np.zeros(0, dtype=bool)
        return (
            np.concatenate(token_parts),
            np.concatenate(length_parts),
            np.concatenate(good_parts),
        )

    def release_engine(self) -> None:
        """Let go of what the tiktoken engine's threads keep for the next encode (their own
        Encodings: fasttok.FastEngine.release); nothing with HF's."""
        fast = self._fast
        if fast is not None:
            fast.release()

    @property
    def batch_docs(self) -> int:
        """Documents per encode call with the engine in use."""
        return ENCODE_BATCH_DOCS if self._fast is None else FAST_BATCH_DOCS

    def _encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        fast = self._fast
        if fast is None:
            return self._hf_encode(texts)
        if self._checked():
            return fast.encode(texts, self.dtype)
        # Until enough documents agreed, the batch's first documents that the check still
        # needs are compared (of every thread) and, if they differ, HF's ids are the ones kept
        # for the whole batch: no id from tiktoken alone is used before the check has passed.
        k, chars = 0, self._agreed_chars
        while k < len(texts) and self._agreed + k < PARITY_DOCS and chars < PARITY_CHARS:
            chars += len(texts[k])
            k += 1
        # HF encodes the compared documents while tiktoken encodes the batch (both let go of
        # the GIL): HF's threads use what tiktoken's leave idle, rather than run after them.
        hf: list = []

        def check() -> None:
            try:
                hf.append(self._hf_encode(texts[:k]))
            except BaseException as e:  # raised below, on the caller's thread
                hf.append(e)

        checking = threading.Thread(target=check, name="parity-check", daemon=True)
        checking.start()
        try:
            tokens, lengths = fast.encode(texts, self.dtype)
        finally:
            checking.join()
        if isinstance(hf[0], BaseException):
            raise hf[0]
        head = (tokens[: int(lengths[:k].sum(dtype=np.int64))], lengths[:k])
        diff = self._difference(texts[:k], hf[0], head)
        with self._switch:
            if diff is None:
                self._agreed += k
                self._agreed_chars = max(self._agreed_chars, chars)
            elif self._fast is not None:
                self._fast = None
                self.engine = "hf"
                self.engine_reason = f"tiktoken differed from HF on a document of the job: {diff}"
                engine_log.warning(
                    "%s: tokenizer engine tiktoken differs from HF on %s; the job uses hf from "
                    "now on (every id so far is HF's)",
                    self.path,
                    diff,
                )
        if diff is None and k == len(texts):
            return tokens, lengths
        if diff is None and self._checked():  # the rest of the batch comes after the check
            return tokens, lengths
        return self._hf_encode(texts)

    def _checked(self) -> bool:
        """The job's first documents agreed: tiktoken's ids are taken alone."""
        return self._agreed >= PARITY_DOCS or self._agreed_chars >= PARITY_CHARS

    def _hf_encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
        total = int(lengths.sum(dtype=np.int64))
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=total)
        return tokens, lengths

    def _difference(self, texts: list[str], hf, other) -> str | None:
        """Where `other` (tokens, lengths) first differs from HF's, in words; None if nowhere."""
        (ht, hl), (ot, ol) = hf, other
        if np.array_equal(hl, ol) and np.array_equal(ht, ot):
            return None
        h_end, o_end = np.cumsum(hl, dtype=np.int64), np.cumsum(ol, dtype=np.int64)
        for d, text in enumerate(texts):
            a, b = ht[h_end[d] - hl[d] : h_end[d]], ot[o_end[d] - ol[d] : o_end[d]]
            if np.array_equal(a, b):
                continue
            n = min(a.size, b.size)
            unequal = np.flatnonzero(a[:n] != b[:n])
            k = int(unequal[0]) if unequal.size else n
            at = len(self.decode(a[:k]))
            return (
                f"document {d} of {len(texts)} (near {text[max(0, at - 30) : at + 30]!r}): "
                f"token {k} is {a[k] if k < a.size else 'past the end'} from HF, "
                f"{b[k] if k < b.size else 'past the end'} from tiktoken"
            )
        return None

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))
