"""n > 1 through the PD coordinator (fake instances): every choice is its own engine request
on P and D, carrying the prompt's sibling group and its derived seed (seed + i); the
coordinator's client has no batch submission, so the choices are submitted one by one."""

from __future__ import annotations

from test_pd_coordinator import by_role, pd_group, wait_for


def test_n_choices_reach_both_instances_as_siblings():
    with pd_group() as (running, http, servers):
        (p,), (d,) = by_role(servers, "prefill"), by_role(servers, "decode")
        body = {"prompt": "hello", "max_tokens": 4, "n": 3, "seed": 7}
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert all(c["text"] == "Hi!?" for c in choices)  # the fakes script every request
        assert answer.json()["usage"]["prompt_tokens"] == 5  # the prompt once
        to_d = d.engine.requests[-3:]
        groups = {r.request.sibling_group for r in to_d}
        assert len(groups) == 1 and None not in groups
        assert sorted(r.request.sampling.seed for r in to_d) == [7, 8, 9]
        wait_for(lambda: not p.engine.held and not d.engine.held, what="instances idle")
