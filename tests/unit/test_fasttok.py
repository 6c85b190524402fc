"""The tiktoken engine gives HF's ids, or is not used.

Real tokenizers: the test data's byte-level BPE (GPT-2 style) and a Llama-3-style one (a Split
regex, then ByteLevel without its own regex, several special tokens) trained here on real prose
and generated text. The oracle is always HF `tokenizers` on the same file.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from support import TOKENIZER
from tokenfeed.server.commands import democorpus
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import TokenizerSpec
from tokenfeed.server.tokenizer import bpeexact, fasttok, paritysample
from tokenfeed.server.tokenizer.tokenize import (
    ENCODE_BATCH_DOCS,
    FAST_BATCH_DOCS,
    PARITY_CHARS,
    PARITY_DOCS,
    TextTokenizer,
)
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|reserved_0|>"]


def generated(n: int, seed: int) -> list[str]:
    """Text with what prose lacks: code, numbers, whitespace runs, other scripts, emoji,
    contractions and special tokens written inside documents."""
    rng = random.Random(seed)
    words = ["def", "x", "return", "the", "I'm", "it'S", "1234567", "3.5", "日本語", "Ωμέγα"]
    words += ["naïve", "e\u0301", "😀", "👩\u200d💻", "\t", "\n\n", "   ", "{", "}", "==", "مرحبا"]
    words += LLAMA3_SPECIALS + ["<|endoftext|>", "<|begin_of", "_text|>"]
    return [
        "".join(
            rng.choice(words) + rng.choice(["", " ", "  ", "\n"]) for _ in range(rng.randint(1, 80))
        )
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return democorpus.documents()[:300] + generated(300, 1)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(democorpus.documents()[:600] + generated(2000, 2), trainer)
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.json"
    tok.save(str(path))
    return path


def load(path: Path, backend: str, **kw) -> TextTokenizer:
    return TextTokenizer(TokenizerSpec(path=str(path), backend=backend), **kw)


def hf_ids(path: Path, texts: list[str], encode_special_tokens=False) -> list[list[int]]:
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = encode_special_tokens
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def split(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    return [a.tolist() for a in np.split(tokens, np.cumsum(lengths)[:-1])] if len(lengths) else []


@pytest.mark.parametrize("which", ["gpt2", "llama3"])
def test_tiktoken_gives_hf_ids(which, llama3, docs):
    path = TOKENIZER if which == "gpt2" else llama3
    tok = load(path, "tiktoken")
    assert tok.engine == "tiktoken", tok.engine_reason
    texts = docs + paritysample.edge_sample(tuple(LLAMA3_SPECIALS)) + ["", "<|endoftext|>"]
    tokens, lengths = tok.encode(texts)
    assert tokens.dtype == np.uint16 and lengths.dtype == np.int32
    assert split(tokens, lengths) == hf_ids(path, texts)
    assert tok.engine == "tiktoken"  # the job's first documents agreed
    # Past the compared documents too, and in int32 (a vocabulary over 65535).
    engine = tok._fast
    tokens, lengths = engine.encode(texts, np.dtype(np.int32))
    assert tokens.dtype == np.int32 and split(tokens, lengths) == hf_ids(path, texts)


def test_added_tokens_in_documents_are_split_out_as_hf_does(llama3):
    texts = ["a<|eot_id|>b", "<|begin_of_text|><|begin_of_text|>", "x <|reserved_0|>\n", "<|eot_id"]
    ids = hf_ids(llama3, texts)
    assert ids[0][1] == Tokenizer.from_file(str(llama3)).token_to_id("<|eot_id|>")
    tokens, lengths = load(llama3, "tiktoken").encode(texts)
    assert split(tokens, lengths) == ids
    # A tokenizer that encodes its special tokens as text: tiktoken does the same.
    config = json.loads(llama3.read_text())
    engine = fasttok.FastEngine.from_config(config, encode_special_tokens=True)
    tokens, lengths = engine.encode(texts, np.dtype(np.int32))
    assert split(tokens, lengths) == hf_ids(llama3, texts, encode_special_tokens=True) != ids


def test_items_parsed_by_the_encoding_threads_give_the_same_ids(docs):
    """encode_items: each item's text found by the thread that encodes it (a JSON line's
    parse), bad items left out and marked; the ids are those of the good texts encoded, before
    and after the job's first documents agreed with HF (found first, then on the threads)."""
    lines = []
    for k, text in enumerate(docs):
        lines.append(json.dumps({"text": text}).encode())
        if k % 7 == 0:
            lines.append(b'{"text": 42}' if k % 2 else b"not json")

    def text_of(line: bytes) -> str | None:
        try:
            found = json.loads(line)["text"]
        except (ValueError, TypeError, KeyError):
            return None
        return found if isinstance(found, str) and found else None

    texts = [text_of(line) for line in lines]
    want_good = [t is not None for t in texts]
    want = hf_ids(TOKENIZER, [t for t in texts if t is not None])
    assert 0 < want_good.count(False) < len(lines)
    tok = load(TOKENIZER, "tiktoken")
    for _ in range(2):  # the first call is compared with HF, the second runs on the threads
        tokens, lengths, good = tok.encode_items(lines, text_of)
        assert good.tolist() == want_good
        assert split(tokens, lengths) == want
    assert tok._checked() and tok.engine == "tiktoken"
    tokens, lengths, good = tok._fast.encode_items(lines, np.dtype(np.int32), text_of)
    assert good.tolist() == want_good and split(tokens, lengths) == want
    none = tok.encode_items([b"[]", b""], text_of)
    assert none[0].size == 0 and none[1].size == 0 and none[2].tolist() == [False, False]


def test_concurrent_encodes_agree(docs):
    tok = load(TOKENIZER, "auto")
    want = split(*load(TOKENIZER, "hf").encode(docs))
    got: dict[int, list] = {}

    def run(k: int) -> None:
        got[k] = split(*tok.encode(docs[k * 50 :] + docs[: k * 50]))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        assert got[k] == want[k * 50 :] + want[: k * 50]
    assert tok.engine == "tiktoken"


def byte_level(tmp_path: Path, name: str, change) -> Path:
    """The test tokenizer with one part changed (a function of its JSON)."""
    config = json.loads(TOKENIZER.read_text())
    change(config)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def wordpiece(tmp_path: Path) -> Path:
    vocab = {t: i for i, t in enumerate(["[UNK]", "<|endoftext|>", "the", "fox", "##es"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "wordpiece.json"))
    return tmp_path / "wordpiece.json"


def normalized(tmp_path: Path) -> Path:
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.normalizer = normalizers.NFKC()
    tok.save(str(tmp_path / "nfkc.json"))
    return tmp_path / "nfkc.json"


def prefix_space(config: dict) -> None:
    config["pre_tokenizer"]["add_prefix_space"] = True


def other_regex(config: dict) -> None:
    split = {"type": "Split", "pattern": {"Regex": r"\w+|\W+"}, "behavior": "Isolated"}
    split["invert"] = False
    byte_level = dict(config["pre_tokenizer"], use_regex=False)
    config["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, byte_level]}


def lstrip(config: dict) -> None:
    config["added_tokens"][0]["lstrip"] = True


def ignore_merges(config: dict) -> None:
    config["model"]["ignore_merges"] = True


def stray_entry(config: dict) -> None:
    """An entry no merge makes, which HF's ignore_merges takes whole: " zqx" is one token."""
    ignore_merges(config)
    config["model"]["vocab"]["Ġzqx"] = len(config["model"]["vocab"])


def overlapping(config: dict) -> None:
    token = dict(config["added_tokens"][0], id=1024, content="<|endoftext|>!")
    config["added_tokens"].append(token)


@pytest.mark.parametrize(
    "make, why",
    [
        (wordpiece, "the model is WordPiece, not BPE"),
        (normalized, "the tokenizer has a normalizer (NFKC)"),
        (lambda p: byte_level(p, "prefix", prefix_space), "adds a prefix space"),
        (lambda p: byte_level(p, "regex", other_regex), "is not one tiktoken is known to match"),
        (lambda p: byte_level(p, "lstrip", lstrip), "'<|endoftext|>' matches with lstrip"),
        (lambda p: byte_level(p, "overlap", overlapping), "'<|endoftext|>!' overlap"),
        (lambda p: byte_level(p, "stray", stray_entry), "ignore_merges with 1 unmergeable"),
    ],
)
def test_ineligible_tokenizers_fall_back_in_auto_and_are_refused_under_tiktoken(
    tmp_path, caplog, make, why
):
    path = make(tmp_path)
    texts = ["The foxes!  Ünïcode <|endoftext|> 12345", "the fox"]
    with caplog.at_level(logging.INFO, logger="tokenfeed.server.tokenizer.tokenize.engine"):
        tok = load(path, "auto")
    assert tok.engine == "hf" and why in tok.engine_reason
    assert "tokenizer engine hf: tiktoken is not exact for it: " in caplog.text
    assert why in caplog.text
    assert split(*tok.encode(texts)) == hf_ids(path, texts)
    with pytest.raises(ConfigError, match="tokenizer.backend: tiktoken cannot reproduce") as e:
        load(path, "tiktoken")
    assert why in str(e.value)


def test_ignore_merges_is_exact_when_every_entry_is_mergeable(tmp_path, docs):
    path = byte_level(tmp_path, "ignore", ignore_merges)
    texts = docs + [" zqx", "<|endoftext|>x"]
    tok = load(path, "tiktoken")
    assert split(*tok.encode(texts)) == hf_ids(path, texts)
    stray = byte_level(tmp_path, "stray", stray_entry)
    assert hf_ids(stray, [" zqx"]) == [[1024]]  # what tiktoken could not know
    assert load(stray, "auto").engine == "hf"


def test_hf_backend_never_builds_the_engine(tmp_path):
    tok = load(byte_level(tmp_path, "prefix", prefix_space), "hf")
    assert tok.engine == "hf" and tok.engine_reason == "tokenizer.backend is hf"


def test_a_merge_table_where_tiktokens_rank_rule_differs_is_refused(tmp_path):
    """Merges (b c), (a b), (ab c): HF leaves "abc" as [a, bc], since (a, bc) is no merge;
    tiktoken's rule joins any two parts whose bytes are a token, so it would make [abc]."""
    alphabet = bpeexact.byte_alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet, key=alphabet.get))}
    vocab.update({"bc": 256, "ab": 257, "abc": 258})
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "abc.json"))
    assert tok.encode("abc").ids == [vocab["a"], vocab["bc"]]
    ranks = {bytes([b]): b for b in range(256)} | {b"bc": 256, b"ab": 257, b"abc": 258}
    plain = tiktoken.Encoding(
        "plain", pat_str=bpeexact.GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    assert plain.encode_ordinary("abc") == [258]  # what the engine would say unchecked

    with pytest.raises(ConfigError, match=r"merge 2 \(b'ab' \+ b'c'\) is not how tiktoken"):
        TextTokenizer(TokenizerSpec(path=str(tmp_path / "abc.json"), eos_id=0, backend="tiktoken"))
    tok = TextTokenizer(TokenizerSpec(path=str(tmp_path / "abc.json"), eos_id=0))
    assert tok.engine == "hf"
    assert split(*tok.encode(["abc abc"])) == [
        [vocab["a"], vocab["bc"], vocab["Ġ"], vocab["a"], vocab["bc"]]
    ]


def swapped(engine: fasttok.FastEngine, a: int, b: int) -> fasttok.FastEngine:
    """The engine with the HF ids of two tokens exchanged: wrong exactly where they occur."""
    lut = engine.rank_to_id.copy()
    ra, rb = (int(np.flatnonzero(lut == i)[0]) for i in (a, b))
    lut[ra], lut[rb] = b, a
    return fasttok.FastEngine(engine.encoding, lut)


def good_engine(path: Path) -> fasttok.FastEngine:
    return fasttok.FastEngine.from_config(json.loads(path.read_text()))


def test_a_parity_check_that_fails_raises_on_the_callers_thread(llama3, docs, monkeypatch):
    # HF encodes the compared documents on a thread of its own, beside tiktoken: what it
    # raises is raised by encode, and no id is taken without the check.
    tok = load(llama3, "auto")
    assert tok.engine == "tiktoken"

    def broken(texts):
        raise RuntimeError("hf failed")

    monkeypatch.setattr(tok, "_hf_encode", broken)
    with pytest.raises(RuntimeError, match="hf failed"):
        tok.encode(docs[:8])
    monkeypatch.undo()
    assert split(*tok.encode(docs[:8])) == hf_ids(llama3, docs[:8])


def test_encode_batches_follow_the_engine_in_use(llama3, docs):
    # tiktoken's calls take 4096 documents (its ids are numpy arrays), HF's 512; a switch to HF
    # after a difference takes HF's size from the next call on.
    tok = load(llama3, "auto")
    assert tok.engine == "tiktoken" and tok.batch_docs == FAST_BATCH_DOCS > PARITY_DOCS
    assert load(llama3, "hf").batch_docs == ENCODE_BATCH_DOCS
    many = (docs * (FAST_BATCH_DOCS // len(docs) + 2))[: FAST_BATCH_DOCS + 7]
    assert split(*tok.encode(many)) == hf_ids(llama3, many)
    used, text, unused = rare_tokens(llama3, docs)
    wrong = load(llama3, "auto", fast=swapped(good_engine(llama3), used, unused))
    assert split(*wrong.encode([text])) == hf_ids(llama3, [text])
    assert wrong.engine == "hf" and wrong.batch_docs == ENCODE_BATCH_DOCS


def test_a_difference_on_the_built_in_sample_keeps_hf(llama3):
    space, bang = (Tokenizer.from_file(str(llama3)).token_to_id(t) for t in ("Ġ", "!"))
    wrong = swapped(good_engine(llama3), space, bang)
    tok = load(llama3, "auto", fast=wrong)
    assert tok.engine == "hf"
    assert "differ from HF's on the built-in sample: document" in tok.engine_reason
    with pytest.raises(ConfigError, match="built-in sample"):
        load(llama3, "tiktoken", fast=wrong)


def rare_tokens(path: Path, avoid: list[str]) -> tuple[int, str, int]:
    """Two tokens that neither the built-in sample nor the `avoid` texts encode to: the id and
    text of one that a text of its own encodes to, and the id of another."""
    hf = Tokenizer.from_file(str(path))
    sample = paritysample.edge_sample(tuple(LLAMA3_SPECIALS))
    seen = {i for ids in hf_ids(path, sample + avoid) for i in ids}
    seen |= set(hf.get_added_tokens_decoder())
    fresh = [i for i in range(hf.get_vocab_size() - 1, -1, -1) if i not in seen]  # merged first
    alone = [i for i in fresh if hf.encode(hf.decode([i]), add_special_tokens=False).ids == [i]]
    assert len(alone) >= 2
    return alone[0], hf.decode([alone[0]]), alone[1]


def first_different(a: list, b: list) -> int:
    return next(d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def test_a_difference_on_the_jobs_documents_switches_to_hf_for_good(llama3, docs, caplog):
    used, text, unused = rare_tokens(llama3, docs)
    job_docs = docs[:5] + [text] + docs[5:10]
    wrong = swapped(good_engine(llama3), used, unused)
    wrong_ids = split(*wrong.encode(job_docs, np.dtype(np.uint16)))
    assert wrong_ids != hf_ids(llama3, job_docs)

    tok = load(llama3, "auto", fast=wrong)
    assert tok.engine == "tiktoken"  # the built-in sample agrees
    with caplog.at_level(logging.WARNING, logger="tokenfeed.server.tokenizer.tokenize.engine"):
        tokens, lengths = tok.encode(job_docs)
    assert split(tokens, lengths) == hf_ids(llama3, job_docs)  # HF's ids are kept
    assert tok.engine == "hf" and "differed from HF on a document of the job" in tok.engine_reason
    first = first_different(wrong_ids, hf_ids(llama3, job_docs))
    assert f"differs from HF on document {first} of {len(job_docs)}" in caplog.text
    assert f"(near {text[:30]!r})" in caplog.text
    assert "the job uses hf from now on" in caplog.text
    # For good: later documents are HF's, even those the wrong engine gets wrong.
    assert split(*tok.encode(job_docs[::-1])) == hf_ids(llama3, job_docs[::-1])


def test_once_the_first_documents_agree_tiktokens_ids_are_used_alone(llama3, docs):
    """Which also shows that the engine really runs: a wrong one goes unnoticed past the check
    (the reason the check's engine must be exact by construction, fasttok.py)."""
    used, text, unused = rare_tokens(llama3, docs)
    wrong = swapped(good_engine(llama3), used, unused)
    tok = load(llama3, "auto", fast=wrong)
    assert split(*tok.encode(docs[:PARITY_DOCS])) == hf_ids(llama3, docs[:PARITY_DOCS])
    assert split(*tok.encode([text])) != hf_ids(llama3, [text])
    assert tok.engine == "tiktoken"


def test_once_the_first_characters_agree_tiktokens_ids_are_used_alone(llama3, docs):
    """Long documents: the check ends after PARITY_CHARS characters of them agreed, however
    few the documents; within the batch that ends it, the documents after those compared are
    tiktoken's, and a difference among those compared still keeps HF's ids for the batch."""
    used, text, unused = rare_tokens(llama3, docs)
    wrong = swapped(good_engine(llama3), used, unused)
    long = ["\n\n".join(docs[i::4]) for i in range(4)]  # 4 documents, each over 64 K chars
    assert all(len(d) > PARITY_CHARS // 4 for d in long) and len(long) < PARITY_DOCS
    tok = load(llama3, "auto", fast=wrong)
    # The rare text right after the compared documents, in the same batch: tiktoken's alone.
    got = split(*tok.encode([*long, text]))
    assert got[:4] == hf_ids(llama3, long)
    assert got[4] != hf_ids(llama3, [text])[0]
    assert tok.engine == "tiktoken"
    # A rare text among the first characters is compared: HF's ids, and HF from then on.
    tok = load(llama3, "auto", fast=wrong)
    assert split(*tok.encode([text, *long])) == hf_ids(llama3, [text, *long])
    assert tok.engine == "hf"


class _Noted:
    """An Encoding that notes which thread encodes each text, in the order they start."""

    def __init__(self, encoding):
        self.encoding, self.calls = encoding, []
        self.special_tokens_set = encoding.special_tokens_set

    def encode_to_numpy(self, text, **kw):
        self.calls.append((threading.current_thread().name, len(text)))
        return self.encoding.encode_to_numpy(text, **kw)


def test_documents_go_longest_first_and_come_back_in_order(docs):
    # One thread: the documents start longest first; two: both threads take documents from
    # the same order. Either way the ids come back in the documents' order, HF's one by one.
    long = "\n".join(docs[:120])
    texts = [*docs[:40], long, *docs[40:45], long[: len(long) // 2], *docs[45:100]]
    for threads in (1, 2):
        base = good_engine_gpt2()
        noted = _Noted(base.encoding)
        engine = fasttok.FastEngine(noted, base.rank_to_id, threads=threads)
        noted.calls.clear()  # the engine's settling sample
        tokens, lengths = engine.encode(texts, np.dtype(np.uint16))
        assert split(tokens, lengths) == hf_ids(TOKENIZER, texts)
        assert tokens.dtype == np.uint16 and lengths.dtype == np.int32
        assert sorted(n for _, n in noted.calls) == sorted(map(len, texts))
        if threads == 1:
            assert [n for _, n in noted.calls] == sorted(map(len, texts), reverse=True)
        else:
            assert len({name for name, _ in noted.calls}) == 2
            assert noted.calls[0][1] == len(long)


def test_a_document_that_fails_to_encode_fails_the_call(docs):
    base = good_engine_gpt2()

    class Failing(_Noted):
        def encode_to_numpy(self, text, **kw):
            if text == "boom":
                raise ValueError("cannot encode boom")
            return super().encode_to_numpy(text, **kw)

    engine = fasttok.FastEngine(Failing(base.encoding), base.rank_to_id, threads=2)
    with pytest.raises(ValueError, match="cannot encode boom"):
        engine.encode([*docs[:20], "boom", *docs[20:40]], np.dtype(np.uint16))
    tokens, lengths = engine.encode(docs[:20], np.dtype(np.uint16))  # the engine serves on
    assert split(tokens, lengths) == hf_ids(TOKENIZER, docs[:20])


def test_an_empty_call_and_an_identity_vocabulary(docs):
    engine = good_engine_gpt2()
    tokens, lengths = engine.encode([], np.dtype(np.uint32))
    assert tokens.size == 0 and lengths.size == 0 and tokens.dtype == np.uint32
    same = fasttok.FastEngine(engine.encoding, None, threads=2)  # HF's ids are the ranks
    tokens, lengths = same.encode(docs[:8], np.dtype(np.uint32))
    expected = [engine.encoding.encode_to_numpy(d, disallowed_special=()) for d in docs[:8]]
    assert split(tokens, lengths) == [e.tolist() for e in expected]


def good_engine_gpt2() -> fasttok.FastEngine:
    return fasttok.FastEngine.from_config(json.loads(Path(TOKENIZER).read_text()))
