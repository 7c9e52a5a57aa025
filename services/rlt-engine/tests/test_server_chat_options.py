"""Chat rendering options over real HTTP (and the official openai client).

- add_generation_prompt / continue_final_message / chat_template_kwargs render exactly what the
  tokenizer's chat template renders with them; chat completions and POST /tokenize agree.
- Tool messages with tool_call_id and assistant messages with tool_calls reach a template that
  renders them (arguments as objects); a template that cannot render tool calls answers 400.
- echo: a reply to a conversation ending with an assistant message begins with its content.
"""

from __future__ import annotations

import json
import shutil

import pytest
from serving_harness import run_server, sse_events

# The bundled test template plus a template variable and tool-call rendering.
TOOL_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% for call in message.tool_calls or [] %}<call {{ call.id }}>{{ call.function.name }}"
    "{{ call.function.arguments | tojson }}</call>{% endfor %}"
    "{% if message.tool_call_id %}[for {{ message.tool_call_id }}]{% endif %}"
    "{{ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "Once upon a time"},
    {"role": "assistant", "content": "there was"},
]


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


def rendered(server, messages, **options) -> str:
    return server.engine.tokenizer.apply_chat_template(messages, tokenize=False, **options)


def tokenize_messages(http, messages, **options) -> list[int]:
    response = http.post("/tokenize", json={"messages": messages, **options})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def detokenize(http, tokens) -> str:
    return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


@pytest.mark.parametrize(
    ("options", "template_options"),
    [
        ({}, {"add_generation_prompt": True}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            {"continue_final_message": True},
        ),
    ],
)
def test_generation_prompt_options_render_as_the_template_does(
    http, server, options, template_options
):
    want = rendered(server, CONVERSATION, **template_options)
    tokens = tokenize_messages(http, CONVERSATION, **options)
    assert detokenize(http, tokens) == want
    chat = http.post(
        "/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 2, **options}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)


def test_continue_final_message_leaves_the_assistant_turn_open(http):
    options = {"add_generation_prompt": False, "continue_final_message": True}
    text = detokenize(http, tokenize_messages(http, CONVERSATION, **options))
    assert text.endswith("<|im_start|>assistant\nthere was")


def test_continue_final_message_with_a_generation_prompt_is_a_400(http):
    body = {"messages": CONVERSATION, "continue_final_message": True}
    for path in ("/v1/chat/completions", "/tokenize"):
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "continue_final_message"


def test_chat_echo_begins_the_reply_with_the_final_assistant_message(http, server):
    body = {
        "messages": CONVERSATION,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "there was" + plain["content"]
    assert echoed["usage"]["completion_tokens"] == 4  # the echo is not generated

    with http.stream(
        "POST", "/v1/chat/completions", json={**body, "echo": True, "stream": True}
    ) as r:
        events = sse_events(r.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "there was"}
    assert "".join(d.get("content", "") for d in deltas) == "there was" + plain["content"]
    assert events[-1] == "[DONE]"

    client = server.openai()
    reply = client.chat.completions.create(
        model="tiny",
        messages=CONVERSATION,
        max_tokens=4,
        temperature=0,
        extra_body={
            "echo": True,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "ignore_eos": True,
        },
    )
    assert reply.choices[0].message.content == "there was" + plain["content"]

    # the last message is the user's: nothing to echo
    ask = {"messages": CONVERSATION[:1], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    without = http.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]
    with_echo = http.post("/v1/chat/completions", json={**ask, "echo": True}).json()
    assert with_echo["choices"][0]["message"] == without


TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tool_server(checkpoint, tmp_path_factory):
    model = tmp_path_factory.mktemp("tool_template") / "tiny-tools"
    shutil.copytree(checkpoint, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    with run_server(model, served_model_name="tiny") as running:
        yield running


def test_tool_calls_and_template_kwargs_reach_a_template_that_renders_them(tool_server):
    with tool_server.http() as http:
        options = {"chat_template_kwargs": {"greeting": "Hello tools"}}
        tokens = tokenize_messages(http, TOOL_CONVERSATION, **options)
        text = detokenize(http, tokens)
        assert text.startswith("Hello tools\n")
        assert '<call call_1>weather{"city": "Paris"}</call>' in text  # arguments as an object
        assert "<|im_start|>tool\nsunny[for call_1]<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": TOOL_CONVERSATION, "max_tokens": 2, **options},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(tokens)


def test_tool_messages_render_and_tool_calls_need_a_template_that_knows_them(http):
    answer = [TOOL_CONVERSATION[0], {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    response = http.post("/v1/chat/completions", json={"messages": answer, "max_tokens": 2})
    assert response.status_code == 200, response.text
    response = http.post("/v1/chat/completions", json={"messages": TOOL_CONVERSATION})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].tool_calls"
    assert "cannot render tool calls" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("messages", "options", "param"),
    [
        (
            [{"role": "user", "content": "x", "tool_call_id": "c"}],
            {},
            "messages[0].tool_call_id",
        ),
        (
            [{"role": "user", "content": None, "tool_calls": TOOL_CONVERSATION[1]["tool_calls"]}],
            {},
            "messages[0].content",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {}}]}],
            {},
            "messages[0].tool_calls[0].function.name",
        ),
        (
            CONVERSATION,
            {"chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs.tokenize",
        ),
        (CONVERSATION, {"chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_bad_chat_rendering_input_names_the_field(http, messages, options, param):
    response = http.post("/v1/chat/completions", json={"messages": messages, **options})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tool_call_arguments_must_be_a_json_object(tool_server):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2"}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    with tool_server.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].tool_calls[0].function.arguments"
