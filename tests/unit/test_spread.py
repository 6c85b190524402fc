"""A serving worker's view of its node's streams (serve/spread.py): it moves a new stream only
when it serves more than another worker, only a call that says it can move, and not one that has
moved 3 times the workers; a worker that starts again zeroes its own slot."""

from __future__ import annotations

from tokenfeed.client.moves import MOVES_KEY, asked_to_move, with_moves
from tokenfeed.server.serve import spread


def test_a_worker_moves_a_stream_only_while_another_serves_fewer(tmp_path):
    path = spread.create(tmp_path, 3)
    a, b, c = (spread.StreamSpread(path, i) for i in range(3))
    can = ((MOVES_KEY, "0"),)
    assert not a.should_move(can)  # all at 0
    a.enter()
    assert a.should_move(can) and not b.should_move(can)  # [1, 0, 0]
    b.enter()
    c.enter()
    assert not a.should_move(can)  # [1, 1, 1]: even
    a.enter()
    assert a.should_move(can)
    assert not a.should_move(None) and not a.should_move((("other", "1"),))  # cannot move
    assert not a.should_move(((MOVES_KEY, "9"),))  # moved 3 x 3 times: served here
    assert not a.should_move(((MOVES_KEY, "many"),))  # not a count: as if it could not
    a.leave()
    assert a.counts.tolist() == [1, 1, 1]
    again = spread.StreamSpread(path, 0)  # worker 0 started anew: its streams ended
    assert again.counts.tolist() == [0, 1, 1] and b.counts.tolist() == [0, 1, 1]


def test_the_clients_say_they_can_move_and_know_a_refusal():
    assert with_moves(None, 0) == ((MOVES_KEY, "0"),)
    assert with_moves((("authorization", "x"),), 2)[-1] == (MOVES_KEY, "2")

    class Refused:
        def trailing_metadata(self):
            return (("tokenfeed-move", "1"),)

    assert asked_to_move(Refused()) and not asked_to_move(ValueError("no call"))
