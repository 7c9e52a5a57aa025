"""Engine-feature checks shared by the per-family feature tests (test_family_*_features.py):
an engine cache for a test module, PD runs through the loopback port or NIXL, and
cancellation with no KV leak. They compare an engine with another engine or a reference the
caller passes; nothing here knows a family."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from pd_loopback import LoopbackPair
from rlt import LLM, SamplingParams
from test_pd_engine import connect_nixl, loopback, run_pd


def tokens_and_depths(outputs) -> list[tuple[list[int], list[int]]]:
    return [(o.token_ids, o.exit_depths) for o in outputs]


@contextmanager
def engine_cache(checkpoint: Path, base: dict, *, reuse: bool = True):
    """`get(**options)`: with `reuse`, one engine per option set for a whole test module (tiny
    engines are cheap to step but not to build hundreds of times); without, a fresh engine
    per call (a PD pair's engines hold the pair's state). At the end every engine must hold
    no KV block and no row (`leak_report`); all are shut down."""
    engines: dict[object, LLM] = {}

    def get(**options) -> LLM:
        key = tuple(sorted((k, repr(v)) for k, v in options.items())) if reuse else len(engines)
        if key not in engines:
            engines[key] = LLM(checkpoint, **{**base, **options})
        return engines[key]

    try:
        yield get
    finally:
        leaks = {key: llm.engine.core.leak_report() for key, llm in engines.items()}
        for llm in engines.values():
            llm.shutdown()
        assert all(report == [] for report in leaks.values()), leaks


def pd_outputs(
    make: Callable[..., LLM], prompts, params: list[SamplingParams], *, nixl: bool, **options
) -> tuple[list, LoopbackPair | None, tuple[LLM, LLM]]:
    """Every request through a fresh prefill/decode pair (the loopback port, or NIXL over UCX
    in host memory): D's finished outputs in order, the pair (loopback: positions written per
    transfer) and the two engines."""
    if nixl:
        prefill = make(pd_role="prefill", **options)
        decode = make(pd_role="decode", **options)
        agent, pair = connect_nixl(prefill, decode), None
    else:
        prefill, decode, pair = loopback(make, **options)
        agent = "P"
    finals = run_pd(prefill, decode, prompts, params, prefill_agent=agent)
    outputs = [finals[f"r{i}"] for i in range(len(prompts))]
    return outputs, pair, (prefill, decode)


def abort_then_reuse_the_id(llm: LLM, prompts, params: list[SamplingParams]) -> dict:
    """Add every request; after the first step abort r1 (waiting, or mid-prompt), and abort
    r0 once it has decoded a token; finish the rest; meanwhile r0's id is given to a new
    request. Returns the finished outputs by id (the aborted r0 as "r0-aborted"); the pool
    is empty at the end and the runner holds no row (no KV leak)."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    decoded = any(o.request_id == "r0" and o.token_ids for o in engine.step())
    finals = {"r1": engine.abort_request("r1")}
    while not decoded:
        decoded = any(o.request_id == "r0" and o.token_ids for o in engine.step())
    finals["r0-aborted"] = engine.abort_request("r0")
    engine.add_request("r0", prompts[0], params[0])  # the same id names a new request
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.get_stats().kv_blocks_used == 0
    assert engine.core.leak_report() == []
    return finals
