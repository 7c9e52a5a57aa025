"""PD disaggregation at the engine level, two engines in one process joined by a loopback KV
port (exact byte copies at the memory the runners declare, the same evidence rules as the NIXL
port): the decode engine's
output equals a single engine's, tokens and exit depths, greedy and seeded, both layouts, both
scheduling modes, an fp8 KV cache (its bytes move as they are), chunked prefill, prompts
ending mid-block, prefix-cache hits on D; aborts on either side leave both engines with no
block or row held."""

from __future__ import annotations

import pytest
from pd_loopback import LoopbackPair
from rlt import SamplingParams
from rlt_contracts import KVTransferParams, PDRole

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 12, 13],  # 13 tokens: ends mid-block (block 4)
    [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 12, 14, 15, 16, 17],  # shares 3 full pages
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3],
]


def params(i: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=8 + i,
        exit_threshold=(0.55, 0.8, 1.0)[i % 3],
        ignore_eos=True,
        temperature=0.0 if i % 2 else 0.9,
        seed=40 + i,
    )


def loopback(make, decode_options: dict | None = None, **options) -> tuple:
    """(P, D, their LoopbackPair): a prefill and a decode engine made by `make` with `options`
    (D with `decode_options` instead, when given), built with the pair's port."""
    pair = LoopbackPair()
    prefill = make(pd_role="prefill", handoff_port=pair.port, **options)
    decode_options = options if decode_options is None else decode_options
    decode = make(pd_role="decode", handoff_port=pair.port, **decode_options)
    return prefill, decode, pair


def connect_nixl(prefill, decode) -> str:
    """Join two PD engines' NIXL transports (UCX over host memory); returns P's agent."""
    p, d = prefill.engine.parts.pd, decode.engine.parts.pd
    assert p.transport.connect(d.metadata) == d.agent
    assert d.transport.connect(p.metadata) == p.agent
    return p.agent


def run_pd(
    prefill, decode, prompts, all_params, *, abort=None, prefill_agent="P", transfer="t"
) -> dict:
    """Submit every request to D, hand each reserved target to P, step both to the end.
    `abort`: (side, request id, after how many P steps) to abort one request mid-way."""
    for i, (prompt, p) in enumerate(zip(prompts, all_params, strict=True)):
        params = KVTransferParams(PDRole.DECODE, f"{transfer}{i}", prefill_agent=prefill_agent)
        decode.engine.add_request(f"r{i}", prompt, p, kv_transfer=params)
    finals, on_p, p_steps = {}, set(), 0
    for _ in range(2000):
        busy_d = decode.engine.has_unfinished_requests()
        if not (busy_d or prefill.engine.has_unfinished_requests()):
            break
        for out in decode.engine.step() if busy_d else ():
            i = int(out.request_id[1:])
            if out.kv_target is not None and out.request_id not in on_p:
                on_p.add(out.request_id)
                transfer = KVTransferParams(
                    PDRole.PREFILL, out.kv_target.transfer_id, target=out.kv_target
                )
                prefill.engine.add_request(out.request_id, prompts[i], all_params[i], transfer)
            if out.finished:
                finals[out.request_id] = out
        if prefill.engine.has_unfinished_requests():
            prefill.engine.step()
            p_steps += 1
            if abort is not None and p_steps == abort[2]:
                side = prefill if abort[0] == "P" else decode
                out = side.engine.abort_request(abort[1])
                if side is decode:
                    finals[out.request_id] = out
    return finals


def reference(llm_factory, prompts, all_params, **options) -> list:
    single = llm_factory(**options)
    return [(o.token_ids, o.exit_depths) for o in single.generate(prompts, list(all_params))]


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_layout="last_exited"),
        dict(kv_layout="shared"),
        dict(scheduling_mode="no_refill"),
        dict(kv_cache_dtype="fp8"),
        dict(kv_cache_dtype="fp8", kv_layout="shared"),
    ],
    ids=["last_exited", "shared", "no_refill", "fp8_kv", "fp8_kv_shared"],
)
def test_pd_output_equals_a_single_engine(llm_factory, options):
    all_params = [params(i) for i in range(len(PROMPTS))]
    expected = reference(llm_factory, PROMPTS, all_params, **options)
    prefill, decode, pair = loopback(llm_factory, **options)
    finals = run_pd(prefill, decode, PROMPTS, all_params)
    got = [(finals[f"r{i}"].token_ids, finals[f"r{i}"].exit_depths) for i in range(len(PROMPTS))]
    assert got == expected
    assert all(finals[f"r{i}"].finish_reason == "length" for i in range(len(PROMPTS)))
    # every prompt position went over the port exactly once (chunks of 5 positions)
    assert pair.written == {f"t{i}": len(p) for i, p in enumerate(PROMPTS)}


def test_prefix_hits_on_the_decode_side_are_not_sent_again(llm_factory):
    all_params = [params(1)] * 2
    prompts = PROMPTS[:2]
    expected = reference(llm_factory, prompts, all_params)
    prefill, decode, pair = loopback(llm_factory, dict(enable_prefix_caching=True))
    first = run_pd(prefill, decode, prompts[:1], all_params[:1])
    assert (first["r0"].token_ids, first["r0"].exit_depths) == expected[0]
    assert pair.written == {"t0": 13}
    second = run_pd(prefill, decode, prompts[1:], all_params[1:])
    assert (second["r0"].token_ids, second["r0"].exit_depths) == expected[1]
    # 12 positions (3 full pages) were cached on D: only the last 4 of 16 were sent
    assert decode.get_stats().prefix_cache_hit_tokens == 12
    assert pair.written == {"t0": 13 + 4}


def test_a_prefix_cached_on_the_prefill_side_but_not_on_the_decode_side_is_sent(llm_factory):
    """P computed a prompt for one decode instance; the same prompt then goes to another D
    that has none of it cached: P's prefix-cache hit covers positions it does not compute
    again, and they must still reach D (they go with P's first computed chunk)."""
    all_params = [params(1)]
    prompt = PROMPTS[1]  # 16 tokens: 3 full pages cached on P after the first request
    expected = reference(llm_factory, [prompt], all_params)
    prefill = llm_factory(pd_role="prefill", enable_prefix_caching=True)
    first = llm_factory(pd_role="decode")
    second = llm_factory(pd_role="decode")
    agent = connect_nixl(prefill, first)
    assert connect_nixl(prefill, second) == agent
    once = run_pd(prefill, first, [prompt], all_params, prefill_agent=agent, transfer="a")
    again = run_pd(prefill, second, [prompt], all_params, prefill_agent=agent, transfer="b")
    assert prefill.get_stats().prefix_cache_hit_tokens == 12  # P did not compute them again
    for finals in (once, again):
        assert (finals["r0"].token_ids, finals["r0"].exit_depths) == expected[0]


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("side", ["P", "D"])
def test_abort_during_transfer_frees_both_sides(llm_factory, side, layout):
    """A long prompt in chunks of 5: abort it after P's second step on either side. Both
    engines end with every block and row free (the leak check of llm_factory), the aborted
    request reports "abort", and the other request is unaffected."""
    all_params = [params(0), params(1)]
    prompts = [list(range(1, 40)), PROMPTS[1]]
    expected = reference(llm_factory, prompts, all_params, kv_layout=layout)
    prefill, decode, _ = loopback(llm_factory, kv_layout=layout)
    finals = run_pd(prefill, decode, prompts, all_params, abort=(side, "r0", 2))
    assert finals["r0"].finish_reason == "abort"
    assert (finals["r1"].token_ids, finals["r1"].exit_depths) == expected[1]
    for llm in (prefill, decode):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_pd_over_nixl_equals_a_single_engine(llm_factory, layout):
    """The real transport in one process: KV and the final hidden state go through NIXL
    WRITEs with notifications (UCX over host memory), prompts chunked by 5 and ending
    mid-block; D's output equals a single engine's, tokens and exit depths."""
    all_params = [params(i) for i in range(len(PROMPTS))]
    expected = reference(llm_factory, PROMPTS, all_params, kv_layout=layout)
    prefill = llm_factory(kv_layout=layout, pd_role="prefill")
    decode = llm_factory(kv_layout=layout, pd_role="decode")
    agent = connect_nixl(prefill, decode)
    finals = run_pd(prefill, decode, PROMPTS, all_params, prefill_agent=agent)
    got = [(finals[f"r{i}"].token_ids, finals[f"r{i}"].exit_depths) for i in range(len(PROMPTS))]
    assert got == expected
    assert (
        prefill.engine.parts.pd.transport.posted["prepped"]
        + prefill.engine.parts.pd.transport.posted["explicit"]
        > 0
    )


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("side", ["P", "D"])
def test_abort_over_nixl_then_reuse_the_request_id_at_once(llm_factory, side, layout):
    """Abort mid-transfer over the real transport, then submit the same request id again at
    once (a fresh transfer id): the new request gets its own blocks (the aborted transfer's
    stay held until P drained), no late write of the old transfer reaches it, and its output
    equals a single engine's."""
    all_params = [params(0), params(1)]
    prompts = [list(range(1, 40)), PROMPTS[1]]
    expected = reference(llm_factory, prompts, all_params, kv_layout=layout)
    prefill = llm_factory(pd_role="prefill", kv_layout=layout)
    decode = llm_factory(pd_role="decode", kv_layout=layout)
    agent = connect_nixl(prefill, decode)
    finals = run_pd(
        prefill, decode, prompts, all_params, abort=(side, "r0", 2), prefill_agent=agent
    )
    assert finals["r0"].finish_reason == "abort"
    assert (finals["r1"].token_ids, finals["r1"].exit_depths) == expected[1]
    again = run_pd(prefill, decode, prompts[:1], all_params[:1], prefill_agent=agent, transfer="u")
    assert (again["r0"].token_ids, again["r0"].exit_depths) == expected[0]
    for llm in (prefill, decode):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


def test_a_failed_admission_step_on_the_decode_side_aborts_and_frees_it(llm_factory):
    """D's block-table upload fails in the step that admits r0 (R04): the runner drops r0's
    row, so its target is never published; r0 ends with an error, no engine holds a block or
    row (llm_factory's leak check), and the next request runs as on a single engine."""
    all_params = [params(0), params(1)]
    expected = reference(llm_factory, PROMPTS[1:2], all_params[1:])
    prefill, decode, _ = loopback(llm_factory)
    rows = decode.engine.core.runner.rows
    original = rows.apply_block_updates

    def fail_for_r0(updates):
        if any(identity.request_id == "r0" for identity, _ in updates):
            raise RuntimeError("simulated upload fault")
        return original(updates)

    rows.apply_block_updates = fail_for_r0
    failed = run_pd(prefill, decode, PROMPTS[:1], all_params[:1])
    assert failed["r0"].finish_reason == "abort" and "admitted" in failed["r0"].error
    assert not prefill.engine.has_unfinished_requests()
    rows.apply_block_updates = original
    ok = run_pd(prefill, decode, PROMPTS[1:2], all_params[1:], transfer="u")
    assert (ok["r0"].token_ids, ok["r0"].exit_depths) == expected[0]


def test_a_failed_step_on_the_prefill_side_leaks_nothing(llm_factory):
    """P's block-table upload fails in the step that admits r0: P aborts it (R04) and, as for
    an abort, its PD link releases what the request held (no transfer had started); D's
    request is then cancelled (the coordinator's part) and frees its blocks too."""
    prefill, decode, _ = loopback(llm_factory)
    rows = prefill.engine.core.runner.rows
    original = rows.apply_block_updates

    def fail_for_r0(updates):
        if any(identity.request_id == "r0" for identity, _ in updates):
            raise RuntimeError("simulated upload fault")
        return original(updates)

    rows.apply_block_updates = fail_for_r0
    finals = run_pd(prefill, decode, PROMPTS[:1], [params(0)], abort=("D", "r0", 2))
    assert finals["r0"].finish_reason == "abort"
    assert prefill.get_stats().aborted_requests == 1
    assert prefill.get_stats().kv_blocks_used == 0


def test_a_prompt_from_fresh_engines_moves_as_one_descriptor_per_plane_layer_and_tensor(
    llm_factory,
):
    """Each plane's pages are consecutive blocks on both fresh engines, so the pages of a plane
    merge into one range per (tensor, layer): 2 x 2 layers x 4 planes descriptors for a
    16-token prompt, not one per page as well (x 4 here; x 32 pages, 6144 descriptors, for a
    512-token prompt of Ouro-1.4B's shape)."""
    options = dict(prefill_chunk_size=16, max_num_batched_tokens=16)
    prefill = llm_factory(pd_role="prefill", **options)
    decode = llm_factory(pd_role="decode", **options)
    agent = connect_nixl(prefill, decode)
    transport = prefill.engine.parts.pd.transport
    posted = []
    write = transport.write

    def recording_write(peer, partition, notification, **kwargs):
        posted.append(len(partition.descriptors))
        return write(peer, partition, notification, **kwargs)

    transport.write = recording_write
    prompt = list(range(1, 17))  # 4 full pages of 4 tokens
    expected = reference(llm_factory, [prompt], [params(1)], **options)
    finals = run_pd(prefill, decode, [prompt], [params(1)], prefill_agent=agent)
    assert [(finals["r0"].token_ids, finals["r0"].exit_depths)] == expected
    assert posted == [2 * 2 * 4]


def test_the_default_inflight_bound_holds_two_steps_of_prompt_kv(llm_factory):
    """P posts a step's chunks after collecting it while the next step computes: the default
    bound on unfinished writes holds two steps' prompt KV (K and V, every layer and plane),
    never less than 256 MiB; a given --pd-max-inflight-bytes wins."""
    tokens = 1 << 17
    prefill = llm_factory(pd_role="prefill", max_num_batched_tokens=tokens)
    keys = prefill.engine.core.runner.kv.tensors.key_cache
    layers, _, block_size, heads, head_dim = keys.shape
    per_token = 2 * layers * heads * head_dim * keys.element_size() * 4  # 4 planes
    sender = prefill.engine.parts.pd.port.sender
    assert sender.config.max_inflight_bytes == 2 * tokens * per_token > 256 << 20
    small = llm_factory(pd_role="prefill")
    assert small.engine.parts.pd.port.sender.config.max_inflight_bytes == 256 << 20
    given = llm_factory(pd_role="prefill", pd_max_inflight_bytes=3 << 20)
    assert given.engine.parts.pd.port.sender.config.max_inflight_bytes == 3 << 20


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_decode_instance_speculates_after_the_handoff(llm_factory, layout):
    """A speculative decode instance (K = 3, D = 2) continues handed-off prompts with rounds:
    greedy tokens and exit depths equal a single engine without speculation."""
    all_params = [
        SamplingParams(max_tokens=8 + i, exit_threshold=0.55, min_loops=1, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    expected = reference(llm_factory, PROMPTS, all_params, kv_layout=layout)
    speculative = dict(kv_layout=layout, num_speculative_tokens=3, speculative_draft_loops=2)
    prefill, decode, _ = loopback(llm_factory, speculative, kv_layout=layout)
    finals = run_pd(prefill, decode, PROMPTS, all_params)
    got = [(finals[f"r{i}"].token_ids, finals[f"r{i}"].exit_depths) for i in range(len(PROMPTS))]
    assert got == expected
    assert decode.get_stats().spec_drafts > 0


def test_abort_on_the_decode_side_before_prefill_heard_of_it_frees_its_blocks(llm_factory):
    """D admitted a request and reported its target, then the client went away before any
    prefill instance got the request: D aborts it, holds its blocks while a late write could
    still come, and frees them once the lease expired. Driven through CoreLoop (what the
    serving loops run): the front end's last statistics show every block free (the step that
    left the core idle produced no delta and used to send none, so the front end kept
    reporting the held blocks). The same request id then runs again correctly."""
    import time

    from rlt.engine.core_loop import CoreLoop
    from rlt_contracts import CoreAbort, CoreAdd, EngineRequest

    timeouts = dict(pd_write_timeout_s=0.1, pd_kv_lease_s=0.3)
    prefill = llm_factory(pd_role="prefill", **timeouts)
    decode = llm_factory(pd_role="decode", **timeouts)
    agent = connect_nixl(prefill, decode)
    prompt = list(range(1, 40))
    transfer = KVTransferParams(PDRole.DECODE, "t-gone", prefill_agent=agent)
    loop = CoreLoop(decode.engine.core)
    request = EngineRequest("r0", tuple(prompt), params(0), 0.0, transfer)
    loop.handle("fe", CoreAdd(1, (request,)))
    received = []
    while not any(d.kv_target is not None for o in received for d in o.deltas):
        loop.step()
        received.extend(loop.take_outputs().values())
    assert received[-1].stats.kv_blocks_used > 0  # admitted: its blocks are reserved
    loop.handle("fe", CoreAbort(("r0",)))
    deadline = time.monotonic() + 10
    while loop.has_work:  # the held transfer keeps the loop stepping until the lease expired
        assert time.monotonic() < deadline, "D never released the aborted request's blocks"
        loop.step()
        received.extend(loop.take_outputs().values())
    [final] = [d for o in received for d in o.deltas if d.finished]
    assert final.finish_reason == "abort"
    assert received[-1].stats.kv_blocks_used == 0
    expected = reference(llm_factory, [prompt], [params(0)])
    again = run_pd(prefill, decode, [prompt], [params(0)], prefill_agent=agent, transfer="u")
    assert (again["r0"].token_ids, again["r0"].exit_depths) == expected[0]
