"""The scheduler's side of structured output, against scripted results (no device, no grammar
library): token masks go out only when no step in flight can sample for the request, output
bounds follow one token per mask, the matcher consumes exactly the recorded outputs, and the
grammar's end, a rejected token and an abort finish the request and drop its matcher."""

from __future__ import annotations

import pytest
from rlt_contracts import (
    FinishReason,
    GeneratedTokens,
    InvalidRequestError,
    ModelRunnerOutput,
    PrefillProgress,
    SamplingParams,
    SchedulerConfig,
    StructuredOutput,
)
from rlt_scheduler import Scheduler
from scheduler_harness import CountingKV

SPEC = StructuredOutput(kind="regex", regex="[ab]+", field="guided_regex")


class FakeConstraint:
    """Accepts tokens 1 and 2; terminates on token 0 (EOS) once at least one was accepted."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.masks = 0

    def allowed_token_bitmask(self) -> bytes:
        self.masks += 1
        return bytes([len(self.accepted) % 256]) + bytes(3)

    def accept_token(self, token_id: int) -> bool:
        if token_id not in (0, 1, 2) or (token_id == 0 and not self.accepted):
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == 0


class FakeCompiler:
    def __init__(self) -> None:
        self.built: list[FakeConstraint] = []

    def compile(self, spec: StructuredOutput) -> FakeConstraint:
        self.built.append(FakeConstraint())
        return self.built[-1]


def make(compiler=None, **config) -> Scheduler:
    return Scheduler(
        SchedulerConfig(**config),
        CountingKV(1000, 4, 4),
        model_depth=4,
        vocab_size=1000,
        max_model_len=256,
        eos_token_ids=(0,),
        constraint_compiler=compiler,
    )


def tokens(step, identity, index, *ids) -> ModelRunnerOutput:
    depths = (4,) * len(ids)
    return ModelRunnerOutput(
        step.step_id,
        generated=(
            GeneratedTokens(
                identity=identity,
                first_output_index=index,
                token_ids=tuple(ids),
                exit_depths=depths,
            ),
        ),
    )


def test_masks_go_out_one_per_token_and_never_to_two_steps_in_flight():
    compiler = FakeCompiler()
    scheduler = make(compiler)
    request = scheduler.add_request(
        "r", [5, 6], SamplingParams(max_tokens=10, structured_output=SPEC)
    )
    assert request.rule.one_output_per_step
    constraint = compiler.built[0]

    step0 = scheduler.schedule()  # the completing chunk: token 0 under the first mask
    assert [m.identity for m in step0.token_masks] == [request.identity]
    assert request.unconfirmed_tokens == 1  # token 0 only: the row holds after it
    step1 = scheduler.schedule()  # pipelined: token 0 is not read back yet
    assert step1.token_masks == () and request.unconfirmed_tokens == 1
    first = ModelRunnerOutput(
        step0.step_id,
        generated=(
            GeneratedTokens(
                identity=request.identity, first_output_index=0, token_ids=(1,), exit_depths=(4,)
            ),
        ),
        prefill_progress=(PrefillProgress(request.identity, 2),),
    )
    scheduler.update_from_output(first)
    assert constraint.accepted == [1] and not request.mask_sent
    step2 = scheduler.schedule()  # token 1's mask, although step 1 is still in flight
    assert [m.identity for m in step2.token_masks] == [request.identity]
    assert step2.token_masks[0].words == bytes([1, 0, 0, 0])  # computed after token 0
    scheduler.update_from_output(ModelRunnerOutput(step1.step_id, decode_ticks=step1.decode_ticks))
    step3 = scheduler.schedule()  # token 1 not read back: no new mask, no output bound
    assert step3.token_masks == ()
    assert request.unconfirmed_tokens == 1  # step 2's bound of 1, step 3 adds none
    scheduler.update_from_output(tokens(step2, request.identity, 1, 2))
    scheduler.update_from_output(ModelRunnerOutput(step3.step_id, decode_ticks=step3.decode_ticks))
    step4 = scheduler.schedule()
    assert len(step4.token_masks) == 1
    scheduler.update_from_output(tokens(step4, request.identity, 2, 0))  # EOS: grammar done
    assert constraint.accepted == [1, 2, 0]
    [delta] = [d for d in scheduler.take_outputs() if d.finished]
    assert delta.finish_reason is FinishReason.STOP and delta.token_ids == (1, 2, 0)
    assert request.constraint is None  # the matcher went with the request


def test_the_grammar_ending_without_a_stop_token_finishes_with_stop():
    class EndsAfterOne(FakeConstraint):
        def is_terminated(self) -> bool:
            return len(self.accepted) == 1

    class Compiler(FakeCompiler):
        def compile(self, spec):
            return EndsAfterOne()

    scheduler = make(Compiler())
    request = scheduler.add_request(
        "r", [5], SamplingParams(max_tokens=10, structured_output=SPEC, ignore_eos=True)
    )
    step = scheduler.schedule()
    result = ModelRunnerOutput(
        step.step_id,
        generated=(
            GeneratedTokens(
                identity=request.identity, first_output_index=0, token_ids=(2,), exit_depths=(4,)
            ),
        ),
        prefill_progress=(PrefillProgress(request.identity, 1),),
    )
    scheduler.update_from_output(result)
    assert request.finish_reason is FinishReason.STOP


def test_a_token_the_grammar_rejects_aborts_the_request_with_the_error():
    scheduler = make(FakeCompiler())
    request = scheduler.add_request("r", [5], SamplingParams(max_tokens=10, structured_output=SPEC))
    step = scheduler.schedule()
    result = ModelRunnerOutput(
        step.step_id,
        generated=(
            GeneratedTokens(
                identity=request.identity, first_output_index=0, token_ids=(7,), exit_depths=(4,)
            ),
        ),
        prefill_progress=(PrefillProgress(request.identity, 1),),
    )
    scheduler.update_from_output(result)
    assert request.finish_reason is FinishReason.ABORT
    assert "violates the grammar" in request.error
    assert request.identity in scheduler.pending_releases()


def test_abort_drops_the_matcher_and_unconstrained_requests_are_unchanged():
    compiler = FakeCompiler()
    scheduler = make(compiler)
    constrained = scheduler.add_request("c", [5], SamplingParams(structured_output=SPEC))
    free = scheduler.add_request("f", [5], SamplingParams(max_tokens=10))
    assert free.constraint is None and not free.rule.one_output_per_step
    scheduler.schedule()
    scheduler.abort_request("c")
    assert constrained.constraint is None


def test_without_a_compiler_structured_requests_are_invalid_naming_their_field():
    scheduler = make(None)
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_request("r", [5], SamplingParams(structured_output=SPEC))
    assert error.value.field == "guided_regex"
    assert not scheduler.has_unfinished_requests()
