"""The data plan's pure parts and its log's conditional writes: an amendment's checks, the
config merged into a log, the log's bytes, two keepers racing on one log, and a phase's
schedule that leaves earlier phases (and their datasets' apportionment) untouched."""

from __future__ import annotations

import json
import threading
from fractions import Fraction

import numpy as np
import pytest
from tokenfeed.server.dataplan.keeper import PlanKeeper
from tokenfeed.server.dataplan.model import (
    Amendment,
    DataPlan,
    PlanLog,
    amend,
    merge_config,
    new_log,
)
from tokenfeed.server.errors import NotReadyError, PlanChangedError, PlanFrozenError, RequestError
from tokenfeed.server.sampling.mixture import Phase, Schedule
from tokenfeed.server.settings.config import from_dict
from tokenfeed.server.store.blobs import ABSENT, Conflict, LocalBlobs


def spec(**job):
    raw = {
        "datasets": {"a": {"sources": ["/d/a/*"], "weight": 1}, "b": {"sources": ["/d/b/*"]}},
        "tokenizer": "/t.json",
        "seq_len": 16,
        "global_batch_size": 8,
        "batch_multiple_of": 2,
        **job,
    }
    return from_dict({"jobs": {"j": raw}}).jobs[0]


def test_an_amendment_appends_a_phase_with_what_it_leaves_out_carried_over():
    s = spec()
    plan = DataPlan.from_spec(s)
    new, replaced = amend(plan, Amendment(40, weights={"b": Fraction(3)}), 10, 8, s)
    assert replaced == []
    assert [p.start_step for p in new.phases] == [0, 40]
    assert new.phases[1].weights == (Fraction(1), Fraction(3))  # a's kept, as in a schedule
    assert (new.phases[1].global_batch_size, new.phases[1].seq_len) == (8, 16)
    assert new.phases[0] == plan.phases[0]


def test_a_later_amendment_replaces_the_future_phases_it_starts_before():
    s = spec()
    plan, _ = amend(DataPlan.from_spec(s), Amendment(100, seq_len=64), 10, 8, s)
    plan2, replaced = amend(plan, Amendment(50, global_batch_size=4), 10, 8, s)
    assert [p.start_step for p in plan2.phases] == [0, 50]
    assert [p.start_step for p in replaced] == [100]


def test_an_amendment_may_add_a_dataset_which_earlier_phases_do_not_know():
    s = spec()
    add = (
        from_dict(
            {
                "jobs": {
                    "x": {
                        "sources": ["/d/c/*"],
                        "tokenizer": "/t",
                        "seq_len": 1,
                        "global_batch_size": 1,
                        "dataset": "c",
                    }
                }
            }
        )
        .jobs[0]
        .datasets
    )
    plan, _ = amend(
        DataPlan.from_spec(s), Amendment(20, weights={"c": Fraction(1)}, add=add), 0, 0, s
    )
    assert plan.names == ["a", "b", "c"]
    assert [len(p.weights) for p in plan.phases] == [2, 3]
    assert plan.phases[1].weights == (1, 1, 1)  # a and b keep theirs, c is named


@pytest.mark.parametrize(
    "change, error, words",
    [
        (Amendment(5), PlanFrozenError, "frozen"),
        (Amendment(20, weights={"zz": Fraction(1)}), RequestError, "'zz'"),
        (
            Amendment(20, weights={"a": Fraction(0), "b": Fraction(0)}),
            RequestError,
            "positive sum",
        ),
        (Amendment(20, global_batch_size=7), RequestError, "multiple of batch_multiple_of 2"),
        (Amendment(20, global_batch_size=0), RequestError, ">= 1"),
        (Amendment(20, seq_len=0), RequestError, ">= 1"),
        (Amendment(20, packing="bestfit"), RequestError, "concat, best_fit"),
    ],
)
def test_bad_amendments_say_what_to_fix(change, error, words):
    s = spec()
    with pytest.raises(error, match=words):
        amend(DataPlan.from_spec(s), change, 10, 7, s)


def test_a_phase_may_change_the_packing_and_says_so_only_where_it_differs():
    s = spec(packing="best_fit")
    plan = DataPlan.from_spec(s)
    longer, _ = amend(plan, Amendment(20, seq_len=32), 0, 0, s)
    assert (longer.phases[-1].seq_len, longer.phases[-1].packing) == (32, "")
    concat, _ = amend(longer, Amendment(30, packing="concat"), 0, 0, s)
    assert (concat.phases[-1].seq_len, concat.phases[-1].packing) == (32, "concat")
    # the next phase keeps the packing of the phase before it, not the job's
    kept, _ = amend(concat, Amendment(40, global_batch_size=8), 0, 0, s)
    assert kept.phases[-1].packing == "concat"
    back, _ = amend(kept, Amendment(50, packing="best_fit"), 0, 0, s)
    assert back.phases[-1].packing == ""
    log = PlanLog("j", "id", 2, 2, -1, -1, back)
    stored = json.loads(log.to_bytes())
    assert PlanLog.from_bytes(log.to_bytes(), "test").plan == back
    assert [p.get("packing") for p in stored["phases"]] == [None, None, "concat", "concat", None]


def test_a_phase_ends_where_the_next_one_starts():
    plan = DataPlan.from_spec(
        spec(
            schedule=[
                {"start_step": 30, "global_batch_size": 16},
                {"start_step": 45, "global_batch_size": 8},
            ]
        )
    )
    assert [plan.phase_end(s) for s in (0, 29, 30, 44)] == [30, 30, 45, 45]
    assert plan.phase_end(45) is None and plan.phase_end(10**9) is None
    assert DataPlan.from_spec(spec()).phase_end(0) is None


def test_the_log_round_trips_and_the_config_merges_into_it():
    s = spec()
    log = new_log(s, "tf.yaml")
    again = PlanLog.from_bytes(log.to_bytes(), "test")
    assert again == log
    # A config that repeats or lags behind the log leaves it; one that extends it, past the
    # horizon, appends.
    assert merge_config(log, s)[0] is None
    longer = spec(schedule=[{"start_step": 30, "global_batch_size": 16}])
    merged, why = merge_config(log, longer)
    assert merged is not None and [p.start_step for p in merged.phases] == [0, 30]
    assert "adds phases" in why
    frozen = log.with_horizon(40, 40)
    assert merge_config(frozen, longer)[0] is None


def test_two_keepers_racing_on_one_log_never_lose_a_write(tmp_path):
    """Horizon advances and appends from two 'servers' interleave; conditional writes make
    every one of them land on the version the other wrote."""
    s = spec()
    blobs = LocalBlobs(str(tmp_path))
    keepers = [PlanKeeper(s, blobs, str(tmp_path), freeze_ahead=1) for _ in range(2)]
    keepers[0].open()
    keepers[1].open()
    errors: list[BaseException] = []

    def advance(k: PlanKeeper, steps: range) -> None:
        try:
            for step in steps:
                k.frozen_through(step)
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=advance, args=(keepers[0], range(0, 200, 2))),
        threading.Thread(target=advance, args=(keepers[1], range(1, 200, 2))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    final = keepers[0].refresh()
    # `served` is the furthest step that moved the horizon: a step already covered by the
    # other keeper's move (within freeze_ahead) writes nothing.
    assert final.horizon >= 199 and 198 <= final.served <= 199
    assert final.horizon == final.served + 1
    assert final.revision >= 2  # every write bumped it
    # An append at a frozen step is refused, one after the horizon lands, and the other
    # keeper's view of the old version is refused a versioned change.
    with pytest.raises(PlanFrozenError):
        keepers[1].append(Amendment(150), "t")
    keepers[1].append(Amendment(final.horizon + 5, global_batch_size=4), "t")
    with pytest.raises(PlanChangedError):
        keepers[0].append(Amendment(final.horizon + 9), "t", expected_version=1)
    assert keepers[0].refresh().version == 2


def test_a_conditional_write_on_a_stale_version_is_refused(tmp_path):
    blobs = LocalBlobs(str(tmp_path))
    tag = blobs.put_if("plans/x.json", b"one", ABSENT)
    with pytest.raises(Conflict):
        blobs.put_if("plans/x.json", b"two", ABSENT)
    tag2 = blobs.put_if("plans/x.json", b"two", tag)
    with pytest.raises(Conflict):
        blobs.put_if("plans/x.json", b"three", tag)
    assert blobs.get_tagged("plans/x.json") == (b"two", tag2)


def test_a_keeper_that_cannot_reach_its_log_refuses_rather_than_guess(tmp_path):
    class Broken(LocalBlobs):
        down = False

        def get_tagged(self, name):
            if self.down:
                raise OSError("no route to host")
            return super().get_tagged(name)

    blobs = Broken(str(tmp_path))
    keeper = PlanKeeper(spec(), blobs, str(tmp_path), freeze_ahead=2)
    keeper.open()
    assert keeper.frozen_through(5).horizon == 7
    blobs.down = True
    assert keeper.frozen_through(7).horizon == 7  # within its copy's horizon: final, served
    with pytest.raises(NotReadyError, match="cannot confirm the data plan for step 8"):
        keeper.frozen_through(8)


def test_a_phase_adding_a_dataset_changes_no_earlier_step():
    """The apportionment of a phase is over the datasets it knows: a third dataset added at
    step 50 leaves steps 0..49 of a two-dataset schedule exactly as they were."""
    two = Schedule(
        [Phase(0, 12, (Fraction(2), Fraction(1))), Phase(30, 6, (Fraction(1), Fraction(1)))], 7
    )
    three = Schedule(
        [
            Phase(0, 12, (Fraction(2), Fraction(1))),
            Phase(30, 6, (Fraction(1), Fraction(1))),
            Phase(50, 6, (Fraction(1), Fraction(1), Fraction(4))),
        ],
        7,
    )
    for step in range(50):
        a, b = two.rows(step, 0, two.batch_size(step)), three.rows(step, 0, three.batch_size(step))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), step
    assert three.consumed(50).tolist()[:2] == two.consumed(50).tolist()
    datasets, rows = three.rows(50, 0, 6)
    assert sorted(datasets.tolist()) == [0, 1, 2, 2, 2, 2]
    # The new dataset's rows start at its row 0; the others continue where they were.
    assert rows[datasets == 2].min() == 0
