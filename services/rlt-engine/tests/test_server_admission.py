"""Admission over real HTTP: what the waiting-queue limit counts, and prompt lists queued all
or none.

- `--max-waiting-requests` bounds the requests that really wait (left waiting by a step, or
  beyond the free runner slots): an idle server with 8 slots and a limit of 2 takes a burst of
  16 requests up to 10 in flight, and refuses the rest with 429 only.
- A list of prompts is queued at once: all of them or none (429 while the queue cannot take
  them now, 400 when it never could), so a refused list leaves nothing queued or aborted.
"""

from __future__ import annotations

import asyncio
import time

import httpx2
import openai
import pytest
from serving_harness import run_server

# 4096 KV blocks: 8 requests of 400 tokens fit at once, so only the slots limit admission
ENGINE = dict(max_num_seqs=8, max_waiting_requests=2, num_kv_blocks=4096)


def test_a_burst_on_an_idle_server_fills_the_free_slots_before_429(checkpoint):
    with run_server(checkpoint, engine=ENGINE) as server:
        body = {"prompt": [5, 6, 7], "max_tokens": 32, "ignore_eos": True, "temperature": 0}

        async def burst() -> list[int]:
            async with httpx2.AsyncClient(
                base_url=server.base_url, trust_env=False, timeout=60
            ) as client:
                responses = await asyncio.gather(
                    *(client.post("/v1/completions", json=body) for _ in range(16))
                )
            return [r.status_code for r in responses]

        statuses = asyncio.run(burst())
        # A refusal needs 8 running + 2 waiting (or more) unfinished requests at that moment,
        # so at least 10 of the 16 were accepted, whatever the timing.
        assert statuses.count(200) >= 10, statuses
        assert set(statuses) <= {200, 429}, statuses
        server.wait_idle()


def test_a_prompt_list_is_queued_all_or_none(checkpoint):
    with run_server(checkpoint, engine=ENGINE) as server, server.http() as http:
        # idle: 8 slots + 2 waiting take a list of 10 at once
        ten = http.post("/v1/completions", json={"prompt": [[5, 6]] * 10, "max_tokens": 2})
        assert ten.status_code == 200, ten.text
        assert [c["index"] for c in ten.json()["choices"]] == list(range(10))
        # 11 can never be queued at once: a client error, not "retry later"
        eleven = http.post("/v1/completions", json={"prompt": [[5, 6]] * 11, "max_tokens": 2})
        assert eleven.status_code == 400, eleven.text
        assert eleven.json()["error"]["param"] == "prompt"
        server.wait_idle()
        assert server.client.stats().aborted_requests == 0

        long = {"prompt": [[1, 2, 3]] * 9, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()  # (keep it: a dropped iterator closes the response)
            next(lines)  # submitted: at most 8 run, the rest wait
            deadline = time.monotonic() + 30
            while server.client.stats().running_requests < 8 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.client.stats().waiting_requests == 1
            refused = http.post("/v1/completions", json={"prompt": [[4], [5]], "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "1"
            stats = server.client.stats()
            # none of the refused list was queued (so none had to be aborted)
            assert stats.aborted_requests == 0 and stats.waiting_requests == 1
            one = {"prompt": [[4]], "max_tokens": 1, "stream": True}
            with http.stream("POST", "/v1/completions", json=one) as accepted:
                assert accepted.status_code == 200  # queued (it waits for a slot)
        server.wait_idle()


def test_the_openai_client_sees_a_refused_list_as_rate_limited(checkpoint):
    engine = dict(max_num_seqs=2, max_waiting_requests=1, num_kv_blocks=4096)
    with run_server(checkpoint, engine=engine) as server, server.http() as http:
        client = server.openai()
        long = {"prompt": [[1, 2]] * 3, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()  # (keep it: a dropped iterator closes the response)
            next(lines)  # 2 run, 1 waits
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=server.client.model_info().name, prompt=["a"])
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=server.client.model_info().name, prompt=["a"] * 4)
        assert error.value.body["param"] == "prompt"
        server.wait_idle()
