"""Sibling groups: one prompt computed once for the n choices of one request.

Siblings are requests with the same `EngineRequest.sibling_group` and the same prompt. With a
prefix cache, the first of the group to be admitted computes the prompt for all
(`ScheduledRequest.computes_group_prompt`); the others stay waiting until its computed prompt
covers the whole prompt, since pages are published only once their chunk is read back
(completion evidence, R18). They are then admitted and reuse every full page. Without a prefix
cache there is nothing to reuse, and siblings are scheduled as independent requests. Scored
siblings (`prompt_logprobs`) wait the same way: the pages they reuse carry the computing
sibling's scores (scored_prefix.py); a sibling whose hit those pages cannot be does not wait.

Pure functions of the request and the running list the scheduler passes in; the scheduler
writes `computes_group_prompt` when it admits a request.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlt_scheduler import scored_prefix
from rlt_scheduler.request_state import ScheduledRequest


def running_siblings(
    request: ScheduledRequest, running: Iterable[ScheduledRequest]
) -> list[ScheduledRequest]:
    """Admitted requests of `request`'s group with the same prompt."""
    if request.sibling_group is None:
        return []
    return [
        other
        for other in running
        if other.sibling_group == request.sibling_group
        and other is not request
        and other.prompt_token_ids == request.prompt_token_ids
    ]


def waits_for_sibling(
    request: ScheduledRequest, running: Iterable[ScheduledRequest], *, prefix_caching: bool
) -> bool:
    """The sibling that computes the group's prompt has not read it back yet: admitting
    `request` now would compute it a second time, since those pages are published only once
    the results are read back (completion evidence, R18). Never with no prefix cache to
    publish into, never for a preempted request (it restores its own snapshot), and never for
    pages that would not be its hit (another salt or fewer score alternatives:
    `scored_prefix.serves`)."""
    if not prefix_caching or request.preempted:
        return False
    return any(
        other.computes_group_prompt
        and other.computed_prompt_tokens < other.prompt_length
        and scored_prefix.serves(other, request)
        for other in running_siblings(request, running)
    )


def computes_group_prompt(request: ScheduledRequest, running: Iterable[ScheduledRequest]) -> bool:
    """Whether `request`, admitted now, computes the prompt for its group: it is the first of
    its group to run (no sibling runs: none computed it, or the one that did is gone and only
    its published pages remain)."""
    return request.sibling_group is not None and not running_siblings(request, running)
