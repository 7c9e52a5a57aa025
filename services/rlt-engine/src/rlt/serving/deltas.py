"""Turn the cumulative `RequestOutput`s of `LLMEngine` into `RequestOutputDelta`s for streaming.

`LLMEngine.step()` returns, for every request that progressed, the same growing
`RequestOutput` object. A frontend streams only what is new, so each live request keeps an
`OutputCursor` that remembers how much of the output it has already handed out.

Stop strings make text the one field that can shrink: the detokenizer appends a token's text
and then cuts everything from a matched stop string on. A delta must never contain text that a
later cut removes, so while a request runs the cursor holds back the last
`len(longest stop string) - 1` characters. That is enough: when no complete stop string is in
the text, a match can only start inside that tail (it has to reach past the current end).
The held-back text is released when the request finishes. A request that keeps its stop
string (`include_stop_str_in_output`) needs no hold-back: its text is cut right after the
match, which lies in text added by the same step, never before text already delivered.
"""

from __future__ import annotations

from rlt_contracts import RequestOutputDelta

from rlt.engine.outputs import RequestOutput


class OutputCursor:
    """How much of one request's cumulative output has been delivered (owned by the engine
    thread; never shared)."""

    def __init__(
        self, stop: tuple[str, ...] = (), *, include_stop_str_in_output: bool = False
    ) -> None:
        longest = 1 if include_stop_str_in_output else max((len(s) for s in stop), default=1)
        self._text_holdback = longest - 1
        self.tokens = 0  # token_ids / exit_depths / logprobs entries delivered
        self.text = 0  # characters of text delivered
        self.target_sent = False  # PD decode: the handoff target went out

    def advance(self, output: RequestOutput) -> RequestOutputDelta | None:
        """The delta since the previous call, or None when nothing new is deliverable."""
        start, end = self.tokens, len(output.token_ids)
        if output.finished:
            text_end = len(output.text)
        else:
            text_end = max(self.text, len(output.text) - self._text_holdback)
        target = output.kv_target if not self.target_sent else None
        if end == start and text_end == self.text and not output.finished and target is None:
            return None
        self.target_sent = self.target_sent or target is not None
        text = output.text[self.text : text_end]
        scored = start == 0 and end > 0 and output.prompt_logprobs is not None
        self.tokens, self.text = end, max(self.text, text_end)
        wants_logprobs = output.logprobs is not None
        return RequestOutputDelta(
            request_id=output.request_id,
            token_ids=tuple(output.token_ids[start:end]),
            exit_depths=tuple(output.exit_depths[start:end]),
            text=text,
            logprobs=tuple(output.logprobs[start:end]) if wants_logprobs else None,
            top_logprobs=(
                tuple(tuple(top) for top in output.top_logprobs[start:end])
                if wants_logprobs and output.top_logprobs is not None
                else None
            ),
            prompt_logprobs=tuple(output.prompt_logprobs) if scored else None,
            prompt_token_ranks=tuple(output.prompt_token_ranks) if scored else None,
            prompt_top_logprobs=(
                tuple(None if t is None else tuple(t) for t in output.prompt_top_logprobs)
                if scored
                else None
            ),
            finished=output.finished,
            finish_reason=output.finish_reason,
            num_prompt_tokens=len(output.prompt_token_ids),
            resolved_seed=output.seed,
            error=output.error,
            timings=output.timings if output.finished else None,
            kv_target=target,
        )


def merge_deltas(first: RequestOutputDelta, second: RequestOutputDelta) -> RequestOutputDelta:
    """One delta equivalent to `first` followed by `second` (same request)."""
    logprobs = first.logprobs
    top = first.top_logprobs
    if second.logprobs is not None:
        logprobs = (logprobs or ()) + second.logprobs
    if second.top_logprobs is not None:
        top = (top or ()) + second.top_logprobs
    return RequestOutputDelta(
        request_id=second.request_id,
        token_ids=first.token_ids + second.token_ids,
        exit_depths=first.exit_depths + second.exit_depths,
        text=first.text + second.text,
        logprobs=logprobs,
        top_logprobs=top,
        prompt_logprobs=first.prompt_logprobs or second.prompt_logprobs,
        prompt_token_ranks=first.prompt_token_ranks or second.prompt_token_ranks,
        prompt_top_logprobs=first.prompt_top_logprobs or second.prompt_top_logprobs,
        finished=second.finished,
        finish_reason=second.finish_reason,
        num_prompt_tokens=second.num_prompt_tokens or first.num_prompt_tokens,
        resolved_seed=second.resolved_seed
        if second.resolved_seed is not None
        else first.resolved_seed,
        error=second.error or first.error,
        timings=second.timings or first.timings,
        kv_target=first.kv_target or second.kv_target,
    )
