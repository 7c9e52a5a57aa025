"""Structured output under prefill/decode disaggregation (in-process P and D engines joined by
the loopback transport of test_pd_engine.py): the grammar reaches the decode side. The rest of
structured output is rlt-engine's (services/rlt-engine/tests/test_structured_output.py, whose
requests this file reuses)."""

from __future__ import annotations

import re

from rlt import SamplingParams
from rlt_contracts import StructuredOutput
from test_pd_engine import loopback, reference, run_pd
from test_structured_output import CHOICES, REGEX, free_params, regex_params


def test_prefill_decode_disaggregation_carries_the_grammar_to_the_decode_side(llm_factory):
    """P computes the prompt only (no matcher there); D samples token 0 under the first mask
    at its remote start, then one token per mask: the output equals a single engine's."""
    prompts = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9]]
    spec = StructuredOutput(kind="choice", choices=tuple(CHOICES))
    all_params = [
        regex_params(),
        SamplingParams(max_tokens=16, structured_output=spec, temperature=0.8, seed=3),
        free_params(),
    ]
    expected = reference(llm_factory, prompts, all_params)
    prefill, decode, _ = loopback(llm_factory)
    finals = run_pd(prefill, decode, prompts, all_params)
    got = [(finals[f"r{i}"].token_ids, finals[f"r{i}"].exit_depths) for i in range(3)]
    assert got == expected
    assert re.fullmatch(REGEX, finals["r0"].text)
    assert finals["r1"].text in CHOICES
