"""The fleet simulator (benchmarks/fleet_sim.py, benchmarks/fleetsim/): its invariants.

Small fleets and short traces, so the whole file runs in a few seconds on a 2-core CPU. What is
checked: every request completes exactly once and the tokens add up; one instance reproduces
the offline decode curve it was built from and, with the fitted constants, the served sweep at
low load within stated tolerances; prefix affinity finds more of the chat trace's prefixes than
round robin; PD pays the measured handoff; a seed fixes the result.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fleet_sim  # noqa: E402
from fleetsim.curves import Calibration, InstanceCosts, load_curves  # noqa: E402
from fleetsim.fleet import Fleet, FleetConfig  # noqa: E402
from fleetsim.instance import Role  # noqa: E402
from fleetsim.metrics import summarize  # noqa: E402
from fleetsim.traces import ChatTrace, RandomTrace  # noqa: E402

CURVES = load_curves()
COSTS = InstanceCosts(CURVES)
BLOCK = 128


def _chat(rate: float, horizon_s: float = 12.0, seed: int = 0) -> ChatTrace:
    return ChatTrace(rate, horizon_s, block_tokens=BLOCK, seed=seed)


@pytest.mark.parametrize(
    "config",
    [
        FleetConfig(4, "round_robin"),
        FleetConfig(4, "least_loaded"),
        FleetConfig(4, "prefix_affinity"),
        FleetConfig(4, "pd", pd_ratio=(1, 3)),
        FleetConfig(4, "pd", pd_ratio=(1, 1), mean_loops=2.47),
    ],
    ids=lambda c: c.label.replace(" ", ""),
)
def test_every_request_completes_once_and_tokens_add_up(config):
    fleet = Fleet(config, COSTS)
    requests = fleet.run(_chat(rate=40.0))
    assert len({r.request_id for r in requests}) == len(requests) > 100
    assert fleet.completions == len(requests)
    for r in requests:
        assert r.arrival_s < r.first_token_s <= r.finish_s < math.inf
        assert 0 <= r.hit_tokens < r.prompt_tokens
    decoders = [i for i in fleet.instances if i.role is not Role.PREFILL]
    prefillers = [i for i in fleet.instances if i.role is not Role.DECODE]
    assert sum(i.stats.output_tokens for i in decoders) == sum(r.output_tokens for r in requests)
    assert sum(i.stats.prompt_tokens for i in prefillers) == sum(r.prompt_tokens for r in requests)
    assert sum(i.stats.hit_tokens for i in prefillers) == sum(r.hit_tokens for r in requests)
    assert all(i.kv_used_tokens == 0 and i.rows == 0 for i in fleet.instances)  # all freed


def test_one_instance_reproduces_the_offline_decode_curve():
    """No overheads, C requests of 1,024 + 128 tokens at once (the offline table's rows): the
    last request to start decodes with no prompt chunk left, at 4 ticks per token, so its TPOT
    is C / measured decode tok/s within 5% (the batch shrinks over its last tokens)."""
    costs = InstanceCosts(CURVES, Calibration(0.0, 0.0, 0.0))
    ticks = CURVES["decode_ticks"]
    for rows, tick_ms in zip(ticks["rows"], ticks["tick_ms"], strict=True):
        assert costs.tick_ms(rows, rows * ticks["mean_context_tokens"]) == pytest.approx(tick_ms)
        trace = RandomTrace(1e6, 1.0, block_tokens=BLOCK, fixed=(1024, 128), count=rows)
        requests = Fleet(FleetConfig(1, "round_robin"), costs).run(trace)
        last = max(requests, key=lambda r: r.first_token_s)
        tpot_ms = 1000 * (last.finish_s - last.first_token_s) / (last.output_tokens - 1)
        assert tpot_ms == pytest.approx(4 * tick_ms, rel=0.05)  # fixed depth: 4 ticks a token


def test_one_instance_matches_the_served_sweep_at_low_load():
    """With the fitted constants, the served sweep (fixed depth, 512 in / 128 out) at 4 and 8
    req/s: TTFT p50 within 15%, TPOT p99 within 10%; saturated request throughput within 5%.
    (TPOT p50 at 4 req/s is 45% high: docs/scale.md, what was simulated.)"""
    for point in CURVES["served_sweep"]["arms"]["fixed"]:
        simulated = fleet_sim.served_sweep_run(CURVES, COSTS, point["rate"], 4.0)
        if point["rate"] is None:
            assert simulated["request_throughput"] == pytest.approx(
                point["request_throughput"], rel=0.05
            )
        elif point["rate"] <= 8:
            assert simulated["ttft_p50_ms"] == pytest.approx(point["ttft_p50_ms"], rel=0.15)
            assert simulated["tpot_p99_ms"] == pytest.approx(point["tpot_p99_ms"], rel=0.10)


def test_prefix_affinity_finds_more_of_the_chat_prefixes_than_round_robin():
    hit_rates = {}
    for policy in ("round_robin", "prefix_affinity"):
        requests = Fleet(FleetConfig(8, policy), COSTS).run(_chat(rate=60.0))
        hit_rates[policy] = summarize(requests, warmup_s=0.0, horizon_s=12.0)["prefix_hit_rate"]
    assert hit_rates["prefix_affinity"] > hit_rates["round_robin"] + 0.1
    random_trace = RandomTrace(60.0, 5.0, block_tokens=BLOCK)
    requests = Fleet(FleetConfig(8, "prefix_affinity"), COSTS).run(random_trace)
    assert summarize(requests, warmup_s=0.0, horizon_s=5.0)["prefix_hit_rate"] == 0.0


def test_pd_pays_the_handoff_in_ttft_and_decodes_without_prompt_chunks():
    trace = lambda: RandomTrace(12.0, 20.0, block_tokens=BLOCK, fixed=(512, 64))  # noqa: E731
    mixed = summarize(
        Fleet(FleetConfig(2, "least_loaded"), COSTS).run(trace()), warmup_s=0, horizon_s=20
    )
    pd = summarize(
        Fleet(FleetConfig(2, "pd", pd_ratio=(1, 1)), COSTS).run(trace()), warmup_s=0, horizon_s=20
    )
    assert pd["ttft_p50_ms"] > mixed["ttft_p50_ms"] + 0.9 * COSTS.calibration.handoff_ms
    assert pd["tpot_p50_ms"] < mixed["tpot_p50_ms"]


def test_a_seed_fixes_the_result():
    def run(seed):
        config = FleetConfig(6, "prefix_affinity")
        return fleet_sim.simulate(
            COSTS, config, "chat", 6.0, horizon_s=10.0, warmup_s=2.0, seed=seed
        )

    first, again, other = run(1), run(1), run(2)
    for key in ("ttft_p99_ms", "tpot_p99_ms", "prefix_hit_rate", "requests", "events"):
        assert first[key] == again[key]
    assert first["requests"] != other["requests"] or first["ttft_p99_ms"] != other["ttft_p99_ms"]
