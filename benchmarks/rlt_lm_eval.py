"""lm-evaluation-harness's command line with one more model, `rlt-completions`:
`local-completions` plus rlt's loop fields (`exit_threshold`, `min_loops`, `max_loops` as model
arguments) on every request and `score_at_exit_depth: true` on the loglikelihood and
loglikelihood_rolling ones, so each scored token is scored at its own exit depth
(docs/evaluation.md). Run it in place of `lm-eval`:

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 uv run python benchmarks/rlt_lm_eval.py run \\
        --model rlt-completions --model_args ARGS,exit_threshold=0.7 \\
        --include_path TASKS --tasks YOUR_TASKS

(ARGS: local-completions' own model arguments, as in docs/evaluation.md.)

Importing this module registers the model (tests/test_lm_eval_harness.py,
benchmarks/heldout_cloze.py); lm-eval (the workspace's `dev` group) must be installed.
"""

from __future__ import annotations

from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalCompletionsAPI


@register_model("rlt-completions")
class RltCompletions(LocalCompletionsAPI):
    def __init__(self, exit_threshold=None, min_loops=None, max_loops=None, **kwargs):
        super().__init__(**kwargs)
        loops = dict(exit_threshold=exit_threshold, min_loops=min_loops, max_loops=max_loops)
        self.loop_fields = {k: v for k, v in loops.items() if v is not None}

    def _create_payload(self, messages, generate=False, gen_kwargs=None, **kwargs):
        payload = super()._create_payload(
            messages, generate=generate, gen_kwargs=gen_kwargs, **kwargs
        )
        payload.update(self.loop_fields)
        if not generate:  # loglikelihood and loglikelihood_rolling requests
            payload["score_at_exit_depth"] = True
        return payload


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
