"""Engine invariants users rely on: batching, scheduling modes and chunking never change
results; seeded sampling is reproducible and batch-independent; aborts free everything and an
id reused afterwards never sees old results; bad input is rejected and the engine keeps going."""

from __future__ import annotations

import pytest
from rlt import SamplingParams
from rlt_contracts import CapacityError, ConfigurationError, InvalidRequestError

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7],
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3, 8, 19],
    [7],
    [100, 101, 102, 103, 104],
]


def run(llm, prompts, params):
    return [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, params)]


def sampled_params(n: int):
    return [
        SamplingParams(
            max_tokens=8,
            temperature=0.9,
            top_p=0.9,
            top_k=50,
            seed=100 + i,
            exit_threshold=0.6,
            ignore_eos=True,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_batched_equals_serial_for_greedy_and_seeded_sampling(llm_factory, layout):
    llm = llm_factory(kv_layout=layout)
    params = sampled_params(len(PROMPTS))
    params[0] = SamplingParams(max_tokens=8, exit_threshold=0.6, ignore_eos=True)  # greedy row
    batched = run(llm, PROMPTS, params)
    serial = [run(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, params, strict=True)]
    assert batched == serial
    reversed_batch = run(llm, PROMPTS[::-1], params[::-1])[::-1]
    assert reversed_batch == batched


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_refill_equals_no_refill(llm_factory, layout):
    params = sampled_params(len(PROMPTS))
    refill = run(llm_factory(kv_layout=layout, scheduling_mode="refill"), PROMPTS, params)
    no_refill = run(llm_factory(kv_layout=layout, scheduling_mode="no_refill"), PROMPTS, params)
    assert refill == no_refill


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_chunked_prefill_of_any_size_equals_unchunked(llm_factory, layout):
    params = SamplingParams(max_tokens=6, exit_threshold=0.6, ignore_eos=True)
    results = [
        run(
            llm_factory(kv_layout=layout, prefill_chunk_size=chunk, max_num_batched_tokens=budget),
            PROMPTS,
            params,
        )
        for chunk, budget in ((1, 8), (3, 16), (64, 128))
    ]
    assert results[0] == results[1] == results[2]


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm_factory):
    llm = llm_factory()
    params = sampled_params(3)
    first = run(llm, PROMPTS[:3], params)
    assert run(llm, PROMPTS[:3], params) == first
    other_seeds = [SamplingParams(**{**_fields(p), "seed": p.seed + 1000}) for p in params]
    assert run(llm, PROMPTS[:3], other_seeds) != first


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_abort_mid_flight_frees_blocks_and_reused_id_starts_clean(llm_factory):
    llm = llm_factory()
    engine = llm.engine
    params = SamplingParams(max_tokens=30, exit_threshold=0.6, ignore_eos=True)
    engine.add_request("req", PROMPTS[2], params)
    engine.add_request("other", PROMPTS[0], params)
    for _ in range(6):
        engine.step()
    assert engine.get_stats().kv_blocks_used > 0
    aborted = engine.abort_request("req")
    assert aborted.finished and aborted.finish_reason == "abort" and aborted.token_ids
    assert engine.abort_request("req") is None  # already gone
    # the same id now names a new request: it must see none of the old tokens
    fresh = SamplingParams(max_tokens=4, exit_threshold=0.6, ignore_eos=True)
    engine.add_request("req", PROMPTS[1], fresh)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    reference = llm_factory().generate([PROMPTS[1]], fresh)[0]
    assert finals["req"].token_ids == reference.token_ids
    assert finals["req"].exit_depths == reference.exit_depths
    assert finals["req"].prompt_token_ids == PROMPTS[1]
    assert engine.get_stats().kv_blocks_used == 0


def test_abort_while_waiting_and_during_prefill(llm_factory):
    llm = llm_factory(max_num_seqs=1, prefill_chunk_size=2)
    engine = llm.engine
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("long", PROMPTS[2], params)
    engine.add_request("queued", PROMPTS[0], params)
    engine.step()  # "long" is mid-prefill, "queued" waits
    assert engine.abort_request("queued").finish_reason == "abort"
    assert engine.abort_request("long").finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize(
    ("prompt", "kwargs", "error", "field"),
    [
        ([], {}, InvalidRequestError, "prompt"),
        ("", {}, InvalidRequestError, "prompt"),
        ([1, 99999], {}, InvalidRequestError, "prompt"),
        ([1, -2], {}, InvalidRequestError, "prompt"),
        ([1, 2], {"max_tokens": 600}, CapacityError, "max_tokens"),  # context 512
        ([1, 2], {"max_loops": 9}, InvalidRequestError, "max_loops"),
        ([1, 2], {"min_loops": 5}, InvalidRequestError, "min_loops"),
    ],
)
def test_bad_requests_raise_typed_errors_and_engine_keeps_serving(
    llm_factory, prompt, kwargs, error, field
):
    llm = llm_factory()
    with pytest.raises(error) as info:
        llm.engine.add_request("bad", prompt, SamplingParams(**kwargs))
    assert info.value.field == field
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_duplicate_running_id_and_oversized_kv_demand(llm_factory):
    llm = llm_factory(num_kv_blocks=8)  # 8 blocks x 4 tokens / 4 planes = 8 positions
    llm.engine.add_request("a", [1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError, match="already running"):
        llm.engine.add_request("a", [1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(CapacityError, match="KV blocks"):
        llm.engine.add_request("b", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=10))
    llm.engine.abort_request("a")


def test_unknown_and_invalid_engine_options(tiny_checkpoint):
    from rlt import LLM

    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    with pytest.raises(ConfigurationError) as info:
        LLM(path, device="cpu", kv_layuot="shared")
    assert info.value.options == ("kv_layuot",)
    with pytest.raises(ConfigurationError, match="kv_layout"):
        LLM(path, device="cpu", kv_layout="diagonal")
    with pytest.raises(ConfigurationError, match="max_num_batched_tokens"):
        LLM(path, device="cpu", max_num_seqs=16, max_num_batched_tokens=16)
    with pytest.raises(ConfigurationError, match="attention_backend"):
        LLM(path, device="cpu", attention_backend="triton")
    with pytest.raises(ConfigurationError, match="model"):
        LLM(path / "missing", device="cpu")


def test_batch_sizes_default_by_device_type():
    """Unset batch sizes follow the device: CPU-sized on the CPU, the H200-measured sizes on
    CUDA; a default chunk never exceeds a given token budget; given values are kept."""
    from rlt.engine import EngineConfig

    def sizes(config):
        batch = config.scheduler
        return batch.max_num_seqs, batch.max_num_batched_tokens, batch.prefill_chunk_size

    assert sizes(EngineConfig.from_options(device="cpu")) == (8, 128, 128)
    assert sizes(EngineConfig.from_options(device="cuda:1")) == (128, 4096, 1024)
    assert sizes(EngineConfig.from_options(device="cuda", max_num_batched_tokens=512)) == (
        128,
        512,
        512,
    )
    assert sizes(
        EngineConfig.from_options(device="cpu", max_num_seqs=4, prefill_chunk_size=32)
    ) == (4, 128, 32)
    with pytest.raises(ConfigurationError, match="max_num_batched_tokens"):
        EngineConfig.from_options(
            device="cpu", max_num_seqs=200
        )  # 200 rows > the CPU budget of 128


def test_stop_token_ids_eos_and_ignore_eos(llm_factory):
    llm = llm_factory()
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    cut = free.token_ids.index(stop_at)
    stopped = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=8, stop_token_ids=(stop_at,), ignore_eos=True)
    )[0]
    assert stopped.token_ids == free.token_ids[: cut + 1] and stopped.finish_reason == "stop"
    # the model's EOS (id 0) ends a request unless ignore_eos; a forced EOS via stop ids shows the
    # same path: generation halts right after the stop token
    assert (
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0].finish_reason
        == "length"
    )


def test_stop_strings_truncate_text(llm_factory):
    llm = llm_factory()
    free = llm.generate(["The river"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert free.text
    needle = free.text[len(free.text) // 2 :][:2]
    out = llm.generate(
        ["The river"], SamplingParams(max_tokens=12, ignore_eos=True, stop=(needle,))
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(needle)]
    assert needle not in out.text


def test_logprobs_match_chosen_tokens(llm_factory):
    llm = llm_factory()
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs) == 5
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert logprob <= 0.0 and len(top) == 3
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob)  # greedy = most likely
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_text_prompts_and_exit_depth_bookkeeping(llm_factory):
    llm = llm_factory()
    out = llm.generate(
        ["It is a truth universally acknowledged", "The river"],
        SamplingParams(max_tokens=6, exit_threshold=0.6, ignore_eos=True),
    )
    assert [len(o.exit_depths) for o in out] == [6, 6]
    assert all(o.exit_depths[0] == 4 and 2 <= min(o.exit_depths) for o in out)
    assert (
        out[0].prompt_token_ids
        == llm.tokenizer(
            "It is a truth universally acknowledged", add_special_tokens=False
        ).input_ids
    )
    stats = llm.get_stats()
    assert stats.generation_tokens >= 12 and stats.decode_loops > 0


def test_execution_failure_aborts_its_requests_and_engine_recovers(llm_factory, monkeypatch):
    llm = llm_factory()
    runner = llm.engine.core.runner
    original = runner.model.recurrent_step
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated device fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner.model, "recurrent_step", flaky)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    assert any(o.finish_reason == "abort" and "simulated device fault" in o.error for o in outs)
    assert llm.get_stats().kv_blocks_used == 0
    again = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(o.finish_reason == "length" for o in again)
