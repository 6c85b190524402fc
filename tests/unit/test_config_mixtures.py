"""Mixture and schedule configs: what loads, and what is refused with the field and value."""

from __future__ import annotations

from fractions import Fraction

import pytest
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import from_dict


def job(**extra) -> dict:
    body = {
        "datasets": {
            "web": {"sources": ["/d/web/*.jsonl"], "weight": 0.7},
            "code": {"sources": ["/d/code/*.jsonl"], "weight": "3/10"},
        },
        "tokenizer": "/t.json",
        "seq_len": 128,
        "global_batch_size": 8,
    }
    body.update(extra)
    return {"jobs": {"mix": body}}


def test_mixture_with_a_schedule_loads_exact_weights():
    raw = job(
        schedule=[
            {"start_step": 100, "weights": {"code": 1}},
            {"start_step": 500, "global_batch_size": 16},
        ]
    )
    spec = from_dict(raw).job("mix")
    assert spec.dataset_names() == ["web", "code"]
    assert [(p.start_step, p.global_batch_size, p.weights) for p in spec.phases] == [
        (0, 8, (Fraction(7, 10), Fraction(3, 10))),
        (100, 8, (Fraction(7, 10), Fraction(1))),
        (500, 16, (Fraction(7, 10), Fraction(1))),
    ]


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (
            job(schedule=[{"start_step": 10, "weights": {"books": 1}}]),
            ["jobs.mix.schedule[0].weights.books", "unknown dataset", "['web', 'code']"],
        ),
        (
            job(schedule=[{"start_step": 50}, {"start_step": 20}]),
            ["jobs.mix.schedule[1].start_step", "20 is not after 50"],
        ),
        (
            job(schedule=[{"start_step": 0}]),
            ["jobs.mix.schedule[0].start_step", "increasing order", "0 is not after 0"],
        ),
        (job(weights={"web": 0, "code": 0}), ["jobs.mix.weights", "positive sum"]),
        (
            job(schedule=[{"start_step": 5, "weights": {"web": -1}}]),
            ["jobs.mix.schedule[0].weights.web", "-1"],
        ),
        (
            job(schedule=[{"start_step": 5, "weights": {"web": "x"}}]),
            ["jobs.mix.schedule[0].weights.web", "'x'"],
        ),
        (job(batch_multiple_of=3), ["jobs.mix.global_batch_size", "8", "multiple of", "3"]),
        (
            job(batch_multiple_of=4, schedule=[{"start_step": 9, "global_batch_size": 6}]),
            ["jobs.mix.schedule[0]", "global_batch_size 6", "multiple of batch_multiple_of 4"],
        ),
        (job(sources=["/x.jsonl"]), ["jobs.mix.sources", "inside each dataset"]),
        (job(datasets={}), ["jobs.mix.datasets", "{}"]),
        (job(schedule={"start_step": 5}), ["jobs.mix.schedule", "list of phases"]),
    ],
)
def test_bad_mixtures_name_the_field_and_value(raw, words):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
