"""Target parsing and rendezvous ranking: which server answers which rank."""

from __future__ import annotations

from collections import Counter

import pytest
from tokenfeed.client.fleet import Fleet, parse_target, rendezvous, resolve

SERVERS = [f"10.0.0.{i}:50051" for i in range(1, 6)]


def test_targets_parse():
    assert parse_target("h:1") == ("static", ["h:1"])
    assert parse_target(" b:2, a:1 ,a:1") == ("static", ["a:1", "b:2"])
    assert parse_target("dns:///svc.ns:50051") == ("dns", ["svc.ns:50051"])
    assert parse_target("[::1]:50051") == ("static", ["[::1]:50051"])


@pytest.mark.parametrize("bad", ["", "host", "host:port", ":50051", "dns://auth/name:1"])
def test_bad_targets_are_refused_with_the_form_expected(bad):
    with pytest.raises(ValueError, match="host:port|empty target|no DNS authority"):
        parse_target(bad)


def test_rendezvous_is_a_stable_total_order_per_job_and_rank():
    order = rendezvous(SERVERS, "job", 3)
    assert sorted(order) == sorted(SERVERS)
    assert rendezvous(list(reversed(SERVERS)), "job", 3) == order  # input order is irrelevant
    assert rendezvous(SERVERS, "other-job", 3) != order or rendezvous(SERVERS, "job", 4) != order


def test_rendezvous_spreads_ranks_evenly_enough():
    homes = Counter(rendezvous(SERVERS, "job", r)[0] for r in range(1000))
    assert set(homes) == set(SERVERS)
    assert min(homes.values()) > 1000 / len(SERVERS) * 0.6


def test_losing_a_server_moves_only_its_own_ranks():
    before = {r: rendezvous(SERVERS, "job", r)[0] for r in range(500)}
    gone = SERVERS[2]
    after = {r: rendezvous([s for s in SERVERS if s != gone], "job", r)[0] for r in range(500)}
    for r in before:
        if before[r] != gone:
            assert after[r] == before[r]
        else:  # the orphaned ranks go to their second choice
            assert after[r] == rendezvous(SERVERS, "job", r)[1]


def test_dns_targets_resolve_and_rank():
    assert "127.0.0.1:7000" in resolve("localhost:7000")
    fleet = Fleet("dns:///localhost:7000")
    assert "127.0.0.1:7000" in fleet.ranked("job", 0)
