"""The routing policy alone (no Ray): round robin, least loaded, prefix affinity and its load
bound, forgetting replicas that left, bad settings."""

from __future__ import annotations

import math
import random

import pytest
from rlt_ray.policy import ReplicaLoad, RoutingPolicy, prefix_block_hashes


def loads(*in_flight: int, **extra) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", in_flight=n, **extra) for i, n in enumerate(in_flight)]


def test_block_hashes_chain_and_leave_out_the_last_token():
    a = prefix_block_hashes(list(range(33)), 16)
    assert len(a) == 2  # 32 usable tokens (the 33rd is the last): 2 full blocks
    assert len(prefix_block_hashes(list(range(32)), 16)) == 1  # 31 usable tokens
    b = prefix_block_hashes([99] + list(range(1, 33)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # a changed first block changes every later hash
    c = prefix_block_hashes(list(range(16)) + [7] * 17, 16)
    assert c[0] == a[0] and c[1] != a[1]


def test_round_robin_cycles_whatever_the_load():
    policy = RoutingPolicy("round_robin")
    picks = [policy.decide([1, 2, 3], loads(5, 0, 0)).ranking[0] for _ in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_least_loaded_uses_the_larger_of_own_and_reported_load_then_kv_then_recency():
    policy = RoutingPolicy("least_loaded")
    replicas = [
        ReplicaLoad("a", in_flight=1, ongoing=0),
        ReplicaLoad("b", in_flight=0, ongoing=4),  # another router's load
        ReplicaLoad("c", in_flight=2),
    ]
    assert policy.decide([1], replicas).ranking == ("a", "c", "b")
    tie = [
        ReplicaLoad("a", kv_blocks_free=10, kv_blocks_total=100),
        ReplicaLoad("b", kv_blocks_free=90, kv_blocks_total=100),
    ]
    assert policy.decide([1], tie).ranking[0] == "b"
    even = [ReplicaLoad("a"), ReplicaLoad("b")]
    first = policy.decide([1], even).ranking[0]
    assert policy.decide([1], even).ranking[0] != first  # picked longest ago next


def test_prefix_affinity_follows_the_cached_prefix():
    policy = RoutingPolicy("prefix_affinity", block_size=4)
    shared = list(range(100, 112))  # 3 blocks
    replicas = loads(0, 0, 0)
    first = policy.decide(shared + [1, 2], replicas)
    assert first.reason == "no_match"
    policy.routed(first.ranking[0], shared + [1, 2])
    other = first.ranking[0]
    # the replica holding the prefix wins even when another one is idler
    busy = [ReplicaLoad(k, in_flight=1 if k == other else 0) for k in ("r0", "r1", "r2")]
    decision = policy.decide(shared + [3, 4, 5], busy)
    assert decision.ranking[0] == other and decision.reason == "prefix"
    assert decision.matched_blocks == 3
    # a prompt sharing only the first block still prefers it; an unrelated one does not
    assert policy.decide(shared[:4] + [9] * 9, busy).ranking[0] == other
    assert policy.decide([7] * 13, busy).reason == "no_match"


def test_longest_match_wins_and_ties_go_to_the_least_loaded():
    policy = RoutingPolicy("prefix_affinity", block_size=2)
    policy.routed("a", [1, 2, 3, 4, 5])  # blocks [1,2] [3,4]
    policy.routed("b", [1, 2, 9, 9, 5])  # blocks [1,2] [9,9]
    policy.routed("c", [1, 2, 3, 4, 5])
    replicas = [ReplicaLoad("a", in_flight=1), ReplicaLoad("b"), ReplicaLoad("c")]
    assert policy.decide([1, 2, 3, 4, 7], replicas).ranking[0] == "c"  # a and c: 2, c idler
    assert policy.decide([1, 2, 9, 9, 7], replicas).ranking[0] == "b"


def test_load_bound_overrides_affinity_and_is_never_exceeded():
    policy = RoutingPolicy("prefix_affinity", block_size=4, load_factor=1.25, load_slack=1)
    hot = list(range(20))
    policy.routed("r0", hot)
    # r0 holds the prefix; loads (3, 0, 0): T = 4, cap = ceil(1.25 * 4 / 3) + 1 = 3 < 3 + 1
    decision = policy.decide(hot, loads(3, 0, 0))
    assert decision.reason == "bound" and decision.ranking[0] != "r0"
    assert decision.cap == 3 and decision.load_after == 1
    # (3, 1, 1): T = 6, cap = ceil(1.25 * 6 / 3) + 1 = 4 >= 3 + 1: affinity allowed
    assert policy.decide(hot, loads(3, 1, 1)).reason == "prefix"
    # without slack the bound is tight: (1, 0, 0), T = 2, cap = ceil(0.83) = 1 < 1 + 1
    strict = RoutingPolicy("prefix_affinity", block_size=4, load_slack=0)
    strict.routed("r0", hot)
    assert strict.decide(hot, loads(1, 0, 0)).reason == "bound"


def test_bound_holds_over_a_random_hot_trace():
    """Every request of a trace where 80% share one prefix lands on a replica whose load after
    routing is <= ceil(load_factor * T / n) + load_slack."""
    rng = random.Random(0)
    policy = RoutingPolicy("prefix_affinity", block_size=4, load_factor=1.25, load_slack=1)
    in_flight = {"r0": 0, "r1": 0, "r2": 0, "r3": 0}
    hot = list(range(50, 70))
    active: list[str] = []
    for step in range(400):
        if active and rng.random() < 0.45:  # one request ends
            in_flight[active.pop(rng.randrange(len(active)))] -= 1
            continue
        prompt = hot + [step] if rng.random() < 0.8 else [step] * 21
        replicas = [ReplicaLoad(k, in_flight=v) for k, v in in_flight.items()]
        total = sum(in_flight.values()) + 1
        d = policy.decide(prompt, replicas)
        chosen = d.ranking[0]
        policy.routed(chosen, prompt)
        in_flight[chosen] += 1
        active.append(chosen)
        assert in_flight[chosen] <= math.ceil(1.25 * total / 4) + 1
    assert policy.max_load_ratio <= 1.0
    assert policy.affinity_hits > 0 and policy.bounded > 0


def test_replicas_that_left_are_forgotten():
    policy = RoutingPolicy("prefix_affinity", block_size=2)
    policy.routed("old", [1, 2, 3, 4, 5])
    assert policy.cached_blocks("old") == 2
    policy.decide([1, 2, 3, 4, 5], [ReplicaLoad("new")])
    assert policy.cached_blocks("old") == 0  # its replacement starts with an empty cache


def test_prefix_table_is_bounded_lru():
    policy = RoutingPolicy("prefix_affinity", block_size=1, max_cached_blocks=3)
    policy.routed("a", [1, 2, 3, 0])
    policy.routed("a", [7, 0])  # evicts block [1]'s hash, the least recently routed
    assert policy.cached_blocks("a") == 3
    assert policy.decide([1, 2, 3, 0], [ReplicaLoad("a"), ReplicaLoad("b")]).reason == "no_match"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "random"}, "routing policy must be one of"),
        ({"block_size": 0}, "block_size"),
        ({"load_factor": 0.9}, "load_factor"),
        ({"load_slack": -1}, "load_slack"),
        ({"min_match_blocks": 0}, "min_match_blocks"),
        ({"max_cached_blocks": 0}, "max_cached_blocks"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingPolicy(**kwargs)


def test_no_replica_is_an_error_and_live_switch_works():
    policy = RoutingPolicy("round_robin")
    with pytest.raises(ValueError, match="no replica"):
        policy.decide([1], [])
    policy.set_policy("least_loaded")
    assert policy.decide([1], loads(2, 0)).ranking[0] == "r1"
    with pytest.raises(ValueError):
        policy.set_policy("fastest")
