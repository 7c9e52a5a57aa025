"""The playground page (`GET /playground`), served by the real HTTP server.

Without a browser: the page and its files are served with their content types and a
Content-Security-Policy that admits nothing but the server itself; the files reference nothing
external; the page is behind the Host guard but not behind the API key; the page's own
(same-origin) API calls pass the Origin guard only where DNS rebinding gains nothing.

In a real headless Chromium (Debian's `chromium`, driven by Playwright with the system browser;
these tests skip, with the reason, where no Chromium or Chrome binary is installed): over the
bundled model, a prompt sent with Enter streams tokens that carry `data-depth` and their depth's
colour, the histogram fills, the page's numbers equal the API's for the same request, and moving
the exit threshold from 1.0 to 0.3 moves the mean loops per token from 4 down; Stop aborts the
request on the server; error bodies are shown; with an API key, the page says a key is needed
(401) and works once it is entered. Canned streams (the answer replaced inside the browser)
cover what a live server gives only under load: several tokens in one chunk, held-back text,
an end token without text, an error event inside the stream.

Set RLT_PLAYGROUND_SCREENSHOT=PATH to save a screenshot of the page after the chat test
(docs/assets/playground.png is made that way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from importlib import resources
from pathlib import Path

import pytest
from rlt.engine.assembly import DEFAULT_MODEL_DIR
from serving_harness import run_server

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MODEL_DEPTH = 4  # the bundled model and the tiny checkpoint both loop 4 times
PAGE_TIMEOUT_MS = 60_000


def find_browser() -> str | None:
    """$RLT_CHROMIUM, else the first Chromium/Chrome binary on PATH."""
    configured = os.environ.get("RLT_CHROMIUM")
    if configured:
        return shutil.which(configured) or (configured if Path(configured).is_file() else None)
    for name in BROWSER_NAMES:
        if found := shutil.which(name):
            return found
    return None


@pytest.fixture(scope="module")
def server():
    with run_server(DEFAULT_MODEL_DIR, served_model_name="default") as running:
        yield running


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)


# ------------------------------------------------------------------------ without a browser


def test_page_and_files_are_served_with_types_and_a_strict_policy(server):
    with server.http() as http:
        expected = {
            "/playground": "text/html",
            "/playground/playground.js": "text/javascript",
            "/playground/playground.css": "text/css",
        }
        for path, media_type in expected.items():
            response = http.get(path)
            assert response.status_code == 200, path
            assert response.headers["content-type"].split(";")[0] == media_type
            assert response.headers["x-content-type-options"] == "nosniff"
            policy = response.headers["content-security-policy"]
            assert "default-src 'none'" in policy and "connect-src 'self'" in policy
        page = http.get("/playground").text
        assert "<textarea" in page and page.count("<textarea") == 1
        assert 'id="depth-histogram"' in page
        assert http.get("/playground/").status_code in (200, 307)  # redirected to /playground
        assert http.get("/playground/nothing.js").status_code == 404
        assert "/playground" not in http.get("/openapi.json").json()["paths"]


def test_shipped_files_reference_nothing_external():
    static = resources.files("rlt_serve") / "static"
    for name in ("playground.html", "playground.js", "playground.css"):
        text = (static / name).read_text()
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|@import|url\(", text), name


def test_page_is_behind_the_host_guard_not_the_api_key(tiny):
    with run_server(tiny, api_key="s3cret") as server, server.http() as http:
        assert http.get("/playground").status_code == 200
        assert http.get("/v1/models").status_code == 401
        foreign = http.get("/playground", headers={"Host": "evil.example"})
        assert foreign.status_code == 403


def chat(http, **headers):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return http.post("/v1/chat/completions", json=body, headers=headers)


def test_own_origin_passes_the_origin_guard_on_loopback(tiny):
    with run_server(tiny) as server, server.http() as http:
        own = f"http://127.0.0.1:{server.port}"
        assert chat(http, Origin=own).status_code == 200
        local = f"localhost:{server.port}"
        assert chat(http, Origin=f"http://{local}", Host=local).status_code == 200
        assert chat(http, Origin=f"http://localhost:{server.port + 1}").status_code == 403
        assert chat(http, Origin="https://evil.example").status_code == 403
        # DNS rebinding: the page's origin matches the Host, but the Host is not loopback.
        rebound = chat(http, Origin="http://evil.example:80", Host="evil.example:80")
        assert rebound.status_code == 403


def test_own_origin_on_a_public_bind_needs_an_api_key(tiny):
    # host 0.0.0.0: no Host check, so an own-looking Origin proves nothing without a key.
    with run_server(tiny, host="0.0.0.0") as server, server.http() as http:
        response = chat(http, Origin=f"http://127.0.0.1:{server.port}")
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "forbidden_origin"
    with run_server(tiny, host="0.0.0.0", api_key="k") as server, server.http() as http:
        own = f"http://127.0.0.1:{server.port}"
        assert chat(http, Origin=own).status_code == 401
        assert chat(http, Origin=own, Authorization="Bearer k").status_code == 200
        assert chat(http, Origin="https://evil.example").status_code == 403


# ------------------------------------------------------------------------ in a real browser


@pytest.fixture(scope="module")
def browser():
    path = find_browser()
    if path is None:
        pytest.skip(
            "no Chromium/Chrome browser installed (looked for $RLT_CHROMIUM and "
            f"{', '.join(BROWSER_NAMES)} on PATH); `apt-get install chromium` to run the "
            "playground browser tests"
        )
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright (dev dependency group) is not installed"
    )
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=path, args=["--disable-dev-shm-usage", "--disable-gpu"]
        )
        try:
            yield launched
        finally:
            launched.close()


class Page:
    """One browser tab on the playground, recording the chat requests it sends."""

    def __init__(self, browser, base_url: str) -> None:
        self.context = browser.new_context(viewport={"width": 1200, "height": 820})
        self.page = self.context.new_page()
        self.page.set_default_timeout(PAGE_TIMEOUT_MS)
        self.requests: list = []
        self.errors: list[str] = []
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on(
            "request",
            lambda r: self.requests.append(r) if r.url.endswith("/v1/chat/completions") else None,
        )
        self.page.goto(f"{base_url}/playground")
        self.wait_ready()

    def wait_ready(self) -> None:
        self.page.wait_for_selector("body[data-state=ready]")

    def set_controls(self, **values) -> None:
        for name, value in values.items():
            self.page.fill(f"#{name.replace('_', '-')}", str(value))

    def send(self, prompt: str) -> None:
        """Type `prompt`, press Enter, wait until the reply has finished."""
        textarea = self.page.locator("textarea")
        textarea.fill(prompt)
        before = self.page.evaluate("() => window.__sends")
        textarea.press("Enter")
        self.page.wait_for_function(
            "n => document.body.dataset.state === 'ready' && window.__sends > n", arg=before
        )

    def install_observers(self) -> None:
        """window.__sends counts finished sends (the page returns to "ready" after each);
        window.__seen records [state, tokens of the last reply] at each transcript change."""
        self.page.evaluate(
            """() => {
                window.__sends = 0;
                window.__seen = [];
                new MutationObserver(() => {
                    const state = document.body.dataset.state;
                    const reply = document.querySelector('.msg.assistant:last-of-type');
                    const tokens = reply ? reply.querySelectorAll('.tok').length : 0;
                    window.__seen.push([state, tokens]);
                }).observe(document.getElementById('transcript'),
                           {childList: true, subtree: true, characterData: true});
                new MutationObserver(() => {
                    if (document.body.dataset.state === 'ready') window.__sends += 1;
                }).observe(document.body, {attributes: true, attributeFilter: ['data-state']});
            }"""
        )

    def last_reply(self) -> dict:
        return self.page.evaluate(
            """() => {
                const reply = [...document.querySelectorAll('.msg.assistant')].at(-1);
                const swatch = d => getComputedStyle(
                    document.querySelector(`#depth-legend [data-bin="${d}"] .swatch`)
                ).backgroundColor;
                return {
                    text: reply.querySelector('.content').textContent,
                    tokens: [...reply.querySelectorAll('.tok')].map(t => ({
                        text: t.textContent,
                        depth: t.dataset.depth,
                        depths: t.dataset.depths || null,
                        colour: getComputedStyle(t).backgroundColor,
                        legend: swatch(t.dataset.depth),
                    })),
                    histogram: Object.fromEntries(
                        [...document.querySelectorAll('#depth-histogram [data-bin]')]
                            .map(b => [b.dataset.bin, +b.dataset.count])),
                    mean: document.getElementById('stat-mean-loops').dataset.value,
                    count: +document.getElementById('stat-tokens').dataset.value,
                    rate: document.getElementById('stat-tokens-per-s').dataset.value,
                    meta: reply.querySelector('.meta').textContent,
                    error: document.getElementById('error').hidden
                        ? null : document.getElementById('error').textContent,
                };
            }"""
        )

    def error_text(self) -> str:
        self.page.wait_for_selector("#error:not([hidden])")
        return self.page.inner_text("#error")

    def close(self) -> None:
        self.context.close()


def replay(server, request) -> dict:
    """The same request as the page's, without streaming, straight to the API."""
    body = {**request.post_data_json, "stream": False}
    body.pop("stream_options")
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def check_reply(reply: dict, api: dict) -> list[int]:
    """The page's reply against the API's answer to the same request; its decoded depths."""
    [choice] = api["choices"]
    depths = choice["exit_depths"]
    assert reply["error"] is None
    assert reply["text"] == choice["message"]["content"]
    assert reply["count"] == len(depths) >= 2
    # Every token element has a depth and that depth's legend colour; they cover the text.
    assert "".join(t["text"] for t in reply["tokens"]) == reply["text"]
    for token in reply["tokens"]:
        assert 1 <= int(token["depth"]) <= MODEL_DEPTH
        assert token["colour"] == token["legend"]
        assert token["colour"] not in ("", "rgba(0, 0, 0, 0)")
    single = [int(t["depth"]) for t in reply["tokens"] if t["depths"] is None]
    if len(single) == len(depths):  # one element per token
        assert single == depths
    # Histogram and mean: decoded tokens only (token 0 comes from prefill at full depth).
    decoded = depths[1:]
    assert reply["histogram"] == {str(d): decoded.count(d) for d in range(1, MODEL_DEPTH + 1)}, (
        "the histogram counts the decoded tokens by depth"
    )
    mean = float(reply["mean"])
    assert mean == pytest.approx(sum(decoded) / len(decoded))
    assert mean == pytest.approx(api["usage"]["loops"]["mean_loops_per_token"])
    assert float(reply["rate"]) > 0
    assert f"{mean:.2f} loops/token" in reply["meta"]
    return decoded


@pytest.mark.slow
def test_chat_streams_depth_coloured_tokens_and_the_threshold_moves_the_mean(browser, server):
    page = Page(browser, server.base_url)
    try:
        assert page.page.inner_text("#model-name") == "default"
        legend = page.page.eval_on_selector_all("#depth-legend [data-bin]", "e => e.length")
        assert legend == MODEL_DEPTH
        page.install_observers()
        page.set_controls(temperature=0, max_tokens=24, exit_threshold=1.0, min_loops=2)

        page.send("Tell me about the weather in London.")
        fixed = page.last_reply()
        [request] = page.requests
        sent = request.post_data_json
        assert sent["stream"] is True and sent["temperature"] == 0 and sent["max_tokens"] == 24
        assert (sent["exit_threshold"], sent["min_loops"], sent["max_loops"]) == (1, 2, 4)
        assert "authorization" not in request.headers  # no key set: none sent
        # The browser sent its Origin (the server's own), and the Origin guard let it pass.
        assert request.all_headers().get("origin") == server.base_url
        decoded = check_reply(fixed, replay(server, request))
        assert set(decoded) == {MODEL_DEPTH} and float(fixed["mean"]) == MODEL_DEPTH
        # Streamed: tokens were on the page while the reply was still streaming.
        seen = page.page.evaluate("() => window.__seen")
        partial = [n for state, n in seen if state == "streaming" and 0 < n < len(fixed["tokens"])]
        assert partial, f"no partial reply was rendered while streaming: {seen}"

        page.set_controls(exit_threshold=0.3)
        page.send("And what about Paris?")
        adaptive = page.last_reply()
        assert page.requests[-1].post_data_json["exit_threshold"] == 0.3
        assert len(page.requests[-1].post_data_json["messages"]) == 3  # the chat goes on
        decoded = check_reply(adaptive, replay(server, page.requests[-1]))
        assert float(adaptive["mean"]) < 3.5, "a low threshold lets tokens exit earlier"
        assert len({t["depth"] for t in adaptive["tokens"]}) >= 2  # several colours
        assert page.errors == []
        if target := os.environ.get("RLT_PLAYGROUND_SCREENSHOT"):
            page.page.screenshot(path=target)
    finally:
        page.close()
    server.wait_idle()


@pytest.mark.slow
def test_stop_aborts_the_request_and_errors_are_shown(browser, server):
    page = Page(browser, server.base_url)
    try:
        page.set_controls(temperature=0, max_tokens=300, exit_threshold=1.0)
        page.page.locator("textarea").fill("Write a long letter to my dear Emma.")
        page.page.locator("textarea").press("Enter")
        page.page.wait_for_function(
            "() => document.querySelectorAll('.msg.assistant .tok').length >= 3"
        )
        page.page.click("#stop")
        page.wait_ready()
        assert page.error_text() == "Stopped."
        reply = page.last_reply()
        assert "stopped" in reply["meta"] and reply["count"] < 300
        server.wait_idle()  # the server aborted the request and freed its KV blocks

        page.page.click("#clear")
        page.set_controls(max_tokens=100_000)
        page.page.locator("textarea").fill("Hello")
        page.page.locator("textarea").press("Enter")
        message = page.error_text()
        assert "HTTP 400" in message and "max_tokens" in message, message
        assert page.page.get_attribute("#error", "data-status") == "400"
        page.wait_ready()
        assert page.page.locator(".msg.assistant").count() == 0
        assert page.page.locator(".msg.user.failed").count() == 1

        page.set_controls(max_tokens=4, min_loops=4, max_loops=2)  # min above max: a 400
        page.page.locator("textarea").fill("Hello")
        page.page.locator("textarea").press("Enter")
        page.page.wait_for_selector("#error[data-status='400']")
        assert "min_loops" in page.error_text() or "max_loops" in page.error_text()
        assert page.errors == []
    finally:
        page.close()


@pytest.mark.slow
def test_api_key_is_asked_for_and_sent(browser, tiny):
    with run_server(tiny, served_model_name="tiny", api_key="s3cret") as server:
        page = Page(browser, server.base_url)
        try:
            assert "API key" in page.error_text() and "401" in page.error_text()
            page.install_observers()
            page.set_controls(temperature=0, max_tokens=6)
            page.send("hello")
            assert "authorization" not in page.requests[-1].headers
            assert "needs an API key" in page.error_text()

            page.page.fill("#api-key", "wrong")
            page.page.press("#api-key", "Tab")  # change event: reloads /v1/models
            page.send("hello")
            assert page.requests[-1].headers["authorization"] == "Bearer wrong"
            assert "refused the API key" in page.error_text()

            page.page.fill("#api-key", "s3cret")
            page.page.press("#api-key", "Tab")
            page.page.wait_for_function(
                "() => document.getElementById('model-name').textContent === 'tiny'"
            )
            page.send("hello")
            assert page.requests[-1].headers["authorization"] == "Bearer s3cret"
            reply = page.last_reply()
            assert reply["error"] is None and reply["count"] >= 1
            assert all(t["depth"] for t in reply["tokens"])
            stored = page.page.evaluate("() => sessionStorage.getItem('rlt-playground-api-key')")
            assert stored == "s3cret"
            page.page.reload()
            page.wait_ready()
            assert page.page.input_value("#api-key") == "s3cret"  # kept for this tab
            assert page.errors == []
        finally:
            page.close()


def sse(*events) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def chunk(content, depths, pieces=None, finish=None) -> dict:
    choice = {"index": 0, "delta": {"content": content}, "exit_depths": depths}
    if pieces is not None:
        choice["logprobs"] = {"content": [{"token": p, "logprob": -1.0} for p in pieces]}
    choice["finish_reason"] = finish
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "choices": [choice]}


@pytest.mark.slow
def test_depths_are_mapped_to_text_of_merged_and_held_back_chunks(browser, server):
    """Canned streams (the API answer replaced in the browser) exercise the cases a live
    server gives only under load: several tokens per chunk, text held back, an end token
    without text, an error inside the stream, a non-JSON error body."""
    page = Page(browser, server.base_url)
    try:
        stream = sse(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "exit_depths": [],
                        "finish_reason": None,
                    }
                ]
            },
            chunk("Hel", [4], ["Hel"]),
            chunk("lo wor", [2, 3], ["lo", " wor"]),  # two tokens, pieces match: two elements
            chunk("", [3], ["\ufffd"]),  # an incomplete character: no text yet
            chunk("é!", [2, 2], ["\ufffd", "!"]),  # pieces do not match: one element
            chunk("", [4], [""], finish="stop"),  # the end-of-turn token: no text
            "[DONE]",
        )
        page.page.route(
            "**/v1/chat/completions",
            lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream),
        )
        page.install_observers()
        page.send("hi")
        reply = page.last_reply()
        tokens = [(t["text"], t["depth"], t["depths"]) for t in reply["tokens"]]
        assert tokens == [
            ("Hel", "4", None),
            ("lo", "2", None),
            (" wor", "3", None),
            ("é!", "2", "3 2 2"),
            ("", "4", None),
        ]
        assert page.page.locator(".tok.tok-end").count() == 1
        assert reply["text"] == "Hello woré!"
        assert reply["histogram"] == {"1": 0, "2": 3, "3": 2, "4": 1}
        assert float(reply["mean"]) == pytest.approx(16 / 6) and reply["count"] == 7
        assert "finish: stop" in reply["meta"] and reply["error"] is None

        page.page.unroute("**/v1/chat/completions")
        failing = sse(
            chunk("Hi", [4], ["Hi"]),
            {
                "error": {
                    "message": "the engine failed",
                    "type": "internal_error",
                    "param": None,
                    "code": None,
                }
            },
            "[DONE]",
        )
        page.page.route(
            "**/v1/chat/completions",
            lambda route: route.fulfill(status=200, content_type="text/event-stream", body=failing),
        )
        page.send("again")
        message = page.error_text()
        assert "internal_error" in message and "the engine failed" in message
        assert page.last_reply()["text"] == "Hi"  # what came before the error stays

        page.page.unroute("**/v1/chat/completions")
        page.page.route(
            "**/v1/chat/completions",
            lambda route: route.fulfill(status=502, content_type="text/plain", body="Bad gateway"),
        )
        page.send("once more")
        assert page.error_text() == "HTTP 502: Bad gateway"
        assert page.errors == []
    finally:
        page.close()


def test_find_browser_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RLT_CHROMIUM", str(tmp_path / "missing"))
    assert find_browser() is None
    monkeypatch.delenv("RLT_CHROMIUM")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_browser() is None
