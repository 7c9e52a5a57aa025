"""`LLM`: offline batch generation, the simplest way to use rlt."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlt_contracts import EngineStats, InvalidRequestError, SamplingParams

from rlt.engine import EngineConfig, LLMEngine, RequestOutput

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


class LLM:
    """Load a model and generate.

    >>> llm = LLM()                                     # the bundled default model
    >>> out = llm.generate("It is a truth", SamplingParams(max_tokens=8, exit_threshold=0.7))
    >>> out[0].text, out[0].exit_depths

    Options are the engine's, by their flat names (`EngineConfig.from_options`: e.g. dtype,
    device, kv_layout, scheduling_mode, max_num_seqs, num_speculative_tokens); unknown ones
    raise ConfigurationError. `handoff_port`: with `pd_role`, the KV handoff port factory to
    use instead of NIXL's (`rlt.engine.pd_link.HandoffPortFactory`).
    """

    def __init__(
        self, model: str | Path | None = None, *, handoff_port=None, **options: Any
    ) -> None:
        self._start(EngineConfig.from_options(model=model, **options), handoff_port)

    @classmethod
    def from_config(cls, config: EngineConfig, *, handoff_port=None) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config, handoff_port)
        return llm

    def _start(self, config: EngineConfig, handoff_port) -> None:
        self.engine = LLMEngine(config, handoff_port=handoff_port)
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Abort what runs and release the engine's device memory (idempotent)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns finished outputs in input order.

        prompts: a string, a list of strings, or a list of token-id lists.
        sampling_params: one for all prompts, or one per prompt (default: `SamplingParams()`,
          greedy at the fixed depth: temperature 0, exit_threshold 1.0; `rlt generate` and
          the servers default to exit_threshold 0.5, docs/configuration.md).
        use_tqdm: show a progress bar on stderr: finished requests, and the tokens generated
          so far with their rate (default: when there are more than 8 prompts; `rlt generate`
          shows it when stderr is a terminal).
        """
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        if self.engine.has_unfinished_requests():
            raise RuntimeError("generate() needs an idle engine; another caller is using it")
        request_ids = [f"generate-{next(self._ids)}" for _ in batch]
        try:
            for request_id, prompt, p in zip(request_ids, batch, params, strict=True):
                self.engine.add_request(request_id, prompt, p)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        progress = _progress_bar(len(batch), use_tqdm)
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            for output in outputs:
                if output.finished:
                    results[output.request_id] = output
            if progress is not None:
                progress.step(outputs)
        if progress is not None:
            progress.close()
        return [results[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError(
            "prompts", "give a string, a list of strings or a list of token-id lists"
        )
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise InvalidRequestError(
            "prompts", "a single token-id prompt must be wrapped in a list: [[1, 2, 3]]"
        )
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise InvalidRequestError(
            "sampling_params", f"{len(params)} sampling params for {count} prompts"
        )
    return params


def _progress_bar(total: int, use_tqdm: bool | None) -> _Progress | None:
    if not (use_tqdm if use_tqdm is not None else total > 8):
        return None
    return _Progress(total)


class _Progress:
    """tqdm's bar of finished requests, with the tokens generated so far and their rate:
    `generating:  50%|#####     | 1/2 [00:03<00:03, 0.33req/s, 96 tokens, 31.2 tok/s]`."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="generating", unit="req")
        self.tokens: dict[str, int] = {}  # request id -> tokens generated (outputs are cumulative)

    def step(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self.tokens[output.request_id] = len(output.token_ids)
        finished = sum(1 for output in outputs if output.finished)
        generated = sum(self.tokens.values())
        elapsed = self.bar.format_dict["elapsed"]
        rate = f", {generated / elapsed:.1f} tok/s" if elapsed > 0 else ""
        self.bar.set_postfix_str(f"{generated} tokens{rate}", refresh=False)
        self.bar.update(finished)  # (0 too: the postfix is redrawn at tqdm's own pace)

    def close(self) -> None:
        self.bar.close()
