"""Prefix reuse for scored prompts (`SamplingParams.prompt_logprobs`; README.md, "Scored
prompts and the prefix cache"): the scores travel with the pages as `PageScores` records, a
later scored prompt reuses only the leading pages whose records fit it, and exit-depth scoring
publishes its decode KV under a salt naming its exit rule. Pure functions of the request; the
scheduler applies them at admission (`take_cached_scores`) and at prompt progress (`publish`).
"""

from __future__ import annotations

from collections.abc import Callable

from rlt_contracts import KVPort, PageScores, PrefixMatch

from rlt_scheduler.request_state import ScheduledRequest


def prefix_salt(request: ScheduledRequest) -> bytes:
    """The prefix-cache salt of the KV `request`'s prompt leaves: none for prefill's at the
    model's depth (plain and scored prompts), its loop count for a prompt run at fewer loops
    (its request's max_loops), the exit rule for a prompt run at exit depth (its KV depends on
    every parameter that decides an exit; the engine's KV layout and model are fixed)."""
    if not request.sampling.score_at_exit_depth:
        loops = request.prompt_loops
        return b"" if loops is None else f"prompt-loops:{loops}".encode()
    rule = request.rule.exit
    return (
        f"exit-depth:{rule.kind.value}:{rule.min_loops}:{rule.max_loops}:{rule.threshold!r}:"
        f"{','.join(map(str, rule.trace_depths))}"
    ).encode()


def match(kv: KVPort, request: ScheduledRequest) -> PrefixMatch:
    """The cached prefix `request` may reuse (pure): prefill's pages for a plain prompt; for a
    scored one, only pages under its salt whose score records fit it."""
    return kv.match_prefix(
        request.prompt_token_ids,
        salt=prefix_salt(request),
        score_top_n=request.sampling.prompt_logprobs,
    )


def serves(computing: ScheduledRequest, request: ScheduledRequest) -> bool:
    """Whether the pages `computing` publishes will give `request` a hit: the same salt and, for
    a scored `request`, records with at least its alternatives."""
    if prefix_salt(computing) != prefix_salt(request):
        return False
    wanted = request.sampling.prompt_logprobs
    recorded = computing.sampling.prompt_logprobs
    return wanted is None or (recorded is not None and recorded >= wanted)


def take_cached_scores(request: ScheduledRequest, prefix: PrefixMatch) -> None:
    """A scored request admitted with `prefix` starts with the reused pages' scores (tokens
    1 .. prefix.num_tokens, each record trimmed to the request's alternatives); the runner scores
    the positions it computes, from the first chunk on (`PromptLogprobs.first_token` follows)."""
    top = request.sampling.prompt_logprobs
    if top is None:
        return
    for page in prefix.scores:
        request.prompt_scores.extend(
            zip(
                page.token_logprobs,
                page.token_ranks,
                (entry[:top] for entry in page.top_logprobs),
                strict=True,
            )
        )
        if request.sampling.score_at_exit_depth:
            request.prompt_exit_depths.extend(page.exit_depths)


def publish(kv: KVPort, request: ScheduledRequest, computed_tokens: int) -> None:
    """Publish the request's computed prompt pages under its salt, with its scores if scored
    (the step's scores are recorded before its progress is applied, so they cover the pages)."""
    kv.publish_prefix(
        request.identity,
        request.prompt_token_ids,
        computed_tokens,
        salt=prefix_salt(request),
        page_scores=_page_scores(request),
    )


def _page_scores(request: ScheduledRequest) -> Callable[[int, int], PageScores] | None:
    top = request.sampling.prompt_logprobs
    if top is None:
        return None
    at_exit_depth = request.sampling.score_at_exit_depth

    def scores(start: int, end: int) -> PageScores:
        # position p scores token p + 1, kept at prompt_scores[p]
        entries = request.prompt_scores[start:end]
        if len(entries) != end - start:
            raise RuntimeError(
                f"{request.identity}: positions [{start}, {end}) published without their scores"
            )
        return PageScores(
            top_n=top,
            token_logprobs=tuple(e[0] for e in entries),
            token_ranks=tuple(e[1] for e in entries),
            top_logprobs=tuple(e[2] for e in entries),
            exit_depths=tuple(request.prompt_exit_depths[start:end]) if at_exit_depth else (),
        )

    return scores
