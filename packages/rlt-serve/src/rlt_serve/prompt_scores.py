"""The prompt's scores in a completion: OpenAI's echo logprobs and vLLM's `prompt_logprobs`.

Both read a choice's prompt scores (`SamplingParams.prompt_logprobs`, one entry per prompt
token, None for the first), at full depth or, with `score_at_exit_depth`, each at its position's
exit depth (`prompt_exit_depths`: next to `prompt_logprobs` in the choice, and in the echo's
logprobs object). `echo` + `logprobs: N` puts them in the choice's `logprobs`
ahead of the generated tokens (text, offsets, each entry's top N plus the token itself);
`prompt_logprobs: N` adds vLLM's per-choice list: None, then per token {token id: {logprob,
rank, decoded_token}} for the prompt token and its top N. `max_tokens: 0` (with either) scores
without generating: the engine makes token 0 anyway, and it is left out of the response.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlt_serve.context import ServerContext
from rlt_serve.errors import invalid
from rlt_serve.request_schemas import CompletionRequest
from rlt_serve.response_schemas import CompletionLogprobs, PromptLogprob


def prompt_scores_wanted(body: CompletionRequest) -> int | None:
    """How many alternatives per prompt token the engine must score (None: no scoring)."""
    counts = [body.prompt_logprobs] if body.prompt_logprobs is not None else []
    if body.echo and body.logprobs is not None:
        counts.append(body.logprobs)
    if body.score_at_exit_depth and not counts:
        raise invalid(
            "score_at_exit_depth",
            "score_at_exit_depth: only applies to a scored prompt: set prompt_logprobs, or "
            "echo with logprobs",
        )
    if body.max_tokens == 0 and not counts:
        raise invalid(
            "max_tokens",
            "max_tokens: 0 scores the prompt without generating; it needs echo with logprobs "
            "or prompt_logprobs",
        )
    return max(counts) if counts else None


def echo_logprobs(ctx: ServerContext, prompt: Sequence[int], choice) -> CompletionLogprobs:
    """Echoed prompt tokens: text, offsets and log-probabilities with the top alternatives
    (null for the first token, which nothing predicts); at exit depth, their depths."""
    tokens = [ctx.token_text(t) for t in prompt]
    scored = choice.prompt_logprobs or (None,) * len(tokens)
    tops = choice.prompt_top_logprobs or (None,) * len(tokens)
    top_entries = []
    for token, logprob, top in zip(tokens, scored, tops, strict=True):
        if logprob is None:
            top_entries.append(None)
            continue
        entry = {ctx.token_text(t): lp for t, lp in top or ()}
        entry[token] = logprob
        top_entries.append(entry)
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    depths = choice.prompt_exit_depths
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=list(scored),
        top_logprobs=top_entries,
        text_offset=offsets,
        prompt_exit_depths=list(depths) if depths is not None else None,
    )


def prompt_exit_depths(choice) -> list[int | None] | None:
    """Per prompt token the loops of the state that scored it (None for the first), when the
    request scored its prompt at exit depth; else None."""
    depths = choice.prompt_exit_depths
    return list(depths) if depths is not None else None


def vllm_prompt_logprobs(
    ctx: ServerContext, prompt: Sequence[int], choice
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's shape: None for token 0, then {token id: {logprob, rank, decoded_token}} with the
    prompt token (its true rank) and the top alternatives (ranks 1..N)."""
    entries: list[dict[str, PromptLogprob] | None] = [None]
    scores = zip(
        prompt[1:],
        choice.prompt_logprobs[1:],
        choice.prompt_token_ranks[1:],
        choice.prompt_top_logprobs[1:],
        strict=True,
    )
    for token, logprob, rank, top in scores:
        entry = {
            str(t): PromptLogprob(logprob=lp, rank=i + 1, decoded_token=ctx.token_text(t))
            for i, (t, lp) in enumerate(top or ())
        }
        entry[str(token)] = PromptLogprob(
            logprob=logprob, rank=rank, decoded_token=ctx.token_text(token)
        )
        entries.append(entry)
    return entries
