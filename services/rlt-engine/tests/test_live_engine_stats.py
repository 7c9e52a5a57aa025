"""Live engine statistics (issue 41): the engine core's periodic INFO line of throughput,
queue, KV use, prefix hits and loop mix (`rlt.engine.stats_log`).

- the line's arithmetic on `EngineStats` windows (the issue's example, n/a cases, extras);
- its windows on a clock the test moves: a line per interval while work goes on, one line for
  the window in which work ended (written once its time comes, by an idle tick), none while
  idle, rates over the busy span;
- the scheduler's loop-mix counters against the exit depths a real engine returned;
- `rlt serve` as a process under load with `--log-level warning` and two front ends: at least
  two lines, each from the one engine core, with throughput and loop mix, a last line once the
  burst ended, then silence; `--disable-log-stats` and an in-process server (the thread
  transport) for on/off; `rlt pd serve`: each instance logs its own lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import time

import httpx2
import pytest
from rlt import LLM, SamplingParams
from rlt.cli import build_parser, engine_config_from_args
from rlt.engine.assembly import DEFAULT_MODEL_DIR
from rlt.engine.stats_log import StatsLog, StatsSample, stats_line
from rlt_contracts import ConfigurationError, EngineStats
from serving_harness import free_port, run_server, start_serve_process, wait_ready

STATS_LOGGER = "rlt.engine.stats"
LINE = re.compile(
    r"\[(?P<process>[\w-]+)\]: engine: prompt throughput (?P<prompt>[\d,.]+) tok/s, "
    r"generation throughput (?P<generation>[\d,.]+) tok/s, (?P<running>\d+) running, "
    r"(?P<waiting>\d+) waiting, KV (?P<kv>\d+)%, prefix hits (?:n/a|\d+%), "
    r"loops per token (?P<loops>n/a|[\d.]+)(?: \((?P<early>\d+)% exited early\))?"
)

# -- the line ------------------------------------------------------------------------------------


def sample(decoded=0, early=0, **stats) -> StatsSample:
    return StatsSample(EngineStats(**stats), decoded, early)


def test_the_line_is_the_issues_example_from_two_samples():
    before = sample(
        decoded=45,
        early=20,
        prompt_tokens=100,
        generation_tokens=50,
        decode_loops=120,
        prefix_cache_hit_tokens=10,
        prefix_cache_queried_tokens=40,
    )
    after = sample(
        decoded=45 + 1000,
        early=20 + 580,
        running_requests=12,
        waiting_requests=0,
        kv_blocks_total=100,
        kv_blocks_used=31,
        prompt_tokens=100 + 1624,
        generation_tokens=50 + 3808,
        decode_loops=120 + 2600,
        prefix_cache_hit_tokens=10 + 40,
        prefix_cache_queried_tokens=40 + 100,
    )
    assert stats_line(before, after, 2.0) == (
        "engine: prompt throughput 812 tok/s, generation throughput 1,904 tok/s, 12 running, "
        "0 waiting, KV 31%, prefix hits 40%, loops per token 2.6 (58% exited early)"
    )


def test_the_line_says_n_a_without_lookups_or_decoded_tokens_and_adds_what_happened():
    quiet = stats_line(sample(), sample(prompt_tokens=7, running_requests=1), 2.0)
    assert quiet == (
        "engine: prompt throughput 3.5 tok/s, generation throughput 0.0 tok/s, 1 running, "
        "0 waiting, KV n/a, prefix hits n/a, loops per token n/a"
    )
    busy = stats_line(
        sample(preemptions=2, spec_draft_tokens=10, spec_accepted_tokens=5),
        sample(
            decoded=4,
            decode_loops=8,
            preemptions=5,
            spec_draft_tokens=30,
            spec_accepted_tokens=20,
            kv_blocks_total=8,
            kv_blocks_used=8,
        ),
        1.0,
    )
    assert busy.endswith(
        "KV 100%, prefix hits n/a, loops per token 2.0 (0% exited early), 3 preempted, "
        "drafts accepted 75%"
    )


# -- the windows ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_line_per_interval_while_busy_one_for_the_window_work_ended_in_then_none(caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    clock = Clock()
    counters = {"generation_tokens": 0}

    def read() -> StatsSample:
        return sample(**counters)

    log = StatsLog(read, 1.0, clock=clock)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]

    assert log.seconds_until_due(0.0) is None  # no window before any work
    log.idle_tick(50.0)
    assert lines() == []

    clock.now = 10.0
    log.step_starting()  # the window opens when work starts, not at construction
    counters["generation_tokens"] = 40
    log.step_done(10.4, idle=False)
    assert lines() == [] and log.seconds_until_due(10.4) == pytest.approx(0.6)
    counters["generation_tokens"] = 100
    log.step_done(11.0, idle=False)  # due: the whole second was busy
    assert lines()[-1].startswith("engine: prompt throughput 0.0 tok/s, generation throughput 100")

    log.step_starting()  # the window goes on from 11.0
    counters["generation_tokens"] = 150
    log.step_done(11.5, idle=True)  # work ended before the line is due
    assert len(lines()) == 1 and log.seconds_until_due(11.5) == pytest.approx(0.5)
    log.idle_tick(11.9)
    assert len(lines()) == 1
    log.idle_tick(12.0)  # the transport woke the idle loop: the ended window's line
    assert len(lines()) == 2
    # 50 tokens over the 0.5 s of work, not over the 1 s interval
    assert "generation throughput 100 tok/s" in lines()[-1]
    assert log.seconds_until_due(12.0) is None
    log.idle_tick(30.0)
    assert len(lines()) == 2  # nothing while idle

    clock.now = 40.0
    log.step_starting()  # work again: a new window from now
    log.step_done(40.2, idle=True)
    log.idle_tick(41.0)
    assert len(lines()) == 3 and "generation throughput 0.0 tok/s" in lines()[-1]


# -- the scheduler's loop-mix counters -----------------------------------------------------------


def test_decoded_tokens_and_early_exits_match_the_returned_exit_depths():
    params = [
        SamplingParams(max_tokens=12, exit_threshold=0.5, min_loops=1, ignore_eos=True),
        SamplingParams(max_tokens=9, exit_threshold=1.0, ignore_eos=True),  # fixed depth
        SamplingParams(max_tokens=10, exit_threshold=0.5, max_loops=3, ignore_eos=True),
    ]
    with LLM(dtype="float32", device="cpu") as llm:
        depth = llm.engine.model_info().default_loops or llm.engine.model_info().num_loops
        outputs = llm.generate(["It is a truth", "My dear Emma,", "The river"], params)
        decoded, early = llm.engine.core.loop_mix()
        stats = llm.get_stats()
    max_loops = [depth, depth, 3]
    depths = [output.exit_depths[1:] for output in outputs]
    assert decoded == sum(len(d) for d in depths) == 11 + 8 + 9
    assert early == sum(x < cap for d, cap in zip(depths, max_loops, strict=True) for x in d)
    assert stats.decode_loops == sum(sum(d) for d in depths)
    assert all(x == depth for x in depths[1])  # fixed depth never exits early
    assert 0 < early  # the gate at 0.5 lets some tokens leave before the last loop


# -- the command line ----------------------------------------------------------------------------


def test_the_flags_reach_the_engine_config_and_a_bad_interval_is_refused():
    args = build_parser().parse_args(["serve", "--stats-interval", "2.5", "--disable-log-stats"])
    config = engine_config_from_args(args)
    assert (config.stats_interval_s, config.log_stats) == (2.5, False)
    config = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert (config.stats_interval_s, config.log_stats) == (10.0, True)  # vLLM's default
    for bad in ("0", "-1", "nan", "inf"):
        args = build_parser().parse_args(["serve", "--stats-interval", bad])
        with pytest.raises(ConfigurationError, match="stats_interval_s"):
            engine_config_from_args(args)


# -- servers -------------------------------------------------------------------------------------


def send_load(base_url: str, model: str, *, clients: int = 4, each: int = 3, tokens: int = 40):
    def one_client() -> None:
        with httpx2.Client(base_url=base_url, trust_env=False, timeout=120) as http:
            for _ in range(each):
                body = {"model": model, "prompt": "It is a truth universally acknowledged"}
                body.update(max_tokens=tokens, ignore_eos=True, exit_threshold=0.5, min_loops=1)
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text

    threads = [threading.Thread(target=one_client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class OutputLines:
    """A process's output lines, collected by a thread as they come."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(
            target=lambda: self.lines.extend(process.stdout), daemon=True
        )
        self._thread.start()

    def stats(self) -> list[re.Match]:
        return [m for line in list(self.lines) if (m := LINE.search(line))]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()


def test_rlt_serve_logs_the_cores_lines_under_load_whatever_the_log_level():
    port = free_port()
    flags = ("--log-level", "warning", "--stats-interval", "0.5", "--api-server-count", "2")
    process = start_serve_process(DEFAULT_MODEL_DIR, port, *flags)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}")
        output = OutputLines(process)
        send_load(f"http://127.0.0.1:{port}", "tiny")
        time.sleep(1.5)  # the line of the window in which the burst ended comes by then
        seen = output.stats()
        time.sleep(1.0)
        assert len(output.stats()) == len(seen), "lines while idle"
    finally:
        stop(process)
    assert len(seen) >= 2, "".join(output.lines)
    assert {m["process"] for m in seen} == {"core"}  # one engine core: no line per front end
    busy = [m for m in seen if int(m["running"]) > 0]
    assert len(busy) >= 2
    for m in busy:
        assert float(m["generation"].replace(",", "")) > 0
        assert 1.0 <= float(m["loops"]) <= 4.0 and 0 <= int(m["early"]) <= 100
    assert int(seen[-1]["running"]) == 0 and int(seen[-1]["kv"]) == 0  # the burst's end


@pytest.mark.parametrize("log_stats", [True, False])
def test_an_in_process_server_logs_the_end_of_a_short_burst_unless_disabled(caplog, log_stats):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    engine = {"stats_interval_s": 0.3, "log_stats": log_stats}
    with run_server(DEFAULT_MODEL_DIR, engine=engine) as server:
        send_load(server.base_url, "default_model", clients=2, each=1, tokens=6)
        time.sleep(0.8)  # the idle engine thread wakes for the line of its ended window
    lines = [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]
    if not log_stats:
        assert lines == []
        return
    assert lines and all(LINE.search(f"[t]: {line}") for line in lines)
    assert "0 running" in lines[-1]
    assert any(float(LINE.search(f"[t]: {x}")["generation"]) > 0 for x in lines)


@pytest.mark.slow
def test_pd_instances_each_log_their_own_lines():
    pytest.importorskip("nixl")
    port = free_port()
    command = [sys.executable, "-m", "rlt.cli", "pd", "serve", str(DEFAULT_MODEL_DIR)]
    command += ["--num-prefill", "1", "--num-decode", "1", "--port", str(port)]
    command += ["--device", "cpu", "--dtype", "float32", "--block-size", "4"]
    command += ["--num-kv-blocks", "256", "--stats-interval", "0.5"]  # an instance flag
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("RLT_API_KEY", None)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        output = OutputLines(process)
        wait_ready(process, f"http://127.0.0.1:{port}", timeout=180)
        send_load(f"http://127.0.0.1:{port}", "default_model")
        time.sleep(1.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(2)  # SIGINT: the coordinator stops its instances
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    by_instance: dict[str, list[re.Match]] = {}
    for line in output.lines:
        match = LINE.search(line)
        if match:
            by_instance.setdefault(line.split("]", 1)[0].lstrip("["), []).append(match)
    assert set(by_instance) == {"prefill-0", "decode-0"}, "".join(output.lines)
    assert any(float(m["prompt"].replace(",", "")) > 0 for m in by_instance["prefill-0"])
    decode = [m for m in by_instance["decode-0"] if m["loops"] != "n/a"]
    assert len(decode) >= 2 and all(1.0 <= float(m["loops"]) <= 4.0 for m in decode)
