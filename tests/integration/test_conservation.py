"""Over one epoch every document's tokens are served once, minus each chunk's dropped tail.

The oracle is independent of the server: each document is tokenized on its own with the HF
tokenizer, EOS appended. What the server streams for the rows of epoch 0 must be (a) exactly
rows_per_epoch * seq_len input tokens, (b) a sub-multiset of the corpus tokens, missing fewer
than seq_len + 1 tokens per chunk (the documented remainder), and (c) made of pieces that are
contiguous runs of single documents.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from support import TOKENIZER
from tokenizers import Tokenizer


def test_one_epoch_serves_every_token_once(server, texts):
    tok = Tokenizer.from_file(str(TOKENIZER))
    eos = tok.token_to_id("<|endoftext|>")
    docs = [e.ids + [eos] for e in tok.encode_batch(texts, add_special_tokens=False)]
    corpus = Counter(t for d in docs for t in d)

    with server.client("main") as c:
        info = c.describe()
        rows, seq_len, batch = (int(info[k]) for k in ("rows_per_epoch", "seq_len",
                                                         "global_batch_size"))  # fmt: skip
        steps = -(-rows // batch)
        served = np.concatenate([b["input_ids"] for b in c.iter_batches(0, steps)])[:rows]
        segments = np.concatenate([b["segment_ids"] for b in c.iter_batches(0, steps)])[:rows]

    assert served.shape == (rows, seq_len)
    got = Counter(served.ravel().tolist())
    assert not got - corpus, "served tokens that are not in the corpus (or too many of them)"
    missing = sum((corpus - got).values())
    chunks = int(info["num_chunks"])
    assert 0 <= missing < chunks * (seq_len + 1)
    assert sum(corpus.values()) - missing == rows * seq_len

    # Every document piece inside a row is a contiguous run of one document.
    haystack = "|," + ",|,".join(",".join(map(str, d)) for d in docs) + ",|"
    for row, seg in zip(served[::7], segments[::7], strict=True):
        for s in np.unique(seg):
            piece = "," + ",".join(map(str, row[seg == s].tolist())) + ","
            assert piece in haystack
