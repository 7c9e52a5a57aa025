"""An engine instance's internal PD endpoints over real HTTP (what the coordinator calls), and
the PD options' validation.

A decode instance reports the handoff target first and aborts the request (freeing its held
blocks once the transfer is released) when the caller goes away; a plain instance streams
deltas equal to `generate`; bad bodies and role mismatches answer 400 naming the field; the
endpoints need the API key; an incompatible peer is refused with 409 naming the fields.
"""

from __future__ import annotations

import json
import re

import httpx
import msgspec
import pytest
from rlt import LLM, SamplingParams
from rlt.engine import EngineConfig
from rlt_contracts import ConfigurationError, EngineRequest, KVTransferParams, PDRole
from rlt_contracts.pd_wire import GenerateBody
from serving_harness import run_server

pytest.importorskip("nixl")

PROMPT = [5, 17, 200, 3, 99, 42, 7]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, exit_threshold=0.8)


def generate_body(request_id: str, role: PDRole, **transfer) -> bytes:
    params = KVTransferParams(role, transfer.pop("transfer_id", "tx-1"), **transfer)
    request = EngineRequest(request_id, tuple(PROMPT), PARAMS)
    return msgspec.json.encode(GenerateBody(request, params))


def lines(response: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line.strip()]


def test_a_plain_instance_streams_deltas_equal_to_generate(tiny_checkpoint):
    model = tiny_checkpoint("l2_t4")
    with LLM(model, dtype="float32", device="cpu", block_size=4, num_kv_blocks=512) as llm:
        [expected] = llm.generate([PROMPT], PARAMS)
    with run_server(model, api_key="k") as server:
        with server.http() as http:
            info = http.get("/internal/pd/info", headers={"Authorization": "Bearer k"}).json()
            assert info["role"] == "none" and info["agent"] == "" and info["load"]["running"] == 0
            assert http.get("/internal/pd/info").status_code == 401  # behind the API key
            body = generate_body("r1", PDRole.NONE)
            headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
            with http.stream(
                "POST", "/internal/pd/generate", content=body, headers=headers
            ) as response:
                assert response.headers["content-type"].startswith("application/x-ndjson")
                got = lines(response)
        deltas = [line["delta"] for line in got]
        assert [t for d in deltas for t in d["token_ids"]] == expected.token_ids
        assert [e for d in deltas for e in d["exit_depths"]] == expected.exit_depths
        assert deltas[-1]["finished"] and deltas[-1]["finish_reason"] == "length"


def test_a_decode_instance_reports_its_target_and_frees_it_when_the_caller_leaves(
    tiny_checkpoint,
):
    with run_server(tiny_checkpoint("l2_t4"), engine=dict(pd_role="decode")) as server:
        with server.http() as http:
            info = http.get("/internal/pd/info").json()
            assert info["role"] == "decode" and info["agent"].startswith("rlt-decode-")
            assert info["compatibility"]["num_loops"] == 4
            # the prefill agent is not connected: the request fails at once, blocks released
            body = generate_body("r1", PDRole.DECODE, prefill_agent="nobody")
            response = http.post("/internal/pd/generate", content=body)
            got = lines(response)
            assert "target" in got[0] and got[0]["target"]["prompt_length"] == len(PROMPT)
            final = got[-1]["delta"]
            assert final["finished"] and "not connected" in final["error"]
            server.wait_idle()
            # a role this instance does not have
            response = http.post(
                "/internal/pd/generate", content=generate_body("r2", PDRole.PREFILL)
            )
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "kv_transfer_params.role"
            # a malformed body names what is wrong
            response = http.post("/internal/pd/generate", json={"request": {}})
            assert response.status_code == 400 and "request" in response.json()["error"]["message"]


def test_an_incompatible_peer_is_refused_naming_the_fields(tiny_checkpoint):
    with (
        run_server(tiny_checkpoint("l2_t4"), engine=dict(pd_role="decode")) as decode,
        run_server(
            tiny_checkpoint("l2_t4"), engine=dict(pd_role="prefill", block_size=8)
        ) as prefill,
    ):
        with decode.http() as d, prefill.http() as p:
            peer = p.get("/internal/pd/info").json()["metadata"]
            response = d.post("/internal/pd/connect", json={"peers": [peer]})
            assert response.status_code == 409
            error = response.json()["error"]
            assert (
                error["code"] == "pd_incompatible"
                and "block_size: 4 here, 8 there" in (error["message"])
            )
            response = d.post("/internal/pd/connect", json={"peers": ["%%%"]})
            assert response.status_code == 400 and response.json()["error"]["param"] == "peers[0]"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(pd_role="both"), "pd_role"),
        (dict(pd_kv_lease_s=10.0, pd_write_timeout_s=20.0), "pd_kv_lease_s + pd_write_timeout_s"),
        (dict(pd_kv_timeout_s=0.0), "pd_kv_timeout_s"),
        (dict(pd_max_inflight_bytes=1000), "pd_max_inflight_bytes"),
    ],
)
def test_pd_options_are_validated(options, named):
    with pytest.raises(ConfigurationError, match="^" + re.escape(named)):
        EngineConfig.from_options(**options)
