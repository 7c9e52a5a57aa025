"""Prefix waits: a waiting request whose leading pages a running request is computing waits
for them instead of computing them a second time (README.md, "Prefix waits: shared pages
computed once", gives the rule, why half of the prompt, and why nothing deadlocks or starves).

Functions of the requests, the KV port's page keys and the running list the scheduler passes
in; the only state they write is each request's page keys, computed once on first need
(`ScheduledRequest.prompt_page_keys`), and never while nothing running has pages to publish.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlt_contracts import KVPort

from rlt_scheduler import scored_prefix
from rlt_scheduler.request_state import ScheduledRequest


def page_keys(kv: KVPort, request: ScheduledRequest) -> tuple[bytes, ...]:
    """The chained keys of `request`'s publishable pages under its salt (computed once: the
    prompt and the salt never change)."""
    if request.prompt_page_keys is None:
        request.prompt_page_keys = kv.page_keys(
            request.prompt_token_ids, salt=scored_prefix.prefix_salt(request)
        )
    return request.prompt_page_keys


def shared_pages(kv: KVPort, request: ScheduledRequest, computing: ScheduledRequest) -> int:
    """Leading pages of `request` that `computing`'s publication will give it as a hit (module
    docstring): equal chained keys under one salt, records that serve it, and for a scored
    `request` the same token after the last one."""
    if computing is request or not scored_prefix.serves(computing, request):
        return 0
    mine, theirs = page_keys(kv, request), page_keys(kv, computing)
    # chained keys: page k's keys are equal only if every earlier page's are, so the shared
    # run ends where they first differ (binary search for it)
    low, high = 0, min(len(mine), len(theirs))
    while low < high:
        middle = (low + high + 1) // 2
        if mine[middle - 1] == theirs[middle - 1]:
            low = middle
        else:
            high = middle - 1
    shared = low
    if shared and request.sampling.prompt_logprobs is not None:
        after = shared * kv.block_size  # inside both prompts: their pages are within prompt[:-1]
        if request.prompt_token_ids[after] != computing.prompt_token_ids[after]:
            shared -= 1  # the last page's record scores the other prompt's next token
    return shared


def worth_waiting(kv: KVPort, request: ScheduledRequest, pages: int) -> bool:
    """At least one page, holding at least half of the prompt (module docstring: why half)."""
    return pages > 0 and 2 * pages * kv.block_size >= request.prompt_length


def waits_for(kv: KVPort, request: ScheduledRequest, computing: ScheduledRequest) -> bool:
    """`computing` (running) has not yet read back the substantial shared pages of `request`."""
    pages = shared_pages(kv, request, computing)
    if not worth_waiting(kv, request, pages):
        return False
    read_back = min(computing.computed_prompt_tokens, computing.prompt_length - 1) // kv.block_size
    return read_back < pages


def waits_for_prefix(
    kv: KVPort,
    request: ScheduledRequest,
    running: Iterable[ScheduledRequest],
    *,
    prefix_caching: bool,
) -> bool:
    """`request` (waiting) waits for pages a running request computes and has not yet read
    back (module docstring). Never with no prefix cache, never for a preempted request."""
    if not prefix_caching or request.preempted:
        return False
    computing = [other for other in running if _unpublished(kv, other)]
    if not computing:
        return False  # the usual case while requests decode: no page hashed
    if not worth_waiting(kv, request, (request.prompt_length - 1) // kv.block_size):
        return False  # even all its pages shared would not be worth a wait
    return any(waits_for(kv, request, other) for other in computing)


def _unpublished(kv: KVPort, request: ScheduledRequest) -> bool:
    """Some of the request's publishable pages are not read back yet."""
    publishable = request.prompt_length - 1
    return min(request.computed_prompt_tokens, publishable) // kv.block_size < (
        publishable // kv.block_size
    )
