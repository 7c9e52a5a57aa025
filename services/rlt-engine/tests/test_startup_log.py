"""Start-up you can watch (issue 23): building an engine logs one line per phase with its
seconds (weights, fp8 KV scales when asked, the runner or graph capture, the KV pool with its
blocks, tokens and how many full-length requests fit), then the ready line."""

from __future__ import annotations

import logging
import re

from rlt import LLM


def test_engine_start_logs_each_phase_with_its_seconds(tiny_checkpoint, caplog):
    checkpoint = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    with caplog.at_level(logging.INFO):
        llm = LLM(checkpoint, device="cpu", dtype="float32", kv_cache_dtype="fp8", max_model_len=64)
        llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]
    timed = re.compile(r"^start-up: (.+?)(: .*)? in \d+\.\d s$")
    phases = [timed.match(line).group(1) for line in lines if timed.match(line)]
    assert phases == ["weights", "fp8 KV scales", "runner", "engine ready"]
    (pool,) = [line for line in lines if line.startswith("start-up: KV pool:")]
    assert "float8_e4m3fn" in pool and "tokens" in pool and "max_model_len 64 fit" in pool
    # K and V of every layer of every plane of one position, one byte each in fp8
    per_token = 4 * 2 * 2 * 2 * 16  # l2_t4: 4 loop planes x 2 layers x (K, V) x 2 heads x 16
    assert f"GiB, {per_token:,} bytes per token)" in pool
    assert lines[-1].startswith("start-up: engine ready in")
