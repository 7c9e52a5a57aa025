"""The engine's step log (`EngineCore.step_log`, written by the core process under
`RLT_STEP_LOG`): one record per step that accounts for every prompt token and generated token,
with its host clocks in order."""

from __future__ import annotations

import json

from rlt.engine import EngineConfig, LLMEngine
from rlt.engine.core_process import _write_step_log
from rlt_contracts import SamplingParams
from serving_harness import ENGINE_DEFAULTS


def test_the_step_log_accounts_for_every_token_and_its_clocks_are_ordered(
    tiny_checkpoint, tmp_path
):
    engine = LLMEngine(
        EngineConfig.from_options(model=tiny_checkpoint("l2_t4", seed=2), **ENGINE_DEFAULTS)
    )
    try:
        engine.core.step_log = []
        prompts = {"a": list(range(3, 40)), "b": list(range(50, 61))}
        params = SamplingParams(max_tokens=9, ignore_eos=True, exit_threshold=0.7)
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, params)
        made = 0
        while engine.has_unfinished_requests():
            made += sum(len(o.token_ids) for o in engine.step() if o.finished)
        records = engine.core.step_log
    finally:
        engine.shutdown()
    assert made == 18
    assert sum(r.prefill_tokens for r in records) == sum(len(p) for p in prompts.values())
    assert sum(r.generated for r in records) == 18
    assert [r.step_id for r in records] == sorted(r.step_id for r in records)
    for r in records:
        assert r.scheduled_s <= r.submitted_s <= r.done_s
        assert r.device_s is None and r.device_idle_s is None  # CPU: no device clock
        assert r.decode_rows <= 2 and (r.decode_ticks == 0 or r.decode_rows > 0)
    assert max(r.decode_rows for r in records) == 2  # both requests decoded in one step

    path = tmp_path / "steps.jsonl"
    _write_step_log(records, str(path))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step_id"] for line in lines] == [r.step_id for r in records]
    assert lines[0]["prefill_tokens"] == records[0].prefill_tokens
