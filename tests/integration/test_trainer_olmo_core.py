"""OLMo-core: TokenFeedDataLoader in OLMo-core's Trainer (a tiny Transformer, DDP on gloo),
checkpointed by its CheckpointerCallback and resumed 2 -> 1 and 1 -> 2 processes;
tests/trainer_harness.py. And the loader's refusals, in this process."""

from __future__ import annotations

import pytest
from support import TOKENIZER
from tokenfeed.client import Client
from trainer_harness import check, scenario


def test_resume_at_another_data_parallel_size(server, tmp_path):
    check(scenario("olmo_core", server.address, "main", tmp_path), server.address, "main")


def test_a_batch_size_that_is_not_the_jobs_is_refused_with_both(server, tmp_path):
    from tokenfeed.client.integrations.olmo_core import TokenFeedDataLoader

    with Client(server.address, job="main") as feed:
        # Rows, not tokens: the job serves 8 rows of 64 tokens per step.
        loader = TokenFeedDataLoader(feed, work_dir=tmp_path, global_batch_size=8)
        loader.reshuffle(epoch=1)
        with pytest.raises(ValueError, match=r"\(8, 64\) = 512 tokens.*gives 8") as e:
            next(iter(loader))
        assert "rows per step x seq_len" in str(e.value)
        with pytest.raises(ValueError, match="does not split into 3"):
            TokenFeedDataLoader(feed, work_dir=tmp_path, global_batch_size=512, dp_world_size=3)
        with pytest.raises(ValueError, match="in tokens"):
            TokenFeedDataLoader(feed, work_dir=tmp_path, global_batch_size=0)
        with pytest.raises(ValueError, match="epoch must be at least 1"):
            loader.reshuffle(epoch=0)
        other = {**loader.state_dict(), "job": "other"}
        with pytest.raises(ValueError, match="checkpoint is for job 'other'"):
            loader.load_state_dict(other)


def test_doc_lens_are_what_olmo_core_derives_from_the_eos_tokens(server, tmp_path):
    """`doc_lens=True`: each row's document lengths equal OLMo-core's own
    `get_document_lengths` over the row's ids (a document ends at its EOS), zero-padded as its
    collator pads them, with `max_doc_lens` each row's longest."""
    from olmo_core.data.utils import get_document_lengths
    from tokenfeed.client.integrations.olmo_core import TokenFeedDataLoader
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(TOKENIZER)).token_to_id("<|endoftext|>")
    with Client(server.address, job="main") as feed:
        loader = TokenFeedDataLoader(feed, work_dir=tmp_path, global_batch_size=512, doc_lens=True)
        loader.reshuffle(epoch=1)
        batches = iter(loader)
        seen = [next(batches) for _ in range(6)]
        mock = loader.get_mock_batch()
    split = 0  # rows holding a document boundary
    for batch in seen:
        ids, lens = batch["input_ids"], batch["doc_lens"]
        assert lens.dtype == torch_int32() and len(lens) == len(ids)
        assert (lens != 0).sum(dim=1).max() == lens.shape[1]  # padded to the most pieces
        for row, got, longest in zip(ids, lens, batch["max_doc_lens"], strict=True):
            want = get_document_lengths(row, eos)
            assert got[got != 0].tolist() == want.tolist()
            assert longest == int(want.max())
            split += len(want) > 1
    assert split >= 3, split  # the boundaries were exercised
    assert mock["doc_lens"].tolist() == [[64]] * 8 and mock["max_doc_lens"] == [64] * 8


def torch_int32():
    import torch

    return torch.int32
