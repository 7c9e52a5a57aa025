"""`CoreLoop`, the core's side of the front-end boundary, driven directly (no transport): replies
and deltas go to the front end that added each request; a front end that is gone has its
requests aborted and its KV freed; a request aborted while its grammar compiles still ends
with a final delta; statistics reach every front end."""

from __future__ import annotations

import time

import pytest
from rlt.engine import EngineConfig, LLMEngine
from rlt.engine.core_loop import CoreLoop
from rlt_contracts import (
    CoreAbort,
    CoreAdd,
    CoreClientGone,
    EngineRequest,
    FinishReason,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
)

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture
def engine(tiny_checkpoint):
    config = EngineConfig.from_options(
        model=tiny_checkpoint("l2_t4", seed=3, gate_std=0.3),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=256,
    )
    with LLMEngine(config) as engine:
        yield engine


def run(loop: CoreLoop, rounds: int, received: dict) -> None:
    """`rounds` loop iterations, collecting what each front end receives."""
    for _ in range(rounds):
        loop.step()
        for client, outputs in loop.take_outputs().items():
            received.setdefault(client, []).append(outputs)


def deltas_of(received: dict, client: str) -> list:
    return [d for outputs in received.get(client, []) for d in outputs.deltas]


def test_a_gone_front_end_has_its_requests_aborted_and_the_other_is_untouched(engine):
    loop = CoreLoop(engine.core)
    received: dict = {}
    loop.handle("fe0", CoreAdd(1, (EngineRequest("a", (5, 6, 7), LONG),)))
    loop.handle("fe1", CoreAdd(2, (EngineRequest("b", (8, 9), SamplingParams(max_tokens=6)),)))
    run(loop, 3, received)
    assert [r.call_id for o in received["fe0"] for r in o.replies] == [1]
    assert [r.call_id for o in received["fe1"] for r in o.replies] == [2]
    assert {d.request_id for d in deltas_of(received, "fe0")} == {"a"}
    assert {d.request_id for d in deltas_of(received, "fe1")} == {"b"}

    loop.handle("fe0", CoreClientGone("fe0"))
    run(loop, 1, received)
    assert engine.core.stats().aborted_requests == 1
    assert "a" not in engine.core.scheduler.running_request_ids()
    before = len(received["fe0"])
    while engine.core.has_unfinished_requests():
        run(loop, 1, received)
    assert len(received["fe0"]) == before  # nothing goes to a front end that is gone
    [final] = [d for d in deltas_of(received, "fe1") if d.finished]
    assert final.finish_reason is FinishReason.LENGTH and final.request_id == "b"
    assert received["fe1"][-1].stats.kv_blocks_used == 0
    assert engine.core.leak_report() == []


def test_a_request_aborted_while_its_grammar_compiles_still_ends(engine):
    loop = CoreLoop(engine.core, constraint_compiler=engine.parts.constraint_compiler)
    received: dict = {}
    grammar = SamplingParams(
        max_tokens=8, structured_output=StructuredOutput(kind=StructuredOutputKind.JSON_OBJECT)
    )
    loop.handle("fe0", CoreAdd(7, (EngineRequest("g", (5, 6), grammar),)))
    loop.handle("fe0", CoreAbort(("g",)))
    deadline = time.monotonic() + 30
    while not any(d.finished for d in deltas_of(received, "fe0")):
        assert time.monotonic() < deadline
        run(loop, 1, received)
        time.sleep(0.005)
    [reply] = [r for o in received["fe0"] for r in o.replies]
    assert reply.call_id == 7 and reply.error is None
    [final] = [d for d in deltas_of(received, "fe0") if d.finished]
    assert final.finish_reason is FinishReason.ABORT
    assert engine.core.leak_report() == []


def test_a_refused_add_is_answered_with_its_typed_error(engine):
    loop = CoreLoop(engine.core)
    received: dict = {}
    loop.handle("fe0", CoreAdd(3, (EngineRequest("x", (5, 99_999), SamplingParams()),)))
    run(loop, 1, received)
    [reply] = [r for o in received["fe0"] for r in o.replies]
    assert reply.error.kind == "InvalidRequestError" and reply.error.field == "prompt"
    assert not engine.core.has_unfinished_requests()
