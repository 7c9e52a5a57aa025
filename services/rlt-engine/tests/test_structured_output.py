"""Structured output end to end: response_format / guided_* / structured_outputs over HTTP (raw
and with the `openai` client) and through `LLM`, on tiny random checkpoints.

A random model writes garbage, so output that parses and validates, matches the regex or is one
of the choices shows the token masks really constrain sampling (greedy and random rows). Also:
free requests batched with constrained ones decode as they do alone, a constrained request
preempted and resumed ends exactly as when it ran alone (its matcher consumed exactly its
outputs), invalid grammars are 400s naming their field, and no KV block leaks (the harness and
`llm_factory` check every engine at the end). Under prefill/decode disaggregation: the root
tests/test_pd_structured_output.py.
"""

from __future__ import annotations

import json
import re

import pytest
from rlt import SamplingParams
from rlt_contracts import StructuredOutput
from serving_harness import run_server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "owl"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,4}-\d{2,3}"
CHOICES = ["yes", "no", "it depends"]
MAX_TOKENS = 120  # byte-level tokens of the tiny vocabulary: a full SCHEMA object fits


def assert_valid(document) -> None:
    """SCHEMA, checked by hand (no jsonschema in the lock)."""
    assert isinstance(document, dict) and set(document) == {"name", "age", "pet", "tags"}
    assert isinstance(document["name"], str) and 1 <= len(document["name"]) <= 6
    age = document["age"]
    assert isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 99
    assert document["pet"] in ("cat", "dog", "owl")
    tags = document["tags"]
    assert isinstance(tags, list) and len(tags) <= 3 and all(isinstance(t, bool) for t in tags)


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.openai(timeout=60)


MESSAGES = [{"role": "user", "content": "Describe a person."}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_output_validates(http, temperature):
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": temperature,
        "seed": 5,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        },
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # the grammar completed
    assert_valid(json.loads(choice["message"]["content"]))


def test_openai_client_json_schema_choice_regex_and_structured_outputs(client):
    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert_valid(json.loads(chat.choices[0].message.content))

    for seed in range(3):
        picked = client.completions.create(
            model="tiny",
            prompt="Shall we?",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": CHOICES},
        )
        assert picked.choices[0].text in CHOICES
        assert picked.choices[0].finish_reason == "stop"

    several = client.completions.create(
        model="tiny",
        prompt="Shall we?",
        max_tokens=16,
        temperature=1.0,
        seed=1,
        n=3,
        extra_body={"guided_choice": CHOICES},
    )
    assert len(several.choices) == 3
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in several.choices)

    matched = client.completions.create(
        model="tiny",
        prompt="Code:",
        max_tokens=16,
        temperature=0,
        extra_body={"guided_regex": REGEX},
    )
    assert re.fullmatch(REGEX, matched.choices[0].text)

    newer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    assert re.fullmatch(REGEX, newer.choices[0].message.content)


def test_guided_json_on_completions_streams_valid_json(http):
    body = {
        "model": "tiny",
        "prompt": "Person:",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "guided_json": SCHEMA,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        text, reasons = "", []
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reasons.append(choice["finish_reason"])
    assert reasons[-1] == "stop"
    assert_valid(json.loads(text))


def test_json_object_output_parses(http):
    # a random model may wander inside an unconstrained string; every prompt that completes
    # (finish "stop") must parse as an object, and these seeds do complete
    done = 0
    for seed in range(4):
        body = {
            "model": "tiny",
            "messages": MESSAGES,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "seed": seed,
            "response_format": {"type": "json_object"},
        }
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        content = choice["message"]["content"]
        assert content.startswith("{")
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(content), dict)
            done += 1
    assert done >= 1


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("guided_regex", {"guided_regex": "(unclosed"}),
        (
            "response_format.json_schema.schema",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
        ),
        ("guided_json", {"guided_json": "{not json"}),
        ("guided_choice", {"guided_choice": []}),
        ("guided_regex", {"guided_json": {"type": "object"}, "guided_regex": "a+"}),
        ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
        ("response_format.json_schema", {"response_format": {"type": "json_schema"}}),
    ],
)
def test_invalid_grammars_are_400s_naming_the_field(server, http, field, body):
    response = http.post(
        "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4, **body}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    server.wait_idle()


# -- engine level -------------------------------------------------------------------------------
def regex_params(**kwargs) -> SamplingParams:
    spec = StructuredOutput(kind="regex", regex=REGEX)
    return SamplingParams(max_tokens=16, structured_output=spec, **kwargs)


def free_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=0.8, **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_free_requests_batched_with_constrained_ones_decode_as_alone(llm_factory, async_scheduling):
    llm = llm_factory(async_scheduling=async_scheduling)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = [free_params(), regex_params(), free_params(temperature=0.9, seed=4), regex_params()]
    together = llm.generate(prompts, params)
    for prompt, param, out in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], param)[0]
        assert out.token_ids == alone.token_ids
        assert out.exit_depths == alone.exit_depths
        if param.structured_output is not None:
            assert re.fullmatch(REGEX, out.text) and out.finish_reason == "stop"

    # step by step: a constrained request gains at most one token per step (and, pipelined,
    # none in the step after: that step was scheduled before its token was read back), while
    # the free ones gain several
    engine = llm.engine
    for i, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, param)
    counts: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            counts[output.request_id].append(len(output.token_ids))
    for request_id in ("r1", "r3"):
        gains = [b - a for a, b in zip([0, *counts[request_id]], counts[request_id], strict=False)]
        assert max(gains) == 1
    assert max(b - a for a, b in zip([0, *counts["r0"]], counts["r0"], strict=False)) > 1


def test_constrained_requests_next_to_speculating_ones(llm_factory):
    """With speculation, a constrained request drafts nothing (its grammar advances on the host)
    and decodes exactly as without speculation, one token per mask, next to greedy requests
    that draft; every output stays identical to a plain engine's."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [free_params(), regex_params(), free_params(min_loops=1)]
    plain = llm_factory().generate(prompts, params)
    llm = llm_factory(num_speculative_tokens=3, speculative_draft_loops=2)
    got = llm.generate(prompts, params)
    for a, b in zip(plain, got, strict=True):
        assert (a.token_ids, a.exit_depths, a.text) == (b.token_ids, b.exit_depths, b.text)
    assert re.fullmatch(REGEX, got[1].text) and got[1].finish_reason == "stop"
    assert llm.get_stats().spec_drafts > 0


def test_preempted_constrained_request_resumes_with_its_matcher(llm_factory):
    llm = llm_factory(scheduling_policy="priority", enable_preemption=True, max_num_seqs=1)
    engine = llm.engine
    spec = StructuredOutput(kind="json_schema", json_schema=json.dumps(SCHEMA))
    low = SamplingParams(max_tokens=MAX_TOKENS, structured_output=spec, priority=10)
    engine.add_request("low", [1, 2, 3], low)
    for _ in range(6):
        engine.step()
    engine.add_request("high", [4, 5], regex_params(priority=-10))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    assert llm.get_stats().preemptions == 1 and llm.get_stats().resumptions == 1
    assert re.fullmatch(REGEX, outputs["high"].text)
    alone = llm_factory().generate([[1, 2, 3]], low)[0]
    assert outputs["low"].token_ids == alone.token_ids
    assert outputs["low"].finish_reason == "stop"
    assert_valid(json.loads(outputs["low"].text))


def test_abort_frees_the_matcher_and_the_row(llm_factory):
    llm = llm_factory()
    engine = llm.engine
    engine.add_request("c", [1, 2, 3], regex_params())
    for _ in range(3):
        engine.step()
    request = engine.core.scheduler.get_request("c")
    assert request.constraint is not None
    engine.abort_request("c")
    assert request.constraint is None
    engine.step()
    assert len(engine.core.runner.rows) == 0


@pytest.mark.parametrize("scheduling_mode", ["refill", "no_refill"])
def test_fused_tick_kernels_hold_constrained_rows_like_the_torch_tick(llm_factory, scheduling_mode):
    """The Triton tick (prepare / commit: the `held` flag) equals the torch tick with
    constrained rows in the batch; Triton's interpreter runs it without CUDA."""
    from rlt_runner import tick_kernels

    if not tick_kernels.available():
        pytest.skip("triton is not installed")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [free_params(), regex_params(), regex_params(temperature=1.0, seed=2)]
    results = []
    for fused in (False, True):
        llm = llm_factory(scheduling_mode=scheduling_mode)
        program = llm.engine.core.runner.program
        program.kernels = tick_kernels.TickKernels(program) if fused else None
        outputs = llm.generate(prompts, params)
        results.append([(o.token_ids, o.exit_depths, o.finish_reason) for o in outputs])
        for out, param in zip(outputs, params, strict=True):
            if param.structured_output is not None:
                assert re.fullmatch(REGEX, out.text)
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(kind="json_schema", json_schema=json.dumps(SCHEMA)),
        StructuredOutput(kind="json_object"),
    ],
    ids=["bounded-string-schema", "json_object"],
)
def test_json_strings_exclude_raw_control_characters(tiny_checkpoint, spec):
    """RFC 8259 forbids U+0000-U+001F inside strings. xgrammar's converter lets them into
    length-bounded strings (SCHEMA's name); a byte-level vocabulary has one token per control
    byte, and a CUDA run wrote one there. After an opened string only printable tokens pass."""
    from rlt.engine.structured_output import XGrammarCompiler
    from rlt_models import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint())
    vocab_size = len(tokenizer)
    compiler = XGrammarCompiler(lambda: tokenizer, vocab_size=vocab_size, stop_token_ids=())
    constraint = compiler.compile(spec)
    prefix = '{"name": "Th' if spec.kind == "json_schema" else '{"Th'
    for token_id in tokenizer.encode(prefix, add_special_tokens=False):
        assert constraint.accept_token(token_id)
    words = memoryview(constraint.allowed_token_bitmask()).cast("i")
    allowed = {t for t in range(vocab_size) if words[t // 32] >> (t % 32) & 1}
    texts = {t: tokenizer.decode([t]) for t in range(vocab_size)}
    control = {t for t, text in texts.items() if text and all(ord(c) < 0x20 for c in text)}
    assert len(control) == 32 and not control & allowed
    assert {t for t, text in texts.items() if text in ("a", "Z", '"')} <= allowed


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_masks_constrain_fused_graph_ticks_like_alone(llm_factory, dtype):
    """On CUDA with the fused tick kernels and CUDA graphs: the bitmasks (uploaded per step,
    applied at the coda on the device) keep regex, choice and json_schema rows valid, greedy and
    seeded, batched with free rows. In fp32 every row equals its run alone (free rows too); bf16
    GEMMs are not batch invariant (docs/serving.md), so there only validity is checked."""
    options = dict(device="cuda", dtype=dtype, cuda_graphs=True, fused_kernels=True)
    llm = llm_factory(**options)
    assert llm.engine.core.runner.graphs is not None
    schema = StructuredOutput(kind="json_schema", json_schema=json.dumps(SCHEMA))
    choice = StructuredOutput(kind="choice", choices=tuple(CHOICES))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    params = [
        free_params(),
        regex_params(),
        SamplingParams(max_tokens=MAX_TOKENS, structured_output=schema),
        SamplingParams(max_tokens=16, structured_output=choice, temperature=0.9, seed=4),
        regex_params(temperature=1.0, seed=2),
    ]
    together = llm.generate(prompts, params)
    assert re.fullmatch(REGEX, together[1].text) and re.fullmatch(REGEX, together[4].text)
    assert_valid(json.loads(together[2].text))
    assert together[3].text in CHOICES
    assert all(out.finish_reason == "stop" for out in together[1:])
    if dtype != "float32":
        return
    for prompt, param, out in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], param)[0]
        assert (out.token_ids, out.exit_depths) == (alone.token_ids, alone.exit_depths)
