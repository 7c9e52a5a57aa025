"""Siblings (`EngineRequest.sibling_group`, e.g. the n choices of one prompt) compute their
prompt once with a prefix cache: one is admitted, the others wait until its prompt pages are
published (read back, R18), then start after the reused pages. Without a prefix cache they run
as independent requests."""

from __future__ import annotations

import pytest
from rlt_contracts import EngineRequest, PageScores, PrefixMatch, RequestStage, SamplingParams
from rlt_scheduler import Scheduler, SchedulerConfig
from scheduler_harness import CountingKV, FakeDevice, run_until_idle

BLOCK = 4


class PublishingKV(CountingKV):
    """CountingKV plus a prefix cache of published prompt extents (whole pages of prompt[:-1],
    as rlt-kv publishes them), per salt, with the pages' score records."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.published: dict[tuple[int, ...], int] = {}
        self.salted: dict[tuple[bytes, tuple[int, ...]], int] = {}
        self.records: dict[tuple[bytes, tuple[int, ...], int], PageScores] = {}
        self.hits: list[int] = []

    def match_prefix(self, prompt, *, salt=b"", score_top_n=None):
        tokens = self.salted.get((salt, tuple(prompt)), 0)
        pages = tokens // self.block_size
        scores = []
        if score_top_n is not None:
            for page in range(pages):
                record = self.records.get((salt, tuple(prompt), page))
                if record is None or record.top_n < score_top_n:
                    break
                scores.append(record)
            pages = len(scores)
        return PrefixMatch(
            keys=tuple(b"k" for _ in range(pages)),
            blocks=tuple((0,) * self.num_planes for _ in range(pages)),
            num_tokens=pages * self.block_size,
            scores=tuple(scores),
        )

    def allocate(self, identity, num_tokens, prefix, *, prompt_length=0):
        updates = super().allocate(identity, num_tokens, prefix, prompt_length=prompt_length)
        if updates is not None:
            self.hits.append(prefix.num_tokens)
        return updates

    def publish_prefix(self, identity, prompt, computed, *, salt=b"", page_scores=None):
        pages = min(computed, len(prompt) - 1) // self.block_size
        key = tuple(prompt)
        self.salted[salt, key] = max(self.salted.get((salt, key), 0), pages * self.block_size)
        self.published[key] = self.salted[salt, key]
        if page_scores is not None:
            for page in range(pages):
                start = page * self.block_size
                self.records[salt, key, page] = page_scores(start, start + self.block_size)
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
                assert kv.published[PROMPT] == 60
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
    assert set(kv.salted) == {(b"exit-depth:hazard:2:4:1.0:" if at_exit_depth else b"", PROMPT)}


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


def test_a_sibling_with_another_prompt_is_not_held():
    scheduler, kv = make(prefix_caching=True)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    scheduler.add_requests(
        [
            EngineRequest("a", PROMPT, params, sibling_group="g"),
            EngineRequest("b", PROMPT[:-1] + (3,), params, sibling_group="g"),
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
