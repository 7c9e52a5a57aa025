"""Scheduling while prompts arrive one after the other (served load): the ticks a step that
computes prompts runs (`prefill_step_decode_ticks`) and the admission window
(`scheduler_delay_factor`). Both are scheduling choices: every request's tokens and exit depths
stay the same, the device never loops outside a request's blocks (the scripted device asserts
it), and every block is freed."""

from __future__ import annotations

import pytest
from rlt_contracts import ConfigurationError, RequestStage, SamplingParams, SchedulerConfig
from rlt_scheduler import scheduler as scheduler_module
from rlt_scheduler.admission_delay import AdmissionDelay
from scheduler_harness import FakeDevice, make_scheduler

DEPTH = 4


def depth_of(request_id: str, index: int) -> int:
    """Exit depths that vary per token within the requests' loop bounds (2 .. 4; token 0
    comes from prefill at full depth)."""
    return 2 + (index + len(request_id)) % 3


def token_of(request_id: str, index: int) -> int:
    return 10 + (index * 7 + len(request_id)) % 50


def run_staggered(scheduler, device, arrivals, *, in_flight=1, device_time=None):
    """Drive like the asynchronous engine; before step i, add the requests `arrivals[i]`
    lists ([(name, prompt length, max_tokens)]); `device_time()` runs after each step was
    executed (a test clock moves there). Returns (steps, deltas by request id)."""
    steps, finals, pending = [], {}, []
    last_arrival = max(arrivals)
    for index in range(2000):
        for name, prompt_length, max_tokens in arrivals.get(index, ()):
            prompt = [1 + (i % 90) for i in range(prompt_length)]
            params = SamplingParams(max_tokens=max_tokens, min_loops=2, exit_threshold=0.5)
            scheduler.add_request(name, prompt, params)
        if index > last_arrival and not scheduler.has_unfinished_requests() and not pending:
            break
        step = scheduler.schedule()
        steps.append(step)
        pending.append(device.execute(step))
        if device_time is not None:
            device_time()
        while len(pending) > (in_flight if step.has_work else 0):
            scheduler.update_from_output(pending.pop(0))
        for delta in scheduler.take_outputs():
            finals.setdefault(delta.request_id, []).append(delta)
    return steps, finals


# Four requests decode; five more arrive two steps apart (long prompts: several chunks each).
STAGGERED = {0: [(f"early{i}", 6, 40) for i in range(4)]} | {
    4 + 2 * i: [(f"late{i}", 30, 12 + 3 * i)] for i in range(5)
}


def outputs(finals):
    return {
        name: (
            [t for d in deltas for t in d.token_ids],
            [e for d in deltas for e in d.exit_depths],
            deltas[-1].finish_reason,
        )
        for name, deltas in finals.items()
    }


def staggered_run(*, in_flight=1, **config):
    scheduler = make_scheduler(
        max_num_seqs=6, max_num_batched_tokens=24, prefill_chunk_size=8, **config
    )
    device = FakeDevice(scheduler.kv, depth=depth_of, token=token_of, model_depth=DEPTH)
    steps, finals = run_staggered(scheduler, device, STAGGERED, in_flight=in_flight)
    assert scheduler.kv.pages == {}, "blocks leaked"
    assert not scheduler.has_unfinished_requests()
    return steps, outputs(finals)


OPTION_VALUES = [
    dict(prefill_step_decode_ticks=1),
    dict(prefill_step_decode_ticks="auto"),
    dict(prefill_step_decode_ticks=3),
    dict(prefill_step_decode_ticks="auto", decode_ticks_per_step=2),
]
FEATURES = [
    dict(),
    dict(incremental_kv=True),
    dict(mode="no_refill"),
    dict(num_speculative_tokens=2, speculative_disable_batch_size=8),
    dict(incremental_kv=True, in_flight=2),
]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f) or "default")
def test_prompt_step_ticks_change_no_output_and_free_every_block(features):
    reference_steps, reference = staggered_run(**features)
    assert len(reference) == 9
    for name, (tokens, depths, reason) in reference.items():
        assert reason == "length"
        assert tokens == [token_of(name, i) for i in range(len(tokens))]
        assert depths == [DEPTH] + [depth_of(name, i) for i in range(1, len(tokens))]
    for options in OPTION_VALUES[1:]:
        steps, got = staggered_run(**features, **options)
        assert got == reference, options


def prompt_step_ticks(steps):
    """Ticks of the steps that computed prompt tokens while other requests decoded (step 0
    starts the first prompts, with nothing decoding yet: one tick, as the refill cap gives)."""
    assert steps[0].prefill and steps[0].decode_ticks == 1
    return [s.decode_ticks for s in steps[1:] if s.prefill and s.decode_ticks]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (dict(prefill_step_decode_ticks=1), 1),
        (dict(prefill_step_decode_ticks="auto"), DEPTH),
        (dict(prefill_step_decode_ticks=3), 3),
        (dict(prefill_step_decode_ticks="auto", decode_ticks_per_step=2), 2),
        (dict(prefill_step_decode_ticks=6, decode_ticks_per_step=5), 5),
    ],
)
def test_steps_that_compute_prompts_run_the_configured_ticks(options, expected):
    steps, _ = staggered_run(**options)
    ticks = prompt_step_ticks(steps)
    assert ticks and set(ticks) == {expected}
    # steps without prompt work keep decode_ticks_per_step (capped by what requests can use)
    decode_only = [s.decode_ticks for s in steps if not s.prefill and s.decode_ticks]
    assert max(decode_only) == options.get("decode_ticks_per_step", 8)
    # the decoding rows advance more per prompt step, so fewer steps in all
    if expected > 1:
        baseline, _ = staggered_run(**(options | {"prefill_step_decode_ticks": 1}))
        assert len(steps) < len(baseline)


def test_prompt_step_ticks_stop_at_what_the_longest_request_can_still_use():
    """Refill: one request with 2 tokens of 2 loops left and a new prompt queued: the prompt
    step runs 3 ticks (token 0's step already ran one), not the 8 asked for."""
    scheduler = make_scheduler(decode_ticks_per_step=8, prefill_step_decode_ticks=8)
    scheduler.add_request("r", [1], SamplingParams(max_tokens=3, ignore_eos=True, max_loops=2))
    device = FakeDevice(scheduler.kv, depth=lambda r, i: 2)
    first = scheduler.schedule()
    assert first.decode_ticks == 1  # nothing decodes yet: the completing prompt ran one tick
    scheduler.update_from_output(device.execute(first))
    scheduler.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2))
    second = scheduler.schedule()
    assert second.prefill and second.decode_ticks == 3


@pytest.mark.parametrize("value", [0, -1, "deep", 2.5, True])
def test_invalid_prompt_step_ticks_are_refused(value):
    with pytest.raises(ConfigurationError, match="prefill_step_decode_ticks"):
        SchedulerConfig(prefill_step_decode_ticks=value)


@pytest.mark.parametrize("value", [-0.1, "1", float("nan"), True])
def test_invalid_delay_factors_are_refused(value):
    with pytest.raises(ConfigurationError, match="scheduler_delay_factor"):
        SchedulerConfig(scheduler_delay_factor=value)


class ManualClock:
    """Stands in for the scheduler module's `time`: `now` moves only when the test says."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = ManualClock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    return clock


def test_the_delay_gathers_prompts_that_arrive_within_the_window(clock):
    """Every step takes 10 ms; prompt steps are measured at 10 ms, so with factor 2 a new
    prompt waits 20 ms while requests run. Two prompts 10 ms apart start in the same step;
    without the delay each starts in its own."""

    def run(factor):
        scheduler = make_scheduler(
            max_num_seqs=6,
            max_num_batched_tokens=40,
            prefill_chunk_size=16,
            scheduler_delay_factor=factor,
        )
        device = FakeDevice(scheduler.kv, depth=depth_of, token=token_of, model_depth=DEPTH)
        arrivals = {0: [("a", 6, 30)], 6: [("b", 6, 8)], 7: [("c", 6, 8)]}

        def step_time():
            clock.now += 0.010

        steps, finals = run_staggered(
            scheduler, device, arrivals, in_flight=0, device_time=step_time
        )
        assert scheduler.kv.pages == {}
        started = {
            new.identity.request_id: i for i, s in enumerate(steps) for new in s.new_requests
        }
        return started, outputs(finals)

    immediate, reference = run(0.0)
    assert immediate == {"a": 0, "b": 6, "c": 7}
    delayed, got = run(2.0)
    assert delayed["a"] == 0  # nothing ran: no wait
    assert delayed["b"] == delayed["c"] == 8  # b waited 20 ms (8 - 6 steps), c came along
    assert got == reference


def test_the_delay_never_holds_admission_while_nothing_runs(clock):
    scheduler = make_scheduler(scheduler_delay_factor=100.0)
    scheduler._delay.prompt_step_s = 1.0  # a long prompt step was measured earlier
    scheduler.add_request("r", [1, 2], SamplingParams(max_tokens=2))
    step = scheduler.schedule()
    assert [n.identity.request_id for n in step.new_requests] == ["r"]


def test_held_admission_lets_the_running_requests_decode_at_full_length(clock):
    """While admission waits, nothing can start, so the step is a decode-only step (8 ticks),
    not a prompt step; once the window passed the prompt starts."""
    scheduler = make_scheduler(scheduler_delay_factor=1.0, decode_ticks_per_step=8)
    scheduler.add_request("a", [1, 2], SamplingParams(max_tokens=40, ignore_eos=True))
    device = FakeDevice(scheduler.kv, depth=lambda r, i: 4)
    executed = device.execute(scheduler.schedule())  # a's prompt step
    clock.now += 0.050
    scheduler.update_from_output(executed)
    assert scheduler._delay.prompt_step_s == pytest.approx(0.050)
    scheduler.add_request("b", [1, 2], SamplingParams(max_tokens=4))
    held = scheduler.schedule()
    assert not held.new_requests and held.decode_ticks == 8
    assert scheduler.get_request("b").stage is RequestStage.WAITING
    clock.now += 0.010
    scheduler.update_from_output(device.execute(held))
    clock.now += 0.040
    started = scheduler.schedule()
    assert [n.identity.request_id for n in started.new_requests] == ["b"]


def test_a_prompt_step_is_timed_from_when_the_device_could_start_it():
    delay = AdmissionDelay(1.0)
    delay.step_scheduled(0, computes_prompts=False, now=0.0)
    delay.step_scheduled(1, computes_prompts=True, now=0.001)  # scheduled while 0 runs
    delay.step_applied(0, now=0.010)
    delay.step_applied(1, now=0.040)  # ran from 0.010 (after step 0) to 0.040
    assert delay.prompt_step_s == pytest.approx(0.030)
    delay.step_scheduled(2, computes_prompts=False, now=0.041)
    delay.step_applied(2, now=0.050)  # not a prompt step: the measurement stays
    assert delay.prompt_step_s == pytest.approx(0.030)
    assert delay.holds(0.045, anything_running=True, now=0.060)
    assert not delay.holds(0.045, anything_running=True, now=0.080)
    assert not delay.holds(0.045, anything_running=False, now=0.060)
    assert not delay.holds(None, anything_running=True, now=0.060)
