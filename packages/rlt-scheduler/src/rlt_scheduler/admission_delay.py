"""`AdmissionDelay`: hold new prompts back briefly so that prompts arriving together start
together (`SchedulerConfig.scheduler_delay_factor`, after vLLM's `scheduler_delay_factor`).

Why: a served request arrives after its own HTTP round trip, a few ms after the one before.
Admitted at once, each prompt makes its own step, and a step that computes a prompt runs few
decode ticks (`tick_policy.decode_ticks`), so the decoding rows crawl. Waiting a fraction of a
prompt step gathers the arrivals of that window into one step, and the steps in between decode
at full length.

Rule (factor F > 0): while any request runs, the waiting requests are admitted only once the
oldest of them waited at least F x `prompt_step_s`, the duration of the latest step that
computed prompt tokens; with nothing running they are admitted at once (no decode to protect).
Priority preemption waits with admission: it only serves an admission.

`prompt_step_s` is measured on the host's monotonic clock when the step's results are
applied: from when the device could start it (the later of its scheduling and the application
of the step before it, which the device ran first) to the application of its own results. With
the engine one step ahead this is the step's device time plus a read-back; on a synchronous
engine it is schedule -> execute -> apply.

State (R02): only the scheduler calls this object; it owns the schedule times of the submitted
steps that compute prompts and the latest measurement. With F = 0 it records nothing and never
holds (the scheduler does not even read the clock for it).
"""

from __future__ import annotations


class AdmissionDelay:
    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.prompt_step_s = 0.0  # duration of the latest applied step that computed prompts
        self._prompt_steps: dict[int, float] = {}  # step id -> when it was scheduled
        self._last_applied: float | None = None  # when the previous step's results were applied

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def step_scheduled(self, step_id: int, *, computes_prompts: bool, now: float) -> None:
        """A step was scheduled at `now` (monotonic seconds)."""
        if computes_prompts:
            self._prompt_steps[step_id] = now

    def step_applied(self, step_id: int, *, now: float) -> None:
        """The results of step `step_id` were applied at `now`."""
        scheduled = self._prompt_steps.pop(step_id, None)
        if scheduled is not None:
            started = scheduled
            if self._last_applied is not None:
                started = max(scheduled, self._last_applied)
            self.prompt_step_s = max(now - started, 0.0)
        self._last_applied = now

    def holds(self, oldest_queued: float | None, *, anything_running: bool, now: float) -> bool:
        """Whether admission waits in the step scheduled at `now`: requests run and the oldest
        waiting request (queued at `oldest_queued`; None: nobody waits) waited less than
        factor x `prompt_step_s`."""
        if not self.enabled or not anything_running or oldest_queued is None:
            return False
        return now - oldest_queued < self.factor * self.prompt_step_s
