"""Where a run's time went, from an engine's step log (issue 23: served against offline).

A step log is `EngineCore.step_log` (offline) or the JSON lines `rlt serve` writes with
`RLT_STEP_LOG=PATH` (docs/configuration.md): one record per step with its prompt tokens, decode
ticks and rows, tokens made, the host clock (time.perf_counter, one clock for every process of
the machine) of its scheduling, submission and results, and on CUDA its device time and the
device's idle time before it.

`summarize(records, start_s, end_s)` covers the steps scheduled in [start_s, end_s) (a
benchmark phase's window on the same clock; `rlt bench serve` saves its start as
`started_perf_counter_s`), the gap before the first of them left out of its device and idle
time:

    before_first_step_s / after_last_result_s   the window's start to the first step's
                    scheduling, the last step's results to the window's end

    device_busy_s   device time of the steps, idle gaps excluded
    device_idle_s   gaps before the steps in which the device had nothing to run
    between_steps_s host time from collecting step n to scheduling step n + 2 (outputs sent,
                    messages read: what the core does outside the engine's step)
    prefill_steps / decode_steps   steps that computed prompt tokens / only decoded, each with
                    its count, device seconds, tokens made and mean decode ticks and rows

    python3 benchmarks/step_timeline.py served.jsonl [--start S --end S]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from harness import parser


def _get(record, name: str):
    return record[name] if isinstance(record, dict) else getattr(record, name)


def _replace(record, **fields):
    if isinstance(record, dict):
        return record | fields
    import dataclasses

    return dataclasses.replace(record, **fields)


def _kind(records: list) -> dict:
    device = [_get(r, "device_s") for r in records if _get(r, "device_s") is not None]
    idle = [_get(r, "device_idle_s") or 0.0 for r in records]
    busy = [d - i for d, i in zip(device, idle, strict=False)]
    return {
        "steps": len(records),
        "device_s": round(sum(device), 4),
        "device_busy_s": round(sum(busy), 4),
        "device_idle_s": round(sum(idle), 4),
        "generated": sum(_get(r, "generated") for r in records),
        "prefill_tokens": sum(_get(r, "prefill_tokens") for r in records),
        "mean_decode_ticks": round(statistics.fmean(_get(r, "decode_ticks") for r in records), 3)
        if records
        else 0.0,
        "mean_decode_rows": round(statistics.fmean(_get(r, "decode_rows") for r in records), 2)
        if records
        else 0.0,
        "median_busy_ms": round(1000 * statistics.median(busy), 3) if busy else None,
    }


def summarize(records, start_s: float | None = None, end_s: float | None = None) -> dict:
    """The steps scheduled in [start_s, end_s): device busy and idle seconds, and the same
    split by steps that computed prompt tokens and steps that only decoded."""
    chosen = [
        r
        for r in records
        if (start_s is None or _get(r, "scheduled_s") >= start_s)
        and (end_s is None or _get(r, "scheduled_s") < end_s)
    ]
    if not chosen:
        return {"steps": 0}
    first, last = _get(chosen[0], "scheduled_s"), _get(chosen[-1], "done_s")
    if start_s is not None:  # the first step's gap began before the window (an idle core)
        head = chosen[0]
        gap = _get(head, "device_idle_s") or 0.0
        busy = None if _get(head, "device_s") is None else _get(head, "device_s") - gap
        chosen = [_replace(head, device_s=busy, device_idle_s=0.0), *chosen[1:]]
    idle = [_get(r, "device_idle_s") or 0.0 for r in chosen]
    host_lead = [_get(r, "submitted_s") - _get(r, "scheduled_s") for r in chosen]
    # The core collects step n, then (front end, messages) schedules step n + 2 (n + 1 is in
    # flight): the host time between them is spent outside the engine's step.
    outside = [
        max(0.0, _get(later, "scheduled_s") - _get(earlier, "done_s"))
        for earlier, later in zip(chosen, chosen[2:], strict=False)
    ]
    summary = {
        "window_s": round((end_s or last) - (start_s or first), 4),
        "first_step_to_last_result_s": round(last - first, 4),
        "before_first_step_s": round(first - start_s, 4) if start_s is not None else None,
        "after_last_result_s": round(end_s - last, 4) if end_s is not None else None,
        **_kind(chosen),
        "idle_gaps_over_1ms": sum(1 for i in idle if i > 1e-3),
        "largest_idle_gaps_ms": sorted((round(1000 * i, 2) for i in idle), reverse=True)[:8],
        "schedule_and_submit_s": round(sum(host_lead), 4),
        "between_steps_s": round(sum(outside), 4),
        "largest_between_steps_ms": sorted((round(1000 * o, 2) for o in outside), reverse=True)[:8],
        "prefill_steps": _kind([r for r in chosen if _get(r, "prefill_tokens")]),
        "decode_steps": _kind([r for r in chosen if not _get(r, "prefill_tokens")]),
    }
    return summary


def load(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def main(argv=None) -> None:
    p = parser(__doc__, out=False)
    p.add_argument("log", help="JSON lines written by RLT_STEP_LOG")
    p.add_argument("--start", type=float, default=None)
    p.add_argument("--end", type=float, default=None)
    args = p.parse_args(argv)
    print(json.dumps(summarize(load(args.log), args.start, args.end), indent=1))


if __name__ == "__main__":
    main()
