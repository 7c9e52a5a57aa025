"""vLLM's sampling extensions end to end (presence / frequency / repetition penalties, logit_bias,
min_tokens, min_p) through `rlt.LLM`, CPU fp32:

- greedy tokens AND exit depths equal a serial float64 reference: the dense oracle's generation
  loop with the rules applied, literally, to each token's logits (its own counting of prompt
  and output tokens), across layouts, scheduling modes and adaptive exit;
- a batch gives each request the tokens it gets alone (random sampling with every feature);
- a penalized request preempted mid-decode (snapshot and restore of its output counts) and a PD
  request activated on the decode side give exactly the tokens of an undisturbed run;
- min_tokens keeps EOS and stop ids from being sampled (finish reasons), logit_bias +100 forces a
  token, out-of-vocabulary logit_bias ids are rejected naming the field;
- the fused Triton commit (interpreter on CPU) counts outputs like the torch tick.
Every engine built by `llm_factory` is checked for KV/row leaks after the test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt import LLM, SamplingParams
from rlt_contracts import InvalidRequestError
from rlt_runner import tick_kernels
from test_pd_engine import loopback, run_pd

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7],
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3, 8, 19],
    [100, 101, 102, 103, 104],
]
EOS = 0
MARGIN = 1e-4


class AdjustedOracle(GenerationOracle):
    """The dense oracle's greedy generation with vLLM's logits adjustments applied to each
    token's float64 logits before the argmax (rules restated here, not imported)."""

    def generate_with(self, request: OracleRequest, params: SamplingParams):
        self.params = params
        self.prompt = set(request.prompt)
        self.stop_ids = set(request.stop_token_ids) | self.eos  # EOS even under ignore_eos
        return self.generate(request)

    def _emit(self, result, logits, depth):
        p, outputs = self.params, result.token_ids
        x = logits.double().clone()
        if len(outputs) < p.min_tokens:
            for token in self.stop_ids:
                x[token] = float("-inf")
        for token, bias in (p.logit_bias or {}).items():
            x[token] += bias
        counts = Counter(outputs)
        for v in self.prompt | set(counts):
            x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
        for v, c in counts.items():
            x[v] -= p.frequency_penalty * c + p.presence_penalty
        super()._emit(result, x, depth)


def oracle_outputs(path, layout, params_list, threshold):
    oracle = AdjustedOracle(DenseOuro(path), layout)
    results = []
    for prompt, p in zip(PROMPTS, params_list, strict=True):
        request = OracleRequest(
            tuple(prompt),
            p.max_tokens,
            # unset: the family's own minimum, 2 for a model with an exit gate (Ouro)
            min_loops=2 if p.min_loops is None else p.min_loops,
            threshold=threshold,
            ignore_eos=p.ignore_eos,
            stop_token_ids=p.stop_token_ids,
        )
        result = oracle.generate_with(request, p)
        assert result.min_logit_margin > MARGIN, "ill-conditioned case"
        assert result.min_gate_margin > MARGIN, "ill-conditioned case"
        results.append(result)
    return results


GREEDY_CASES = {
    "repetition": dict(repetition_penalty=1.6),
    "repetition_below_1": dict(repetition_penalty=0.7),
    "frequency_presence": dict(frequency_penalty=0.8, presence_penalty=0.5),
    "logit_bias": dict(logit_bias={7: 4.0, 130: -3.0, 80: 2.5}),
    "min_tokens": dict(min_tokens=6, logit_bias={EOS: 9.0}, ignore_eos=False),
    "min_tokens_ignore_eos": dict(min_tokens=5, logit_bias={EOS: 9.0}),  # EOS masked anyway
    "combined": dict(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=-0.3,
        logit_bias={12: 3.0, EOS: 6.0},
        min_tokens=4,
        stop_token_ids=(44,),
        ignore_eos=False,
    ),
}


def greedy_params(case: str, threshold: float) -> list[SamplingParams]:
    options = {"ignore_eos": True, **GREEDY_CASES[case]}
    return [
        SamplingParams(max_tokens=8 + i, exit_threshold=threshold, **options)
        for i in range(len(PROMPTS))
    ]


def check_against_oracle(llm, path, layout, case, threshold):
    params_list = greedy_params(case, threshold)
    outputs = llm.generate(PROMPTS, params_list)
    expected = oracle_outputs(path, layout, params_list, threshold)
    for output, reference in zip(outputs, expected, strict=True):
        assert output.token_ids == reference.token_ids
        assert output.exit_depths == reference.exit_depths
        assert output.finish_reason == reference.finish_reason
    return outputs


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_adjustments_match_the_serial_reference(llm_factory, tiny_checkpoint, case):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    outputs = check_against_oracle(llm_factory(), path, "last_exited", case, 0.8)
    if case == "min_tokens":  # EOS is favoured by the bias, so it comes right at min_tokens
        assert [o.finish_reason for o in outputs] == ["stop"] * 4
        assert [len(o.token_ids) for o in outputs] == [7] * 4


@pytest.mark.parametrize(
    ("options", "layout"),
    [
        (dict(kv_layout="shared"), "shared"),
        (dict(scheduling_mode="no_refill"), "last_exited"),
        (dict(decode_ticks_per_step=1, async_scheduling=False), "last_exited"),
    ],
    ids=["shared", "no_refill", "single_ticks"],
)
def test_combined_adjustments_match_the_reference_in_every_mode(
    llm_factory, tiny_checkpoint, options, layout
):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    check_against_oracle(llm_factory(**options), path, layout, "combined", 0.55)


def test_repetition_penalty_changes_greedy_tokens_where_a_token_repeats(llm_factory):
    llm = llm_factory()
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    penalized = llm.generate(
        PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.5)
    )
    changed = 0
    for prompt, a, b in zip(PROMPTS, plain, penalized, strict=True):
        first = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
            None,
        )
        if first is None:
            continue
        changed += 1
        # the unpenalized choice there repeats a prompt or earlier output token
        assert a.token_ids[first] in set(prompt) | set(a.token_ids[:first])
    assert changed >= 2

    # fewer repeats overall: the penalty works against what it penalizes
    def repeats(outputs):
        return sum(len(o.token_ids) - len(set(o.token_ids)) for o in outputs)

    assert repeats(penalized) < repeats(plain)


RANDOM_PARAMS = [
    SamplingParams(
        max_tokens=10,
        temperature=0.9,
        seed=11,
        repetition_penalty=1.4,
        min_p=0.05,
        exit_threshold=0.7,
        ignore_eos=True,
    ),
    SamplingParams(
        max_tokens=9,
        temperature=1.2,
        seed=12,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        top_k=40,
        logit_bias={5: 3.0},
        min_tokens=5,
    ),
    SamplingParams(max_tokens=8, seed=13, min_tokens=3, stop_token_ids=(9,), logit_bias={9: 50.0}),
    SamplingParams(max_tokens=11, temperature=0.7, seed=14, min_p=0.2, top_p=0.9, ignore_eos=True),
]


def test_a_batch_gives_each_request_its_serial_tokens(llm_factory):
    batched = llm_factory().generate(PROMPTS, RANDOM_PARAMS)
    serial_llm = llm_factory(max_num_seqs=1)
    for prompt, params, together in zip(PROMPTS, RANDOM_PARAMS, batched, strict=True):
        [alone] = serial_llm.generate([prompt], params)
        assert (together.token_ids, together.exit_depths, together.finish_reason) == (
            alone.token_ids,
            alone.exit_depths,
            alone.finish_reason,
        )
    # request 2: the +50 biased stop id is held back for 3 tokens, then ends it
    assert batched[2].token_ids[3] == 9 and batched[2].finish_reason == "stop"
    assert 9 not in batched[2].token_ids[:3] and len(batched[2].token_ids) == 4


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_preempted_penalized_request_continues_exactly(llm_factory, async_scheduling):
    """The victim's output counts go through a host snapshot; its prompt mask, bias and stop
    mask are rewritten at re-activation. Tokens equal the undisturbed run's."""
    # Greedy with strong penalties: without the restored counts the tokens differ (checked by
    # disabling the snapshot of the counts: the victim then repeats 17 and 287 after resuming).
    low = SamplingParams(
        max_tokens=14,
        repetition_penalty=2.0,
        frequency_penalty=2.0,
        presence_penalty=0.5,
        logit_bias={EOS: 8.0, 17: 2.0},
        min_tokens=10,
        priority=10,
    )
    high = SamplingParams(max_tokens=6, ignore_eos=True, frequency_penalty=0.3, priority=-10)
    undisturbed = llm_factory().generate([PROMPTS[0]], low)[0]
    llm = llm_factory(
        scheduling_policy="priority",
        enable_preemption=True,
        max_num_seqs=1,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    engine.add_request("low", PROMPTS[0], low)
    for _ in range(4):  # prefill, then a few decode steps
        engine.step()
    engine.add_request("high", PROMPTS[1], high)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    stats = llm.get_stats()
    assert stats.preemptions >= 1 and stats.resumptions >= 1
    assert finals["low"].token_ids == undisturbed.token_ids
    assert finals["low"].finish_reason == undisturbed.finish_reason
    assert len(undisturbed.token_ids) >= 10  # min_tokens held the favoured EOS back
    assert finals["high"].token_ids == llm_factory().generate([PROMPTS[1]], high)[0].token_ids


def test_pd_decode_side_applies_the_whole_prompt_and_counts(llm_factory):
    """PD: the decode instance activates the row from the whole prompt (no chunk ran there)."""
    params = [
        SamplingParams(max_tokens=9, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, seed=5, frequency_penalty=1.2, min_p=0.1),
        SamplingParams(max_tokens=7, logit_bias={EOS: 20.0}, min_tokens=5),
        SamplingParams(max_tokens=10, presence_penalty=1.5, exit_threshold=0.7, ignore_eos=True),
    ]
    expected = [(o.token_ids, o.exit_depths) for o in llm_factory().generate(PROMPTS, params)]
    prefill, decode, _ = loopback(llm_factory)
    finals = run_pd(prefill, decode, PROMPTS, params)
    got = [(finals[f"r{i}"].token_ids, finals[f"r{i}"].exit_depths) for i in range(len(PROMPTS))]
    assert got == expected
    prefill_logits = prefill.engine.core.runner.rows.logits_state  # it never samples: none
    assert prefill_logits.output_counts is None and prefill_logits.bias_token_ids is None
    assert decode.engine.core.runner.rows.logits_state.output_counts is not None


def test_min_tokens_holds_back_eos_and_stop_ids(llm_factory):
    llm = llm_factory()
    forced_eos = dict(logit_bias={EOS: 100.0})
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, **forced_eos))
    assert [(o.token_ids, o.finish_reason) for o in out] == [([EOS], "stop")] * 2
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, min_tokens=4, **forced_eos))
    for o in out:
        assert EOS not in o.token_ids[:4] and o.token_ids[4] == EOS
        assert (len(o.token_ids), o.finish_reason) == (5, "stop")
    stop_id = dict(logit_bias={77: 100.0}, stop_token_ids=(77,), temperature=1.0, seed=3)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, min_tokens=6, **stop_id))
    assert [(len(o.token_ids), o.token_ids[-1], o.finish_reason) for o in out] == [
        (7, 77, "stop")
    ] * 2
    # ignore_eos: EOS is no stop, but min_tokens still masks it (vLLM masks all_stop_token_ids,
    # which always hold EOS); afterwards the forced EOS repeats until max_tokens
    out = llm.generate(
        PROMPTS[:1], SamplingParams(max_tokens=5, min_tokens=2, ignore_eos=True, **forced_eos)
    )
    assert EOS not in out[0].token_ids[:2]
    assert (out[0].token_ids[2:], out[0].finish_reason) == ([EOS] * 3, "length")


def test_logit_bias_of_100_forces_a_token(llm_factory):
    llm = llm_factory()
    for params in (
        SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={33: 100.0}),
        SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={33: 100.0}, temperature=1.5),
    ):
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [[33] * 6] * 4


def test_out_of_vocabulary_logit_bias_is_rejected(llm_factory):
    llm = llm_factory()
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={320: 1.0}))
    assert info.value.field == "logit_bias"


def test_only_features_in_use_allocate_device_state(llm_factory):
    llm = llm_factory()
    state = llm.engine.core.runner.rows.logits_state
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, min_p=0.5, temperature=1.0))
    assert state.output_counts is None and state.bias_token_ids is None and state.stop_mask is None
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, logit_bias={3: 1.0}))
    assert state.bias_token_ids is not None and state.output_counts is None
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, presence_penalty=0.5))
    assert tuple(state.output_counts.shape) == (4, 320) and state.output_counts.dtype == torch.int32
    assert state.stop_mask is None


@pytest.mark.skipif(not tick_kernels.available(), reason="triton is not installed")
def test_fused_commit_counts_outputs_like_the_torch_tick(tiny_checkpoint):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    params = [RANDOM_PARAMS[0], RANDOM_PARAMS[1], GREEDY_CASES_PARAMS, RANDOM_PARAMS[3]]

    def run(fused: bool):
        llm = LLM(
            path,
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=256,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            prefill_chunk_size=5,
            cuda_graphs=False,
        )
        program = llm.engine.core.runner.program
        program.kernels = tick_kernels.TickKernels(program) if fused else None
        outputs = llm.generate(PROMPTS, params)
        counts = llm.engine.core.runner.rows.logits_state.output_counts.clone()
        assert llm.engine.core.leak_report() == []
        llm.shutdown()
        return [(o.token_ids, o.exit_depths, o.finish_reason) for o in outputs], counts

    reference, reference_counts = run(False)
    fused, fused_counts = run(True)
    assert fused == reference
    assert torch.equal(fused_counts, reference_counts)
    # the counts of the row that held request 0 (row 0) are its outputs, exactly
    expected = torch.zeros(320, dtype=torch.int32)
    for token in reference[0][0]:
        expected[token] += 1
    assert torch.equal(reference_counts[0], expected)


GREEDY_CASES_PARAMS = SamplingParams(
    max_tokens=9, repetition_penalty=1.3, presence_penalty=0.4, exit_threshold=0.55, ignore_eos=True
)


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 5])
def test_min_tokens_defers_stop_strings_through_the_engine(llm_factory, min_tokens):
    """Stop strings in the text of the first min_tokens tokens do not count (vLLM's rule); the
    expectation is computed from the undisturbed text and its decoded prefixes."""
    llm = llm_factory()
    tokenizer = llm.engine.tokenizer
    free = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = free.text[:2]  # " s" here: tokens 0 and 1 both write it, so min_tokens 0 / 1 / 2
    assert stop and stop in tokenizer.decode(free.token_ids[:1])  # stop at 0 / 2 / not at all
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,), min_tokens=min_tokens)
    out = llm.generate(PROMPTS[:1], params)[0]
    floor = len(tokenizer.decode(free.token_ids[:min_tokens])) if min_tokens else 0
    start = free.text.find(stop, max(floor - len(stop) + 1, 0))
    if start < 0:
        assert (out.text, out.finish_reason) == (free.text, "length")
    else:
        assert (out.text, out.finish_reason) == (free.text[:start], "stop")


def test_the_min_tokens_mask_leaves_the_mode_once_every_row_passed_it(llm_factory):
    """Host knowledge only: once the reported outputs reach min_tokens (the device is never
    behind them), steps run without the mask; the tokens are those of the masked rule."""
    llm = llm_factory(decode_ticks_per_step=1, async_scheduling=False)
    program = llm.engine.core.runner.program
    masked = []
    tick = program.tick

    def spy(num_rows, mode, gate, max_context=None):
        masked.append(mode.min_tokens)
        return tick(num_rows, mode, gate, max_context)

    program.tick = spy
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(77,), logit_bias={77: 5.0})
    out = llm.generate(PROMPTS[:1], params)[0]
    assert masked[0] and not masked[-1] and masked == sorted(masked, reverse=True)
    assert 77 not in out.token_ids[:3] and out.token_ids[-1] == 77 and out.finish_reason == "stop"


# -- CUDA (skipped without a GPU; passed on an H200 on 2026-12-01) --------------------------------


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.cuda
@pytest.mark.parametrize("fast", [True, False], ids=["fused+graphs", "eager"])
def test_cuda_adjustments_match_the_serial_reference(llm_factory, tiny_checkpoint, no_tf32, fast):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    llm = llm_factory(device="cuda", cuda_graphs=fast, fused_kernels=fast)
    check_against_oracle(llm, path, "last_exited", "combined", 0.8)
    if fast:
        assert llm.engine.core.runner.graphs.replays > 0


@pytest.mark.cuda
def test_cuda_steps_with_every_extension_make_no_host_sync(llm_factory):
    """Warm up (lazy allocation, graph capture of each mode), then the same traffic under
    CUDA's sync debug mode: penalties, bias, min_tokens, min_p (and preemption snapshots of
    counts when the small pool runs short)."""
    llm = llm_factory(
        device="cuda",
        scheduling_policy="priority",
        enable_preemption=True,
        max_num_seqs=2,
        num_kv_blocks=40,
        incremental_kv=True,
    )

    def traffic():
        return [o.token_ids for o in llm.generate(PROMPTS, RANDOM_PARAMS)]

    first = traffic()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = traffic()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert again == first
