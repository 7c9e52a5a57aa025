"""Failure protocol of a step's bookkeeping (R04), with injected faults: a failed preemption
snapshot or restore aborts only its request, with the error; a failed shared operation aborts
the requests of its step; steps already scheduled for a lost request are skipped, not crashed;
nothing leaks (the `llm_factory` fixture checks KV blocks, rows and snapshots) and the engine
keeps serving, in the synchronous and the asynchronous pipeline."""

from __future__ import annotations

import pytest
from rlt import SamplingParams

LOW = [1, 2, 3]
LONG_LOW = list(range(10, 33))  # 23 tokens: several prefill chunks of 5
HIGH = [4, 5]


def params(max_tokens: int, priority: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)


def fail_once(target, name: str, message: str, when=lambda *args, **kwargs: True) -> list:
    """Make `target.name` raise RuntimeError(message) on its first call for which `when` holds;
    returns the list of calls that failed (for assertions)."""
    original = getattr(target, name)
    failed = []

    def flaky(*args, **kwargs):
        if not failed and when(*args, **kwargs):
            failed.append(args)
            raise RuntimeError(message)
        return original(*args, **kwargs)

    setattr(target, name, flaky)
    return failed


def record(finals: dict, outputs) -> None:
    for output in outputs:
        if output.finished:
            finals[output.request_id] = output


def run_to_end(engine, finals: dict | None = None) -> dict:
    finals = {} if finals is None else finals
    while engine.has_unfinished_requests():
        record(finals, engine.step())
    return finals


def alone(llm_factory, prompt, max_tokens):
    return llm_factory().generate([prompt], params(max_tokens))[0].token_ids


def preempting(llm_factory, async_scheduling: bool):
    return llm_factory(
        scheduling_policy="priority",
        enable_preemption=True,
        max_num_seqs=1,
        async_scheduling=async_scheduling,
    )


def assert_serves_and_forgets(llm, llm_factory) -> None:
    """A later request runs normally, and once the releases were delivered the runner holds no
    state and tracks no lost request."""
    again = llm.generate([LOW], params(5))[0]
    assert again.finish_reason == "length" and again.token_ids == alone(llm_factory, LOW, 5)
    llm.engine.step()  # delivers the last release
    runner = llm.engine.core.runner
    assert len(runner.rows) == 0 and len(runner.snapshots) == 0
    assert runner.bookkeeping.lost == frozenset()
    assert llm.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("victim_stage", ["decoding", "prefill"])
def test_failed_snapshot_aborts_only_the_victim(llm_factory, async_scheduling, victim_stage):
    """Old behaviour: the snapshot ran outside the per-request handling; a decoding victim and
    the innocent new request were aborted together, and a prefilling victim stayed WAITING
    without a snapshot until its resume crashed the engine (KeyError)."""
    llm = preempting(llm_factory, async_scheduling)
    engine, runner = llm.engine, llm.engine.core.runner
    low_prompt = LOW if victim_stage == "decoding" else LONG_LOW
    engine.add_request("low", low_prompt, params(8, priority=10))
    engine.step()
    if victim_stage == "decoding":
        engine.step()
    failed = fail_once(runner.snapshots, "save", "simulated pinned-memory exhaustion")
    engine.add_request("high", HIGH, params(6, priority=-10))
    finals = run_to_end(engine)
    assert len(failed) == 1
    low, high = finals["low"], finals["high"]
    assert low.finish_reason == "abort"
    assert "preemption snapshot failed" in low.error and "pinned-memory" in low.error
    assert high.finish_reason == "length" and high.error is None
    assert high.token_ids == alone(llm_factory, HIGH, 6)
    stats = llm.get_stats()
    assert (stats.preemptions, stats.resumptions, stats.aborted_requests) == (1, 0, 1)
    assert_serves_and_forgets(llm, llm_factory)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_failed_restore_aborts_only_the_resumed_request(llm_factory, async_scheduling):
    llm = preempting(llm_factory, async_scheduling)
    engine, runner = llm.engine, llm.engine.core.runner
    engine.add_request("low", LOW, params(8, priority=10))
    engine.step()
    engine.step()
    failed = fail_once(runner.snapshots, "restore", "simulated host-to-device copy fault")
    engine.add_request("high", HIGH, params(6, priority=-10))
    finals = run_to_end(engine)
    assert len(failed) == 1
    assert finals["low"].finish_reason == "abort"
    assert "restoring the preempted request failed" in finals["low"].error
    assert finals["high"].finish_reason == "length"
    assert finals["high"].token_ids == alone(llm_factory, HIGH, 6)
    assert llm.get_stats().resumptions == 1
    assert_serves_and_forgets(llm, llm_factory)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_failed_shared_bookkeeping_aborts_its_step_and_later_steps_skip_them(
    llm_factory, async_scheduling
):
    """The block-table upload of the step that admits "b" fails: every request of that step
    ("b" and the decoding "a") is aborted. With one step in flight, the next step was already
    scheduled with b's next chunk and a's ticks: the runner skips them instead of failing on
    rows it no longer has. A request admitted afterwards runs normally."""
    llm = llm_factory(max_num_seqs=3, async_scheduling=async_scheduling)
    engine, runner = llm.engine, llm.engine.core.runner
    engine.add_request("a", LOW, params(12))
    engine.step()
    engine.step()

    def admits_b(updates):
        return any(identity.request_id == "b" for identity, _ in updates)

    failed = fail_once(runner.rows, "apply_block_updates", "simulated upload fault", admits_b)
    engine.add_request("b", LONG_LOW, params(4))
    finals = {}
    record(finals, engine.step())  # sync: the failure is applied in this very call
    engine.add_request("c", HIGH, params(6))
    run_to_end(engine, finals)
    assert len(failed) == 1
    for request_id in ("a", "b"):
        assert finals[request_id].finish_reason == "abort"
        assert "simulated upload fault" in finals[request_id].error
    assert finals["c"].finish_reason == "length"
    assert finals["c"].token_ids == alone(llm_factory, HIGH, 6)
    assert_serves_and_forgets(llm, llm_factory)
