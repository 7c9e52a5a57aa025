"""`rlt serve` with self-speculative decoding, over real HTTP.

Against a server without speculation on the same checkpoint: greedy completions (one choice,
n = 2, streamed) carry the same tokens and per-token exit depths; every streamed chunk's
`exit_depths` matches its tokens; `/metrics` reports the spec-decode counters, equal to the
engine's stats and consistent with each other; nothing leaks (the harness checks).
"""

from __future__ import annotations

import pytest
from serving_harness import metric_samples, run_server, sse_events

GREEDY = dict(
    temperature=0,
    max_tokens=12,
    ignore_eos=True,
    return_token_ids=True,
    exit_threshold=0.55,
    min_loops=1,
)
PROMPTS = ["It is a truth", [5, 17, 200, 3, 99, 42, 7], "The river"]


@pytest.fixture(scope="module")
def servers(checkpoint):
    speculative = dict(num_speculative_tokens=3, speculative_draft_loops=2)
    with (
        run_server(checkpoint, served_model_name="tiny", engine=speculative) as spec,
        run_server(checkpoint, served_model_name="tiny") as plain,
    ):
        yield spec, plain


def complete(server, **body) -> dict:
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_tokens_and_exit_depths_equal_a_plain_server(servers):
    spec, plain = servers
    for prompt in PROMPTS:
        got = complete(spec, prompt=prompt, n=2, **GREEDY)["choices"]
        expected = complete(plain, prompt=prompt, **GREEDY)["choices"][0]
        for choice in got:
            assert choice["token_ids"] == expected["token_ids"]
            assert choice["exit_depths"] == expected["exit_depths"]
            assert choice["text"] == expected["text"]


def test_streamed_chunks_carry_their_exit_depths(servers):
    spec, plain = servers
    expected = complete(plain, prompt=PROMPTS[0], **GREEDY)["choices"][0]
    with (
        spec.http() as http,
        http.stream(
            "POST",
            "/v1/completions",
            json={"model": "tiny", "prompt": PROMPTS[0], "stream": True, **GREEDY},
        ) as response,
    ):
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    tokens = [t for c in chunks for t in c.get("token_ids") or []]
    depths = [d for c in chunks for d in c.get("exit_depths") or []]
    for chunk in chunks:
        assert len(chunk.get("token_ids") or []) == len(chunk.get("exit_depths") or [])
    assert (tokens, depths) == (expected["token_ids"], expected["exit_depths"])


def test_metrics_report_draft_and_acceptance_counts(servers):
    spec, _ = servers
    # every prompt here, whatever else ran on this server before (xdist may run this test alone):
    # on this random model one prompt's drafts may all be rejected, the three together are not
    for prompt in PROMPTS:
        complete(spec, prompt=prompt, **GREEDY)
    with spec.http() as http:
        text = http.get("/metrics").text
    samples = {
        (name, labels.get("position")): value
        for name, labels, value in metric_samples(text)
        if name.startswith("rlt:spec_decode")
    }
    drafts = samples[("rlt:spec_decode_num_drafts_total", None)]
    drafted = samples[("rlt:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("rlt:spec_decode_num_accepted_tokens_total", None)]
    per_position = [
        samples[("rlt:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)
    ]
    stats = spec.client.stats()
    assert (drafts, drafted, accepted) == (
        stats.spec_drafts,
        stats.spec_draft_tokens,
        stats.spec_accepted_tokens,
    )
    assert drafts > 0 and 0 < accepted <= drafted <= 3 * drafts
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # a later draft needs the earlier
