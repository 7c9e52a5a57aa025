"""Prefix waits (`prefix_waits.py`): with a prefix cache, a waiting request whose leading pages
a running request is computing waits until they are read back (R18) and is then admitted with
the prefix-cache hit (their score records too, for a scored prompt): the n choices of one
prompt (`EngineRequest.sibling_group`) and the choices of a question submitted together compute
the shared part once. Only for a substantial share (at least half of the waiting prompt) that
the computing request's pages serve (salt, alternatives, the token after the last page);
waiters are released when the computing request leaves; without a prefix cache everything
runs independently."""

from __future__ import annotations

import pytest
from rlt_contracts import (
    EngineRequest,
    PageScores,
    PrefixMatch,
    RequestStage,
    SamplingParams,
    SchedulerConfig,
)
from rlt_scheduler import Scheduler
from scheduler_harness import CountingKV, FakeDevice, run_until_idle

BLOCK = 4


class PublishingKV(CountingKV):
    """CountingKV plus a prefix cache keyed as rlt-kv keys it: page i of a prompt under a salt
    is named by the salt and every token up to the page's end (what a chained hash names);
    only full pages of prompt[:-1] are published, each with its score records keyed by (page
    key, next token). `published[salt, prompt]`: positions published for that prompt."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.cached: set[bytes] = set()
        self.records: dict[tuple[bytes, int], PageScores] = {}
        self.published: dict[tuple[bytes, tuple[int, ...]], int] = {}
        self.hits: list[int] = []

    def page_keys(self, prompt, *, salt=b""):
        pages = (len(prompt) - 1) // self.block_size
        block = self.block_size
        return tuple(repr((salt, tuple(prompt[: (i + 1) * block]))).encode() for i in range(pages))

    def match_prefix(self, prompt, *, salt=b"", score_top_n=None):
        keys, scores = [], []
        for page, key in enumerate(self.page_keys(prompt, salt=salt)):
            if key not in self.cached:
                break
            if score_top_n is not None:
                record = self.records.get((key, prompt[(page + 1) * self.block_size]))
                if record is None or record.top_n < score_top_n:
                    break
                scores.append(record)
            keys.append(key)
        return PrefixMatch(
            keys=tuple(keys),
            blocks=tuple((0,) * self.num_planes for _ in keys),
            num_tokens=len(keys) * self.block_size,
            scores=tuple(scores),
        )

    def allocate(self, identity, num_tokens, prefix, *, prompt_length=0):
        updates = super().allocate(identity, num_tokens, prefix, prompt_length=prompt_length)
        if updates is not None:
            self.hits.append(prefix.num_tokens)
        return updates

    def publish_prefix(self, identity, prompt, computed, *, salt=b"", page_scores=None):
        pages = min(computed, len(prompt) - 1) // self.block_size
        keys = self.page_keys(prompt, salt=salt)[:pages]
        self.cached.update(keys)
        extent = (salt, tuple(prompt))
        self.published[extent] = max(self.published.get(extent, 0), pages * self.block_size)
        if page_scores is not None:
            for page, key in enumerate(keys):
                start, end = page * self.block_size, (page + 1) * self.block_size
                slot = (key, prompt[end])
                old = self.records.get(slot)
                if old is None or old.top_n < page_scores(start, end).top_n:
                    self.records[slot] = page_scores(start, end)
        return pages


def make(prefix_caching: bool, **config) -> tuple[Scheduler, PublishingKV]:
    kv = PublishingKV(1000, BLOCK, 4)
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=16)
    scheduler = Scheduler(
        SchedulerConfig(**{**defaults, **config}),
        kv,
        model_depth=4,
        vocab_size=1000,
        max_model_len=4096,
        eos_token_ids=(0,),
        prefix_caching=prefix_caching,
    )
    return scheduler, kv


def siblings(prompt, count, group="g", max_tokens=3):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [
        EngineRequest(f"{group}-{i}", tuple(prompt), params, sibling_group=group)
        for i in range(count)
    ]


def prefilled_tokens(steps):
    return sum(len(c.token_ids) for step in steps for c in step.prefill)


PROMPT = tuple(range(10, 74))  # 64 tokens: 15 full pages of prompt[:-1] (60 tokens)


def test_siblings_compute_the_prompt_once_and_reuse_every_full_page():
    scheduler, kv = make(prefix_caching=True)
    scheduler.add_requests(siblings(PROMPT, 4))
    steps, finals = run_until_idle(scheduler, FakeDevice(kv, depth=lambda rid, i: 2))
    assert [n.identity.request_id for n in steps[0].new_requests] == ["g-0"]
    assert sorted(finals) == ["g-0", "g-1", "g-2", "g-3"]
    assert all(len([t for d in finals[r] for t in d.token_ids]) == 3 for r in finals)
    assert kv.hits == [0, 60, 60, 60]
    # the prompt once, then per sibling only what follows the last full page of prompt[:-1]
    assert prefilled_tokens(steps) == 64 + 3 * (64 - 60)


def test_siblings_wait_until_the_prompt_is_read_back_not_only_scheduled():
    scheduler, kv = make(prefix_caching=True)
    scheduler.add_requests(siblings(PROMPT, 3))
    device = FakeDevice(kv, depth=lambda rid, i: 2)
    pending = []
    admitted_at = {}
    for step_index in range(40):
        if not scheduler.has_unfinished_requests() and not pending:
            break
        step = scheduler.schedule()
        for new in step.new_requests:
            admitted_at[new.identity.request_id] = step_index
            # a sibling is admitted only once the prompt's pages are published
            if new.identity.request_id != "g-0":
                assert kv.published[b"", PROMPT] == 60
        pending.append(device.execute(step))
        while len(pending) > (1 if step.has_work else 0):
            scheduler.update_from_output(pending.pop(0))
        scheduler.take_outputs()
    # 64 tokens in chunks of 16: scheduled in steps 0..3, read back after step 4 is scheduled
    assert admitted_at["g-0"] == 0
    assert admitted_at["g-1"] == admitted_at["g-2"] == 5
    assert kv.hits == [0, 60, 60]


def test_without_a_prefix_cache_siblings_run_independently():
    scheduler, kv = make(prefix_caching=False)
    scheduler.add_requests(siblings(PROMPT, 4))
    first = scheduler.schedule()
    assert len(first.new_requests) == 4
    assert scheduler.waiting_request_ids() == []


def scored_prompt(finals, request_id):
    delta = next(d for d in finals[request_id] if d.prompt_logprobs is not None)
    return delta.prompt_logprobs, delta.prompt_top_logprobs, delta.prompt_exit_depths


@pytest.mark.parametrize("at_exit_depth", [False, True])
def test_scored_siblings_compute_the_prompt_once_and_take_its_scores(at_exit_depth):
    """Siblings scoring their prompt (prompt_logprobs) wait for the first like plain ones: the
    pages they reuse carry its scores (under the exit rule's salt at exit depth), so each gets
    every prompt token's score, the reused ones from the records, trimmed to its n."""
    scheduler, kv = make(prefix_caching=True)
    params = SamplingParams(
        max_tokens=2, ignore_eos=True, prompt_logprobs=2, score_at_exit_depth=at_exit_depth
    )
    scheduler.add_requests(
        [EngineRequest(f"s-{i}", PROMPT, params, sibling_group="s") for i in range(3)]
    )
    steps, finals = run_until_idle(scheduler, FakeDevice(kv, depth=lambda rid, i: 2))
    assert [n.identity.request_id for n in steps[0].new_requests] == ["s-0"]
    assert kv.hits == [0, 60, 60]
    assert prefilled_tokens(steps) == 64 + 2 * 4
    want = scored_prompt(finals, "s-0")
    assert want[0] == (None, *(-(p + 1) / 8 for p in range(63)))
    assert want[2] == ((None, *(2,) * 63) if at_exit_depth else None)
    assert scored_prompt(finals, "s-1") == scored_prompt(finals, "s-2") == want
    assert set(kv.published) == {(b"exit-depth:hazard:2:4:1.0:" if at_exit_depth else b"", PROMPT)}


def test_a_sibling_wanting_more_alternatives_than_the_records_hold_computes_its_prompt():
    scheduler, kv = make(prefix_caching=True)
    scheduler.add_requests(
        [
            EngineRequest(
                f"s-{n}",
                PROMPT,
                SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=n),
                sibling_group="s",
            )
            for n in (1, 3)
        ]
    )
    steps, _ = run_until_idle(scheduler, FakeDevice(kv, depth=lambda rid, i: 2))
    assert len(steps[0].new_requests) == 2  # s-3 does not wait for records of 1 alternative
    assert kv.hits == [0, 0]


def test_an_aborted_computing_sibling_hands_the_prompt_to_the_next():
    scheduler, kv = make(prefix_caching=True)
    scheduler.add_requests(siblings(PROMPT, 3))
    scheduler.schedule()
    assert scheduler.running_request_ids() == ["g-0"]
    scheduler.abort_request("g-0")
    step = scheduler.schedule()
    assert [n.identity.request_id for n in step.new_requests] == ["g-1"]
    assert scheduler.waiting_request_ids() == ["g-2"]
    scheduler.abort_request("g-1")
    scheduler.abort_request("g-2")
    assert not scheduler.has_unfinished_requests()


def test_held_siblings_do_not_block_other_requests():
    scheduler, kv = make(prefix_caching=True, max_admission_bypasses=1)
    scheduler.add_requests(siblings(PROMPT, 4))
    other = SamplingParams(max_tokens=2, ignore_eos=True)
    scheduler.add_requests([EngineRequest(f"o{i}", (5, 6, 7), other) for i in range(3)])
    step = scheduler.schedule()
    assert [n.identity.request_id for n in step.new_requests] == ["g-0", "o0", "o1", "o2"]
    for request_id in ("g-1", "g-2", "g-3"):
        assert scheduler.get_request(request_id).bypass_count == 0
        assert scheduler.get_request(request_id).stage is RequestStage.WAITING


def test_a_group_member_with_another_last_token_still_shares_every_page():
    """The rule looks at pages, not groups: b differs from a only in its last token, which is
    never in a published page, so it waits for a's 15 pages like a sibling with a's prompt."""
    scheduler, kv = make(prefix_caching=True)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    scheduler.add_requests(
        [
            EngineRequest("a", PROMPT, params, sibling_group="g"),
            EngineRequest("b", PROMPT[:-1] + (3,), params, sibling_group="g"),
        ]
    )
    device = FakeDevice(kv, depth=lambda rid, i: 2)
    step = scheduler.schedule()
    assert [n.identity.request_id for n in step.new_requests] == ["a"]
    scheduler.update_from_output(device.execute(step))
    run_until_idle(scheduler, device)
    assert kv.hits == [0, 60]


def test_a_prompt_sharing_no_page_is_not_held():
    scheduler, kv = make(prefix_caching=True)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    scheduler.add_requests(
        [
            EngineRequest("a", PROMPT, params, sibling_group="g"),
            EngineRequest("b", (9, *PROMPT[1:]), params, sibling_group="g"),  # differs in page 0
        ]
    )
    step = scheduler.schedule()
    assert [n.identity.request_id for n in step.new_requests] == ["a", "b"]


def test_a_preempted_computing_sibling_resumes_and_still_computes_the_prompt_once():
    scheduler, kv = make(
        prefix_caching=True,
        policy="priority",
        enable_preemption=True,
        incremental_kv=True,
        max_num_seqs=1,
    )
    low = SamplingParams(max_tokens=3, ignore_eos=True, priority=5)
    scheduler.add_requests(
        [EngineRequest(f"g-{i}", PROMPT, low, sibling_group="g") for i in range(3)]
    )
    device = FakeDevice(kv, depth=lambda rid, i: 2)
    first = scheduler.schedule()  # g-0 starts computing the prompt (16 of 64 positions)
    assert [n.identity.request_id for n in first.new_requests] == ["g-0"]
    scheduler.update_from_output(device.execute(first))
    vip = SamplingParams(max_tokens=2, ignore_eos=True, priority=0)
    scheduler.add_requests([EngineRequest("vip", (5, 6, 7), vip)])
    steps, finals = run_until_idle(scheduler, device)
    steps = [first, *steps]
    assert any(s.snapshots for s in steps) and any(s.restores for s in steps)
    assert sorted(finals) == ["g-0", "g-1", "g-2", "vip"]
    assert kv.hits == [0, 0, 0, 60, 60]  # g-0, vip, g-0 resumed (its snapshot), the siblings
    assert prefilled_tokens(steps) == 64 + 3 + 2 * (64 - 60)


def test_waiting_siblings_do_not_count_toward_the_admission_scan_limit():
    scheduler, kv = make(prefix_caching=True, admission_scan_limit=4)
    scheduler.add_requests(siblings(PROMPT, 10))
    scheduler.schedule()  # g-0 computes; g-1..g-9 wait for it
    other = SamplingParams(max_tokens=2, ignore_eos=True)
    scheduler.add_requests([EngineRequest("late", (5, 6, 7), other)])
    step = scheduler.schedule()
    assert [n.identity.request_id for n in step.new_requests] == ["late"]


CONTEXT = tuple(range(100, 150))  # 50 tokens: 12 full pages, then 2 more context tokens
CHOICES = [(7,), (8, 9), (10, 11, 12), (13,)]
KINDS = {
    "plain": SamplingParams(max_tokens=2, ignore_eos=True),
    "scored": SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2),
    "exit_depth": SamplingParams(
        max_tokens=2, ignore_eos=True, prompt_logprobs=1, score_at_exit_depth=True
    ),
}


def choices(params, context=CONTEXT, name="c"):
    return [EngineRequest(f"{name}{i}", context + c, params) for i, c in enumerate(CHOICES)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_choices_submitted_together_compute_their_context_once(kind):
    """The 4 choices of a question queued before one step, with no group (one list-of-prompts
    completion): the first computes the context, the others wait for its 12 pages to be read
    back, then take them (and their scores) and compute only their last positions."""
    scheduler, kv = make(prefix_caching=True)
    requests = choices(KINDS[kind])
    scheduler.add_requests(requests)
    steps, finals = run_until_idle(scheduler, FakeDevice(kv, depth=lambda rid, i: 2))
    assert [n.identity.request_id for n in steps[0].new_requests] == ["c0"]
    assert kv.hits == [0, 48, 48, 48]
    prompts = [r.prompt_token_ids for r in requests]
    assert prefilled_tokens(steps) == len(prompts[0]) + sum(len(p) - 48 for p in prompts[1:])
    if kind != "plain":  # every prompt token scored, the reused ones from the records
        for request, prompt in zip(requests, prompts, strict=True):
            logprobs, _, depths = scored_prompt(finals, request.request_id)
            assert logprobs == (None, *(-(p + 1) / 8 for p in range(len(prompt) - 1)))
            want_depths = (None, *(2,) * (len(prompt) - 1))
            assert depths == (want_depths if kind == "exit_depth" else None)
    assert kv.pages == {}  # every request's blocks returned


@pytest.mark.parametrize("kind", ["plain", "scored"])
def test_a_context_ending_on_a_page_boundary_shares_one_page_less_when_scored(kind):
    """Context of 48 tokens: its 12th page's last position scores each choice's own first
    token, so that page's record serves no other choice; a scored choice waits for and reuses
    11 pages, a plain one all 12."""
    scheduler, kv = make(prefix_caching=True)
    scheduler.add_requests(choices(KINDS[kind], context=CONTEXT[:48]))
    run_until_idle(scheduler, FakeDevice(kv, depth=lambda rid, i: 2))
    shared = 44 if kind == "scored" else 48
    assert kv.hits == [0, shared, shared, shared]


def test_an_aborted_computing_request_releases_its_waiters():
    scheduler, kv = make(prefix_caching=True)
    scheduler.add_requests(choices(KINDS["scored"]))
    device = FakeDevice(kv, depth=lambda rid, i: 2)
    first = scheduler.schedule()
    assert scheduler.running_request_ids() == ["c0"]
    assert scheduler.waiting_request_ids() == ["c1", "c2", "c3"]
    scheduler.abort_request("c0")  # its first chunk is in flight: nothing was published
    scheduler.update_from_output(device.execute(first))
    second = scheduler.schedule()
    assert [n.identity.request_id for n in second.new_requests] == ["c1"]  # computes it now
    assert scheduler.waiting_request_ids() == ["c2", "c3"]  # ... and they wait for c1
    scheduler.update_from_output(device.execute(second))
    steps, finals = run_until_idle(scheduler, device)
    assert sorted(finals) == ["c0", "c1", "c2", "c3"]
    assert kv.hits == [0, 0, 48, 48]
    assert kv.pages == {}


def test_a_plain_prompt_waits_for_a_scored_one_but_not_the_other_way_round():
    """Full-depth scored pages hold prefill's KV: a plain prompt reuses them. A plain prompt's
    pages carry no scores, and exit-depth pages are salted: those give no hit, so nobody waits
    for them."""
    scored, plain, exit_depth = KINDS["scored"], KINDS["plain"], KINDS["exit_depth"]
    for first, second in ((plain, scored), (scored, exit_depth), (exit_depth, plain)):
        scheduler, kv = make(prefix_caching=True)
        scheduler.add_requests(
            [EngineRequest("a", CONTEXT + (1,), first), EngineRequest("b", CONTEXT + (2,), second)]
        )
        assert [n.identity.request_id for n in scheduler.schedule().new_requests] == ["a", "b"]
    scheduler, kv = make(prefix_caching=True)
    scheduler.add_requests(
        [EngineRequest("s", CONTEXT + (1,), scored), EngineRequest("p", CONTEXT + (2,), plain)]
    )
    run_until_idle(scheduler, FakeDevice(kv, depth=lambda rid, i: 2))
    assert kv.hits == [0, 48]
    assert kv.pages == {}


@pytest.mark.parametrize(("length", "waits"), [(16, True), (17, False), (40, False)])
def test_only_a_share_of_at_least_half_the_prompt_is_waited_for(length, waits):
    """b shares 2 pages (8 tokens) with a: worth waiting for when they hold half of b's
    prompt (16 tokens), not for 17 or 40 (a short wait would save little of b's prefill)."""
    scheduler, kv = make(prefix_caching=True)
    params = KINDS["plain"]
    b_prompt = PROMPT[:8] + tuple(range(500, 500 + length - 8))
    scheduler.add_requests(
        [EngineRequest("a", PROMPT, params), EngineRequest("b", b_prompt, params)]
    )
    admitted = [n.identity.request_id for n in scheduler.schedule().new_requests]
    assert admitted == (["a"] if waits else ["a", "b"])
