"""A tokenizer.json's truncation, padding and special-token template never change the documents.

The tokenizer is a real WordPiece one built here, BERT style (all-MiniLM ships the same
settings): `[CLS] $A [SEP]` template, truncation and padding to 16 tokens. The oracle is a second
load of the same file with both turned off by hand, encoding without special tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from support import TOKENIZER
from tokenfeed.server.settings.config import TokenizerSpec
from tokenfeed.server.tokenizer.tokenize import TextTokenizer
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

MAX_LEN = 16
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]"]
WORDS = ["the", "quick", "brown", "fox", "jump", "##s", "##ing", "over", "lazy", "dog", ".", ","]

DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 12,  # ~120 tokens
    "the fox",  # 2 tokens
    "Jumping, jumping.",
    "A dog",  # "a" is not in the vocabulary: [UNK]
    "The lazy dog jumps over the quick brown fox, " * 30,
    "fox",
]


def wordpiece_json(path: Path) -> Path:
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.enable_truncation(max_length=MAX_LEN)
    tok.enable_padding(length=MAX_LEN, pad_token="[PAD]", pad_id=vocab["[PAD]"])
    tok.save(str(path))
    return path


def oracle(path: Path, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


@pytest.fixture
def wordpiece(tmp_path) -> Path:
    return wordpiece_json(tmp_path / "tokenizer.json")


def test_the_file_really_truncates_pads_and_adds_specials(wordpiece):
    saved = json.loads(wordpiece.read_text())
    assert saved["truncation"]["max_length"] == MAX_LEN
    assert saved["padding"]["strategy"] == {"Fixed": MAX_LEN}
    assert saved["post_processor"]["type"] == "TemplateProcessing"
    as_shipped = Tokenizer.from_file(str(wordpiece))
    assert as_shipped.encode("the fox").tokens[:4] == ["[CLS]", "the", "fox", "[SEP]"]
    lengths = [len(e.ids) for e in as_shipped.encode_batch_fast(DOCS, add_special_tokens=False)]
    assert lengths == [MAX_LEN] * len(DOCS)


def test_documents_are_encoded_whole_without_pad_or_specials(wordpiece, caplog):
    with caplog.at_level(logging.WARNING, logger="tokenfeed.server.tokenizer.tokenize"):
        tok = TextTokenizer(TokenizerSpec(path=str(wordpiece)))
    tokens, lengths = tok.encode(DOCS)

    want = oracle(wordpiece, DOCS)
    assert lengths.tolist() == [len(ids) for ids in want]
    assert lengths[0] > 5 * MAX_LEN and lengths[1] == 2 and lengths[5] == 1
    assert tokens.tolist() == [i for ids in want for i in ids]
    vocab = Tokenizer.from_file(str(wordpiece)).get_vocab()
    assert not set(tokens.tolist()) & {vocab["[PAD]"], vocab["[CLS]"], vocab["[SEP]"]}
    assert tok.eos_id == vocab["[EOS]"]

    assert tok.ignored_settings == (f"truncation max_length={MAX_LEN}", f"padding length={MAX_LEN}")
    (record,) = [r for r in caplog.records if r.name == "tokenfeed.server.tokenizer.tokenize"]
    assert record.levelno == logging.WARNING
    assert "truncation max_length=16 and padding length=16" in record.getMessage()
    assert "ignores both" in record.getMessage()


def test_the_digest_is_of_the_file_as_shipped(wordpiece):
    tok = TextTokenizer(TokenizerSpec(path=str(wordpiece)))
    assert tok.digest == hashlib.sha256(wordpiece.read_bytes()).hexdigest()
    # Chunk keys name it apart from the same file's earlier (cut or padded) chunks.
    assert tok.chunk_digest == tok.digest + ":whole"
    plain = TextTokenizer(TokenizerSpec(path=str(TOKENIZER)))
    assert plain.chunk_digest == plain.digest  # no setting ignored: keys as before


def test_batch_longest_padding_to_a_multiple_is_ignored_too(tmp_path, caplog):
    """Padding without a length pads each encode batch to its longest document (and to a
    multiple of 8 here): the batch would decide a document's tokens."""
    path = wordpiece_json(tmp_path / "tokenizer.json")
    raw = Tokenizer.from_file(str(path))
    raw.no_truncation()
    raw.enable_padding(pad_to_multiple_of=8, pad_token="[PAD]", pad_id=0)
    raw.save(str(path))
    with caplog.at_level(logging.WARNING, logger="tokenfeed.server.tokenizer.tokenize"):
        tok = TextTokenizer(TokenizerSpec(path=str(path)))
    assert tok.ignored_settings == ("padding pad_to_multiple_of=8",)
    assert "ignores it" in caplog.text
    tokens, lengths = tok.encode(DOCS)
    assert lengths.tolist() == [len(ids) for ids in oracle(path, DOCS)]
    assert 0 not in tokens


def test_a_tokenizer_without_these_settings_logs_nothing(caplog):
    assert json.loads(TOKENIZER.read_text())["model"]["type"] == "BPE"
    with caplog.at_level(logging.DEBUG, logger="tokenfeed.server.tokenizer.tokenize"):
        tok = TextTokenizer(TokenizerSpec(path=str(TOKENIZER)))
    assert tok.ignored_settings == ()
    assert not [r for r in caplog.records if r.name == "tokenfeed.server.tokenizer.tokenize"]
    docs = ["hello world", "a much longer document " * 50]
    _, lengths = tok.encode(docs)
    assert np.array_equal(lengths, [len(ids) for ids in oracle(TOKENIZER, docs)])
