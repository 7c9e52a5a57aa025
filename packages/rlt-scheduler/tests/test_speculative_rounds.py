"""Scheduling speculative rounds against a scripted device that accepts every draft: which
requests draft, ticks while prompts are computed or too many requests decode, KV lookahead for
K + 1 positions per round (the device asserts it), no trailing round after the last token."""

from __future__ import annotations

from rlt_contracts import SamplingParams
from scheduler_harness import FakeDevice, make_scheduler, run_until_idle


def test_rounds_cover_every_position_and_emit_all_tokens():
    scheduler = make_scheduler(num_speculative_tokens=3, max_num_seqs=4)
    device = FakeDevice(scheduler.kv, depth=lambda request_id, index: 3)
    for i in range(3):
        scheduler.add_request(f"r{i}", [1] * (5 + 7 * i), SamplingParams(max_tokens=9 + 4 * i))
    steps, finals = run_until_idle(scheduler, device)
    for i in range(3):
        assert sum(len(d.token_ids) for d in finals[f"r{i}"]) == 9 + 4 * i
        assert finals[f"r{i}"][-1].finish_reason == "length"
    for step in steps:
        assert not (step.decode_ticks and step.speculative_rounds)
        if step.prefill:  # prompt steps tick, so prompts are never held up by a round
            assert step.speculative_rounds == 0
    assert sum(s.speculative_rounds for s in steps) > 0
    assert scheduler.kv.pages == {}  # every block freed


def test_rounds_in_flight_that_finish_a_request_get_no_followers():
    """Every round makes at least one token: with nothing accepted (one token per round), the
    scheduler, one step ahead of the device, never queues more rounds than tokens are left,
    and the last token, which no round could draft for, comes from ticks."""
    scheduler = make_scheduler(num_speculative_tokens=3)
    device = FakeDevice(scheduler.kv, depth=lambda request_id, index: 4, accepts=False)
    scheduler.add_request("r", [1, 2], SamplingParams(max_tokens=17))
    steps, finals = run_until_idle(scheduler, device)
    assert sum(len(d.token_ids) for d in finals["r"]) == 17
    # token 0 from the prompt step, which also ran one tick; then 15 tokens, one per round,
    # and the last one from ticks
    assert sum(s.speculative_rounds for s in steps) == 15
    decoding = [s for s in steps if s.decode_ticks or s.speculative_rounds]
    assert decoding[-1].decode_ticks and not decoding[-1].speculative_rounds


def test_penalized_and_constrained_requests_do_not_draft_and_the_limit_pauses_rounds():
    scheduler = make_scheduler(num_speculative_tokens=2, speculative_disable_batch_size=1)
    penalized = scheduler.add_request(
        "p", [1], SamplingParams(repetition_penalty=1.2, max_tokens=5)
    )
    plain = scheduler.add_request("q", [1], SamplingParams(max_tokens=12))
    assert penalized.rule.num_speculative_tokens == 0
    assert plain.rule.num_speculative_tokens == 2
    device = FakeDevice(scheduler.kv, depth=lambda request_id, index: 2)
    steps, finals = run_until_idle(scheduler, device)
    assert sum(len(d.token_ids) for d in finals["q"]) == 12
    # two decode: ticks (the limit); once "p" ends, "q" speculates
    assert any(s.decode_ticks for s in steps) and any(s.speculative_rounds for s in steps)


def test_a_request_that_cannot_draft_decodes_alone_with_ticks():
    """A round in which no request drafts costs more loop passes than its tokens' ticks."""
    scheduler = make_scheduler(num_speculative_tokens=2)
    scheduler.add_request("p", [1], SamplingParams(repetition_penalty=1.2, max_tokens=9))
    device = FakeDevice(scheduler.kv, depth=lambda request_id, index: 2)
    steps, finals = run_until_idle(scheduler, device)
    assert sum(len(d.token_ids) for d in finals["p"]) == 9
    assert not any(s.speculative_rounds for s in steps)


def test_no_round_once_ticks_in_flight_leave_at_most_one_token():
    """Two requests tick (above the limit of 1); when the short one ends, the ticks in flight
    surely leave the other one token (refill: 8 ticks at depth 4 finish 2 tokens), so its
    last step ticks instead of running a round that could draft nothing."""
    scheduler = make_scheduler(num_speculative_tokens=2, speculative_disable_batch_size=1)
    scheduler.add_request("x", [1], SamplingParams(max_tokens=3))
    scheduler.add_request("y", [1], SamplingParams(max_tokens=6))
    device = FakeDevice(scheduler.kv, depth=lambda request_id, index: 4)
    steps, finals = run_until_idle(scheduler, device)
    assert sum(len(d.token_ids) for d in finals["x"]) == 3
    assert sum(len(d.token_ids) for d in finals["y"]) == 6
    assert not any(s.speculative_rounds for s in steps)


def test_rounds_that_could_finish_a_request_are_not_followed_by_more():
    """Every draft accepted (K + 1 = 4 tokens per round): the scheduler, one step ahead of the
    device, never queues a round once the rounds in flight could reach max_tokens, so no round
    runs only padding after the last token (the bound n - r would queue a fifth step here)."""
    scheduler = make_scheduler(num_speculative_tokens=3)
    device = FakeDevice(scheduler.kv, depth=lambda request_id, index: 4)
    scheduler.add_request("r", [1, 2], SamplingParams(max_tokens=33))
    steps, finals = run_until_idle(scheduler, device)
    # token 0 from the prompt step, then 32 tokens: 8 rounds of 4
    assert [len(d.token_ids) for d in finals["r"]] == [1, 8, 8, 8, 8]
    assert sum(s.speculative_rounds for s in steps) == 8
