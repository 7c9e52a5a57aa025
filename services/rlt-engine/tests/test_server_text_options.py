"""Text options over HTTP, the openai client and the Python API (vLLM's extra fields):
`skip_special_tokens`, `include_stop_str_in_output`, `spaces_between_special_tokens`.

The test checkpoint's tokenizer has special tokens (`<|endoftext|>` = 0, `<|im_start|>` = 1,
`<|im_end|>` = 2); sampling at a high temperature from the random model produces them. Streaming
and non-streaming answers give the same text.
"""

from __future__ import annotations

import openai
import pytest
from rlt import LLM, SamplingParams
from serving_harness import ENGINE_DEFAULTS, run_server, sse_events

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
HOT = {"temperature": 2.0, "max_tokens": 48, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


def completion(http, **body) -> dict:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_texts(http, path: str, body: dict) -> dict[int, str]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            piece = choice["text"] if "text" in choice else choice["delta"].get("content", "")
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def test_special_tokens_are_skipped_unless_asked(http, checkpoint):
    body = {"prompt": "It is a truth", "n": 16, "seed": 1, **HOT}
    skipped = completion(http, **body)["choices"]
    shown = completion(http, skip_special_tokens=False, **body)["choices"]
    with_special = [c for c in shown if any(t < len(SPECIAL) for t in c["token_ids"])]
    assert len(with_special) >= 2  # the seed gives some
    for choice in with_special:
        for token in {t for t in choice["token_ids"] if t < len(SPECIAL)}:
            assert SPECIAL[token] in choice["text"]
    assert not any(s in c["text"] for c in skipped for s in SPECIAL)
    assert [c["token_ids"] for c in skipped] == [c["token_ids"] for c in shown]
    # streaming gives the same text, with either setting
    for options, want in (({}, skipped), ({"skip_special_tokens": False}, shown)):
        texts = streamed_texts(http, "/v1/completions", {**body, **options})
        assert texts == {c["index"]: c["text"] for c in want}
    # the Python API takes the same option (choice 5 samples with seed 1 + 5)
    choice = shown[5]
    llm = LLM(checkpoint, **ENGINE_DEFAULTS)
    try:
        params = SamplingParams(
            max_tokens=48, temperature=2.0, ignore_eos=True, seed=6, skip_special_tokens=False
        )
        [out] = llm.generate(["It is a truth"], params)
    finally:
        llm.shutdown()
    assert (out.token_ids, out.text) == (choice["token_ids"], choice["text"])


def test_spaces_between_special_tokens_is_accepted_and_byte_level_text_is_unchanged(http):
    body = {"prompt": "It is a truth", "n": 16, "seed": 1, "skip_special_tokens": False, **HOT}
    spaced = completion(http, **body)["choices"]
    bare = completion(http, spaces_between_special_tokens=False, **body)["choices"]
    assert [c["text"] for c in bare] == [c["text"] for c in spaced]


def prefix_offsets(tokenizer, token_ids, text) -> list[int]:
    """Where in `text` each token boundary lies (boundaries inside a character are left out)."""
    offsets = []
    for k in range(1, len(token_ids)):
        prefix = tokenizer.decode(token_ids[:k])
        if text.startswith(prefix):
            offsets.append(len(prefix))
    return offsets


def boundary_needle(http, server, prompt: str, seed: int) -> tuple[str, str, dict]:
    """A 3-character stop string of a sampled answer that spans a token boundary, the answer's
    text, and the request body."""
    body = {"prompt": prompt, "seed": seed, "temperature": 0.7, "max_tokens": 32}
    body["ignore_eos"] = True
    free = completion(http, return_token_ids=True, **body)["choices"][0]
    text = free["text"]
    offsets = prefix_offsets(server.engine.tokenizer, free["token_ids"], text)
    for start in range(len(text) // 3, len(text) - 3):
        needle = text[start : start + 3]
        spans = any(start < o < start + 3 for o in offsets)
        if spans and "\ufffd" not in needle and text.find(needle) == start:
            return needle, text, body
    raise AssertionError(f"no boundary-spanning needle in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(http, server, include):
    needle, text, body = boundary_needle(http, server, "My dear Emma,", seed=12)
    start = text.find(needle)
    want = text[: start + len(needle)] if include else text[:start]
    body = {**body, "stop": [needle], "include_stop_str_in_output": include}
    got = completion(http, **body)["choices"][0]
    assert (got["text"], got["finish_reason"]) == (want, "stop")
    assert streamed_texts(http, "/v1/completions", body) == {0: want}


def test_chat_keeps_the_stop_string_when_asked(http):
    messages = [{"role": "user", "content": "Tell me"}]
    base = {"messages": messages, "seed": 3, "temperature": 0.7, "max_tokens": 32}
    base["ignore_eos"] = True
    free = http.post("/v1/chat/completions", json=base).json()["choices"][0]["message"]["content"]
    needle = next(
        free[i : i + 2]
        for i in range(len(free) // 2, len(free) - 2)
        if "\ufffd" not in free[i : i + 2]
    )
    body = {**base, "stop": needle, "include_stop_str_in_output": True}
    want = free[: free.find(needle) + len(needle)]
    got = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert got["message"]["content"] == want and got["finish_reason"] == "stop"
    assert streamed_texts(http, "/v1/chat/completions", body) == {0: want}


def test_the_stop_token_text_is_kept_only_when_asked(http, server):
    body = {"prompt": "It is a truth", "seed": 4, "temperature": 0.7, "max_tokens": 16}
    body.update(ignore_eos=True, return_token_ids=True)
    free = completion(http, **body)["choices"][0]
    ids, decode = free["token_ids"], server.engine.tokenizer.decode
    # a token that ends on a character boundary, at its first occurrence
    k = next(
        i
        for i in range(2, 16)
        if ids.index(ids[i]) == i
        and not decode(ids[: i + 1]).endswith("\ufffd")
        and not decode(ids[:i]).endswith("\ufffd")
        and len(decode(ids[: i + 1])) > len(decode(ids[:i]))
    )
    cut = completion(http, **{**body, "stop_token_ids": [ids[k]]})["choices"][0]
    kept = completion(
        http, **{**body, "stop_token_ids": [ids[k]], "include_stop_str_in_output": True}
    )["choices"][0]
    assert cut["token_ids"] == kept["token_ids"] == ids[: k + 1]
    assert (cut["text"], kept["text"]) == (decode(ids[:k]), decode(ids[: k + 1]))


def test_openai_client_sends_the_options_as_extra_body(server):
    client = server.openai()
    out = client.completions.create(
        model="tiny",
        prompt="It is a truth",
        n=16,
        seed=1,
        max_tokens=48,
        temperature=2.0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert any(s in c.text for c in out.choices for s in SPECIAL)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny", prompt="x", extra_body={"include_stop_str_in_output": "yes"}
        )
    assert info.value.body["param"] == "include_stop_str_in_output"
